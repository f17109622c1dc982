#!/bin/bash
# session 8 run c: the fix kernel's cost curve; the xl step (per-step waits, timeline); flags over 30 real steps
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
NT="--xla_gpu_enable_triton_gemm=false"
timeout 170 python benchmarks/fp8_fix.py --shapes 8192x16384x4096,16384x4096x8192 --fractions 0,0.001,0.01,0.1 --groups 16,64 --profile --out $OUT/fix > $OUT/c_fix.txt 2>&1
tail -20 $OUT/c_fix.txt
XLA_FLAGS=$NT timeout 140 python benchmarks/compile_time.py --size xl --recipes mxfp4 --flags notriton --data corpus --profile --timeout 130 > $OUT/c_step_xl.txt 2>&1
grep -v "^      " $OUT/c_step_xl.txt | tail -8
XLA_FLAGS=$NT timeout 120 python benchmarks/fp8_flags.py --size xl --data corpus --steps 20 > $OUT/c_flags_xl.txt 2>&1
grep "step" $OUT/c_flags_xl.txt | tail -12
