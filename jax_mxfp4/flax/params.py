"""``quantize_params``: trained float kernels -> ``MXFP4Array`` for inference (linen or nnx)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from .. import checks, dims
from .. import hadamard as hd
from ..array import MXFP4Array
from ..decode_prepared import DecodePrepared, prepare_decode
from ..fp8_prepared import FP8Prepared
from ..mx_format import BLOCK_SIZE
from ..weight_record import check_against_recipe, fprop_rotation, quantize_weight

#: The quantized kernel forms the Flax layers use as is (inference): an MXFP4Array and the forms
#: arranged once from one, :func:`jax_mxfp4.prepare_decode` / :func:`jax_mxfp4.prepare_fp8`.
QUANTIZED_KERNELS = (MXFP4Array, DecodePrepared, FP8Prepared)

#: ``quantize_params(prepare=...)`` values: None (plain MXFP4Array) or "decode".
PREPARE_MODES = (None, "decode")


def quantized_kernel(kernel):
    """``kernel`` if it is a quantized kernel (:data:`QUANTIZED_KERNELS`), else None.

    A :class:`~jax_mxfp4.DecodePrepared` or :class:`~jax_mxfp4.FP8Prepared` kernel of layers
    stacked by ``nn.scan``/``nnx.vmap`` reaches each layer with its children sliced along their
    leading dims while its static ``shape``/``axis`` still describe the stack (unlike an
    MXFP4Array, these two classes do not re-describe themselves under ``vmap``/``scan``). Such a
    kernel is rebuilt here as the per-layer array: the leading ``d`` logical dims dropped (``d``
    less than or equal to ``axis``; the quantized axis is never sliced), the class's own
    constructor checking the children against the new static shape. Both classes store the
    non-quantized dims first, in order, so slicing the leading dims of the children is exactly
    slicing the leading logical dims. Children matching no such shape are returned unchanged, and
    :func:`jax_mxfp4.dot_general` reports them (the class's "batching ... not supported" error).
    """
    if isinstance(kernel, MXFP4Array):
        return kernel  # re-describes itself under vmap/scan (MXFP4Array.tree_unflatten)
    if not isinstance(kernel, (DecodePrepared, FP8Prepared)):
        return None
    for d in range(kernel.axis + 1):  # d = 0: already consistent
        try:
            return dataclasses.replace(kernel, axis=kernel.axis - d, shape=kernel.shape[d:])
        except ValueError:
            continue
    return kernel


def kernel_kind(kernel) -> str:
    """"an MXFP4Array" / "a DecodePrepared" / "an FP8Prepared": the type, for error messages."""
    name = type(kernel).__name__
    return ("an " if name[0] in "AEFHILMNORSX" else "a ") + name


def _key_name(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def default_select(path: tuple[str, ...], leaf) -> int | None:
    """The selector :func:`quantize_params` uses when it is given no ``model``.

    A leaf whose path ends in ``"kernel"`` (or ``"kernel", "value"`` for nnx states), with exactly
    2 dims and a float32/bfloat16/float16 dtype, is quantized along axis 0: the contraction axis
    of :class:`~jax_mxfp4.flax.linen.Dense`, :class:`~jax_mxfp4.flax.nnx.Linear` and a
    :class:`~jax_mxfp4.flax.linen.DenseGeneral` with one input axis and no batch dims. Kernels of
    other ranks (convolutions, scanned/stacked layers, einsum and attention kernels) stay float:
    from the path alone it cannot tell which GEMM consumes them. Without a model it also cannot
    tell a jax_mxfp4 layer's [K, N] kernel from a plain Flax Dense's; pass ``model=`` to
    :func:`quantize_params` to select exactly. Returns the axis or None.
    """
    names = [p for p in path if p != "value"]
    if not names or names[-1] != "kernel":
        return None
    if getattr(leaf, "ndim", 0) != 2 or jnp.dtype(getattr(leaf, "dtype", jnp.int32)) not in checks.INPUT_DTYPES:
        return None
    return 0


def einsum_kernel_dims(einsum_str, inputs_ndim, kernel_ndim):
    """(contraction axis or None if several, batch dims) of an einsum's kernel (rhs)."""
    from ..einsum import parse_subscripts

    try:
        (_, rc), (_, rb) = parse_subscripts(einsum_str.replace(" ", ""), inputs_ndim, kernel_ndim)[0]
    except (ValueError, TypeError):
        return None, ()
    return (rc[0] if len(rc) == 1 else None), tuple(rb)


def _record(found, path, dims, call_shape):
    axis, batch = dims
    found.setdefault(tuple(str(p) for p in path) + ("kernel",), set()).add((axis, tuple(call_shape), batch))


def consumed_kernels(model, params, inputs=()) -> dict:
    """Which kernels a jax_mxfp4 GEMM consumes: ``{path: (axis, per-call kernel shape)}``.

    ``path`` is the kernel's module path plus ``"kernel"`` (strings; no "params"/"value").
    For ``flax.linen`` the model is traced abstractly (``jax.eval_shape`` of
    ``model.apply(params, *inputs)``, nothing computed) and every call of a jax_mxfp4 layer
    (:class:`~jax_mxfp4.flax.linen.Dense`, ``DenseGeneral``, ``Einsum``) is recorded with the
    axis its GEMM contracts; for ``flax.nnx`` the module tree is walked (``nnx.iter_modules``)
    for :class:`~jax_mxfp4.flax.nnx.Linear` and ``Einsum``. Layers stacked by ``nn.scan`` /
    ``nnx.vmap`` see a per-layer kernel; the stacking dims are taken as the leading dims when
    that matches (both transforms' default; see :func:`_full_axis`). The axis is None when the
    GEMM contracts several kernel dims or calls disagree (such kernels stay float).
    """
    return {path: (axis, shape) for path, (axis, shape, _) in _consumers(model, params, inputs).items()}


def _consumers(model, params, inputs) -> dict:
    """:func:`consumed_kernels` with the per-call kernel's batch dims:
    ``{path: (axis, per-call kernel shape, batch dims)}``."""
    found: dict = {}
    try:
        from flax import nnx

        is_nnx = isinstance(model, nnx.Module)
    except ImportError:  # pragma: no cover - nnx missing in some jax/flax pairs
        is_nnx = False
    if is_nnx:
        # the jax_mxfp4 layers say which kernel dims their GEMM contracts (_mx_kernel_dims), so
        # this module never imports the layer modules (they import it)
        for path, m in nnx.iter_modules(model):
            if hasattr(m, "_mx_kernel_dims"):
                kernel = m.kernel.get_value()
                per_call, dims = m._mx_kernel_dims()
                _record(found, path, dims, tuple(kernel.shape)[len(kernel.shape) - per_call:])
    else:
        import flax.linen as nn

        def interceptor(next_fun, args, kwargs, context):
            out = next_fun(*args, **kwargs)
            mod = context.module
            if (context.method_name == "__call__" and hasattr(mod, "_mx_kernel_dims")
                    and mod.has_variable("params", "kernel")):
                k = mod.get_variable("params", "kernel")
                if not isinstance(k, QUANTIZED_KERNELS):
                    _record(found, mod.path, mod._mx_kernel_dims(args, kwargs, jnp.ndim(k)), jnp.shape(k))
            return out

        variables = params if "params" in params else {"params": params}
        with nn.intercept_methods(interceptor):
            jax.eval_shape(lambda v, *a: model.apply(v, *a), variables, *inputs)
    return {path: (calls.pop() if len(calls) == 1 else (None, None, ())) for path, calls in found.items()}


def _full_axis(leaf, consumer):
    """Axis of ``leaf`` (possibly stacked: extra leading dims) that its consumer contracts, or None.

    ``consumer`` is ``(per-call axis, per-call kernel shape, ...)`` from :func:`consumed_kernels`."""
    axis, call_shape = consumer[:2]
    if axis is None:
        return None
    extra = jnp.ndim(leaf) - len(call_shape)
    if extra < 0 or tuple(jnp.shape(leaf))[extra:] != tuple(call_shape):
        return None
    return axis + extra


def quantize_params(
    params: Any,
    *,
    scale_mode: str | None = None,
    scale_layout: str = "plain",
    select: Callable[[tuple[str, ...], Any], int | None] | None = None,
    model: Any = None,
    inputs: tuple = (),
    recipe=None,
    prepare: str | None = None,
) -> Any:
    """Replace the float kernels that jax_mxfp4 GEMMs consume by :class:`jax_mxfp4.MXFP4Array`.

    Works on linen variable dicts (``{"params": ...}`` or the inner dict) and on nnx states
    (``nnx.state(model, nnx.Param)``; apply the result with ``nnx.update(model, state)``).
    A selected axis whose length is not a multiple of 32 is zero-padded first (exact; the layers
    and :func:`jax_mxfp4.dense` pad the inputs to match).

    Which leaves: with ``model`` (the linen ``Module`` plus example ``inputs``, or the nnx
    ``Module``), exactly the kernels of jax_mxfp4 layers (``Dense``, ``DenseGeneral`` with one
    input axis, ``Einsum`` with one contracting kernel dim, nnx ``Linear`` and ``Einsum``, linen
    and nnx ``RaggedDense``: experts [E, K, N] along K, axis 1), each along the axis its GEMM contracts; layers stacked by ``nn.scan``/``nnx.vmap`` are quantized
    per layer along that axis (:func:`consumed_kernels`). Everything else stays float: Flax's own
    layers (even with ``dot_general=jax_mxfp4.dot_general``: Flax's parameter checks refuse a
    non-array kernel), convolutions, attention, embeddings, norms, biases. Without ``model``,
    :func:`default_select` (2-D kernels along axis 0). ``select`` overrides both; with ``model``
    each of its requests is checked against what the model's jax_mxfp4 GEMMs contract.

    Pass the training ``recipe`` to serve exactly what training multiplied: its ``scale_mode`` is
    used, and if ``recipe.hadamard`` includes "fprop" (with ``recipe.fprop == "mxfp4"``) each
    selected kernel is rotated along its axis (after padding) by the forward pass's Hadamard
    transform -- block ``recipe.hadamard_block``, seed :func:`jax_mxfp4.hadamard.weight_seed` of
    the kernel's (per-layer, with ``model``: one layer of an ``nn.scan``/``nnx.vmap`` stack)
    shape, ``(axis,)``, ``()`` -- before quantizing; the :class:`MXFP4Array` records
    ``hadamard=(block, seed)`` and :func:`jax_mxfp4.dot_general` rotates the activations to
    match. The stored codes and scales are then bit-identical to those training's forward pass
    quantized (without ``model``, for kernels contracted along ``axis`` with no batch dims, as
    :func:`default_select` selects; with ``model``, the batch dims of a ``DenseGeneral``/``Einsum``
    count too). The record travels with the array (orbax, ``jit``,
    :func:`jax_mxfp4.checkpoint.save_mxfp4`), and every layer checks it against its recipe
    (:func:`layer_operands`), so a kernel rotated otherwise is refused, never served.

    Args:
      params: any pytree of arrays.
      scale_mode: E8M0 scale rule (see :func:`jax_mxfp4.quantize`); default ``recipe.scale_mode``,
        or "even" without a recipe. Weights use round-to-nearest-even elements.
      scale_layout: "plain" or "swizzled" scales.
      select: optional ``select(path_names, leaf) -> axis | None`` (path names are strings, e.g.
        ``("params", "Dense_0", "kernel")``).
      model: optional linen ``Module`` (then ``inputs`` are example inputs for ``model.apply``;
        only shapes are used) or nnx ``Module`` (``inputs`` unused).
      inputs: tuple of example inputs for a linen ``model``.
      recipe: the :class:`jax_mxfp4.Recipe` the model was trained with (optional; see above).
      prepare: None (default): each selected kernel becomes a plain MXFP4Array. "decode": each
        becomes ``jax_mxfp4.prepare_decode(q)`` of that MXFP4Array, a
        :class:`jax_mxfp4.DecodePrepared` (the same bytes, packed data with the quantized axis
        last and E8M0 scales K-major: data uint8 [N, K/2] and scales [K/32, N] for a [K, N]
        kernel, [L, N, K/2] and [L, K/32, N] for a stack of L layers), and so do MXFP4Array
        leaves already in ``params`` (e.g. restored from a checkpoint: save the MXFP4Arrays,
        prepare after restoring). For inference/serving only, like every quantized kernel
        (training needs the float kernels): the layers give bit-identical outputs with either
        form, and on an NVIDIA Hopper GPU the w4a16 GEMMs of decode-size batches then read the
        weight with no per-call transpose of the Flax kernel layout (README "Weights arranged
        once for decode"). DecodePrepared and FP8Prepared leaves in ``params`` are kept as is.

    Returns:
      A pytree of the same structure with MXFP4Array leaves where selected (4.25 bits/element),
      or DecodePrepared leaves with ``prepare="decode"`` (same size).

    Raises:
      ValueError: an unknown ``scale_mode``/``scale_layout``; ``prepare`` not None or "decode";
        an out-of-range axis from ``select``; with ``model``, a ``select`` request for a kernel no jax_mxfp4 GEMM consumes,
        or along another axis than the one it contracts (the message names the parameter path);
        a ``scale_mode`` different from ``recipe.scale_mode``; with an fprop rotation, a kernel
        axis (padded to 32) that is not a multiple of ``recipe.hadamard_block``.
      TypeError: ``recipe`` not a Recipe.
    """
    if not (prepare is None or (isinstance(prepare, str) and prepare in PREPARE_MODES)):
        raise ValueError(
            f"quantize_params: prepare must be one of {PREPARE_MODES} (None: plain MXFP4Array kernels; "
            f'"decode": jax_mxfp4.prepare_decode of each), got {prepare!r}'
        )
    finish = prepare_decode if prepare == "decode" else (lambda q: q)
    if recipe is not None:
        from ..dims import check_recipe

        recipe = check_recipe(recipe)
        if scale_mode is not None and scale_mode != recipe.scale_mode:
            raise ValueError(
                f"scale_mode={scale_mode!r} differs from recipe.scale_mode={recipe.scale_mode!r}; "
                "leave scale_mode out to use the recipe's"
            )
        scale_mode = recipe.scale_mode
    scale_mode = "even" if scale_mode is None else scale_mode
    checks.check_scale_mode(scale_mode)
    checks.check_scale_layout(scale_layout)
    consumers = _consumers(model, params, inputs) if model is not None else None

    def convert(path, leaf):
        if isinstance(leaf, QUANTIZED_KERNELS):
            return finish(leaf) if isinstance(leaf, MXFP4Array) else leaf
        names = tuple(_key_name(k) for k in path)
        key = tuple(n for n in names if n != "value")
        if key[:1] == ("params",):
            key = key[1:]
        if select is not None:
            axis = select(names, leaf)
            if axis is None:
                return leaf
            axis = checks.normalize_axis(axis, leaf.ndim, "axis returned by select")
            if consumers is not None:
                if key not in consumers:
                    raise ValueError(
                        f"quantize_params: select asked to quantize {'/'.join(names)} along axis {axis}, but "
                        "no jax_mxfp4 layer of the model consumes it (only the kernels of "
                        "jax_mxfp4.flax layers accept an MXFP4Array); leave it float"
                    )
                want = _full_axis(leaf, consumers[key])
                if want != axis:
                    raise ValueError(
                        f"quantize_params: select asked to quantize {'/'.join(names)} along axis {axis}, but "
                        + ("its jax_mxfp4 GEMM contracts several of its dims (or calls disagree)" if want is None
                           else f"its jax_mxfp4 GEMM contracts axis {want}")
                        + "; an MXFP4 operand must be quantized along its single contracting dim (OCP MX v1.0 §6.1)"
                    )
        elif consumers is not None:
            axis = _full_axis(leaf, consumers[key]) if key in consumers else None
            if axis is None or getattr(leaf, "dtype", None) is None or jnp.dtype(leaf.dtype) not in checks.INPUT_DTYPES:
                return leaf
        else:
            axis = default_select(names, leaf)
            if axis is None:
                return leaf
        # the forward's rotation of this kernel as one layer's GEMM saw it (its seed depends on
        # that): a stack of layers (nn.scan/nnx.vmap, leading dims) is rotated per layer, with
        # the per-layer shape, and a kernel with batch dims with those
        call_shape, call_axis, batch = tuple(leaf.shape), axis, ()
        if consumers is not None and key in consumers and consumers[key][1] is not None:
            call_shape, batch = tuple(consumers[key][1]), consumers[key][2]
            call_axis = axis - (leaf.ndim - len(call_shape))
        rotation = fprop_rotation(recipe, call_shape, (call_axis,), batch) if recipe is not None else None
        extra = (-leaf.shape[axis]) % BLOCK_SIZE
        if extra:
            widths = [(0, 0)] * leaf.ndim
            widths[axis] = (0, extra)
            leaf = jnp.pad(leaf, widths)
        if rotation is not None:
            hd.check_length(leaf.shape[axis], rotation[0],
                            f"the kernel at {'/'.join(_key_name(k) for k in path)} along axis {axis}")
        return finish(quantize_weight(leaf, axis, scale_mode=scale_mode, scale_layout=scale_layout,
                                      hadamard=rotation))

    return jax.tree_util.tree_map_with_path(
        convert, params, is_leaf=lambda x: isinstance(x, QUANTIZED_KERNELS)
    )


def abstract_params(params: Any) -> Any:
    """``jax.ShapeDtypeStruct`` mirror of ``params`` (MXFP4Arrays included): the restore target
    for ``orbax.checkpoint.StandardCheckpointer().restore(path, abstract_params(params))``."""
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), x.dtype), params)


