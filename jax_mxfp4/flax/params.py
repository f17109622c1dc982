"""``quantize_params``: trained float kernels -> ``MXFP4Array`` for inference (linen or nnx)."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from .. import checks
from .. import hadamard as hd
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
    scale_mode: str | None = None,
    scale_layout: str = "plain",
    select: Callable[[tuple[str, ...], Any], int | None] = default_select,
    recipe=None,
) -> Any:
    """Replace the selected float leaves of a parameter pytree by :class:`jax_mxfp4.MXFP4Array`.

    Works on linen variable dicts (``{"params": ...}`` or the inner dict) and on nnx states
    (``nnx.state(model, nnx.Param)``; apply the result with ``nnx.update(model, state)``).
    A selected axis whose length is not a multiple of 32 is zero-padded first (exact; the layers
    and :func:`jax_mxfp4.dense` pad the inputs to match).

    Pass the training ``recipe`` to serve exactly what training multiplied: its ``scale_mode`` is
    used, and if ``recipe.hadamard`` includes "fprop" (with ``recipe.fprop == "mxfp4"``) each
    selected kernel is rotated along its axis (after padding) by the forward pass's Hadamard
    transform -- block ``recipe.hadamard_block``, seed :func:`jax_mxfp4.hadamard.weight_seed` of
    the kernel's shape, ``(axis,)``, ``()`` -- before quantizing; the :class:`MXFP4Array` records
    ``hadamard=(block, seed)`` and :func:`jax_mxfp4.dot_general` rotates the activations to
    match. The stored codes and scales are then bit-identical to those training's forward pass
    quantized (for layers that contract the kernel's axis ``axis`` with no batch dims, as
    :func:`default_select` selects).

    Args:
      params: any pytree of arrays.
      scale_mode: E8M0 scale rule (see :func:`jax_mxfp4.quantize`); default ``recipe.scale_mode``,
        or "even" without a recipe. Weights use round-to-nearest-even elements.
      scale_layout: "plain" or "swizzled" scales.
      select: ``select(path_names, leaf) -> axis | None``; default :func:`default_select`
        (every float ``kernel`` with ndim >= 2, along axis 0).
      recipe: the :class:`jax_mxfp4.Recipe` the model was trained with (optional; see above).

    Returns:
      A pytree of the same structure with MXFP4Array leaves where selected (4.25 bits/element).

    Raises:
      ValueError: an unknown ``scale_mode``/``scale_layout``; an out-of-range axis from ``select``;
        a ``scale_mode`` different from ``recipe.scale_mode``; with an fprop rotation, a kernel
        axis (padded to 32) that is not a multiple of ``recipe.hadamard_block``.
      TypeError: ``recipe`` not a Recipe.
    """
    rotate = False
    if recipe is not None:
        from ..dims import check_recipe

        recipe = check_recipe(recipe)
        if scale_mode is not None and scale_mode != recipe.scale_mode:
            raise ValueError(
                f"scale_mode={scale_mode!r} differs from recipe.scale_mode={recipe.scale_mode!r}; "
                "leave scale_mode out to use the recipe's"
            )
        scale_mode = recipe.scale_mode
        rotate = "fprop" in recipe.hadamard_passes and recipe.fprop == "mxfp4"
    scale_mode = "even" if scale_mode is None else scale_mode
    checks.check_scale_mode(scale_mode)
    checks.check_scale_layout(scale_layout)

    def convert(path, leaf):
        if isinstance(leaf, MXFP4Array):
            return leaf
        axis = select(tuple(_key_name(k) for k in path), leaf)
        if axis is None:
            return leaf
        axis = checks.normalize_axis(axis, leaf.ndim, "axis returned by select")
        seed = hd.weight_seed(leaf.shape, (axis,), ())
        extra = (-leaf.shape[axis]) % BLOCK_SIZE
        if extra:
            widths = [(0, 0)] * leaf.ndim
            widths[axis] = (0, extra)
            leaf = jnp.pad(leaf, widths)
        if not rotate:
            return quantize(leaf, axis, scale_mode=scale_mode, scale_layout=scale_layout)
        block = recipe.hadamard_block
        hd.check_length(leaf.shape[axis], block, f"the kernel at {'/'.join(_key_name(k) for k in path)} along axis {axis}")
        q = quantize(hd.random_hadamard_transform(leaf, axis, seed, block), axis, scale_mode=scale_mode,
                     scale_layout=scale_layout)
        return MXFP4Array(q.data, q.scales, q.axis, q.shape, leaf.dtype, q.scale_mode, q.scale_layout, (block, seed))

    return jax.tree_util.tree_map_with_path(
        convert, params, is_leaf=lambda x: isinstance(x, MXFP4Array)
    )


def abstract_params(params: Any) -> Any:
    """``jax.ShapeDtypeStruct`` mirror of ``params`` (MXFP4Arrays included): the restore target
    for ``orbax.checkpoint.StandardCheckpointer().restore(path, abstract_params(params))``."""
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), x.dtype), params)
