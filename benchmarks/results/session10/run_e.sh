#!/bin/bash
# session 10 run e: dispatch with prepare_decode's new default ("lanes" bytes, decode in two parts):
# decode checks through dot_general; w4a16 / a4w4 prepared at M = 16 and 1 (fair and GPU time);
# where the lanes kernel's time goes (probe over K at M = 16)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 110 python benchmarks/gpu_check.py --decode-only --out /tmp/gcd > $OUT/e_gpu_check_decode.txt 2>&1
tail -1 $OUT/e_gpu_check_decode.txt; grep FAIL $OUT/e_gpu_check_decode.txt | cut -c1-300 | head -3
timeout 170 python benchmarks/gemm.py --decode-m 16,1 --layers none --only pallas-prepared --profile --out $OUT/gd > $OUT/e_gemm_decode.txt 2>&1
grep "timeline\|profile\|^\[" $OUT/e_gemm_decode.txt | head -24
timeout 120 python benchmarks/decode_probe.py --m 16 --out $OUT/probe > $OUT/e_probe.txt 2>&1
grep -v Warning $OUT/e_probe.txt | head -14
