#!/bin/bash
# session 14 run c: the linear training step, default (rows) mode against "sr", twice each in two
# processes (run b: 0.763x vs 0.752x, one sample each); the demo at --size xl with "sr" (first
# re-measure since session 8)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
NT="--xla_gpu_enable_triton_gemm=false"
for i in 1 2; do
  timeout 90 python benchmarks/train_step.py --configs linear --variants mxfp4,mxfp4-sr,mxfp4-rbg-key,mxfp4-rbg-key-sr \
    --out $OUT/train$i > $OUT/c_train$i.txt 2>&1
  grep "ratio" $OUT/c_train$i.txt
done
JAX_MXFP4_FUSED_TRAINING=sr XLA_FLAGS=$NT timeout 240 python -m jax_mxfp4.demo --size xl --quiet --out $OUT/demo_xl > $OUT/c_demo_xl.txt 2>&1
tail -9 $OUT/c_demo_xl.txt
