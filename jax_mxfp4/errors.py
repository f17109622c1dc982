"""Exceptions of jax_mxfp4 that more than one layer raises (imports nothing of the package)."""

from __future__ import annotations


class BackendUnavailableError(RuntimeError):
    """A backend named explicitly (Recipe.backend or JAX_MXFP4_BACKEND) cannot run this GEMM:
    raised when the GEMM is traced, or, for a backend staged for another platform (an export),
    when the program is lowered for a platform the backend has no handler on."""
