"""The hipBLASLt call path (xla_ffi/src/hipblaslt_gemm.cc) run on the CPU against the recording
test double of hipBLASLt + HIP (xla_ffi/src/fake_hipblaslt.cc).

The double computes D from the descriptors and attributes it receives, as hipBLASLt defines them
(column-major, opA = T, ld in elements, scale mode, scale pointers), with the CPU reference
arithmetic; it refuses pointers outside the registered buffers, a handle used from a second
stream, and (like rocRoller's kernels) forms beta * C even for beta = 0, so NaN bits in C give NaN.
So the numbers check the whole mapping of row-major [M,K/2] x [N,K/2] onto hipBLASLt's TN form,
and the log checks the sequence of reference/hipblaslt-mxfp4.md §1.5 and every attribute value
(reference/hipblaslt-abi.md). The double lives in the test-only module _hipblaslt_double
(tests/hipblaslt_double.py), never in the shipped jax_mxfp4._native.
"""

from __future__ import annotations

import re

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_mxfp4 as mx
from jax_mxfp4 import Recipe, layout
from jax_mxfp4.ffi import registration

from hipblaslt_double import load

_native = registration.native()
double = load()
ENVELOPE = "JAX_MXFP4_HIPBLASLT_ENVELOPE"


@pytest.fixture
def documented(monkeypatch):
    """The wider, unverified envelope (M % 16, N % 16, K % 128, float16 out, hipBLASLt >= 1.0)."""
    monkeypatch.setenv(ENVELOPE, "documented")


@pytest.fixture(autouse=True)
def _default_environment(monkeypatch):
    monkeypatch.delenv(ENVELOPE, raising=False)
    monkeypatch.delenv("HIPBLASLT_USE_ROCROLLER", raising=False)

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


def fake(ld, ls, rd, rs, out_dtype="float32", scale_layout="plain", calls=1, device=0, streams=(), **config):
    if scale_layout == "swizzled":
        ls, rs = swizzle_np(ls), swizzle_np(rs)
    res = double.gemm(np.ascontiguousarray(ld), np.ascontiguousarray(ls), np.ascontiguousarray(rd),
                      np.ascontiguousarray(rs), out_dtype, scale_layout, config, calls, device, list(streams))
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
@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16"])
def test_numbers_equal_the_cpu_handler(out_dtype, scale_layout):
    ld, ls, rd, rs = operands(64, 32, 512, seed=len(out_dtype))  # the validated envelope
    # Output starts as NaN bits; the double reads C where the kernel does (rocRoller, plain scales).
    res = fake(ld, ls, rd, rs, out_dtype, scale_layout, out_fill=0xFF, model_c_read=True)
    assert res["error"] is None, res["error"]
    assert res["sentinel_intact"]
    want = cpu_reference(ld, ls, rd, rs, out_dtype)
    np.testing.assert_array_equal(res["array"].view(np.uint8), want.view(np.uint8))
    assert np.abs(want.astype(np.float32)).max() > 0


@pytest.mark.parametrize(
    "scale_layout,out_dtype,version",
    [("plain", "float32", 100000), ("plain", "float16", 100300), ("swizzled", "bfloat16", 100500)],
)
def test_numbers_in_the_documented_envelope(documented, scale_layout, out_dtype, version):
    # K % 128 == 0 but K % 256 != 0, M % 32 != 0: only the opt-in envelope takes these, on the
    # rocRoller route (plain) or on hipBLASLt >= 1.5.0 (padded swizzled buffers).
    ld, ls, rd, rs = operands(48, 16, 384, seed=7)
    res = fake(ld, ls, rd, rs, out_dtype, scale_layout, hipblaslt_version=version)
    assert res["error"] is None, res["error"]
    want = cpu_reference(ld, ls, rd, rs, out_dtype)
    np.testing.assert_array_equal(res["array"].view(np.uint8), want.view(np.uint8))


