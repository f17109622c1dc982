"""The FP8 form of MXFP4 rows, as rules on scale bytes: the window of block shifts for which
E2M1 x 2^d is an E4M3 value, the per-row exponent, the row flags, and which blocks the reference
decoding flushes or overflows. A leaf beneath :mod:`jax_mxfp4.fp8_prepared` (the encoding) and
:mod:`jax_mxfp4.kernels.fp8_encode` (its Pallas kernel), so both read one copy of each rule.
"""

from __future__ import annotations

import jax.numpy as jnp

from .mx_format import BLOCK_SIZE, E8M0_NAN, pow2_from_exponent

E4M3_D_MIN, E4M3_D_MAX = -8, 6
"""Shifts d for which E2M1 x 2^d is exactly a float8_e4m3fn value (2^-9 is E4M3's smallest
subnormal, 6 x 2^6 = 384 <= 448, its largest finite value)."""
WINDOW_SPAN = E4M3_D_MAX - E4M3_D_MIN  # 14 binades between the largest and smallest block scale
ROW_EXP_OFFSET = 127 + E4M3_D_MAX  # e = b_max - 133
EMPTY_ROW_BMAX = ROW_EXP_OFFSET  # a row with no nonzero block: e = 0 (any value would do)
FLAG_EXACT = 1  # row_flag bit 0: the row needs the exact path
FLAG_NAN = 2  # row_flag bit 1: the row holds a 0xFF scale byte (all its outputs are NaN)


def _block_shift(b, b_max, exact):
    """Per-block shift d (int32, clipped to [-8, 6]) from scale bytes ``b`` [..., nb], the row's
    b_max [..., 1] and its exact flag [..., 1]: the one rule used to encode and to decode."""
    d = jnp.where(exact, 0, b - b_max + E4M3_D_MAX)
    return jnp.clip(d, E4M3_D_MIN, E4M3_D_MAX)


def special_blocks(b, max_mag, min_nonzero_mag):
    """bool per block: does :func:`jax_mxfp4.mx_format.dequantize_blocks` (the reference
    decoding) turn one of its nonzero codes into a signed zero or into ±Inf?

    From the block's scale byte ``b`` and the largest / smallest nonzero E2M1 magnitude code
    (0..7; 8 = no nonzero code) alone, per block instead of per element. With v = E2M1 x
    2^(b - 127): v < 2^-126 (flushed) needs b = 0 and |E2M1| < 2 (codes 1..3) or b = 1 and
    |E2M1| < 1 (code 1); v >= 2^128 (Inf) needs b = 254 and |E2M1| >= 2 (codes >= 4) or b = 253
    and |E2M1| >= 4 (codes >= 6). Tested against dequantize_blocks for every byte and code
    (tests/test_fp8.py).
    """
    flushed = ((b == 0) & (min_nonzero_mag <= 3)) | ((b == 1) & (min_nonzero_mag == 1))
    overflow = ((b == 254) & (max_mag >= 4)) | ((b == 253) & (max_mag >= 6))
    return flushed | overflow


