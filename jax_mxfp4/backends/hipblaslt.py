"""Backend "hipblaslt": hipBLASLt's native MXFP4 kernels on AMD gfx950 via the XLA FFI handler
``jax_mxfp4_gemm_hipblaslt`` (platform "ROCM").

Routing rules (checked here so "auto" can route elsewhere before the call; the handler checks
them again and returns an error). Every rule lives once, in C++ (xla_ffi/src/hipblaslt_gemm.cc);
this module asks it through ``_native``:

- operands both MXFP4 (no w4a16);
- the envelope (``JAX_MXFP4_HIPBLASLT_ENVELOPE``). Default "validated", the project's policy,
  modelled on the gate reported for ROCm TransformerEngine's MXFP4 hipBLASLt GEMM on gfx950:
  hipBLASLt >= 1.3, K % 256 == 0, M % 32 == N % 32 == 0, bfloat16 or float32 out, beta = 0.
  "documented" (opt-in, UNVERIFIED on hardware): hipBLASLt's api-reference rules M % 16, N % 16,
  K % 128, float16 out too, hipBLASLt >= 1.0 for plain scales (>= 1.3 swizzled), and swizzled
  scales on hipBLASLt < 1.5 only unpadded (M % 32, N % 32, K % 256);
- in both envelopes, plain scales are refused on hipBLASLt's TensileLite route
  (``HIPBLASLT_USE_ROCROLLER`` set to anything not starting with "1", or a libhipblaslt that does
  not link librocroller), for every shape: TensileLite is not told the scale mode and its gfx950
  FP4 kernels read pre-swizzled scales (reference §7.1). ``scale_layout="swizzled"`` is that
  route's own path. The route is read once, when the handler creates its first hipBLASLt handle;
- a gfx950 device, ROCm >= 7.0;
- the hipBLASLt heuristic returns an algorithm for the shape and output dtype.

The ROCm libraries are loaded with dlopen on first use, never at import time.
"""

from __future__ import annotations

import os

import numpy as np

from ..ffi import registration
from ..ffi.primitive import mxfp4_gemm
from .base import Backend
from ..platform import current_platform
from .ffi_cpu import packed_operands

MIN_VERSION = 100000  # hipBLASLt 1.0.0 (ROCm 7.0): FP4 + VEC32_UE8M0 (below it: no FP4 at all)
REQUIRED_ARCH = "gfx950"
ENVELOPE_ENV = "JAX_MXFP4_HIPBLASLT_ENVELOPE"


def shape_reason(m: int, n: int, k: int, out_dtype="bfloat16") -> str | None:
    """Why the hipBLASLt envelope in force (``$JAX_MXFP4_HIPBLASLT_ENVELOPE``) excludes an
    M x N x K GEMM writing ``out_dtype``, or None. The rule is the handler's own
    (``CheckHipblasltShape`` in C++); needs the compiled extension. The variable is read here, from
    ``os.environ``, and handed over."""
    envelope = os.environ.get(ENVELOPE_ENV, "")
    ok, why = registration.native().hipblaslt_check_shape(m, n, k, np.dtype(out_dtype).name, envelope)
    return None if ok else why


def _version(v: int) -> str:
    return f"{v // 100000}.{v // 100 % 1000}.{v % 100}"


class HipblasltBackend(Backend):
    """hipBLASLt MXFP4 GEMM on gfx950 (rules in the module docstring); "auto" prefers it on
    ROCm. Judged for a platform other than this process's own (``jax.export(...,
    platforms=["rocm"])`` on a machine without the GPU), only the envelope's shape rules apply:
    the handler checks device, library, version and route on the target and returns an error."""

    name = "hipblaslt"
    auto_platforms = ("rocm",)
    lowers_on = ("rocm",)
    opaque = True  # an FFI custom call: jax_mxfp4.partitioning gives it a sharding rule

    def foreign_reason(self, platform):
        if platform not in self.lowers_on:
            return f"lowers only for rocm, not {platform}"
        return registration.NATIVE_IMPORT_ERROR

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
        why = shape_reason(problem.m, problem.n, problem.k, problem.out_dtype)
        if why or problem.platform != current_platform():  # judged for another platform: shapes only
            return why
        ordinal, info = self._device()
        if ordinal is None:
            return info
        # Version, route and heuristic: the handler's own gates, then hipBLASLt's answer.
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
