#!/bin/bash
# session 9 run f: the M = 1 decode figures run e's time limit cut (x and output unpadded at M < 8)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 140 python benchmarks/gemm.py --decode-m 1 --layers none --only pallas-prepared --profile --out $OUT/gd > $OUT/f_gemm_decode1.txt 2>&1
grep "timeline\|profile\|^\[" $OUT/f_gemm_decode1.txt | head -12
