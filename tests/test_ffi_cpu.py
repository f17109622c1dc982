"""Backend "ffi-cpu" (C++ reference handler through XLA FFI) against backend "xla" and a float64
NumPy oracle written here from the OCP MX rules.

Stated bound. Every E2M1 x E2M1 product is exact in float32 and each 32-element block sum is
exact, so the handler rounds only when adding the K/32 block sums (fixed order) and once to the
output dtype. Backend "xla" rounds the K products' float32 accumulation in XLA's order. With
u = 2^-24 and g(n) = n u / (1 - n u), S = sum_k |a_k b_k| (float64):
  |ffi - exact|  <= g(K/32) S          |ffi - xla| <= (g(K/32) + g(K)) S
(plus K 2^-126 for products that flush). Where every partial sum is exact (all scales equal)
the two backends and the oracle must agree bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_mxfp4 as mx
from jax_mxfp4 import Recipe
from jax_mxfp4.backends.base import GemmProblem
from jax_mxfp4.dispatch import BackendUnavailableError, decide
from jax_mxfp4.ffi import primitive, registration

DN = (((1,), (1,)), ((), ()))
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float64)
U = 2.0**-24


def g(n):
    return n * U / (1 - n * U)


def random_mx(rng, rows, k, scale_lo=120, scale_hi=134):
    """MXFP4Array [rows, K] (axis 1) from random codes and scale bytes."""
    data = rng.integers(0, 256, (rows, k // 2), dtype=np.uint8)
    scales = rng.integers(scale_lo, scale_hi + 1, (rows, k // 32), dtype=np.uint8)
    return mx.MXFP4Array(
        jnp.asarray(data), jnp.asarray(scales.view(ml_dtypes.float8_e8m0fnu)), 1, (rows, k), jnp.float32
    )


def oracle(q):
    """float64 [rows, K] values: E2M1 x 2^(s-127), 0xFF -> NaN, |v| < 2^-126 -> signed zero."""
    data = np.asarray(q.data)
    s = np.asarray(q.plain_scales()).view(np.uint8).astype(np.int64)
    codes = np.stack([data & 0xF, data >> 4], -1).reshape(data.shape[0], -1)
    vals = E2M1[codes]
    sc = np.repeat(s, 32, axis=1)
    v = vals * np.ldexp(1.0, sc - 127)
    v = np.where(np.abs(v) < 2.0**-126, np.copysign(0.0, vals), v)
    return np.where(sc == 0xFF, np.nan, v)


def run(lhs, rhs, backend, out=jnp.float32, layout="plain", jit=False):
    f = lambda a, b: mx.dot_general(a, b, DN, preferred_element_type=out,
                                    recipe=Recipe(backend=backend, scale_layout=layout))
    if jit:
        f = jax.jit(f)
    return np.asarray(f(lhs, rhs))


@pytest.mark.parametrize("m,n,k", [(16, 16, 32), (32, 48, 256), (7, 5, 96)])
def test_bit_exact_when_all_partial_sums_are_exact(m, n, k):
    rng = np.random.default_rng(m * n + k)
    lhs, rhs = random_mx(rng, m, k, 127, 127), random_mx(rng, n, k, 127, 127)
    want = oracle(lhs) @ oracle(rhs).T  # multiples of 1/4 below 2^14: exact in float32
    ffi = run(lhs, rhs, "ffi-cpu")
    np.testing.assert_array_equal(ffi, want.astype(np.float32))
    np.testing.assert_array_equal(ffi, run(lhs, rhs, "xla"))


@pytest.mark.parametrize("layout", ["plain", "swizzled"])
@pytest.mark.parametrize("m,n,k", [(32, 16, 512), (40, 24, 96), (64, 64, 1024)])
def test_matches_xla_and_oracle_within_the_bound(m, n, k, layout):
    rng = np.random.default_rng(k + m)
    lhs, rhs = random_mx(rng, m, k), random_mx(rng, n, k)
    a, b = oracle(lhs), oracle(rhs)
    exact = a @ b.T
    s = np.abs(a) @ np.abs(b).T
    ffi = run(lhs, rhs, "ffi-cpu", layout=layout, jit=True).astype(np.float64)
    xla = run(lhs, rhs, "xla").astype(np.float64)
    assert np.all(np.abs(ffi - exact) <= g(k // 32) * s + k * 2.0**-126)
    assert np.all(np.abs(ffi - xla) <= (g(k // 32) + g(k)) * s + k * 2.0**-126)
    assert not np.array_equal(exact, np.zeros_like(exact))


def test_swizzled_layout_is_decoded_independently():
    """The C++ handler reads swizzled bytes with the closed-form index (§1.6): a result equal to
    the plain-layout one checks jax_mxfp4.layout.swizzle, and a wrong permutation would not."""
    rng = np.random.default_rng(3)
    m, n, k = 40, 24, 96  # rows and K/32 both need padding
    lhs, rhs = random_mx(rng, m, k, 100, 150), random_mx(rng, n, k, 100, 150)
    plain = run(lhs, rhs, "ffi-cpu", layout="plain")
    np.testing.assert_array_equal(run(lhs, rhs, "ffi-cpu", layout="swizzled"), plain)
    # Feed the handler a transposed-tile permutation instead: it must disagree.
    problem = GemmProblem(1, m, n, k, np.dtype(np.float32), "swizzled", "cpu")
    from jax_mxfp4.backends.ffi_cpu import packed_operands

    ld, ls, rd, rs = packed_operands(
        mx.MXFP4Array(lhs.data[None], lhs.scales[None], 2, (1, m, k), jnp.float32),
        mx.MXFP4Array(rhs.data[None], rhs.scales[None], 2, (1, n, k), jnp.float32), problem)
    registration.ensure_registered()
    good = primitive.mxfp4_gemm(ld, ls, rd, rs, out_dtype=np.float32, scale_layout="swizzled", backend="ffi-cpu")
    np.testing.assert_array_equal(np.asarray(good)[0], plain)
    bad_ls = jnp.swapaxes(ls.reshape(1, 2, 32, 8), 2, 3).reshape(ls.shape)  # wrong order, same bytes
    bad = primitive.mxfp4_gemm(ld, bad_ls, rd, rs, out_dtype=np.float32, scale_layout="swizzled", backend="ffi-cpu")
    assert not np.array_equal(np.asarray(bad)[0], plain)


@pytest.mark.parametrize("out", [jnp.bfloat16, jnp.float16])
def test_narrow_outputs_are_one_rne_rounding_of_the_float32_result(out):
    """bf16/f16 = RNE(float32 accumulator), compared with XLA's own converts; scales spread the
    results over f16 subnormals, normals and overflow to inf."""
    rng = np.random.default_rng(11)
    lhs, rhs = random_mx(rng, 32, 128, 100, 127), random_mx(rng, 32, 128, 100, 140)
    f32 = run(lhs, rhs, "ffi-cpu")
    narrow = run(lhs, rhs, "ffi-cpu", out=out)
    want = np.asarray(jnp.asarray(f32).astype(out))
    assert narrow.dtype == want.dtype
    np.testing.assert_array_equal(narrow.view(np.uint16), want.view(np.uint16))
    if out == jnp.float16:
        a = np.abs(f32)
        assert (a < 2.0**-14).any() and (a > 0).any() and (a > 65520).any()


def test_special_scale_bytes_match_xla():
    """0xFF -> NaN block; 0x00 (2^-127) and 0x01 flush small elements to zero (package rule)."""
    rng = np.random.default_rng(5)
    lhs, rhs = random_mx(rng, 16, 128), random_mx(rng, 16, 128)
    ls = np.asarray(lhs.scales).view(np.uint8).copy()
    ls[0, 1] = 0xFF
    ls[1, :] = 0x00
    ls[2, :] = 0x01
    ls[3:, :] = 0x03  # keep the other rows' products finite against 2^123
    rs = np.asarray(rhs.scales).view(np.uint8).copy()
    rs[:, :] = 250  # 2^123 (6 x 2^123 is finite): products with the tiny scales land near 2^-3
    lhs = mx.MXFP4Array(lhs.data, jnp.asarray(ls.view(ml_dtypes.float8_e8m0fnu)), 1, lhs.shape, jnp.float32)
    rhs = mx.MXFP4Array(rhs.data, jnp.asarray(rs.view(ml_dtypes.float8_e8m0fnu)), 1, rhs.shape, jnp.float32)
    ffi, xla = run(lhs, rhs, "ffi-cpu"), run(lhs, rhs, "xla")
    assert np.isnan(ffi[0]).all() and not np.isnan(ffi[1:]).any()
    np.testing.assert_array_equal(ffi, xla)
    want = oracle(lhs)[1:3] @ oracle(rhs).T
    np.testing.assert_allclose(ffi[1:3], want, rtol=1e-6)


def test_batch_dims_and_vmap():
    rng = np.random.default_rng(9)
    x = jnp.asarray(rng.standard_normal((3, 32, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((3, 16, 64)), jnp.float32)
    dn = (((2,), (2,)), ((0,), (0,)))
    f = lambda b: (lambda a, c: mx.dot_general(a, c, dn, recipe=Recipe(backend=b)))
    batched = np.asarray(f("ffi-cpu")(x, w))
    one = lambda a, c: mx.dot_general(a, c, DN, recipe=Recipe(backend="ffi-cpu"))
    for i in range(3):  # the batch dim reaches the handler as B: same bits as B separate GEMMs
        np.testing.assert_array_equal(batched[i], np.asarray(one(x[i], w[i])))
    np.testing.assert_allclose(batched, np.asarray(f("xla")(x, w)), rtol=1e-5, atol=1e-5)
    # vmap of a batched GEMM (rank-3 operands) with one unmapped operand, nested twice.
    g2 = jax.vmap(jax.vmap(f("ffi-cpu"), in_axes=(0, None)), in_axes=(0, None))
    xx = jnp.stack([jnp.stack([x * (i + 2 * j + 1) for i in range(4)]) for j in range(2)])  # [2, 4, 3, 32, 64]
    got = np.asarray(g2(xx, w))
    assert got.shape == (2, 4, 3, 32, 16)
    for i in range(2):
        for j in range(4):
            np.testing.assert_array_equal(got[i, j], np.asarray(f("ffi-cpu")(xx[i, j], w)))


def test_primitive_vmap_rank2_and_mapped_axis_not_leading():
    rng = np.random.default_rng(1)
    qs = [random_mx(rng, 16, 64) for _ in range(4)]
    rhs = random_mx(rng, 16, 64)
    ld = jnp.stack([q.data for q in qs], axis=1)  # mapped axis 1
    ls = jnp.stack([q.scales for q in qs], axis=1)
    registration.ensure_registered()
    f = lambda a, s: primitive.mxfp4_gemm(a, s, rhs.data, rhs.scales, out_dtype=np.float32,
                                          scale_layout="plain", backend="ffi-cpu")
    got = np.asarray(jax.jit(jax.vmap(f, in_axes=(1, 1)))(ld, ls))
    for i, q in enumerate(qs):
        np.testing.assert_array_equal(got[i], run(q, rhs, "ffi-cpu"))


def test_trace_time_errors_name_the_argument():
    rng = np.random.default_rng(0)
    q = random_mx(rng, 16, 64)
    call = lambda **kw: primitive.mxfp4_gemm(
        kw.get("ld", q.data), kw.get("ls", q.scales), q.data, q.scales,
        out_dtype=kw.get("out", np.float32), scale_layout=kw.get("layout", "plain"), backend="ffi-cpu")
    with pytest.raises(ValueError, match="lhs_scales shape"):
        call(ls=q.scales[:, :1])
    with pytest.raises(TypeError, match="lhs_data must be uint8"):
        call(ld=q.data.astype(jnp.int8))
    with pytest.raises(ValueError, match="scale_layout"):
        call(layout="tiled")
    with pytest.raises(ValueError, match="out_dtype"):
        call(out=np.float64)


@pytest.mark.parametrize(
    "case,match",
    [
        ("scales_shape", "lhs scales has shape \\[16, 1\\], expected \\[16, 2\\]"),
        ("layout_attr", "scale_layout must be \"plain\" or \"swizzled\""),
        ("out_dtype", "out must be one of"),
        ("k_mismatch", "rhs data has shape"),
        ("data_dtype", "must be uint8"),
    ],
)
def test_handler_validates_and_returns_errors(case, match):
    """The C++ checks run even when Python's are bypassed (raw ffi_call): errors, never aborts."""
    registration.ensure_registered()
    rng = np.random.default_rng(0)
    ld = jnp.asarray(rng.integers(0, 256, (16, 32), dtype=np.uint8))
    ls = jnp.full((16, 2), 127, jnp.uint8)
    rd, rs = ld, ls
    out = jax.ShapeDtypeStruct((16, 16), jnp.float32)
    layout = "plain"
    if case == "scales_shape":
        ls = ls[:, :1]
    elif case == "layout_attr":
        layout = "diagonal"
    elif case == "out_dtype":
        out = jax.ShapeDtypeStruct((16, 16), jnp.int32)
    elif case == "k_mismatch":
        rd = rd[:, :16]
    elif case == "data_dtype":
        ld = ld.astype(jnp.int8)
    f = jax.ffi.ffi_call(registration.CPU_TARGET, out)
    with pytest.raises(Exception, match=match) as info:
        jax.block_until_ready(f(ld, ls, rd, rs, scale_layout=layout))
    assert "jax_mxfp4_gemm_cpu" in str(info.value)


