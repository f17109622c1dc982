"""The MXFP4 element and scale formats: the one place that owns every bit-level rule.

Every backend (the XLA reference, Pallas kernels, the FFI handlers' Python side) encodes and
decodes through these functions, so the scale rule, the element rounding and the nibble packing
each live in exactly one place.

Sources:
- OCP Microscaling Formats (MX) v1.0: E2M1 elements (§5.3.3), E8M0 shared scale (§5.4.1),
  block size k = 32 (§5.1), conversion (§6.3).
- Scale rules in use: OCP §6.3 ("floor"), torchao ``ScaleCalculationMode`` (FLOOR/CEIL/EVEN/RCEIL),
  Quark ``even_round`` / AITER Triton ``dynamic_mxfp4_quant`` ("even"), NVIDIA cuBLAS/TE and
  PTX ``cvt.rp.ue8m0`` ("rceil").
- Nibble order: element 2i in bits 0-3, element 2i+1 in bits 4-7 (torchao ``pack_uint4``,
  AITER, hipBLASLt ``packData``, Triton ``tl.dot_scaled``).

All functions here are pure ``jax.numpy`` on whole arrays, usable eagerly, under ``jit`` and inside
Pallas kernel bodies.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

BLOCK_SIZE = 32
"""Elements per shared scale along the quantized axis (OCP MX v1.0 §5.1: k = 32 for MXFP4)."""

E2M1_MAX = 6.0
"""Largest E2M1 magnitude (OCP MX v1.0 §5.3.3: 1.5 x 2^2)."""

E2M1_EMAX = 2
"""Exponent of the largest normal E2M1 value (floor(log2 6)); OCP §6.3 subtracts it from amax's."""

E8M0_BIAS = 127
E8M0_NAN = 0xFF
E8M0_MAX_BYTE = 0xFE

FLOAT32_MIN_NORMAL = float(np.finfo(np.float32).tiny)  # 2^-126

SCALE_MODES = ("floor", "ceil", "even", "rceil")
ROUNDING_MODES = ("nearest", "stochastic")

# Round-to-nearest-even decision points on the E2M1 magnitude grid. A magnitude moves past the
# midpoint when it is greater than it, or equal to it and the upper neighbour has an even code
# (mantissa bit 0): 0.75 -> 1.0, 1.75 -> 2.0, 3.5 -> 4.0 round up; 0.25, 1.25, 2.5, 5.0 round down.
_RNE_STRICT = (0.25, 1.25, 2.5, 5.0)  # ties go down
_RNE_INCLUSIVE = (0.75, 1.75, 3.5)  # ties go up


def _f32_bits(x: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)


