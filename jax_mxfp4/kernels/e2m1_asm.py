"""E2M1 decode in a few integer operations per element: inline PTX for Pallas on NVIDIA GPUs.

``decode_scaled_halves(data, scale)`` turns a tile of packed MXFP4 bytes ``uint8 [r, c]`` and the
per-byte bfloat16 block scale ``[r, c]`` into two bfloat16 tiles ``(lo, hi)`` [r, c]: the values
of the low and the high nibbles, times the scale, in a **permuted order within every group of 4
bytes**: position p of a group holds byte ``BYTE_ORDER[p]`` = (0, 2, 1, 3)[p]. The caller permutes
the other GEMM operand's contraction identically (``permute_contraction``): a contraction may be
permuted freely as long as both operands agree, so the weight's nibbles are never interleaved.

Per 4 bytes (8 values; one 32-bit register ``q``; "Marlin"-style, vllm-project/vllm
csrc/quantization/marlin/dequant.h): three shifts of q put each nibble in the top 4 bits of a
16-bit lane; ``(x & 0x80008000) | ((x >> 6) & 0x01C001C0)`` then moves the magnitude bits e1 e0 m
into bfloat16's lowest exponent bits and leading mantissa bit, which makes the lane the exact
bfloat16 value E2M1 x 2^-126 (the E2M1 subnormal 0.5 becomes a bfloat16 subnormal). Two
``mul.rn.bf16x2`` by 2^126 and by the E8M0 scale 2^(s-127) are exact (products of powers of two
and 2-bit significands; the scale is applied last so any E8M0 byte, 0x00 and 0xFF included,
gives what the reference gives). ~15 integer and 8 bfloat16x2 instructions per 8 values, against
~20 per value for the float16-bits decode of :mod:`jax_mxfp4.kernels.gemm`.

The inline assembly is PTX: NVIDIA only. ROCm and the Pallas interpreter take the portable
decode (``jax_mxfp4.kernels.gemm._dequant_halves``, natural order).

Workaround kept here: ``jax.experimental.pallas.triton.elementwise_inline_asm`` cannot lower an
asm with more than one result in jax 0.10/0.11 (its lowering wraps the op's result list in a
second list: "... has multiple results, but 2 outvars do not match 1 outvals"), so this module
binds its own primitive with the same abstract evaluation and a lowering that returns the list.
"""

from __future__ import annotations

import numpy as np

import jax
import jax.numpy as jnp
from jax._src import core as jax_core

BYTE_ORDER = (0, 2, 1, 3)
"""Position p of each 4-byte group of a decoded tile holds the nibbles of byte BYTE_ORDER[p]."""

_DECODE_PTX = """{
.reg .b32 x0, x1, x2, x3, m0, m1, m2, m3, k;
mov.b32 k, 0x7E807E80;
shl.b32 x1, $4, 4;
shl.b32 x2, $4, 8;
shl.b32 x3, $4, 12;
shr.u32 m0, $4, 6;
shr.u32 m1, x1, 6;
shr.u32 m2, x2, 6;
shr.u32 m3, x3, 6;
and.b32 m0, m0, 0x01C001C0;
and.b32 m1, m1, 0x01C001C0;
and.b32 m2, m2, 0x01C001C0;
and.b32 m3, m3, 0x01C001C0;
and.b32 x0, $4, 0x80008000;
and.b32 x1, x1, 0x80008000;
and.b32 x2, x2, 0x80008000;
and.b32 x3, x3, 0x80008000;
or.b32 x0, x0, m0;
or.b32 x1, x1, m1;
or.b32 x2, x2, m2;
or.b32 x3, x3, m3;
mul.rn.bf16x2 x0, x0, k;
mul.rn.bf16x2 x1, x1, k;
mul.rn.bf16x2 x2, x2, k;
mul.rn.bf16x2 x3, x3, k;
mul.rn.bf16x2 $0, x3, $5;
mul.rn.bf16x2 $1, x1, $6;
mul.rn.bf16x2 $2, x2, $5;
mul.rn.bf16x2 $3, x0, $6;
}"""
# $0,$1: lo (bytes 0,2 | 1,3 low nibbles); $2,$3: hi (bytes 0,2 | 1,3 high nibbles);
# $4: the 4 packed bytes; $5,$6: the scale of bytes 0,1 | 2,3 (one block: all four equal).

_asm_p = jax_core.Primitive("jax_mxfp4_inline_asm")
_asm_p.multiple_results = True


@_asm_p.def_abstract_eval
def _abstract_eval(*avals, result_shape_dtypes, **_):
    if any(a.shape != avals[0].shape for a in avals):
        raise ValueError("inline asm arguments must have the same shape")
    return [jax_core.ShapedArray(s.shape, s.dtype) for s in result_shape_dtypes]


def _register_lowering():
    from jax._src.interpreters import mlir
    from jax._src.lib.triton import dialect as tt_dialect
    from jax._src.pallas.triton import lowering

    def rule(ctx, *args, asm, constraints, pack, result_shape_dtypes):
        del result_shape_dtypes
        res = tt_dialect.elementwise_inline_asm(
            [mlir.aval_to_ir_type(ctx.context.mlir_ctx, a) for a in ctx.avals_out],
            asm, constraints=constraints, pure=True, packed_element=pack, args=args,
        )
        return list(res) if len(ctx.avals_out) > 1 else [res]

    lowering.register_lowering(_asm_p)(rule)


try:  # the Triton lowering is private API: without it only the portable decode is offered
    _register_lowering()
    LOWERING_ERROR = None
except Exception as e:  # pragma: no cover - depends on the installed jax
    LOWERING_ERROR = f"{type(e).__name__}: {e}"


def decode_scaled_halves(data, scale):
    """uint8 [r, c] packed bytes, bfloat16 [r, c] per-byte scale -> bfloat16 (lo, hi) [r, c].

    Position p of each group of 4 bytes holds byte ``BYTE_ORDER[p]`` of the group; c must be a
    multiple of 4 and each group of 4 bytes must share one scale (16 bytes = one 32-block).
    Only inside a Pallas Triton kernel on an NVIDIA GPU.
    """
    shp = jax.ShapeDtypeStruct(data.shape, jnp.bfloat16)
    lo, hi = _asm_p.bind(
        data, scale, asm=_DECODE_PTX, constraints="=r,=r,=r,=r,r,r,r", pack=4,
        result_shape_dtypes=(shp, shp),
    )
    return lo, hi


def permute_contraction(x, order=BYTE_ORDER):
    """Split a float operand [..., K] into the halves that meet the (lo, hi) decoded tiles.

    Returns (x_lo, x_hi), each [..., K/2]: x_lo[..., 4g + p] = x[..., 8g + 2 order[p]] and
    x_hi[..., 4g + p] = x[..., 8g + 2 order[p] + 1]. ``order=(0, 1, 2, 3)`` is the natural order
    (even and odd elements) used with the portable decode. K must be a multiple of 8.
    """
    k = x.shape[-1]
    xr = x.reshape(*x.shape[:-1], k // 8, 4, 2)
    if tuple(order) != (0, 1, 2, 3):
        xr = jnp.take(xr, np.asarray(order), axis=-2)
    return xr[..., 0].reshape(*x.shape[:-1], k // 2), xr[..., 1].reshape(*x.shape[:-1], k // 2)
