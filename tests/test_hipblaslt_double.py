"""The hipBLASLt call path (xla_ffi/src/hipblaslt_gemm.cc) run on the CPU against the recording
test double of hipBLASLt + HIP (xla_ffi/src/fake_hipblaslt.cc).

The double computes D from the descriptors and attributes it receives, as hipBLASLt defines them
(column-major, opA = T, ld in elements, scale mode, scale pointers), with the CPU reference
arithmetic; it refuses pointers outside the registered buffers. So the numbers check the whole
mapping of row-major [M,K/2] x [N,K/2] onto hipBLASLt's TN form, and the log checks the sequence
of reference/hipblaslt-mxfp4.md §1.5 and every attribute value (reference/hipblaslt-abi.md).
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_mxfp4 as mx
from jax_mxfp4 import Recipe, layout
from jax_mxfp4.ffi import registration

_native = registration.native()

# Values from reference/hipblaslt-abi.json.
HIP_R_32F, HIP_R_16F, HIP_R_16BF, HIP_R_4F_E2M1 = 0, 2, 14, 33
OP_N, OP_T, COMPUTE_32F = 111, 112, 2
TRANSA, TRANSB, A_SCALE_POINTER, B_SCALE_POINTER, A_SCALE_MODE, B_SCALE_MODE = 0, 1, 5, 6, 31, 32
VEC32_UE8M0, BLK32_UE8M0_32_8_EXT = 2, 1001
PREF_MAX_WORKSPACE_BYTES = 1
OUT_TYPES = {"float32": HIP_R_32F, "bfloat16": HIP_R_16BF, "float16": HIP_R_16F}
NP_OUT = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def operands(m, n, k, batch=None, seed=0, swizzled=False):
    rng = np.random.default_rng(seed)
    lead = () if batch is None else (batch,)
    ld = rng.integers(0, 256, lead + (m, k // 2), dtype=np.uint8)
    rd = rng.integers(0, 256, lead + (n, k // 2), dtype=np.uint8)
    ls = rng.integers(118, 136, lead + (m, k // 32), dtype=np.uint8)
    rs = rng.integers(118, 136, lead + (n, k // 32), dtype=np.uint8)
    return ld, ls, rd, rs


def swizzle_np(s):
    """Per batch element, through the package's layout.swizzle (checked by test_ffi_cpu)."""
    if s.ndim == 2:
        return np.asarray(layout.swizzle(jnp.asarray(s)))
    return np.stack([np.asarray(layout.swizzle(jnp.asarray(x))) for x in s])


def cpu_reference(ld, ls, rd, rs, out_dtype):
    """The same GEMM through backend "ffi-cpu" (the CPU FFI handler) on plain scales."""
    batch = ld.ndim == 3
    to = lambda d, s: mx.MXFP4Array(jnp.asarray(d), jnp.asarray(s.view(ml_dtypes.float8_e8m0fnu)),
                                    d.ndim - 1, d.shape[:-1] + (2 * d.shape[-1],), jnp.float32)
    dn = (((2,), (2,)), ((0,), (0,))) if batch else (((1,), (1,)), ((), ()))
    return np.asarray(mx.dot_general(to(ld, ls), to(rd, rs), dn, preferred_element_type=getattr(jnp, out_dtype),
                                     recipe=Recipe(backend="ffi-cpu")))


def fake(ld, ls, rd, rs, out_dtype="float32", scale_layout="plain", calls=1, device=0, **config):
    if scale_layout == "swizzled":
        ls, rs = swizzle_np(ls), swizzle_np(rs)
    res = _native._fake_hipblaslt_gemm(np.ascontiguousarray(ld), np.ascontiguousarray(ls),
                                       np.ascontiguousarray(rd), np.ascontiguousarray(rs),
                                       out_dtype, scale_layout, config, calls, device)
    res = dict(res)
    shape = ld.shape[:-1] + (rd.shape[-2],)
    res["array"] = np.frombuffer(res["out"], NP_OUT[out_dtype]).reshape(shape) if res["out"] else None
    res["inputs"] = (ls, rs)
    return res


