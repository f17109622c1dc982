"""MXFP4 ``flax.nnx`` layer: ``Linear`` with nnx.Linear's parameters plus a recipe."""

from __future__ import annotations

from flax import nnx

from ..array import MXFP4Array
from ..recipe import Recipe
from ..training import dense


class Linear(nnx.Linear):
    """MXFP4 drop-in for ``flax.nnx.Linear``: ``y = x · kernel + bias`` over the last dim.

    Same constructor as ``nnx.Linear`` (``in_features``, ``out_features``, ``use_bias``,
    ``dtype``, ``param_dtype``, ``precision`` (ignored), ``kernel_init``, ``bias_init``,
    ``promote_dtype``, ``rngs``, ...) plus ``recipe`` (:class:`jax_mxfp4.Recipe`, default
    ``Recipe()``); ``dot_general``/``dot_general_cls`` raise TypeError (the GEMM is always
    :func:`jax_mxfp4.dot_general`, never silently another). Params ``kernel`` [in, out] and
    ``bias`` [out] as in Flax, so states are interchangeable. Any ``in_features`` works (K zero-padded to 32 inside). The kernel may be
    replaced by an :class:`jax_mxfp4.MXFP4Array` (:func:`jax_mxfp4.flax.quantize_params` on
    ``nnx.state(model, nnx.Param)`` then ``nnx.update``) for inference.
    """

    def __init__(self, in_features: int, out_features: int, *, recipe: Recipe | None = None, **kwargs):
        if recipe is not None and not isinstance(recipe, Recipe):
            raise TypeError(f"recipe must be a jax_mxfp4.Recipe or None, got {type(recipe).__name__}")
        for name in ("dot_general", "dot_general_cls"):
            if kwargs.get(name) is not None:
                raise TypeError(
                    f"jax_mxfp4.flax.nnx.Linear does not take {name}: its GEMMs always run through "
                    "jax_mxfp4.dot_general with `recipe`. Pass recipe=jax_mxfp4.Recipe(...), or use "
                    f"flax.nnx.Linear({name}=...) for another dot_general"
                )
        super().__init__(in_features, out_features, **kwargs)
        self.recipe = recipe

    def __call__(self, inputs, out_sharding=None):
        """inputs [..., in_features] -> [..., out_features] in the promoted dtype."""
        kernel = self.kernel.get_value()
        bias = self.bias.get_value() if self.bias is not None else None
        if isinstance(kernel, MXFP4Array):
            inputs, bias = self.promote_dtype((inputs, bias), dtype=self.dtype)
        else:
            inputs, kernel, bias = self.promote_dtype((inputs, kernel, bias), dtype=self.dtype)
        y = dense(inputs, kernel, bias, recipe=self.recipe)
        if out_sharding is not None:
            import jax

            y = jax.lax.with_sharding_constraint(y, out_sharding)
        return y


from .nnx_einsum import Einsum  # noqa: E402  (MXFP4 flax.nnx.Einsum)
