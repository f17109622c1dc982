"""Backend "xla": the portable, exact reference. Dequantize to float32, contract in float32."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ..array import MXFP4Array
from ..quantize import dequantize
from ..sharding import canonical_out_sharding
from .base import Backend

CANONICAL_DIMS = (((2,), (2,)), ((0,), (0,)))


def _as_float32(x):
    """Dequantized MXFP4Array, or a float operand (w4a16) widened exactly to float32."""
    return dequantize(x, jnp.float32) if isinstance(x, MXFP4Array) else x.astype(jnp.float32)


class XlaBackend(Backend):
    """Dequantize both operands to float32 and ``lax.dot_general`` with ``Precision.HIGHEST`` and
    float32 accumulation, then cast. Runs on every platform. Each block product is exact (E2M1
    products and 32-term block sums are exact in float32; OCP MX v1.0 §6.1); only the float32
    accumulation across blocks rounds, in XLA's order."""

    name = "xla"
    auto_platforms = ("cpu", "cuda", "rocm", "tpu")
    symbolic_dims = True  # XLA ops: shape-polymorphic exports lower with symbolic dims

    def gemm(self, lhs, rhs, problem):
        a = _as_float32(lhs)
        b = _as_float32(rhs)
        out = lax.dot_general(
            a,
            b,
            CANONICAL_DIMS,
            precision=lax.Precision.HIGHEST,
            preferred_element_type=jnp.float32,
            out_sharding=canonical_out_sharding(a, b),
        )
        return out.astype(problem.out_dtype)
