"""The FP8 GEMM's power-of-two rescale: the Pallas kernel (jax_mxfp4/kernels/rescale.py, in the
Pallas interpreter) bit for bit against ``rescale`` (the rule), ``rescale`` against NumPy's ldexp
(float64, exact here, then rounded to float32 and to the output dtype as the rule documents), the
CUDA routing of ``rescale_on`` and its switch, and the Triton lowering (no GPU needed)."""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_mxfp4.backends import fp8 as fp8_backend
from jax_mxfp4.backends.fp8 import rescale, rescale_on
from jax_mxfp4.platform import KERNELS_ENV
from jax_mxfp4.kernels.rescale import rescale_kernel

rk = importlib.import_module("jax_mxfp4.kernels.rescale")
OUT = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}


def bits(x):
    x = np.asarray(x)
    return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def edge_data(rng, b, m, n, acc_dtype):
    """Accumulators in the rule's domain (sums of E4M3 products: multiples of 2^-18, here up to
    2^34) with 0, -0.0, +-Inf, NaN and 2^-18 (the smallest nonzero product) planted; row exponents
    sweeping [-133, 121] (b_max - 133 for E8M0 bytes 0..254) and column exponents holding both
    ends, so sums cover [-266, 242]: overflow to Inf, underflow to zero, subnormal float32/bf16
    results; one NaN row and one NaN column."""
    acc = rng.integers(-(2**20), 2**20, (b, m, n)) * 2.0 ** rng.integers(-18, 15, (b, m, n))
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 2.0**-18, -(2.0**-18), 3 * 2.0**-17])
    flat = acc.reshape(-1)
    idx = rng.choice(flat.size, size=min(flat.size, 40), replace=False)
    flat[idx] = specials[np.arange(idx.size) % specials.size]
    el = np.linspace(-133, 121, m).round().astype(np.int32)[None].repeat(b, 0)
    er = rng.integers(-133, 122, (b, n)).astype(np.int32)
    er[:, :4] = [-133, -100, 100, 121]
    nl, nr = np.zeros((b, m), bool), np.zeros((b, n), bool)
    nl[:, rng.integers(m)] = True
    nr[:, rng.integers(n)] = True
    return (jnp.asarray(acc, jnp.float32).astype(acc_dtype), jnp.asarray(el), jnp.asarray(er),
            jnp.asarray(nl), jnp.asarray(nr))


def random_data(rng, b, m, n, acc_dtype):
    acc = rng.standard_normal((b, m, n)) * 2.0 ** rng.integers(-8, 9, (b, m, n))
    return (jnp.asarray(acc, jnp.float32).astype(acc_dtype), jnp.asarray(rng.integers(-133, 122, (b, m)), jnp.int32),
            jnp.asarray(rng.integers(-133, 122, (b, n)), jnp.int32), jnp.asarray(rng.random((b, m)) < 0.05),
            jnp.asarray(rng.random((b, n)) < 0.05))


def numpy_rescale(acc, el, er, nl, nr, out_dtype, flush_subnormals):
    """Independent reference: acc x 2^E in float64 (np.ldexp, exact for every E here), rounded to
    float32 (IEEE) then to the output dtype (ml_dtypes), NaN rows/cols. ``flush_subnormals``:
    float32 subnormal results become signed zeros, as XLA:CPU computes (it runs with denormals
    flushed to zero; XLA on GPUs and Triton keep them)."""
    a = np.asarray(acc).astype(np.float64)
    e = np.asarray(el)[:, :, None] + np.asarray(er)[:, None, :]
    with np.errstate(over="ignore"):
        out = np.ldexp(a, e).astype(np.float32)
    if flush_subnormals:
        out = np.where(np.abs(out) < np.float32(2.0**-126), np.copysign(np.float32(0), out), out)
    out = np.where(np.asarray(nl)[:, :, None] | np.asarray(nr)[:, None, :], np.float32(np.nan), out)
    with np.errstate(over="ignore"):  # overflow to Inf is one of the edges
        return out.astype({"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[
            np.dtype(out_dtype).name])


@pytest.mark.sweep(keep=2)
@pytest.mark.parametrize("acc_dtype,out_dtype", [("bf16", "bf16"), ("f32", "f32"), ("f32", "bf16"), ("f32", "f16")])
@pytest.mark.parametrize("family", ["edge", "random"])
def test_kernel_bit_identical_to_rescale(acc_dtype, out_dtype, family, rng):
    """Ragged M and N (edge tiles masked), a batch of 2, two tile shapes."""
    make = edge_data if family == "edge" else random_data
    args = make(rng, 2, 40, 72, OUT[acc_dtype])
    want = rescale(*args, OUT[out_dtype])
    for block, warps in (((16, 32), 4), ((8, 128), 2)):
        got = rescale_kernel(*args, OUT[out_dtype], block=block, num_warps=warps, interpret=True)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(bits(got), bits(want))


