"""Backend "hipblaslt": hipBLASLt's native MXFP4 kernels on AMD gfx950 via the XLA FFI handler
``jax_mxfp4_gemm_hipblaslt`` (platform "ROCM").

Routing rules (checked here so "auto" can route elsewhere before the call; the handler checks
them again and returns an error): operands both MXFP4; M % 16, N % 16, K % 128 (hipBLASLt
api-reference, VEC32_UE8M0); a gfx950 device; hipBLASLt >= 1.0 (ROCm 7.0) for plain scales and
>= 1.3 for swizzled ones; and the hipBLASLt heuristic must return an algorithm for the shape and
output dtype (float16 output often has none). The ROCm libraries are loaded with dlopen on first
use, never at import time.
"""

from __future__ import annotations

from ..ffi import registration
from ..ffi.primitive import mxfp4_gemm
from .base import Backend
from .ffi_cpu import current_platform, packed_operands

MIN_VERSION = 100000  # hipBLASLt 1.0.0 (ROCm 7.0): FP4 + VEC32_UE8M0
MIN_VERSION_SWIZZLED = 100300  # hipBLASLt 1.3.0: BLK32_UE8M0_32_8_EXT usable
REQUIRED_ARCH = "gfx950"


def shape_reason(m: int, n: int, k: int) -> str | None:
    """Why hipBLASLt's MX path cannot take an M x N x K GEMM, or None."""
    if m % 16 or n % 16 or k % 128 or k <= 0:
        return f"hipBLASLt MXFP4 needs M % 16 == 0, N % 16 == 0, K % 128 == 0; got M={m}, N={n}, K={k}"
    return None


def _version(v: int) -> str:
    return f"{v // 100000}.{v // 100 % 1000}.{v % 100}"


class HipblasltBackend(Backend):
    """hipBLASLt MXFP4 GEMM on gfx950 (rules in the module docstring); "auto" prefers it on
    ROCm. Under :func:`jax_mxfp4.ffi.target_platforms` ("rocm") only the shape rules apply."""

    name = "hipblaslt"
    auto_platforms = ("rocm",)
    opaque = True  # an FFI custom call: jax_mxfp4.partitioning gives it a sharding rule

    def _exporting(self) -> bool:
        from ..ffi import current_target_platforms

        return "rocm" in current_target_platforms()

    def _device(self):
        """(ordinal, info) of the device the handler will see first, or (None, reason)."""
        status = registration.hipblaslt_status()
        if not status.get("loaded"):
            return None, f"ROCm libraries unavailable: {status.get('error')}"
        devices = status.get("devices", [])
        if not devices:
            return None, f"no HIP device visible ({status.get('error') or 'hipGetDeviceCount returned 0'})"
        dev = devices[0]
        if dev.get("error"):
            return None, f"device 0: {dev['error']}"
        return dev["ordinal"], dev

    def unavailable_reason(self):
        if registration.NATIVE_IMPORT_ERROR:
            return registration.NATIVE_IMPORT_ERROR
        if self._exporting():
            return None
        platform = current_platform()
        if platform != "rocm":
            return f"needs an AMD gfx950 GPU with ROCm >= 7.0 (JAX's default backend is {platform!r})"
        ordinal, info = self._device()
        if ordinal is None:
            return info
        if info["arch"] != REQUIRED_ARCH:
            return f"hipBLASLt MXFP4 needs gfx950 (MI350/MI355); device {ordinal} is {info['arch']}"
        if info["hipblaslt_version"] < MIN_VERSION:
            return f"hipBLASLt {_version(info['hipblaslt_version'])} has no FP4 support; need >= 1.0 (ROCm 7.0)"
        return None

    def rejects(self, problem):
        if problem.has_float_operand:
            return "takes two MXFP4 operands only (no w4a16 float operand)"
        why = shape_reason(problem.m, problem.n, problem.k)
        if why or self._exporting():
            return why
        ordinal, info = self._device()
        if ordinal is None:
            return info
        if problem.scale_layout == "swizzled" and info["hipblaslt_version"] < MIN_VERSION_SWIZZLED:
            return (
                f"swizzled scales need hipBLASLt >= 1.3 (BLK32_UE8M0_32_8_EXT); found "
                f"{_version(info['hipblaslt_version'])}"
            )
        ok, why = registration.native().hipblaslt_find_algorithm(
            ordinal, problem.m, problem.n, problem.k, problem.out_dtype.name, problem.scale_layout
        )
        return None if ok else why

    def gemm(self, lhs, rhs, problem):
        registration.ensure_registered()
        return mxfp4_gemm(
            *packed_operands(lhs, rhs, problem),
            out_dtype=problem.out_dtype, scale_layout=problem.scale_layout, backend=self.name,
        )
