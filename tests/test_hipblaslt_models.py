"""hipBLASLt behaviour the recording double models beyond the call contract
(reference/hipblaslt-mxfp4.md §7), each model behind a switch of the double that these tests turn
on, and the handler's rules that keep the user from a wrong result under each:

- model_heuristic: the heuristic returns nothing for float16 out, for missing scale pointers and
  where no rocRoller tile divides M/N/K; the handler reports it (never runs without an algorithm);
- model_tensilelite_scales: TensileLite reads plain (VEC32) scales in the pre-swizzled order; the
  handler refuses plain scales on that route for every shape;
- model_rocroller_dense: rocRoller ignores ld; the handler's operands are dense;
- model_route_at_create: the route is fixed when a handle is created; the handler snapshots it at
  its first handle and refuses a changed HIPBLASLT_USE_ROCROLLER;
- model_mode_version: BLK32_UE8M0_32_8_EXT (1001) is INVALID_VALUE below 1.3.0; the handler never
  sets it there;
- model_workspace_per_solution: each algorithm needs its own workspace; the handler gives the
  chosen one exactly what it asks for;
- model_c_read: only rocRoller with plain scales reads C; the handler zeroes C there and only there;
- model_kernel_per_handle: rocRoller generates kernels per handle; the handler runs the heuristic
  on each new (device, stream) handle so no matmul compiles.
"""

from __future__ import annotations

import numpy as np
import pytest

from hipblaslt_double import load
from test_hipblaslt_double import NP_OUT, calls_named, cpu_reference, swizzle_np

double = load()
ROUTE_ENV = "HIPBLASLT_USE_ROCROLLER"
ENVELOPE = "JAX_MXFP4_HIPBLASLT_ENVELOPE"
OP_N, OP_T, VEC32_UE8M0, BLK32 = 111, 112, 2, 1001


@pytest.fixture(autouse=True)
def _default_environment(monkeypatch):
    monkeypatch.delenv(ENVELOPE, raising=False)
    monkeypatch.delenv(ROUTE_ENV, raising=False)


