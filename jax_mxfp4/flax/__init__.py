"""Flax integration: drop-in MXFP4 layers and helpers for quantized inference parameters.

* :class:`jax_mxfp4.flax.linen.Dense`, :class:`jax_mxfp4.flax.linen.DenseGeneral` and
  :class:`jax_mxfp4.flax.nnx.Linear`: the parameter names, shapes, dtypes and initializers of
  Flax's own layers (checkpoints are interchangeable) plus a ``recipe`` field
  (:class:`jax_mxfp4.Recipe`); every forward, dgrad and wgrad GEMM goes through
  :func:`jax_mxfp4.dot_general`. Any input width works (K is zero-padded to 32 inside).
* :func:`quantize_params`: trained float kernels -> :class:`jax_mxfp4.MXFP4Array` (inference).
  The layers accept such kernels in place of the float ones; orbax saves and restores them
  bit-exactly (``orbax.checkpoint.StandardCheckpointer``; see :func:`abstract_params`).

Needs the ``flax`` extra: ``pip install jax-mxfp4[flax]``.
"""

from . import linen, nnx
from .params import abstract_params, default_select, quantize_params

__all__ = ["linen", "nnx", "quantize_params", "default_select", "abstract_params"]
