"""The one place that loads ``jax_mxfp4._native`` and registers its XLA FFI handlers.

Platform strings are exact (jax-ffi.md §0.3): XLA keys handlers by ``"cpu"`` (alias of ``"Host"``)
and ``"ROCM"``; a wrong case is accepted silently and fails only at run time. Registration is lazy
(first use of an FFI backend) and calls ``jax.devices()`` first, so the backends are initialised
before any handler is registered (jax-ffi.md §0.4: type/handler registration order).

Importing this module never fails: if the compiled extension is missing, :data:`NATIVE_IMPORT_ERROR`
says why and the FFI backends report it through ``unavailable_reason()`` (and ``explain()``).
The ROCm libraries are not touched here; they are loaded with dlopen on first use of the
hipBLASLt backend on a ROCm platform (:func:`hipblaslt_status`).
"""

from __future__ import annotations

import functools
import importlib.util
import threading

import jax

try:
    from .. import _native
except ImportError as e:  # source tree without the compiled module, broken build, ...
    _native = None
    _missing = importlib.util.find_spec(f"{__package__.rpartition('.')[0]}._native") is None
    NATIVE_IMPORT_ERROR: str | None = (
        "the compiled extension jax_mxfp4._native "
        + ("is not built (jax_mxfp4 was imported from a source tree or installed without it)"
           if _missing else f"could not be loaded ({e})")
        + "; install with `pip install .` (needs a C++17 compiler and CMake)"
    )
else:
    NATIVE_IMPORT_ERROR = None

CPU_TARGET = "jax_mxfp4_gemm_cpu"
HIPBLASLT_TARGET = "jax_mxfp4_gemm_hipblaslt"
FFI_PLATFORMS = {CPU_TARGET: "cpu", HIPBLASLT_TARGET: "ROCM"}
"""XLA FFI platform string of each target (exact spelling matters)."""

_lock = threading.Lock()
_registered = False


def native():
    """The compiled module; raises RuntimeError naming the import failure if it is missing."""
    if _native is None:
        raise RuntimeError(NATIVE_IMPORT_ERROR)
    return _native


def ensure_registered() -> None:
    """Register every FFI target of ``_native`` with XLA (idempotent, thread-safe)."""
    global _registered
    if _registered:
        return
    mod = native()
    with _lock:
        if _registered:
            return
        jax.devices()  # initialise the backends before registering handlers (jax-ffi.md §0.4)
        for name, (platform, capsule) in mod.registrations().items():
            if FFI_PLATFORMS.get(name) != platform:
                raise RuntimeError(
                    f"_native registers {name!r} for platform {platform!r}, but jax_mxfp4 expects "
                    f"{FFI_PLATFORMS.get(name)!r}: the extension and the Python package disagree"
                )
            jax.ffi.register_ffi_target(name, capsule, platform=platform, api_version=1)
        _registered = True


@functools.lru_cache(maxsize=1)
def hipblaslt_status() -> dict:
    """Load libamdhip64 + libhipblaslt (once) and describe them and every visible device.

    Returns ``{"loaded", "error", "hip_path", "hipblaslt_path", "searched", "devices": [{"ordinal",
    "arch", "hipblaslt_version", "hip_runtime_version", "error"}]}``. Never raises for missing
    libraries (the reason is in ``error``). Search order and ``JAX_MXFP4_ROCM_LIB_DIR``: README.
    """
    if _native is None:
        return {"loaded": False, "error": NATIVE_IMPORT_ERROR, "devices": []}
    return dict(_native.hipblaslt_status(True))
