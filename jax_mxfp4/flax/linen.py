"""MXFP4 ``flax.linen`` layers: ``Dense`` and ``DenseGeneral`` with Flax's parameters + a recipe.

Parameter names (``kernel``, ``bias``), shapes, ``param_dtype`` and default initializers
(``lecun_normal`` kernel, zero bias) are those of ``flax.linen.Dense``/``DenseGeneral``, so
checkpoints move between the two freely. ``dtype`` is the computation dtype as in Flax (inputs,
bias promoted to it; default: inferred from inputs, kernel and bias). The kernel is quantized
from its ``param_dtype`` value, never from a cast copy, so the trained forward uses exactly the
weights :func:`jax_mxfp4.flax.quantize_params` produces for serving. The GEMMs (fprop, dgrad,
wgrad) run through :func:`jax_mxfp4.dot_general` with ``recipe`` (default ``Recipe()``); the
float32 accumulator is returned in the computation dtype. A kernel replaced by an
:class:`jax_mxfp4.MXFP4Array` (:func:`jax_mxfp4.flax.quantize_params`), or by one arranged once
by :func:`jax_mxfp4.prepare_decode` (``quantize_params(..., prepare="decode")``) or
:func:`jax_mxfp4.prepare_fp8`, is used as is (inference; same outputs, bit for bit), once its
record (scale rule, Hadamard rotation) is checked against ``recipe``: a kernel quantized or
restored without the training recipe raises ValueError naming both records
(:func:`jax_mxfp4.weight_record.check_against_recipe`).

Stochastic rounding of the gradients (``Recipe.grad_rounding="stochastic"``) draws its key from
the RNG stream ``rng_collection`` (default ``"stochastic_rounding"``) when ``apply`` is given one:
``model.apply(params, x, rngs={"stochastic_rounding": jax.random.fold_in(key, step)})`` gives
fresh noise every step (each layer gets its own key from ``make_rng``), reproducible from the
seed. Without that stream the data-derived key of :func:`jax_mxfp4.training.gradient_key` is
used (the documented fallback; it repeats whenever dY repeats).
"""

from __future__ import annotations

from typing import Any, Sequence

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
from flax.linen import initializers
from flax.linen import module
from flax.linen.dtypes import promote_dtype

from .. import dims, sharding
from ..einsum import _einsum
from ..experts import expert_bias, expert_dot
from ..recipe import Recipe
from ..training import _dense, _dot_general
from .params import QUANTIZED_KERNELS, einsum_kernel_dims, einsum_trained, kernel_kind, layer_operands, quantized_kernel

default_kernel_init = initializers.lecun_normal()
#: Per expert: fan-in K (a Flax ``lecun_normal`` of [E, K, N] would count E * K).
default_expert_kernel_init = initializers.lecun_normal(batch_axis=(0,))


def _promote(args, dtype):
    return promote_dtype(*args, dtype=dtype)


def _rounding_key(module: nn.Module):
    """A key from the module's rounding RNG stream, or None (data-derived fallback)."""
    if dims.takes_rounding_key(module.recipe) and module.has_rng(module.rng_collection):
        return module.make_rng(module.rng_collection)
    return None


def _quantized_kernel(module: nn.Module):
    """The layer's quantized kernel (MXFP4Array, DecodePrepared, FP8Prepared), used as is, or None."""
    if module.has_variable("params", "kernel"):
        return quantized_kernel(module.get_variable("params", "kernel"))
    return None


class Dense(nn.Module):
    """MXFP4 drop-in for ``flax.linen.Dense``: ``y = x · kernel + bias`` over the last dim.

    Attributes:
      features: output width N.
      use_bias: add a bias [N] (default True).
      dtype: computation dtype (default: promoted from inputs and params).
      param_dtype: parameter dtype (default float32).
      precision: accepted for compatibility; ignored (float32 accumulation).
      kernel_init, bias_init: as in Flax (``lecun_normal()``, zeros).
      recipe: :class:`jax_mxfp4.Recipe` for the three GEMMs (default ``Recipe()``).
      rng_collection: RNG stream for stochastic rounding of the gradients (module docstring).

    Input [..., K] (any K), output [..., N]. Params: ``kernel`` [K, N], ``bias`` [N].
    """

    features: int
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    precision: Any = None
    kernel_init: Any = default_kernel_init
    bias_init: Any = initializers.zeros_init()
    recipe: Recipe | None = None
    rng_collection: str = "stochastic_rounding"

    @nn.compact
    def __call__(self, inputs):
        kernel = _quantized_kernel(self)
        if kernel is None:
            kernel = self.param("kernel", self.kernel_init, (jnp.shape(inputs)[-1], self.features), self.param_dtype)
        bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype) if self.use_bias else None
        trained = ((jnp.shape(inputs)[-1], self.features), (0,), ())
        inputs, kernel, bias, out_dtype = layer_operands(inputs, kernel, bias, self.dtype, self.recipe, _promote,
                                                         trained)
        return _dense(inputs, kernel, bias, self.recipe, _rounding_key(self), out_dtype)

    def _mx_kernel_dims(self, args, kwargs, kernel_ndim):
        """(contracted kernel axis or None if several, kernel batch dims) of a call: read by
        :func:`jax_mxfp4.flax.consumed_kernels`."""
        return 0, ()


