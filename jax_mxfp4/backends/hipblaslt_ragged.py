"""Route "hipblaslt-grouped" of :func:`jax_mxfp4.ragged_dot` on ROCm gfx950: the groups served by
hipBLASLt's MXFP4 GEMM without copying ``group_sizes`` to the host.

hipBLASLt has no MXFP4 grouped GEMM: its block-scaled GEMM takes batch 1 only (api-reference,
VEC32_UE8M0), rocRoller refuses a batch count other than 1, and the grouped extension API
(``hipblaslt_ext::GroupedGemm``, device-side ``UserArguments``) has no MX scale mode. So the
tokens go into a **capacity-padded batched layout**, computed in ``jit``: the rows of group g
are scattered to rows ``[g*C, g*C + size_g)`` of a [G*C, K] buffer (codes and scales; the
padding rows are zero codes), one FFI call of the hipBLASLt handler multiplies batch element g
by expert g (the handler issues G batch-1 GEMMs of M = C rows on the stream, pointers offset per
group: the dense handler's own batch loop, gates, envelope, route snapshot and per-stream
warm-up), and the rows are gathered back; rows past ``sum(group_sizes)`` give zeros. Nothing
needs the sizes on the host: C is static.

C (rows per group): ``Recipe.ragged_capacity`` (None: M, every group can hold every row, no
token is ever dropped), at most M, rounded up to the smallest multiple of 16 or 32 that the
hipBLASLt envelope in force takes. The work is G x C rows: with C = M that is G times the rows
of the ragged product, which costs little while the GEMMs stay bound by reading the experts
(decode sizes), so "auto" takes the route with the default capacity only for C <= 256
(:data:`AUTO_MAX_ROWS`, not measured on hardware). A caller that knows its routing (e.g. a
capacity factor over M·top_k/G) sets ``Recipe.ragged_capacity``; a group larger than it is an
error when ``group_sizes`` is concrete and makes the result all NaN under ``jit``, on every
platform and route (:func:`check_sizes`, :func:`overflows`).

Takes: the ragged-rows form with both operands MXFP4 (no w4a16) and the experts contracted
along their last dim ([G, N, K], gpt-oss's storage: hipBLASLt's MXFP4 GEMM is TN only, so
[G, K, N] would need a transposed copy of every expert per call), float32 out, and the
hipBLASLt backend's own rules (:class:`jax_mxfp4.backends.hipblaslt.HipblasltBackend`:
envelope, device, version, route, heuristic) for the batched problem G x (C, N, K).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .. import dispatch
from ..array import MXFP4Array
from ..partitioning import partitioned_gemm
from ..platform import current_platform
from .base import GemmProblem
from .hipblaslt import shape_reason

GROUPED = "hipblaslt-grouped"
PLATFORM = "rocm"
AUTO_MAX_ROWS = 256
"""With ``Recipe.ragged_capacity=None`` "auto" takes the route only while C <= this: the G x C
padded rows then add at most 4·C flops per weight byte (MXFP4: 2 elements per byte), below the
compute/bandwidth ratio of gfx950, so the GEMMs stay bound by reading the experts. An estimate
from data sheets, not a measurement."""
ROW_MULTIPLES = (16, 32)  # candidate multiples of C, the smallest the envelope takes wins


def check_sizes(group_sizes, capacity: int | None) -> None:
    """ValueError if a concrete ``group_sizes`` has a group larger than ``capacity``."""
    if capacity is None or isinstance(group_sizes, jax.core.Tracer):
        return
    v = np.asarray(group_sizes).astype(np.int64)
    over = np.flatnonzero(v > capacity)
    if over.size:
        raise ValueError(
            f"group_sizes exceeds Recipe.ragged_capacity={capacity} at groups {over.tolist()} (sizes "
            f"{v[over].tolist()}): every group must fit in the capacity (rows beyond it would be dropped)")


def overflows(group_sizes, capacity: int | None):
    """Traced: whether a group is larger than ``capacity`` (False when there is none)."""
    if capacity is None:
        return jnp.asarray(False)
    return jnp.any(group_sizes > capacity)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def capacity_rows(m: int, n: int, k: int, capacity: int | None) -> tuple[int, str]:
    """(C, "") with C the padded rows per group that the envelope in force takes, or (0, why not)."""
    want = max(1, min(m, capacity or m))
    why = ""
    for multiple in ROW_MULTIPLES:
        c = _round_up(want, multiple)
        why = shape_reason(c, n, k, "float32")
        if not why:
            return c, ""
    return 0, why


def _problem(g: int, c: int, n: int, k: int, recipe, platform: str) -> GemmProblem:
    return GemmProblem(g, c, n, k, np.dtype(np.float32), recipe.scale_layout, platform)


def judge(platform: str, lhs_shape, rhs_shape, dn, mxfp4: bool, recipe) -> str | None:
    """Whether this route serves a ragged product on ``platform``: None where it is no candidate
    (off ROCm, or ``Recipe.backend`` not "auto"), "" where it does, else why not. ``mxfp4``: both operands MXFP4 as the product takes them."""
    if platform != PLATFORM or recipe.backend != "auto":
        return None
    (lc, rc), _ = dn.dot_dimension_numbers
    if tuple(dn.rhs_group_dimensions) != (0,) or len(rhs_shape) != 3:
        return "serves the ragged-rows form only"
    if tuple(rc) != (2,):
        return ("the experts are contracted along dim 1 ([G, K, N]): hipBLASLt's MXFP4 GEMM is TN only, so each "
                "call would copy every expert transposed; store them as [G, N, K] (contracting dims (1,)/(2,))")
    if not mxfp4:
        return "takes two MXFP4 operands only (no w4a16 float operand)"
    m, k = lhs_shape
    g, n, _ = rhs_shape
    c, why = capacity_rows(m, n, k, recipe.ragged_capacity)
    if why:
        return f"per-group GEMM outside the hipBLASLt envelope: {why}"
    if recipe.ragged_capacity is None and c > AUTO_MAX_ROWS:
        return (f"Recipe.ragged_capacity=None pads every group to all M={m} rows ({g} x {c} rows of work, more "
                f"than {AUTO_MAX_ROWS} per group); set Recipe.ragged_capacity to route it here")
    backend = dispatch.get_backend("hipblaslt")
    why = dispatch._reason(backend, _problem(g, c, n, k, recipe, platform), current_platform())
    return f"hipBLASLt: {why}" if why else ""


def reason(capacity_set: bool) -> str:
    """explain_ragged_dot's reason for this route."""
    c = "Recipe.ragged_capacity rows" if capacity_set else "all M rows"
    return (f"on rocm: one hipBLASLt FFI call, one batch-1 MXFP4 GEMM per group on a capacity-padded layout "
            f"(each group padded to {c}; group_sizes stays on the device)")


