#!/bin/bash
# session 9 run e: decode checks and figures with x and the output unpadded at M < 8 / M % 8 == 0
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 100 python benchmarks/gpu_check.py --decode-only --out /tmp/gcd > $OUT/e_gpu_check_decode.txt 2>&1
tail -1 $OUT/e_gpu_check_decode.txt; grep FAIL $OUT/e_gpu_check_decode.txt | cut -c1-400 | head -4
timeout 115 python benchmarks/gemm.py --decode-m 1,16 --layers none --only pallas-prepared --profile --out $OUT/gd > $OUT/e_gemm_decode.txt 2>&1
grep "timeline\|profile\|^\[" $OUT/e_gemm_decode.txt | head -24
