"""hipBLASLt MXFP4 backend on real gfx950 hardware (skipped elsewhere; see conftest.py).

What only hardware can show: that hipBLASLt accepts the declared enums/layouts, reads packed FP4
(element 2i in the low nibble) and the scale layouts as documented, finds algorithms for these
shapes, and that its float32 accumulation stays within the stated bound:
  |out - exact| <= g(K) |A||B|^T + half an output ulp,   g(n) = n 2^-24 / (1 - n 2^-24)
against the exact float64 product (small/medium shapes) and against backend "ffi-cpu" (the C++
reference) run on the host CPU device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_mxfp4 as mx
from jax_mxfp4 import Recipe, dispatch
from jax_mxfp4.backends.base import GemmProblem
from jax_mxfp4.ffi import primitive, registration

DN = (((1,), (1,)), ((), ()))
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float64)
U = 2.0**-24
HALF_ULP = {"float32": 0.0, "bfloat16": 2.0**-8, "float16": 2.0**-11}
HALF_SUBNORMAL = {"float32": 0.0, "bfloat16": 2.0**-134, "float16": 2.0**-25}


def random_mx(rng, rows, k, lo=118, hi=134):
    data = rng.integers(0, 256, (rows, k // 2), dtype=np.uint8)
    scales = rng.integers(lo, hi, (rows, k // 32), dtype=np.uint8)
    q = mx.MXFP4Array(jnp.asarray(data), jnp.asarray(scales.view(ml_dtypes.float8_e8m0fnu)), 1, (rows, k), jnp.float32)
    codes = np.stack([data & 0xF, data >> 4], -1).reshape(rows, k)
    vals = E2M1[codes] * np.ldexp(1.0, np.repeat(scales.astype(np.int64), 32, axis=1) - 127)
    return q, vals


def hip(a, b, out="bfloat16", layout="plain"):
    f = jax.jit(lambda x, y: mx.dot_general(x, y, DN, preferred_element_type=getattr(jnp, out),
                                            recipe=Recipe(backend="hipblaslt", scale_layout=layout)))
    return np.asarray(f(a, b)).astype(np.float64)


def cpu_reference(a, b, out):
    """The C++ reference handler on the host CPU device (primitive called directly: dispatch
    decides for the default platform, rocm)."""
    registration.ensure_registered()
    cpu = jax.devices("cpu")[0]
    args = [jax.device_put(x, cpu) for x in (a.data, a.scales, b.data, b.scales)]
    f = jax.jit(lambda *xs: primitive.mxfp4_gemm(*xs, out_dtype=np.dtype(getattr(jnp, out)),
                                                 scale_layout="plain", backend="ffi-cpu"))
    return np.asarray(f(*args)).astype(np.float64)


def assert_within_bound(got, exact, s, k, out):
    acc = k * U / (1 - k * U) * s
    bound = acc + HALF_ULP[out] * (np.abs(exact) + acc) + HALF_SUBNORMAL[out] + 2.0**-126 * k
    err = np.abs(got - exact)
    assert np.all(err <= bound), f"max err/bound = {np.max(err / np.maximum(bound, 1e-300)):.3g}"


SHAPES = [(32, 32, 256), (16, 48, 128), (64, 32, 384), (128, 256, 640), (256, 128, 1152), (1024, 1024, 2048)]


@pytest.mark.parametrize("envelope", ["validated", "documented"])
@pytest.mark.parametrize("layout", ["plain", "swizzled"])
@pytest.mark.parametrize("out", ["bfloat16", "float32"])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_native_vs_exact_and_cpu_reference(monkeypatch, m, n, k, out, layout, envelope):
    # "documented" (JAX_MXFP4_HIPBLASLT_ENVELOPE) is the wider, unverified envelope: these runs
    # are what would verify it (M % 16, N % 16, K % 128 shapes).
    monkeypatch.setenv("JAX_MXFP4_HIPBLASLT_ENVELOPE", envelope)
    rng = np.random.default_rng(m + n + k)
    (a, ea), (b, eb) = random_mx(rng, m, k), random_mx(rng, n, k)
    problem = GemmProblem(1, m, n, k, np.dtype(getattr(jnp, out)), layout, "rocm")
    why = dispatch.get_backend("hipblaslt").rejects(problem)
    if why:
        pytest.skip(f"hipblaslt routes this case elsewhere: {why}")
    got = hip(a, b, out, layout)
    exact = ea @ eb.T
    s = np.abs(ea) @ np.abs(eb).T
    assert_within_bound(got, exact, s, k, out)
    ref = cpu_reference(a, b, out)
    assert_within_bound(got, ref, s, 2 * k, out)  # both sides round: twice the budget


@pytest.mark.parametrize("m,n,k", [(4096, 4096, 4096), (8192, 1024, 8192), (2048, 4096, 1408)])
def test_large_shapes_vs_xla_on_device(m, n, k):
    """Large shapes: against backend "xla" on the same GPU (both accumulate in float32)."""
    rng = np.random.default_rng(7)
    (a, _), (b, _) = random_mx(rng, m, k), random_mx(rng, n, k)
    got = hip(a, b, "float32")
    xla = np.asarray(jax.jit(lambda x, y: mx.dot_general(x, y, DN, recipe=Recipe(backend="xla")))(a, b))
    deq_a = np.abs(np.asarray(a.dequantize()).astype(np.float64))
    deq_b = np.abs(np.asarray(b.dequantize()).astype(np.float64))
    assert_within_bound(got, xla.astype(np.float64), deq_a @ deq_b.T, 2 * k, "float32")


def test_packed_nibble_order_and_scales_on_device():
    """One nonzero element per row: lhs[i, k0] = 1.5 in the HIGH nibble of byte k0/2 (k0 odd)
    with scale 2^(s-127); rhs all ones. A swapped nibble order or scale index gives another value."""
    m, n, k = 32, 32, 256
    data = np.zeros((m, k // 2), np.uint8)
    scales = np.full((m, k // 32), 127, np.uint8)
    want = np.zeros((m,), np.float64)
    for i in range(m):
        k0 = 2 * (i % (k // 2)) + 1
        data[i, k0 // 2] = 0x3 << 4  # code 3 = 1.5 in the high nibble
        scales[i, k0 // 32] = 127 + (i % 5)
        want[i] = 1.5 * 2.0 ** (i % 5)
    a = mx.MXFP4Array(jnp.asarray(data), jnp.asarray(scales.view(ml_dtypes.float8_e8m0fnu)), 1, (m, k), jnp.float32)
    ones = np.full((n, k // 2), 0x22, np.uint8)  # code 2 = 1.0 in both nibbles
    b = mx.MXFP4Array(jnp.asarray(ones), jnp.asarray(np.full((n, k // 32), 127, np.uint8).view(ml_dtypes.float8_e8m0fnu)),
                      1, (n, k), jnp.float32)
    for layout in ("plain", "swizzled"):
        # plain scales are refused on hipBLASLt's TensileLite route (backends/hipblaslt.py)
        if layout == "plain" and dispatch.get_backend("hipblaslt").rejects(
                GemmProblem(1, m, n, k, np.dtype(np.float32), layout, "rocm")):
            continue
        got = hip(a, b, "float32", layout)
        np.testing.assert_array_equal(got, np.repeat(want[:, None], n, axis=1))


def test_auto_picks_hipblaslt_on_gfx950_and_routes_unsupported_shapes():
    x = jax.ShapeDtypeStruct((64, 256), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((32, 256), jnp.bfloat16)
    assert mx.explain(x, w, DN).backend == "hipblaslt"
    odd = mx.explain(jax.ShapeDtypeStruct((48, 256), jnp.bfloat16), w, DN)
    assert odd.backend != "hipblaslt" and "M % 32" in odd.reasons["hipblaslt"]
    with pytest.raises(mx.BackendUnavailableError, match="K % 256"):
        mx.explain(jax.ShapeDtypeStruct((64, 128), jnp.bfloat16), jax.ShapeDtypeStruct((32, 128), jnp.bfloat16), DN,
                   recipe=Recipe(backend="hipblaslt"))


def test_float16_output_runs_or_is_routed_with_a_reason(monkeypatch):
    monkeypatch.setenv("JAX_MXFP4_HIPBLASLT_ENVELOPE", "documented")  # f16 out: unverified envelope only
    rng = np.random.default_rng(3)
    (a, ea), (b, eb) = random_mx(rng, 64, 256, 116, 126), random_mx(rng, 64, 256, 116, 126)  # |out| < 65504
    problem = GemmProblem(1, 64, 64, 256, np.dtype(np.float16), "plain", "rocm")
    why = dispatch.get_backend("hipblaslt").rejects(problem)
    if why:
        assert "no usable algorithm" in why
        return
    assert_within_bound(hip(a, b, "float16"), ea @ eb.T, np.abs(ea) @ np.abs(eb).T, 256, "float16")


def test_handler_returns_errors_for_bad_shapes_and_attributes():
    """The Python side routes these away; the handler must still refuse them with an error."""
    registration.ensure_registered()
    ld = jnp.zeros((24, 64), jnp.uint8)  # M = 24, K = 128
    ls = jnp.full((24, 4), 127, jnp.uint8)
    rd, rs = jnp.zeros((16, 64), jnp.uint8), jnp.full((16, 4), 127, jnp.uint8)
    call = jax.ffi.ffi_call(registration.HIPBLASLT_TARGET, jax.ShapeDtypeStruct((24, 16), jnp.float32))
    with pytest.raises(Exception, match="M % 32 == 0"):
        jax.block_until_ready(call(ld, ls, rd, rs, scale_layout="plain"))
    with pytest.raises(Exception, match="scale_layout must be"):
        jax.block_until_ready(call(ld[:16], ls[:16], rd, rs, scale_layout="tiled"))
    with pytest.raises(Exception, match="lhs scales has shape"):
        jax.block_until_ready(call(ld[:16], ls[:16, :2], rd, rs, scale_layout="plain"))


def test_batch_and_vmap_on_device():
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((3, 64, 256)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((3, 32, 256)), jnp.float32)
    dn = (((2,), (2,)), ((0,), (0,)))
    f = lambda be: jax.jit(lambda a, c: mx.dot_general(a, c, dn, recipe=Recipe(backend=be)))
    got = np.asarray(f("hipblaslt")(x, w))
    np.testing.assert_allclose(got, np.asarray(f("xla")(x, w)), rtol=1e-5, atol=1e-4)
    v = jax.vmap(lambda a: mx.dot_general(a, w[0], DN, recipe=Recipe(backend="hipblaslt")))(x)
    for i in range(3):
        np.testing.assert_allclose(np.asarray(v)[i], np.asarray(f("xla")(x[i:i + 1], w[:1]))[0], rtol=1e-5, atol=1e-4)
