#!/bin/bash
# session 9 run c: the flagged-row list kernel (exact_rows_index) checked and timed in context:
# fp8 checks, training step, 1024 and 8192^3 fp8-prepared; decode figures with the "pairs" default
# and the one-fusion activation dequantization; decode checks
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
NT="--xla_gpu_enable_triton_gemm=false"
timeout 130 python benchmarks/gpu_check.py --fp8-only --out /tmp/gc > $OUT/c_gpu_check_fp8.txt 2>&1
tail -1 $OUT/c_gpu_check_fp8.txt; grep FAIL $OUT/c_gpu_check_fp8.txt | head -3
timeout 90 python benchmarks/train_step.py --configs linear --profile mxfp4 --out $OUT/train > $OUT/c_train.txt 2>&1
grep "ratio\|^ *[0-9.]* ms  " $OUT/c_train.txt | head -16
XLA_FLAGS=$NT timeout 150 python benchmarks/gemm.py --decode-m none --layers 1024x8192x8192,8192x8192x8192 --fprop-only --only fp8-prepared,xla-fp8 --profile --out /tmp/gb > $OUT/c_gemm_big.txt 2>&1
grep "^| fprop\|profile" $OUT/c_gemm_big.txt
timeout 75 python benchmarks/gemm.py --decode-m 16,1 --layers none --only pallas-prepared --profile --out /tmp/gd > $OUT/c_gemm_decode.txt 2>&1
grep "timeline\|profile\|^\[" $OUT/c_gemm_decode.txt | head -20
timeout 100 python benchmarks/gpu_check.py --decode-only --out /tmp/gcd > $OUT/c_gpu_check_decode.txt 2>&1
tail -1 $OUT/c_gpu_check_decode.txt; grep FAIL $OUT/c_gpu_check_decode.txt | head -3
