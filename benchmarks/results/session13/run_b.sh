#!/bin/bash
# session 13 run b: the "pairs" decode in the mask-multiply form (4 integer instructions per output
# instead of 6) with the one-multiply scale fold, so the "natural" decode (plain weights) runs
# quad transpose + folded pairs; dot_general timed at 256..2048 rows (bf16, plain weight ->
# natural decode, prepared weight), run a's natural kernel (nofold) beside it at 1024 rows, then
# gpu_check --wgemm-only on this code (every w4a16 route, every E8M0 byte on the natural decode)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
P=benchmarks/xla_dequant_probe.py
timeout 250 python $P --shapes 1024x8192x8192,2048x8192x8192,512x8192x8192,256x8192x8192 --only bf16,pallas,pallas-prepared,tiles-256x64-s4-r-nofold-n,tiles-256x128-s2-r-n --out $OUT/t1 > $OUT/b_time.txt 2>&1; echo "time rc=$?"
grep -E "^ +[0-9]+x|bad" $OUT/b_time.txt | cut -c1-250
cp $OUT/t1/xla_dequant_probe.json $OUT/b_time.json; cp $OUT/t1/xla_dequant_probe.png $OUT/b_time.png
timeout 230 python benchmarks/gpu_check.py --wgemm-only --out $OUT/gc > $OUT/b_gpu_check_wgemm.txt 2>&1; echo "gpu_check rc=$?"
grep "FAIL" $OUT/b_gpu_check_wgemm.txt | cut -c1-200 | head; tail -1 $OUT/b_gpu_check_wgemm.txt
cp $OUT/gc/*.json $OUT/b_gpu_check.json 2>/dev/null
rm -rf $OUT/t1 $OUT/gc
