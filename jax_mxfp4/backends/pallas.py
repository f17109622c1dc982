"""Backend "pallas": fused MXFP4 GEMM kernels written in Pallas (Triton lowering).

a4w4 (both operands MXFP4) and w4a16 (MXFP4 x bfloat16): the kernels in
:mod:`jax_mxfp4.kernels.gemm` unpack E2M1 nibbles and apply E8M0 scales inside the K loop and
feed bfloat16 tiles to the matrix units with float32 accumulation; no dequantized operand is
written to device memory. Results equal backend "xla" up to the order of float32 accumulation.

"auto" picks it on CUDA and ROCm GPUs (``auto_platforms``), never on CPU. On CPU it can still be
named explicitly: it then runs the same kernels in the Pallas interpreter (slow; for tests).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..array import MXFP4Array
from ..mx_format import as_scale_bytes
from .base import Backend, GemmProblem

FLOAT_OPERAND_DTYPES = (np.dtype(jnp.bfloat16),)

# Shape rule for "auto", from benchmarks/gemm.py on an NVIDIA H200 (benchmarks/results/gemm/
# gemm.md, 2026-11-29): the kernels are bound by on-core E2M1 decoding, so for a4w4 they win only
# while one side is small (decode: 16x8192x8192 pallas 0.119 ms vs scaled_dot 0.194 ms;
# 128x8192x8192 0.208 vs 0.276) and lose once both M and N are large (1024x8192x8192: 1.07 vs
# 0.37 ms; 8192^3: 8.1 vs 1.8 ms). For w4a16 "scaled_dot" cannot run and pallas beats "xla"
# (float32 reference path) at every measured shape (2.7x to 5.7x), so no rule applies.
A4W4_MAX_SMALL_SIDE = 128


def _operand(x, kind):
    if isinstance(x, MXFP4Array):
        return (x.data, as_scale_bytes(x.plain_scales()))
    return x.astype(jnp.bfloat16)


class PallasBackend(Backend):
    """Fused Pallas/Triton MXFP4 GEMM (a4w4 and w4a16) for GPUs; interpreter on CPU."""

    name = "pallas"
    auto_platforms = ("cuda", "rocm")
    opaque = True  # a pallas_call: jax_mxfp4.partitioning gives it a sharding rule

    def unavailable_reason(self):
        try:
            from jax.experimental import pallas  # noqa: F401
            from jax.experimental.pallas import triton  # noqa: F401
        except Exception as e:  # pragma: no cover - depends on the installed jax
            return f"jax.experimental.pallas.triton cannot be imported ({e})"
        return None

    def rejects(self, problem: GemmProblem):
        for kind, dtype, side in (
            (problem.lhs_kind, problem.lhs_dtype, "lhs"),
            (problem.rhs_kind, problem.rhs_dtype, "rhs"),
        ):
            if kind == "float" and np.dtype(dtype) not in FLOAT_OPERAND_DTYPES:
                return (
                    f"w4a16 kernels take a bfloat16 float operand; {side} is {np.dtype(dtype).name} "
                    f"(converting it would change the result; backend 'xla' keeps it exact)"
                )
        if problem.platform not in ("cuda", "rocm", "cpu"):
            return f"Pallas Triton kernels run on CUDA/ROCm GPUs (and interpreted on CPU), not {problem.platform}"
        return None

    def auto_rejects(self, problem: GemmProblem):
        if not problem.has_float_operand and min(problem.m, problem.n) > A4W4_MAX_SMALL_SIDE:
            return (
                f"a4w4 with M={problem.m} and N={problem.n} both > {A4W4_MAX_SMALL_SIDE}: "
                "decode-bound here, 'scaled_dot' measured faster on the H200 (benchmarks/results/gemm)"
            )
        return None

    def gemm(self, lhs, rhs, problem: GemmProblem) -> jax.Array:
        from ..kernels.gemm import default_config, mxfp4_gemm

        cfg = default_config(
            problem.m, problem.n, problem.k, problem.batch,
            a4w4=not problem.has_float_operand,
        )
        return mxfp4_gemm(
            _operand(lhs, problem.lhs_kind),
            _operand(rhs, problem.rhs_kind),
            m=problem.m,
            n=problem.n,
            k=problem.k,
            out_dtype=problem.out_dtype,
            cfg=cfg,
            interpret=problem.platform == "cpu",
        )