def test_call_sequence_and_every_attribute_value():
    m, n, k = 32, 64, 256
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
        "hipblasLtCreate",  # a handle for this (device, stream)
        "hipblasLtMatrixLayoutCreate", "hipblasLtMatrixLayoutCreate", "hipblasLtMatrixLayoutCreate",
        "hipblasLtMatrixLayoutCreate", "hipblasLtMatmulDescCreate",
        "hipblasLtMatmulDescSetAttribute", "hipblasLtMatmulDescSetAttribute",  # TRANSA, TRANSB
        "hipblasLtMatmulDescSetAttribute", "hipblasLtMatmulDescSetAttribute",  # scale modes
        "hipblasLtMatmulDescSetAttribute", "hipblasLtMatmulDescSetAttribute",  # dummy pointers
        "hipblasLtMatmulPreferenceCreate", "hipblasLtMatmulPreferenceSetAttribute",
        "hipblasLtMatmulAlgoGetHeuristic",
        "hipMemsetAsync",  # C = D zeroed: beta = 0 may still read C
        "hipblasLtMatmulDescSetAttribute", "hipblasLtMatmulDescSetAttribute",  # real pointers
        "hipblasLtMatmul",
        "hipblasLtMatmulPreferenceDestroy", "hipblasLtMatmulDescDestroy",
        "hipblasLtMatrixLayoutDestroy", "hipblasLtMatrixLayoutDestroy", "hipblasLtMatrixLayoutDestroy",
        "hipblasLtMatrixLayoutDestroy",
        # runtime teardown destroys the pooled handles (stream-less and per-stream)
        "hipblasLtDestroy", "hipblasLtDestroy",
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
    (ms,) = calls_named(log, "hipMemsetAsync")
    assert (ms["dst"], ms["value"], ms["bytes"], ms["stream"]) == (buf["out"], 0, m * n * 2, 0x5EA0)
    assert mm["c_nonfinite"] == 0
    creates = calls_named(log, "hipblasLtCreate")
    assert mm["handle"] == creates[1]["handle"] != creates[0]["handle"]
    # Workspace: what the chosen algorithm needs, from the allocator, 256-byte aligned.
    assert res["workspace"] == [(4096, 256)]
    assert mm["workspace_size"] == 4096 and mm["workspace"] % 256 == 0
    assert res["live_objects_before_teardown"] == 2  # only the pooled handles
    assert res["live_objects_after_teardown"] == 0


def test_swizzled_mode_and_batch_pointer_offsets():
    b, m, n, k = 3, 32, 64, 256
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
    assert not calls_named(res["log"], "hipMemsetAsync")  # swizzled FP4 runs on TensileLite: C unread
    real = attrs[6:]
    for i, mm in enumerate(mms):
        assert mm["A"] == buf["rhs"] + i * n * k // 2 and mm["B"] == buf["lhs"] + i * m * k // 2
        assert mm["D"] == mm["C"] == buf["out"] + i * m * n * 4
        assert real[2 * i] == (A_SCALE_POINTER, 8, buf["rhs_scales"] + i * srs[0].size)
        assert real[2 * i + 1] == (B_SCALE_POINTER, 8, buf["lhs_scales"] + i * sls[0].size)
    assert len(calls_named(res["log"], "hipblasLtMatmulAlgoGetHeuristic")) == 1


def test_algorithm_cache_skips_the_heuristic_on_the_second_call():
    ld, ls, rd, rs = operands(32, 32, 256)
    res = fake(ld, ls, rd, rs, calls=2)
    assert res["error"] is None
    log = res["log"]
    assert len(calls_named(log, "hipblasLtMatmulAlgoGetHeuristic")) == 1
    assert len(calls_named(log, "hipblasLtMatmul")) == 2
    assert len(calls_named(log, "hipblasLtCreate")) == 2  # version query + this stream's, reused
    assert len(calls_named(log, "hipGetDevicePropertiesR0600")) == 1  # device info cached
    # Second call: only the real pointers are set, after the scale modes, before the matmul.
    second = log[[i for i, r in enumerate(log) if r["fn"] == "hipblasLtMatmul"][0] + 1:]
    ptrs = [a for a in desc_attrs(second) if a[0] in (A_SCALE_POINTER, B_SCALE_POINTER)]
    assert [p[2] for p in ptrs] == [res["buffers"]["rhs_scales"], res["buffers"]["lhs_scales"]]


