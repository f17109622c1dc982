"""References and tolerances shared by the device tests in tests/gpu (plain functions, no JAX
device needed to import; tests/test_gpu_reference.py checks them on the CPU).

The GEMM tolerance: elementwise |out - ref| <= 2 K 2^-24 (|A|.|B|), the bound for two float32
summation orders (tests/test_pallas_gemm.py), plus one bfloat16 ulp (2^-7 |ref|) for a bfloat16
output; outputs must be finite."""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np

E2M1_VALUES = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])  # OCP MX v1.0 §5.3.3


def rand(seed, shape, dtype=jnp.float32):
    """Standard normal values times a power of two (2^-8..2^8) drawn per run of 32 elements
    (mixed block magnitudes), from ``np.random.default_rng(seed)``."""
    rng = np.random.default_rng(seed)
    size = int(np.prod(shape))
    mags = np.exp2(rng.integers(-8, 9, size=-(-size // 32))).repeat(32)[:size].reshape(shape)
    return jnp.asarray(rng.standard_normal(shape) * mags, dtype)


def bound_check(out, ref, a_abs, b_abs, k, bf16_out):
    """``out`` against ``ref`` ([..., M, N]) within the float32 accumulation bound, the
    magnitudes ``a_abs`` [..., M, K] and ``b_abs`` [..., N, K]. Returns a dict: finite,
    max_err_over_bound (<= 1 passes), rel_fro, ok."""
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    ref = np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
    # sum_k |a||b| per output, on the device in float32: it only sets the tolerance
    mag = np.asarray(jnp.einsum("...mk,...nk->...mn", jnp.asarray(a_abs, jnp.float32), jnp.asarray(b_abs, jnp.float32),
                                precision="highest"), np.float64)
    tol = 2 * k * 2.0**-24 * mag + (2.0**-7 * np.abs(ref) if bf16_out else 0) + 1e-30
    err = np.abs(out - ref)
    finite = bool(np.all(np.isfinite(out)))
    ratio = float(np.max(err / tol)) if finite else float("inf")
    rel = float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))
    return {"finite": finite, "max_err_over_bound": ratio, "rel_fro": rel, "ok": finite and ratio <= 1.0}


def assert_within_bound(out, ref, a_abs, b_abs, k, bf16_out, case=""):
    """:func:`bound_check`, failing with the measured numbers."""
    r = bound_check(out, ref, a_abs, b_abs, k, bf16_out)
    assert r["ok"], (f"{case}: finite={r['finite']} max err/bound={r['max_err_over_bound']:.4g} "
                     f"rel_fro={r['rel_fro']:.3g}")
    return r


def byte_reference(x, data, scale_bytes):
    """float64 (x · Wᵀ, |x| · |W|ᵀ) for a weight given as packed E2M1 bytes ``data`` [..., N, K/2]
    (low nibble = element 2j) and E8M0 bytes ``scale_bytes`` [..., N, K/32] (0xFF NaN), decoded
    independently of the project (NumPy tables; each element rounded to float32 as a float32
    dequantization would: 2^128 -> inf), against ``x`` [..., M, K]. The every-byte tests' reference."""
    data, sb = np.asarray(data), np.asarray(scale_bytes)
    codes = np.stack([data & 15, data >> 4], -1).reshape(*data.shape[:-1], 2 * data.shape[-1])
    sc = np.where(sb == 255, np.nan, 2.0 ** (sb.astype(np.float64) - 127))
    xf = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        w = (E2M1_VALUES[codes] * np.repeat(sc, 32, axis=-1)).astype(np.float32).astype(np.float64)
        return xf @ np.swapaxes(w, -1, -2), np.abs(xf) @ np.abs(np.swapaxes(w, -1, -2))


def every_byte_operands(seed, m, n, k, nan_at, batch=()):
    """Operands that put every E8M0 byte 0x00..0xFE on the weight's blocks (in row order, 255
    repeating) and 0xFF (NaN) at block ``nan_at`` ((row, block) of the weight): (x bfloat16
    [*batch, M, K] of magnitude 2^-10, data uint8 [*batch, N, K/2], scale bytes uint8
    [*batch, N, K/32]) as NumPy / JAX arrays, from ``np.random.default_rng(seed)``."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (*batch, n, k // 2), dtype=np.uint8)
    sb = (np.arange(n * (k // 32), dtype=np.int64).reshape(*batch, n, k // 32) % 255).astype(np.uint8)
    sb[(*(0,) * len(batch), *nan_at)] = 255
    x = jnp.asarray(rng.standard_normal((*batch, m, k)) * 2.0**-10, jnp.bfloat16)
    return x, data, sb


def finite_within_bound(out, ref, mag, k, slack=2):
    """Where ``ref`` is finite in float32, |out - ref| <= slack K 2^-24 |x|.|W| + 2^-126; the mask."""
    fin = np.isfinite(ref) & (np.abs(ref) < 3e38)
    ok = bool(np.all(np.abs(out[fin] - ref[fin]) <= slack * k * 2.0**-24 * mag[fin] + 2.0**-126))
    return ok, fin


# ---- FP8 path

def mx_from_codes(codes, sbytes):
    """Canonical MXFP4Array [1, rows, K] (axis 2) from E2M1 codes and scale bytes (numpy uint8)."""
    import jax_mxfp4 as mx
    from jax_mxfp4.mx_format import as_e8m0, pack_nibbles

    return mx.MXFP4Array(pack_nibbles(jnp.asarray(codes, jnp.uint8)), as_e8m0(jnp.asarray(sbytes, jnp.uint8)),
                         2, codes.shape, jnp.float32)


def fp8_operands(kind, k, seed, m=256, n=256):
    """(lhs codes, lhs bytes, rhs codes, rhs bytes) [1, rows, K] / [1, rows, K/32], all within
    the FP8 window (no row flagged), for the error measurement. ``kind``: "random",
    "head_tail_<drop>" (one large block, then K - 32 products 2^-drop smaller), "cancel" (block
    pairs that cancel exactly, plus one small last block), "ramp" (every product equal)."""
    rng = np.random.default_rng(seed)
    nb = k // 32
    ca = rng.integers(0, 16, (1, m, k), dtype=np.uint8)
    cb = rng.integers(0, 16, (1, n, k), dtype=np.uint8)
    sa = rng.integers(120, 135, (1, m, nb)).astype(np.uint8)
    sb = rng.integers(120, 135, (1, n, nb)).astype(np.uint8)
    if kind.startswith("head_tail"):
        drop = int(kind.split("_")[-1])
        ca = rng.integers(1, 8, (1, m, k), dtype=np.uint8)  # positive: no cancellation
        cb = rng.integers(1, 8, (1, n, k), dtype=np.uint8)
        ca[:, :, :32] = 7
        sa[:] = 134 - drop
        sa[:, :, 0] = 134
        sb[:] = 127
    elif kind == "cancel":
        sb[:, :, 1::2] = sb[:, :, 0::2]
        cb.reshape(1, n, nb // 2, 2, 32)[:, :, :, 1] = cb.reshape(1, n, nb // 2, 2, 32)[:, :, :, 0]
        sa[:, :, 1::2] = sa[:, :, 0::2]
        ca.reshape(1, m, nb // 2, 2, 32)[:, :, :, 1] = ca.reshape(1, m, nb // 2, 2, 32)[:, :, :, 0] ^ 8
        sa[:, :, -1] = 121
        sa[:, :, 0] = 134
    elif kind == "ramp":
        ca[:] = 7
        cb[:] = 7
        sa[:] = 130
        sb[:] = 130
    elif kind != "random":
        raise ValueError(f"fp8_operands: unknown kind {kind!r}")
    return ca, sa, cb, sb


def fp8_dot_in_hlo(hlo: str, types=("f8e4m3fn", "f8e4m3fn")) -> bool:
    """Whether compiled HLO text holds a ``dot`` whose operands have the element ``types`` (lhs,
    rhs; default both float8_e4m3fn). XLA prints dot operands by name only (``dot(%param_0,
    %param_1)``), so each computation's definitions are read first (names repeat across fused
    computations)."""
    for comp in re.split(r"\n(?=\S)", hlo):  # a computation starts at an unindented line
        defs = dict(re.findall(r"%([\w.\-]+) = ([a-z0-9]+)\[", comp))
        for a, b in re.findall(r" dot\(%([\w.\-]+), %([\w.\-]+)\)", comp):
            if (defs.get(a), defs.get(b)) == tuple(types):
                return True
    return False
