"""The FP8 GEMM's power-of-two rescale on CUDA: :func:`jax_mxfp4.backends.fp8.rescale` as one Pallas kernel.

After the FP8 GEMM (backend "fp8") every output element is multiplied by 2^(e_row + e_col) and
rounded once to the output dtype, NaN rows and columns poisoned. XLA fuses that into one loop
fusion, which ran at about half of HBM speed on an H200. Here one program owns a [bm, bn] tile
of one batch element: it reads the tile, the bm row and bn column exponents and NaN flags, and
applies :func:`jax_mxfp4.fp8_format.rescale_elements` (imported, not copied: the same float32
operations in the same order), so the result is bit-identical to ``rescale``
(tests/test_rescale_kernel.py in the Pallas interpreter).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .. import checks
from ..fp8_format import rescale_elements  # the rule

DEFAULT_TILE = (32, 256, 8)
"""(bm, bn, num_warps): rows and columns of one program's tile, warps per program (32
elements per thread); not tuned on a GPU."""


def _rescale_kernel(acc_ref, el_ref, er_ref, nl_ref, nr_ref, out_ref, *, m, n, bm, bn):
    # grid (B, N tiles, M tiles): consecutive programs (CUDA's y, after the batch in x) walk along a row
    b, c0, r0 = pl.program_id(0), pl.program_id(1) * bn, pl.program_id(2) * bm
    rmask = (r0 + lax.broadcasted_iota(jnp.int32, (bm,), 0)) < m if m % bm else None
    cmask = (c0 + lax.broadcasted_iota(jnp.int32, (bn,), 0)) < n if n % bn else None
    if rmask is None and cmask is None:
        mask2 = None
    else:
        rm = rmask if rmask is not None else jnp.ones((bm,), jnp.bool_)
        cm = cmask if cmask is not None else jnp.ones((bn,), jnp.bool_)
        mask2 = rm[:, None] & cm[None, :]
    rows, cols = pl.ds(b * m + r0, bm), pl.ds(b * n + c0, bn)  # flattened [B * M] rows, [B * N] cols

    def load(view, mask):
        return plgpu.load(view) if mask is None else plgpu.load(view, mask=mask, other=0)

    acc = load(acc_ref.at[rows, pl.ds(c0, bn)], mask2)
    el, nl = load(el_ref.at[rows], rmask), load(nl_ref.at[rows], rmask)
    er, nr = load(er_ref.at[cols], cmask), load(nr_ref.at[cols], cmask)
    out = rescale_elements(acc, el[:, None] + er[None, :], (nl[:, None] | nr[None, :]) != 0, out_ref.dtype)
    plgpu.store(out_ref.at[rows, pl.ds(c0, bn)], out, mask=mask2)


@functools.partial(jax.jit, static_argnames=("out_dtype", "block", "num_warps", "interpret"))
def rescale_kernel(acc, e_lhs, e_rhs, nan_rows, nan_cols, out_dtype, *, block=None, num_warps=None,
                   interpret: bool = False):
    """:func:`jax_mxfp4.backends.fp8.rescale` in one Pallas kernel (bit-identical).

    Args:
      acc: float32/bfloat16/float16 [B, M, N], the FP8 GEMM's accumulator.
      e_lhs: int32 [B, M] row exponents; e_rhs: int32 [B, N] column exponents, each within
        (-2^30, 2^30) so that their int32 sum does not wrap (the FP8 encoding gives [-133, 121];
        2^30 + 2^30 wraps to -2^31 and scales by 0, not Inf); the rule clips the sum.
      nan_rows: bool [B, M]; nan_cols: bool [B, N]: outputs of these rows / columns are NaN.
      out_dtype: float32, bfloat16 or float16.
      block: (bm, bn) tile of one program, powers of two (default :data:`DEFAULT_TILE`); M and N
        need not be multiples (the edge tiles are masked).
      num_warps: warps per program (default :data:`DEFAULT_TILE`).
      interpret: run the Pallas interpreter (CPU tests).
    Returns:
      out_dtype [B, M, N]: acc x 2^(e_lhs[:, :, None] + e_rhs[:, None, :]), one rounding.
    Raises:
      ValueError: operands whose shapes do not pair up as above, a non-float ``acc`` or output
        dtype, a tile or warp count that is not a power of two.
    """
    checks.check_interpret(interpret, "rescale_kernel")
    if block is not None and (not isinstance(block, tuple) or len(block) != 2):
        raise ValueError(f"rescale_kernel: block must be a (bm, bn) tuple of powers of two, got {block!r}")
    bm, bn = DEFAULT_TILE[:2] if block is None else block
    bm, bn = checks.power_of_two(bm, "rescale_kernel: block[0]"), checks.power_of_two(bn, "rescale_kernel: block[1]")
    num_warps = checks.power_of_two(DEFAULT_TILE[2] if num_warps is None else num_warps, "rescale_kernel: num_warps",
                                    most=32)
    out_dtype = np.dtype(out_dtype)
    floats = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
    if acc.ndim != 3 or np.dtype(acc.dtype) not in floats or out_dtype not in floats:
        raise ValueError(f"rescale_kernel: acc must be a float32/bfloat16/float16 [B, M, N] array and "
                         f"out_dtype one of those, got {acc.dtype}{list(acc.shape)} -> {out_dtype}")
    bsz, m, n = acc.shape
    want = {"e_lhs": ((bsz, m), "int32"), "e_rhs": ((bsz, n), "int32"),
            "nan_rows": ((bsz, m), "bool"), "nan_cols": ((bsz, n), "bool")}
    for name, v in zip(want, (e_lhs, e_rhs, nan_rows, nan_cols)):
        shape, dt = want[name]
        if tuple(v.shape) != shape or np.dtype(v.dtype) != np.dtype(dt):
            raise ValueError(f"rescale_kernel: {name} must be {dt} {list(shape)} for acc {list(acc.shape)}, "
                             f"got {v.dtype}{list(v.shape)}")
    if acc.size == 0:  # nothing to launch
        return jnp.zeros(acc.shape, out_dtype)
    bm = min(bm, 1 << max(0, (m - 1).bit_length()))  # no tile taller / wider than the array needs
    bn = min(bn, 1 << max(0, (n - 1).bit_length()))
    kernel = functools.partial(_rescale_kernel, m=m, n=n, bm=bm, bn=bn)
    flat = lambda v: v.reshape(-1)  # noqa: E731
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((bsz * m, n), out_dtype),
        grid=(bsz, pl.cdiv(n, bn), pl.cdiv(m, bm)),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="mxfp4_fp8_rescale",
    )(acc.reshape(bsz * m, n), flat(e_lhs), flat(e_rhs), flat(nan_rows).astype(jnp.int32),
      flat(nan_cols).astype(jnp.int32))
    return out.reshape(bsz, m, n)