def test_dispatch_rules_on_cpu():
    p = GemmProblem(1, 32, 32, 256, np.dtype(np.float32), "plain", "cpu")
    assert decide(p, "auto").backend == "xla"  # ffi-cpu is explicit-only
    assert decide(p, "ffi-cpu").backend == "ffi-cpu"
    pf = GemmProblem(1, 32, 32, 256, np.dtype(np.float32), "plain", "cpu", lhs_kind="float")
    with pytest.raises(BackendUnavailableError, match="ffi-cpu.*w4a16"):
        decide(pf, "ffi-cpu")
    with pytest.raises(BackendUnavailableError, match="hipblaslt.*gfx950.*'cpu'"):
        decide(p, "hipblaslt")


def test_registration_platform_strings_are_exact():
    regs = registration.native().registrations()
    assert {k: v[0] for k, v in regs.items()} == {
        "jax_mxfp4_gemm_cpu": "cpu",
        "jax_mxfp4_gemm_hipblaslt": "ROCM",
    }
    assert registration.FFI_PLATFORMS == {k: v[0] for k, v in regs.items()}
    assert registration.NATIVE_IMPORT_ERROR is None


def test_import_without_the_compiled_module_records_why(tmp_path):
    """A copy of the package without _native imports fine; the FFI backends say why not."""
    import pathlib
    import shutil
    import subprocess
    import sys

    src = pathlib.Path(mx.__file__).resolve().parent
    shutil.copytree(src, tmp_path / "jax_mxfp4", ignore=shutil.ignore_patterns("_native*", "__pycache__"))
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import jax_mxfp4 as mx, jax;"
        "import jax.numpy as jnp;"
        "assert mx.__file__.startswith(sys.argv[1]), mx.__file__;"
        "x = jax.ShapeDtypeStruct((32, 256), jnp.float32);"
        "d = mx.explain(x, x, (((1,), (1,)), ((), ())));"
        "print(d.backend); print(d.reasons['ffi-cpu']); print(d.reasons['hipblaslt'])"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120,
                         cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr
    backend, ffi_reason, hip_reason = out.stdout.strip().splitlines()[-3:]
    assert backend == "xla"
    assert "jax_mxfp4._native is not built" in ffi_reason
    assert "jax_mxfp4._native is not built" in hip_reason
