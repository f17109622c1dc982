"""XLA FFI side of jax_mxfp4: handler registration, the GEMM primitive and export targeting.

- :mod:`.registration`: loads ``jax_mxfp4._native``, registers the handlers with exact platform
  strings ("cpu", "ROCM"), reports why anything is unavailable.
- :mod:`.primitive`: ``mxfp4_gemm_p`` with abstract eval, a batching rule (vmap) and lowerings per
  platform (cpu -> ``jax_mxfp4_gemm_cpu``, rocm -> ``jax_mxfp4_gemm_hipblaslt``).
- :func:`target_platforms`: trace for another platform (``jax.export`` on a machine without it).
"""

from __future__ import annotations

import contextlib
import threading

from .registration import CPU_TARGET, HIPBLASLT_TARGET, NATIVE_IMPORT_ERROR, hipblaslt_status

_state = threading.local()


@contextlib.contextmanager
def target_platforms(*platforms: str):
    """Trace GEMMs for ``platforms`` (lower case, as ``jax.export``'s ``platforms``) instead of
    the process's own devices.

    Dispatch decides at trace time from ``jax.default_backend()``, so on a CPU-only machine the
    backend "hipblaslt" is unavailable. Inside this context, backends whose platform is listed
    are judged by the shape rules only (libraries, device arch and hipBLASLt version are checked
    by the handler at run time on the target, which returns an error if they fail), so::

        with jax_mxfp4.ffi.target_platforms("rocm"):
            exp = jax.export.export(jax.jit(f), platforms=["rocm"])(*args)

    emits the hipBLASLt custom_call. Name the backend explicitly (``Recipe(backend="hipblaslt")``):
    "auto" still decides for the current platform. Raises ValueError for an unknown platform.
    """
    known = ("cpu", "rocm", "cuda", "tpu")
    for p in platforms:
        if p not in known:
            raise ValueError(f"target_platforms: platform must be one of {known}, got {p!r}")
    previous = getattr(_state, "platforms", ())
    _state.platforms = tuple(platforms)
    try:
        yield
    finally:
        _state.platforms = previous


def current_target_platforms() -> tuple[str, ...]:
    """Platforms set by the innermost :func:`target_platforms` on this thread (empty if none)."""
    return getattr(_state, "platforms", ())


__all__ = [
    "CPU_TARGET",
    "HIPBLASLT_TARGET",
    "NATIVE_IMPORT_ERROR",
    "current_target_platforms",
    "hipblaslt_status",
    "target_platforms",
]
