"""Device tests of the GPU paths: every test here is marked ``gpu`` and is skipped, with the
reason, where JAX sees no GPU. Tests marked ``cuda`` also need an NVIDIA GPU (the Triton and
XLA FP8 paths these check are the CUDA ones; tests/rocm covers AMD), tests marked ``hopper`` an
NVIDIA Hopper GPU (compute capability 9.x: the Mosaic GPU kernels, WGMMA on sm_90a).
Run: pytest -m gpu tests/gpu -v (add -m "gpu and not slow" for the shorter set).

Random operands come from fixed seeds per case (gpu_reference.rand(seed, ...)): the data the
tolerances and the FP8 error bounds were measured on, the same on every run.

A test that runs longer than $JAX_MXFP4_GPU_TEST_TIMEOUT seconds (default 300) ends the run with
every thread's traceback (faulthandler): a kernel that deadlocks names itself instead of holding
the device until an outer time limit."""

from __future__ import annotations

import faulthandler
import functools
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # gpu_reference, mgpu_variants


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs an NVIDIA GPU (tests/gpu; skipped elsewhere)")
    config.addinivalue_line("markers", "hopper: needs an NVIDIA Hopper GPU, compute capability 9.x (tests/gpu)")


@functools.lru_cache(maxsize=1)
def gpu_skip_reason() -> str | None:
    try:
        import jax
    except Exception as e:  # pragma: no cover - import failure is itself the reason
        return f"jax import failed: {e}"
    try:
        devices = jax.devices()
    except Exception as e:  # pragma: no cover - a broken backend is itself the reason
        return f"jax.devices() failed: {e}"
    platforms = sorted({d.platform for d in devices})
    if not any(p in ("gpu", "cuda", "rocm") for p in platforms):
        return f"needs a GPU; jax.devices() has platform(s) {platforms} ({devices[0].device_kind})"
    return None


@functools.lru_cache(maxsize=1)
def cuda_skip_reason() -> str | None:
    from jax_mxfp4.platform import current_platform

    platform = current_platform()
    if platform != "cuda":
        return f"needs an NVIDIA GPU; JAX's GPU platform is {platform!r} (tests/rocm covers ROCm)"
    return None


@functools.lru_cache(maxsize=1)
def hopper_skip_reason() -> str | None:
    import jax

    from jax_mxfp4.platform import compute_capability

    reason = cuda_skip_reason()
    if reason:
        return reason
    cc = compute_capability()
    if cc is None or cc[0] != 9:
        return (f"needs an NVIDIA Hopper GPU (compute capability 9.x: WGMMA, Mosaic GPU); device 0 is "
                f"{jax.devices()[0].device_kind} with compute capability {cc}")
    try:
        from jax.experimental.pallas import mosaic_gpu  # noqa: F401
    except Exception as e:  # noqa: BLE001 - jaxlib built without Mosaic GPU
        return f"Mosaic GPU unavailable in this jaxlib: {e}"
    return None


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(os.path.abspath(__file__))
    for item in items:
        if not os.path.abspath(str(item.fspath)).startswith(here + os.sep):
            continue
        item.add_marker(pytest.mark.gpu)
        reason = gpu_skip_reason()
        if reason is None and item.get_closest_marker("hopper"):
            reason = hopper_skip_reason()
        elif reason is None and item.get_closest_marker("cuda"):
            reason = cuda_skip_reason()
        if reason:
            item.add_marker(pytest.mark.skip(reason=f"gpu: {reason}"))


@pytest.fixture(autouse=True)
def _hang_guard():
    """Ends the run with every thread's traceback when one test exceeds the time limit."""
    limit = float(os.environ.get("JAX_MXFP4_GPU_TEST_TIMEOUT", "300"))
    if limit > 0:
        faulthandler.dump_traceback_later(limit, exit=True)
    yield
    if limit > 0:
        faulthandler.cancel_dump_traceback_later()
