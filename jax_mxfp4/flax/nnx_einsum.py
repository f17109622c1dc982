"""MXFP4 ``flax.nnx.Einsum``: nnx.Einsum's parameters plus a recipe."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from ..einsum import _einsum
from ..recipe import Recipe
from .nnx import _stream
from .params import einsum_trained, layer_operands


class Einsum(nnx.Einsum):
    """MXFP4 drop-in for ``flax.nnx.Einsum``: ``y = einsum(einsum_str, inputs, kernel) + bias``.

    Same constructor as ``nnx.Einsum`` (``einsum_str``, ``kernel_shape``, ``bias_shape``,
    ``dtype``, ``param_dtype``, ``precision`` (ignored), ``kernel_init``, ``bias_init``,
    ``promote_dtype``, ``preferred_element_type``, ``rngs``, ...) plus ``recipe``
    (:class:`jax_mxfp4.Recipe`); ``einsum_op`` raises TypeError (the contraction is always
    :func:`jax_mxfp4.einsum`). Params ``kernel`` and ``bias`` as in Flax. K is zero-padded to a
    multiple of 32 inside; the kernel may be an :class:`jax_mxfp4.MXFP4Array` quantized along its
    single contracting dim (:func:`jax_mxfp4.flax.quantize_params`), or its
    :class:`jax_mxfp4.DecodePrepared`/:class:`jax_mxfp4.FP8Prepared` form, for inference.
    """

    def __init__(self, einsum_str, kernel_shape, bias_shape=None, *, recipe: Recipe | None = None, **kwargs):
        if recipe is not None and not isinstance(recipe, Recipe):
            raise TypeError(f"recipe must be a jax_mxfp4.Recipe or None, got {type(recipe).__name__}")
        if kwargs.get("einsum_op") is not None:
            raise TypeError(
                "jax_mxfp4.flax.nnx.Einsum does not take einsum_op: its contraction always runs through "
                "jax_mxfp4.einsum with `recipe`; use flax.nnx.Einsum(einsum_op=...) for another einsum"
            )
        super().__init__(einsum_str, kernel_shape, bias_shape, **kwargs)
        self.recipe = recipe

    def __call__(self, inputs, einsum_str=None, out_sharding=None, *, rngs=None):
        """inputs -> ``einsum(einsum_str, inputs, kernel) (+ bias)`` in the promoted dtype.
        ``rngs``: key of the stochastic rounding of the gradients (a PRNG key, or an
        ``nnx.Rngs``/``nnx.RngStream`` whose ``"stochastic_rounding"`` stream is drawn); None: the
        data-derived fallback key (:func:`jax_mxfp4.training.gradient_key`)."""
        einsum_str = (einsum_str if einsum_str is not None else self.einsum_str)
        if einsum_str is None:
            raise ValueError("No `einsum_str` argument was provided to Einsum as either a __call__ argument, "
                             "or class attribute.")
        einsum_str = einsum_str.replace(" ", "")
        self._einsum_str_check(einsum_str)
        kernel = self.kernel.get_value()
        bias = self.bias.get_value() if self.bias is not None else None
        # the one weight path of every layer: kernel from its param_dtype value, never cast
        inputs, kernel, bias, out_dtype = layer_operands(inputs, kernel, bias, self.dtype, self.recipe,
                                                         self.promote_dtype,
                                                         einsum_trained(einsum_str, inputs, self.kernel_shape))
        if rngs is not None and not hasattr(rngs, "shape"):
            rngs = _stream(rngs, "stochastic_rounding")()
        y = _einsum(einsum_str, inputs, kernel, self.preferred_element_type or out_dtype, self.recipe,
                    pad_k=True, key=rngs)
        if bias is not None:
            y += jnp.reshape(bias, self._infer_broadcasted_bias_shape(einsum_str, inputs, kernel))
        if out_sharding is not None:
            import jax

            y = jax.sharding.reshard(y, out_sharding)
        return y
