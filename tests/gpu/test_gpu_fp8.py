"""Backend "fp8" on an NVIDIA GPU: XLA compiles its GEMM to an FP8 GEMM (cuBLASLt's
``__cublas$lt$matmul$f8`` or a GEMM fusion whose dot reads f8 operands), not an upcast; the error
against the exact float64 result, max |out - exact| / sum_k |a_k b_k|, at precision DEFAULT and
HIGH on random and adversarial data (a large first block then small products, cancelling block
pairs, equal-sign ramps; K = 1024 and 8192) stays within ``jax_mxfp4.backends.fp8.ERROR_BOUNDS``
(the README bound); rows and columns outside the FP8 window meet the float32 bound of the exact
path; NaN scale bytes poison exactly their row/column; a prepared weight gives the same bits;
the Pallas encode kernel equals the jnp ``encode_rows`` bit for bit; "auto" picks fp8 for a large
a4w4 GEMM at DEFAULT and not at HIGHEST."""

from __future__ import annotations

import functools
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_mxfp4 as mx
from gpu_reference import fp8_dot_in_hlo, fp8_operands, mx_from_codes

pytestmark = [pytest.mark.gpu, pytest.mark.cuda]

XLA = mx.Recipe(backend="xla")


@functools.lru_cache(maxsize=None)
def _fp8_gemm(precision, out_dtype=jnp.float32):
    """The jitted fp8 GEMM at ``precision`` on this platform (one compile per operand shape)."""
    from jax_mxfp4.backends import fp8 as fb
    from jax_mxfp4.platform import current_platform

    platform = current_platform()
    return jax.jit(lambda a, b: fb.fp8_gemm(a, b, out_dtype, precision, platform))