def _bits_f32(bits: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(bits.astype(jnp.uint32), jnp.float32)


def flush_subnormal_inputs(x: jax.Array) -> jax.Array:
    """Float32 view of ``x`` with float32 subnormals replaced by a zero of the same sign.

    XLA on CPU flushes float32 subnormals; GPUs do not. Testing the exponent bits (never a float
    comparison, which FTZ could change) makes every backend treat |x| < 2^-126 as zero.
    """
    bits = _f32_bits(x)
    is_subnormal = (bits & np.uint32(0x7F800000)) == 0
    return _bits_f32(jnp.where(is_subnormal, bits & np.uint32(0x80000000), bits))


# ----------------------------------------------------------------------------------- E8M0 scale


def e8m0_from_amax(amax: jax.Array, scale_mode: str) -> jax.Array:
    """Biased E8M0 byte (uint8) of the shared scale for finite block maxima ``amax`` (float32, >= 0).

    The byte is built with integer bit operations on the float32 encoding of ``amax``; a dtype
    cast to E8M0 rounds to the nearest power of two, which is none of these rules. With ``e`` the
    unbiased float32 exponent of amax and ``m`` its mantissa field, the unbiased scale exponent s is

    - ``"floor"`` (OCP MX v1.0 §6.3): ``s = e - 2``;
    - ``"ceil"``: ``s = e + [m != 0] - 2`` (= ceil(log2 amax) - 2);
    - ``"even"`` (Quark ``even_round``, AITER Triton, TE-ROCm): round amax to one mantissa bit
      half-up (``bits + 2^21``, drop the mantissa), then ``s = e' - 2``;
    - ``"rceil"`` (NVIDIA cuBLAS/TE, PTX ``cvt.rp``, torchao RCEIL): ``d = amax / 6`` correctly
      rounded in float32 (subnormal d included), ``s = ceil(log2 d)``.

    and the byte is ``clamp(s, -127, 127) + 127``. amax = 0 gives 0x00 in every mode. Callers
    handle NaN/Inf blocks (byte 0xFF) separately.
    """
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"scale_mode must be one of {SCALE_MODES}, got {scale_mode!r}")
    amax = amax.astype(jnp.float32)
    bits = _f32_bits(amax)
    exp_field = ((bits >> 23) & 0xFF).astype(jnp.int32)  # biased
    mant = bits & 0x7FFFFF
    if scale_mode == "floor":
        s = exp_field - 127 - E2M1_EMAX
    elif scale_mode == "ceil":
        s = exp_field + (mant != 0).astype(jnp.int32) - 127 - E2M1_EMAX
    elif scale_mode == "even":
        rounded = (bits + np.uint32(1 << 21)) & np.uint32(0xFF800000)
        s = ((rounded >> 23) & 0xFF).astype(jnp.int32) - 127 - E2M1_EMAX
    else:  # rceil
        return _rceil_byte(amax, bits, exp_field, mant)
    return (jnp.clip(s, -E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS).astype(jnp.uint8)


def _rceil_byte(amax, bits, exp_field, mant):
    # Normal d = RN(amax / 6) (amax >= 6 * 2^-126): the byte is d's biased exponent plus one when d
    # is not a power of two. Evaluated in integers, without the division (a GPU kernel's float
    # division may be approximate): with amax = M 2^(e-23), M in [2^23, 2^24), d = (M/3) 2^(e-24);
    # M/3 rounded to 24 bits is a power of two only for M = 3 * 2^22 (mantissa field 0x400000),
    # its exponent is e - 2 for M >= 3 * 2^22 and e - 3 below, so byte = e_biased - 2 + [m > 0x400000]
    # (checked against the float32 division in tests/test_fast_quantize.py).
    byte_normal = exp_field - 2 + (mant > 0x400000).astype(jnp.int32)
    # Subnormal d: FTZ would flush it, so round amax / 6 onto the 2^-149 grid in integers.
    # For amax < 6 * 2^-126 the exponent field is 1..3, so N = amax * 2^149 < 2^26 fits int32.
    n = (mant | 0x800000).astype(jnp.int32) << jnp.clip(exp_field - 1, 0, 2)
    n = jnp.where(exp_field == 0, 0, n)  # subnormal amax: callers flushed it to zero already
    q, r = n // 6, n % 6
    q = q + ((r > 3) | ((r == 3) & ((q & 1) == 1))).astype(jnp.int32)  # round half to even
    # d = q * 2^-149 <= 2^(b - 127)  <=>  q <= 2^(b + 22): b = max(0, ceil(log2 q) - 22).
    ceil_log2_q = 32 - lax.clz(jnp.maximum(q - 1, 0))
    byte_sub = jnp.where(q <= 1, 0, jnp.maximum(ceil_log2_q - 22, 0))
    small = amax < jnp.float32(E2M1_MAX * FLOAT32_MIN_NORMAL)
    byte = jnp.where(small, byte_sub, byte_normal)
    return jnp.clip(byte, 0, E8M0_MAX_BYTE).astype(jnp.uint8)


def as_scale_bytes(scales: jax.Array) -> jax.Array:
    """uint8 view of E8M0 scales given as ``float8_e8m0fnu`` or uint8 (bit-preserving)."""
    if scales.dtype == jnp.uint8:
        return scales
    if scales.dtype != jnp.float8_e8m0fnu:
        raise TypeError(f"scales must be float8_e8m0fnu or uint8, got {scales.dtype}")
    return lax.bitcast_convert_type(scales, jnp.uint8)


def as_e8m0(scale_bytes: jax.Array) -> jax.Array:
    """``float8_e8m0fnu`` view of uint8 scale bytes (bit-preserving, no rounding)."""
    return lax.bitcast_convert_type(scale_bytes.astype(jnp.uint8), jnp.float8_e8m0fnu)


def pow2_from_exponent(s: jax.Array) -> jax.Array:
    """2^s as float32 for integer s in [-126, 127], from bits (exact, normal)."""
    return _bits_f32(((s.astype(jnp.int32) + 127) << 23).astype(jnp.uint32))


# ----------------------------------------------------------------------------------- E2M1 codes


def e2m1_code_nearest(y: jax.Array) -> jax.Array:
    """4-bit E2M1 codes (uint8, 0..15) of float32 ``y``: round-half-to-even, saturating to ±6.

    ``y`` must be finite (blocks holding NaN/Inf are handled by the caller). The sign bit comes
    from ``y``'s bits, so -0.0 and values that round to zero keep their sign (code 0x8).
    """
    a = jnp.abs(y)
    mag = jnp.zeros(y.shape, jnp.uint8)
    for t in _RNE_STRICT:
        mag = mag + (a > t).astype(jnp.uint8)
    for t in _RNE_INCLUSIVE:
        mag = mag + (a >= t).astype(jnp.uint8)
    return mag | _sign_nibble(y)


def e2m1_code_stochastic(y: jax.Array, uniform: jax.Array) -> jax.Array:
    """4-bit E2M1 codes of float32 ``y`` rounded stochastically with ``uniform`` in [0, 1).

    Method: |y| lies between two neighbouring E2M1 magnitudes lo <= |y| < hi (spacing 0.5 below
    2, 1 in [2, 4), 2 in [4, 6]); it rounds up with probability (|y| - lo) / (hi - lo), so
    E[result] = y exactly for |y| <= 6 (unbiased). |y| > 6 saturates to 6 (biased; scale rules
    "even", "ceil" and "rceil" keep |y| <= 7, "floor" up to < 8). The spacing is a power of two, so
    lo and the fraction are exact in float32.
    """
    rounded = e2m1_stochastic_magnitude(jnp.abs(y), uniform)
    # `rounded` is on the grid, so nearest-rounding it is the identity on magnitudes; the sign
    # nibble comes from y's bits (-0.0 and negatives rounded to zero give code 0x8).
    return e2m1_code_nearest(rounded) | _sign_nibble(y)


def e2m1_stochastic_magnitude(a: jax.Array, uniform: jax.Array) -> jax.Array:
    """Stochastically rounded E2M1 magnitude (float32 on the grid {0, 0.5, ..., 6}) of ``a >= 0``.

    The rule of :func:`e2m1_code_stochastic`: with lo <= a < lo + step on the grid (step 0.5 below
    2, 1 in [2, 4), 2 from 4), a rounds up when ``uniform < (a - lo) / step``; saturates at 6.
    Divisions by the power of two ``step`` are multiplications by its exact reciprocal (same bits),
    and no float is negated, so it lowers to GPU kernels unchanged.
    """
    a = a.astype(jnp.float32)
    step = jnp.where(a < 2.0, 0.5, jnp.where(a < 4.0, 1.0, 2.0)).astype(jnp.float32)
    inv_step = jnp.where(a < 2.0, 2.0, jnp.where(a < 4.0, 1.0, 0.5)).astype(jnp.float32)
    lo = jnp.floor(a * inv_step) * step
    frac = (a - lo) * inv_step
    return jnp.minimum(jnp.where(uniform < frac, lo + step, lo), jnp.float32(E2M1_MAX))


def _sign_nibble(y: jax.Array) -> jax.Array:
    return ((_f32_bits(y) >> 28) & 0x8).astype(jnp.uint8)


def decode_e2m1(codes: jax.Array) -> jax.Array:
    """float32 values of 4-bit E2M1 codes (uint8 0..15), OCP MX v1.0 §5.3.3 (bit 3 the sign).

    Built elementwise from bits rather than with a table gather, so it fuses and shards like any
    elementwise op: exponent bits e = code[2:1], mantissa m = code[0]; e >= 1 gives
    2^(e-1) (1 + m/2), e = 0 gives m / 2; bit 3 is the sign.
    """
    c = codes.astype(jnp.uint32) & 0xF
    e, m = (c >> 1) & 3, c & 1
    normal = ((e + 126) << 23) | (m << 22)
    bits = jnp.where(e == 0, m * jnp.uint32(126 << 23), normal) | ((c & 8) << 28)
    return _bits_f32(bits)


# ----------------------------------------------------------------------------------- packing


def pack_nibbles(codes: jax.Array) -> jax.Array:
    """Pack 4-bit codes along the last axis: byte i = code[2i] | code[2i+1] << 4 (uint8).

    The last axis must be even; the result's last axis is half as long.
    """
    c = codes.astype(jnp.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return c[..., 0] | (c[..., 1] << 4)


def unpack_nibbles(data: jax.Array) -> jax.Array:
    """Inverse of :func:`pack_nibbles`: uint8 [..., n] -> 4-bit codes uint8 [..., 2n].

    Element j is byte j // 2 shifted right by 4 (j % 2): a broadcast and an elementwise shift, which
    XLA fuses with what follows (a ``stack`` of the two nibble arrays became a separate
    concatenate kernel)."""
    n2 = data.shape[-1] * 2
    rep = jnp.broadcast_to(data[..., None], (*data.shape, 2)).reshape(*data.shape[:-1], n2)
    shift = (lax.broadcasted_iota(jnp.uint8, rep.shape, rep.ndim - 1) & 1) << 2
    return (rep >> shift) & 0xF


def dequantize_blocks(codes: jax.Array, scale_bytes: jax.Array) -> jax.Array:
    """float32 values of E2M1 codes [..., nblocks, 32] times their E8M0 scales [..., nblocks].

    Decoded value = E2M1(code) x 2^(byte - 127) (OCP MX v1.0 §5.2); byte 0xFF makes the whole
    block NaN. Results below 2^-126 in magnitude (possible only for bytes 0x00 and 0x01) are
    flushed to a signed zero explicitly, so CPU (which flushes float32 subnormals) and GPUs (which
    do not) give the same bits. Every product that is kept is a normal float32 and exact.
    """
    return scale_e2m1_values(decode_e2m1(codes), scale_bytes)


def scale_e2m1_values(vals: jax.Array, scale_bytes: jax.Array) -> jax.Array:
    """The rule of :func:`dequantize_blocks` on E2M1 values already decoded (float32 [..., nb, 32],
    e.g. FP8 E4M3 codes that hold E2M1 values, :mod:`jax_mxfp4.kernels.fp8_fix`)."""
    b = scale_bytes.astype(jnp.int32)[..., None]
    # For byte 0 the scale 2^-127 is subnormal; use (v / 2) x 2^-126 instead (exact).
    factor = pow2_from_exponent(jnp.maximum(b, 1) - 127)
    v = jnp.where(b == 0, vals * 0.5, vals) * factor
    tiny = jnp.abs(vals) < pow2_from_exponent(jnp.clip(1 - b, -126, 2))  # |v| < 2^-126
    v = jnp.where(tiny, jnp.where(jnp.signbit(vals), -0.0, 0.0), v)
    return jnp.where(b == E8M0_NAN, jnp.nan, v).astype(jnp.float32)


def normal_range_blocks(data: jax.Array, scale_bytes: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Packed E2M1 ``data`` [..., K/2] and plain E8M0 ``scale_bytes`` [..., K/32] (uint8 or
    ``float8_e8m0fnu``) re-encoded so that no scale and no element is a float32 subnormal, with
    the values of :func:`dequantize_blocks` (signed zeros included): (data, scale bytes uint8).

    Why: the decoded value of byte 0x00 (2^-127) is a float32/bfloat16 subnormal, which hardware
    treats differently: XLA on CPU treats it as zero (every element of the block lost, though
    6 x 2^-127 is a normal float32), GPUs keep subnormal elements that the reference flushes. After
    this rewrite any decode gives the reference's values, flushing or not:
      - byte 0x00 -> 0x01 with each magnitude halved: 2, 3, 4, 6 -> 1, 1.5, 2, 3 (exact E2M1
        values, magnitude code c -> c - 2); magnitudes below 2 (subnormal, flushed by the
        reference) -> a zero of the same sign;
      - byte 0x01: magnitude 0.5 (2^-127, flushed by the reference) -> a zero of the same sign.
    Every other block is unchanged. Elementwise (XLA fuses it with what reads ``data``).
    """
    sb = as_scale_bytes(scale_bytes)
    nb = sb.shape[-1]
    b = jnp.repeat(sb, BLOCK_SIZE // 2, axis=-1, total_repeat_length=nb * (BLOCK_SIZE // 2))

    def nibble(n):  # n: 4-bit code in the low bits
        mag = n & 7
        mag = jnp.where(b == 0, jnp.where(mag >= 4, mag - 2, 0), jnp.where((b == 1) & (mag == 1), 0, mag))
        return (n & 8) | mag

    d = data.astype(jnp.uint8)
    out = nibble(d & 0xF) | (nibble(d >> 4) << 4)
    return out.astype(jnp.uint8), jnp.where(sb == 0, jnp.uint8(1), sb)


# ------------------------------------------------------------- kernel-friendly (Pallas/Triton)
# Variants of the decode rules above for Pallas kernel bodies, where a table gather does not
# lower to Triton. They are tested bit for bit against decode_e2m1 / dequantize_blocks
# (tests/test_pallas_gemm.py).


def e2m1_times_2pow_minus14(codes: jax.Array) -> jax.Array:
    """E2M1 value x 2^-14 of 4-bit codes (uint8 0..15), as float16, exactly and without a table.

    The magnitude bits (e1 e0 m) placed at float16 bits 11..9 give exponent field e and leading
    mantissa bit m: 2^(e-15)(1 + m/2) for e >= 1 and the subnormal m x 2^-15 for e = 0, which is
    E2M1(code) x 2^-14 in both cases (OCP MX v1.0 §5.3.3); the sign bit 3 moves to bit 15.
    """
    c = codes.astype(jnp.uint16)
    bits = ((c & 7) << 9) | ((c & 8) << 12)
    return lax.bitcast_convert_type(bits, jnp.float16)


def e2m1_magnitude_code(a: jax.Array) -> jax.Array:
    """E2M1 magnitude code (int32, 0..7) of float32 ``a >= 0``: the rule of
    :func:`e2m1_code_nearest` (round half to even, saturating at 6) in ~8 operations, no table.

    Per-binade magic add (torchao ``_f32_to_floatx_unpacked``): with
    e' = clamp(floor(log2 a), 0, 2), adding M = 2^(22 + e') makes the float32 adder round ``a`` to
    the E2M1 spacing 2^(e' - 1) of its binade, half to even; the code is the number of those
    steps above M plus 2e' (the codes below the binade), capped at 7. Non-finite ``a`` gives an
    unspecified code (callers zero NaN/Inf blocks). Sign handling is left to the caller (integer
    bit operations), so nothing here negates a float.
    """
    a = a.astype(jnp.float32)
    e = lax.bitcast_convert_type(jnp.minimum(jnp.maximum(a, 1.0), 4.0), jnp.int32) & 0x7F800000  # 2^e'
    m = lax.bitcast_convert_type(e, jnp.float32) * jnp.float32(2.0**22)  # 2^(22 + e'): exact, FP unit
    t = lax.bitcast_convert_type(a + m, jnp.int32)
    return jnp.minimum(t - lax.bitcast_convert_type(m, jnp.int32) + (e >> 22) - 254, 7)


def e2m1_nearest_magnitude(a: jax.Array) -> jax.Array:
    """The E2M1 magnitude (float32 on the grid {0, 0.5, ..., 6}) that :func:`e2m1_magnitude_code`
    encodes, for float32 ``0 <= a < 8`` (a block's elements over its shared scale): the same
    per-binade magic add, read back as a float (``(a + M) - M`` is exact: both terms lie within a
    factor 2 of each other), then saturated at 6. Fewer operations than a code and a decode, for
    kernels that need the value (the fused quantize-to-FP8 kernel's plain path)."""
    a = a.astype(jnp.float32)
    e = lax.bitcast_convert_type(jnp.minimum(jnp.maximum(a, 1.0), 4.0), jnp.int32) & 0x7F800000
    m = lax.bitcast_convert_type(e, jnp.float32) * jnp.float32(2.0**22)
    return jnp.minimum((a + m) - m, jnp.float32(E2M1_MAX))


def flush_below_normal(v: jax.Array) -> jax.Array:
    """float32 ``v`` with values below 2^-126 in magnitude replaced by a zero of the same sign
    (NaN and Inf kept): the flush of :func:`dequantize_blocks`, for decodes that compute
    E2M1 x 2^(b-127) in float32 arithmetic, where a GPU keeps the subnormal (bytes 0x00 and 0x01
    only) and the reference has zero. Written with a multiply by zero (the sign survives) and a
    select, which every kernel lowering takes."""
    return jnp.where(jnp.abs(v) < jnp.float32(FLOAT32_MIN_NORMAL), v * 0.0, v)


def scale_factors_for_f16_codes(scale_bytes: jax.Array, code_exponent: int = 14) -> tuple[jax.Array, jax.Array]:
    """Two float32 factors (f1, f2) per E8M0 byte with E2M1 x 2^-c x f1 x f2 = E2M1 x 2^(b-127).

    ``c = code_exponent``: 14 for :func:`e2m1_times_2pow_minus14` (float16 codes). Both factors
    are normal float32 powers of two (f1 = 2^c, f2 = 2^(b-127); for byte 0, f1 = 2^(c-1) and f2 = 2^-126), so each product is exact
    whenever the result is a normal float32. Byte 0xFF gives f2 = NaN (the whole block NaN).
    Results under 2^-126 (bytes 0x00/0x01 only) are subnormal, which a GPU keeps and the
    reference flushes: callers apply :func:`flush_below_normal` (the difference, below 2^-126 per
    element, is not small once multiplied by an operand near 2^127).
    """
    b = as_scale_bytes(scale_bytes).astype(jnp.int32)
    f1 = jnp.where(b == 0, jnp.float32(2.0 ** (code_exponent - 1)), jnp.float32(2.0**code_exponent))
    f2 = pow2_from_exponent(jnp.maximum(b, 1) - E8M0_BIAS)
    f2 = jnp.where(b == E8M0_NAN, jnp.float32(jnp.nan), f2)
    return f1, f2


def e8m0_to_bf16_bits(scale_bytes: jax.Array) -> jax.Array:
    """uint16 bits of the bfloat16 value 2^(b-127) for E8M0 bytes b (OCP MX v1.0 §5.4).

    bfloat16 has float32's exponent range, so every E8M0 value is exact: b in [1, 254] is the
    normal number with exponent field b (bits ``b << 7``), b = 0 (2^-127) the bfloat16 subnormal
    0x0040, and b = 0xFF (NaN) the quiet NaN 0x7FC0, which poisons the whole block on multiply.
    """
    b = as_scale_bytes(scale_bytes).astype(jnp.uint16)
    bits = b << 7
    bits = jnp.where(b == 0, jnp.uint16(0x0040), bits)
    return jnp.where(b == E8M0_NAN, jnp.uint16(0x7FC0), bits)


@functools.partial(jax.jit, static_argnames=("axis",))
def dequantize_packed(data, scale_bytes, *, axis):
    """E2M1(code) x 2^(scale byte - 127) per element, float32, from packed ``data`` (uint8, the
    logical shape with ``axis`` halved) and plain ``scale_bytes`` (uint8, ``axis`` divided by 32):
    :func:`unpack_nibbles` then :func:`dequantize_blocks` along ``axis``."""
    codes = unpack_nibbles(jnp.moveaxis(data, axis, -1))
    blocks = codes.reshape(*codes.shape[:-1], codes.shape[-1] // BLOCK_SIZE, BLOCK_SIZE)
    values = dequantize_blocks(blocks, jnp.moveaxis(scale_bytes, axis, -1))
    return jnp.moveaxis(values.reshape(codes.shape), -1, axis)