def calls_named(log, fn):
    return [r for r in log if r["fn"] == fn]


def desc_attrs(log):
    return [(r["attr"], r["size"], r["value"]) for r in calls_named(log, "hipblasLtMatmulDescSetAttribute")]


@pytest.mark.parametrize("scale_layout", ["plain", "swizzled"])
@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16", "float16"])
def test_numbers_equal_the_cpu_handler(out_dtype, scale_layout):
    ld, ls, rd, rs = operands(32, 48, 384, seed=len(out_dtype))  # K % 128 == 0, K % 256 != 0
    res = fake(ld, ls, rd, rs, out_dtype, scale_layout)
    assert res["error"] is None, res["error"]
    assert res["sentinel_intact"]
    want = cpu_reference(ld, ls, rd, rs, out_dtype)
    np.testing.assert_array_equal(res["array"].view(np.uint8), want.view(np.uint8))
    assert np.abs(want.astype(np.float32)).max() > 0


def test_call_sequence_and_every_attribute_value():
    m, n, k = 32, 48, 256
    ld, ls, rd, rs = operands(m, n, k)
    res = fake(ld, ls, rd, rs, "bfloat16")
    assert res["error"] is None, res["error"]
    log, buf = res["log"], res["buffers"]
    seq = [r["fn"] for r in log if r["fn"] != "hipGetErrorString"]
    assert seq == [
        # device info (once per device): arch from the R0600 struct, version from a pooled handle
        "hipGetDevice", "hipRuntimeGetVersion", "hipGetDevicePropertiesR0600",
        "hipDeviceGetAttribute", "hipDeviceGetAttribute", "hipblasLtCreate", "hipblasLtGetVersion",
        # the GEMM (§1.5)
        "hipGetDevice",
        "hipblasLtMatrixLayoutCreate", "hipblasLtMatrixLayoutCreate", "hipblasLtMatrixLayoutCreate",
        "hipblasLtMatrixLayoutCreate", "hipblasLtMatmulDescCreate",
        "hipblasLtMatmulDescSetAttribute", "hipblasLtMatmulDescSetAttribute",  # TRANSA, TRANSB
        "hipblasLtMatmulDescSetAttribute", "hipblasLtMatmulDescSetAttribute",  # scale modes
        "hipblasLtMatmulDescSetAttribute", "hipblasLtMatmulDescSetAttribute",  # dummy pointers
        "hipblasLtMatmulPreferenceCreate", "hipblasLtMatmulPreferenceSetAttribute",
        "hipblasLtMatmulAlgoGetHeuristic",
        "hipblasLtMatmulDescSetAttribute", "hipblasLtMatmulDescSetAttribute",  # real pointers
        "hipblasLtMatmul",
        "hipblasLtMatmulPreferenceDestroy", "hipblasLtMatmulDescDestroy",
        "hipblasLtMatrixLayoutDestroy", "hipblasLtMatrixLayoutDestroy", "hipblasLtMatrixLayoutDestroy",
        "hipblasLtMatrixLayoutDestroy",
        # runtime teardown destroys the pooled handle
        "hipblasLtDestroy",
    ]
    # Layouts: A = rhs as (K x N) ld K, B = lhs as (K x M) ld K, C = D = out as (N x M) ld N.
    lay = [(r["type"], r["rows"], r["cols"], r["ld"]) for r in calls_named(log, "hipblasLtMatrixLayoutCreate")]
    assert lay == [(HIP_R_4F_E2M1, k, n, k), (HIP_R_4F_E2M1, k, m, k), (HIP_R_16BF, n, m, n), (HIP_R_16BF, n, m, n)]
    (dc,) = calls_named(log, "hipblasLtMatmulDescCreate")
    assert (dc["compute_type"], dc["scale_type"]) == (COMPUTE_32F, HIP_R_32F)
    attrs = desc_attrs(log)
    assert attrs[:4] == [(TRANSA, 4, OP_T), (TRANSB, 4, OP_N), (A_SCALE_MODE, 4, VEC32_UE8M0), (B_SCALE_MODE, 4, VEC32_UE8M0)]
    (dummy_a, sa, da), (dummy_b, sb, db) = attrs[4:6]
    assert (dummy_a, sa, dummy_b, sb) == (A_SCALE_POINTER, 8, B_SCALE_POINTER, 8)
    assert da != 0 and db != 0 and da not in buf.values() and db not in buf.values()
    assert attrs[6:] == [(A_SCALE_POINTER, 8, buf["rhs_scales"]), (B_SCALE_POINTER, 8, buf["lhs_scales"])]
    (pref,) = calls_named(log, "hipblasLtMatmulPreferenceSetAttribute")
    assert (pref["attr"], pref["size"], pref["value"]) == (PREF_MAX_WORKSPACE_BYTES, 8, _native.HIPBLASLT_MAX_WORKSPACE_BYTES)
    (heur,) = calls_named(log, "hipblasLtMatmulAlgoGetHeuristic")
    assert heur["requested"] == _native.HIPBLASLT_REQUESTED_ALGOS
    assert heur["a_scale_mode_set"] == 1 and heur["b_scale_mode_set"] == 1  # set before the heuristic
    assert heur["a_scale_pointer"] == da and heur["b_scale_pointer"] == db  # dummy ones
    (mm,) = calls_named(log, "hipblasLtMatmul")
    assert (mm["A"], mm["B"], mm["C"], mm["D"]) == (buf["rhs"], buf["lhs"], buf["out"], buf["out"])
    assert (mm["alpha"], mm["beta"]) == (1.0, 0.0)
    assert mm["stream"] == 0x5EA0
    assert mm["algo_index"] == 0
    # Workspace: what the chosen algorithm needs, from the allocator, 256-byte aligned.
    assert res["workspace"] == [(4096, 256)]
    assert mm["workspace_size"] == 4096 and mm["workspace"] % 256 == 0
    assert res["live_objects_before_teardown"] == 1  # only the pooled handle
    assert res["live_objects_after_teardown"] == 0


