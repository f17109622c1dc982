"""Sharding functions for explicit-sharding meshes (``jax.make_mesh`` default ``AxisType.Explicit``).

Under an explicit mesh, every reshape that merges sharded dims and every contraction over a
sharded dim needs an explicit ``out_sharding``. The canonical GEMM mapping (:mod:`jax_mxfp4.gemm`)
asks these functions for those shardings, so the whole path stays shard-local: a 32-element block
never straddles a shard, and no hidden all-gather appears. Under ``AxisType.Auto`` meshes (or no
mesh) every one of them returns ``None`` and XLA's partitioner decides.
"""

from __future__ import annotations

import math

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from .mx_format import BLOCK_SIZE


def _explicit_mesh(x):
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty or AxisType.Explicit not in tuple(mesh.axis_types):
        return None
    return mesh


def explicit_spec(x) -> tuple | None:
    """Per-dim PartitionSpec entries of ``x`` if it carries an explicit-mesh sharding, else None."""
    if _explicit_mesh(x) is None:
        return None
    spec = tuple(jax.typeof(x).sharding.spec)
    return spec + (None,) * (jax.typeof(x).ndim - len(spec))


def mesh_of(x):
    return jax.typeof(x).sharding.mesh


def explicit_specs(*xs):
    """``(mesh, [spec of each x])`` when any of ``xs`` carries an explicit-mesh sharding, else
    ``(None, None)``. An operand without one (e.g. a weight created outside ``jax.set_mesh``) is
    replicated on that mesh, as in JAX's own ops: its entries are all None."""
    mesh = next((m for m in map(_explicit_mesh, xs) if m is not None), None)
    if mesh is None:
        return None, None
    return mesh, [explicit_spec(x) or (None,) * jax.typeof(x).ndim for x in xs]


