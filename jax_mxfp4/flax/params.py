"""``quantize_params``: trained float kernels -> ``MXFP4Array`` for inference (linen or nnx)."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from .. import checks, dims
from ..array import MXFP4Array
from ..mx_format import BLOCK_SIZE
from ..quantize import quantize


def _key_name(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def default_select(path: tuple[str, ...], leaf) -> int | None:
    """Which leaves :func:`quantize_params` quantizes, and along which axis.

    A leaf whose path ends in ``"kernel"`` (or ``"kernel", "value"`` for nnx states), with at
    least 2 dims and a float32/bfloat16/float16 dtype, is quantized along axis 0: the contraction
    axis of :class:`~jax_mxfp4.flax.linen.Dense`, :class:`~jax_mxfp4.flax.nnx.Linear` and
    :class:`~jax_mxfp4.flax.linen.DenseGeneral` with one input axis and no batch dims. Everything
    else (biases, norms, embeddings) is left as is. Returns the axis or None.
    """
    names = [p for p in path if p != "value"]
    if not names or names[-1] != "kernel":
        return None
    if getattr(leaf, "ndim", 0) < 2 or jnp.dtype(getattr(leaf, "dtype", jnp.int32)) not in checks.INPUT_DTYPES:
        return None
    return 0


def quantize_params(
    params: Any,
    *,
    scale_mode: str = "even",
    scale_layout: str = "plain",
    select: Callable[[tuple[str, ...], Any], int | None] = default_select,
) -> Any:
    """Replace the selected float leaves of a parameter pytree by :class:`jax_mxfp4.MXFP4Array`.

    Works on linen variable dicts (``{"params": ...}`` or the inner dict) and on nnx states
    (``nnx.state(model, nnx.Param)``; apply the result with ``nnx.update(model, state)``).
    A selected axis whose length is not a multiple of 32 is zero-padded first (exact; the layers
    and :func:`jax_mxfp4.dense` pad the inputs to match).

    Args:
      params: any pytree of arrays.
      scale_mode: E8M0 scale rule (see :func:`jax_mxfp4.quantize`); weights use
        round-to-nearest-even elements.
      scale_layout: "plain" or "swizzled" scales.
      select: ``select(path_names, leaf) -> axis | None``; default :func:`default_select`
        (every float ``kernel`` with ndim >= 2, along axis 0).

    Returns:
      A pytree of the same structure with MXFP4Array leaves where selected (4.25 bits/element).

    Raises:
      ValueError: an unknown ``scale_mode``/``scale_layout`` or an out-of-range axis from ``select``.
    """
    checks.check_scale_mode(scale_mode)
    checks.check_scale_layout(scale_layout)

    def convert(path, leaf):
        if isinstance(leaf, MXFP4Array):
            return leaf
        axis = select(tuple(_key_name(k) for k in path), leaf)
        if axis is None:
            return leaf
        axis = checks.normalize_axis(axis, leaf.ndim, "axis returned by select")
        extra = (-leaf.shape[axis]) % BLOCK_SIZE
        if extra:
            widths = [(0, 0)] * leaf.ndim
            widths[axis] = (0, extra)
            leaf = jnp.pad(leaf, widths)
        return quantize(leaf, axis, scale_mode=scale_mode, scale_layout=scale_layout)

    return jax.tree_util.tree_map_with_path(
        convert, params, is_leaf=lambda x: isinstance(x, MXFP4Array)
    )


def abstract_params(params: Any) -> Any:
    """``jax.ShapeDtypeStruct`` mirror of ``params`` (MXFP4Arrays included): the restore target
    for ``orbax.checkpoint.StandardCheckpointer().restore(path, abstract_params(params))``."""
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), x.dtype), params)


def layer_operands(inputs, kernel, bias, dtype, recipe, promote):
    """The one weight path of every Flax layer, training and serving alike.

    The kernel is never cast: a float kernel reaches the GEMM in its ``param_dtype`` and is
    quantized from that value (the value :func:`quantize_params` quantizes), an MXFP4Array kernel
    is used as is. ``inputs`` and ``bias`` are promoted with ``promote`` (Flax's
    ``promote_dtype``) to the computation dtype: ``dtype``, else the result type of inputs, the
    kernel's (logical) dtype and bias, as Flax's layers do. The GEMM returns that dtype.

    Returns ``(inputs, kernel, bias, out_dtype)``. Raises ValueError for an MXFP4Array kernel
    quantized with another scale rule than ``recipe.scale_mode`` (serving would then differ
    from the forward the model was trained with).
    """
    recipe = dims.check_recipe(recipe)
    if isinstance(kernel, MXFP4Array) and kernel.scale_mode != recipe.scale_mode:
        raise ValueError(
            f"kernel: an MXFP4Array quantized with scale_mode={kernel.scale_mode!r}, but this layer's "
            f"recipe trains with scale_mode={recipe.scale_mode!r}; quantize_params(..., "
            f"scale_mode={recipe.scale_mode!r}) gives the weights the trained forward used"
        )
    if dtype is None:
        dtype = jnp.result_type(*(x for x in (inputs, bias) if x is not None), jnp.dtype(kernel.dtype))
        if not jnp.issubdtype(dtype, jnp.inexact):
            dtype = jnp.promote_types(jnp.float32, dtype)
    inputs, bias = promote((inputs, bias), dtype=dtype)
    return inputs, kernel, bias, jnp.dtype(dtype)
