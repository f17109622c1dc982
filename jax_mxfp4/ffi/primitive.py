"""The MXFP4 FFI GEMM primitive: abstract eval, batching rule and per-platform lowering.

``mxfp4_gemm_p`` takes the packed operands of the canonical TN GEMM (``jax_mxfp4.backends.base``):

  lhs_data uint8 [B?, M, K/2], lhs_scales E8M0 [B?, M, K/32] (plain) or
  [B?, round_up(M, 32), round_up(K/32, 8)] (swizzled), rhs_data uint8 [B?, N, K/2], rhs_scales
  likewise with N rows -> out [B?, M, N] in ``out_dtype``.

Lowering: platform "cpu" emits a custom_call to ``jax_mxfp4_gemm_cpu`` (only for
``backend="ffi-cpu"``), platform "rocm" to ``jax_mxfp4_gemm_hipblaslt`` (only for
``backend="hipblaslt"``); any other pairing raises ``BackendUnavailableError`` at lowering time,
so an explicit backend never silently becomes another one. The ``scale_layout`` attribute ("plain" | "swizzled") is the only
FFI attribute.

No JVP/transpose: differentiation is handled above the backends (custom VJP of dot_general).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import dispatch as jax_dispatch
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from ..errors import BackendUnavailableError
from ..layout import SCALE_LAYOUTS, swizzled_shape
from ..mx_format import BLOCK_SIZE
from .registration import CPU_TARGET, HIPBLASLT_TARGET

OUT_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
_SCALE_DTYPES = (np.dtype(jnp.float8_e8m0fnu), np.dtype(np.uint8))
LOWERING_TARGETS = {"cpu": ("ffi-cpu", CPU_TARGET), "rocm": ("hipblaslt", HIPBLASLT_TARGET)}
"""platform (lower case, as in mlir.register_lowering) -> (backend name, FFI target)."""

mxfp4_gemm_p = Primitive("jax_mxfp4_gemm")


def mxfp4_gemm(lhs_data, lhs_scales, rhs_data, rhs_scales, *, out_dtype, scale_layout, backend):
    """out = lhs . rhs^T per batch element through the FFI handler of ``backend``.

    Args:
      lhs_data, rhs_data: uint8 [B?, M|N, K/2] packed E2M1 pairs (element 2i in bits 0-3).
      lhs_scales, rhs_scales: float8_e8m0fnu or uint8 scale bytes, shape per ``scale_layout``
        (module docstring).
      out_dtype: float32, bfloat16 or float16.
      scale_layout: "plain" or "swizzled".
      backend: "ffi-cpu" (lowers on cpu) or "hipblaslt" (lowers on rocm).

    Returns:
      [B?, M, N] array of ``out_dtype``.

    Raises:
      TypeError / ValueError: dtypes or shapes break the contract (checked at trace time).
      BackendUnavailableError: lowering for a platform that ``backend`` has no handler on.
    """
    return mxfp4_gemm_p.bind(
        lhs_data, lhs_scales, rhs_data, rhs_scales,
        out_dtype=np.dtype(out_dtype), scale_layout=scale_layout, backend=backend,
    )


def check_operands(lhs_data, lhs_scales, rhs_data, rhs_scales, out_dtype, scale_layout):
    """Trace-time contract check (shapes/dtypes only); returns the output shape."""
    if scale_layout not in SCALE_LAYOUTS:
        raise ValueError(f"scale_layout must be one of {SCALE_LAYOUTS}, got {scale_layout!r}")
    if np.dtype(out_dtype) not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be float32, bfloat16 or float16, got {out_dtype}")
    rank = len(lhs_data.shape)
    if rank not in (2, 3):
        raise ValueError(f"lhs_data must have rank 2 [M, K/2] or 3 [B, M, K/2], got shape {lhs_data.shape}")
    named = (("lhs_data", lhs_data), ("lhs_scales", lhs_scales), ("rhs_data", rhs_data), ("rhs_scales", rhs_scales))
    for name, x in named:
        if len(x.shape) != rank:
            raise ValueError(f"{name} has rank {len(x.shape)}, but lhs_data has rank {rank}")
    for name, x in (named[0], named[2]):
        if np.dtype(x.dtype) != np.uint8:
            raise TypeError(f"{name} must be uint8 (packed E2M1 pairs), got {x.dtype}")
    for name, x in (named[1], named[3]):
        if np.dtype(x.dtype) not in _SCALE_DTYPES:
            raise TypeError(f"{name} must be float8_e8m0fnu or uint8 E8M0 bytes, got {x.dtype}")
    lead = tuple(lhs_data.shape[:-2])
    m, kh = lhs_data.shape[-2:]
    n = rhs_data.shape[-2]
    k = 2 * kh
    if k % BLOCK_SIZE:
        raise ValueError(f"K = 2 x {kh} = {k} must be a multiple of {BLOCK_SIZE} (OCP MX v1.0 §5.1)")
    if tuple(rhs_data.shape) != lead + (n, kh):
        raise ValueError(f"rhs_data shape {rhs_data.shape} must be {lead + (n, kh)} (same batch and K/2 as lhs_data)")
    for name, x, rows in ((named[1][0], lhs_scales, m), (named[3][0], rhs_scales, n)):
        want = lead + ((rows, k // BLOCK_SIZE) if scale_layout == "plain" else swizzled_shape(rows, k // BLOCK_SIZE))
        if tuple(x.shape) != want:
            raise ValueError(f"{name} shape {x.shape} does not match the {scale_layout!r} layout: expected {want}")
    return lead + (m, n)


def _abstract_eval(lhs_data, lhs_scales, rhs_data, rhs_scales, *, out_dtype, scale_layout, backend):
    if backend not in ("ffi-cpu", "hipblaslt"):
        raise ValueError(f"backend must be 'ffi-cpu' or 'hipblaslt', got {backend!r}")
    shape = check_operands(lhs_data, lhs_scales, rhs_data, rhs_scales, out_dtype, scale_layout)
    return jax.core.ShapedArray(shape, out_dtype)


def _batch(args, dims, *, out_dtype, scale_layout, backend):
    """vmap: move the mapped axis to the front, broadcast unmapped operands, fold it into the
    operands' leading batch dim (adding one for rank-2 operands), call once, unfold."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    moved = []
    for a, d in zip(args, dims):
        if d is None:  # not mapped
            a = jnp.broadcast_to(a, (size,) + a.shape)
        else:
            a = jnp.moveaxis(a, d, 0)
        moved.append(a)
    rank = moved[0].ndim - 1  # rank of one example
    if rank == 3:
        b = moved[0].shape[1]
        flat = [a.reshape((size * b,) + a.shape[2:]) for a in moved]
        out = mxfp4_gemm(*flat, out_dtype=out_dtype, scale_layout=scale_layout, backend=backend)
        return out.reshape((size, b) + out.shape[1:]), 0
    out = mxfp4_gemm(*moved, out_dtype=out_dtype, scale_layout=scale_layout, backend=backend)
    return out, 0


def _lowering(ctx, *args, out_dtype, scale_layout, backend, platform):
    want_backend, target = LOWERING_TARGETS[platform]
    if backend != want_backend:
        raise BackendUnavailableError(
            f"jax_mxfp4 backend {backend!r} has no handler for platform {platform!r} (only "
            f"{want_backend!r} lowers there); choose the backend for the platform you compile for, "
            f"or backend='auto', which stages each platform's own"
        )
    del out_dtype
    return jax.ffi.ffi_lowering(target)(ctx, *args, scale_layout=scale_layout)


mxfp4_gemm_p.def_impl(lambda *args, **params: jax_dispatch.apply_primitive(mxfp4_gemm_p, *args, **params))
mxfp4_gemm_p.def_abstract_eval(_abstract_eval)
batching.primitive_batchers[mxfp4_gemm_p] = _batch
for _platform in LOWERING_TARGETS:
    mlir.register_lowering(
        mxfp4_gemm_p,
        lambda ctx, *a, _p=_platform, **kw: _lowering(ctx, *a, platform=_p, **kw),
        platform=_platform,
    )
