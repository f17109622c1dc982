#!/bin/bash
# session 14 run a: the two-pass tiled quantize-to-FP8 kernel (issue 10): tiles timed and checked
# bit for bit on the device; the linear training step with the tiled passes against the default
# (rows: XLA transposes + the one-pass kernel), both keys, profiled; fused-vs-unfused step check
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 240 python benchmarks/train_step.py --kernel --one-pass 1 \
  --tiled 64x4w4,128x4w4,64x8w4,128x2w4,32x8w4,128x4w8,256x2w8,64x2w4 --out $OUT/kern > $OUT/a_kernel.txt 2>&1
grep "tiled\|copy\|XLA transpose\|fused rows RN rows=1\|check" $OUT/a_kernel.txt | head -70
timeout 300 python benchmarks/train_step.py --configs linear --check-fused \
  --variants mxfp4,mxfp4-tiled,mxfp4-rbg-key,mxfp4-rbg-key-tiled,mxfp4-nearest,mxfp4-nearest-tiled \
  --profile mxfp4,mxfp4-tiled --out $OUT/train > $OUT/a_train.txt 2>&1
grep "ratio\|^ *[0-9.]* ms  \|bit_identical\|identical\|error" $OUT/a_train.txt | head -60
