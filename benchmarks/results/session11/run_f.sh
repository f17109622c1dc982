#!/bin/bash
# session 11 run f: the session's last code: gpu_check --wgemm-only (weight-stationary kernels,
# the two-pass route with float32 and bfloat16 output, the decode-size dispatch checks)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 380 python benchmarks/gpu_check.py --wgemm-only --out $OUT/gc > $OUT/f_gpu_check_wgemm.txt 2>&1
grep "PASS\|FAIL" $OUT/f_gpu_check_wgemm.txt | cut -c1-160 | tail -30; tail -1 $OUT/f_gpu_check_wgemm.txt