@pytest.mark.parametrize("odt", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("precision", ["default", "high"])
def test_an_fp8_gemm_in_the_compiled_hlo(precision, odt):
    qa = mx_from_codes(*fp8_operands("random", 1024, 1)[:2])
    hlo = _fp8_gemm(precision, odt).lower(qa, qa).compile().as_text()
    # cuBLASLt's FP8 GEMM, or a GEMM fusion (Triton) whose dot reads f8 operands: at DEFAULT XLA
    # may pick such a fusion (named gemm_fusion_dot*), not an upcast
    cublas = "__cublas$lt$matmul$f8" in hlo
    assert cublas or fp8_dot_in_hlo(hlo), sorted(set(re.findall(r'custom_call_target="([^"]+)"', hlo)))


KINDS = ("random", "head_tail_6", "head_tail_10", "head_tail_14", "cancel", "ramp")


@functools.lru_cache(maxsize=None)
def _exact(kind, k):
    from jax_mxfp4.fp8_prepared import prepare_fp8

    ca, sa, cb, sb = fp8_operands(kind, k, seed=k + len(kind))
    a, b = mx_from_codes(ca, sa), mx_from_codes(cb, sb)
    assert not bool(jnp.any(prepare_fp8(a).exact_rows())), kind  # all within the window
    da = np.asarray(mx.dequantize(a), np.float64)[0]
    db = np.asarray(mx.dequantize(b), np.float64)[0]
    return a, b, da @ db.T, np.abs(da) @ np.abs(db).T


@pytest.mark.parametrize("precision", ["default", "high"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", [1024, 8192])
def test_fp8_error_within_the_documented_bound(k, kind, precision):
    from jax_mxfp4.backends import fp8 as fb

    a, b, exact, mag = _exact(kind, k)
    out = np.asarray(_fp8_gemm(precision)(a, b), np.float64)[0]
    assert np.isfinite(out).all()
    ratio = float(np.max(np.abs(out - exact) / mag))
    bound = fb.ERROR_BOUNDS[(precision, "random" if kind == "random" else "adversarial")]
    assert ratio <= bound, (ratio, bound)


def _window_operands():
    """512 x 384 x 2048 operands with rows 3, 100, 511 and every 9th column (43: more than the
    strip capacity, 16) outside the FP8 window."""
    ca, sa, cb, sb = fp8_operands("random", 2048, 7, m=512, n=384)
    for r in (3, 100, 511):
        sa[0, r, 5] = 60
        ca[0, r, 5 * 32] = 2
    for c in range(0, 384, 9):
        sb[0, c, 0] = 20
        cb[0, c, 0] = 3
    return ca, sa, cb, sb


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_rows_and_columns_outside_the_window_take_the_exact_path(fmt):
    """Rows 3, 100, 511 span 60+ binades: flagged in either format (an E5M2 lhs, as the training
    passes hand dY, has the CUDA fix kernel read E5M2 codes)."""
    from jax_mxfp4.fp8_prepared import to_fp8

    ca, sa, cb, sb = _window_operands()
    a, b = mx_from_codes(ca, sa), mx_from_codes(cb, sb)
    da = np.asarray(mx.dequantize(a), np.float64)[0]
    db = np.asarray(mx.dequantize(b), np.float64)[0]
    exact, mag = da @ db.T, np.abs(da) @ np.abs(db).T
    lhs = to_fp8(a, fmt)
    assert set(np.flatnonzero(np.asarray(lhs.exact_rows())[0])) == {3, 100, 511}
    out = np.asarray(_fp8_gemm("default")(lhs, b), np.float64)[0]
    fl = np.zeros(exact.shape, bool)
    fl[[3, 100, 511], :] = True
    fl[:, 0::9] = True
    err = np.abs(out - exact)
    assert (err[fl] <= 2 * 2048 * 2.0**-24 * mag[fl]).all(), float((err[fl] / mag[fl]).max())


def test_nan_scale_bytes_poison_exactly_their_row_and_column():
    ca, sa, cb, sb = _window_operands()
    sa[0, 7, 2] = 255
    sb[0, 5, 1] = 255
    out = np.asarray(_fp8_gemm("default")(mx_from_codes(ca, sa), mx_from_codes(cb, sb)))[0]
    want = np.zeros(out.shape, bool)
    want[7, :] = want[:, 5] = True
    np.testing.assert_array_equal(np.isnan(out), want)


def test_prepared_weight_gives_the_same_bits():
    from jax_mxfp4.fp8_prepared import prepare_fp8

    ca, sa, cb, sb = fp8_operands("random", 4096, 9, m=1024, n=1024)
    a, b = mx_from_codes(ca, sa), mx_from_codes(cb, sb)
    run = _fp8_gemm("default")
    np.testing.assert_array_equal(np.asarray(run(a, b)), np.asarray(run(a, prepare_fp8(b))))


ENCODE_CASES = list(itertools.product(((4096, 8192), (1000, 96), (37, 1056)), ((100, 150), (120, 135))))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("i", range(len(ENCODE_CASES)), ids=[
    f"{r}x{k}-bytes{lo}-{hi}" for (r, k), (lo, hi) in ENCODE_CASES])
def test_encode_kernel_bit_identical_to_encode_rows(i, fmt):
    """Scale bands: (100, 150) flags most E4M3 rows; (120, 135) keeps most inside the window, with
    blocks at shifts -8..-6 (subnormal E4M3 results; E5M2's 29-binade window holds every row of
    both bands but the edge ones); edge bytes 80, 255, 0, 254, 1 and a zero row."""
    from jax_mxfp4.fp8_prepared import encode_rows
    from jax_mxfp4.kernels.fp8_encode import encode_rows_kernel

    (r_, k_), band = ENCODE_CASES[i]
    rng = np.random.default_rng(11 + i)
    data = rng.integers(0, 256, (r_, k_ // 2), dtype=np.uint8)
    sbytes = rng.integers(*band, (r_, k_ // 32)).astype(np.uint8)
    sbytes[0, 0], sbytes[1, 0], sbytes[2, 0], sbytes[3, 0], sbytes[4, 0] = 80, 255, 0, 254, 1
    data[5, :] = 0
    want = jax.jit(encode_rows, static_argnums=2)(jnp.asarray(data), jnp.asarray(sbytes), fmt)
    got = encode_rows_kernel(jnp.asarray(data), jnp.asarray(sbytes), fmt=fmt)
    assert len(got) == len(want)
    for j, (x, y) in enumerate(zip(want, got)):
        np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8),
                                      err_msg=f"output {j}")


def test_auto_picks_fp8_at_default_and_not_at_highest():
    big = jax.ShapeDtypeStruct((8192, 8192), jnp.float32)
    dn = (((1,), (1,)), ((), ()))
    d = mx.explain(big, big, dn)
    dh = mx.explain(big, big, dn, precision=jax.lax.Precision.HIGHEST)
    assert d.backend == "fp8" and dh.backend != "fp8", (d.backend, dh.backend)


# ------------------------------------------------------------------ E5M2 gradient operands
def _e5m2_operands(kind, k, seed):
    """``fp8_operands`` with the lhs's block scales spread over 15-28 binades (outside E4M3's
    window, inside E5M2's): the lhs as E5M2 codes, the rhs as E4M3."""
    from jax_mxfp4.fp8_prepared import to_fp8

    ca, sa, cb, sb = fp8_operands(kind, k, seed)
    lo = np.random.default_rng(seed).integers(93, 120, sa.shape[:2])  # 15..41 below 134: some at 28
    sa[:, :, 1] = np.maximum(lo, 134 - 28).astype(np.uint8)
    sa[:, :, 0] = 134
    a, b = mx_from_codes(ca, sa), mx_from_codes(cb, sb)
    ea = to_fp8(a, "e5m2")
    assert not bool(jnp.any(ea.exact_rows())), kind  # all within E5M2's window
    da = np.asarray(mx.dequantize(a), np.float64)[0]
    db = np.asarray(mx.dequantize(b), np.float64)[0]
    return ea, b, da @ db.T, np.abs(da) @ np.abs(db).T


def test_an_e5m2_by_e4m3_gemm_in_the_compiled_hlo():
    ea, b, _, _ = _e5m2_operands("random", 1024, 3)
    hlo = _fp8_gemm("default").lower(ea, b).compile().as_text()
    cublas = "__cublas$lt$matmul$f8" in hlo
    assert cublas or fp8_dot_in_hlo(hlo, ("f8e5m2", "f8e4m3fn")), sorted(set(re.findall(r'custom_call_target="([^"]+)"', hlo)))


@pytest.mark.parametrize("precision", ["default", "high"])
@pytest.mark.parametrize("kind", ("random", "head_tail_14", "cancel"))
@pytest.mark.parametrize("k", [1024, 8192])
def test_e5m2_operand_error_within_the_documented_bound(k, kind, precision):
    """An E5M2 lhs (rows spanning up to 28 binades) x an E4M3 rhs on the FP8 GEMM: the error
    stays within ERROR_BOUNDS (measured for E4M3 x E4M3)."""
    from jax_mxfp4.backends import fp8 as fb

    ea, b, exact, mag = _e5m2_operands(kind, k, k + len(kind))
    out = np.asarray(_fp8_gemm(precision)(ea, b), np.float64)[0]
    assert np.isfinite(out).all()
    ratio = float(np.max(np.abs(out - exact) / mag))
    assert ratio <= fb.ERROR_BOUNDS[(precision, "random" if kind == "random" else "adversarial")], ratio


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_fused_kernel_e5m2_bit_identical_to_encode_rows(rounding):
    """The fused quantize-to-FP8 kernel with E5M2 codes on the GPU (Triton's f32 -> f8e5m2
    conversion) equals the jnp encoding of the quantized operand bit for bit."""
    from jax_mxfp4.fp8_prepared import encode_rows
    from jax_mxfp4.kernels import fp8_quantize as fq

    rng = np.random.default_rng(11)
    x = rng.standard_normal((512, 1024)).astype(np.float32)
    x *= np.float32(2.0) ** rng.integers(-14, 15, (512, 32)).repeat(32, 1).astype(np.float32)
    key = jax.random.key(5) if rounding == "stochastic" else None
    kd = jax.random.key_data(key) if key is not None else None
    got = fq.quantize_fp8_2d(jnp.asarray(x), kd, fmt="e5m2")
    q = mx.quantize(jnp.asarray(x), 1, rounding=rounding, key=key)
    want = encode_rows(q.data, q.plain_scales(), "e5m2")
    np.testing.assert_array_equal(np.asarray(got[0]).view(np.uint8), np.asarray(want[0]).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(want[1]))
    np.testing.assert_array_equal(np.asarray(got[3]), np.asarray(want[2]))