def test_empty_heuristic_is_an_error_naming_the_shape_and_nothing_leaks():
    ld, ls, rd, rs = operands(32, 32, 256)
    res = fake(ld, ls, rd, rs, "float32", heuristic_count=0)
    assert res["code"] == "UNIMPLEMENTED"
    assert "no usable algorithm" in res["error"] and "M=32 N=32 K=256 out=float32" in res["error"]
    assert not calls_named(res["log"], "hipblasLtMatmul")
    assert res["workspace"] == [] and not calls_named(res["log"], "hipMemsetAsync")
    assert res["live_objects_before_teardown"] == 2 and res["live_objects_after_teardown"] == 0


def test_zero_workspace_algorithm_allocates_nothing():
    ld, ls, rd, rs = operands(32, 32, 256)
    res = fake(ld, ls, rd, rs, workspace_size=0)
    assert res["error"] is None and res["workspace"] == []
    (mm,) = calls_named(res["log"], "hipblasLtMatmul")
    assert mm["workspace"] == 0 and mm["workspace_size"] == 0


def test_device_is_selected_and_restored():
    ld, ls, rd, rs = operands(32, 32, 256)
    res = fake(ld, ls, rd, rs, device=1, device_count=2, current_device=0)
    assert res["error"] is None, res["error"]
    sets = [r["device"] for r in calls_named(res["log"], "hipSetDevice")]
    assert sets == [1, 0, 1, 0]  # device info, then the GEMM; each restores device 0
    creates = calls_named(res["log"], "hipblasLtCreate")
    assert [c["current_device"] for c in creates] == [1, 1]


def _happy_path_functions():
    ld, ls, rd, rs = operands(32, 32, 256)
    res = fake(ld, ls, rd, rs)
    # hipblasLtDestroy runs only when the runtime is torn down (no call left to report it to).
    return sorted({r["fn"] for r in res["log"]} - {"hipGetErrorString", "hipblasLtDestroy"})


@pytest.mark.parametrize("fn", _happy_path_functions())
def test_a_failing_status_from_any_call_is_returned_naming_it(fn):
    ld, ls, rd, rs = operands(32, 32, 256)
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
        ({"arch": "gfx942:sramecc+:xnack-", "minor": 4}, "plain", 32, 32, 256, "FAILED_PRECONDITION", "needs a gfx950 GPU.*gfx942"),
        ({"hipblaslt_version": 100202}, "swizzled", 32, 32, 256, "UNIMPLEMENTED", "below the validated envelope's 1.3.0"),
        ({"hipblaslt_version": 100202}, "plain", 32, 32, 256, "UNIMPLEMENTED", "1.2.2 is below the validated envelope"),
        ({"hipblaslt_version": 1100}, "plain", 32, 32, 256, "FAILED_PRECONDITION", "need >= 1.0.0"),
        ({"hip_runtime_version": 60400000}, "plain", 32, 32, 256, "FAILED_PRECONDITION", "HIP runtime version"),
        # The validated envelope: M % 32, N % 32, K % 256, bf16/f32 out.
        ({}, "plain", 16, 32, 256, "INVALID_ARGUMENT", "validated envelope.*M % 32 == 0.*M=16"),
        ({}, "plain", 32, 48, 256, "INVALID_ARGUMENT", "validated envelope.*N=48"),
        ({}, "plain", 32, 32, 384, "INVALID_ARGUMENT", "validated envelope.*K % 256 == 0.*K=384"),
        ({"arch": "gfx950", "major": 10}, "plain", 32, 32, 256, "INTERNAL", "layout mismatch"),
    ],
)
def test_gates(config, layout_, m, n, k, code, match):
    ld, ls, rd, rs = operands(m, n, k)
    res = fake(ld, ls, rd, rs, "float32", layout_, **config)
    assert res["code"] == code, res["error"]
    assert re.search(match, res["error"]), res["error"]
    assert not calls_named(res["log"], "hipblasLtMatmul")


