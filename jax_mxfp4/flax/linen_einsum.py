"""MXFP4 ``flax.linen.Einsum``: Flax's parameters (``kernel`` of ``shape``, ``bias``) + a recipe."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
from flax.linen import module

from ..einsum import _einsum
from ..recipe import Recipe
from .linen import _quantized_kernel, _rounding_key
from .params import einsum_trained, layer_operands


class Einsum(nn.Einsum):
    """MXFP4 drop-in for ``flax.linen.Einsum``: ``y = einsum(einsum_str, inputs, kernel) + bias``.

    Attributes: those of ``flax.linen.Einsum`` (``shape``, ``einsum_str``, ``use_bias``,
    ``dtype``, ``param_dtype``, ``precision`` (ignored), ``kernel_init``, ``bias_init``,
    ``promote_dtype``, ``preferred_element_type``) plus ``recipe`` (:class:`jax_mxfp4.Recipe`).
    Params ``kernel`` (``shape``) and ``bias`` (the kernel's output dims) exactly as Flax makes
    them, so checkpoints move between the two. The contraction runs through
    :func:`jax_mxfp4.einsum` (rules in :mod:`jax_mxfp4.einsum`; K zero-padded to a multiple of 32
    inside). A kernel replaced by an :class:`jax_mxfp4.MXFP4Array` quantized along its single
    contracting dim (:func:`jax_mxfp4.flax.quantize_params`), or by its
    :class:`jax_mxfp4.DecodePrepared`/:class:`jax_mxfp4.FP8Prepared` form, is used as is.

    Raises:
      ValueError: as ``flax.linen.Einsum`` (no "->", not two operands), and as
        :func:`jax_mxfp4.einsum` for a contraction that is not one ``dot_general``.
    """

    recipe: Recipe | None = None
    rng_collection: str = "stochastic_rounding"

    @nn.compact
    def __call__(self, inputs, einsum_str: str | None = None):
        einsum_str = module.merge_param("einsum_str", self.einsum_str, einsum_str).replace(" ", "")
        if "->" not in einsum_str:
            raise ValueError('`einsum_str` equation must be explicit and include "->".')
        if einsum_str.count(",") != 1:
            raise ValueError(
                "`einsum_str` equation must have exactly two operands and therefore, exactly one "
                f"comma character, instead of {einsum_str.count(',')}"
            )
        kernel = _quantized_kernel(self)
        if kernel is None:
            kernel = self.param("kernel", self.kernel_init, self.shape, self.param_dtype)
        bias = None
        if self.use_bias:
            bias_shape, broadcasted_bias_shape = self._get_bias_shape(einsum_str, inputs, kernel)
            bias = self.param("bias", self.bias_init, bias_shape, self.param_dtype)
        # the one weight path of every layer: the kernel is quantized from its param_dtype value,
        # never from a copy cast to `dtype`; inputs and bias are promoted
        inputs, kernel, bias, out_dtype = layer_operands(
            inputs, kernel, bias, self.dtype, self.recipe,
            lambda args, dtype: self.promote_dtype(*args, dtype=dtype),
            einsum_trained(einsum_str, inputs, self.shape))
        y = _einsum(einsum_str, inputs, kernel, self.preferred_element_type or out_dtype, self.recipe,
                    pad_k=True, key=_rounding_key(self))
        if bias is not None:
            y += jnp.reshape(bias, broadcasted_bias_shape)
        return y
