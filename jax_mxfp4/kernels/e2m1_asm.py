"""E2M1 decode in a few integer operations per element: inline PTX for Pallas on NVIDIA GPUs.

``decode_scaled_halves(data, scale)`` turns a tile of packed MXFP4 bytes ``uint8 [r, c]`` and the
per-byte bfloat16 block scale ``[r, c]`` into two bfloat16 tiles ``(lo, hi)`` [r, c]: the values
of the low nibbles (elements 2j) and of the high nibbles (elements 2j+1) times the scale. The
GEMM meets them with the even and the odd elements of the other operand
(``split_even_odd``): a contraction may be permuted freely as long as both operands agree, so
the weight's nibbles are never interleaved.

Per 4 bytes (one 32-bit register ``q``, 8 values), in the manner of vLLM's Marlin
(vllm-project/vllm csrc/quantization/marlin/dequant.h): two ``prmt`` spread the bytes into
16-bit lanes, then per lane pair ``((t << a) & 0x80008000) | ((t << b) & 0x01C001C0)`` moves the
nibble's sign to bfloat16's sign bit and its magnitude bits e1 e0 m into bfloat16's lowest
exponent bits and leading mantissa bit: the lane is the exact bfloat16 E2M1 x 2^-126 (the E2M1
subnormal 0.5 becomes a bfloat16 subnormal). Two ``mul.rn.bf16x2``, by 2^126 and by the E8M0
scale 2^(s-127), are exact (powers of two times 2-bit significands; the scale comes last, so every
E8M0 byte, 0x00 and 0xFF included, gives what the float32 reference gives, up to its flush of
values below 2^-126). 22 integer and 8 bfloat16x2 instructions per 8 values (PTX, before
ptxas merges and/or pairs into LOP3), against ~20
instructions per value for the portable float16-bits decode. Every
output element depends on its own byte and scale only (Triton may pack any 4 of a thread's
elements into one asm instance).

``_DECODE_PAIRS_PTX`` (the Mosaic GPU kernel's "pairs" decode) keeps each byte's two values
together instead: byte k of the register -> one bfloat16x2 register (low nibble in the low lane),
one ``prmt`` per byte against the register shifted right by 4, then the same lane formula.

The inline assembly is PTX for Hopper and later: ``mul.rn.bf16x2`` needs sm_90 (PTX ISA;
ptxas refuses it for sm_80-sm_89, tests/test_cuda_compile.py), so :data:`MIN_COMPUTE_CAPABILITY`.
Ampere and Ada GPUs, ROCm and the Pallas interpreter take the portable decode
(``jax_mxfp4.kernels.wgemm._dequant_halves``), which gives the same values.

Workaround kept here: ``jax.experimental.pallas.triton.elementwise_inline_asm`` cannot lower an
asm with more than one result in jax 0.10/0.11 (its lowering wraps the op's result list in a
second list: "... has multiple results, but 2 outvars do not match 1 outvals"), so this module
binds its own primitive with the same abstract evaluation and a lowering that returns the list.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core as jax_core

def _scaled(out, scale):
    """PTX: register ``a`` (bfloat16x2 of E2M1 x 2^-126 per lane) x 2^126 (register ``k``) x ``scale``
    into ``out``; exact in bfloat16 (the E2M1 0.5 passes through the subnormal 2^-127)."""
    return f"""mul.rn.bf16x2 a, a, k;
mul.rn.bf16x2 {out}, a, {scale};
"""


def _lanes(out, src, sign_shift, mag_shift, scale):
    """PTX for one lane pair: the nibble at bits [shift..shift+3] of each 16-bit lane of ``src``
    -> bfloat16 E2M1 x 2^-126 (sign to bit 15, magnitude e1 e0 m to bits 8..6), x 2^126, x scale."""
    return f"""shl.b32 a, {src}, {sign_shift};