def test_validated_envelope_refuses_float16_out_and_names_the_opt_in():
    ld, ls, rd, rs = operands(32, 32, 256)
    res = fake(ld, ls, rd, rs, "float16")
    assert res["code"] == "INVALID_ARGUMENT"
    assert "float32 or bfloat16, not float16" in res["error"] and "JAX_MXFP4_HIPBLASLT_ENVELOPE=documented" in res["error"]


def test_unknown_envelope_value_is_an_error_naming_the_variable(monkeypatch):
    monkeypatch.setenv(ENVELOPE, "wide")
    ld, ls, rd, rs = operands(32, 32, 256)
    res = fake(ld, ls, rd, rs)
    assert res["code"] == "INVALID_ARGUMENT" and 'JAX_MXFP4_HIPBLASLT_ENVELOPE must be "validated"' in res["error"]
    assert res["log"] == []


@pytest.mark.parametrize(
    "config,layout_,m,n,k,code,match",
    [
        ({}, "plain", 24, 16, 128, "INVALID_ARGUMENT", "M % 16 == 0.*M=24"),
        ({}, "plain", 16, 16, 96, "INVALID_ARGUMENT", "K % 128 == 0.*K=96"),
        ({"hipblaslt_version": 100202}, "swizzled", 32, 32, 256, "UNIMPLEMENTED", "need hipBLASLt >= 1.3.0, found 1.2.2"),
        # Swizzled scales below 1.5.0: unpadded only (XLA's rule; 1.5.0 fixes padded buffers).
        ({"hipblaslt_version": 100300}, "swizzled", 48, 32, 256, "UNIMPLEMENTED", "1.3.0 < 1.5.0 need M % 32.*M=48"),
        ({"hipblaslt_version": 100402}, "swizzled", 32, 32, 384, "UNIMPLEMENTED", "1.4.2 < 1.5.0.*K=384"),
        # Plain scales on TensileLite (no rocRoller library seen): refused for every shape.
        ({"rocroller_library": False}, "plain", 32, 32, 384, "UNIMPLEMENTED", "refused on hipBLASLt's TensileLite.*K=384"),
        ({"rocroller_library": False}, "plain", 48, 32, 256, "UNIMPLEMENTED", "refused on hipBLASLt's TensileLite.*M=48"),
    ],
)
def test_documented_envelope_gates(documented, config, layout_, m, n, k, code, match):
    ld, ls, rd, rs = operands(m, n, k)
    res = fake(ld, ls, rd, rs, "float32", layout_, **config)
    assert res["code"] == code, res["error"]
    assert re.search(match, res["error"]), res["error"]
    assert not calls_named(res["log"], "hipblasLtMatmul")


@pytest.mark.parametrize("value,tensilelite", [("0", True), ("", True), ("false", True), ("1", False), ("10", False)])
def test_hipblaslt_use_rocroller_is_read_as_the_library_reads_it(monkeypatch, value, tensilelite):
    # rocblaslt handle constructor: unset -> default (rocRoller); set -> strncmp(value, "1", 1).
    monkeypatch.setenv("HIPBLASLT_USE_ROCROLLER", value)
    assert double.route(True)[0] is tensilelite
    assert double.route(False)[0] is True  # a build without rocRoller is TensileLite either way
    monkeypatch.delenv("HIPBLASLT_USE_ROCROLLER")
    assert double.route(True) == (False, "rocRoller (HIPBLASLT_USE_ROCROLLER unset, librocroller loaded)")