def einsum_trained(einsum_str, inputs, kernel_shape):
    """``(kernel_shape, contracting, batch)`` of an Einsum layer's kernel as its GEMM contracts it
    (the ``trained`` argument of :func:`layer_operands`), or None for subscripts that are not one
    GEMM (:func:`jax_mxfp4.einsum` reports those)."""
    from ..einsum import parse_subscripts

    try:
        (_, rc), (_, rb) = parse_subscripts(einsum_str, jnp.ndim(inputs), len(kernel_shape))[0]
    except (ValueError, TypeError):
        return None
    return tuple(kernel_shape), tuple(rc), tuple(rb)


def layer_operands(inputs, kernel, bias, dtype, recipe, promote, trained=None):
    """The one weight path of every Flax layer, training and serving alike.

    The kernel is never cast: a float kernel reaches the GEMM in its ``param_dtype`` and is
    quantized from that value (the value :func:`quantize_params` quantizes), a quantized kernel
    (MXFP4Array, DecodePrepared, FP8Prepared: :func:`quantized_kernel`) is used as is, once its
    record (scale rule, Hadamard rotation) is checked against ``recipe``
    (:func:`jax_mxfp4.weight_record.check_against_recipe`). ``trained`` is ``(shape,
    contracting, batch)`` of the float kernel as the layer declares and contracts it (the
    rotation's seed depends on it); None: the quantized kernel's own shape and axis, no batch
    dims. ``inputs`` and ``bias`` are promoted with ``promote`` (Flax's ``promote_dtype``) to
    the computation dtype: ``dtype``, else the result type of inputs, the kernel's (logical)
    dtype and bias, as Flax's layers do. The GEMM returns that dtype.

    Returns ``(inputs, kernel, bias, out_dtype)``. Raises ValueError for a quantized kernel
    whose scale rule or rotation differs from what ``recipe``'s forward pass used (serving
    would then differ from the forward the model was trained with), naming both.
    """
    recipe = dims.check_recipe(recipe)
    q = quantized_kernel(kernel)
    kernel = kernel if q is None else q
    if q is not None:
        shape, contracting, batch = trained if trained is not None else (None, None, ())
        check_against_recipe(q, recipe, shape=shape, contracting=contracting, batch=batch)
    if dtype is None:
        dtype = jnp.result_type(*(x for x in (inputs, bias) if x is not None), jnp.dtype(kernel.dtype))
        if not jnp.issubdtype(dtype, jnp.inexact):
            dtype = jnp.promote_types(jnp.float32, dtype)
    inputs, bias = promote((inputs, bias), dtype=dtype)
    return inputs, kernel, bias, jnp.dtype(dtype)
