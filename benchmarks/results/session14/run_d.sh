#!/bin/bash
# session 14 run d (last device minutes): the tiled kernel's bit-for-bit checks on the device in
# both layouts and every rounding (run a's were cut by its time limit); small shape: checks only
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 130 python benchmarks/train_step.py --kernel --one-pass 0 --tiled 64x4w4 --kernel-shape 2048x2048 \
  --out $OUT/kern > $OUT/d_kernel.txt 2>&1
grep "==" $OUT/d_kernel.txt