shl.b32 b, {src}, {mag_shift};
and.b32 a, a, 0x80008000;
and.b32 b, b, 0x01C001C0;
or.b32 a, a, b;
""" + _scaled(out, scale)


_DECODE_PTX = (
    "{\n.reg .b32 t0, t1, a, b, k;\nmov.b32 k, 0x7E807E80;\n"
    "prmt.b32 t0, $4, 0, 0x4140;\nprmt.b32 t1, $4, 0, 0x4342;\n"  # bytes 0,1 | 2,3 -> 16-bit lanes
    + _lanes("$0", "t0", 12, 6, "$5") + _lanes("$1", "t1", 12, 6, "$6")  # low nibbles
    + _lanes("$2", "t0", 8, 2, "$5") + _lanes("$3", "t1", 8, 2, "$6")  # high nibbles
    + "}"
)
# $0,$1: lo (low nibbles of bytes 0,1 | 2,3); $2,$3: hi (high nibbles of bytes 0,1 | 2,3);
# $4: the 4 packed bytes; $5,$6: the scales of bytes 0,1 | 2,3. Every output element depends on
# its own byte and scale only: Triton may pack any 4 of a thread's elements into one instance.

def _lane_pair(out, src, mask, mult, fold=False):
    """PTX for one output of the "lanes" decode: the two nibbles of ``src`` under ``mask`` (one per
    16-bit lane, at bits 0-3 or 4-7 of the lane) times ``mult`` (0x1040 = shifts 12 and 6, 0x104
    = shifts 8 and 2, no overlapping copies, so no carries): the sign lands on bit 15, the
    magnitude e1 e0 m on bits 8..6 of each lane; then x 2^126 and x scale (:func:`_scaled`), or
    (``fold``) one multiply by ``$5`` = 2^126 x scale (:data:`FOLD_MAX_BYTE`)."""
    return f"""and.b32 u, {src}, {mask:#010x};
mul.lo.u32 a, u, {mult:#x};
and.b32 a, a, 0x81C081C0;
""" + (f"mul.rn.bf16x2 {out}, a, $5;\n" if fold else _scaled(out, "$5"))


# "lanes" (the Mosaic GPU kernel's decode for weights stored in the "lanes" nibble order,
# jax_mxfp4.decode_prepared.lanes_order_bytes): the register holds the low-lane nibbles of its four
# outputs at bits 0-15 (output k at bits 4k..4k+3) and the high-lane nibbles at bits 16-31, so each
# output is a mask and one multiply away (outputs 2, 3 from the register shifted right by 8): 13
# PTX integer instructions per register against 17 for "pairs" (a prmt more per output; 25 with
# two shifts and three logic operations per output instead).
_DECODE_LANES_PTX = (
    "{\n.reg .b32 q8, u, a, k;\nmov.b32 k, 0x7E807E80;\nshr.u32 q8, $4, 8;\n"
    + _lane_pair("$0", "$4", 0x000F000F, 0x1040) + _lane_pair("$1", "$4", 0x00F000F0, 0x104)
    + _lane_pair("$2", "q8", 0x000F000F, 0x1040) + _lane_pair("$3", "q8", 0x00F000F0, 0x104)
    + "}"
)


# "lanes" with the two multiplies folded into one (the Mosaic GPU kernels' folded scale, wgemm_mgpu._decode_folded):
# $5 = the bfloat16x2 of 2^126 x 2^(b-127) = 2^(b-1), exact and finite for E8M0 bytes b <= 128
# (b = 0 gives 2^-1 = 0x3F00: no exception to select), built as b x FOLD_SCALE_MUL +
# FOLD_SCALE_ADD; E2M1 x 2^-126 (a subnormal for the 0.5) times 2^(b-1) is E2M1 x 2^(b-127) exactly,
# the value of the two-multiply form, for every such b (tests/test_wgemm.py, PTX model). Bytes
# above 128 (scales > 2) take the two-multiply form: 2^(b-1) would overflow bfloat16.
FOLD_MAX_BYTE = 128
FOLD_SCALE_MUL = 0x00800080  # b << 7 in both 16-bit lanes
FOLD_SCALE_ADD = 0x3F003F00  # + 126 << 7: the exponent field of 2^(b-1)
_DECODE_LANES_FOLD_PTX = (
    "{\n.reg .b32 q8, u, a;\nshr.u32 q8, $4, 8;\n"
    + _lane_pair("$0", "$4", 0x000F000F, 0x1040, True) + _lane_pair("$1", "$4", 0x00F000F0, 0x104, True)
    + _lane_pair("$2", "q8", 0x000F000F, 0x1040, True) + _lane_pair("$3", "q8", 0x00F000F0, 0x104, True)
    + "}"
)


# Pair decode (the Mosaic GPU kernels' "pairs" decode): each byte -> one bfloat16x2 register
# holding its two elements in order (low nibble = element 2j in the low lane, high nibble = element
# 2j+1 in the high lane), the layout a bfloat16 WGMMA A fragment wants for two consecutive K
# columns. Per byte k: one prmt puts byte k of q into the low lane and byte k of q >> 4 (whose low
# nibble is byte k's high nibble) into the high lane; then the "lanes" formula on the nibbles at
# bits 0-3 of each lane (_lane_pair: a mask and one integer multiply: 4 integer
# instructions per output instead of the prmt, two shifts and three logic operations).
# $0..$3: bytes 0..3 of $4; $5: the block scale in both lanes (all four bytes share one block), or
# (the _FOLD form, for E8M0 bytes <= FOLD_MAX_BYTE) 2^(b-1) as for "lanes".
_PAIR_SELECTORS = (0x4400, 0x5511, 0x6622, 0x7733)  # byte k of {q (0-3), q >> 4 (4-7)} per lane


def _pairs_ptx(fold: bool) -> str:
    return ("{\n.reg .b32 q4, t, u, a" + ("" if fold else ", k") + ";\n" + ("" if fold else "mov.b32 k, 0x7E807E80;\n")
            + "shr.u32 q4, $4, 4;\n"
            + "".join(f"prmt.b32 t, $4, q4, {sel:#06x};\n" + _lane_pair(f"${i}", "t", 0x000F000F, 0x1040, fold)
                      for i, sel in enumerate(_PAIR_SELECTORS))
            + "}")


DECODE_PAIRS_CONSTRAINTS = "=r,=r,=r,=r,r,r"


_DECODE_PAIRS_PTX = _pairs_ptx(False)
_DECODE_PAIRS_FOLD_PTX = _pairs_ptx(True)


# Natural bytes -> the "pairs" order in registers (the large-tile kernel's "natural" decode, for a
# plain MXFP4Array weight): in the 8-bit WGMMA layout the four threads of a quad (lanes 4r..4r+3)
# hold one weight row's 16-byte block, thread l its natural bytes 4l..4l+3, while the "pairs"
# decode wants byte 4t + l in position t (jax_mxfp4.decode_prepared.pair_order_bytes: a 4x4 byte
# transpose). Two butterfly exchanges do it: with lane l ^ 1 the bytes of the other lane's parity
# (A[l1,l0][t1,t0] -> A[l1,t0][t1,l0]), then with lane l ^ 2 (-> A[t1,t0][l1,l0]); each a
# shfl.sync.bfly and one prmt whose selector depends on the lane (QUAD_SELECTORS_PTX, once per
# decode). All 32 threads of the warp must execute it (full-mask shfl.sync).
# QUAD_SELECTORS_PTX: $0 = the selector of the l ^ 1 exchange, $1 = that of the l ^ 2 exchange.
QUAD_SELECTORS_PTX = (
    "{\n.reg .b32 l;\n.reg .pred p;\n"
    "mov.u32 l, %laneid;\nand.b32 l, l, 1;\nsetp.ne.u32 p, l, 0;\nselp.b32 $0, 0x3715, 0x6240, p;\n"
    "mov.u32 l, %laneid;\nand.b32 l, l, 2;\nsetp.ne.u32 p, l, 0;\nselp.b32 $1, 0x3276, 0x5410, p;\n}"
)
QUAD_SELECTORS_CONSTRAINTS = "=r,=r"
# QUAD_TRANSPOSE_PTX: $0 = the transposed word of $1 (this thread's natural bytes); $2, $3 the selectors.
QUAD_TRANSPOSE_PTX = (
    "{\n.reg .b32 r, t;\n"
    "shfl.sync.bfly.b32 r, $1, 1, 0x1f, 0xffffffff;\nprmt.b32 t, $1, r, $2;\n"
    "shfl.sync.bfly.b32 r, t, 2, 0x1f, 0xffffffff;\nprmt.b32 $0, t, r, $3;\n}"
)
QUAD_TRANSPOSE_CONSTRAINTS = "=r,r,r,r"


# $0 = 1 if $1 != 0 in every thread of the warp, else 0 (all 32 threads must execute it)
WARP_ALL_PTX = ("{\n.reg .pred p, q;\nsetp.ne.u32 p, $1, 0;\nvote.sync.all.pred q, p, 0xffffffff;\n"
                "selp.u32 $0, 1, 0, q;\n}")


def fold_scale_bits(b: int) -> int:
    """bfloat16x2 bits (both lanes) of 2^(b-1) for an E8M0 byte 0 <= b <= FOLD_MAX_BYTE: the
    ``$5`` of ``_DECODE_LANES_FOLD_PTX`` (the kernel computes the same with two integer operations).
    Raises TypeError for a non-int (bool included; NumPy integers are taken), ValueError outside
    0..FOLD_MAX_BYTE (2^(b-1) would overflow bfloat16)."""
    if isinstance(b, (bool, np.bool_)) or not isinstance(b, (int, np.integer)):
        raise TypeError(f"fold_scale_bits: E8M0 byte must be an int, got {b!r}")
    b = int(b)  # a NumPy uint8 byte would overflow in b x FOLD_SCALE_MUL
    if not 0 <= b <= FOLD_MAX_BYTE:
        raise ValueError(f"fold_scale_bits: E8M0 byte must be in 0..{FOLD_MAX_BYTE}, got {b}")
    return (b * FOLD_SCALE_MUL + FOLD_SCALE_ADD) & 0xFFFFFFFF


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


MIN_COMPUTE_CAPABILITY = (9, 0)
"""The GPUs whose ptxas takes this module's PTX (``mul.rn.bf16x2``: sm_90 and later)."""

try:  # the Triton lowering is private API: without it only the portable decode is offered
    _register_lowering()
    LOWERING_ERROR = None
except Exception as e:  # pragma: no cover - depends on the installed jax
    LOWERING_ERROR = f"{type(e).__name__}: {e}"


def decode_scaled_halves(data, scale):
    """uint8 [r, c] packed bytes, bfloat16 [r, c] per-byte scale -> bfloat16 (lo, hi) [r, c]:
    E2M1(low nibble) x scale and E2M1(high nibble) x scale. Only inside a Pallas Triton kernel on
    an NVIDIA GPU; c must be a multiple of 4."""
    shp = jax.ShapeDtypeStruct(data.shape, jnp.bfloat16)
    lo, hi = _asm_p.bind(
        data, scale, asm=_DECODE_PTX, constraints="=r,=r,=r,=r,r,r,r", pack=4,
        result_shape_dtypes=(shp, shp),
    )
    return lo, hi


def split_even_odd(x):
    """Float operand [..., K] -> (even, odd) elements, each [..., K/2]: the halves that meet the
    low-nibble and high-nibble decoded tiles (byte j holds elements 2j and 2j+1)."""
    xr = x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
    return xr[..., 0], xr[..., 1]