def _canonicalize_tuple(x):
    return tuple(x) if isinstance(x, Sequence) else (x,)


def _normalize_axes(axes, ndim):
    return tuple(sorted(ax if ax >= 0 else ndim + ax for ax in axes))


class DenseGeneral(nn.Module):
    """MXFP4 drop-in for ``flax.linen.DenseGeneral`` (several input axes, several features, batch dims).

    Attributes: those of ``flax.linen.DenseGeneral`` (``features``, ``axis``, ``batch_dims``,
    ``use_bias``, ``dtype``, ``param_dtype``, ``kernel_init``, ``bias_init``, ``precision``) plus
    ``recipe`` and ``rng_collection`` (as in :class:`Dense`). Params: ``kernel`` [*batch, *in_axes,
    *features], ``bias`` [*batch, *features].
    The contracted axes are flattened into one K (zero-padded to a multiple of 32). A quantized
    kernel (MXFP4Array, DecodePrepared, FP8Prepared) must be quantized along its single
    contraction axis.

    Raises:
      ValueError: ``batch_dims`` not consecutive leading dims (as in Flax); a quantized kernel
        not quantized along the single contraction axis (the message names its type).
    """

    features: int | Sequence[int]
    axis: int | Sequence[int] = -1
    batch_dims: Sequence[int] = ()
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Any = default_kernel_init
    bias_init: Any = initializers.zeros_init()
    precision: Any = None
    recipe: Recipe | None = None
    rng_collection: str = "stochastic_rounding"

    @nn.compact
    def __call__(self, inputs):
        features = _canonicalize_tuple(self.features)
        axis = _canonicalize_tuple(self.axis)
        batch_dims = _canonicalize_tuple(self.batch_dims)
        if batch_dims:
            max_dim = np.max(batch_dims)
            if set(batch_dims) != set(range(max_dim + 1)):
                raise ValueError(f"batch_dims {batch_dims} must be consecutive leading dimensions starting from 0.")
        ndim = inputs.ndim
        n_batch_dims = len(batch_dims)
        axis = _normalize_axes(axis, ndim)
        batch_dims = _normalize_axes(batch_dims, ndim)
        n_axis, n_features = len(axis), len(features)

        def kernel_init_wrap(rng, shape, dtype=jnp.float32):
            flat_shape = (
                int(np.prod(shape[:n_batch_dims]) * np.prod(shape[n_batch_dims : n_axis + n_batch_dims])),
                int(np.prod(shape[-n_features:])),
            )
            return jnp.reshape(self.kernel_init(rng, flat_shape, dtype), shape)

        batch_shape = tuple(inputs.shape[ax] for ax in batch_dims)
        expanded_batch_shape = tuple(
            inputs.shape[ax] if ax in batch_dims else 1 for ax in range(inputs.ndim) if ax not in axis
        )
        kernel_shape = tuple(inputs.shape[ax] for ax in axis) + features
        batch_ind = tuple(range(n_batch_dims))
        contract_ind = tuple(range(n_batch_dims, n_axis + n_batch_dims))
        trained = (batch_shape + kernel_shape, contract_ind, batch_ind)  # the float kernel's GEMM
        kernel = _quantized_kernel(self)
        if kernel is None:
            kernel = self.param("kernel", kernel_init_wrap, batch_shape + kernel_shape, self.param_dtype)

        bias = None
        if self.use_bias:

            def bias_init_wrap(rng, shape, dtype=jnp.float32):
                flat_shape = (int(np.prod(shape[:n_batch_dims]) * np.prod(shape[-n_features:])),)
                return jnp.reshape(self.bias_init(rng, flat_shape, dtype), shape)

            bias = self.param("bias", bias_init_wrap, batch_shape + features, self.param_dtype)

        if isinstance(kernel, QUANTIZED_KERNELS):
            if n_axis != 1 or kernel.axis != contract_ind[0]:
                raise ValueError(
                    f"DenseGeneral: {kernel_kind(kernel)} kernel must be quantized along the single contraction "
                    f"axis {contract_ind[0] if n_axis == 1 else contract_ind} of the kernel, but this "
                    f"layer contracts {n_axis} axes (axis={self.axis}, batch_dims={self.batch_dims}) and "
                    f"the kernel is quantized along axis {kernel.axis}; quantize it with "
                    "quantize_params(select=...) along the contraction axis, or keep this layer in float"
                )
            if n_axis == 1:  # a kernel padded by quantize_params: pad the inputs to its K
                ax, kp = axis[0], kernel.shape[contract_ind[0]]
                if inputs.shape[ax] < kp:
                    sharding.check_dim_blocks(inputs, ax, "inputs")  # before padding a sharded K
                    widths = [(0, 0)] * inputs.ndim
                    widths[ax] = (0, kp - inputs.shape[ax])
                    inputs = jnp.pad(inputs, widths)
        inputs, kernel, bias, out_dtype = layer_operands(inputs, kernel, bias, self.dtype, self.recipe, _promote,
                                                         trained)
        out = _dot_general(
            inputs, kernel, ((axis, contract_ind), (batch_dims, batch_ind)), out_dtype, self.recipe, pad_k=True,
            key=_rounding_key(self),
        )
        if bias is not None:
            out = out + jnp.reshape(bias, expanded_batch_shape + features).astype(out.dtype)
        return out

    def _mx_kernel_dims(self, args, kwargs, kernel_ndim):
        """(contracted kernel axis or None if several, kernel batch dims) of a call: read by
        :func:`jax_mxfp4.flax.consumed_kernels`."""
        n_batch = len(_canonicalize_tuple(self.batch_dims))
        return (n_batch if len(_canonicalize_tuple(self.axis)) == 1 else None), tuple(range(n_batch))


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

    def _mx_kernel_dims(self, args, kwargs, kernel_ndim):
        """(contracted kernel axis or None if several, kernel batch dims) of a call: read by
        :func:`jax_mxfp4.flax.consumed_kernels`."""
        es = kwargs.get("einsum_str", args[1] if len(args) > 1 else None) or self.einsum_str
        return einsum_kernel_dims(es, jnp.ndim(args[0]), kernel_ndim)


