"""MXFP4 quantization along the token axis within each group (the wgrad operands of ``ragged_dot``).

**Rule.** The rows (tokens) of an operand [M, F] are split into the groups of ``group_sizes``
(group g holds rows ``start_g .. start_g + size_g - 1``, ``start_g = size_0 + ... + size_{g-1}``),
and each group into blocks of 32 rows that start at the group's first row. A group whose size is
not a multiple of 32 ends with one partial block: its missing rows count as zeros (they add
nothing to the block's amax, nor to a product). An empty group has no block. Rows past
``sum(group_sizes)`` belong to no group and are dropped. No block ever holds rows of two groups, so
each expert's gradient X_gᵀ·dY_g contracts whole blocks of that expert's tokens only.

**How (static shapes under ``jit``).** Each row is scattered to its position in a padded buffer
in which every group occupies ``ceil(size_g / 32) * 32`` rows (zeros fill the gaps), groups in
order: row r of group g goes to ``padded_start_g + (r - start_g)``. The buffer has
``P = 32 * ceil((M + 31 G) / 32)`` rows, enough for any group sizes summing to at most M (each
group adds fewer than 32 rows of padding). :func:`jax_mxfp4.quantize` along axis 0 of the buffer
then forms exactly the blocks of the rule (the same scale rule, element rounding and, for
stochastic rounding, the uniforms of ``quantize`` for the [P, F] buffer and the given key).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from .mx_format import BLOCK_SIZE
from .quantize import quantize


class BlockLayout(NamedTuple):
    """Where each row of an [M, ...] operand goes in the group-blocked buffer.

    dest: int32 [M], the buffer row of each row (``rows`` for a row past the groups: dropped).
    padded_sizes: int32 [G], each group's size rounded up to a multiple of 32 (its buffer rows).
    rows: P, the buffer's (static) row count.
    """

    dest: jax.Array
    padded_sizes: jax.Array
    rows: int


def buffer_rows(m: int, g: int) -> int:
    """P = 32 * ceil((M + 31 G) / 32): buffer rows that hold any grouping of M rows into G groups."""
    return BLOCK_SIZE * (-(-(m + (BLOCK_SIZE - 1) * g) // BLOCK_SIZE))


def clipped_sizes(group_sizes, m: int) -> jax.Array:
    """``group_sizes`` (int32) as the groups that fit in M rows: negative sizes count as 0 and the
    groups are cut at row M. Equal to ``group_sizes`` whenever it is valid (sizes >= 0, sum <= M)."""
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes.astype(jnp.int32), 0)), m)
    return jnp.diff(ends, prepend=jnp.zeros((1,), jnp.int32))


def block_layout(group_sizes, m: int) -> BlockLayout:
    """The :class:`BlockLayout` of M rows grouped by ``group_sizes`` (int [G]), under ``jit`` too."""
    sizes = clipped_sizes(group_sizes, m)
    g = sizes.shape[0]
    ends = jnp.cumsum(sizes)
    padded = -(-sizes // BLOCK_SIZE) * BLOCK_SIZE
    padded_starts = jnp.cumsum(padded) - padded
    rows = jnp.arange(m, dtype=jnp.int32)
    group = jnp.searchsorted(ends, rows, side="right").astype(jnp.int32)  # first group ending after r
    gi = jnp.minimum(group, g - 1)
    p = buffer_rows(m, g)
    dest = jnp.where(group < g, padded_starts[gi] + rows - (ends[gi] - sizes[gi]), p)
    return BlockLayout(dest.astype(jnp.int32), padded, p)


def to_blocks(x, layout: BlockLayout) -> jax.Array:
    """x [M, ...] scattered into the zero-filled [P, ...] buffer of ``layout``."""
    buf = jnp.zeros((layout.rows,) + tuple(x.shape[1:]), x.dtype)
    return buf.at[layout.dest].set(x, mode="drop")


def quantize_blocked(x, layout: BlockLayout, *, scale_mode: str, rounding: str = "nearest", key=None):
    """x [M, F] float -> MXFP4Array [P, F] quantized along axis 0 in the blocks of the rule."""
    return quantize(to_blocks(x, layout), 0, scale_mode=scale_mode, rounding=rounding, key=key)


def group_blocked_values(x, group_sizes, *, scale_mode: str = "even", rounding: str = "nearest", key=None):
    """float32 [M, F]: the values of x [M, F] quantized along the token axis within each group.

    The quantize-dequantize of the rule above, read back at each row's own position (rows past
    ``sum(group_sizes)`` give 0): what the wgrad of :func:`jax_mxfp4.ragged_dot` multiplies.

    Args:
      x: float32/bfloat16/float16 [M, F].
      group_sizes: integer [G], sizes >= 0 summing to at most M (else the groups are clipped to
        M rows, negative sizes counting as 0).
      scale_mode, rounding, key: as in :func:`jax_mxfp4.quantize`.
    """
    layout = block_layout(jnp.asarray(group_sizes), x.shape[0])
    values = quantize_blocked(x, layout, scale_mode=scale_mode, rounding=rounding, key=key).dequantize(jnp.float32)
    return values.at[layout.dest].get(mode="fill", fill_value=0.0)
