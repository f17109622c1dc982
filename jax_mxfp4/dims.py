"""``dimension_numbers`` -> the canonical [B, F, K] operand form and back (one place for the layout).

Every GEMM of the package (the forward :func:`jax_mxfp4.gemm.dot_general` and the fprop, dgrad
and wgrad of the custom VJP in :mod:`jax_mxfp4.training`) maps its operands with these functions:
batch dims first, then the free dims, then the contracting dims, flattened to [B, F, K] (the "TN"
form every backend takes), and the [B, M, N] result back to ``lax.dot_general``'s output shape.
Under an explicit-sharding mesh the merges keep their shardings (:mod:`jax_mxfp4.sharding`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import checks, sharding
from .mx_format import BLOCK_SIZE
from .recipe import Recipe


def check_recipe(recipe) -> Recipe:
    """``recipe`` or the default ``Recipe()``; TypeError for anything else."""
    if recipe is None:
        return Recipe()
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a jax_mxfp4.Recipe or None, got {type(recipe).__name__}")
    return recipe


def takes_rounding_key(recipe) -> bool:
    """Whether a GEMM under ``recipe`` (a :class:`jax_mxfp4.Recipe` or None) draws a key for
    stochastic rounding: a gradient quantized to MXFP4 (dgrad or wgrad) with
    ``grad_rounding="stochastic"``. The layers and the Qwix providers ask this before drawing
    from their RNG stream."""
    recipe = check_recipe(recipe)
    return recipe.grad_rounding == "stochastic" and "mxfp4" in (recipe.dgrad, recipe.wgrad)


def parse_dimension_numbers(dimension_numbers, lshape, rshape):
    """Normalized (non-negative) ``(lc, rc, lb, rb)`` and the output shape; dims must be ints.

    ``lax.dot_general``'s own shape rule validates ranks, dims and sizes (TypeError from it).
    Raises ValueError for a malformed ``dimension_numbers`` or one without contracting dims.
    """
    def as_dims(t):
        dims = tuple(t)
        if not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) for d in dims):
            raise TypeError
        return tuple(int(d) for d in dims)

    try:
        (lc, rc), (lb, rb) = dimension_numbers
        lc, rc, lb, rb = (as_dims(t) for t in (lc, rc, lb, rb))
    except (TypeError, ValueError):
        raise ValueError(
            "dimension_numbers must be ((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch)) "
            f"as in jax.lax.dot_general, got {dimension_numbers!r}"
        ) from None
    la = jax.ShapeDtypeStruct(tuple(lshape), jnp.float32)
    ra = jax.ShapeDtypeStruct(tuple(rshape), jnp.float32)
    out = jax.eval_shape(functools.partial(lax.dot_general, dimension_numbers=((lc, rc), (lb, rb))), la, ra)
    if not lc:
        raise ValueError("dimension_numbers has no contracting dims: an MXFP4 GEMM needs one (K)")
    nl, nr = len(lshape), len(rshape)
    norm = lambda dims, n: tuple(d % n for d in dims)  # noqa: E731
    return norm(lc, nl), norm(rc, nr), norm(lb, nl), norm(rb, nr), tuple(out.shape)


def check_block_k(k: int, contracting, name: str = "lhs") -> None:
    """ValueError unless the total contracting length ``k`` is a (concrete) multiple of 32."""
    checks.check_concrete_block_dim(k, f"{name}: contracting dim(s) {tuple(contracting)}")
    if k % BLOCK_SIZE:
        raise ValueError(
            f"{name}: contracting dim(s) {tuple(contracting)} have total length {k}, which is not a "
            f"multiple of the MXFP4 block size {BLOCK_SIZE} (OCP MX v1.0 §5.1); pad K with zeros "
            "(exact) or use jax_mxfp4.dense or the jax_mxfp4.flax layers, which pad for you"
        )


def free_dims(ndim, contracting, batch) -> tuple[int, ...]:
    return tuple(d for d in range(ndim) if d not in contracting and d not in batch)


def canonical_sizes(shape, contracting, batch) -> tuple[int, int, int]:
    """(B, F, K) sizes of an operand of ``shape``."""
    free = free_dims(len(shape), contracting, batch)
    return tuple(math.prod(shape[d] for d in dims) for dims in (batch, free, contracting))


def to_bfk(x, contracting, batch, name, logical_k=None):
    """Transpose ``x`` to (batch, free, contracting) dims and merge them into [B, F, K].

    Also used on packed data (K/2) and plain scales (K/32) of an MXFP4Array, with ``logical_k``
    the logical K. Under an explicit mesh the merged dims keep their shardings and a K shard must
    hold whole 32-element blocks (ValueError otherwise, naming ``name``, raised before any reshape).
    """
    free = free_dims(x.ndim, contracting, batch)
    perm = tuple(batch) + free + tuple(contracting)
    shape3 = canonical_sizes(x.shape, contracting, batch)
    spec = sharding.explicit_spec(x)
    if spec is not None:
        k = sharding.canonical_operand_spec(spec, perm, len(batch), len(free))[2]
        sharding.check_k_shards(sharding.mesh_of(x), k, shape3[2] if logical_k is None else logical_k, name)
    return merge3(jnp.transpose(x, perm), len(batch), len(free))


def merge3(x, n_batch: int, n_free: int):
    """Merge ``x``'s leading ``n_batch`` dims, the next ``n_free`` dims and the rest, row-major, into
    [B, F, K]; under an explicit mesh each merged dim keeps its dims' shardings (no check)."""
    shape3 = (
        math.prod(x.shape[:n_batch]), math.prod(x.shape[n_batch : n_batch + n_free]),
        math.prod(x.shape[n_batch + n_free :]),
    )
    spec = sharding.explicit_spec(x)
    if spec is None:
        return x.reshape(shape3)
    entries = sharding.canonical_operand_spec(spec, tuple(range(x.ndim)), n_batch, n_free)
    return jnp.reshape(x, shape3, out_sharding=sharding.named(sharding.mesh_of(x), *entries))


def to_logical(y3, out_shape, lhs, rhs, lc, rc, lb, rb):
    """[B, M, N] -> ``lax.dot_general``'s output shape. ``lhs``/``rhs`` are the logical operands
    (arrays, or MXFP4Array data); under an explicit mesh each output dim keeps its operand dim's
    sharding (the inverse of the merges done by :func:`to_bfk`), an operand without an explicit
    sharding counting as replicated (as in ``lax.dot_general``)."""
    mesh, specs = sharding.explicit_specs(lhs, rhs)
    if mesh is None:
        return y3.reshape(out_shape)
    ls, rs = specs
    lfree, rfree = free_dims(lhs.ndim, lc, lb), free_dims(rhs.ndim, rc, rb)
    entries = sharding.logical_out_entries([ls[d] for d in tuple(lb) + lfree], [rs[d] for d in rfree])
    return jnp.reshape(y3, out_shape, out_sharding=sharding.named(mesh, *entries))