def test_swizzled_mode_and_batch_pointer_offsets():
    b, m, n, k = 3, 16, 32, 256
    ld, ls, rd, rs = operands(m, n, k, batch=b, seed=4)
    res = fake(ld, ls, rd, rs, "float32", "swizzled")
    assert res["error"] is None, res["error"]
    np.testing.assert_array_equal(res["array"], cpu_reference(ld, ls, rd, rs, "float32"))
    attrs = desc_attrs(res["log"])
    assert attrs[2:4] == [(A_SCALE_MODE, 4, BLK32_UE8M0_32_8_EXT), (B_SCALE_MODE, 4, BLK32_UE8M0_32_8_EXT)]
    buf = res["buffers"]
    sls, srs = res["inputs"]
    mms = calls_named(res["log"], "hipblasLtMatmul")
    assert len(mms) == b
    real = attrs[6:]
    for i, mm in enumerate(mms):
        assert mm["A"] == buf["rhs"] + i * n * k // 2 and mm["B"] == buf["lhs"] + i * m * k // 2
        assert mm["D"] == mm["C"] == buf["out"] + i * m * n * 4
        assert real[2 * i] == (A_SCALE_POINTER, 8, buf["rhs_scales"] + i * srs[0].size)
        assert real[2 * i + 1] == (B_SCALE_POINTER, 8, buf["lhs_scales"] + i * sls[0].size)
    assert len(calls_named(res["log"], "hipblasLtMatmulAlgoGetHeuristic")) == 1


def test_algorithm_cache_skips_the_heuristic_on_the_second_call():
    ld, ls, rd, rs = operands(16, 16, 128)
    res = fake(ld, ls, rd, rs, calls=2)
    assert res["error"] is None
    log = res["log"]
    assert len(calls_named(log, "hipblasLtMatmulAlgoGetHeuristic")) == 1
    assert len(calls_named(log, "hipblasLtMatmul")) == 2
    assert len(calls_named(log, "hipblasLtCreate")) == 1  # the pooled handle is reused
    assert len(calls_named(log, "hipGetDevicePropertiesR0600")) == 1  # device info cached
    # Second call: only the real pointers are set, after the scale modes, before the matmul.
    second = log[[i for i, r in enumerate(log) if r["fn"] == "hipblasLtMatmul"][0] + 1:]
    ptrs = [a for a in desc_attrs(second) if a[0] in (A_SCALE_POINTER, B_SCALE_POINTER)]
    assert [p[2] for p in ptrs] == [res["buffers"]["rhs_scales"], res["buffers"]["lhs_scales"]]


