#!/bin/bash
# session 10 run f: a4w4 with the activation quantized inside every call (bf16 in, prepared weight)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 200 python benchmarks/gemm.py --decode-m 16,1 --layers none --only pallas-prepared-q,pallas-prepared --profile --out $OUT/gq > $OUT/f_gemm_decode_q.txt 2>&1
grep "timeline\|profile\|^\[" $OUT/f_gemm_decode_q.txt | head -30
