#!/bin/bash
# session 11 run g: after the review refactor of the decode's MLIR builders (same operations):
# gpu_check --decode-only
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 150 python benchmarks/gpu_check.py --decode-only --out $OUT/gc > $OUT/g_gpu_check_decode.txt 2>&1
grep "FAIL" $OUT/g_gpu_check_decode.txt | cut -c1-200 | head; tail -1 $OUT/g_gpu_check_decode.txt
