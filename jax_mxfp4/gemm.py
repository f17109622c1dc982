"""``dot_general`` with MXFP4 operands: maps every ``dimension_numbers`` onto the canonical GEMM.

Operands are mapped with :mod:`jax_mxfp4.dims` (batch dims, free dims, contracting dims, flattened
to [B, M, K] / [B, N, K]: the "TN" form every backend takes), quantized, and handed to the backend
that :mod:`jax_mxfp4.dispatch` chooses for each platform. Where platforms choose differently the
choices are staged with ``lax.platform_dependent``: only the branch of the platform a program is
lowered for is compiled, and ``jax.export(..., platforms=["cpu", "rocm"])`` gets each platform's
own path (as JAX's own platform-specific ops do).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from . import checks, dims, dispatch, sharding
from .array import MXFP4Array
from .hadamard import random_hadamard_transform
from .backends.base import GemmProblem
from .decode_prepared import DecodePrepared
from .decode_prepared import canonical as decode_canonical
from .decode_prepared import order_of
from .fp8_prepared import FP8Prepared
from .fp8_prepared import canonical as fp8_canonical
from .partitioning import partitioned_gemm
from .quantize import quantize
from .recipe import Recipe


_QUANTIZED = (MXFP4Array, FP8Prepared, DecodePrepared)
_ROTATABLE = _QUANTIZED  # every quantized operand records its Hadamard rotation


def _logical_shape(x, name):
    if isinstance(x, (FP8Prepared, DecodePrepared)):
        x._check_children()  # batched by vmap/scan: say so before the shape checks misread it
    if isinstance(x, _QUANTIZED):
        return x.shape
    checks.check_float_input(x, name)
    return tuple(jnp.shape(x))


def _check_quantized_contraction(x, contracting, name):
    """ValueError unless a pre-quantized operand (MXFP4Array, FP8Prepared, DecodePrepared) is
    contracted along its single quantized axis (the shared scales run along the contraction;
    OCP MX v1.0 §6.1). Float operands pass."""
    if not isinstance(x, _QUANTIZED) or (len(contracting) == 1 and contracting[0] == x.axis):
        return
    what = {DecodePrepared: "a DecodePrepared array", FP8Prepared: "an FP8Prepared array"}.get(type(x), "an MXFP4Array")
    raise ValueError(
        f"{name} is {what} quantized along axis {x.axis}, but its contracting dims are "
        f"{tuple(contracting)}: an MXFP4 operand must be quantized along its single contracting dim, i.e. "
        f"contracted along its single quantized axis (the shared scales run along the contraction; OCP MX "
        f"v1.0 §6.1)"
    )


def _operand_kinds(lhs, rhs, recipe: Recipe) -> tuple[str, str]:
    """"mxfp4" (pre-quantized), "quantized" (float, quantized here) or "float" (kept: w4a16)."""
    lq, rq = isinstance(lhs, _QUANTIZED), isinstance(rhs, _QUANTIZED)
    lk, rk = ("mxfp4" if lq else "quantized"), ("mxfp4" if rq else "quantized")
    if not recipe.quantize_activations:
        if rq and not lq:
            lk = "float"
        elif lq and not rq:
            rk = "float"
        elif not lq and not rq:
            lk = "float"  # lhs is the activation, rhs the weight
    return lk, rk


def _to_canonical(x, contracting, batch, recipe: Recipe, kind: str, name):
    """Operand -> MXFP4Array [B, F, K] quantized along axis 2 with plain scales, or, for
    ``kind == "float"``, the float array as [B, F, K] (:func:`jax_mxfp4.dims.to_bfk`); an
    :class:`jax_mxfp4.FP8Prepared` operand stays prepared ([B, F, K], see :mod:`jax_mxfp4.fp8_prepared`), as
    does a :class:`jax_mxfp4.DecodePrepared` ([B, F, K], see :mod:`jax_mxfp4.decode_prepared`)."""
    if isinstance(x, DecodePrepared):
        return decode_canonical(x, contracting, batch)
    if isinstance(x, FP8Prepared):
        return fp8_canonical(x, contracting, batch)
    if isinstance(x, MXFP4Array):
        k = x.shape[x.axis]
        data = dims.to_bfk(x.data, contracting, batch, name, logical_k=k)
        scales = dims.to_bfk(x.plain_scales(), contracting, batch, name, logical_k=k)
        return MXFP4Array(data, scales, 2, data.shape[:2] + (k,), x.dtype, x.scale_mode, "plain")
    x3 = dims.to_bfk(x, contracting, batch, name)
    return x3 if kind == "float" else quantize(x3, 2, scale_mode=recipe.scale_mode)


def match_rotation(lhs, rhs, dimension_numbers):
    """(lhs, rhs) with a float operand facing a rotated MXFP4Array rotated the same way.

    An :class:`MXFP4Array` (or a :class:`jax_mxfp4.DecodePrepared`/:class:`jax_mxfp4.FP8Prepared`) whose ``hadamard`` is
    ``(block, seed)`` holds values rotated along its axis; the float operand is rotated along its
    (single) contracting dim with the same transform (float32 result; ``jax.ShapeDtypeStruct``s
    become float32 structs), so the product is that of the unrotated operands. Shapes that do
    not match are left for the later checks to report.

    Raises:
      ValueError: both operands are MXFP4Arrays recording different rotations.
    """
    lq, rq = isinstance(lhs, _ROTATABLE), isinstance(rhs, _ROTATABLE)
    lh, rh = (lhs.hadamard if lq else None), (rhs.hadamard if rq else None)
    if lq and rq:
        if lh != rh:
            raise ValueError(
                f"lhs and rhs are MXFP4Arrays with different Hadamard rotations (lhs.hadamard={lh}, "
                f"rhs.hadamard={rh}): their product is only the product of the unrotated values when "
                "both were rotated with the same (block, seed)"
            )
        return lhs, rhs
    if lh is None and rh is None:
        return lhs, rhs
    try:
        (lc, rc), _ = dimension_numbers
    except (TypeError, ValueError):
        return lhs, rhs  # malformed: reported by the dimension checks

    def rotate(x, contracting, mx, h):
        contracting = tuple(contracting) if isinstance(contracting, (tuple, list)) else (contracting,)
        if len(contracting) != 1 or not hasattr(x, "shape"):
            return x
        ax = int(contracting[0]) % max(1, len(x.shape))
        if x.shape[ax] != mx.shape[mx.axis] or x.shape[ax] % h[0]:
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, jnp.float32)
        return random_hadamard_transform(x, ax, h[1], h[0])

    if rh is not None:
        lhs = rotate(lhs, lc, rhs, rh)
    if lh is not None:
        rhs = rotate(rhs, rc, lhs, lh)
    return lhs, rhs


@dataclasses.dataclass(frozen=True)
class GemmPlan:
    """One GEMM validated and dispatched once (:func:`plan`), run by :func:`execute`.

    ``recipe``: the validated :class:`jax_mxfp4.Recipe`; ``dims``: normalized ``(lc, rc, lb, rb)``;
    ``problem``: the canonical :class:`jax_mxfp4.backends.base.GemmProblem`; ``out_shape``: the
    logical output shape; ``backends``: ``(platform, backend)`` pairs staged per platform
    ("default": any platform not listed); ``decision``: the full
    :class:`jax_mxfp4.dispatch.Decision` (what :func:`explain` returns; not part of the hash).
    Hashable, so it passes through ``jax.custom_vjp`` as a static argument."""

    recipe: Recipe
    dims: tuple
    problem: GemmProblem
    out_shape: tuple
    backends: tuple
    decision: dispatch.Decision = dataclasses.field(compare=False, hash=False, repr=False)

    @property
    def backend_here(self) -> str:
        """The backend this process's platform runs."""
        table = dict(self.backends)
        return table.get(self.problem.platform, table["default"])

    def with_out_dtype(self, dtype) -> "GemmPlan":
        """The same plan writing ``dtype`` (no backend's choice depends on the output dtype)."""
        return dataclasses.replace(self, problem=dataclasses.replace(self.problem, out_dtype=jnp.dtype(dtype)))


