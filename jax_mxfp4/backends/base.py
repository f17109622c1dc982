"""The backend interface and the canonical GEMM problem every backend receives.

Canonical form (one place maps every ``dimension_numbers`` onto it: :mod:`jax_mxfp4.gemm`):
  lhs: MXFP4Array [B, M, K], quantized along axis 2, plain scales [B, M, K/32]
  rhs: MXFP4Array [B, N, K], quantized along axis 2, plain scales [B, N, K/32]
  out: [B, M, N] = lhs · rhsᵀ per batch (the "TN" GEMM of BLAS, hipBLASLt's only FP4 layout)
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class GemmProblem:
    """Static description of one canonical GEMM (sizes in logical elements)."""

    batch: int
    m: int
    n: int
    k: int
    out_dtype: np.dtype
    scale_layout: str  # the layout the recipe asks the backend to consume ("plain" | "swizzled")
    platform: str  # "cpu", "cuda", "rocm", ...
    lhs_float: bool = False  # lhs was a float array quantized on the fly (not an MXFP4Array)
    rhs_float: bool = False


class Backend:
    """A GEMM backend. Subclasses set ``name`` and ``auto_platforms`` and implement the methods.

    ``auto_platforms``: platforms on which "auto" may pick this backend, in the order of
    :data:`jax_mxfp4.dispatch.AUTO_ORDER`; empty means explicit use only.
    """

    name: str = ""
    auto_platforms: tuple[str, ...] = ()

    def unavailable_reason(self) -> str | None:
        """None if this backend can run in this process, else why not (for explain())."""
        return None

    def rejects(self, problem: GemmProblem) -> str | None:
        """None if this backend handles ``problem``, else why not."""
        return None

    def gemm(self, lhs, rhs, problem: GemmProblem) -> jax.Array:
        raise NotImplementedError
