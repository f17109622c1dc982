#!/bin/bash
# session 9 run d: checks of the merged flagged-row list launch (fp8) and of 8-row padding at M <= 8
# (decode); decode figures through dispatch at M = 16 and 1; training step
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 100 python benchmarks/gpu_check.py --decode-only --out /tmp/gcd > $OUT/d_gpu_check_decode.txt 2>&1
tail -1 $OUT/d_gpu_check_decode.txt; grep FAIL $OUT/d_gpu_check_decode.txt | cut -c1-300 | head -3
timeout 130 python benchmarks/gpu_check.py --fp8-only --out /tmp/gc > $OUT/d_gpu_check_fp8.txt 2>&1
tail -1 $OUT/d_gpu_check_fp8.txt; grep FAIL $OUT/d_gpu_check_fp8.txt | head -3
timeout 110 python benchmarks/gemm.py --decode-m 16,1 --layers none --only pallas-prepared --profile --out $OUT/gd > $OUT/d_gemm_decode.txt 2>&1
grep "timeline\|profile\|^\[" $OUT/d_gemm_decode.txt | head -24
timeout 70 python benchmarks/train_step.py --configs linear --variants mxfp4,mxfp4-rbg-key --profile mxfp4 --out $OUT/train > $OUT/d_train.txt 2>&1
grep "ratio\|^ *[0-9.]* ms  " $OUT/d_train.txt | head -16
