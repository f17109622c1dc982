"""The platform JAX runs on, as jax_mxfp4 names it: "cpu", "cuda", "rocm", "tpu", ...

The one place that tells CUDA from ROCm (JAX reports both as "gpu"). Imports nothing from
jax_mxfp4, so every module can use it without an import cycle.
"""

from __future__ import annotations

import jax


def current_platform() -> str:
    """Platform of JAX's default backend: "cpu", "cuda", "rocm", "tpu", ..."""
    platform = jax.default_backend()
    if platform == "gpu":
        version = jax.devices()[0].client.platform_version.lower()
        return "rocm" if ("rocm" in version or "hip" in version) else "cuda"
    return platform


def compute_capability() -> tuple[int, int] | None:
    """(major, minor) of CUDA device 0, or None where there is none (CPU, ROCm, TPU, or a device
    that does not report one)."""
    try:
        major, minor = str(jax.devices()[0].compute_capability).split(".")[:2]
        return int(major), int(minor)
    except Exception:  # pragma: no cover - depends on the device
        return None


def sm_count() -> int | None:
    """Streaming multiprocessors (CUDA) or compute units (ROCm) of device 0, as the device reports
    them (``Device.core_count``); None where there are none (CPU: the Pallas interpreter)."""
    count = getattr(jax.devices()[0], "core_count", None)
    return int(count) if count else None


def env_switch(name: str) -> bool:
    """A feature switch read from the environment: on unless set to 0/off/false/no (any case).

    Raises:
      ValueError: any other value than those or 1/on/true/yes/"" (a typo must not leave a switch
      silently on).
    """
    import os

    v = os.environ.get(name, "1").strip().lower()
    if v in ("0", "off", "false", "no"):
        return False
    if v in ("", "1", "on", "true", "yes"):
        return True
    raise ValueError(f"${name} must be 1/on/true/yes or 0/off/false/no, got {v!r}")


def xla_flag_off(name: str) -> bool:
    """Whether ``$XLA_FLAGS`` turns the boolean XLA flag ``name`` off (``--name=false`` or
    ``--name=0``; the last setting wins, as in XLA's own parsing). XLA reads ``$XLA_FLAGS`` when
    the backend starts, so this is what the process's compiler runs with unless the variable
    changed afterwards."""
    import os

    value = None
    for token in os.environ.get("XLA_FLAGS", "").split():
        flag, _, v = token.partition("=")
        if flag == f"--{name}":
            value = v.strip().lower()
    return value in ("false", "0")


KERNELS_ENV = "JAX_MXFP4_KERNELS"
"""The one switch over every custom GPU kernel (Pallas/Triton/Mosaic GPU): on by default; 0/off
turns them all off, leaving the portable paths (:func:`kernels_enabled`)."""


def kernels_enabled() -> bool:
    """Whether jax_mxfp4 may run its custom kernels (``$JAX_MXFP4_KERNELS``, on unless
    0/off/false/no). Off: backend "pallas" rejects every problem, the fp8 backend encodes,
    rescales and fixes flagged rows with its XLA formulations, :func:`jax_mxfp4.quantize` takes
    the reference jnp path and training quantizes in unfused passes; the same bits as the kernels
    everywhere except backend "pallas" (its GEMMs go to another backend).

    The one place this switch is read; it is read when a program is traced, so a change applies
    to programs traced after it (``jax.clear_caches()`` to recompile).

    Raises:
      ValueError: any other value (:func:`env_switch`), naming ``JAX_MXFP4_KERNELS``.
    """
    return env_switch(KERNELS_ENV)
