"""Sharding rules for backends that XLA's partitioner cannot see into (FFI custom calls, Pallas).

An FFI custom call or a ``pallas_call`` is opaque to SPMD partitioning: without a rule XLA
all-gathers its operands onto every device. ``partitioned_gemm`` runs such a backend's canonical
GEMM ([B, M, K] x [B, N, K] -> [B, M, N]) through an outer primitive (batching rule: vmap folds
into B) whose lowering is a ``custom_partitioning`` with a Shardy ``sharding_rule``
(TransformerEngine-JAX's inner/outer primitive pattern):

  - B, M and N shard freely with no collectives;
  - a sharded K gives per-shard partial GEMMs (float32) and one ``psum`` over K's mesh axes;
  - scales share their operand's factors (packed data K/2 and scales K/32 are one factor "k");
    a :class:`jax_mxfp4.DecodePrepared` operand's K-major scales [B, K/32, F] take them in that order.

The custom VJP of :func:`jax_mxfp4.dot_general` stays outside (custom_partitioning has no JVP),
so ``jax.grad`` works on sharded inputs.

The same primitive defers a backend staged for another platform (a ``lax.platform_dependent``
branch, :mod:`jax_mxfp4.gemm`): its GEMM is traced only when the branch is lowered, so a program
lowered for this platform alone never traces another platform's kernels (which may not trace
here: a CUDA Pallas kernel on explicitly sharded types). Such a call with ``partition=False``
(a backend XLA can see into) is lowered inline, without the sharding rule.

Inside ``jax.shard_map`` the operands are cast to one varying type (their union) and the result
varies alike, as with JAX's own primitives, so every branch gives the same type.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import config as jax_config
from jax._src import core as jax_core
from jax._src import dispatch as jax_dispatch
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir
from jax.sharding import NamedSharding, PartitionSpec

from .array import MXFP4Array
from .decode_prepared import DecodePrepared
from .backends.base import GemmProblem
from .mx_format import BLOCK_SIZE
from .sharding import canonical_out_sharding, entry_axes, merge_entries, vary_alike, varying_axes

partitioned_gemm_p = Primitive("jax_mxfp4_partitioned_gemm")


def _flatten(x, kind):
    if kind == "float":
        return (x,)
    return (x.data, x.scales)


def _unflatten(arrays, kind, dtype, decode_prepared=False):
    if kind == "float":
        return arrays[0]
    data, scales = arrays
    b, f, kh = data.shape
    if decode_prepared:  # the operand's byte order (GemmProblem.*_decode_prepared)
        return DecodePrepared(data, scales, 2, (b, f, 2 * kh), dtype, "even", None, decode_prepared)
    return MXFP4Array(data, scales, 2, (b, f, 2 * kh), dtype, "even", "plain")


def _split(args, problem):
    n_l = 1 if problem.lhs_kind == "float" else 2
    return args[:n_l], args[n_l:]


def _local_problem(args, problem: GemmProblem) -> GemmProblem:
    lhs, rhs = _split(args, problem)
    b, m = lhs[0].shape[:2]
    n = rhs[0].shape[1]
    k = lhs[0].shape[2] * (1 if problem.lhs_kind == "float" else 2)
    return dataclasses.replace(problem, batch=b, m=m, n=n, k=k)


def _run_backend(args, backend_name, problem: GemmProblem):
    from . import dispatch

    problem = _local_problem(args, problem)
    lhs, rhs = _split(args, problem)
    a = _unflatten(lhs, problem.lhs_kind, problem.lhs_dtype, problem.lhs_decode_prepared)
    b = _unflatten(rhs, problem.rhs_kind, problem.rhs_dtype, problem.rhs_decode_prepared)
    return dispatch.get_backend(backend_name).gemm(a, b, problem)


def partitioned_gemm(lhs, rhs, backend_name: str, problem: GemmProblem, platforms=None,
                     partition: bool = True) -> jax.Array:
    """Canonical GEMM through ``backend_name`` with a sharding rule (module docstring).

    ``lhs``/``rhs``: canonical MXFP4Arrays [B, M|N, K] (plain scales), float arrays (w4a16), or
    canonical DecodePrepared where ``problem.lhs_decode_prepared``/``rhs_decode_prepared`` say so.
    ``platforms``: when this call is one branch of a ``lax.platform_dependent``, the platforms
    that branch serves; in a multi-platform lowering the call is then lowered for those platforms
    only (JAX lowers every kept branch for all of them, and a backend that has no lowering for
    another platform would fail there in code that never runs). None: every platform.
    ``partition``: lower through the sharding rule (an opaque backend); False: inline, for a
    backend XLA partitions itself, deferred to lowering (module docstring).
    Returns [B, M, N] in ``problem.out_dtype``.
    """
    args = vary_alike(*_flatten(lhs, problem.lhs_kind), *_flatten(rhs, problem.rhs_kind))
    platforms = None if platforms is None else tuple(platforms)
    bind = functools.partial(partitioned_gemm_p.bind, backend_name=backend_name, problem=problem,
                             platforms=platforms, partition=bool(partition))
    out_sharding = canonical_out_sharding(args[0], args[len(_flatten(lhs, problem.lhs_kind))])
    if out_sharding is None:
        return bind(*args)
    # Under an explicit-sharding mesh the call is typed with Auto axes inside: a kernel traced on
    # explicitly sharded types fails (Pallas: "sharded ref can only be indexed by slices"), and
    # the custom_partitioning rule below shards it all the same; the result is typed as the
    # canonical GEMM's output (jax_mxfp4.sharding.canonical_out_sharding).
    return jax.sharding.auto_axes(bind, out_sharding=out_sharding)(*args)


def _abstract_eval(*args, backend_name, problem, platforms, partition):
    lhs, rhs = _split(args, problem)
    shape = (lhs[0].shape[0], lhs[0].shape[1], rhs[0].shape[1])
    vma = varying_axes(args[0])  # all operands vary alike (partitioned_gemm casts them)
    if not vma:
        return jax.core.ShapedArray(shape, problem.out_dtype)
    sharding = NamedSharding(args[0].sharding.mesh, PartitionSpec())
    return jax.core.ShapedArray(shape, problem.out_dtype, sharding=sharding,
                                manual_axis_type=jax_core.ManualAxisType(varying=vma))


def _batch(args, dims, *, backend_name, problem, platforms, partition):
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    folded = []
    for a, d in zip(args, dims):
        a = jnp.broadcast_to(a, (size,) + a.shape) if d is None else jnp.moveaxis(a, d, 0)
        folded.append(a.reshape((size * a.shape[1],) + a.shape[2:]))
    problem = dataclasses.replace(problem, batch=problem.batch * size)
    out = partitioned_gemm_p.bind(*folded, backend_name=backend_name, problem=problem, platforms=platforms,
                                  partition=partition)
    return out.reshape((size, out.shape[0] // size) + out.shape[1:]), 0


def _spec_entries(info, ndim):
    spec = tuple(info.sharding.spec) if isinstance(info.sharding, NamedSharding) else ()
    return spec + (None,) * (ndim - len(spec))


def _partitioned_impl(backend_name: str, problem: GemmProblem):
    """custom_partitioning of the local backend call: one per configuration (backend, operand
    kinds, dtypes, layout, platform, precision), shared by every shape (each call reads its shapes
    from its arguments: :func:`_local_problem`)."""
    return _partitioned_rule(backend_name, dataclasses.replace(problem, batch=0, m=0, n=0, k=0))


@functools.lru_cache(maxsize=None)  # bounded: finitely many configurations, shapes excluded
def _partitioned_rule(backend_name: str, problem: GemmProblem):
    n_lhs = 1 if problem.lhs_kind == "float" else 2
    n_rhs = 1 if problem.rhs_kind == "float" else 2

    @custom_partitioning
    def impl(*args):
        return _run_backend(args, backend_name, problem)

    def partition(mesh, arg_infos, result_infos):
        lspec = _spec_entries(arg_infos[0], 3)
        rspec = _spec_entries(arg_infos[n_lhs], 3)
        b_axes = entry_axes(lspec[0])
        m_axes = tuple(a for a in entry_axes(lspec[1]) if a not in b_axes)
        k_axes = tuple(a for a in entry_axes(lspec[2]) if a not in b_axes + m_axes)
        n_axes = tuple(a for a in entry_axes(rspec[1]) if a not in b_axes + m_axes + k_axes)
        k_shards = int(np.prod([mesh.shape[a] for a in k_axes])) if k_axes else 1
        k_len = arg_infos[0].shape[2] * (1 if problem.lhs_kind == "float" else 2)
        if (k_len // BLOCK_SIZE) % k_shards:  # a shard may not split a 32-element block
            k_axes, k_shards = (), 1
        b, m, n, k = merge_entries(b_axes), merge_entries(m_axes), merge_entries(n_axes), merge_entries(k_axes)
        lhs_s = NamedSharding(mesh, PartitionSpec(b, m, k))
        rhs_s = NamedSharding(mesh, PartitionSpec(b, n, k))
        out_s = NamedSharding(mesh, PartitionSpec(b, m, n))
        lhs_kmajor = NamedSharding(mesh, PartitionSpec(b, k, m))
        rhs_kmajor = NamedSharding(mesh, PartitionSpec(b, k, n))
        arg_shardings = ((lhs_s,) + ((lhs_kmajor if problem.lhs_decode_prepared else lhs_s),) * (n_lhs - 1)
                         + (rhs_s,) + ((rhs_kmajor if problem.rhs_decode_prepared else rhs_s),) * (n_rhs - 1))

        def lower(*args):
            if not k_axes:
                return _run_backend(args, backend_name, problem)
            partial = _run_backend(args, backend_name, dataclasses.replace(problem, out_dtype=np.dtype(np.float32)))
            return jax.lax.psum(partial, k_axes).astype(problem.out_dtype)

        return mesh, lower, out_s, arg_shardings

    lhs_rule = ", ".join(["b m k"] + ["b k m" if problem.lhs_decode_prepared else "b m k"] * (n_lhs - 1))
    rhs_rule = ", ".join(["b n k"] + ["b k n" if problem.rhs_decode_prepared else "b n k"] * (n_rhs - 1))
    impl.def_partition(
        partition=partition,
        sharding_rule=f"{lhs_rule}, {rhs_rule} -> b m n",
        reduction_factors=("k",),
    )
    return impl


def _lowering(ctx, *args, backend_name, problem, platforms, partition):
    impl = _partitioned_impl(backend_name, problem) if partition else (
        lambda *a: _run_backend(a, backend_name, problem))
    if platforms is not None:
        lowering_for = ctx.platforms or ctx.module_context.platforms
        narrowed = [p for p in lowering_for if p in platforms]
        if narrowed and len(narrowed) < len(lowering_for):
            ctx = ctx.replace(platforms=narrowed)
    if not jax_config._check_vma.value:
        return mlir.lower_fun(lambda *a: impl(*a), multiple_results=False)(ctx, *args)
    # Inside shard_map the backend runs on the per-shard values, typed without varying axes: its
    # kernels (a pallas_call's out_shape, an FFI call) type none, and the lowered code is the
    # same either way (the primitive's own type, _abstract_eval, carries them outside).
    plain = lambda a: jax.core.ShapedArray(a.shape, a.dtype, a.weak_type)  # noqa: E731
    ctx = ctx.replace(avals_in=[plain(a) for a in ctx.avals_in], avals_out=[plain(a) for a in ctx.avals_out])
    with jax_config._check_vma(False):
        return mlir.lower_fun(lambda *a: impl(*a), multiple_results=False)(ctx, *args)


partitioned_gemm_p.def_impl(
    lambda *args, **params: jax_dispatch.apply_primitive(partitioned_gemm_p, *args, **params)
)
partitioned_gemm_p.def_abstract_eval(_abstract_eval)
batching.primitive_batchers[partitioned_gemm_p] = _batch
mlir.register_lowering(partitioned_gemm_p, _lowering)
# custom_partitioning needs the device assignment while lowering (as TransformerEngine-JAX does).
jax_dispatch.prim_requires_devices_during_lowering.add(partitioned_gemm_p)