def test_empty_heuristic_is_an_error_naming_the_shape_and_nothing_leaks():
    ld, ls, rd, rs = operands(16, 16, 128)
    res = fake(ld, ls, rd, rs, "float16", heuristic_count=0)
    assert res["code"] == "UNIMPLEMENTED"
    assert "no usable algorithm" in res["error"] and "M=16 N=16 K=128 out=float16" in res["error"]
    assert not calls_named(res["log"], "hipblasLtMatmul")
    assert res["workspace"] == []
    assert res["live_objects_before_teardown"] == 1 and res["live_objects_after_teardown"] == 0


def test_zero_workspace_algorithm_allocates_nothing():
    ld, ls, rd, rs = operands(16, 16, 128)
    res = fake(ld, ls, rd, rs, workspace_size=0)
    assert res["error"] is None and res["workspace"] == []
    (mm,) = calls_named(res["log"], "hipblasLtMatmul")
    assert mm["workspace"] == 0 and mm["workspace_size"] == 0


def test_device_is_selected_and_restored():
    ld, ls, rd, rs = operands(16, 16, 128)
    res = fake(ld, ls, rd, rs, device=1, device_count=2, current_device=0)
    assert res["error"] is None, res["error"]
    sets = [r["device"] for r in calls_named(res["log"], "hipSetDevice")]
    assert sets == [1, 0, 1, 0]  # device info, then the GEMM; each restores device 0
    (create,) = calls_named(res["log"], "hipblasLtCreate")
    assert create["current_device"] == 1


def _happy_path_functions():
    ld, ls, rd, rs = operands(16, 16, 128)
    res = fake(ld, ls, rd, rs)
    # hipblasLtDestroy runs only when the runtime is torn down (no call left to report it to).
    return sorted({r["fn"] for r in res["log"]} - {"hipGetErrorString", "hipblasLtDestroy"})


@pytest.mark.parametrize("fn", _happy_path_functions())
def test_a_failing_status_from_any_call_is_returned_naming_it(fn):
    ld, ls, rd, rs = operands(16, 16, 128)
    status = 100 if fn.startswith("hip") and not fn.startswith("hipblas") else 5
    res = fake(ld, ls, rd, rs, fail_fn=fn, fail_status=status)
    assert res["error"] is not None, fn
    assert fn in res["error"]
    if fn.startswith("hipblasLt"):
        assert "HIPBLAS_STATUS_EXECUTION_FAILED (5)" in res["error"]
    else:
        assert "hipError_t 100" in res["error"]
    assert res["code"] == "INTERNAL"
    # Everything is released even on the error path, except the object whose destroy failed.
    assert res["live_objects_after_teardown"] == (1 if fn.endswith("Destroy") else 0)


@pytest.mark.parametrize(
    "config,layout_,m,n,k,code,match",
    [
        ({"arch": "gfx942:sramecc+:xnack-", "minor": 4}, "plain", 16, 16, 128, "FAILED_PRECONDITION", "needs a gfx950 GPU.*gfx942"),
        ({"hipblaslt_version": 100202}, "swizzled", 32, 32, 256, "UNIMPLEMENTED", "need hipBLASLt >= 1.3.0, found 1.2.2"),
        ({"hipblaslt_version": 1100}, "plain", 16, 16, 128, "FAILED_PRECONDITION", "need >= 1.0.0"),
        ({"hip_runtime_version": 60400000}, "plain", 16, 16, 128, "FAILED_PRECONDITION", "HIP runtime version"),
        ({}, "plain", 24, 16, 128, "INVALID_ARGUMENT", "M % 16 == 0.*M=24"),
        ({}, "plain", 16, 16, 96, "INVALID_ARGUMENT", "K % 128 == 0.*K=96"),
        ({"arch": "gfx950", "major": 10}, "plain", 16, 16, 128, "INTERNAL", "layout mismatch"),
    ],
)
def test_gates(config, layout_, m, n, k, code, match):
    ld, ls, rd, rs = operands(m, n, k)
    res = fake(ld, ls, rd, rs, "float32", layout_, **config)
    assert res["code"] == code, res["error"]
    assert __import__("re").search(match, res["error"]), res["error"]
    assert not calls_named(res["log"], "hipblasLtMatmul")


