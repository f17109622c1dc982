#!/bin/bash
# session 14 run b: training step with the fused kernel for dY's stochastic quantizations only
# ("sr": the round-to-nearest operands through the SWAR quantizer + encode kernel, 0.120 ms in run a
# against 0.185 for the one-pass kernel's first tile); fused checks of every mode; the MLP block
# config (d = 8192, hidden 4d); the demo at --size xl with the "sr" mode
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
NT="--xla_gpu_enable_triton_gemm=false"
timeout 200 python benchmarks/train_step.py --configs linear --check-fused \
  --variants mxfp4,mxfp4-sr,mxfp4-unfused,mxfp4-rbg-key,mxfp4-rbg-key-sr,mxfp4-nearest \
  --profile mxfp4-sr --out $OUT/train > $OUT/b_train.txt 2>&1
grep "ratio\|^ *[0-9.]* ms  \|identical\|error" $OUT/b_train.txt | head -60
timeout 150 python benchmarks/train_step.py --configs mlp --variants mxfp4,mxfp4-sr --out $OUT/mlp > $OUT/b_mlp.txt 2>&1
grep "ratio\|error" $OUT/b_mlp.txt | head
# JAX_MXFP4_FUSED_TRAINING=sr XLA_FLAGS=$NT timeout 230 python -m jax_mxfp4.demo --size xl --quiet --out $OUT/demo_xl > $OUT/b_demo_xl.txt 2>&1
# tail -9 $OUT/b_demo_xl.txt  (demo left out: device time lost to three refused starts)
