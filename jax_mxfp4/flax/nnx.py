"""MXFP4 ``flax.nnx`` layer: ``Linear`` with nnx.Linear's parameters plus a recipe."""

from __future__ import annotations

import jax
from flax import nnx

from .. import dims, sharding
from ..recipe import Recipe
from ..training import _dense
from .params import layer_operands


def _stream(rngs, collection):
    """An ``nnx.RngStream`` from ``rngs`` (Rngs, RngStream or None), as ``nnx.Dropout`` does."""
    if rngs is None or isinstance(rngs, nnx.RngStream):
        return rngs
    if isinstance(rngs, nnx.Rngs):
        return rngs[collection]
    raise TypeError(f"rngs must be an nnx.Rngs, an nnx.RngStream, a PRNG key or None, got {type(rngs).__name__}")


class Linear(nnx.Linear):
    """MXFP4 drop-in for ``flax.nnx.Linear``: ``y = x · kernel + bias`` over the last dim.

    Same constructor as ``nnx.Linear`` (``in_features``, ``out_features``, ``use_bias``,
    ``dtype``, ``param_dtype``, ``precision`` (ignored), ``kernel_init``, ``bias_init``,
    ``promote_dtype``, ``rngs``, ...) plus ``recipe`` (:class:`jax_mxfp4.Recipe`, default
    ``Recipe()``), ``rng_collection`` and ``rounding_rngs`` (below); ``dot_general`` and
    ``dot_general_cls`` raise TypeError (the GEMM is always :func:`jax_mxfp4.dot_general`, never
    silently another). Params ``kernel`` [in, out] and ``bias`` [out] as in Flax, so states are
    interchangeable. Any ``in_features`` works (K zero-padded to 32 inside). The kernel is
    quantized from its ``param_dtype`` value (never a cast copy), so the trained forward uses
    exactly the weights that :func:`jax_mxfp4.flax.quantize_params` on
    ``nnx.state(model, nnx.Param)`` (then ``nnx.update``) gives for inference (an MXFP4Array
    kernel, or its :class:`jax_mxfp4.DecodePrepared`/:class:`jax_mxfp4.FP8Prepared` form). A
    quantized kernel whose record (scale rule, Hadamard rotation) is not what ``recipe``'s
    forward pass used raises ValueError naming both (:func:`jax_mxfp4.weight_record.check_against_recipe`).

    Key for stochastic rounding of the gradients (``Recipe.grad_rounding="stochastic"``), first
    found of: the call's ``rngs`` (a PRNG key, an ``nnx.RngStream``, or an ``nnx.Rngs`` whose
    ``rng_collection`` stream, default ``"stochastic_rounding"``, falling back to its
    ``default`` stream, is drawn); the stream forked at construction from ``rounding_rngs`` (an
    ``nnx.Rngs`` or ``nnx.RngStream``; its counter advances every call, so under ``nnx.jit``
    each step gets fresh noise, reproducible from the seed; like ``nnx.Dropout`` it is layer
    state, which ``jax.jit`` of a closure cannot update); else the data-derived key of
    :func:`jax_mxfp4.training.gradient_key` (the documented fallback, repeating whenever dY
    repeats).
    """

    def __init__(self, in_features: int, out_features: int, *, recipe: Recipe | None = None,
                 rng_collection: str = "stochastic_rounding", rounding_rngs=None, **kwargs):
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
        self.rng_collection = rng_collection
        stream = _stream(rounding_rngs, rng_collection)
        self.rounding_rngs = stream.fork() if stream is not None else nnx.data(None)

    def _rounding_key(self, rngs):
        recipe = dims.check_recipe(self.recipe)
        if recipe.grad_rounding != "stochastic" or "mxfp4" not in (recipe.dgrad, recipe.wgrad):
            return None
        if rngs is not None and not isinstance(rngs, (nnx.Rngs, nnx.RngStream)):
            return rngs  # a PRNG key (validated by dot_general)
        stream = _stream(rngs, self.rng_collection) or self.rounding_rngs
        return stream() if stream is not None else None

    def __call__(self, inputs, out_sharding=None, *, rngs=None):
        """inputs [..., in_features] -> [..., out_features] in the computation dtype (``dtype``, or
        promoted from inputs, kernel and bias). ``rngs``: the rounding key source (class docstring)."""
        kernel = self.kernel.get_value()
        bias = self.bias.get_value() if self.bias is not None else None
        inputs, kernel, bias, out_dtype = layer_operands(
            inputs, kernel, bias, self.dtype, self.recipe, self.promote_dtype,
            ((self.in_features, self.out_features), (0,), ()),
        )
        y = _dense(inputs, kernel, bias, self.recipe, self._rounding_key(rngs), out_dtype)
        if out_sharding is not None:  # explicit-mesh types are changed by reshard, Auto ones constrained
            explicit = sharding.explicit_spec(y) is not None
            y = (jax.sharding.reshard if explicit else jax.lax.with_sharding_constraint)(y, out_sharding)
        return y


from .nnx_einsum import Einsum  # noqa: E402  (MXFP4 flax.nnx.Einsum)
