"""MXFP4 ``ragged_dot``: the grouped GEMMs of mixture-of-experts layers, differentiable.

Drop-ins for ``jax.lax.ragged_dot`` and ``jax.lax.ragged_dot_general`` where the expert weights
(and, by default, the activations) are MXFP4 (OCP MX v1.0: E2M1 elements, one E8M0 scale per 32
along the contraction). The caller sorts its tokens by expert and passes ``group_sizes``, as with
``lax.ragged_dot``: rows ``start_g .. start_g + size_g - 1`` of the lhs are multiplied by expert g;
rows past ``sum(group_sizes)`` give zeros.

Forms of ``ragged_dot_general`` (``jax.lax.RaggedDotDimensionNumbers``; no batch dims):

* **ragged rows** (fprop; dgrad): lhs [M, K] ragged along M (``lhs_ragged_dimensions=[0]``,
  contracting dim 1), rhs with group dim 0, [G, K, N] (contracting dim 1, ``lax.ragged_dot``'s
  layout) or [G, N, K] (contracting dim 2: gpt-oss's expert storage, and the form of dgrad,
  dY [M, N] against the experts [G, K, N] contracted along N) -> [M, N] (resp. [M, K]).
* **ragged contracting** (wgrad): lhs [M, K] and rhs [M, N], both contracted along their ragged
  dim 0, no group dim -> [G, K, N] (each group's X_gᵀ·Y_g), G = ``len(group_sizes)``. Both
  operands are quantized along M within each group (:mod:`jax_mxfp4.group_blocks`).

**Numerics.** Operands are quantized (:func:`jax_mxfp4.quantize`, the recipe's scale rule,
round-to-nearest-even) or taken as given (an :class:`MXFP4Array`), decoded exactly, and
multiplied by ``lax.ragged_dot_general`` with float32 accumulation. Two routes
(:func:`explain_ragged_dot` says which one runs and why): "exact" decodes to float32 and
contracts with ``Precision.HIGHEST`` (every platform; the reference); "bf16-decode" decodes to
bfloat16 (exact: an E2M1 value times a power of two has at most 2 significant bits) and runs
``lax.ragged_dot_general`` on bfloat16 with float32 accumulation (bfloat16 products are exact in
float32): the same values up to the order of float32 accumulation. "auto" takes "bf16-decode" on
CUDA and ROCm GPUs where every operand is exact in bfloat16 (a float activation kept by w4a16 must
be bfloat16), "exact" elsewhere; the choice is staged per platform (``lax.platform_dependent``).
Native rhs storage: both [G, K, N] and [G, N, K] are contracted as stored on both routes (XLA's
ragged dot takes either contracting dim; no transpose is materialized by this module).
On ROCm gfx950, "auto" takes "hipblaslt-grouped" where it fits (:mod:`jax_mxfp4.backends.hipblaslt_ragged`:
hipBLASLt's MXFP4 GEMM per group on a capacity-padded layout, ``Recipe.ragged_capacity``).

**Training** (custom VJP; the recipe of :func:`jax_mxfp4.dot_general`, :mod:`jax_mxfp4.training`):
for Y = ragged_dot(X, W) with X [M, K], W [G, K, N] (or [G, N, K]) and cotangent dY [M, N]:

* fprop: X and W quantized along K (``Recipe.quantize_activations=False``: X kept, w4a16);
* dgrad dX = ragged_dot(dY, Wᵀ): dY and W quantized along N (N zero-padded to a multiple of 32),
  dY with ``Recipe.grad_rounding``;
* wgrad dW_g = X_gᵀ·dY_g: X and dY quantized along the token axis within each group, blocks of
  32 rows starting at each group's first row, a partial last block padded with zeros
  (:mod:`jax_mxfp4.group_blocks`), dY with ``Recipe.grad_rounding``.

``Recipe.fprop/dgrad/wgrad = "bf16"`` runs that pass on bfloat16 casts. Stochastic rounding keys
as for dense layers (:func:`jax_mxfp4.training.rounding_key`): ``fold_in(key, 1)`` for dgrad and
``fold_in(key, 2)`` for wgrad with a caller's ``key``, else the data-derived key of dY
(:func:`jax_mxfp4.training.gradient_key`) with the call site ``crc32(repr(("ragged_dot",
lhs.shape, rhs.shape, lhs dtype, rhs dtype, form, rhs contracting dim))) & 0x7FFFFFFF``. The
quantizers are straight-through: the backward passes are differentiated as the exact float32
products they approximate (second derivatives through dgrad work; through wgrad JAX raises
NotImplementedError: ``lax`` has no transpose of the ragged-contracting form). A gradient with
respect to an MXFP4Array operand raises (as :func:`jax_mxfp4.dot_general`); an undifferentiated
operand's gradient pass is skipped.

**Checks.** Shapes, dtypes, dimension numbers and the recipe are checked when traced. The values
of ``group_sizes`` (sizes >= 0, sum <= M) are checked eagerly when they are concrete; under
``jit`` they are not known, and an invalid ``group_sizes`` makes the output (and the gradients)
all NaN instead of a silently wrong result.

**Non-finite weights.** XLA's CPU ragged dot (the "exact" route on CPU, as ``jax.lax.ragged_dot``
there) multiplies every row by every expert and masks the result: a NaN or Inf anywhere in an
expert's weights, used or not, makes that output column NaN for every row, as ``lax.ragged_dot``
itself does on CPU.

**Meshes.** Under ``jit`` on an Auto mesh XLA partitions the ragged dot (e.g. experts sharded
on G, tokens on M). On an Explicit mesh the call runs with the mesh axes Auto inside
(``jax.sharding.auto_axes``: ``lax.ragged_dot_general`` infers no output sharding there) and
returns [M, N] sharded as lhs's M and rhs's N.

Not supported (ValueError): ``group_offset``; Hadamard rotations (``Recipe.hadamard`` naming an
MXFP4 pass, or an MXFP4Array recording one); batch dims and ragged-batch forms; MXFP4Array
operands in the ragged-contracting form (their blocks would have to follow the groups).
``Recipe.backend`` must be "auto" or "xla" (the exact route).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import checks, dims, group_blocks
from .backends import grouped, hipblaslt_ragged
from .kernels.grouped_wgemm import slots as grouped_slots
from . import sharding as shd
from .array import MXFP4Array
from .differentiation import straight_through
from .dispatch import current_platform
from .errors import BackendUnavailableError
from .gemm import _operand_kinds
from .hadamard import site_seed
from .quantize import quantize
from .recipe import Recipe
from .training import DGRAD_TAG, WGRAD_TAG, _materialize, _pad_axis, rounding_key

EXACT, BF16, GROUPED = "exact", "bf16-decode", "grouped-kernel"
ROWS, CONTRACTING = "ragged rows", "ragged contracting"
GPU_PLATFORMS = ("cuda", "rocm")
EXPLAIN_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
_F32 = jnp.dtype(jnp.float32)
_BF16 = jnp.dtype(jnp.bfloat16)


def _rdn(lhs_contracting, rhs_contracting, rhs_group):
    return lax.RaggedDotDimensionNumbers(((lhs_contracting, rhs_contracting), ((), ())), (0,), rhs_group)


def _rows_dn(rhs_k_axis: int):
    """lhs [M, K] ragged along M, rhs [G, ., .] contracted along ``rhs_k_axis``."""
    return _rdn((1,), (rhs_k_axis,), (0,))


_CONTRACTING_DN = _rdn((0,), (0,), ())
_RAGGED_DOT_DN = _rows_dn(1)


# ----------------------------------------------------------------------------- forms and checks
class _Form(NamedTuple):
    kind: str  # ROWS or CONTRACTING
    rhs_k_axis: int  # the rhs contracting dim: 1 ([G, K, N]) or 2 ([G, N, K]); 0 for CONTRACTING


def _form_of(ragged_dot_dimension_numbers, lhs_ndim: int, rhs_ndim: int) -> _Form:
    """The supported form named by ``ragged_dot_dimension_numbers``, else ValueError naming it."""
    rdn = ragged_dot_dimension_numbers
    try:
        (lc, rc), (lb, rb) = rdn.dot_dimension_numbers
        lc, lb, ragged = (tuple(int(d) % max(lhs_ndim, 1) for d in t) for t in (lc, lb, rdn.lhs_ragged_dimensions))
        rc, rb, group = (tuple(int(d) % max(rhs_ndim, 1) for d in t) for t in (rc, rb, rdn.rhs_group_dimensions))
    except (AttributeError, TypeError, ValueError):
        raise TypeError("ragged_dot_dimension_numbers must be a jax.lax.RaggedDotDimensionNumbers, got "
                        f"{ragged_dot_dimension_numbers!r}") from None
    desc = (f"(lhs rank {lhs_ndim}, rhs rank {rhs_ndim}, contracting {lc}/{rc}, batch {lb}/{rb}, "
            f"lhs ragged {ragged}, rhs group {group})")
    supported = (
        "jax_mxfp4.ragged_dot_general supports, without batch dims: ragged rows (lhs [M, K] ragged along "
        "dim 0 and contracted along dim 1; rhs [G, K, N] or [G, N, K] with group dim 0, contracted along "
        "dim 1 or 2) and ragged contracting (lhs [M, K] and rhs [M, N], both contracted along their ragged "
        "dim 0, no rhs group dim)")
    if lb or rb:
        raise ValueError(f"ragged_dot_dimension_numbers {desc}: batch dims (incl. the ragged-batch form) are "
                         f"not supported; {supported}")
    if lhs_ndim == 2 and ragged == (0,) and lc == (1,) and group == (0,) and rhs_ndim == 3 and rc in ((1,), (2,)):
        return _Form(ROWS, rc[0])
    if lhs_ndim == 2 and ragged == (0,) and lc == (0,) and rc == (0,) and group == () and rhs_ndim == 2:
        return _Form(CONTRACTING, 0)
    raise ValueError(f"ragged_dot_dimension_numbers {desc} is not a supported form: {supported}")


def _check_operand(x, name):
    if isinstance(x, MXFP4Array):
        if x.hadamard is not None:
            raise ValueError(f"{name} is an MXFP4Array recording a Hadamard rotation {x.hadamard}: "
                             "jax_mxfp4.ragged_dot does not support rotated operands")
        return
    if hasattr(x, "to_mxfp4"):  # FP8Prepared / DecodePrepared: dense-GEMM forms
        raise TypeError(f"{name} is a {type(x).__name__} (a form prepared for dense GEMMs): pass {name}.to_mxfp4()")
    checks.check_float_input(x, name)


def _check_group_sizes(group_sizes, g: int | None, m: int):
    """Static checks of ``group_sizes`` (integer, rank 1, G entries); its values where concrete.
    Returns (group_sizes as int32, whether its values were checked here)."""
    dtype = getattr(group_sizes, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"group_sizes must be an integer array (int32, as for jax.lax.ragged_dot), got "
                        f"{type(group_sizes).__name__} with dtype {dtype}")
    if jnp.ndim(group_sizes) != 1:
        raise ValueError(f"group_sizes must have rank 1 ([G], one size per group), got shape {jnp.shape(group_sizes)}")
    n = jnp.shape(group_sizes)[0]
    if g is not None and n != g:
        raise ValueError(f"group_sizes has {n} entries but rhs has G={g} groups (its dim 0): they must match")
    if n == 0:
        raise ValueError("group_sizes is empty: a ragged dot needs at least one group")
    concrete = isinstance(group_sizes, (np.ndarray, jax.Array)) and not isinstance(group_sizes, jax.core.Tracer)
    if concrete:
        v = np.asarray(group_sizes).astype(np.int64)
        if (v < 0).any():
            raise ValueError(f"group_sizes must be >= 0, got negative sizes at groups {np.flatnonzero(v < 0).tolist()}")
        if v.sum() > m:
            raise ValueError(f"group_sizes sum to {int(v.sum())}, more than the M={m} rows of lhs (its ragged dim 0): "
                             "the groups must fit in the rows (sum(group_sizes) <= M; rows past the sum give zeros)")
    if isinstance(group_sizes, jax.ShapeDtypeStruct):  # explain_ragged_dot's abstract arguments
        return group_sizes, False
    return jnp.asarray(group_sizes).astype(jnp.int32), concrete


def _check_shapes(lhs, rhs, form: _Form):
    if len(lhs.shape) != 2:
        raise ValueError(f"lhs must be 2-D, got shape {tuple(lhs.shape)}")
    m, k = lhs.shape
    if form.kind == ROWS:
        g, rk = rhs.shape[0], rhs.shape[form.rhs_k_axis]
        if rk != k:
            layout = "[G, K, N]" if form.rhs_k_axis == 1 else "[G, N, K]"
            raise ValueError(f"lhs [M, K] has K={k} but rhs {layout} {tuple(rhs.shape)} has K={rk} (its dim "
                             f"{form.rhs_k_axis}): the contracting lengths must match")
        dims.check_block_k(k, (1,))
        for name, x, axis in (("lhs", lhs, 1), ("rhs", rhs, form.rhs_k_axis)):
            if isinstance(x, MXFP4Array) and x.axis != axis:
                raise ValueError(
                    f"{name} is an MXFP4Array quantized along axis {x.axis}, but it is contracted along axis {axis}: "
                    "an MXFP4 operand must be quantized along its contracting dim (the shared scales run along "
                    "the contraction; OCP MX v1.0 §6.1)")
        return m, g
    if rhs.shape[0] != m:
        raise ValueError(f"ragged contracting form: lhs [M, K] has M={m} rows but rhs [M, N] has {rhs.shape[0]}")
    for name, x in (("lhs", lhs), ("rhs", rhs)):
        if isinstance(x, MXFP4Array):
            raise ValueError(f"{name} is an MXFP4Array: the ragged contracting form takes float operands only "
                             "(they are quantized along M within each group, blocks that follow group_sizes)")
    return m, None


def _check_recipe(recipe, precision) -> Recipe:
    recipe = dims.check_recipe(recipe)
    checks.canonical_precision(precision)  # validated; both routes keep exact products (any contract)
    rotated = [p for p in recipe.hadamard_passes if getattr(recipe, p) == "mxfp4"]
    if rotated:
        raise ValueError(f"Recipe.hadamard={recipe.hadamard!r}: jax_mxfp4.ragged_dot does not support Hadamard "
                         f"rotations (pass(es) {tuple(rotated)}); use a recipe with hadamard=False")
    if recipe.backend not in ("auto", "xla"):
        raise BackendUnavailableError(
            f"Recipe.backend={recipe.backend!r}: jax_mxfp4.ragged_dot runs on its own routes, chosen by "
            "Recipe.backend='auto' (see explain_ragged_dot) or forced to the exact reference by 'xla'")
    return recipe


# ----------------------------------------------------------------------------- routes
class RaggedRoute(NamedTuple):
    """What :func:`explain_ragged_dot` returns: ``route`` ("exact", "bf16-decode" or
    "hipblaslt-grouped") on ``platform``,
    and ``reason``, why."""

    route: str
    reason: str
    platform: str


def _route(platform: str, recipe: Recipe, bf16_exact: bool, rows: tuple[int, int] | None = None,
           rocm_why: str | None = None) -> RaggedRoute:
    """The one routing rule (:func:`explain_ragged_dot`). ``rows``: (M, G) of a ragged-rows product
    whose rhs is MXFP4 (the CUDA grouped kernel's case), else None; ``rocm_why``:
    :func:`hipblaslt_ragged.judge`'s answer (None: no candidate, "": taken, else why not)."""
    if rocm_why == "":
        return RaggedRoute(hipblaslt_ragged.GROUPED, hipblaslt_ragged.reason(recipe.ragged_capacity is not None),
                           platform)
    route = _portable_route(platform, recipe, bf16_exact, rows)
    return route._replace(reason=f"{route.reason}; not {hipblaslt_ragged.GROUPED}: {rocm_why}") if rocm_why else route


def _portable_route(platform: str, recipe: Recipe, bf16_exact: bool, rows) -> RaggedRoute:
    if recipe.backend == "xla":
        return RaggedRoute(EXACT, "Recipe.backend='xla': the exact float32 reference", platform)
    if platform not in GPU_PLATFORMS:
        return RaggedRoute(EXACT, f"on {platform}: operands decoded to float32, ragged dot with Precision.HIGHEST",
                           platform)
    if not bf16_exact:
        return RaggedRoute(EXACT, "a float operand kept as is (w4a16) is not bfloat16, so not exact in bfloat16: "
                           "float32 ragged dot with Precision.HIGHEST", platform)
    why_not = grouped.why_not(platform) if rows else "the grouped kernel takes ragged rows with MXFP4 experts"
    if not why_not:
        return RaggedRoute(GROUPED, f"on {platform}, {rows[0]} rows over {rows[1]} experts: the grouped kernel reads "
                           "each used expert's packed weights and decodes them in registers, each row meeting only "
                           "its own expert (exact products, float32 accumulation; accumulation order may differ)",
                           platform)
    return RaggedRoute(BF16, f"on {platform}: MXFP4 operands decoded exactly to bfloat16, bfloat16 ragged dot "
                       f"with float32 accumulation (the exact products; accumulation order may differ); {why_not}",
                       platform)


def _decode(x, dtype):
    return x.dequantize(dtype) if isinstance(x, MXFP4Array) else x.astype(dtype)


def _product_on(route: str, a, b, group_sizes, dn, recipe=None):
    """The product on ``route``, float32 result: a grouped kernel or GEMM, or
    lax.ragged_dot_general of the decoded operands."""
    if route == GROUPED:
        return grouped.grouped_product(a, b, group_sizes, dn.dot_dimension_numbers[0][1][0])
    if route == hipblaslt_ragged.GROUPED:
        return hipblaslt_ragged.product(a, b, group_sizes, recipe)
    if route == EXACT:
        return lax.ragged_dot_general(_decode(a, _F32), _decode(b, _F32), group_sizes, dn,
                                      precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    b, group_sizes = _experts_with_rows(b, group_sizes, dn, a.shape[0])
    return lax.ragged_dot_general(_decode(a, _BF16), _decode(b, _BF16), group_sizes, dn,
                                  preferred_element_type=jnp.float32)


def _experts_with_rows(b, group_sizes, dn, m: int):
    """With fewer rows than experts (decode sizes), only the experts that have rows: at most ``m``
    of the G groups are non-empty, so their packed weights are gathered (in group order, padded
    with empty groups) before the decode, which then writes m experts' bfloat16 values instead of
    all G. The product is unchanged: the same rows meet the same experts in the same order."""
    if not (isinstance(b, MXFP4Array) and tuple(dn.rhs_group_dimensions) == (0,) and m < b.shape[0]):
        return b, group_sizes
    table = grouped_slots(group_sizes, m)  # the non-empty groups in order, as the grouped kernel takes them
    idx, sizes = table[0], table[2].astype(group_sizes.dtype)
    scales = b.plain_scales()
    used = MXFP4Array(jnp.take(b.data, idx, axis=0), jnp.take(scales, idx, axis=0), b.axis, (m,) + tuple(b.shape[1:]),
                      b.dtype, b.scale_mode, "plain", b.hadamard)
    return used, sizes


def _fprop_kinds(lhs, rhs, recipe: Recipe) -> tuple[str, str]:
    """How the forward takes each operand: "mxfp4" (an MXFP4Array), "quantized" (float, quantized
    along K), "float" (kept as is: w4a16, :func:`jax_mxfp4.gemm._operand_kinds`'s rule) or "bf16"
    (``Recipe.fprop="bf16"`` with two float operands: both cast to bfloat16, as in dense layers)."""
    if recipe.fprop == "bf16" and not any(isinstance(x, MXFP4Array) for x in (lhs, rhs)):
        return "bf16", "bf16"
    return _operand_kinds(lhs, rhs, recipe)


def _exact_in_bf16(kinds, dtypes) -> bool:
    """Whether every operand, as the forward takes it, is exact in bfloat16 (MXFP4 values always;
    a kept float operand only if it is bfloat16)."""
    return all(k != "float" or jnp.dtype(d) == _BF16 for k, d in zip(kinds, dtypes))


def _grouped_rows(a, b, dn) -> tuple[int, int] | None:
    """(M, G) when the product is ragged rows against MXFP4 experts quantized along their
    contracting dim (what the grouped kernel takes), else None."""
    (_, rc), _ = dn.dot_dimension_numbers
    if isinstance(b, MXFP4Array) and tuple(dn.rhs_group_dimensions) == (0,) and b.axis == rc[0]:
        return a.shape[0], b.shape[0]
    return None


def _product(a, b, group_sizes, dn, recipe: Recipe, exact16: bool = True):
    """The product on each platform's route (:func:`_route`), staged per platform where they differ."""
    rows = _grouped_rows(a, b, dn)
    mx = all(isinstance(x, MXFP4Array) for x in (a, b))
    routes = {p: _route(p, recipe, exact16, rows, hipblaslt_ragged.judge(p, a.shape, b.shape, dn, mx, recipe)).route
              for p in GPU_PLATFORMS}
    if all(r == EXACT for r in routes.values()):
        return _product_on(EXACT, a, b, group_sizes, dn)
    branches = {p: functools.partial(_product_on, r, dn=dn, recipe=recipe) for p, r in routes.items()}
    return lax.platform_dependent(a, b, group_sizes, default=functools.partial(_product_on, EXACT, dn=dn), **branches)


def explain_ragged_dot(lhs, rhs, group_sizes, ragged_dot_dimension_numbers=None, preferred_element_type=None,
                       *, recipe=None, platform=None) -> RaggedRoute:
    """Which route :func:`ragged_dot_general` takes for these operands (forward pass), and why.

    Same arguments as :func:`ragged_dot_general` (arrays, MXFP4Arrays or ``jax.ShapeDtypeStruct``s;
    ``ragged_dot_dimension_numbers`` None: :func:`ragged_dot`'s); ``platform`` (default: JAX's
    default backend): "cpu", "cuda", "rocm" or "tpu", else ValueError. Computes nothing; raises
    what the call would.
    """
    if platform is not None and platform not in EXPLAIN_PLATFORMS:
        raise ValueError(f"platform must be None or one of {EXPLAIN_PLATFORMS} (JAX's platform names), got {platform!r}")
    rdn = _RAGGED_DOT_DN if ragged_dot_dimension_numbers is None else ragged_dot_dimension_numbers
    recipe = _check_recipe(recipe, None)
    form = _validate(lhs, rhs, group_sizes, rdn, preferred_element_type)[0]
    kinds = _fprop_kinds(lhs, rhs, recipe) if form.kind == ROWS else ("quantized", "quantized")
    platform = platform or current_platform()
    rows = (lhs.shape[0], rhs.shape[0]) if form.kind == ROWS and kinds[1] in ("mxfp4", "quantized") else None
    mx = form.kind == ROWS and all(k in ("mxfp4", "quantized") for k in kinds)
    return _route(platform, recipe, _exact_in_bf16(kinds, (lhs.dtype, rhs.dtype)), rows,
                  hipblaslt_ragged.judge(platform, lhs.shape, rhs.shape, rdn, mx, recipe))


# ----------------------------------------------------------------------------- the passes
@dataclasses.dataclass(frozen=True)
class _Static:
    """The static configuration of one call (hashable: a custom_vjp non-differentiable argument)."""

    recipe: Recipe
    out_dtype: object
    form: _Form
    site: int
    m: int
    poison: bool  # group_sizes not checked eagerly: an invalid one makes the results NaN
    lhs_dtype: object  # the gradients' dtypes
    rhs_dtype: object


def _poison(x, group_sizes, static: _Static):
    """All-NaN ``x`` when the traced ``group_sizes`` is invalid (sizes < 0, sum > M, or a size above
    ``Recipe.ragged_capacity``)."""
    if not static.poison:
        return x
    bad = jnp.any(group_sizes < 0) | (jnp.sum(group_sizes) > static.m)
    bad = bad | hipblaslt_ragged.overflows(group_sizes, static.recipe.ragged_capacity)
    return jnp.where(bad, jnp.asarray(jnp.nan, x.dtype), x)


def _fprop_rows(lhs, rhs, group_sizes, static: _Static):
    """Forward of the ragged-rows form: float32 [M, N]."""
    recipe, axis = static.recipe, static.form.rhs_k_axis
    kinds = _fprop_kinds(lhs, rhs, recipe)
    take = {"mxfp4": lambda x, _: x, "float": lambda x, _: x, "bf16": lambda x, _: x.astype(jnp.bfloat16),
            "quantized": lambda x, k_axis: quantize(x, k_axis, scale_mode=recipe.scale_mode)}
    a, b = (take[kind](x, k_axis) for kind, x, k_axis in zip(kinds, (lhs, rhs), (1, axis)))
    return _product(a, b, group_sizes, _rows_dn(axis), recipe, _exact_in_bf16(kinds, (lhs.dtype, rhs.dtype)))


def _contract_groups(x, y, group_sizes, recipe: Recipe, precision: str, rounding: str = "nearest", key=None):
    """[G, Fx, Fy] = per group x_gᵀ·y_g for x [M, Fx], y [M, Fy]: "bf16" on bfloat16 casts, "mxfp4"
    with both quantized along M within each group (y with ``rounding``/``key``)."""
    if precision == "bf16":
        sizes = group_blocks.clipped_sizes(group_sizes, x.shape[0])
        return _product(x.astype(jnp.bfloat16), y.astype(jnp.bfloat16), sizes, _CONTRACTING_DN, recipe)
    layout = group_blocks.block_layout(group_sizes, x.shape[0])
    xq = group_blocks.quantize_blocked(x, layout, scale_mode=recipe.scale_mode)
    yq = group_blocks.quantize_blocked(y, layout, scale_mode=recipe.scale_mode, rounding=rounding, key=key)
    return _product(xq, yq, layout.padded_sizes, _CONTRACTING_DN, recipe)


def _dgrad(dy, w, group_sizes, static: _Static, key):
    """dX [M, K] = ragged_dot(dY [M, N], Wᵀ): float32, contracted along N."""
    recipe = static.recipe
    n_axis = 3 - static.form.rhs_k_axis  # [G, K, N]: 2; [G, N, K]: 1
    dn = _rows_dn(n_axis)
    if recipe.dgrad == "bf16":
        return _product(dy.astype(jnp.bfloat16), w.astype(jnp.bfloat16), group_sizes, dn, recipe)
    sr = recipe.grad_rounding == "stochastic"
    gkey = rounding_key(key, dy, static.site, DGRAD_TAG) if sr else None
    dyq = quantize(_pad_axis(dy, 1), 1, scale_mode=recipe.scale_mode, rounding=recipe.grad_rounding, key=gkey)
    wq = quantize(_pad_axis(w, n_axis), n_axis, scale_mode=recipe.scale_mode)
    return _product(dyq, wq, group_sizes, dn, recipe)


def _wgrad(dy, x, group_sizes, static: _Static, key):
    """dW (float32) in the rhs's layout: [G, K, N] (or [G, N, K]) = per group X_gᵀ·dY_g."""
    recipe = static.recipe
    sr = recipe.wgrad == "mxfp4" and recipe.grad_rounding == "stochastic"
    gkey = rounding_key(key, dy, static.site, WGRAD_TAG) if sr else None
    out = _contract_groups(x, dy, group_sizes, recipe, recipe.wgrad, recipe.grad_rounding, gkey)
    return out if static.form.rhs_k_axis == 1 else jnp.swapaxes(out, 1, 2)


def _exact_rows(a, b, group_sizes, dn):
    return lax.ragged_dot_general(a, b, group_sizes, dn, precision=lax.Precision.HIGHEST,
                                  preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ragged_rows(static, lhs, rhs, group_sizes, key):
    return _fprop_rows(lhs, rhs, group_sizes, static).astype(static.out_dtype)


def _ragged_rows_fwd(static, lhs, rhs, group_sizes, key):
    values, perturbed = [], []
    for name, arg in (("lhs", lhs), ("rhs", rhs)):
        if isinstance(arg, MXFP4Array):
            if any(leaf.perturbed for leaf in jax.tree_util.tree_leaves(arg)):
                raise ValueError(
                    f"jax_mxfp4.ragged_dot: a gradient with respect to {name}, an MXFP4Array, was requested. "
                    "Pre-quantized MXFP4Arrays are for inference only (the 4-bit codes and E8M0 scales are not "
                    "differentiable); differentiate with respect to the float weights and let ragged_dot quantize "
                    "them, or close over the MXFP4Array so that only the float operand is differentiated")
            values.append(jax.tree_util.tree_map(lambda p: p.value, arg))
            perturbed.append(False)
        else:
            values.append(arg.value)
            perturbed.append(arg.perturbed)
    lhs_v, rhs_v = values
    gs, key_v = group_sizes.value, (key.value if key is not None else None)
    y = _ragged_rows(static, lhs_v, rhs_v, gs, key_v)
    # keep only what the requested gradients need: W for dX, X for dW
    return y, (rhs_v if perturbed[0] else None, lhs_v if perturbed[1] else None, gs, key_v)


def _ragged_rows_bwd(static, res, dy):
    w, x, group_sizes, key = res
    dy = _materialize(dy)
    n_axis = 3 - static.form.rhs_k_axis
    dx = dw = None
    if w is not None:
        wf = _decode(w, _F32) if isinstance(w, MXFP4Array) else w
        dgrad = straight_through(lambda args, k: _dgrad(*args, group_sizes, static, k),
                                 lambda args: _exact_rows(*args, group_sizes, _rows_dn(n_axis)))
        dx = _poison(dgrad((dy, wf), key), group_sizes, static).astype(static.lhs_dtype)
    if x is not None:
        xf = _decode(x, _F32) if isinstance(x, MXFP4Array) else x

        def exact_wgrad(args):
            out = _exact_rows(*args, group_sizes, _CONTRACTING_DN)
            return out if static.form.rhs_k_axis == 1 else jnp.swapaxes(out, 1, 2)

        wgrad = straight_through(lambda args, k: _wgrad(args[0], args[1], group_sizes, static, k), exact_wgrad)
        dw = _poison(wgrad((dy, xf), key), group_sizes, static).astype(static.rhs_dtype)
    return dx, dw, None, None


_ragged_rows.defvjp(_ragged_rows_fwd, _ragged_rows_bwd, symbolic_zeros=True)


def _contracting(lhs, rhs, group_sizes, static: _Static):
    """The public ragged-contracting form: [G, K, N], round-to-nearest for both operands (fprop's
    rule), differentiated as the exact float product (as jax.lax.ragged_dot_general is)."""
    recipe = static.recipe
    quantized = straight_through(
        lambda args, _: _contract_groups(*args, group_sizes, recipe, recipe.fprop),
        lambda args: _exact_rows(*args, group_sizes, _CONTRACTING_DN))
    return quantized((lhs, rhs), None).astype(static.out_dtype)


# ----------------------------------------------------------------------------- public API
def _validate(lhs, rhs, group_sizes, ragged_dot_dimension_numbers, preferred_element_type):
    """(form, M, group_sizes int32, checked eagerly, output dtype), raising on any bad argument."""
    _check_operand(lhs, "lhs")
    _check_operand(rhs, "rhs")
    form = _form_of(ragged_dot_dimension_numbers, len(lhs.shape), len(rhs.shape))
    m, g = _check_shapes(lhs, rhs, form)
    gs, concrete = _check_group_sizes(group_sizes, g, m)
    out_dtype = checks.dot_output_dtype(preferred_element_type, lhs.dtype, rhs.dtype)
    return form, m, gs, concrete, out_dtype


def ragged_dot_general(lhs, rhs, group_sizes, ragged_dot_dimension_numbers, precision=None,
                       preferred_element_type=None, group_offset=None, *, recipe=None, key=None):
    """MXFP4 ``jax.lax.ragged_dot_general`` (same arguments), differentiable.

    Supported forms (:mod:`jax_mxfp4.ragged`): ragged rows, lhs [M, K] x rhs [G, K, N] (contracting
    dims (1,)/(1,)) or [G, N, K] ((1,)/(2,)), rhs group dim 0 -> [M, N]; ragged contracting,
    lhs [M, K] x rhs [M, N] (contracting (0,)/(0,), no group dim) -> [G, K, N].
    Native rhs storage: [G, K, N] and [G, N, K] alike on every route (exact on CPU, bf16-decode on
    CUDA/ROCm): both are contracted as stored, without a transpose.

    Args:
      lhs: float32/bfloat16/float16 [M, K] (the tokens, sorted by group), or an
        :class:`MXFP4Array` quantized along K (axis 1); ragged contracting form: float only.
      rhs: ragged rows: the experts, float [G, K, N] / [G, N, K] (quantized per call along K by
        ``recipe``; ``jax_mxfp4.quantize``) or an MXFP4Array quantized along K (axis 1 of
        [G, K, N], axis 2 of [G, N, K]). Ragged contracting: float [M, N].
      group_sizes: integer [G] (int32 as for ``lax``): rows per group, in order; sizes >= 0 and
        ``sum(group_sizes) <= M``; rows past the sum give zeros (ragged rows) or count in no group.
      ragged_dot_dimension_numbers: a ``jax.lax.RaggedDotDimensionNumbers`` of a supported form.
      precision: accepted as in ``lax`` (validated); every route keeps exact block products with
        float32 accumulation, which satisfies any contract.
      preferred_element_type: output dtype (float32, bfloat16, float16); None: what
        ``lax.ragged_dot_general`` returns for the (logical) operand dtypes.
      group_offset: must be None (``lax.ragged_dot_general`` has no implementation of it either).
      recipe: :class:`jax_mxfp4.Recipe` (scale_mode, quantize_activations, fprop/dgrad/wgrad,
        grad_rounding; backend "auto" or "xla"); default ``Recipe()``.
      key: optional PRNG key for stochastic rounding of dY in the backward passes (dgrad
        ``fold_in(key, 1)``, wgrad ``fold_in(key, 2)``); None: the data-derived key.

    Returns:
      [M, N] (ragged rows; [M, K] for a [G, N, K]-contracted-along-N call such as dgrad's) or
      [G, K, N] (ragged contracting), in the output dtype, float32 accumulation.

    Raises:
      TypeError: an operand neither float nor MXFP4Array (or a FP8Prepared/DecodePrepared);
        non-integer ``group_sizes``; ``ragged_dot_dimension_numbers`` of the wrong type; a bad
        ``recipe`` or ``key``.
      ValueError: an unsupported form (named); K not a multiple of 32 or not matching;
        ``group_sizes`` not rank 1 or not G entries, or (when concrete) negative or summing past
        M; an MXFP4Array not quantized along its contracting dim, recording a Hadamard rotation,
        or in the ragged contracting form; ``Recipe.hadamard`` on an MXFP4 pass;
        ``group_offset`` given; a gradient with respect to an MXFP4Array (when differentiated).
      BackendUnavailableError: ``Recipe.backend`` other than "auto" or "xla".

    Under ``jit`` the values of ``group_sizes`` cannot be checked: an invalid one (a negative
    size, or a sum above M) makes the result and the gradients all NaN.
    """
    if group_offset is not None:
        raise ValueError("group_offset is not supported by jax_mxfp4.ragged_dot_general (jax.lax.ragged_dot_general "
                         "raises NotImplementedError for it too): pass group_offset=None")
    recipe = _check_recipe(recipe, precision)
    if key is not None:
        checks.check_rounding("stochastic", key)  # one PRNG key
    form, m, gs, concrete, out_dtype = _validate(lhs, rhs, group_sizes, ragged_dot_dimension_numbers,
                                                 preferred_element_type)
    hipblaslt_ragged.check_sizes(gs, recipe.ragged_capacity)
    site = site_seed("ragged_dot", tuple(lhs.shape), tuple(rhs.shape), str(jnp.dtype(lhs.dtype)),
                     str(jnp.dtype(rhs.dtype)), form.kind, form.rhs_k_axis)
    static = _Static(recipe, jnp.dtype(out_dtype), form, site, m, not concrete, jnp.dtype(lhs.dtype), jnp.dtype(rhs.dtype))
    def run(lhs, rhs, gs):
        out = _contracting(lhs, rhs, gs, static) if form.kind == CONTRACTING else _ragged_rows(static, lhs, rhs, gs, key)
        return _poison(out, gs, static)

    return _explicit_mesh_call(run, lhs, rhs, gs, form)


def _explicit_mesh_call(run, lhs, rhs, group_sizes, form: _Form):
    """``run(lhs, rhs, group_sizes)``; with operands on an Explicit mesh, run with the mesh axes
    Auto (``lax.ragged_dot_general`` infers no output sharding there) and the output sharded as
    its operands' dims: ragged rows [M, N] as lhs's M and rhs's N; ragged contracting [G, K, N]
    as lhs's K and rhs's N (a mesh axis named twice is kept on the first dim only)."""
    mesh, specs = shd.explicit_specs(*(x.data if isinstance(x, MXFP4Array) else x for x in (lhs, rhs, group_sizes)))
    if mesh is None:
        return run(lhs, rhs, group_sizes)
    (ls, rs, _) = specs
    entries = (ls[0], rs[3 - form.rhs_k_axis]) if form.kind == ROWS else (None, ls[1], rs[1])
    out, used = [], set()
    for e in entries:
        axes = set(shd.entry_axes(e))
        out.append(None if axes & used else e)
        used |= axes
    return jax.sharding.auto_axes(run, axes=mesh.axis_names, out_sharding=jax.sharding.PartitionSpec(*out))(
        lhs, rhs, group_sizes)


def ragged_dot(lhs, rhs, group_sizes, precision=None, preferred_element_type=None, group_offset=None, *,
               recipe=None, key=None):
    """MXFP4 ``jax.lax.ragged_dot``: lhs [M, K] x rhs [G, K, N] -> [M, N], differentiable.

    Rows ``start_g .. start_g + group_sizes[g] - 1`` of lhs are multiplied by ``rhs[g]``; rows past
    ``sum(group_sizes)`` give zeros. ``rhs`` may be float (quantized along K per call) or an
    :class:`MXFP4Array` quantized along K (axis 1); for gpt-oss's [G, N, K] storage use
    :func:`ragged_dot_general` with contracting dims (1,)/(2,). Arguments, numerics, training
    rule, returns and errors: :func:`ragged_dot_general` and :mod:`jax_mxfp4.ragged`.
    """
    for name, x, rank, form in (("lhs", lhs, 2, "[M, K]"), ("rhs", rhs, 3, "[G, K, N]")):
        if len(jnp.shape(x)) != rank:
            raise ValueError(f"ragged_dot: {name} must be {rank}-D {form}, got shape {tuple(jnp.shape(x))}")
    return ragged_dot_general(lhs, rhs, group_sizes, _RAGGED_DOT_DN, precision, preferred_element_type,
                              group_offset, recipe=recipe, key=key)
