"""XLA FFI side of jax_mxfp4: handler registration, the GEMM primitive and export.

- :mod:`.registration`: loads ``jax_mxfp4._native``, registers the handlers with exact platform
  strings ("cpu", "ROCM"), reports why anything is unavailable.
- :mod:`.primitive`: ``mxfp4_gemm_p`` with abstract eval, a batching rule (vmap) and lowerings per
  platform (cpu -> ``jax_mxfp4_gemm_cpu``, rocm -> ``jax_mxfp4_gemm_hipblaslt``).

Exporting works as for JAX's own ops, with no context manager: every GEMM is staged per platform
(:func:`jax_mxfp4.dispatch.plan`), so ``jax.export`` lowers, for each platform it is asked for,
that platform's own path. On a machine without a GPU::

    import jax, jax.numpy as jnp
    import jax_mxfp4 as mx
    from jax_mxfp4.ffi import export_safety_checks

    def f(x, w):
        return mx.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16)

    x = jax.ShapeDtypeStruct((64, 256), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((32, 256), jnp.bfloat16)
    exp = jax.export.export(jax.jit(f), platforms=["cpu", "rocm"],
                            disabled_checks=export_safety_checks())(x, w)
    assert "jax_mxfp4_gemm_hipblaslt" in exp.mlir_module()  # rocm: the hipBLASLt handler
    y = exp.call(jnp.ones((64, 256), jnp.bfloat16), jnp.ones((32, 256), jnp.bfloat16))  # cpu: "xla"

``disabled_checks``: the jax_mxfp4 custom-call targets (and Pallas's Triton call) are not on
JAX's list of targets with a compatibility guarantee, so ``jax.export`` refuses them unless told
(:func:`export_safety_checks`).
An exported program runs where jax_mxfp4 is imported (its handlers registered). The hipBLASLt
handler re-checks device, library, envelope and route on the target and returns an error if
they fail.
"""

from __future__ import annotations

import jax

from .registration import CPU_TARGET, HIPBLASLT_TARGET, NATIVE_IMPORT_ERROR, hipblaslt_status

PALLAS_TRITON_TARGET = "__gpu$xla.gpu.triton"
"""The custom call of Pallas Triton kernels (backend "pallas" on CUDA/ROCm)."""


def export_safety_checks() -> list:
    """``disabled_checks`` for ``jax.export.export`` of programs with jax_mxfp4 GEMMs: one
    ``jax.export.DisabledSafetyCheck.custom_call`` per custom-call target a GEMM may lower to,
    the jax_mxfp4 FFI targets and Pallas's Triton call. None of them is on JAX's list of targets
    with a compatibility guarantee: run an exported program with the same jax and jax_mxfp4."""
    targets = (CPU_TARGET, HIPBLASLT_TARGET, PALLAS_TRITON_TARGET)
    return [jax.export.DisabledSafetyCheck.custom_call(t) for t in targets]


__all__ = [
    "CPU_TARGET",
    "HIPBLASLT_TARGET",
    "NATIVE_IMPORT_ERROR",
    "export_safety_checks",
    "hipblaslt_status",
]
