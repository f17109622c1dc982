#!/usr/bin/env bash
# Session 13: what limits the fused MXFP4 quantizer (bf16 16384x8192 round-to-nearest ~0.61x of copy)?
# Run from the repository root on the GPU machine; $OUT is the output folder. Budget: < 120 s of
# device time in all, compiles included (bf16 part ~55 s, float32 part ~20 s; each under its own
# timeout). Writes 3 files: quant_probe_console.txt (every line of both parts, with the tables),
# quant_probe_bf16.json, quant_probe_f32.json.
#
# Variants (benchmarks/quantize.py parse_variant, applied to the dtype's default tile: bf16 32x128 w4,
# f32 2x2048 w8); every quantizer variant is checked bit-exact against the reference on the device
# first, the probes are NOT (they are not quantizers):
#   base        today's kernel
#   swar        bf16: inline PTX on 32-bit words, two elements per op (fixed: the asm returns signless
#               int8, bitcast to uint8; the last run failed to parse with a ui8 asm result)
#   cols        program id 0 walks the column tiles of a row band
#   probe       NOT a quantizer: the same grid, tiles, loads and stores with nearly no arithmetic
#               (packed byte = xor of the low bytes of the pair, scale byte 127): the data-movement
#               floor at that tiling. probe ~ base => memory/tiling limits; probe ~ copy => compute.
#   probe-amax  probe plus the per-block max reduction (scale byte = top byte of the block max)
#   RxCwW       tile override (rows x cols, num_warps), for base and probe
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results/session13/out}
mkdir -p "$OUT"
LOG="$OUT/quant_probe_console.txt"
TMP=$(mktemp -d)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > "$LOG" 2>&1 || true

# 1. bfloat16, floor and even, round to nearest (~55 s)
timeout 75 python benchmarks/quantize.py --dtypes bfloat16 --modes floor,even \
  --variants base,probe,swar,swar+cols,probe-amax,64x128w8,probe+64x128w8,16x512w4,probe+16x512w4,32x256w8,probe+32x256w8 \
  --out "$TMP/bf16" 2>&1 | tee -a "$LOG"
echo "bf16 exit: ${PIPESTATUS[0]}" | tee -a "$LOG"
cp "$TMP/bf16/quantize_variants_bfloat16.json" "$OUT/quant_probe_bf16.json" 2>/dev/null || echo "bf16: no JSON" | tee -a "$LOG"

# 2. float32, floor, round to nearest (~20 s)
timeout 35 python benchmarks/quantize.py --dtypes float32 --modes floor \
  --variants base,probe,probe-amax \
  --out "$TMP/f32" 2>&1 | tee -a "$LOG"
echo "f32 exit: ${PIPESTATUS[0]}" | tee -a "$LOG"
cp "$TMP/f32/quantize_variants_float32.json" "$OUT/quant_probe_f32.json" 2>/dev/null || echo "f32: no JSON" | tee -a "$LOG"
rm -rf "$TMP"