def entry_axes(entry) -> tuple[str, ...]:
    """The mesh axis names of one PartitionSpec entry (None, a name or a tuple of names)."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def merge_entries(entries) -> str | tuple | None:
    """Spec entry of a dim formed by merging dims with ``entries`` (row-major)."""
    axes = tuple(a for e in entries for a in entry_axes(e))
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes


def axis_size(mesh, entry) -> int:
    return math.prod(mesh.shape[a] for a in entry_axes(entry))


def canonical_operand_spec(spec, perm, n_batch, n_free) -> tuple:
    """(B, F, K) spec entries of an operand transposed by ``perm`` and merged into [B, F, K]."""
    moved = [spec[d] for d in perm]
    return (
        merge_entries(moved[:n_batch]),
        merge_entries(moved[n_batch : n_batch + n_free]),
        merge_entries(moved[n_batch + n_free :]),
    )


def whole_blocks(mesh, entry, length: int) -> bool:
    """True if a dim of ``length`` elements sharded as ``entry`` gives every shard whole 32-element
    blocks: unsharded, or ``length`` a multiple of 32 * shards (the one sharding rule of MXFP4)."""
    shards = axis_size(mesh, entry)
    return shards == 1 or length % (BLOCK_SIZE * shards) == 0


def check_block_shards(mesh, entry, length: int, name: str, what: str = "the contracting dim (K)") -> None:
    """ValueError unless each shard of a quantized dim holds whole 32-element blocks
    (:func:`whole_blocks`); checked before any reshape or quantization that it would break."""
    if not whole_blocks(mesh, entry, length):
        shards = axis_size(mesh, entry)
        raise ValueError(
            f"{name}: {what} of length {length} is sharded over mesh axes {entry_axes(entry)} ({shards} "
            f"shards), so a shard would split a 32-element MXFP4 block ({length} is not a multiple of "
            f"32 x {shards} = {BLOCK_SIZE * shards}); reshard that dim so each shard holds a multiple "
            "of 32 elements, or leave it unsharded"
        )


def check_dim_blocks(x, axis: int, name: str, what: str = "the contracting dim (K)") -> None:
    """:func:`check_block_shards` for dim ``axis`` of ``x`` under an explicit mesh (no-op elsewhere)."""
    spec = explicit_spec(x)
    if spec is not None:
        check_block_shards(mesh_of(x), spec[axis], x.shape[axis], name, what)


def check_k_shards(mesh, k_entry, k: int, name: str) -> None:
    """A K shard must hold whole 32-element blocks (quantization stays shard-local)."""
    check_block_shards(mesh, k_entry, k, name)


def gather_partial_blocks(x, axis: int, padded_length: int | None = None):
    """``x`` resharded, under an explicit mesh, so that ``axis`` (to be zero-padded to
    ``padded_length`` and quantized along) gives every shard whole 32-element blocks: the mesh axes
    of that dim are dropped from the minor end until :func:`whole_blocks` holds, and all of them if
    the dim will be padded (padding a sharded dim would shift the shard boundaries). What XLA does
    by itself on an ``AxisType.Auto`` mesh; used by the backward passes, whose contraction (N in
    dgrad, the token axis M in wgrad) the user does not shard directly. ``x`` as is elsewhere."""
    spec = explicit_spec(x)
    if spec is None:
        return x
    mesh, length = mesh_of(x), x.shape[axis]
    axes = entry_axes(spec[axis])
    if padded_length is not None and padded_length != length:
        axes = ()
    while axes and not whole_blocks(mesh, axes, length):
        axes = axes[:-1]
    if axes == entry_axes(spec[axis]):
        return x
    new = list(spec)
    new[axis] = merge_entries([axes])
    return jax.sharding.reshard(x, named(mesh, *new))


def varying_axes(x) -> frozenset:
    """The manual mesh axes (inside ``jax.shard_map``) along which ``x``'s value varies: its type's
    varying-manual-axes set (JAX's "vma"); empty outside ``shard_map`` or with ``check_vma=False``.
    ``x``: an array, a tracer or an abstract value."""
    aval = x if isinstance(x, jax.core.ShapedArray) else jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    return frozenset(mat.varying) if mat is not None else frozenset(getattr(aval, "vma", ()))


def vary_alike(*xs) -> tuple:
    """``xs``, each cast to vary along the union of their varying manual axes (as JAX's own
    primitives cast their operands): an opaque primitive and each ``lax.platform_dependent``
    branch then gets and gives one varying type. ``xs`` as they are outside ``shard_map``."""
    union = frozenset().union(*map(varying_axes, xs))
    if not union:
        return xs
    return tuple(_vary(x, union) for x in xs)


def _vary(x, axes):
    missing = tuple(sorted(axes - varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def kernel_may_run(*xs) -> bool:
    """Whether an opaque kernel (a ``pallas_call`` outside :mod:`jax_mxfp4.partitioning`) may run on
    ``xs`` where it is traced: outside any mesh context, on arrays that carry no explicit-mesh
    sharding and vary along no ``shard_map`` axis. SPMD partitioning cannot see into such a kernel
    (it would gather its operands), Pallas rejects explicitly sharded refs ("sharded ref can only be
    sliced along unsharded axes") and types no varying output; the XLA formulation runs instead."""
    return jax.sharding.get_abstract_mesh().empty and all(
        explicit_spec(x) is None and not varying_axes(x) for x in xs)


def like(g, x):
    """``g`` typed as its primal ``x`` (a cotangent must have its primal's type): resharded to
    ``x``'s sharding under an explicit mesh (the backward GEMMs shard their outputs by their own
    operands), and inside ``shard_map`` summed (``psum``) over the manual axes along which ``g``
    varies but ``x`` does not, as JAX transposes the implicit cast of an invariant operand (the
    cotangent of a replicated weight is the sum of the per-shard cotangents); cast to vary along
    those ``x`` varies along and ``g`` does not."""
    gv, xv = varying_axes(g), varying_axes(x)
    if gv - xv:
        g = jax.lax.psum(g, tuple(sorted(gv - xv)))
    g = _vary(g, xv) if xv - gv else g
    gs = explicit_spec(g)
    if gs is None:
        return g
    xs = explicit_spec(x) or (None,) * x.ndim
    return g if gs == xs else jax.sharding.reshard(g, named(mesh_of(g), *xs))


def named(mesh, *entries) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(*entries))


def logical_out_entries(lhs_entries, rhs_free_entries) -> list:
    """Spec entries of dot_general's output dims (lhs batch + free dims, then rhs free dims),
    dropping from the rhs dims mesh axes that the lhs dims already use (as canonical_out_spec)."""
    used = {a for e in lhs_entries for a in entry_axes(e)}
    out = list(lhs_entries)
    for e in rhs_free_entries:
        keep = tuple(a for a in entry_axes(e) if a not in used)
        used |= set(keep)
        out.append(merge_entries(keep))
    return out


def canonical_out_spec(lhs_spec, rhs_spec) -> tuple:
    """(B, M, N) spec of the canonical GEMM output; N drops mesh axes already used by B or M."""
    b, m, _ = lhs_spec
    n = rhs_spec[1]
    used = set(entry_axes(b)) | set(entry_axes(m))
    n_axes = tuple(a for a in entry_axes(n) if a not in used)
    return b, m, merge_entries(n_axes)


def canonical_out_sharding(lhs3, rhs3) -> NamedSharding | None:
    """Output sharding of the canonical [B, M, K] x [B, N, K] -> [B, M, N] contraction under an
    explicit mesh (a sharded K is reduced), or None elsewhere."""
    mesh, specs = explicit_specs(lhs3, rhs3)
    if mesh is None:
        return None
    return named(mesh, *canonical_out_spec(*specs))
