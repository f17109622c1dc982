"""MXFP4 ``flax.nnx`` layer: ``Linear`` with nnx.Linear's parameters plus a recipe."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn.dtypes import promote_dtype

from .. import dims, sharding
from ..einsum import _einsum
from ..experts import expert_bias, expert_dot
from ..recipe import Recipe
from ..training import _dense
from .params import einsum_kernel_dims, einsum_trained, layer_operands


def _stream(rngs, collection):
    """An ``nnx.RngStream`` from ``rngs`` (Rngs, RngStream or None), as ``nnx.Dropout`` does."""
    if rngs is None or isinstance(rngs, nnx.RngStream):
        return rngs
    if isinstance(rngs, nnx.Rngs):
        return rngs[collection]
    raise TypeError(f"rngs must be an nnx.Rngs, an nnx.RngStream, a PRNG key or None, got {type(rngs).__name__}")


def _set_rounding(layer, recipe, rng_collection, rounding_rngs):
    """The layer's ``recipe``, ``rng_collection`` and ``rounding_rngs`` (the stream forked at
    construction, or None), read by :func:`_rounding_key`."""
    layer.recipe = recipe
    layer.rng_collection = rng_collection
    stream = _stream(rounding_rngs, rng_collection)
    layer.rounding_rngs = stream.fork() if stream is not None else nnx.data(None)


def _rounding_key(layer, rngs):
    """The stochastic-rounding key of one call of ``layer`` (its ``recipe``, ``rng_collection``,
    ``rounding_rngs``), first found of: the call's ``rngs``, the layer's stream, None (fallback)."""
    if not dims.takes_rounding_key(layer.recipe):
        return None
    if rngs is not None and not isinstance(rngs, (nnx.Rngs, nnx.RngStream)):
        return rngs  # a PRNG key (validated by dot_general)
    stream = _stream(rngs, layer.rng_collection) or layer.rounding_rngs
    return stream() if stream is not None else None


def _check_recipe(recipe):
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a jax_mxfp4.Recipe or None, got {type(recipe).__name__}")


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
        _check_recipe(recipe)
        for name in ("dot_general", "dot_general_cls"):
            if kwargs.get(name) is not None:
                raise TypeError(
                    f"jax_mxfp4.flax.nnx.Linear does not take {name}: its GEMMs always run through "
                    "jax_mxfp4.dot_general with `recipe`. Pass recipe=jax_mxfp4.Recipe(...), or use "
                    f"flax.nnx.Linear({name}=...) for another dot_general"
                )
        super().__init__(in_features, out_features, **kwargs)
        _set_rounding(self, recipe, rng_collection, rounding_rngs)
    def __call__(self, inputs, out_sharding=None, *, rngs=None):
        """inputs [..., in_features] -> [..., out_features] in the computation dtype (``dtype``, or
        promoted from inputs, kernel and bias). ``rngs``: the rounding key source (class docstring)."""
        kernel = self.kernel.get_value()
        bias = self.bias.get_value() if self.bias is not None else None
        inputs, kernel, bias, out_dtype = layer_operands(
            inputs, kernel, bias, self.dtype, self.recipe, self.promote_dtype,
            ((self.in_features, self.out_features), (0,), ()),
        )
        y = _dense(inputs, kernel, bias, self.recipe, _rounding_key(self, rngs), out_dtype)
        if out_sharding is not None:  # explicit-mesh types are changed by reshard, Auto ones constrained
            explicit = sharding.explicit_spec(y) is not None
            y = (jax.sharding.reshard if explicit else jax.lax.with_sharding_constraint)(y, out_sharding)
        return y

    def _mx_kernel_dims(self):
        """(kernel dims per call; (contracted kernel axis or None, kernel batch dims)): read by
        :func:`jax_mxfp4.flax.consumed_kernels`."""
        return 2, (0, ())


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
        _check_recipe(recipe)
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

    def _mx_kernel_dims(self):
        """(kernel dims per call; (contracted kernel axis or None, kernel batch dims)): read by
        :func:`jax_mxfp4.flax.consumed_kernels`."""
        per_call = len(self.kernel_shape)
        if not self.einsum_str:
            return per_call, (None, ())
        lhs_term = self.einsum_str.split("->")[0].split(",")[0].replace("...", "")
        return per_call, einsum_kernel_dims(self.einsum_str, len(lhs_term), per_call)


class RaggedDense(nnx.Module):
    """MXFP4 expert layer (mixture of experts), the nnx twin of
    :class:`jax_mxfp4.flax.linen.RaggedDense`: ``y[rows of e] = x[rows of e] · kernel[e] (+ bias[e])``.

    Router-agnostic, as ``jax.lax.ragged_dot``: the caller sorts its tokens by expert and passes
    ``group_sizes``; rows past ``sum(group_sizes)`` give zeros. GEMMs through
    :func:`jax_mxfp4.ragged_dot` with ``recipe``; any ``in_features`` (K zero-padded to 32 inside).
    Params ``kernel`` [E, K, N] (``nnx.Param``) and, with ``use_bias``, ``bias`` [E, N]. A kernel
    replaced by an :class:`jax_mxfp4.MXFP4Array` quantized along axis 1
    (:func:`jax_mxfp4.flax.quantize_params` on ``nnx.state(model, nnx.Param)`` with ``model=``,
    then ``nnx.update``) is used as is: the same outputs, bit for bit. Stochastic-rounding keys:
    the call's ``rngs``, else the stream forked from ``rounding_rngs``, else the data-derived
    fallback, exactly as :class:`Linear`.

    Args:
      num_experts: E. in_features: K. out_features: N.
      use_bias: per-expert bias [E, N] (default False).
      dtype: computation dtype (default: promoted from inputs and params); param_dtype (float32).
      kernel_init: default ``lecun_normal(batch_axis=(0,))`` (fan-in K per expert); bias_init zeros.
      recipe: :class:`jax_mxfp4.Recipe` (default ``Recipe()``; no Hadamard).
      rng_collection, rounding_rngs: as :class:`Linear`. rngs: ``nnx.Rngs`` for the initializers.

    Raises:
      TypeError: ``recipe`` not a Recipe. Calls: as :class:`jax_mxfp4.flax.linen.RaggedDense`.
    """

    def __init__(self, num_experts: int, in_features: int, out_features: int, *, use_bias: bool = False,
                 dtype=None, param_dtype=jnp.float32, kernel_init=None, bias_init=None,
                 recipe: Recipe | None = None, rng_collection: str = "stochastic_rounding", rounding_rngs=None,
                 rngs: nnx.Rngs):
        from .linen import default_expert_kernel_init

        _check_recipe(recipe)
        self.num_experts, self.in_features, self.out_features = num_experts, in_features, out_features
        self.dtype, self.param_dtype = dtype, param_dtype
        kernel_init = default_expert_kernel_init if kernel_init is None else kernel_init
        bias_init = nnx.initializers.zeros_init() if bias_init is None else bias_init
        self.kernel = nnx.Param(kernel_init(rngs.params(), (num_experts, in_features, out_features), param_dtype))
        self.bias = (nnx.Param(bias_init(rngs.params(), (num_experts, out_features), param_dtype)) if use_bias
                     else nnx.data(None))
        _set_rounding(self, recipe, rng_collection, rounding_rngs)

    def __call__(self, inputs, group_sizes, *, rngs=None):
        """inputs [M, in_features], group_sizes int32 [E] -> [M, out_features] in the computation
        dtype. ``rngs``: the rounding key source (as :meth:`Linear.__call__`)."""
        kernel = self.kernel.get_value()
        bias = self.bias.get_value() if self.bias is not None else None
        shape = (self.num_experts, self.in_features, self.out_features)
        inputs, kernel, bias, out_dtype = layer_operands(inputs, kernel, bias, self.dtype, self.recipe,
                                                         promote_dtype, (shape, (1,), (0,)))
        y = expert_dot(inputs, kernel, group_sizes, self.recipe, _rounding_key(self, rngs), out_dtype)
        return y if bias is None else expert_bias(y, bias, group_sizes)

    def _mx_kernel_dims(self):
        """(kernel dims per call; (contracted kernel axis, kernel batch dims)): read by
        :func:`jax_mxfp4.flax.consumed_kernels`. The expert dim 0 is the kernel's batch dim."""
        return 3, (1, (0,))
