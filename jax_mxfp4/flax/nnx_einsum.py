"""MXFP4 ``flax.nnx.Einsum``: nnx.Einsum's parameters plus a recipe."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from ..array import MXFP4Array
from ..einsum import _einsum
from ..recipe import Recipe


class Einsum(nnx.Einsum):
    """MXFP4 drop-in for ``flax.nnx.Einsum``: ``y = einsum(einsum_str, inputs, kernel) + bias``.

    Same constructor as ``nnx.Einsum`` (``einsum_str``, ``kernel_shape``, ``bias_shape``,
    ``dtype``, ``param_dtype``, ``precision`` (ignored), ``kernel_init``, ``bias_init``,
    ``promote_dtype``, ``preferred_element_type``, ``rngs``, ...) plus ``recipe``
    (:class:`jax_mxfp4.Recipe`); ``einsum_op`` raises TypeError (the contraction is always
    :func:`jax_mxfp4.einsum`). Params ``kernel`` and ``bias`` as in Flax. K is zero-padded to a
    multiple of 32 inside; the kernel may be an :class:`jax_mxfp4.MXFP4Array` quantized along its
    single contracting dim (:func:`jax_mxfp4.flax.quantize_params`) for inference.
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

    def __call__(self, inputs, einsum_str=None, out_sharding=None):
        """inputs -> ``einsum(einsum_str, inputs, kernel) (+ bias)`` in the promoted dtype."""
        einsum_str = (einsum_str if einsum_str is not None else self.einsum_str)
        if einsum_str is None:
            raise ValueError("No `einsum_str` argument was provided to Einsum as either a __call__ argument, "
                             "or class attribute.")
        einsum_str = einsum_str.replace(" ", "")
        self._einsum_str_check(einsum_str)
        kernel = self.kernel.get_value()
        bias = self.bias.get_value() if self.bias is not None else None
        if isinstance(kernel, MXFP4Array):
            inputs, bias = self.promote_dtype((inputs, bias), dtype=self.dtype)
        else:
            inputs, kernel, bias = self.promote_dtype((inputs, kernel, bias), dtype=self.dtype)
        y = _einsum(einsum_str, inputs, kernel, self.preferred_element_type, self.recipe, pad_k=True)
        if bias is not None:
            y += jnp.reshape(bias, self._infer_broadcasted_bias_shape(einsum_str, inputs, kernel))
        if out_sharding is not None:
            import jax

            y = jax.sharding.reshard(y, out_sharding)
        return y
