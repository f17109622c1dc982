"""jax-mxfp4: MXFP4 (OCP Microscaling FP4) matrix multiplication for JAX and Flax.

Public API: :func:`quantize`, :func:`dequantize`, :class:`MXFP4Array`, :func:`dot_general`
(differentiable: MXFP4 fprop, dgrad and wgrad; :mod:`jax_mxfp4.training`), :func:`einsum`,
:func:`dense`, :class:`Recipe`, :func:`available_backends`, :func:`explain`, :func:`prepare_fp8`
(:class:`FP8Prepared`, a weight converted once for the FP8 GEMM path), :func:`prepare_decode`
(:class:`DecodePrepared`, a weight arranged once for decode-size GEMMs), :func:`ragged_dot` and
:func:`ragged_dot_general` (MoE grouped GEMMs with MXFP4 experts; :mod:`jax_mxfp4.ragged`); Flax layers in
:mod:`jax_mxfp4.flax` (imported on first use of ``jax_mxfp4.flax``; needs flax).
"""

from .array import MXFP4Array
from .decode_prepared import DecodePrepared, prepare_decode
from .dispatch import BackendUnavailableError, available_backends
from .einsum import einsum
from .fp8_prepared import FP8Prepared, prepare_fp8
from .gemm import explain
from .quantize import dequantize, quantize
from .ragged import ragged_dot, ragged_dot_general
from .recipe import Recipe
from .training import dense, dot_general
from . import serialization as _serialization  # noqa: F401  (jax.export serialization of the pytrees)

__version__ = "0.1.0"


def __getattr__(name):
    # ``jax_mxfp4.flax`` is imported on first use so that flax stays an optional dependency.
    if name == "flax":
        import importlib

        return importlib.import_module(".flax", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "MXFP4Array",
    "BackendUnavailableError",
    "DecodePrepared",
    "FP8Prepared",
    "Recipe",
    "available_backends",
    "dense",
    "dequantize",
    "dot_general",
    "einsum",
    "explain",
    "prepare_decode",
    "prepare_fp8",
    "quantize",
    "ragged_dot",
    "ragged_dot_general",
]
