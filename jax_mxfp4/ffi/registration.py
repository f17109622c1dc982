"""The one place that loads ``jax_mxfp4._native`` and registers its XLA FFI handlers.

Platform strings are exact (jax-ffi.md §0.3): XLA keys handlers by ``"cpu"`` (alias of ``"Host"``)
and ``"ROCM"``; a wrong case is accepted silently and fails only at run time. Registration is lazy
(first use of an FFI backend) and calls ``jax.devices()`` first, so the backends are initialised
before any handler is registered (jax-ffi.md §0.4: type/handler registration order).

Importing this module never fails: if the compiled extension is missing, :data:`NATIVE_IMPORT_ERROR`
says why and the FFI backends report it through ``unavailable_reason()`` (and ``explain()``).
The ROCm libraries are not touched here; they are loaded with dlopen on first use of the
hipBLASLt backend on a ROCm platform (:func:`hipblaslt_status`). Before that, the lib
directories of pip-installed ROCm (TheRock wheels) are handed to the loader
(:func:`rocm_wheel_library_dirs`).
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
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


ROCM_WHEEL_PACKAGES = ("_rocm_sdk_core", "_rocm_sdk_libraries")
"""Top-level packages of TheRock's ROCm wheels: ``rocm-sdk-core`` installs ``_rocm_sdk_core``
(``lib/libamdhip64.so.7``), ``rocm-sdk-libraries-<family>`` installs ``_rocm_sdk_libraries*``
(``lib/libhipblaslt.so.1``)."""


def rocm_wheel_library_dirs() -> list[str]:
    """The ``lib`` directories of pip-installed ROCm: ``_rocm_sdk_core`` first, then every
    ``_rocm_sdk_libraries*`` package, found through ``importlib.metadata`` (installed
    distributions and their top-level packages) and located with ``importlib.util.find_spec``
    (nothing is imported). Empty when no such wheel is installed. Never raises."""
    try:
        top_level = importlib.metadata.packages_distributions()
    except Exception:  # broken metadata somewhere on sys.path: no wheel dirs, system search only
        return []
    dirs: list[str] = []
    for prefix in ROCM_WHEEL_PACKAGES:
        for name in sorted(n for n in top_level if n.startswith(prefix)):
            try:
                spec = importlib.util.find_spec(name)
            except (ImportError, ValueError):
                continue
            for location in (spec.submodule_search_locations or []) if spec else []:
                lib = os.path.join(location, "lib")
                if os.path.isdir(lib) and lib not in dirs:
                    dirs.append(lib)
    return dirs


@functools.lru_cache(maxsize=1)
def _configure_rocm_search() -> tuple[str, ...]:
    """Hand :func:`rocm_wheel_library_dirs` to the loader once, before it first runs."""
    dirs = rocm_wheel_library_dirs()
    if _native is not None:
        _native.set_wheel_library_dirs(dirs)
    return tuple(dirs)


def ensure_registered() -> None:
    """Register every FFI target of ``_native`` with XLA (idempotent, thread-safe)."""
    global _registered
    if _registered:
        return
    mod = native()
    _configure_rocm_search()  # the handler may be the first to load hipBLASLt
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

    Returns ``{"loaded", "error", "hip_path", "hipblaslt_path", "searched", "rocroller_path",
    "envelope", "devices": [{"ordinal", "arch", "hipblaslt_version", "hip_runtime_version",
    "route", "error"}]}``; ``route`` is hipBLASLt's internal MX route as far as it can be told
    (rocRoller or TensileLite, and why). Never raises for missing libraries (the reason is in
    ``error``). Search order and ``JAX_MXFP4_ROCM_LIB_DIR``: README.
    """
    if _native is None:
        return {"loaded": False, "error": NATIVE_IMPORT_ERROR, "devices": []}
    _configure_rocm_search()
    status = dict(_native.hipblaslt_status(True))
    status["devices"] = [dict(d) for d in status["devices"]]
    return status