def plan(lhs, rhs, dimension_numbers, preferred_element_type, recipe: Recipe, precision=None) -> GemmPlan:
    """Validate one GEMM and choose its backend per platform, once.

    ``lhs``/``rhs``: float arrays, ``jax.ShapeDtypeStruct``s or quantized operands as
    :func:`dot_general` takes them, after :func:`match_rotation`; ``recipe``: an already validated
    :class:`jax_mxfp4.Recipe` (the public entry points validate it). Raises what
    :func:`dot_general` raises for bad arguments or an unavailable backend."""
    precision = checks.stricter_precision(checks.canonical_precision(precision), recipe.precision)
    lshape, rshape = _logical_shape(lhs, "lhs"), _logical_shape(rhs, "rhs")
    out_dtype = checks.dot_output_dtype(preferred_element_type, lhs.dtype, rhs.dtype)
    lc, rc, lb, rb, out_shape = dims.parse_dimension_numbers(dimension_numbers, lshape, rshape)
    batch, m, k = dims.canonical_sizes(lshape, lc, lb)
    n = dims.canonical_sizes(rshape, rc, rb)[1]
    _check_quantized_contraction(lhs, lc, "lhs")
    _check_quantized_contraction(rhs, rc, "rhs")
    dims.check_block_k(k, lc)
    lk, rk = _operand_kinds(lhs, rhs, recipe)
    problem = GemmProblem(
        batch=batch, m=m, n=n, k=k, out_dtype=out_dtype, scale_layout=recipe.scale_layout,
        platform=dispatch.current_platform(), lhs_kind=lk, rhs_kind=rk,
        lhs_dtype=jnp.dtype(lhs.dtype), rhs_dtype=jnp.dtype(rhs.dtype), precision=precision,
        lhs_decode_prepared=order_of(lhs), rhs_decode_prepared=order_of(rhs),
    )
    decision = dispatch.plan(problem, recipe.backend)
    return GemmPlan(recipe, (lc, rc, lb, rb), problem, out_shape, tuple(decision.per_platform.items()), decision)


