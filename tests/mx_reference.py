"""Independent NumPy float64 + ml_dtypes reference for MXFP4 (test oracle).

Written from the rules (OCP MX v1.0 and the documented scale variants), with float64 arithmetic
and np.frexp instead of the package's float32 bit tricks, and ml_dtypes for the E2M1 rounding, so
that agreement with ``jax_mxfp4`` is evidence rather than the same code run twice.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

BLOCK = 32
F32_TINY = float(np.finfo(np.float32).tiny)  # 2^-126


def _floor_log2(a: np.ndarray) -> np.ndarray:
    """floor(log2 a) for a > 0 (float64, exact via frexp)."""
    _, e = np.frexp(a)
    return (e - 1).astype(np.int64)


def scale_exponent(amax: np.ndarray, mode: str) -> np.ndarray:
    """Unbiased shared-scale exponent s (before clamping) for block maxima amax (float32 values)."""
    amax = np.asarray(amax, np.float64)
    pos = np.where(amax > 0, amax, 1.0)
    fl = _floor_log2(pos)
    is_pow2 = pos == np.ldexp(1.0, fl)
    if mode == "floor":  # OCP MX v1.0 §6.3
        s = fl - 2
    elif mode == "ceil":  # ceil(log2 amax) - 2
        s = fl + (~is_pow2) - 2
    elif mode == "even":  # round amax to 1 mantissa bit, half up (significand >= 1.75 bumps)
        sig = pos / np.ldexp(1.0, fl)
        s = fl + (sig >= 1.75) - 2
    elif mode == "rceil":  # d = amax / 6 correctly rounded in float32 (subnormals kept), ceil(log2 d)
        with np.errstate(under="ignore"):
            d = (np.asarray(amax, np.float32) / np.float32(6.0)).astype(np.float64)
        dpos = np.where(d > 0, d, 1.0)
        dfl = _floor_log2(dpos)
        s = dfl + (dpos != np.ldexp(1.0, dfl))
        s = np.where(d > 0, s, -127)
    else:
        raise ValueError(mode)
    return np.where(amax > 0, s, -127)


def quantize_ref(x: np.ndarray, axis: int, mode: str):
    """(codes uint8 [.. logical ..], scale bytes uint8 [.. axis/32 ..]) for float input x."""
    x = np.asarray(x).astype(np.float32)
    x = np.where(np.abs(x) < F32_TINY, np.copysign(0.0, x), x).astype(np.float32)  # documented flush
    xm = np.moveaxis(x, axis, -1).astype(np.float64)
    blocks = xm.reshape(*xm.shape[:-1], xm.shape[-1] // BLOCK, BLOCK)
    finite = np.isfinite(blocks)
    bad = ~finite.all(-1)
    amax = np.where(finite, np.abs(blocks), 0.0).max(-1)
    s = np.clip(scale_exponent(amax, mode), -127, 127)
    byte = np.where(bad, 255, s + 127).astype(np.uint8)
    y = np.where(finite, blocks, 0.0) / np.ldexp(1.0, s)[..., None]
    y = np.clip(y, -6.0, 6.0)
    codes = y.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
    codes = np.where(bad[..., None], 0, codes).astype(np.uint8)
    codes = np.moveaxis(codes.reshape(xm.shape), -1, axis)
    return codes, np.moveaxis(byte, -1, axis)


def stochastic_magnitude_ref(a: np.ndarray, u: np.ndarray) -> np.ndarray:
    """float64 E2M1 magnitude of a = |x| / 2^s (a >= 0) rounded stochastically with uniforms u:
    the grid neighbour above where u < (a - lo) / step, else the one below (lo); at most 6."""
    a = np.asarray(a, np.float64)
    step = np.where(a < 2, 0.5, np.where(a < 4, 1.0, 2.0))
    lo = np.floor(a / step) * step
    return np.minimum(np.where(np.asarray(u, np.float64) < (a - lo) / step, lo + step, lo), 6.0)


def pack_ref(codes: np.ndarray, axis: int) -> np.ndarray:
    c = np.moveaxis(codes, axis, -1)
    packed = (c[..., 0::2] | (c[..., 1::2] << 4)).astype(np.uint8)
    return np.moveaxis(packed, -1, axis)


def unpack_ref(data: np.ndarray, axis: int) -> np.ndarray:
    d = np.moveaxis(np.asarray(data, np.uint8), axis, -1)
    out = np.empty(d.shape[:-1] + (d.shape[-1] * 2,), np.uint8)
    out[..., 0::2] = d & 0xF
    out[..., 1::2] = d >> 4
    return np.moveaxis(out, -1, axis)


def pairs_source_index(kh: int) -> np.ndarray:
    """DecodePrepared's "pairs" byte order, written as index arithmetic (independent of the
    package's reshape/transpose): stored byte p of a row holds natural byte
    16 (p // 16) + (p % 16) // 4 + 4 (p % 4) (a 4x4 transpose inside every 16-byte block)."""
    p = np.arange(kh)
    return 16 * (p // 16) + (p % 16) // 4 + 4 * (p % 4)


def lanes_ref(pairs_bytes):
    """The "lanes" nibble order from the "pairs" bytes, by nibble lists: in each 4-byte word with
    nibbles n0..n7 (n_2t, n_2t+1 = low, high nibble of byte t) the new nibble sequence is
    n0 n2 n4 n6 n1 n3 n5 n7 (nibble i at bits 4i)."""
    b = np.asarray(pairs_bytes).reshape(-1, 4)
    n = np.stack([b & 15, b >> 4], -1).reshape(-1, 8)
    m = np.concatenate([n[:, 0::2], n[:, 1::2]], axis=1)
    return (m[:, 0::2] | (m[:, 1::2] << 4)).astype(np.uint8).reshape(np.shape(pairs_bytes))


def pairs_from_lanes_ref(lanes_bytes):
    """Inverse of :func:`lanes_ref` (nibble lists again: n[0::2] = m[0:4], n[1::2] = m[4:8])."""
    b = np.asarray(lanes_bytes).reshape(-1, 4)
    m = np.stack([b & 15, b >> 4], -1).reshape(-1, 8)
    n = np.empty_like(m)
    n[:, 0::2], n[:, 1::2] = m[:, :4], m[:, 4:]
    return (n[:, 0::2] | (n[:, 1::2] << 4)).astype(np.uint8).reshape(np.shape(lanes_bytes))


def natural_from_stored(data: np.ndarray, byte_order: str) -> np.ndarray:
    """Packed bytes [..., K/2] of a DecodePrepared back in natural order (byte j = elements 2j, 2j+1)."""
    if byte_order == "natural":
        return np.asarray(data)
    if byte_order == "lanes":
        data = pairs_from_lanes_ref(data)
    out = np.empty_like(np.asarray(data))
    out[..., pairs_source_index(data.shape[-1])] = data
    return out


def e2m1_values(codes: np.ndarray) -> np.ndarray:
    return np.asarray(codes, np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)


def dequantize_ref(codes: np.ndarray, scale_bytes: np.ndarray, axis: int) -> np.ndarray:
    """float64 values; |v| < 2^-126 -> signed zero (documented rule); byte 0xFF -> NaN."""
    c = np.moveaxis(codes, axis, -1)
    b = np.moveaxis(np.asarray(scale_bytes, np.int64), axis, -1)
    vals = e2m1_values(c).reshape(*c.shape[:-1], c.shape[-1] // BLOCK, BLOCK)
    v = vals * np.ldexp(1.0, b - 127)[..., None]
    v = np.where(np.abs(v) < F32_TINY, np.copysign(0.0, vals), v)
    v = np.where((b == 255)[..., None], np.nan, v)
    return np.moveaxis(v.reshape(c.shape), -1, axis)


def swizzle_index_ref(rows: int, cols: int) -> tuple[int, int, np.ndarray]:
    """Closed-form hipBLASLt 32x8 swizzle (hipblaslt-mxfp4.md §1.6): flat destination of S[r][c]."""
    R = -(-rows // 32) * 32
    C = -(-cols // 8) * 8
    dest = np.empty((rows, cols), np.int64)
    for r in range(rows):
        for c in range(cols):
            a, b, cc = r // 32, (r % 32) // 16, r % 16
            d, e, f = c // 8, (c % 8) // 4, c % 4
            dest[r, c] = a * 32 * C + d * 256 + f * 64 + cc * 4 + e * 2 + b
    return R, C, dest


def qdq(x, axis, mode="even"):
    """float64 value of x (float32 values) quantized to MXFP4 along axis (independent oracle)."""
    return dequantize_ref(*quantize_ref(np.asarray(x, np.float32), axis, mode), axis)


def pad(x, axis):
    """Zero-pad ``axis`` up to a multiple of 32 (what dense and the layers do)."""
    w = [(0, 0)] * x.ndim
    w[axis] = (0, (-x.shape[axis]) % 32)
    return np.pad(x, w)


def bf16(x):
    """float64 values of x rounded to bfloat16."""
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


# ---- every pair of E8M0 scale bytes in one GEMM

E8M0_BYTES = 256
_MIXED = np.arange(BLOCK, dtype=np.uint8) % 16
PAIR_PATTERNS = {  # name -> (lhs codes, rhs codes) of the one block each row carries
    # max E2M1 both sides: at byte 0x00 each element 6 x 2^-127 is still a normal float32
    "six": (np.full(BLOCK, 7, np.uint8), np.full(BLOCK, 7, np.uint8)),
    # every code on each side (signed zeros, 0.5 .. 6, both signs), each paired with another
    # magnitude of the same sign (no cancellation: every product counts): at byte 0x00 the
    # elements below 2 are float32 subnormals (flushed), at 0x01 only 0.5
    "mixed": (_MIXED, (_MIXED & 8) | ((_MIXED * 3 + 1) & 7)),
}


def scale_pair_operands(pattern: str, k: int = BLOCK):
    """(lhs codes [256, k], lhs bytes [256, k/32], rhs codes [256, k], rhs bytes [256, k/32]):
    lhs row i carries scale byte i on its first block and rhs row j byte j (0x00..0xFE, 0xFF the
    NaN byte), the block codes of ``PAIR_PATTERNS[pattern]``; further blocks hold zeros (byte
    127). Output (i, j) of lhs · rhsᵀ is the product of the block pair with bytes (i, j)."""
    lc, rc = PAIR_PATTERNS[pattern]
    out = []
    for block in (lc, rc):
        codes = np.zeros((E8M0_BYTES, k), np.uint8)
        codes[:, :BLOCK] = block
        sb = np.full((E8M0_BYTES, k // BLOCK), 127, np.uint8)
        sb[:, 0] = np.arange(E8M0_BYTES)
        out += [codes, sb]
    return tuple(out)


def scale_pair_reference(codes_l, bytes_l, codes_r, bytes_r):
    """float64 (exact, abs_dot, nan_byte, overflow) [256, 256] for :func:`scale_pair_operands`:
    each element decoded by :func:`dequantize_ref` (|v| < 2^-126 flushed to a signed zero),
    products and sums exact in float64. ``nan_byte``: outputs whose row or column holds 0xFF (must
    be NaN). ``overflow``: outputs with an element or product of magnitude >= 2^128 (unbounded:
    float32 arithmetic makes them +-Inf/NaN, a path that sums before it scales may not)."""
    a, b = dequantize_ref(codes_l, bytes_l, 1), dequantize_ref(codes_r, bytes_r, 1)
    nan_l, nan_r = (bytes_l == 255).any(1), (bytes_r == 255).any(1)
    a, b = np.where(np.isnan(a), 0.0, a), np.where(np.isnan(b), 0.0, b)
    big = 2.0**128
    with np.errstate(over="ignore"):
        prods = a[:, None, :] * b[None, :, :]
        exact, abs_dot = prods.sum(-1), np.abs(prods).sum(-1)
        overflow = ((np.abs(a) >= big).any(1)[:, None] | (np.abs(b) >= big).any(1)[None, :]
                    | (np.abs(prods) >= big).any(-1) | (abs_dot >= big))
    return exact, abs_dot, nan_l[:, None] | nan_r[None, :], overflow


def scale_pair_failures(got, exact, abs_dot, nan_byte, overflow, bound):
    """Mask of outputs outside the contract: NaN-byte outputs not NaN; elsewhere, outside the
    overflow region, |got - exact| > bound (a NaN or Inf result fails); in the overflow region a
    finite result must still be within the bound (the value of a path that sums before it scales)."""
    got = np.asarray(got, np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        within = np.abs(got - exact) <= bound
    ok = np.where(nan_byte, np.isnan(got), np.where(overflow, ~np.isfinite(got) | within, within))
    return ~ok


def hadamard_transform_ref(x: np.ndarray, axis: int, seed: int, block: int = BLOCK) -> np.ndarray:
    """NumPy float32 twin of :func:`jax_mxfp4.hadamard.random_hadamard_transform` (the definition
    in its module docstring: signs, butterfly stages h = 1, 2, ..., block/2, one scaling)."""
    from jax_mxfp4.hadamard import random_signs

    y = np.moveaxis(np.asarray(x, np.float32), axis, -1).copy()
    y *= np.tile(random_signs(seed, block), y.shape[-1] // block).astype(np.float32)
    h = 1
    while h < block:
        z = y.reshape(y.shape[:-1] + (y.shape[-1] // (2 * h), 2, h))
        a, b = z[..., 0, :], z[..., 1, :]
        y = np.stack([a + b, a - b], axis=-2).reshape(y.shape)
        h *= 2
    return np.moveaxis(y * np.float32(1.0 / np.sqrt(block)), -1, axis)
