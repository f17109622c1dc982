#!/bin/bash
# session 12 run c: the large-tile kernel in dispatch (W4A16_TILES_MAX_ROWS, default_tiles_config):
# gpu_check --wgemm-only (routes through dot_general, every E8M0 byte on the kernel); then timed
# through dot_general with a plain weight (arranged per call) and a prepared one, beside bf16 and
# the two-pass route, at 1024 and 2048 rows; and at 256 / 512 rows the tilings side by side
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
P=benchmarks/xla_dequant_probe.py
timeout 300 python benchmarks/gpu_check.py --wgemm-only --out $OUT/gc > $OUT/c_gpu_check_wgemm.txt 2>&1
grep "PASS\|FAIL" $OUT/c_gpu_check_wgemm.txt | cut -c1-150 | tail -20; tail -1 $OUT/c_gpu_check_wgemm.txt
timeout 200 python $P --shapes 1024x8192x8192,2048x8192x8192 --only bf16,pallas,pallas-prepared,pallas-two-pass --out $OUT/t1 > $OUT/c_time.txt 2>&1; echo "time rc=$?"
grep -E "^ +[0-9]+x" $OUT/c_time.txt | cut -c1-250
timeout 200 python $P --shapes 256x8192x8192,512x8192x8192 --only bf16,pallas-prepared,pallas-two-pass,tiles-256x64-r,tiles-128x128-r --out $OUT/t2 > $OUT/c_time2.txt 2>&1; echo "time2 rc=$?"
grep -E "^ +[0-9]+x" $OUT/c_time2.txt | cut -c1-250
cp $OUT/t1/xla_dequant_probe.json $OUT/c_time.json; cp $OUT/t2/xla_dequant_probe.json $OUT/c_time2.json; cp $OUT/gc/*.json $OUT/c_gpu_check.json 2>/dev/null
rm -rf $OUT/t1 $OUT/t2 $OUT/gc