def abstract(x):
    """A float operand as its ``jax.ShapeDtypeStruct`` (planning needs no values); quantized
    operands and structs as they are."""
    if isinstance(x, _QUANTIZED) or isinstance(x, jax.ShapeDtypeStruct) or not hasattr(x, "shape"):
        return x
    return jax.ShapeDtypeStruct(jnp.shape(x), x.dtype)


def _run(a, b, backend_name: str, problem: GemmProblem, platforms=None):
    if backend_name != "fp8":  # other backends take the exact MXFP4Array round trip
        a, b = (v.to_mxfp4() if isinstance(v, FP8Prepared) else v for v in (a, b))
    backend = dispatch.get_backend(backend_name)
    # a DecodePrepared stays as stored only where the backend's route reads it so (the pallas
    # backend's Mosaic GPU route); elsewhere the exact MXFP4Array round trip (a scales transpose)
    keep = backend.takes_decode_prepared(problem)
    a, b = (v.to_mxfp4() if isinstance(v, DecodePrepared) and not k else v for v, k in zip((a, b), keep))
    problem = dataclasses.replace(problem, lhs_decode_prepared=order_of(a), rhs_decode_prepared=order_of(b))
    if backend.opaque or platforms is not None:  # another platform's branch: traced when lowered for it
        # the partitioned primitive carries MXFP4Arrays (the backend re-encodes an FP8 operand)
        a, b = (v.to_mxfp4() if isinstance(v, FP8Prepared) else v for v in (a, b))
        return partitioned_gemm(a, b, backend_name, problem, platforms, partition=backend.opaque)
    return backend.gemm(a, b, problem)


def _staged_gemm(a, b, problem: GemmProblem, per_platform: dict):
    """The canonical GEMM through each platform's backend (``dispatch.plan``): one
    ``lax.platform_dependent`` branch per distinct backend, serving the platforms that chose it
    (any other platform: ``default``, this platform's choice); a single backend is called
    directly (no conditional is staged). The branches of other platforms than this one are
    deferred (:func:`jax_mxfp4.partitioning.partitioned_gemm`): traced only when the program is
    lowered for one of them, so a program compiled here never traces their kernels."""
    default = per_platform["default"]
    if len(set(per_platform.values())) == 1:
        return _run(a, b, default, problem)
    listed = {p: name for p, name in per_platform.items() if p != "default"}
    served: dict[str, list] = {}
    for p, name in listed.items():
        served.setdefault(name, []).append(p)
    branches = {}
    for name, plats in served.items():
        here = problem.platform if problem.platform in plats else plats[0]
        p_problem = dataclasses.replace(problem, platform=here)
        # The default branch also serves unlisted platforms: it is not narrowed.
        narrow = None if name == default else tuple(plats)
        branches[name] = functools.partial(_run, backend_name=name, problem=p_problem, platforms=narrow)
    if default not in branches:
        branches[default] = functools.partial(_run, backend_name=default, problem=problem)
    return jax.lax.platform_dependent(
        a, b, default=branches[default], **{p: branches[name] for p, name in listed.items()})


