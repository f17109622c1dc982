#!/bin/bash
# session 8 run d: gpu_check fp8 with the group-64 fix kernel; its cost curve; the decode timeline of a long program; demo xl
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
NT="--xla_gpu_enable_triton_gemm=false"
timeout 130 python benchmarks/gpu_check.py --fp8-only --out /tmp/gc > $OUT/d_gpu_check_fp8.txt 2>&1
tail -2 $OUT/d_gpu_check_fp8.txt
timeout 60 python benchmarks/fp8_fix.py --shapes 8192x16384x4096 --fractions 0.001,0.01,0.1 --groups 64 --profile --out /tmp/fx > $OUT/d_fix.txt 2>&1
grep "^| 8192" $OUT/d_fix.txt
timeout 50 python benchmarks/gemm.py --decode-m 16 --layers none --only pallas-prepared --profile --out /tmp/gd > $OUT/d_gemm_decode.txt 2>&1
grep "timeline\|decode 16" $OUT/d_gemm_decode.txt | head -8
XLA_FLAGS=$NT timeout 230 python -m jax_mxfp4.demo --size xl --quiet --out $OUT/demo_xl > $OUT/d_demo_xl.txt 2>&1
tail -9 $OUT/d_demo_xl.txt
