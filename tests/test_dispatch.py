"""Backend selection: available_backends, explain, JAX_MXFP4_BACKEND, explicit errors, fallback log."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_mxfp4 as mx
from jax_mxfp4 import dispatch
from jax_mxfp4.backends.base import Backend

DIMS = (((1,), (0,)), ((), ()))


def operands():
    return jnp.ones((8, 64)), jnp.ones((64, 16))


def test_available_backends_on_cpu():
    names = mx.available_backends()
    assert "xla" in names and "scaled_dot" in names
    assert "hipblaslt" not in names  # no ROCm device here


def test_auto_picks_xla_on_cpu_and_explains_the_rest():
    d = mx.explain(*operands(), DIMS)
    assert d.backend == "xla" and d.requested == "auto"
    assert d.problem.m == 8 and d.problem.n == 16 and d.problem.k == 64 and d.problem.batch == 1
    assert set(d.reasons) == set(dispatch._REGISTRY)
    assert all(why for name, why in d.reasons.items() if name != "xla")
    text = str(d)
    assert "8x16x64" in text and "'xla'" in text
    # explain accepts abstract shapes too
    s = jax.ShapeDtypeStruct((8, 64), jnp.bfloat16)
    assert mx.explain(s, jax.ShapeDtypeStruct((64, 16), jnp.float32), DIMS).backend == "xla"


def test_env_var_overrides_auto(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "scaled_dot")
    assert mx.explain(*operands(), DIMS).backend == "scaled_dot"
    out = mx.dot_general(*operands(), DIMS)
    np.testing.assert_array_equal(np.asarray(out), 64.0)
    # an explicit recipe backend beats the environment
    assert mx.explain(*operands(), DIMS, recipe=mx.Recipe(backend="xla")).backend == "xla"


def test_env_var_naming_unknown_backend_raises(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "cublas")
    with pytest.raises(mx.BackendUnavailableError, match=r"\$JAX_MXFP4_BACKEND='cublas' is not a known backend"):
        mx.dot_general(*operands(), DIMS)


def test_explicit_unavailable_backend_raises_never_falls_back():
    with pytest.raises(mx.BackendUnavailableError, match="Recipe.backend='hipblaslt' cannot run this GEMM|not a known backend"):
        mx.dot_general(*operands(), DIMS, recipe=mx.Recipe(backend="hipblaslt"))
    x = jnp.ones((8, 64), jnp.bfloat16)
    wq = mx.quantize(jnp.ones((64, 16)), axis=0)
    with pytest.raises(mx.BackendUnavailableError, match="scaled_dot.*no w4a16"):
        mx.dot_general(x, wq, DIMS, recipe=mx.Recipe(backend="scaled_dot", quantize_activations=False))


class _Rejecting(Backend):
    name = "pallas"
    auto_platforms = ("cpu",)

    def rejects(self, problem):
        return "test double: shape not supported"


def test_auto_fallback_is_logged_once(monkeypatch, caplog):
    monkeypatch.setitem(dispatch._REGISTRY, "pallas", _Rejecting())
    monkeypatch.setattr(dispatch, "_LOGGED", set())
    with caplog.at_level(logging.WARNING, logger="jax_mxfp4"):
        for _ in range(3):
            d = mx.explain(*operands(), DIMS)
    assert d.backend == "xla"
    assert d.reasons["pallas"] == "test double: shape not supported"
    records = [r for r in caplog.records if "fell back" in r.getMessage()]
    assert len(records) == 1 and "pallas: test double" in records[0].getMessage()


def _cuda_problem(m, n, k=1024, w4a16=False, precision="default"):
    from jax_mxfp4.backends.base import GemmProblem

    return GemmProblem(
        batch=1, m=m, n=n, k=k, out_dtype=np.dtype(jnp.bfloat16), scale_layout="plain", platform="cuda",
        lhs_kind="float" if w4a16 else "quantized", rhs_kind="mxfp4",
        lhs_dtype=np.dtype(jnp.bfloat16), rhs_dtype=np.dtype(jnp.float32), precision=precision,
    )


@pytest.mark.parametrize("m,n,w4a16,want,precision", [
    (16, 8192, False, "pallas", "default"),        # decode-sized a4w4: the fused kernel (H200 measurements)
    (128, 8192, False, "pallas", "default"),
    (8192, 64, False, "pallas", "default"),        # small N counts too
    (1024, 8192, False, "fp8", "default"),         # both sides large: FP8 tensor cores
    (1024, 8192, False, "scaled_dot", "highest"),  # ... unless float32 accumulation is asked for
    (1024, 8192, True, "pallas", "default"),       # w4a16: scaled_dot cannot run it, pallas beats xla
])
def test_auto_shape_rules_on_cuda(m, n, w4a16, want, precision, monkeypatch):
    if "pallas" not in dispatch._REGISTRY:
        pytest.skip("pallas backend not registered")
    # the shape rules only: pretend every backend is installed (as on a CUDA machine)
    for name in ("pallas", "scaled_dot"):
        monkeypatch.setattr(dispatch._REGISTRY[name], "unavailable_reason", lambda: None)
    monkeypatch.setattr(dispatch, "_LOGGED", set())
    d = dispatch.decide(_cuda_problem(m, n, w4a16=w4a16, precision=precision), "auto")
    assert d.backend == want, str(d)
    if want == "scaled_dot":
        assert "measured faster" in d.reasons["pallas"]


@pytest.mark.parametrize("flags,off", [
    ("", False),
    ("--xla_gpu_enable_triton_gemm=false", True),
    ("--xla_gpu_autotune_level=0 --xla_gpu_enable_triton_gemm=0", True),
    ("--xla_gpu_enable_triton_gemm=False", True),
    ("--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_triton_gemm=true", False),  # the last one wins
    ("--xla_gpu_enable_triton_gemm=true", False),
    ("--xla_gpu_enable_triton_gemm_any=false", False),  # another flag
])
def test_xla_flag_off_reads_xla_flags(flags, off, monkeypatch):
    from jax_mxfp4.platform import xla_flag_off

    monkeypatch.setenv("XLA_FLAGS", flags)
    assert xla_flag_off("xla_gpu_enable_triton_gemm") is off


def test_scaled_dot_declines_on_cuda_without_triton_gemm(monkeypatch):
    """XLA's CUDA compiler emits lax.scaled_dot through its Triton GEMM emitter only: with
    --xla_gpu_enable_triton_gemm=false it fails to compile ("Unsupported instruction opcode:
    scaled-dot", jax 0.11.2 on an H200). Backend scaled_dot then declines in a CUDA process:
    "auto" moves on for the GEMM it would have picked (float32 accumulation asked for), and an
    explicit request raises BackendUnavailableError naming the flag. Without the flag, or on
    another platform, it is available."""
    import jax_mxfp4.backends.scaled_dot as sd

    if "pallas" not in dispatch._REGISTRY:
        pytest.skip("pallas backend not registered")
    monkeypatch.setattr(dispatch._REGISTRY["pallas"], "unavailable_reason", lambda: None)
    monkeypatch.setattr(dispatch, "_LOGGED", set())
    monkeypatch.setattr(dispatch, "current_platform", lambda: "cuda")
    monkeypatch.setattr(sd, "current_platform", lambda: "cuda")
    problem = _cuda_problem(1024, 8192, precision="highest")
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_triton_gemm=false")
    d = dispatch.decide(problem, "auto")
    assert d.backend not in ("scaled_dot", "fp8"), str(d)
    assert "xla_gpu_enable_triton_gemm" in d.reasons["scaled_dot"]
    with pytest.raises(mx.BackendUnavailableError, match="xla_gpu_enable_triton_gemm=false"):
        dispatch.decide(problem, "scaled_dot")
    monkeypatch.setenv("XLA_FLAGS", "")
    assert dispatch.decide(problem, "auto").backend == "scaled_dot"
    monkeypatch.setattr(sd, "current_platform", lambda: "cpu")  # the flag concerns XLA's CUDA compiler only
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_triton_gemm=false")
    assert dispatch._REGISTRY["scaled_dot"].unavailable_reason() is None
