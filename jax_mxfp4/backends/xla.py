"""Backend "xla": the portable, exact reference. Dequantize to float32, contract in float32."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ..quantize import dequantize
from .base import Backend

CANONICAL_DIMS = (((2,), (2,)), ((0,), (0,)))


class XlaBackend(Backend):
    """Dequantize both operands to float32 and ``lax.dot_general`` with ``Precision.HIGHEST`` and
    float32 accumulation, then cast. Runs on every platform. Each block product is exact (E2M1
    products and 32-term block sums are exact in float32; OCP MX v1.0 §6.1); only the float32
    accumulation across blocks rounds, in XLA's order."""

    name = "xla"
    auto_platforms = ("cpu", "cuda", "rocm", "tpu")

    def gemm(self, lhs, rhs, problem):
        a = dequantize(lhs, jnp.float32)
        b = dequantize(rhs, jnp.float32)
        out = lax.dot_general(
            a, b, CANONICAL_DIMS, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32
        )
        return out.astype(problem.out_dtype)
