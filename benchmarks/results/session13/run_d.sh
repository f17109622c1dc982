#!/bin/bash
# session 13 run d: gpu_check --wgemm-only on the final w4a16 code (run c's stopped at a check
# config of its own that cannot take a float32 output; that config removed)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 230 python benchmarks/gpu_check.py --wgemm-only --out $OUT/gc > $OUT/d_gpu_check_wgemm.txt 2>&1; echo "gpu_check rc=$?"
grep "FAIL" $OUT/d_gpu_check_wgemm.txt | cut -c1-200 | head; tail -1 $OUT/d_gpu_check_wgemm.txt
cp $OUT/gc/*.json $OUT/d_gpu_check.json 2>/dev/null; rm -rf $OUT/gc
