#!/bin/bash
# session 13 run a: the large-tile kernel's "natural" decode (a plain MXFP4Array weight, its bytes
# moved to the "pairs" order by warp shuffles): first checked alone (a hang costs its timeout),
# then dot_general timed at 256..2048 rows (bf16, plain weight -> natural decode, prepared weight,
# plain weight with the Mosaic routes off = two-pass) and
# gpu_check --wgemm-only (every w4a16 route; every E8M0 byte on the natural decode)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
P=benchmarks/xla_dequant_probe.py
timeout 90 python $P --shapes 1024x2048x1024,520x1024x512 --only tiles-n,tiles-128x128-r-n,pallas --check-only --out $OUT/c0 > $OUT/a_chk.txt 2>&1; echo "chk rc=$?"
grep -E "^ +[0-9]+x|bad|Error" $OUT/a_chk.txt | cut -c1-250
timeout 250 python $P --shapes 1024x8192x8192,2048x8192x8192,512x8192x8192,256x8192x8192 --only bf16,pallas,pallas-prepared,pallas-two-pass --out $OUT/t1 > $OUT/a_time.txt 2>&1; echo "time rc=$?"
grep -E "^ +[0-9]+x" $OUT/a_time.txt | cut -c1-250
cp $OUT/t1/xla_dequant_probe.json $OUT/a_time.json; cp $OUT/t1/xla_dequant_probe.png $OUT/a_time.png
timeout 230 python benchmarks/gpu_check.py --wgemm-only --out $OUT/gc > $OUT/a_gpu_check_wgemm.txt 2>&1; echo "gpu_check rc=$?"
grep "FAIL" $OUT/a_gpu_check_wgemm.txt | cut -c1-200 | head; tail -1 $OUT/a_gpu_check_wgemm.txt
cp $OUT/gc/*.json $OUT/a_gpu_check.json 2>/dev/null
rm -rf $OUT/t1 $OUT/gc $OUT/c0
