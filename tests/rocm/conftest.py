"""Hardware kit for the hipBLASLt backend: every test here needs an AMD gfx950 GPU (MI350/MI355)
with ROCm >= 7.0 and is skipped elsewhere with the reason. Run: pytest -m rocm tests/rocm -v"""

from __future__ import annotations

import functools

import pytest


@functools.lru_cache(maxsize=1)
def gfx950_skip_reason() -> str | None:
    try:
        import jax

        from jax_mxfp4 import dispatch
        from jax_mxfp4.ffi import hipblaslt_status
    except Exception as e:  # pragma: no cover - import failure is itself the reason
        return f"jax_mxfp4 import failed: {e}"
    platform = dispatch.current_platform()
    if platform != "rocm":
        return f"needs a ROCm GPU; JAX's default backend is {platform!r} ({jax.devices()[0].device_kind})"
    st = hipblaslt_status()
    if not st.get("loaded"):
        return f"hipBLASLt could not be loaded: {st.get('error')}"
    archs = [d.get("arch") for d in st.get("devices", [])]
    if "gfx950" not in archs:
        return f"no gfx950 device (found {archs or 'none'}; {st.get('error') or ''})"
    reason = dispatch.get_backend("hipblaslt").unavailable_reason()
    return reason


def pytest_collection_modifyitems(config, items):
    reason = None
    for item in items:
        if "tests/rocm" not in str(item.fspath).replace("\\", "/"):
            continue
        item.add_marker(pytest.mark.rocm)
        if reason is None:
            reason = gfx950_skip_reason() or ""
        if reason:
            item.add_marker(pytest.mark.skip(reason=f"rocm: {reason}"))