def dot_general(
    lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, *, out_sharding=None, recipe=None
):
    """MXFP4 ``jax.lax.dot_general``: same signature, operands quantized to MXFP4 along K.

    Args:
      lhs, rhs: each an :class:`MXFP4Array` quantized along its single contracting dim, or a
        float32/bfloat16/float16 array, quantized on the fly along its contracting dim(s) with
        ``recipe.scale_mode`` (several contracting dims are flattened, row-major, into one K).
        A float operand facing an MXFP4Array that records a Hadamard rotation
        (``MXFP4Array.hadamard``) is first rotated the same way (:func:`match_rotation`).
        With ``Recipe(quantize_activations=False)`` a float operand facing an MXFP4Array is not
        quantized (w4a16); see :class:`jax_mxfp4.Recipe`.
      dimension_numbers: ``((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch))`` as in
        ``jax.lax.dot_general``; any NN/NT/TN/TT arrangement and batch dims.
      precision: the numerics contract (README "FP8 path"); the stricter of it and
        ``recipe.precision`` counts. None/``DEFAULT``: backend "fp8" may run the GEMM on FP8
        tensor cores with hardware accumulation; ``HIGH``: FP8 with fast accumulation off;
        ``HIGHEST``: exact block products and float32 accumulation (every other backend).
        ``explain()`` states the contract in force.
      preferred_element_type: output dtype, float32, bfloat16 or float16; None (default): what
        ``lax.dot_general`` returns for the operands' (logical) dtypes (bfloat16 x bfloat16 ->
        bfloat16); accumulation is float32 either way.
      out_sharding: as in ``jax.lax.dot_general``: the output's sharding (a ``NamedSharding`` or,
        inside ``jax.set_mesh``, a ``PartitionSpec``). By default, under an explicit-sharding mesh
        the output is sharded like the operands' batch and free dims, and a sharded contracting
        dim is reduced (all-reduce) — each K shard must hold whole 32-element blocks.
      recipe: :class:`jax_mxfp4.Recipe` (scale rule, scale layout, backend); default ``Recipe()``.

    Returns:
      Array of ``lax.dot_general``'s output shape (batch dims, lhs free dims, rhs free dims).

    Raises:
      ValueError: malformed ``dimension_numbers``; total contracting length not a multiple of 32;
        an MXFP4Array, FP8Prepared or DecodePrepared not quantized along its single contracting
        dim; a prepared operand batched by ``vmap``/``scan`` (not supported); unsupported output
        dtype; two MXFP4Arrays recording different Hadamard rotations.
      TypeError: an operand that is neither an MXFP4Array nor a float array; shape mismatches
        (from ``lax.dot_general``'s shape rule).
      BackendUnavailableError: the backend named by the recipe or ``JAX_MXFP4_BACKEND`` cannot
        run this GEMM.
    """
    recipe = dims.check_recipe(recipe)
    lhs, rhs = match_rotation(lhs, rhs, dimension_numbers)
    p = plan(abstract(lhs), abstract(rhs), dimension_numbers, preferred_element_type, recipe, precision)
    return execute(lhs, rhs, p, out_sharding=out_sharding)


def execute(lhs, rhs, p: GemmPlan, *, out_sharding=None):
    """Run the GEMM ``p`` (:func:`plan`) on ``lhs``/``rhs``: operands of the logical shapes and
    dtypes it was planned for, already rotated (:func:`match_rotation`); a float operand planned
    to be quantized may come quantized already (same axis, same bits: the training passes hand
    in their own quantized operands)."""
    (lc, rc, lb, rb), problem = p.dims, p.problem
    a = _to_canonical(lhs, lc, lb, p.recipe, problem.lhs_kind, "lhs")
    b = _to_canonical(rhs, rc, rb, p.recipe, problem.rhs_kind, "rhs")
    if 0 in (problem.batch, problem.m, problem.n, problem.k):  # empty operands: an exact zero sum
        out = jnp.zeros((problem.batch, problem.m, problem.n), problem.out_dtype)
    else:
        out = _staged_gemm(a, b, problem, dict(p.backends))

    def leaf(v):  # an array of the operand's logical rank and shardings (to_logical reads both)
        if isinstance(v, DecodePrepared):  # rank only, unless a mesh needs the permuted shardings
            explicit = sharding.explicit_spec(v.data) is not None
            return jnp.moveaxis(v.data, -1, v.axis) if explicit else v.data
        if isinstance(v, FP8Prepared):
            return jnp.moveaxis(v.codes, -1, v.axis)
        return v.data if isinstance(v, MXFP4Array) else v

    out = dims.to_logical(out, p.out_shape, leaf(lhs), leaf(rhs), lc, rc, lb, rb)
    return out if out_sharding is None else jax.sharding.reshard(out, out_sharding)


def explain(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, *, recipe=None):
    """Which backend :func:`dot_general` would use for these operands, and why not the others.

    Takes the same arguments as :func:`dot_general` (arrays, MXFP4Arrays or
    ``jax.ShapeDtypeStruct``s); computes nothing. Returns a :class:`jax_mxfp4.dispatch.Decision`
    whose ``str()`` is a readable report; ``.backend`` is the chosen name, ``.reasons`` maps every
    registered backend to why it was not chosen. Raises what :func:`dot_general` would raise.
    """
    lhs, rhs = match_rotation(lhs, rhs, dimension_numbers)
    return plan(lhs, rhs, dimension_numbers, preferred_element_type, dims.check_recipe(recipe), precision).decision
