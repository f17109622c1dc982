#!/bin/bash
# session 12 run d: a plain (not prepared) weight at many rows through the large-tile kernel's
# "pairs" decode (natural bytes, x permuted per call; run c's per-call prepare_decode cost 0.127 ms);
# gpu_check --wgemm-only (every route incl. every E8M0 byte on three tilings/orders), then timed
# beside bf16, the prepared weight and the two-pass route (the Mosaic switch off for that variant)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
P=benchmarks/xla_dequant_probe.py
timeout 300 python benchmarks/gpu_check.py --wgemm-only --out $OUT/gc > $OUT/d_gpu_check_wgemm.txt 2>&1
grep "PASS\|FAIL" $OUT/d_gpu_check_wgemm.txt | grep -i "tiles\|large-tile\|two-pass" | cut -c1-150 | tail -20; tail -1 $OUT/d_gpu_check_wgemm.txt
timeout 220 python $P --shapes 1024x8192x8192,2048x8192x8192 --only bf16,pallas,pallas-prepared,pallas-two-pass --out $OUT/t1 > $OUT/d_time.txt 2>&1; echo "time rc=$?"
grep -E "^ +[0-9]+x" $OUT/d_time.txt | cut -c1-250
cp $OUT/t1/xla_dequant_probe.json $OUT/d_time.json; cp $OUT/gc/*.json $OUT/d_gpu_check.json 2>/dev/null
rm -rf $OUT/t1 $OUT/gc
