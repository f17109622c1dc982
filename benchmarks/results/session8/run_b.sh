#!/bin/bash
# session 8 run b: the row-listing fix kernel on the GPU (gpu_check fp8), demo xl, its step profile
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
NT="--xla_gpu_enable_triton_gemm=false"
timeout 200 python benchmarks/gpu_check.py --fp8-only --out /tmp/gc > $OUT/b_gpu_check_fp8.txt 2>&1
tail -3 $OUT/b_gpu_check_fp8.txt
XLA_FLAGS=$NT timeout 130 python benchmarks/compile_time.py --size xl --recipes mxfp4 --flags notriton --data corpus --profile --timeout 120 > $OUT/b_step_xl.txt 2>&1
tail -4 $OUT/b_step_xl.txt
XLA_FLAGS=$NT timeout 300 python -m jax_mxfp4.demo --size xl --quiet --out $OUT/demo_xl > $OUT/b_demo_xl.txt 2>&1
tail -12 $OUT/b_demo_xl.txt
