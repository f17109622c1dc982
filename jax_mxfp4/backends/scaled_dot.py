"""Backend "scaled_dot": JAX's own block-scaled dot, ``jax.lax.scaled_dot``.

XLA may route it to hipBLASLt on gfx950 (with ``--xla_gpu_experimental_scaled_dot_with_triton``);
elsewhere it decomposes to a bf16 convert-multiply-dot (exact: E2M1 x E8M0 values are bf16
values, their products are exact in float32, and it accumulates in float32). ``lax.scaled_dot``
is not differentiable in JAX 0.10, but backends only ever run forward GEMMs (the custom VJP of
:func:`jax_mxfp4.dot_general` calls them for fprop, dgrad and wgrad), so "auto" may pick it on
CUDA GPUs for what "fp8" and "pallas" (ahead in :data:`jax_mxfp4.dispatch.AUTO_ORDER`) decline.
On CUDA, XLA compiles it with its Triton GEMM emitter: with ``--xla_gpu_enable_triton_gemm=false``
in ``XLA_FLAGS`` it cannot, and this backend declines (:data:`TRITON_GEMM_FLAG`).

On ROCm it is XLA's own route to hipBLASLt: upstream XLA serves the ``xla.scaled_dot`` composite
with its autotuned hipBLASLt block-scaled call ``__cublas$lt$matmul$mx`` (read in sources,
reference/hipblaslt-mxfp4.md §7; not run here: the exported module holds only the composite,
the call is chosen by XLA's GPU compiler on the device). "auto" does not pick it on ROCm: XLA's
call sets plain VEC32 scales (§1.5) on either of hipBLASLt's internal routes, and the TensileLite
route may read plain scales in the pre-swizzled order (§7.1), a case backend "hipblaslt" refuses.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ..mx_format import as_e8m0, normal_range_blocks
from ..platform import current_platform, xla_flag_off
from .base import Backend
from .xla import CANONICAL_DIMS

TRITON_GEMM_FLAG = "xla_gpu_enable_triton_gemm"
"""The XLA flag without which XLA's CUDA compiler cannot compile a scaled-dot (jax/jaxlib 0.11.2 on
an NVIDIA H200, 2026-12-03: "INTERNAL: Unsupported instruction opcode: scaled-dot" with
``XLA_FLAGS=--xla_gpu_enable_triton_gemm=false``, a flag often set for cuBLAS GEMMs); the backend
then declines, so "auto" moves on and an explicit request raises a clear error."""


def packed_to_float4(data: jax.Array) -> jax.Array:
    """uint8 [..., K/2] packed E2M1 pairs -> ``float4_e2m1fn`` [..., K] (bit-preserving).

    The optimization barrier keeps XLA from constant-folding the bitcast: with jax/jaxlib 0.10.2 on
    CPU, a folded uint8 -> float4_e2m1fn bitcast gives wrong values (bytes [0x21, 0x43] fold to
    [-0.5, -1.5, 0, 0] instead of [0.5, 1, 1.5, 2]), so ``jit`` of a GEMM whose operand is a
    closed-over constant (e.g. params captured by the jitted function) returned a wrong product."""
    data = lax.optimization_barrier(data)
    f4 = lax.bitcast_convert_type(data, jnp.float4_e2m1fn)  # [..., K/2, 2], low nibble first
    return f4.reshape(*data.shape[:-1], data.shape[-1] * 2)


class ScaledDotBackend(Backend):
    name = "scaled_dot"
    auto_platforms = ("cuda",)
    # XLA's SPMD partitioner cannot legalize the scaled-dot composite on sharded operands (seen on
    # 2 H200s, jax 0.11.2): run it per shard under jax_mxfp4.partitioning's rule instead.
    opaque = True

    def unavailable_reason(self):
        if not hasattr(lax, "scaled_dot"):
            return f"jax.lax.scaled_dot is missing from jax {jax.__version__}"
        if current_platform() == "cuda" and xla_flag_off(TRITON_GEMM_FLAG):
            return (f"XLA_FLAGS sets --{TRITON_GEMM_FLAG}=false, and XLA's CUDA compiler emits "
                    "lax.scaled_dot through its Triton GEMM emitter only (with the flag it fails: "
                    "'Unsupported instruction opcode: scaled-dot')")
        return None

    def rejects(self, problem):
        if problem.has_float_operand:
            return "takes two MXFP4 operands only (no w4a16)"
        return None

    def gemm(self, lhs, rhs, problem):
        # Blocks with byte 0x00/0x01 re-encoded without subnormals (normal_range_blocks): the
        # decomposition multiplies by the bfloat16 scale 2^-127, a subnormal that XLA on CPU
        # treats as zero (the whole block lost) and a GPU keeps (elements the reference flushes).
        (ld, ls), (rd, rs) = (normal_range_blocks(x.data, x.plain_scales()) for x in (lhs, rhs))
        out = lax.scaled_dot(
            packed_to_float4(ld),
            packed_to_float4(rd),
            lhs_scale=as_e8m0(ls),
            rhs_scale=as_e8m0(rs),
            dimension_numbers=CANONICAL_DIMS,
            preferred_element_type=jnp.float32,
        )
        return out.astype(problem.out_dtype)
