"""jax-mxfp4: MXFP4 (OCP Microscaling FP4) matrix multiplication for JAX and Flax.

Public API: :func:`quantize`, :func:`dequantize`, :class:`MXFP4Array`, :func:`dot_general`,
:class:`Recipe`, :func:`available_backends`, :func:`explain`.
"""

from .array import MXFP4Array
from .dispatch import BackendUnavailableError, available_backends
from .gemm import dot_general, explain
from .quantize import dequantize, quantize
from .recipe import Recipe

__version__ = "0.1.0"

__all__ = [
    "MXFP4Array",
    "BackendUnavailableError",
    "Recipe",
    "available_backends",
    "dequantize",
    "dot_general",
    "explain",
    "quantize",
]
