"""Route "hipblaslt-grouped" of jax_mxfp4.ragged_dot (jax_mxfp4/backends/hipblaslt_ragged.py) on the CPU:
the hipBLASLt backend's batched GEMM is replaced by the recording double of hipBLASLt + HIP
(tests/hipblaslt_double.py: the handler's real call path, gates included, computing D from the
descriptors it receives), called from inside ``jit`` through ``jax.pure_callback``; group_sizes
stays traced, so nothing can read it on the host. The values are compared with the exact route
(``Recipe(backend="xla")``) and a float64 reference, the log with the per-group calls.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_mxfp4 as mx
from jax_mxfp4 import dispatch, ragged
from jax_mxfp4.backends import hipblaslt_ragged as grouped
from jax_mxfp4.backends import hipblaslt as hb
from jax_mxfp4.backends.ffi_cpu import packed_operands
from jax_mxfp4.ffi import export_safety_checks, registration

from hipblaslt_double import load
from mx_reference import qdq
from test_hipblaslt_double import calls_named, desc_attrs, A_SCALE_POINTER, B_SCALE_POINTER, HIP_R_4F_E2M1

double = load()
NK_DN = lax.RaggedDotDimensionNumbers((((1,), (2,)), ((), ())), (0,), (0,))  # experts [G, N, K]
EXACT = mx.Recipe(backend="xla")


@pytest.fixture(autouse=True)
def _default_environment(monkeypatch):
    monkeypatch.delenv(hb.ENVELOPE_ENV, raising=False)
    monkeypatch.delenv("HIPBLASLT_USE_ROCROLLER", raising=False)


@pytest.fixture
def recorded(monkeypatch):
    """The hipBLASLt backend's GEMM run by the double; returns the list of its results (one per call)."""
    results = []

    def gemm(lhs, rhs, problem):
        ops = packed_operands(lhs, rhs, problem)
        shape = (problem.batch, problem.m, problem.n)

        def run(ld, ls, rd, rs):
            arrays = [np.ascontiguousarray(np.asarray(a).view(np.uint8)) for a in (ld, ls, rd, rs)]
            res = dict(double.gemm(*arrays, "float32", problem.scale_layout, {}, 1, 0, []))
            assert res["error"] is None, res["error"]
            res["inputs"] = arrays
            results.append(res)
            return np.frombuffer(res["out"], np.float32).reshape(shape)

        return jax.pure_callback(run, jax.ShapeDtypeStruct(shape, jnp.float32), *ops)

    monkeypatch.setattr(dispatch.get_backend("hipblaslt"), "gemm", gemm)
    return results


def experts(rng, g, n, k):
    w = jnp.asarray(rng.standard_normal((g, n, k)), jnp.float32)
    return w, mx.quantize(w, 2)


def reference(x, w, gs):
    """float64 [M, N]: each group's rows (quantized along K) times its expert [N, K] (along K)."""
    x, w = np.asarray(x, np.float32), np.asarray(w, np.float32)
    out, start = np.zeros((x.shape[0], w.shape[1])), 0
    for g, size in enumerate(gs):
        out[start:start + size] = qdq(x[start:start + size], 1) @ qdq(w[g], 1).T
        start += size
    return out


def grouped_product(x, wq, gs, recipe=mx.Recipe()):
    """The route as ragged.py stages it for ROCm, under jit with group_sizes traced."""
    f = jax.jit(lambda x, w, s: ragged._product_on(grouped.GROUPED, mx.quantize(x, 1), w, s, NK_DN, recipe))
    return np.asarray(f(x, wq, jnp.asarray(gs, jnp.int32)))


