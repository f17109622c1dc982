"""JAX_MXFP4_KERNELS, the one switch over the custom GPU kernels: off, backend "pallas" rejects
every problem naming the switch, quantize and the fp8 backend's functions trace no pallas_call on
a CUDA-judged path (the portable forms, the same bits), and a bad value is refused by name."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import mx_reference as ref
import numpy as np
import pytest

import jax_mxfp4 as mx
from jax_mxfp4 import dispatch, platform
from jax_mxfp4 import fp8_prepared as fp8
from jax_mxfp4.backends import fp8 as fp8_backend
from jax_mxfp4.backends.base import GemmProblem

qmod = importlib.import_module("jax_mxfp4.quantize")  # the module (the package exports the function)


@pytest.fixture
def kernels_off(monkeypatch):
    """JAX_MXFP4_KERNELS=0; jit caches cleared around it (the switch is read when tracing)."""
    monkeypatch.setenv(platform.KERNELS_ENV, "0")
    jax.clear_caches()
    fp8_backend.fp8_gemm.clear_cache()
    yield
    jax.clear_caches()
    fp8_backend.fp8_gemm.clear_cache()


def _decode_size_cuda_problem():
    """A decode-size a4w4 GEMM judged for CUDA: "auto" picks "pallas" with the kernels on
    (tests/test_dispatch.py: test_auto_shape_rules_on_cuda)."""
    return GemmProblem(batch=1, m=16, n=8192, k=1024, out_dtype=np.dtype(jnp.bfloat16), scale_layout="plain",
                       platform="cuda", lhs_kind="quantized", rhs_kind="mxfp4",
                       lhs_dtype=np.dtype(jnp.bfloat16), rhs_dtype=np.dtype(jnp.float32))


def test_kernels_switch_is_on_by_default_and_refuses_a_bad_value(monkeypatch):
    monkeypatch.delenv(platform.KERNELS_ENV, raising=False)
    assert platform.kernels_enabled()
    for value, on in (("0", False), ("off", False), ("No", False), ("1", True), ("on", True), ("", True)):
        monkeypatch.setenv(platform.KERNELS_ENV, value)
        assert platform.kernels_enabled() is on, value
    monkeypatch.setenv(platform.KERNELS_ENV, "of")
    with pytest.raises(ValueError, match=r"\$JAX_MXFP4_KERNELS must be 1/on/true/yes or 0/off/false/no, got 'of'"):
        platform.kernels_enabled()
    with pytest.raises(ValueError, match="JAX_MXFP4_KERNELS"):  # where a GEMM is planned, not silently on
        mx.explain(jax.ShapeDtypeStruct((16, 64), jnp.bfloat16), jax.ShapeDtypeStruct((64, 64), jnp.bfloat16),
                   (((1,), (0,)), ((), ())))
    # read when used, not at import: a bad value does not break `import jax_mxfp4`
    env = dict(os.environ, JAX_MXFP4_KERNELS="bogus")
    r = subprocess.run([sys.executable, "-c", "import jax_mxfp4"], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


def test_kernels_off_pallas_rejected_on_cuda_naming_the_switch(monkeypatch, kernels_off):
    for name in ("pallas", "scaled_dot"):  # as on a CUDA machine: the shape rules alone decide
        monkeypatch.setattr(dispatch._REGISTRY[name], "unavailable_reason", lambda: None)
    monkeypatch.setattr(dispatch, "_LOGGED", set())
    d = dispatch.decide(_decode_size_cuda_problem(), "auto")
    assert d.backend != "pallas", str(d)
    assert "JAX_MXFP4_KERNELS=0" in d.reasons["pallas"], d.reasons["pallas"]
    with pytest.raises(mx.BackendUnavailableError, match=r"JAX_MXFP4_KERNELS=0"):
        dispatch.decide(_decode_size_cuda_problem(), "pallas")
    monkeypatch.delenv(platform.KERNELS_ENV)
    assert dispatch.decide(_decode_size_cuda_problem(), "auto").backend == "pallas"  # the default


def test_kernels_off_explain_names_the_switch(kernels_off):
    x, w = jax.ShapeDtypeStruct((16, 256), jnp.bfloat16), jax.ShapeDtypeStruct((256, 64), jnp.bfloat16)
    dims = (((1,), (0,)), ((), ()))
    d = mx.explain(x, w, dims)
    assert "JAX_MXFP4_KERNELS=0" in d.reasons["pallas"] and "JAX_MXFP4_KERNELS=0" in str(d)
    assert "pallas" not in d.per_platform.values(), d.per_platform  # CUDA and ROCm lowerings too
    with pytest.raises(mx.BackendUnavailableError, match="JAX_MXFP4_KERNELS=0"):
        mx.explain(x, w, dims, recipe=mx.Recipe(backend="pallas"))


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_kernels_off_quantize_on_cuda_takes_the_reference_path(monkeypatch, kernels_off, rounding, rng, jax_key):
    """quantize judged for CUDA (the platform replaced: tracing only needs the name): the fused
    Pallas quantizer with the kernels on, the reference jnp path (no pallas_call) off, whose
    values (run here on the CPU) are the NumPy reference's."""
    monkeypatch.setattr(qmod, "current_platform", lambda: "cuda")
    x = jnp.asarray(rng.standard_normal((8, 64)) * 2.0 ** rng.integers(-8, 8, (8, 1)), jnp.float32)
    key = jax_key if rounding == "stochastic" else None
    f = lambda x: mx.quantize(x, 1, rounding=rounding, key=key)  # noqa: E731
    assert "pallas_call" not in str(jax.make_jaxpr(f)(x))
    if rounding == "nearest":
        q = f(x)
        codes, scale_bytes = ref.quantize_ref(np.asarray(x), 1, "even")
        np.testing.assert_array_equal(np.asarray(q.data), ref.pack_ref(codes, 1))
        np.testing.assert_array_equal(np.asarray(q.scales).view(np.uint8), scale_bytes)
    monkeypatch.delenv(platform.KERNELS_ENV)
    jax.clear_caches()
    assert "pallas_call" in str(jax.make_jaxpr(f)(x))  # the default: the fused quantizer


def test_kernels_off_fp8_functions_on_cuda_trace_no_kernel(monkeypatch, kernels_off, rng):
    """The fp8 backend judged for CUDA: the row encoding, the rescale and the flagged-row fix are
    Pallas kernels by default and their XLA formulations with the kernels off."""
    a = mx.quantize(jnp.asarray(rng.standard_normal((1, 64, 64)), jnp.float32), 2)
    b = mx.quantize(jnp.asarray(rng.standard_normal((1, 32, 64)), jnp.float32), 2)

    def jaxprs():
        fp8_backend.fp8_gemm.clear_cache()
        gemm = jax.make_jaxpr(lambda a, b: fp8_backend.fp8_gemm(a, b, jnp.bfloat16, "default", "cuda"))(a, b)
        encode = jax.make_jaxpr(lambda d, s: fp8.encode_rows_on(d, s, "cuda"))(a.data, a.scales)
        return str(gemm), str(encode)

    gemm, encode = jaxprs()
    assert "pallas_call" not in gemm and "pallas_call" not in encode
    assert "top_k" in gemm  # the portable flagged-row loop
    monkeypatch.delenv(platform.KERNELS_ENV)
    gemm, encode = jaxprs()
    for name in ("mxfp4_fp8_rescale", "mxfp4_fp8_fix_flagged"):
        assert f"name={name}" in gemm, name
    assert "pallas_call" in encode
