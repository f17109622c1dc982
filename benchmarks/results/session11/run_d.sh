#!/bin/bash
# session 11 run d: w4a16 at 1024 and 8192 rows with the decode left to XLA inside one jitted
# function (can XLA fuse it into its GEMM?) against bf16 and today's "pallas" two-pass route;
# XLA's default flags (Triton GEMM fusions on)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 400 python benchmarks/xla_dequant_probe.py --shapes 1024x8192x8192,8192x8192x8192 --out $OUT/xdp > $OUT/d_xla_dequant.txt 2>&1
grep -v "Warning\|warn" $OUT/d_xla_dequant.txt | cut -c1-260 | tail -14
