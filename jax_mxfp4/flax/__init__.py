"""Flax integration: drop-in MXFP4 layers and functions for quantized inference parameters.

* :class:`jax_mxfp4.flax.linen.Dense`, :class:`jax_mxfp4.flax.linen.DenseGeneral` and
  :class:`jax_mxfp4.flax.nnx.Linear`: the parameter names, shapes, dtypes and initializers of
  Flax's own layers (checkpoints are interchangeable) plus a ``recipe`` field
  (:class:`jax_mxfp4.Recipe`); every forward, dgrad and wgrad GEMM goes through
  :func:`jax_mxfp4.dot_general`. Any input width works (K is zero-padded to 32 inside).
* :class:`jax_mxfp4.flax.linen.RaggedDense` and :class:`jax_mxfp4.flax.nnx.RaggedDense`: MXFP4
  expert layers (mixture of experts), ``layer(x [M, K], group_sizes [E]) -> [M, N]`` with a
  ``kernel`` [E, K, N] (optional ``bias`` [E, N]); GEMMs through :func:`jax_mxfp4.ragged_dot`.
* :func:`quantize_params`: trained float kernels -> :class:`jax_mxfp4.MXFP4Array` (inference).
  The layers accept such kernels in place of the float ones; orbax saves and restores them
  bit-exactly (``orbax.checkpoint.StandardCheckpointer``; see :func:`abstract_params`).
  ``prepare="decode"`` returns each as :func:`jax_mxfp4.prepare_decode` of it (serving: arranged
  once for decode-size GEMMs); the layers take that :class:`jax_mxfp4.DecodePrepared` (or a
  :class:`jax_mxfp4.FP8Prepared`) kernel as is, with the same outputs.

Needs the ``flax`` extra: ``pip install ".[flax]"`` from a checkout.
"""

from . import linen
from .params import abstract_params, consumed_kernels, default_select, quantize_params

__all__ = ["linen", "nnx", "quantize_params", "default_select", "consumed_kernels", "abstract_params"]


def __getattr__(name):
    # nnx is imported on first use: flax.linen never needs flax.nnx, and some jax/flax version
    # pairs import one but not the other (flax 0.12.8's nnx fails on jax 0.11.2).
    if name == "nnx":
        import importlib

        return importlib.import_module(f"{__name__}.nnx")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
