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