def test_shared_validation_rejects_bad_buffers_before_any_call():
    ld, ls, rd, rs = operands(16, 16, 128)
    res = _native._fake_hipblaslt_gemm(ld, ls[:, :2].copy(), rd, rs, "float32", "plain", {}, 1, 0)
    assert res["code"] == "INVALID_ARGUMENT" and "lhs scales has shape [16, 2], expected [16, 4]" in res["error"]
    assert res["log"] == []


# ---- The double itself: it refuses what hipBLASLt refuses and computes from what it is given,
# so the tests above would see a swapped operand, a wrong ld, transpose or scale pointer.

def raw(a, b, sa, sb, k, m, n, lda=None, ldb=None, trans_a=OP_T, trans_b=OP_N, mode=VEC32_UE8M0,
        ws_given=4096, ws_needed=4096, register_scales=True):
    st, out = _native._fake_hipblaslt_raw_matmul(
        np.ascontiguousarray(a), np.ascontiguousarray(b), np.ascontiguousarray(sa), np.ascontiguousarray(sb),
        k, m, n, lda or k, ldb or k, trans_a, trans_b, mode, ws_given, ws_needed, register_scales)
    return st, np.frombuffer(out, np.float32).reshape(n, m)  # column-major (m x n) == row-major [n, m]


def test_double_computes_from_descriptors_and_detects_a_swap():
    m, n, k = 32, 16, 256  # caller's M, N
    ld, ls, rd, rs = operands(m, n, k, seed=21)
    want = cpu_reference(ld, ls, rd, rs, "float32")
    st, out = raw(rd, ld, rs, ls, k, n, m)  # A = W (rhs), B = X (lhs): hipBLASLt m = N, n = M
    assert st == 0
    np.testing.assert_array_equal(out, want)
    st, swapped = raw(ld, rd, ls, rs, k, m, n)  # operands exchanged: the transpose comes out
    assert st == 0 and swapped.shape != want.shape
    np.testing.assert_array_equal(swapped, want.T)


def test_double_honours_leading_dimensions():
    m, n, k = 16, 16, 128
    ld, ls, rd, rs = operands(m, n, k, seed=22)
    pad = 64  # elements of padding per column: ld = K + 64
    rd_padded = np.concatenate([rd, np.full((n, pad // 2), 0x77, np.uint8)], axis=1)
    st, out = raw(rd_padded, ld, rs, ls, k, n, m, lda=k + pad)
    assert st == 0
    np.testing.assert_array_equal(out, cpu_reference(ld, ls, rd, rs, "float32"))
    st, wrong = raw(rd_padded, ld, rs, ls, k, n, m, lda=k)  # ld that ignores the padding
    assert st == 0 and not np.array_equal(wrong, out)


@pytest.mark.parametrize(
    "kwargs,status",
    [
        ({"trans_a": OP_N}, 7),  # MX is TN only: NOT_SUPPORTED
        ({"trans_b": OP_T}, 7),
        ({"mode": 0}, 7),  # SCALAR_32F is not an MX scale mode
        ({"register_scales": False}, 3),  # scale pointer outside device memory: INVALID_VALUE
        ({"ws_given": 1024, "ws_needed": 4096}, 3),  # workspace smaller than the algorithm needs
    ],
)
def test_double_refuses_what_hipblaslt_refuses(kwargs, status):
    ld, ls, rd, rs = operands(16, 16, 128, seed=23)
    st, _ = raw(rd, ld, rs, ls, 128, 16, 16, **kwargs)
    assert st == status
