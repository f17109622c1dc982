#!/usr/bin/env bash
# Session 13: candidate formulations of the fused MXFP4 quantizer side by side with the same run's
# XLA copy, 16384x8192, every scale mode round-to-nearest (bf16 and float32) plus one
# even/stochastic row (uniforms generated in the kernel). Each variant is checked bit-exact against
# the reference on the device before it is timed (benchmarks/quantize.py --variants).
# Run from the repository root on the GPU machine; $OUT is the output folder. Budget: < 150 s of
# device time in all (each part under its own timeout, so one hang costs only that part).
#
# Variant names (benchmarks/quantize.py parse_variant), applied to the dtype's default tile:
#   base    today's kernel (bf16 32x128 w4, f32 2x2048 w8; grid rows, tile-wide flush branch)
#   cols    program id 0 walks the column tiles of a row band (sequential addresses, each row's
#           scale bytes completed by neighbouring programs)
#   always  per-element subnormal flush (no tile-wide min reduction across warps, no branch)
#   swar    bf16 only: inline PTX, two elements per 32-bit op (~10 instead of ~17 ops/element)
#   strided f32 only: even/odd elements by two stride-2 loads instead of a register split
#   RxCwW   tile override (rows x cols, num_warps)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results/session13/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > "$OUT/gpu.txt" 2>&1 || true

# 1. bfloat16, round to nearest, all four scale modes (~55 s)
timeout 62 python benchmarks/quantize.py --dtypes bfloat16 \
  --variants base,cols,always,cols+always,swar,swar+cols,swar+cols+16x256w4 \
  --out "$OUT" 2>&1 | tee "$OUT/bf16_log.txt"
echo "bf16 exit: ${PIPESTATUS[0]}" | tee -a "$OUT/bf16_log.txt"

# 2. float32, round to nearest, all four scale modes (~40 s)
timeout 48 python benchmarks/quantize.py --dtypes float32 \
  --variants base,cols,always,strided,strided+cols+always \
  --out "$OUT" 2>&1 | tee "$OUT/f32_log.txt"
echo "f32 exit: ${PIPESTATUS[0]}" | tee -a "$OUT/f32_log.txt"

# 3. one stochastic row per variant (even, uniforms in the kernel; swar does not apply) (~25 s)
mkdir -p "$OUT/stochastic"
timeout 32 python benchmarks/quantize.py --dtypes bfloat16 --modes even --stochastic \
  --variants base,cols+always \
  --out "$OUT/stochastic" 2>&1 | tee "$OUT/stochastic_log.txt"
echo "stochastic exit: ${PIPESTATUS[0]}" | tee -a "$OUT/stochastic_log.txt"