@pytest.mark.parametrize("m,k", [(48, 384), (32, 512)])
def test_tensilelite_route_from_the_environment(documented, monkeypatch, m, k):
    # Plain scales are refused on that route whatever the shape; swizzled ones (its own path) run.
    monkeypatch.setenv("HIPBLASLT_USE_ROCROLLER", "0")
    ld, ls, rd, rs = operands(m, 32, k, seed=9)
    res = fake(ld, ls, rd, rs, "float32")
    assert res["code"] == "UNIMPLEMENTED" and 'HIPBLASLT_USE_ROCROLLER="0"' in res["error"]
    res = fake(ld, ls, rd, rs, "float32", "swizzled", hipblaslt_version=100500)
    assert res["error"] is None, res["error"]
    np.testing.assert_array_equal(res["array"], cpu_reference(ld, ls, rd, rs, "float32"))


def test_output_is_zeroed_before_beta_zero_reads_c():
    ld, ls, rd, rs = operands(32, 32, 256, seed=11)
    for fill in (0xFF, 0x7F):  # NaN bit patterns in every float32 of the uninitialised output
        res = fake(ld, ls, rd, rs, "float32", out_fill=fill)
        assert res["error"] is None, res["error"]
        assert not np.isnan(res["array"]).any()
        np.testing.assert_array_equal(res["array"], cpu_reference(ld, ls, rd, rs, "float32"))
        (mm,) = calls_named(res["log"], "hipblasLtMatmul")
        assert mm["c_nonfinite"] == 0 and mm["C"] == mm["D"]
        (ms,) = calls_named(res["log"], "hipMemsetAsync")
        assert [r["fn"] for r in res["log"]].index("hipMemsetAsync") < [r["fn"] for r in res["log"]].index("hipblasLtMatmul")


def test_handles_are_keyed_by_device_and_stream():
    ld, ls, rd, rs = operands(32, 32, 256, seed=12)
    # Stream A, stream B, stream A again: B never gets A's handle (the double refuses a handle
    # used from a second stream), A's second call reuses A's.
    res = fake(ld, ls, rd, rs, calls=3, streams=[0xA, 0xB, 0xA])
    assert res["error"] is None, res["error"]
    mms = calls_named(res["log"], "hipblasLtMatmul")
    assert [m["stream"] for m in mms] == [0xA, 0xB, 0xA]
    assert mms[0]["handle"] != mms[1]["handle"] and mms[0]["handle"] == mms[2]["handle"]
    assert len(calls_named(res["log"], "hipblasLtCreate")) == 3  # version query, stream A, stream B
    assert res["live_objects_after_teardown"] == 0


def test_shared_validation_rejects_bad_buffers_before_any_call():
    ld, ls, rd, rs = operands(32, 32, 256)
    res = double.gemm(ld, ls[:, :2].copy(), rd, rs, "float32", "plain", {}, 1, 0, [])
    assert res["code"] == "INVALID_ARGUMENT" and "lhs scales has shape [32, 2], expected [32, 8]" in res["error"]
    assert res["log"] == []


def test_shipped_module_has_no_test_double():
    names = set(dir(_native))
    assert not {n for n in names if "fake" in n.lower() or "double" in n.lower()}, names
    assert {"registrations", "hipblaslt_status", "hipblaslt_check_shape"} <= names


# ---- The double itself: it refuses what hipBLASLt refuses and computes from what it is given,
# so the tests above would see a swapped operand, a wrong ld, transpose or scale pointer.

def raw(a, b, sa, sb, k, m, n, lda=None, ldb=None, trans_a=OP_T, trans_b=OP_N, mode=VEC32_UE8M0,
        ws_given=4096, ws_needed=4096, register_scales=True):
    st, out = double.raw_matmul(
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
