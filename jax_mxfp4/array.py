"""``MXFP4Array``: a quantized tensor as a JAX pytree (packed E2M1 data + E8M0 shared scales)."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import checks, layout
from .pytree import ArraysWithRecord
from .mx_format import BLOCK_SIZE, as_scale_bytes, dequantize_packed


@dataclasses.dataclass(frozen=True, eq=False)
class MXFP4Array(ArraysWithRecord):
    """An MXFP4 tensor (OCP MX v1.0): E2M1 elements with one E8M0 scale per 32 along ``axis``.

    Children (traced by ``jit``/``vmap``/``scan``, moved by ``device_put``):
      data:   uint8, the logical shape with ``axis`` halved; byte i along ``axis`` holds element 2i
              in bits 0-3 and element 2i+1 in bits 4-7 (E2M1 codes, sign in bit 3).
      scales: ``jnp.float8_e8m0fnu``. Layout "plain": the logical shape with ``axis`` divided by
              32, byte i covering elements 32i..32i+31 along ``axis``. Layout "swizzled":
              hipBLASLt's 32x8 pre-swizzled layout of the 2-D view [rows, K/32] (rows = product
              of the other dims, in order, with ``axis`` moved last), shape
              [round_up(rows, 32), round_up(K/32, 8)]; see :mod:`jax_mxfp4.layout`.
    Static (part of the treedef):
      axis (non-negative), shape (logical), dtype (logical: the quantized input's dtype),
      scale_mode, scale_layout, and ``hadamard``: None (default), or ``(block, seed)`` when the
      values were rotated along ``axis`` by :func:`jax_mxfp4.hadamard.random_hadamard_transform`
      before quantizing (:func:`jax_mxfp4.flax.quantize_params` with a recipe whose
      ``hadamard`` includes "fprop"). :func:`jax_mxfp4.dequantize` returns the rotated values;
      :func:`jax_mxfp4.dot_general` rotates a float operand facing such an array the same way, so
      the product is that of the unrotated operands (an orthogonal rotation cancels).
    The static fields are the weight's record (:mod:`jax_mxfp4.weight_record`): what it needs to
    be served as trained; :func:`jax_mxfp4.checkpoint.save_mxfp4` stores it with the bytes.

    Under ``vmap``/``scan`` (batch axis 0, plain layout) the static ``shape`` and ``axis`` follow
    the children: leading dims added or removed by batching are re-described on unflattening.
    Batching along the quantized axis itself, or a swizzled array, is not supported.

    ``jax.export`` serializes it as an argument or result (:mod:`jax_mxfp4.serialization`). Its
    shape is part of the pytree structure, so an exported program takes MXFP4Array arguments of
    the exported shape only; a shape-polymorphic export may return one with symbolic
    non-quantized dims (concrete again when called: :func:`jax_mxfp4.checks.resolve_symbolic`).
    """

    _IS_MXFP4_ARRAY = True  # how jax_mxfp4.checks recognises it without importing this module
    holds = "an MXFP4Array is packed E2M1 codes plus E8M0 scales"
    decode_hint = ("decode it with jax_mxfp4.dequantize(q, dtype) (or q.dequantize(dtype)), or read its parts "
                   "q.data (uint8) and q.scales (float8_e8m0fnu)")

    data: Any
    scales: Any
    axis: int
    shape: tuple[int, ...]
    dtype: Any
    scale_mode: str = "even"
    scale_layout: str = "plain"
    hadamard: tuple[int, int] | None = None

    CHILDREN = ("data", "scales")

    @classmethod
    def _restore(cls, static, children):
        data, scales = children
        axis, scale_layout = static["axis"], static["scale_layout"]
        shape = checks.resolve_symbolic(tuple(static["shape"]), axis, data, packed=True, axis_last=False)
        # vmap/scan batch the children along some axis while the static fields describe the
        # unbatched array: re-describe the dims added (out_axes) or removed (in_axes).
        if scale_layout == "plain" and hasattr(data, "shape") and hasattr(scales, "shape"):
            shape, axis = _rebatch(tuple(shape), axis, tuple(data.shape), tuple(scales.shape))
        return {**static, "shape": shape, "axis": axis}

    def __post_init__(self):
        checks.check_mx_dtype(self.dtype)
        object.__setattr__(self, "shape", tuple(self.shape))
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype))
        checks.check_scale_layout(self.scale_layout, "scale_layout")
        checks.check_scale_mode(self.scale_mode, "scale_mode")
        checks.check_mx_array_parts(self.data, self.scales, self.axis, self.shape, self.scale_layout)
        if self.hadamard is not None:
            from .hadamard import check_block, check_length

            h = self.hadamard
            if not (isinstance(h, tuple) and len(h) == 2 and isinstance(h[1], (int, np.integer))
                    and not isinstance(h[1], bool) and h[1] >= 0):
                raise ValueError(f"hadamard must be None or a tuple (block, seed) with seed an int >= 0, got {h!r}")
            block = check_block(h[0], "hadamard block")
            check_length(self.shape[self.axis], block, f"the quantized axis {self.axis} of this MXFP4Array")
            object.__setattr__(self, "hadamard", (block, int(h[1])))

    # ---------------------------------------------------------------- conveniences
    @property
    def nbytes(self) -> int:
        """Bytes held by data and scales (4.25 bits per element in the plain layout)."""
        return int(np.prod(self.data.shape)) + int(np.prod(self.scales.shape))

    def __repr__(self) -> str:
        return (
            f"MXFP4Array(shape={self.shape}, dtype={self.dtype.name}, axis={self.axis}, "
            f"scale_mode={self.scale_mode!r}, scale_layout={self.scale_layout!r}"
            + (f", hadamard={self.hadamard}" if self.hadamard is not None else "") + ")"
        )

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """Same as :func:`jax_mxfp4.dequantize` (which calls this)."""
        dtype = checks.check_output_dtype(dtype, "dtype")
        return dequantize_packed(self.data, as_scale_bytes(self.plain_scales()), axis=self.axis).astype(dtype)

    def plain_scales(self) -> jax.Array:
        """Scales in the plain layout (logical shape with ``axis`` divided by 32), E8M0."""
        if self.scale_layout == "plain":
            return self.scales
        rows, cols = layout.scale_view_2d(self.shape, self.axis)
        flat = layout.unswizzle(self.scales, rows, cols)
        moved = list(np.moveaxis(np.empty(self.shape, np.bool_), self.axis, -1).shape)
        moved[-1] = moved[-1] // BLOCK_SIZE
        return jnp.moveaxis(flat.reshape(moved), -1, self.axis)

    def with_scale_layout(self, scale_layout: str) -> "MXFP4Array":
        """This array with its scales in ``scale_layout`` ("plain" | "swizzled"); data unchanged.

        Conversions are exact permutations (plus 0x00 padding bytes for "swizzled").
        Raises ValueError for an unknown layout.
        """
        checks.check_scale_layout(scale_layout, "scale_layout")
        if scale_layout == self.scale_layout:
            return self
        plain = self.plain_scales()
        if scale_layout == "plain":
            scales = plain
        else:
            scales = layout.swizzle(jnp.moveaxis(plain, self.axis, -1).reshape(layout.scale_view_2d(self.shape, self.axis)))
        return dataclasses.replace(self, scales=scales, scale_layout=scale_layout)


def _packed_shapes(shape, axis):
    data = tuple(d // 2 if i == axis else d for i, d in enumerate(shape))
    scales = tuple(d // BLOCK_SIZE if i == axis else d for i, d in enumerate(shape))
    return data, scales


def _rebatch(shape, axis, data_shape, scales_shape):
    """(shape, axis) consistent with children of ``data_shape``/``scales_shape`` that vmap or scan
    batched by inserting or removing dims. Unchanged if already consistent or not explainable by
    batching along non-quantized dims (then the array's own shape checks report it)."""
    if _packed_shapes(shape, axis) == (data_shape, scales_shape):
        return shape, axis
    extra = len(data_shape) - len(shape)
    if extra > 0:  # dims were inserted: find their positions in the data shape
        for pos in itertools.combinations(range(len(data_shape)), extra):
            if axis + sum(p <= axis + i for i, p in enumerate(pos)) in pos:
                continue
            new_axis = axis + sum(1 for i, p in enumerate(pos) if p <= axis + i)
            rest = [d for i, d in enumerate(data_shape) if i not in pos]
            new_shape = list(data_shape)
            new_shape[new_axis] = rest[axis] * 2
            new_shape = tuple(new_shape)
            if _packed_shapes(new_shape, new_axis) == (data_shape, scales_shape):
                return new_shape, new_axis
    elif extra < 0:  # dims were removed: find which of the logical dims are gone
        for pos in itertools.combinations(range(len(shape)), -extra):
            if axis in pos:
                continue
            new_shape = tuple(d for i, d in enumerate(shape) if i not in pos)
            new_axis = axis - sum(1 for p in pos if p < axis)
            if _packed_shapes(new_shape, new_axis) == (data_shape, scales_shape):
                return new_shape, new_axis
    return shape, axis
