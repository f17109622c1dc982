"""Sharding helpers for explicit-sharding meshes (``jax.make_mesh`` default ``AxisType.Explicit``).

Under an explicit mesh, every reshape that merges sharded dims and every contraction over a
sharded dim needs an explicit ``out_sharding``. The canonical GEMM mapping (:mod:`jax_mxfp4.gemm`)
asks these helpers for those shardings, so the whole path stays shard-local: a 32-element block
never straddles a shard, and no hidden all-gather appears. Under ``AxisType.Auto`` meshes (or no
mesh) every helper returns ``None`` and XLA's partitioner decides.
"""

from __future__ import annotations

import math

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from .mx_format import BLOCK_SIZE


def explicit_spec(x) -> tuple | None:
    """Per-dim PartitionSpec entries of ``x`` if it carries an explicit-mesh sharding, else None."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty or AxisType.Explicit not in tuple(mesh.axis_types):
        return None
    spec = tuple(sharding.spec)
    return spec + (None,) * (jax.typeof(x).ndim - len(spec))


def mesh_of(x):
    return jax.typeof(x).sharding.mesh


def _axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def merge_entries(entries) -> str | tuple | None:
    """Spec entry of a dim formed by merging dims with ``entries`` (row-major)."""
    axes = tuple(a for e in entries for a in _axes(e))
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes


def axis_size(mesh, entry) -> int:
    return math.prod(mesh.shape[a] for a in _axes(entry))


def canonical_operand_spec(spec, perm, n_batch, n_free) -> tuple:
    """(B, F, K) spec entries of an operand transposed by ``perm`` and merged into [B, F, K]."""
    moved = [spec[d] for d in perm]
    return (
        merge_entries(moved[:n_batch]),
        merge_entries(moved[n_batch : n_batch + n_free]),
        merge_entries(moved[n_batch + n_free :]),
    )


def check_k_shards(mesh, k_entry, k: int, name: str) -> None:
    """A K shard must hold whole 32-element blocks (quantization stays shard-local)."""
    shards = axis_size(mesh, k_entry)
    if shards > 1 and (k // BLOCK_SIZE) % shards:
        raise ValueError(
            f"{name}: the contracting dim (K={k}) is sharded over mesh axes {_axes(k_entry)} "
            f"({shards} shards), so a shard would split a 32-element MXFP4 block (K/32={k // BLOCK_SIZE} "
            f"is not divisible by {shards}); reshard K so each shard holds a multiple of 32 elements"
        )


def named(mesh, *entries) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(*entries))


def logical_out_entries(lhs_entries, rhs_free_entries) -> list:
    """Spec entries of dot_general's output dims (lhs batch + free dims, then rhs free dims),
    dropping from the rhs dims mesh axes that the lhs dims already use (as canonical_out_spec)."""
    used = {a for e in lhs_entries for a in _axes(e)}
    out = list(lhs_entries)
    for e in rhs_free_entries:
        keep = tuple(a for a in _axes(e) if a not in used)
        used |= set(keep)
        out.append(merge_entries(keep))
    return out


def canonical_out_spec(lhs_spec, rhs_spec) -> tuple:
    """(B, M, N) spec of the canonical GEMM output; N drops mesh axes already used by B or M."""
    b, m, _ = lhs_spec
    n = rhs_spec[1]
    used = set(_axes(b)) | set(_axes(m))
    n_axes = tuple(a for a in _axes(n) if a not in used)
    return b, m, merge_entries(n_axes)


def canonical_out_sharding(lhs3, rhs3) -> NamedSharding | None:
    """Output sharding of the canonical [B, M, K] x [B, N, K] -> [B, M, N] contraction under an
    explicit mesh (a sharded K is reduced), or None elsewhere."""
    ls, rs = explicit_spec(lhs3), explicit_spec(rhs3)
    if ls is None or rs is None:
        return None
    return named(mesh_of(lhs3), *canonical_out_spec(ls, rs))
