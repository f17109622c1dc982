#!/bin/bash
# session 9 run b: table look-up decode ("pairs_lut", now the default for prepared weights) against
# "pairs"; decode checks and timing with it; fp8 checks with the word-parallel encode; 1024 rows fp8-prepared
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
NT="--xla_gpu_enable_triton_gemm=false"
timeout 170 python benchmarks/wgemm_mgpu_check.py --only "ks4 pairs bk512 st5 P,ks4 lut bk512 st5 P,ks4 lut bk512 st3 P" --budget 100 --preflight-timeout 60 --out $OUT/wg > $OUT/b_wgemm.txt 2>&1
grep "ok=False\|error\|kernel " $OUT/b_wgemm.txt | head -12
timeout 100 python benchmarks/gpu_check.py --decode-only --out /tmp/gcd > $OUT/b_gpu_check_decode.txt 2>&1
tail -1 $OUT/b_gpu_check_decode.txt; grep FAIL $OUT/b_gpu_check_decode.txt | head -3
timeout 75 python benchmarks/gemm.py --decode-m 16,1 --layers none --only pallas-prepared --profile --out /tmp/gd > $OUT/b_gemm_decode.txt 2>&1
grep "timeline\|^\[" $OUT/b_gemm_decode.txt | head -16
timeout 130 python benchmarks/gpu_check.py --fp8-only --out /tmp/gc > $OUT/b_gpu_check_fp8.txt 2>&1
tail -1 $OUT/b_gpu_check_fp8.txt; grep FAIL $OUT/b_gpu_check_fp8.txt | head -3
XLA_FLAGS=$NT timeout 80 python benchmarks/gemm.py --decode-m none --layers 1024x8192x8192 --fprop-only --only fp8-prepared,xla-fp8 --profile --out /tmp/gb > $OUT/b_gemm_1024.txt 2>&1
grep "^| fprop\|profile" $OUT/b_gemm_1024.txt
