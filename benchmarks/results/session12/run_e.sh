#!/bin/bash
# session 12 run e (final code of the session): gpu_check --wgemm-only (every w4a16 route through
# dot_general: decode sizes, the large-tile kernel for prepared weights, two-pass for plain ones;
# every E8M0 byte on the large-tile kernel), then dot_general timed at 256..2048 rows: bf16, a plain
# weight (two-pass), a prepared weight (large-tile kernel)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
P=benchmarks/xla_dequant_probe.py
timeout 300 python benchmarks/gpu_check.py --wgemm-only --out $OUT/gc > $OUT/e_gpu_check_wgemm.txt 2>&1
grep "FAIL" $OUT/e_gpu_check_wgemm.txt | cut -c1-200 | head; tail -1 $OUT/e_gpu_check_wgemm.txt
timeout 200 python $P --shapes 1024x8192x8192,2048x8192x8192,512x8192x8192,256x8192x8192 --only bf16,pallas,pallas-prepared --out $OUT/t1 > $OUT/e_time.txt 2>&1; echo "time rc=$?"
grep -E "^ +[0-9]+x" $OUT/e_time.txt | cut -c1-250
cp $OUT/t1/xla_dequant_probe.json $OUT/e_time.json; cp $OUT/t1/xla_dequant_probe.png $OUT/e_time.png; cp $OUT/gc/*.json $OUT/e_gpu_check.json 2>/dev/null
rm -rf $OUT/t1 $OUT/gc