def test_per_group_calls_recorded_and_values_equal_the_exact_route(rng, recorded):
    g, m, n, k = 4, 40, 64, 256
    gs = [9, 0, 24, 2]  # an empty group; rows 35..39 in no group
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    w, wq = experts(rng, g, n, k)
    got = grouped_product(x, wq, gs)
    exact = np.asarray(mx.ragged_dot_general(x, wq, jnp.asarray(gs, jnp.int32), NK_DN, recipe=EXACT))
    np.testing.assert_allclose(got, exact, rtol=0, atol=2e-6 * np.abs(exact).max())
    np.testing.assert_allclose(got, reference(x, w, gs), rtol=0, atol=2e-6 * np.abs(exact).max())
    assert not got[35:].any() and np.abs(got[:35]).max(axis=1).all()  # rows past sum(group_sizes): zeros

    (res,) = recorded  # one FFI call
    c = 64  # min(M, capacity) = 40, rounded up to the validated envelope's M % 32
    log, buf = res["log"], res["buffers"]
    lay = [(r["type"], r["rows"], r["cols"], r["ld"]) for r in calls_named(log, "hipblasLtMatrixLayoutCreate")]
    assert lay[:2] == [(HIP_R_4F_E2M1, k, n, k), (HIP_R_4F_E2M1, k, c, k)]  # A = expert, B = C padded rows
    mms = calls_named(log, "hipblasLtMatmul")
    assert len(mms) == g  # one batch-1 GEMM per group, empty ones included
    ptrs = [a for a in desc_attrs(log) if a[0] in (A_SCALE_POINTER, B_SCALE_POINTER)][2:]  # after the dummies
    for i, mm in enumerate(mms):
        assert mm["A"] == buf["rhs"] + i * n * k // 2 and mm["B"] == buf["lhs"] + i * c * k // 2
        assert mm["D"] == buf["out"] + i * c * n * 4
        assert ptrs[2 * i:2 * i + 2] == [(A_SCALE_POINTER, 8, buf["rhs_scales"] + i * n * k // 32),
                                         (B_SCALE_POINTER, 8, buf["lhs_scales"] + i * c * k // 32)]
    # The padded layout: group g's rows first in its C rows, zero codes after them.
    ld = res["inputs"][0].reshape(g, c, k // 2)
    xq = np.asarray(mx.quantize(x, 1).data)
    start = 0
    for i, size in enumerate(gs):
        np.testing.assert_array_equal(ld[i, :size], xq[start:start + size])
        assert not ld[i, size:].any()
        start += size


def test_a_group_of_all_rows_and_empty_groups(rng, recorded):
    g, m, n, k = 3, 32, 32, 256
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    w, wq = experts(rng, g, n, k)
    for gs in ([0, m, 0], [0, 0, 0]):
        got = grouped_product(x, wq, gs)
        np.testing.assert_allclose(got, reference(x, w, gs), rtol=0, atol=2e-6 * max(np.abs(got).max(), 1))
    assert not got.any()  # no group has rows: all zeros
    assert [len(calls_named(r["log"], "hipblasLtMatmul")) for r in recorded] == [g, g]


def test_swizzled_scales_per_group(rng, recorded):
    g, m, n, k = 2, 32, 32, 256
    gs = [20, 12]
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    w, wq = experts(rng, g, n, k)
    got = grouped_product(x, wq, gs, mx.Recipe(scale_layout="swizzled"))
    np.testing.assert_allclose(got, reference(x, w, gs), rtol=0, atol=2e-6 * np.abs(got).max())
    modes = [a for a in desc_attrs(recorded[0]["log"]) if a[0] in (31, 32)]
    assert modes == [(31, 4, 1001), (32, 4, 1001)]  # BLK32_UE8M0_32_8_EXT for A and B


def test_capacity_sets_the_rows_per_group(rng, recorded):
    g, m, n, k = 2, 96, 32, 256
    gs = [20, 7]
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    w, wq = experts(rng, g, n, k)
    got = grouped_product(x, wq, gs, mx.Recipe(ragged_capacity=20))
    np.testing.assert_allclose(got, reference(x, w, gs), rtol=0, atol=2e-6 * np.abs(got).max())
    lay = calls_named(recorded[0]["log"], "hipblasLtMatrixLayoutCreate")
    assert lay[1]["cols"] == 32  # capacity 20 rounded up to M % 32, not all 96 rows


def test_capacity_overflow_is_an_error_when_concrete_and_nan_under_jit(rng):
    x = jnp.asarray(rng.standard_normal((32, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((3, 64, 16)), jnp.float32)
    recipe = mx.Recipe(ragged_capacity=8)
    over = jnp.asarray([8, 9, 0], jnp.int32)
    with pytest.raises(ValueError, match=r"exceeds Recipe.ragged_capacity=8 at groups \[1\] \(sizes \[9\]\)"):
        mx.ragged_dot(x, w, over, recipe=recipe)
    f = jax.jit(lambda x, w, s: mx.ragged_dot(x, w, s, recipe=recipe))
    assert np.isnan(np.asarray(f(x, w, over))).all()
    fits = jnp.asarray([8, 8, 0], jnp.int32)
    np.testing.assert_array_equal(np.asarray(f(x, w, fits)), np.asarray(mx.ragged_dot(x, w, fits)))


@pytest.mark.parametrize("value,error", [(0, ValueError), (-3, ValueError), (True, TypeError), ("8", TypeError)])
def test_recipe_capacity_is_validated(value, error):
    with pytest.raises(error, match="Recipe.ragged_capacity"):
        mx.Recipe(ragged_capacity=value)


def sds(*shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def explain(x, w, dn=NK_DN, platform="rocm", **recipe):
    return ragged.explain_ragged_dot(x, w, jnp.zeros(w.shape[0], jnp.int32), dn, platform=platform,
                                     recipe=mx.Recipe(**recipe))


def test_explain_takes_the_route_on_rocm_only():
    r = explain(sds(8, 256), sds(4, 64, 256))
    assert r.route == grouped.GROUPED and "group_sizes stays on the device" in r.reason
    for platform in ("cpu", "cuda"):
        r = explain(sds(8, 256), sds(4, 64, 256), platform=platform)
        assert r.route != grouped.GROUPED and grouped.GROUPED not in r.reason
    assert explain(sds(8, 256), sds(4, 64, 256), backend="xla").route == "exact"


@pytest.mark.parametrize(
    "x,w,dn,recipe,match",
    [
        (sds(8, 256), sds(4, 48, 256), NK_DN, {}, "hipBLASLt envelope.*N % 32 == 0.*N=48"),
        (sds(8, 384), sds(4, 64, 384), NK_DN, {}, "hipBLASLt envelope.*K=384"),
        (sds(8, 256), sds(4, 256, 64), None, {}, r"contracted along dim 1 \(\[G, K, N\]\).*TN only"),
        (sds(8, 256), sds(4, 64, 256), NK_DN, {"quantize_activations": False}, "two MXFP4 operands"),
        (sds(300, 256), sds(4, 64, 256), NK_DN, {}, "pads every group to all M=300 rows.*ragged_capacity"),
    ],
)
def test_shapes_outside_fall_back_with_the_reason(x, w, dn, recipe, match):
    r = explain(x, w, dn or ragged._RAGGED_DOT_DN, **recipe)
    assert r.route == "bf16-decode"
    assert re.search("not hipblaslt-grouped: .*" + match, r.reason), r.reason


def test_documented_envelope_and_capacity_widen_the_route(monkeypatch):
    assert explain(sds(300, 256), sds(4, 64, 256), ragged_capacity=100).route == grouped.GROUPED
    monkeypatch.setenv(hb.ENVELOPE_ENV, "documented")
    assert explain(sds(8, 256), sds(4, 48, 256)).route == grouped.GROUPED
    assert grouped.capacity_rows(8, 48, 256, None) == (16, "")  # M % 16 suffices there


def test_device_gates_on_rocm_are_the_hipblaslt_backend_s(monkeypatch):
    gfx942 = {"loaded": True, "error": "", "devices": [
        {"ordinal": 0, "arch": "gfx942", "hipblaslt_version": 100300, "hip_runtime_version": 70100000, "error": ""}]}
    for module in (hb, dispatch, grouped):
        monkeypatch.setattr(module, "current_platform", lambda: "rocm")
    monkeypatch.setattr(registration, "hipblaslt_status", lambda: gfx942)
    r = explain(sds(8, 256), sds(4, 64, 256))
    assert r.route == "bf16-decode" and "needs gfx950" in r.reason and "gfx942" in r.reason


def test_export_for_rocm_has_one_hipblaslt_call_on_the_padded_layout(rng):
    g, m, n, k = 4, 8, 64, 256
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    wq = mx.quantize(jnp.asarray(rng.standard_normal((g, n, k)), jnp.float32), 2)
    f = jax.jit(lambda x, w, s: mx.ragged_dot_general(x, w, s, NK_DN))
    exp = jax.export.export(f, platforms=["rocm"], disabled_checks=export_safety_checks())(
        x, wq, jax.ShapeDtypeStruct((g,), jnp.int32))
    calls = [line for line in exp.mlir_module().splitlines() if "stablehlo.custom_call" in line]
    assert len(calls) == 1 and "@jax_mxfp4_gemm_hipblaslt" in calls[0]
    c = 32
    assert f"tensor<{g}x{c}x{k // 2}xui8>" in calls[0] and f"tensor<{g}x{c}x{n}xf32>" in calls[0]
    # cpu + rocm: the route is lowered for ROCm only; the exported program runs here on "exact".
    gs = jnp.asarray([3, 0, 4, 1], jnp.int32)
    both = jax.export.export(f, platforms=["cpu", "rocm"], disabled_checks=export_safety_checks())(x, wq, gs)
    assert both.mlir_module().count("@jax_mxfp4_gemm_hipblaslt") == 1
    exact = mx.ragged_dot_general(x, wq, gs, NK_DN, recipe=EXACT)
    np.testing.assert_array_equal(np.asarray(both.call(x, wq, gs)), np.asarray(exact))
