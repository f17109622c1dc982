"""Backend "ffi-cpu": the C++ reference handler ``jax_mxfp4_gemm_cpu`` through XLA FFI (CPU only).

Numerics (xla_ffi/include/jax_mxfp4/cpu_gemm.h): each 32-element block product is exact and the
blocks accumulate in float32 in ascending K order, then one rounding to the output dtype. The C++
side decodes E2M1/E8M0 and the swizzled scale layout with its own code, so comparing it with
backend "xla" checks jax_mxfp4.mx_format and jax_mxfp4.layout. Explicit use only ("auto" keeps
"xla" on CPU).
"""

from __future__ import annotations

import jax

from .. import layout
from ..ffi import registration
from ..ffi.primitive import mxfp4_gemm
from ..platform import current_platform
from .base import Backend


def packed_operands(lhs, rhs, problem):
    """(lhs_data, lhs_scales, rhs_data, rhs_scales) of canonical MXFP4Arrays [B, M|N, K] in the
    layout ``problem.scale_layout`` asks for; "swizzled" is applied per batch element to the 2-D
    [rows, K/32] view (jax_mxfp4.layout.swizzle), as hipBLASLt consumes one matrix per call."""
    ls, rs = lhs.plain_scales(), rhs.plain_scales()
    if problem.scale_layout == "swizzled":
        ls, rs = jax.vmap(layout.swizzle)(ls), jax.vmap(layout.swizzle)(rs)
    return lhs.data, ls, rhs.data, rs


class FfiCpuBackend(Backend):
    """CPU reference handler through XLA FFI; MXFP4 x MXFP4 only, plain or swizzled scales,
    float32/bfloat16/float16 out. Unavailable off the CPU platform (explicit use only)."""

    name = "ffi-cpu"
    auto_platforms = ()
    lowers_on = ("cpu",)
    opaque = True  # an FFI custom call: jax_mxfp4.partitioning gives it a sharding rule

    def foreign_reason(self, platform):
        if platform not in self.lowers_on:
            return f"lowers only for cpu, not {platform}"
        return registration.NATIVE_IMPORT_ERROR

    def unavailable_reason(self):
        if registration.NATIVE_IMPORT_ERROR:
            return registration.NATIVE_IMPORT_ERROR
        platform = current_platform()
        if platform != "cpu":
            return f"runs only on the CPU platform (JAX's default backend is {platform!r})"
        return None

    def rejects(self, problem):
        if problem.has_float_operand:
            return "takes two MXFP4 operands only (no w4a16 float operand)"
        return None

    def gemm(self, lhs, rhs, problem):
        registration.ensure_registered()
        out = mxfp4_gemm(
            *packed_operands(lhs, rhs, problem),
            out_dtype=problem.out_dtype, scale_layout=problem.scale_layout, backend=self.name,
        )
        return out