class RaggedDense(nn.Module):
    """MXFP4 expert layer (mixture of experts): ``y[rows of e] = x[rows of e] · kernel[e] (+ bias[e])``.

    Router-agnostic, as ``jax.lax.ragged_dot``: the caller sorts its tokens by expert and passes
    ``group_sizes``; rows ``start_e .. start_e + group_sizes[e] - 1`` of ``inputs`` go to expert
    ``e``, rows past ``sum(group_sizes)`` give zeros. The GEMMs (fprop, dgrad, wgrad) run through
    :func:`jax_mxfp4.ragged_dot` with ``recipe`` (rules in :mod:`jax_mxfp4.ragged`). Any input
    width K works (zero-padded to a multiple of 32 inside, as :class:`Dense`). A kernel replaced by
    an :class:`jax_mxfp4.MXFP4Array` [E, Kp, N] quantized along axis 1
    (:func:`jax_mxfp4.flax.quantize_params` with ``model=``) is used as is: the same outputs, bit
    for bit. Stochastic rounding keys: the ``rng_collection`` stream, as :class:`Dense`.

    Attributes:
      num_experts: E.
      features: output width N.
      use_bias: add a per-expert bias [E, N] (default False, as MoE layers usually have none).
      dtype: computation dtype (default: promoted from inputs and params).
      param_dtype: parameter dtype (default float32).
      precision: accepted for compatibility; ignored (float32 accumulation).
      kernel_init: default ``lecun_normal(batch_axis=(0,))`` (fan-in K per expert); bias_init zeros.
      recipe: :class:`jax_mxfp4.Recipe` for the three GEMMs (default ``Recipe()``; no Hadamard).
      rng_collection: RNG stream for stochastic rounding of the gradients.

    Call: ``layer(inputs [M, K], group_sizes int32 [E]) -> [M, N]``. Params: ``kernel`` [E, K, N],
    ``bias`` [E, N].

    Raises:
      ValueError: inputs not 2-D; a kernel whose K does not match; ``group_sizes`` not [E] (or, when
        concrete, negative or summing past M: :func:`jax_mxfp4.ragged_dot`); a quantized kernel not
        quantized along axis 1 or recorded with another scale rule than ``recipe``'s.
    """

    num_experts: int
    features: int
    use_bias: bool = False
    dtype: Any = None
    param_dtype: Any = jnp.float32
    precision: Any = None
    kernel_init: Any = default_expert_kernel_init
    bias_init: Any = initializers.zeros_init()
    recipe: Recipe | None = None
    rng_collection: str = "stochastic_rounding"

    @nn.compact
    def __call__(self, inputs, group_sizes):
        shape = (self.num_experts, jnp.shape(inputs)[-1], self.features)
        kernel = _quantized_kernel(self)
        if kernel is None:
            kernel = self.param("kernel", self.kernel_init, shape, self.param_dtype)
        bias = (self.param("bias", self.bias_init, (self.num_experts, self.features), self.param_dtype)
                if self.use_bias else None)
        inputs, kernel, bias, out_dtype = layer_operands(inputs, kernel, bias, self.dtype, self.recipe, _promote,
                                                         (shape, (1,), (0,)))
        y = expert_dot(inputs, kernel, group_sizes, self.recipe, _rounding_key(self), out_dtype)
        return y if bias is None else expert_bias(y, bias, group_sizes)

    def _mx_kernel_dims(self, args, kwargs, kernel_ndim):
        """(contracted kernel axis, kernel batch dims) of a call: read by
        :func:`jax_mxfp4.flax.consumed_kernels`. The expert dim 0 is the kernel's batch dim."""
        return 1, (0,)