@pytest.mark.parametrize("out_dtype", ["f32", "bf16", "f16"])
def test_rescale_matches_numpy_ldexp(out_dtype, rng):
    """The rule itself against an independent formulation, edges included; the edge data must
    really reach Inf, zero and subnormal results (else the test would be vacuous)."""
    args = edge_data(rng, 1, 64, 96, jnp.float32)
    got = np.asarray(rescale(*args, OUT[out_dtype]))
    cpu = jax.default_backend() == "cpu"
    want = numpy_rescale(*args, OUT[out_dtype], flush_subnormals=cpu)
    np.testing.assert_array_equal(bits(got), bits(want.astype(got.dtype)))
    g = np.abs(got.astype(np.float32))
    assert np.isinf(g).any() and (g == 0).any() and np.isnan(g).any()
    exact = np.abs(numpy_rescale(*args, jnp.float32, flush_subnormals=False))
    assert ((exact > 0) & (exact < 2.0**-126)).sum() > 10  # the data reaches subnormal results
    assert (bits(got) == bits(np.array(-0.0, got.dtype))).any()  # -0.0 kept


def test_rescale_on_routes_the_kernel_on_cuda_only(monkeypatch, rng):
    """rescale_on: XLA's fusion off CUDA and with JAX_MXFP4_KERNELS=0; the kernel on CUDA
    (spied here: a CPU test cannot run Triton). A typo in the switch is refused."""
    args = random_data(rng, 1, 16, 24, jnp.bfloat16)
    calls = []

    def spy(*a, **k):
        calls.append(a[-1])
        return rescale_kernel(*a, **k, interpret=True)

    monkeypatch.setattr(rk, "rescale_kernel", spy)
    want = bits(rescale(*args, jnp.bfloat16))
    np.testing.assert_array_equal(bits(rescale_on(*args, jnp.bfloat16, "cpu")), want)
    assert calls == []
    np.testing.assert_array_equal(bits(rescale_on(*args, jnp.bfloat16, "cuda")), want)
    assert len(calls) == 1
    monkeypatch.setenv(KERNELS_ENV, "0")
    np.testing.assert_array_equal(bits(rescale_on(*args, jnp.bfloat16, "cuda")), want)
    assert len(calls) == 1
    monkeypatch.setenv(KERNELS_ENV, "of")
    with pytest.raises(ValueError, match=KERNELS_ENV):
        rescale_on(*args, jnp.bfloat16, "cuda")


def test_fp8_gemm_on_cuda_traces_the_kernel(monkeypatch, rng):
    """The GEMM's CUDA branch (traced, not run) holds one rescale kernel; with the switch off none
    (the switch is read when fp8_gemm is traced: its jit cache is cleared in between)."""
    import jax_mxfp4 as mx

    a = mx.quantize(jnp.asarray(rng.standard_normal((1, 64, 64)), jnp.float32), 2)
    b = mx.quantize(jnp.asarray(rng.standard_normal((1, 32, 64)), jnp.float32), 2)
    jaxpr = lambda: str(jax.make_jaxpr(lambda a, b: fp8_backend.fp8_gemm(a, b, jnp.bfloat16, "default", "cuda"))(a, b))  # noqa: E731
    assert jaxpr().count("name=mxfp4_fp8_rescale") == 1
    monkeypatch.setenv(KERNELS_ENV, "0")
    fp8_backend.fp8_gemm.clear_cache()
    assert jaxpr().count("name=mxfp4_fp8_rescale") == 0
    fp8_backend.fp8_gemm.clear_cache()


def test_kernel_lowers_for_cuda():
    """Triton lowering (no GPU needed): a ragged batch and the 8192^2 training shape."""
    for b, m, n in ((3, 100, 200), (1, 8192, 8192)):
        s = lambda *sh, dt=jnp.int32: jax.ShapeDtypeStruct(sh, dt)  # noqa: E731
        traced = jax.jit(lambda *a: rescale_kernel(*a, jnp.bfloat16)).trace(
            s(b, m, n, dt=jnp.bfloat16), s(b, m), s(b, n), s(b, m, dt=jnp.bool_), s(b, n, dt=jnp.bool_))
        assert "triton" in traced.lower(lowering_platforms=("cuda",)).as_text()


def test_kernel_errors_name_the_argument(rng):
    acc, el, er, nl, nr = random_data(rng, 1, 8, 16, jnp.float32)
    with pytest.raises(ValueError, match="e_rhs"):
        rescale_kernel(acc, el, er[:, :8], nl, nr, jnp.float32, interpret=True)
    with pytest.raises(ValueError, match="e_lhs"):
        rescale_kernel(acc, el.astype(jnp.int16), er, nl, nr, jnp.float32, interpret=True)
    with pytest.raises(ValueError, match="nan_cols"):
        rescale_kernel(acc, el, er, nl, nr.astype(jnp.int32), jnp.float32, interpret=True)
    with pytest.raises(ValueError, match="acc"):
        rescale_kernel(acc[0], el, er, nl, nr, jnp.float32, interpret=True)
    with pytest.raises(ValueError, match="out_dtype"):
        rescale_kernel(acc, el, er, nl, nr, jnp.int32, interpret=True)
    with pytest.raises(ValueError, match="block"):
        rescale_kernel(acc, el, er, nl, nr, jnp.float32, block=(24, 32), interpret=True)
    empty = rescale_kernel(acc[:, :0], el[:, :0], er, nl[:, :0], nr, jnp.bfloat16, interpret=True)
    assert empty.shape == (1, 0, 16) and empty.dtype == jnp.bfloat16
    with pytest.raises(ValueError, match=r"block must be a \(bm, bn\) tuple"):  # was: not enough values to unpack
        rescale_kernel(acc, el, er, nl, nr, jnp.float32, block=(32,), interpret=True)