def check_packed_rows(data, scale_bytes) -> None:
    """Operands of :func:`encode_rows_on`: data uint8 [..., K/2] and E8M0 scales (uint8 bytes or
    float8_e8m0fnu) [..., K/32] with the same leading dims, K a multiple of 32 (OCP MX v1.0 §5:
    one scale per 32 elements; two E2M1 codes per byte).

    Raises:
      TypeError: a dtype other than those; ValueError: shapes that do not pair up.
    """
    if getattr(data, "dtype", None) != jnp.uint8:
        raise TypeError(f"data must be uint8 packed E2M1 pairs, got {getattr(data, 'dtype', type(data))}")
    if getattr(scale_bytes, "dtype", None) not in (jnp.uint8, jnp.float8_e8m0fnu):
        raise TypeError(f"scale_bytes: scales must be float8_e8m0fnu or uint8 E8M0 bytes, got "
                        f"{getattr(scale_bytes, 'dtype', type(scale_bytes).__name__)}")
    if (data.ndim < 1 or scale_bytes.shape[:-1] != data.shape[:-1] or (data.shape[-1] * 2) % BLOCK_SIZE
            or scale_bytes.shape[-1] != data.shape[-1] * 2 // BLOCK_SIZE):
        raise ValueError(f"data [..., K/2] and scale_bytes [..., K/32] with K % 32 == 0 expected, got "
                         f"{data.shape} and {scale_bytes.shape}")


def encode_blocks(sb, mag):
    """The row encoding rule (module docstring) from scale bytes and E2M1 magnitude codes.

    Args:
      sb: int32 scale bytes [..., nb]; mag: int32 E2M1 magnitude codes (0..7) [..., nb, 32].
    Returns:
      (d int32 [..., nb]: the shift of each block, row_exp int32 [...], row_flag uint8 [...]).
    Shared by :func:`encode_rows` and the fused kernel :mod:`jax_mxfp4.kernels.fp8_quantize`
    (written with max/min reductions only, which the Triton lowering takes).
    """
    max_mag = jnp.max(mag, axis=-1)
    min_nz = jnp.min(jnp.where(mag != 0, mag, 8), axis=-1)
    return encode_block_stats(sb, max_mag, min_nz)


def encode_block_stats(sb, max_mag, min_nz):
    """:func:`encode_blocks` from per-block statistics: scale bytes ``sb``, the largest E2M1
    magnitude code ``max_mag`` and the smallest nonzero one ``min_nz`` (8 = none), int32 [..., nb].

    Only :func:`special_blocks` reads ``min_nz``, and only for scale bytes 0 and 1; ``max_mag``
    decides which blocks count (nonzero) and, for bytes 253/254, overflow. So a caller that knows
    its tile holds no such byte (the fused kernel's plain path) may pass ``min_nz`` = 8 and
    ``max_mag`` from the block's amax. Returns (d, row_exp, row_flag) as :func:`encode_blocks`.
    """
    nan_blk = sb == E8M0_NAN
    special = special_blocks(sb, max_mag, min_nz)
    counted = (max_mag != 0) & ~nan_blk
    b_max = jnp.max(jnp.where(counted, sb, -1), axis=-1, keepdims=True)
    b_max = jnp.where(b_max < 0, EMPTY_ROW_BMAX, b_max)
    outside = counted & (sb < b_max - WINDOW_SPAN)
    exact = jnp.max((outside | special).astype(jnp.int32), axis=-1, keepdims=True) != 0
    d = _block_shift(sb, b_max, exact)
    row_exp = (b_max[..., 0] - ROW_EXP_OFFSET).astype(jnp.int32)
    any_nan = jnp.max(nan_blk.astype(jnp.int32), axis=-1) != 0
    row_flag = (exact[..., 0].astype(jnp.uint8) * FLAG_EXACT) | (any_nan.astype(jnp.uint8) * FLAG_NAN)
    return d, row_exp, row_flag


def rescale_elements(acc, e, nan, out_dtype):
    """The FP8 GEMM's output rescale, elementwise (:func:`jax_mxfp4.backends.fp8.rescale`; shared
    with its CUDA kernel :mod:`jax_mxfp4.kernels.rescale`): ``acc`` (float) x 2^e (int32 e, any
    value) in float32 as 2^E1 x 2^E2 (E1 = clip(e, -100, 100), E2 = clip(e - E1, -126, 127)), NaN
    where ``nan`` (bool), then one rounding to ``out_dtype``. Operands broadcast together."""
    e1 = jnp.clip(e, -100, 100)
    e2 = jnp.clip(e - e1, -126, 127)
    out = acc.astype(jnp.float32) * pow2_from_exponent(e1) * pow2_from_exponent(e2)
    out = jnp.where(nan, jnp.float32(jnp.nan), out)
    return out.astype(out_dtype)
