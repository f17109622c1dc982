"""``dot_general`` with MXFP4 operands: maps every ``dimension_numbers`` onto the canonical GEMM.

The only place that reshapes and transposes logical operands: batch dims first, then free dims,
then the contracting dims, flattened to [B, M, K] / [B, N, K] (the "TN" form every backend takes).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from . import checks, dispatch, sharding
from .array import MXFP4Array
from .backends.base import GemmProblem
from .mx_format import BLOCK_SIZE
from .partitioning import partitioned_gemm
from .quantize import quantize
from .recipe import Recipe


@dataclasses.dataclass(frozen=True)
class _OperandPlan:
    perm: tuple[int, ...]  # batch dims, free dims, contracting dims
    n_batch: int
    batch: int
    free: int
    k: int
    free_shape: tuple[int, ...]


def _plan_operand(shape, contracting, batch, name) -> _OperandPlan:
    free = tuple(d for d in range(len(shape)) if d not in contracting and d not in batch)
    k = math.prod(shape[d] for d in contracting)
    if k % BLOCK_SIZE:
        raise ValueError(
            f"{name}: contracting dim(s) {tuple(contracting)} have total length {k}, which is not a "
            f"multiple of the MXFP4 block size {BLOCK_SIZE} (OCP MX v1.0 §5.1); pad K with zeros "
            f"(exact) or use jax_mxfp4.dense, which pads for you"
        )
    return _OperandPlan(
        perm=tuple(batch) + free + tuple(contracting),
        n_batch=len(batch),
        batch=math.prod(shape[d] for d in batch),
        free=math.prod(shape[d] for d in free),
        k=k,
        free_shape=tuple(shape[d] for d in free),
    )


def _logical_aval(x, name):
    if isinstance(x, MXFP4Array):
        return jax.ShapeDtypeStruct(x.shape, jnp.float32)
    checks.check_float_input(x, name)
    return jax.ShapeDtypeStruct(jnp.shape(x), jnp.float32)


def _operand_kinds(lhs, rhs, recipe: Recipe) -> tuple[str, str]:
    """"mxfp4" (pre-quantized), "quantized" (float, quantized here) or "float" (kept: w4a16)."""
    lq, rq = isinstance(lhs, MXFP4Array), isinstance(rhs, MXFP4Array)
    lk, rk = ("mxfp4" if lq else "quantized"), ("mxfp4" if rq else "quantized")
    if not recipe.quantize_activations:
        if rq and not lq:
            lk = "float"
        elif lq and not rq:
            rk = "float"
        elif not lq and not rq:
            lk = "float"  # lhs is the activation, rhs the weight
    return lk, rk


def _to_canonical(x, plan: _OperandPlan, contracting, recipe: Recipe, kind: str, name):
    """Operand -> MXFP4Array [B, F, K] quantized along axis 2 with plain scales, or, for
    ``kind == "float"``, the float array transposed and reshaped to [B, F, K]."""
    shape3 = (plan.batch, plan.free, plan.k)
    leaf = x.data if isinstance(x, MXFP4Array) else x
    spec = sharding.explicit_spec(leaf)
    if spec is not None:  # explicit mesh: merged dims need their sharding spelled out
        mesh = sharding.mesh_of(leaf)
        b, f, k = sharding.canonical_operand_spec(spec, plan.perm, plan.n_batch, len(plan.free_shape))
        sharding.check_k_shards(mesh, k, plan.k, name)

        def reshape(v, shape):
            return jnp.reshape(v, shape, out_sharding=sharding.named(mesh, b, f, k))
    else:

        def reshape(v, shape):
            return v.reshape(shape)

    if isinstance(x, MXFP4Array):
        if len(contracting) != 1 or contracting[0] != x.axis:
            raise ValueError(
                f"{name} is an MXFP4Array quantized along axis {x.axis}, but its contracting dims are "
                f"{tuple(contracting)}: an MXFP4 operand must be quantized along its single "
                f"contracting dim (the shared scales run along the contraction; OCP MX v1.0 §6.1)"
            )
        data = reshape(jnp.transpose(x.data, plan.perm), (plan.batch, plan.free, plan.k // 2))
        scales = jnp.transpose(x.plain_scales(), plan.perm)
        scales = reshape(scales, (plan.batch, plan.free, plan.k // BLOCK_SIZE))
        return MXFP4Array(data, scales, 2, shape3, x.dtype, x.scale_mode, "plain")
    x3 = reshape(jnp.transpose(x, plan.perm), shape3)
    if kind == "float":
        return x3
    return quantize(x3, 2, scale_mode=recipe.scale_mode)


def _problem(lhs_plan, rhs_plan, out_dtype, recipe, lhs, rhs) -> GemmProblem:
    lk, rk = _operand_kinds(lhs, rhs, recipe)
    return GemmProblem(
        batch=lhs_plan.batch,
        m=lhs_plan.free,
        n=rhs_plan.free,
        k=lhs_plan.k,
        out_dtype=out_dtype,
        scale_layout=recipe.scale_layout,
        platform=dispatch.current_platform(),
        lhs_kind=lk,
        rhs_kind=rk,
        lhs_dtype=jnp.dtype(lhs.dtype),
        rhs_dtype=jnp.dtype(rhs.dtype),
    )


def _plan(lhs, rhs, dimension_numbers, preferred_element_type, recipe):
    if recipe is None:
        recipe = Recipe()
    elif not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a jax_mxfp4.Recipe or None, got {type(recipe).__name__}")
    out_dtype = checks.check_output_dtype(preferred_element_type)
    try:
        (lc, rc), (lb, rb) = dimension_numbers
        lc, rc, lb, rb = (tuple(int(d) for d in t) for t in (lc, rc, lb, rb))
    except (TypeError, ValueError):
        raise ValueError(
            "dimension_numbers must be ((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch)) "
            f"as in jax.lax.dot_general, got {dimension_numbers!r}"
        ) from None
    la, ra = _logical_aval(lhs, "lhs"), _logical_aval(rhs, "rhs")
    # lax.dot_general's own shape rules validate ranks, dims and sizes (and give the output shape).
    out_aval = jax.eval_shape(
        functools.partial(lax.dot_general, dimension_numbers=((lc, rc), (lb, rb))), la, ra
    )
    if not lc:
        raise ValueError("dimension_numbers has no contracting dims: an MXFP4 GEMM needs one (K)")
    lc, rc = tuple(d % la.ndim for d in lc), tuple(d % ra.ndim for d in rc)
    lb, rb = tuple(d % la.ndim for d in lb), tuple(d % ra.ndim for d in rb)
    lplan = _plan_operand(la.shape, lc, lb, "lhs")
    rplan = _plan_operand(ra.shape, rc, rb, "rhs")
    problem = _problem(lplan, rplan, out_dtype, recipe, lhs, rhs)
    return recipe, (lc, rc, lplan, rplan), problem, out_aval.shape


def dot_general(
    lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, *, out_sharding=None, recipe=None
):
    """MXFP4 ``jax.lax.dot_general``: same signature, operands quantized to MXFP4 along K.

    Args:
      lhs, rhs: each an :class:`MXFP4Array` quantized along its single contracting dim, or a
        float32/bfloat16/float16 array, quantized on the fly along its contracting dim(s) with
        ``recipe.scale_mode`` (several contracting dims are flattened, row-major, into one K).
        With ``Recipe(quantize_activations=False)`` a float operand facing an MXFP4Array is not
        quantized (w4a16); see :class:`jax_mxfp4.Recipe`.
      dimension_numbers: ``((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch))`` as in
        ``jax.lax.dot_general``; any NN/NT/TN/TT arrangement and batch dims.
      precision: accepted for signature compatibility; ignored (every backend accumulates each
        block exactly and blocks in float32).
      preferred_element_type: output dtype, float32 (default), bfloat16 or float16.
      out_sharding: as in ``jax.lax.dot_general``: the output's sharding (a ``NamedSharding`` or,
        inside ``jax.set_mesh``, a ``PartitionSpec``). By default, under an explicit-sharding mesh
        the output is sharded like the operands' batch and free dims, and a sharded contracting
        dim is reduced (all-reduce) — each K shard must hold whole 32-element blocks.
      recipe: :class:`jax_mxfp4.Recipe` (scale rule, scale layout, backend); default ``Recipe()``.

    Returns:
      Array of ``lax.dot_general``'s output shape (batch dims, lhs free dims, rhs free dims).

    Raises:
      ValueError: malformed ``dimension_numbers``; total contracting length not a multiple of 32;
        an MXFP4Array not quantized along its single contracting dim; unsupported output dtype.
      TypeError: an operand that is neither an MXFP4Array nor a float array; shape mismatches
        (from ``lax.dot_general``'s shape rule).
      BackendUnavailableError: the backend named by the recipe or ``JAX_MXFP4_BACKEND`` cannot
        run this GEMM.
    """
    del precision
    recipe, (lc, rc, lplan, rplan), problem, out_shape = _plan(
        lhs, rhs, dimension_numbers, preferred_element_type, recipe
    )
    decision = dispatch.decide(problem, recipe.backend)
    a = _to_canonical(lhs, lplan, lc, recipe, problem.lhs_kind, "lhs")
    b = _to_canonical(rhs, rplan, rc, recipe, problem.rhs_kind, "rhs")
    backend = dispatch.get_backend(decision.backend)
    if backend.opaque:
        out = partitioned_gemm(a, b, backend.name, problem)
    else:
        out = backend.gemm(a, b, problem)
    out = _to_logical_output(out, out_shape, lhs, rhs, lplan, rplan)
    return out if out_sharding is None else jax.sharding.reshard(out, out_sharding)


def _to_logical_output(out, out_shape, lhs, rhs, lplan: _OperandPlan, rplan: _OperandPlan):
    """[B, M, N] -> lax.dot_general's output shape; under an explicit mesh each output dim keeps
    its operand dim's sharding (the inverse of the merges done by _to_canonical)."""
    lleaf = lhs.data if isinstance(lhs, MXFP4Array) else lhs
    rleaf = rhs.data if isinstance(rhs, MXFP4Array) else rhs
    ls, rs = sharding.explicit_spec(lleaf), sharding.explicit_spec(rleaf)
    if ls is None or rs is None:
        return out.reshape(out_shape)
    nb, nlf, nrf = lplan.n_batch, len(lplan.free_shape), len(rplan.free_shape)
    entries = sharding.logical_out_entries(
        [ls[d] for d in lplan.perm[: nb + nlf]], [rs[d] for d in rplan.perm[nb : nb + nrf]]
    )
    return jnp.reshape(out, out_shape, out_sharding=sharding.named(sharding.mesh_of(lleaf), *entries))


def explain(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, *, recipe=None):
    """Which backend :func:`dot_general` would use for these operands, and why not the others.

    Takes the same arguments as :func:`dot_general` (arrays, MXFP4Arrays or
    ``jax.ShapeDtypeStruct``s); computes nothing. Returns a :class:`jax_mxfp4.dispatch.Decision`
    whose ``str()`` is a readable report; ``.backend`` is the chosen name, ``.reasons`` maps every
    registered backend to why it was not chosen. Raises what :func:`dot_general` would raise.
    """
    del precision
    recipe, _, problem, _ = _plan(lhs, rhs, dimension_numbers, preferred_element_type, recipe)
    return dispatch.decide(problem, recipe.backend)
