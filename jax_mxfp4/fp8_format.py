"""The FP8 form of MXFP4 rows, as rules on scale bytes: the window of block shifts for which
E2M1 x 2^d is an FP8 value, the per-row exponent, the row flags, and which blocks the reference
decoding flushes or overflows. A leaf beneath :mod:`jax_mxfp4.fp8_prepared` (the encoding) and
:mod:`jax_mxfp4.kernels.fp8_encode` (its Pallas kernel), so both read one copy of each rule.

Two FP8 formats hold the codes (:data:`FORMATS`): E4M3 (``float8_e4m3fn``, a 15-binade window of
block scales per row, 3 mantissa bits) and E5M2 (``float8_e5m2``, a 29-binade window, 2 mantissa
bits). An E2M1 value has at most two significant bits, so it is exact in either; E5M2's wider
window takes rows whose block scales spread further (gradients: a softmax gradient's or a qkv
gradient's row spans 15-28 binades after some training) without the exact-row recompute. Hopper
FP8 tensor cores multiply E4M3 x E4M3, E4M3 x E5M2 and E5M2 x E4M3 (not E5M2 x E5M2), so one
operand of a GEMM at most is E5M2 (the gradient; OCP FP8 and FP8 training recipes use E5M2 for
gradients for the same reason: range).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from .mx_format import BLOCK_SIZE, E8M0_NAN, pow2_from_exponent


@dataclasses.dataclass(frozen=True)
class Fp8Format:
    """One FP8 code format of the FP8 path: ``d_min``..``d_max`` are the block shifts d for which
    every E2M1 value x 2^d is exactly a value of ``dtype`` (d_min: 0.5 x 2^d and 1.5 x 2^d are
    multiples of the format's smallest subnormal; d_max: 6 x 2^d is at most its largest finite
    value)."""

    name: str
    dtype: object
    d_min: int
    d_max: int

    @property
    def window_span(self) -> int:
        """Binades between a row's largest and smallest block scale that the codes hold."""
        return self.d_max - self.d_min

    @property
    def row_exp_offset(self) -> int:
        """e = b_max - row_exp_offset: the largest block of a row gets the shift d_max."""
        return 127 + self.d_max


E4M3 = Fp8Format("e4m3", jnp.float8_e4m3fn, -8, 6)  # 2^-9 smallest subnormal; 6 x 2^6 = 384 <= 448
E5M2 = Fp8Format("e5m2", jnp.float8_e5m2, -15, 13)  # 2^-16 smallest subnormal; 6 x 2^13 = 49152 <= 57344
FORMATS = {f.name: f for f in (E4M3, E5M2)}


def format_named(name) -> Fp8Format:
    """The :class:`Fp8Format` called ``name`` ("e4m3" | "e5m2"); ValueError for another."""
    if not isinstance(name, str) or name not in FORMATS:
        raise ValueError(f"fmt must be one of {sorted(FORMATS)} (the FP8 code format), got {name!r}")
    return FORMATS[name]


def format_of(codes_dtype) -> Fp8Format:
    """The :class:`Fp8Format` whose codes have dtype ``codes_dtype``; TypeError for another."""
    for f in FORMATS.values():
        if jnp.dtype(codes_dtype) == jnp.dtype(f.dtype):
            return f
    raise TypeError(f"FP8 codes must be float8_e4m3fn or float8_e5m2, got {codes_dtype}")


FLAG_EXACT = 1  # row_flag bit 0: the row needs the exact path
FLAG_NAN = 2  # row_flag bit 1: the row holds a 0xFF scale byte (all its outputs are NaN)


def _block_shift(b, b_max, exact, fmt: Fp8Format = E4M3):
    """Per-block shift d (int32, clipped to [fmt.d_min, fmt.d_max]) from scale bytes ``b``
    [..., nb], the row's b_max [..., 1] and its exact flag [..., 1]: the one rule used to encode
    and to decode."""
    d = jnp.where(exact, 0, b - b_max + fmt.d_max)
    return jnp.clip(d, fmt.d_min, fmt.d_max)


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


def encode_blocks(sb, mag, fmt: Fp8Format = E4M3):
    """The row encoding rule (module docstring) from scale bytes and E2M1 magnitude codes.

    Args:
      sb: int32 scale bytes [..., nb]; mag: int32 E2M1 magnitude codes (0..7) [..., nb, 32];
      fmt: the code format (:data:`E4M3` or :data:`E5M2`).
    Returns:
      (d int32 [..., nb]: the shift of each block, row_exp int32 [...], row_flag uint8 [...]).
    Shared by :func:`encode_rows` and the fused kernel :mod:`jax_mxfp4.kernels.fp8_quantize`
    (written with max/min reductions only, which the Triton lowering takes).
    """
    max_mag = jnp.max(mag, axis=-1)
    min_nz = jnp.min(jnp.where(mag != 0, mag, 8), axis=-1)
    return encode_block_stats(sb, max_mag, min_nz, fmt)


def encode_block_stats(sb, max_mag, min_nz, fmt: Fp8Format = E4M3):
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
    b_max = jnp.where(b_max < 0, fmt.row_exp_offset, b_max)  # an empty row: e = 0
    outside = counted & (sb < b_max - fmt.window_span)
    exact = jnp.max((outside | special).astype(jnp.int32), axis=-1, keepdims=True) != 0
    d = _block_shift(sb, b_max, exact, fmt)
    row_exp = (b_max[..., 0] - fmt.row_exp_offset).astype(jnp.int32)
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
