#!/bin/bash
# session 11 run e: the two-pass w4a16 route with XLA's GEMM writing bfloat16 itself (run d: a
# separate 0.094 ms cast at 8192^3), against bf16, at 1024 and 8192 rows
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 300 python benchmarks/xla_dequant_probe.py --shapes 1024x8192x8192,8192x8192x8192 --only bf16,pallas,xla-int-cat --out $OUT/xdp > $OUT/e_xla_dequant.txt 2>&1
grep -v "Warning\|warn" $OUT/e_xla_dequant.txt | cut -c1-260 | tail -8