def _slots(group_sizes, m: int, c: int):
    """Per lhs row its row in the padded [G*C] layout, and whether it has one (in a group, within C)."""
    ends = jnp.cumsum(group_sizes)
    rows = jnp.arange(m, dtype=ends.dtype)
    g = jnp.searchsorted(ends, rows, side="right")
    starts = ends - group_sizes
    pos = rows - starts[jnp.minimum(g, group_sizes.shape[0] - 1)]
    valid = (g < group_sizes.shape[0]) & (pos < c)
    return jnp.where(valid, g * c + pos, group_sizes.shape[0] * c), valid


def product(a: MXFP4Array, b: MXFP4Array, group_sizes, recipe):
    """float32 [M, N]: rows of ``a`` [M, K] (MXFP4 along K) by their group's expert of ``b``
    [G, N, K] (MXFP4 along K) through the hipBLASLt backend's batched GEMM. Rows past
    ``sum(group_sizes)``, and rows beyond the capacity (which the caller poisons), give zeros."""
    m, k = a.shape
    g, n, _ = b.shape
    c, why = capacity_rows(m, n, k, recipe.ragged_capacity)
    if why:  # judge() declined this already; never reached through ragged_dot
        raise ValueError(why)
    slot, valid = _slots(group_sizes, m, c)
    scales = a.plain_scales()
    data = jnp.zeros((g * c, k // 2), a.data.dtype).at[slot].set(a.data, mode="drop")
    scales = jnp.zeros((g * c, scales.shape[1]), scales.dtype).at[slot].set(scales, mode="drop")
    lhs = MXFP4Array(data.reshape(g, c, k // 2), scales.reshape(g, c, -1), 2, (g, c, k), a.dtype, a.scale_mode)
    rhs = MXFP4Array(b.data, b.plain_scales(), 2, (g, n, k), b.dtype, b.scale_mode)
    # The dense GEMM's own call: its sharding rule, and lowered for ROCm only in a multi-platform export.
    out = partitioned_gemm(lhs, rhs, "hipblaslt", _problem(g, c, n, k, recipe, PLATFORM), platforms=(PLATFORM,))
    out = out.reshape(g * c, n)
    return jnp.where(valid[:, None], jnp.take(out, jnp.minimum(slot, g * c - 1), axis=0), 0.0).astype(jnp.float32)