def ops(rng, m, n, k):
    """Random packed E2M1 codes and E8M0 scales near 1 for lhs [M, K] and rhs [N, K]."""
    return (rng.integers(0, 256, (m, k // 2), dtype=np.uint8), rng.integers(118, 136, (m, k // 32), dtype=np.uint8),
            rng.integers(0, 256, (n, k // 2), dtype=np.uint8), rng.integers(118, 136, (n, k // 32), dtype=np.uint8))


def run(o, out_dtype="float32", scale_layout="plain", calls=1, streams=(), **config):
    ld, ls, rd, rs = o
    if scale_layout == "swizzled":
        ls, rs = swizzle_np(ls), swizzle_np(rs)
    res = dict(double.gemm(ld, np.ascontiguousarray(ls), rd, np.ascontiguousarray(rs), out_dtype, scale_layout,
                           config, calls, 0, list(streams)))
    res["array"] = np.frombuffer(res["out"], NP_OUT[out_dtype]).reshape(ld.shape[0], rd.shape[0]) if res["out"] else None
    return res


def runtime_gemm(runtime, o, scale_layout, stream, out_dtype="float32", out_fill=0xEE):
    ld, ls, rd, rs = o
    if scale_layout == "swizzled":
        ls, rs = swizzle_np(ls), swizzle_np(rs)
    res = dict(runtime.gemm(ld, np.ascontiguousarray(ls), rd, np.ascontiguousarray(rs), out_dtype, scale_layout,
                            stream=stream, out_fill=out_fill))
    res["array"] = np.frombuffer(res["out"], NP_OUT[out_dtype]).reshape(ld.shape[0], rd.shape[0])
    return res


def exact(o, out_dtype="float32"):
    return cpu_reference(*o, out_dtype)


def raw(o, config, lda_pad=0, mode=VEC32_UE8M0):
    """The double driven directly as the handler would (A = rhs, B = lhs), ld = K + lda_pad for A."""
    ld, ls, rd, rs = o
    n, m, k = rd.shape[0], ld.shape[0], 2 * ld.shape[1]
    a = np.concatenate([rd, np.full((n, lda_pad // 2), 0x77, np.uint8)], axis=1) if lda_pad else rd
    if mode == BLK32:
        ls, rs = swizzle_np(ls), swizzle_np(rs)
    st, out = double.raw_matmul(np.ascontiguousarray(a), ld, np.ascontiguousarray(rs), np.ascontiguousarray(ls),
                                k, n, m, k + lda_pad, k, OP_T, OP_N, mode, 4096, 4096, True, config)
    return st, np.frombuffer(out, np.float32).reshape(m, n)


# ---- model_heuristic

def test_model_heuristic_float16_out_gives_no_algorithm_and_a_clear_error(monkeypatch, rng):
    monkeypatch.setenv(ENVELOPE, "documented")
    res = run(ops(rng, 32, 32, 256), "float16", model_heuristic=True)
    assert res["code"] == "UNIMPLEMENTED" and "no usable algorithm" in res["error"] and "out=float16" in res["error"]
    (h,) = calls_named(res["log"], "hipblasLtMatmulAlgoGetHeuristic")
    assert h["empty_because"] == "no FP4 kernel writes float16"
    assert not calls_named(res["log"], "hipblasLtMatmul")


def test_model_heuristic_finds_algorithms_because_dummy_scale_pointers_are_set(rng):
    o = ops(rng, 64, 32, 512)
    res = run(o, model_heuristic=True)
    assert res["error"] is None, res["error"]
    (h,) = calls_named(res["log"], "hipblasLtMatmulAlgoGetHeuristic")
    assert h["returned"] == 1 and h["a_scale_pointer"] != 0 and h["b_scale_pointer"] != 0
    np.testing.assert_array_equal(res["array"], exact(o))


def test_model_heuristic_no_rocroller_tile_divides_documented_shape(monkeypatch, rng):
    # hipBLASLt m = N = 16, n = M = 48, k = 384: {32,32,64} needs m % 32, {16,16,128} needs k % 256.
    monkeypatch.setenv(ENVELOPE, "documented")
    res = run(ops(rng, 48, 16, 384), model_heuristic=True)
    assert res["code"] == "UNIMPLEMENTED" and "no usable algorithm" in res["error"] and "M=48 N=16 K=384" in res["error"]
    (h,) = calls_named(res["log"], "hipblasLtMatmulAlgoGetHeuristic")
    assert h["empty_because"] == "no rocRoller tile divides m, n, k"


# ---- model_tensilelite_scales (plain scales on the TensileLite route)

def test_model_tensilelite_scales_reads_plain_scales_permuted(rng):
    o = ops(rng, 64, 32, 512)
    st, out = raw(o, {"model_tensilelite_scales": True, "rocroller_library": False})
    assert st == 0 and not np.array_equal(out, exact(o))  # silently wrong: what the gate must prevent
    st, out = raw(o, {"model_tensilelite_scales": True, "rocroller_library": False}, mode=BLK32)
    assert st == 0
    np.testing.assert_array_equal(out, exact(o))


@pytest.mark.parametrize("how", ["environment", "no_rocroller_library"])
def test_plain_scales_are_refused_on_tensilelite_for_unpadded_shapes(monkeypatch, rng, how):
    # 64 x 32 x 512 is inside the validated envelope (no padding anywhere): still refused.
    config = {"model_tensilelite_scales": True}
    if how == "environment":
        monkeypatch.setenv(ROUTE_ENV, "0")
    else:
        config["rocroller_library"] = False
    o = ops(rng, 64, 32, 512)
    res = run(o, **config)
    assert res["code"] == "UNIMPLEMENTED", "ran: plain scales read in the pre-swizzled order"
    assert "TensileLite" in res["error"] and 'scale_layout="swizzled"' in res["error"]
    assert not calls_named(res["log"], "hipblasLtMatmul")
    swz = run(o, scale_layout="swizzled", **config)  # the route's own layout runs, exactly
    assert swz["error"] is None, swz["error"]
    np.testing.assert_array_equal(swz["array"], exact(o))


# ---- model_rocroller_dense

def test_model_rocroller_dense_ignores_ld_and_the_handlers_dense_operands_are_exact(rng):
    o = ops(rng, 32, 32, 256)
    st, out = raw(o, {"model_rocroller_dense": True}, lda_pad=64)
    assert st == 0 and not np.array_equal(out, exact(o))  # a padded ld would be misread
    res = run(o, model_rocroller_dense=True)
    assert res["error"] is None, res["error"]
    lay = calls_named(res["log"], "hipblasLtMatrixLayoutCreate")
    assert [(r["rows"], r["ld"]) for r in lay[:2]] == [(256, 256), (256, 256)]  # ld == K: dense
    np.testing.assert_array_equal(res["array"], exact(o))


# ---- model_route_at_create (the route is read once, when the first handle is created)

def test_route_snapshot_keeps_plain_scales_off_a_tensilelite_handle(monkeypatch, rng):
    o = ops(rng, 64, 32, 512)
    s = double.LongRuntime({"model_route_at_create": True, "model_tensilelite_scales": True})
    monkeypatch.setenv(ROUTE_ENV, "0")
    first = runtime_gemm(s, o, "swizzled", 0xA)  # creates stream A's handle on TensileLite
    assert first["error"] is None, first["error"]
    monkeypatch.delenv(ROUTE_ENV)  # now reads as rocRoller, but stream A's handle stays TensileLite
    second = runtime_gemm(s, o, "plain", 0xA)
    s.close()
    assert second["code"] == "UNIMPLEMENTED", "ran plain scales on a TensileLite handle"
    assert "TensileLite" in second["error"] and 'HIPBLASLT_USE_ROCROLLER="0"' in second["error"]


def test_route_change_after_the_first_handle_is_refused_naming_the_variable(monkeypatch, rng):
    o = ops(rng, 64, 32, 512)
    s = double.LongRuntime({"model_route_at_create": True, "model_tensilelite_scales": True})
    assert runtime_gemm(s, o, "plain", 0xA)["error"] is None  # rocRoller handles
    monkeypatch.setenv(ROUTE_ENV, "0")
    new_stream = runtime_gemm(s, o, "plain", 0xB)  # its handle would be created on TensileLite
    same_stream = runtime_gemm(s, o, "plain", 0xA)  # the existing rocRoller handle
    log = s.log()
    s.close()
    assert new_stream["code"] == "FAILED_PRECONDITION", new_stream["error"]
    assert "HIPBLASLT_USE_ROCROLLER" in new_stream["error"] and "changed" in new_stream["error"]
    assert same_stream["error"] is None, same_stream["error"]
    np.testing.assert_array_equal(same_stream["array"], exact(o))
    assert [m["stream"] for m in calls_named(log, "hipblasLtMatmul")] == [0xA, 0xA]


# ---- model_mode_version

def test_model_mode_version_refuses_mode_1001_below_1_3_and_the_gate_never_sets_it(monkeypatch, rng):
    o = ops(rng, 32, 32, 256)
    st, _ = raw(o, {"model_mode_version": True, "hipblaslt_version": 100202}, mode=BLK32)
    assert st != 0  # INVALID_VALUE at SetAttribute: the double then has no MX scale mode
    monkeypatch.setenv(ENVELOPE, "documented")
    res = run(o, scale_layout="swizzled", model_mode_version=True, hipblaslt_version=100202)
    assert res["code"] == "UNIMPLEMENTED" and "need hipBLASLt >= 1.3.0, found 1.2.2" in res["error"]
    assert not [r for r in calls_named(res["log"], "hipblasLtMatmulDescSetAttribute") if r["value"] == BLK32]


# ---- model_workspace_per_solution

def test_model_workspace_per_solution_the_chosen_algorithm_gets_its_own_size(rng):
    # Algorithm i needs 40 MiB * (i + 1): only algorithm 0 fits the 64 MiB cap.
    o = ops(rng, 32, 32, 256)
    res = run(o, model_workspace_per_solution=True, heuristic_count=3, workspace_size=40 << 20)
    assert res["error"] is None, res["error"]
    (mm,) = calls_named(res["log"], "hipblasLtMatmul")
    assert (mm["algo_index"], mm["workspace_size"]) == (0, 40 << 20)
    assert res["workspace"] == [(40 << 20, 256)]
    np.testing.assert_array_equal(res["array"], exact(o))


# ---- model_c_read (only rocRoller with plain scales reads C when beta = 0)

def test_output_is_zeroed_only_where_the_kernel_reads_c(rng):
    o = ops(rng, 64, 32, 512)
    models = {"model_c_read": True, "model_route_at_create": True}
    for layout, zeroed in (("plain", True), ("swizzled", False)):
        res = run(o, scale_layout=layout, out_fill=0xFF, **models)  # output starts as NaN bits
        assert res["error"] is None, res["error"]
        np.testing.assert_array_equal(res["array"], exact(o))
        (mm,) = calls_named(res["log"], "hipblasLtMatmul")
        assert mm["c_read"] == int(zeroed)
        assert len(calls_named(res["log"], "hipMemsetAsync")) == int(zeroed), layout


# ---- model_kernel_per_handle (rocRoller compiles per handle)

def test_each_new_stream_handle_is_warmed_so_no_matmul_compiles(rng):
    o = ops(rng, 64, 32, 512)
    res = run(o, calls=3, streams=[0xA, 0xB, 0xA], model_kernel_per_handle=True)
    assert res["error"] is None, res["error"]
    mms = calls_named(res["log"], "hipblasLtMatmul")
    assert [m["compiled_in_matmul"] for m in mms] == [0, 0, 0]
    heur = calls_named(res["log"], "hipblasLtMatmulAlgoGetHeuristic")
    assert len(heur) == 2 and heur[0]["handle"] == mms[0]["handle"] and heur[1]["handle"] == mms[1]["handle"]
    np.testing.assert_array_equal(res["array"], exact(o))
