"""Weight-stationary w4a16 MXFP4 GEMM in Pallas Mosaic GPU (NVIDIA Hopper, WGMMA).

Computes ``out = x · Wᵀ`` for a bfloat16 activation x [M, K] (M <= 256, decode sizes) and an
MXFP4 weight W (packed E2M1 bytes [N, K/2], E8M0 scale bytes [N, K/32]) as ``outᵀ = W · xᵀ``:
the weight's rows are the WGMMA M side (64 rows per warpgroup) and its decoded tile is the
REGISTER A operand; the activation rows (padded to a multiple of 16) are the WGMMA N side, read
from shared memory as the B operand. Per K step the weight bytes, the scales and the two halves of
x arrive by TMA (Pallas' pipelined ``pallas_call``); each 32-element block (16 bytes per row) is
loaded into registers in the WGMMA fragment layout (each thread holds the bytes of its fragment
slots), decoded in registers, and multiplied by its block scale broadcast along the row:

- low nibble of byte j = element 2j, high nibble = element 2j+1; the contraction is permuted
  identically on both operands (x split into even and odd elements once,
  :func:`jax_mxfp4.kernels.e2m1_asm.split_even_odd`), so a 16-byte block gives two [64, 16]
  bfloat16 A fragments (low, high) that meet x's even and odd halves: two m64nMk16 WGMMAs;
- E2M1 code c (sign s, magnitude e m) -> bfloat16 bits ``s << 15 | (c & 7) << 6``, which is the
  value x 2^-126 (the exponent field holds e and the E2M1 subnormal 0.5 becomes the bfloat16
  subnormal); one bfloat16 multiply by 2^126 restores it exactly (``decode="mul"``), or the bits
  ``(c & 7) << 6 + 0x3F00`` with selects for codes 0 and 1 build it without subnormals
  (``decode="select"``). Source: the Marlin FP4 decode (vllm csrc/quantization/marlin/dequant.h),
  checked in NumPy on every byte in tests/test_wgemm_mgpu.py;
- the block scale 2^(b-127) is a bfloat16 (:func:`jax_mxfp4.mx_format.e8m0_to_bf16_bits`; byte 0
  the subnormal 2^-127, byte 0xFF NaN), applied last, so E2M1 x scale is exact in bfloat16 and its
  products with x exact in float32; WGMMA accumulates in float32. Results equal backend "xla" up to
  the order of float32 accumulation.

Split-K over the grid fills the GPU when N/64 tiles are few; float32 partial sums are added
afterwards in a fixed order. The scales are passed to the kernel as bfloat16 [K/32, N] (one row per
block, contiguous along N so that a block's 64 scales load as one row vector); :func:`kernel_scales`
builds that form (a weight could keep it, like ``scale_layout``).

Status: lowers for CUDA on a CPU machine (tests/test_wgemm_mgpu.py); correctness and speed on an
H200 are checked by benchmarks/wgemm_mgpu_check.py. Not used by dispatch.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from ..mx_format import BLOCK_SIZE, e8m0_to_bf16_bits
from . import e2m1_asm

DECODES = ("mul", "select", "ptx")
_WG_ROWS = 64  # rows of one warpgroup's WGMMA tile (M side)
_BF16_2P126 = 0x7E80  # bfloat16 bits of 2^126
_SMEM_BUDGET = 200 * 1024  # bytes of shared memory the pipeline may take (sm_90: 227 KiB)


def _plgpu():
    """jax.experimental.pallas.mosaic_gpu, imported lazily (needs jaxlib's Mosaic GPU)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    return plgpu


@dataclasses.dataclass(frozen=True)
class MgpuConfig:
    """Tiling of the Mosaic GPU w4a16 kernel.

    bk: K elements per pipeline step (multiple of 32, divides K / split_k); split_k: K ranges
    summed afterwards; stages: pipeline depth (``max_concurrent_steps``; lowered where shared memory would not fit); decode: ``"mul"`` or
    ``"select"`` (module doc); x_swizzle: shared-memory swizzle of x's tiles in bytes (32: each
    16-element block is one tile).
    """

    bk: int = 256
    split_k: int = 2
    stages: int = 4
    decode: str = "mul"
    x_swizzle: int = 32

    def __post_init__(self):
        if self.decode not in DECODES:
            raise ValueError(f"MgpuConfig.decode must be one of {DECODES}, got {self.decode!r}")
        if self.bk < BLOCK_SIZE or self.bk % BLOCK_SIZE:
            raise ValueError(f"MgpuConfig.bk must be a positive multiple of {BLOCK_SIZE}, got {self.bk}")
        if self.split_k < 1 or self.stages < 1:
            raise ValueError(f"MgpuConfig.split_k and stages must be >= 1, got {self.split_k}, {self.stages}")
        if self.x_swizzle != 32:
            raise ValueError(f"MgpuConfig.x_swizzle must be 32, got {self.x_swizzle}")


def _swizzle(row_bytes: int) -> int:
    """Largest TMA swizzle (bytes) that divides a tile row of ``row_bytes``."""
    for sw in (128, 64, 32):
        if row_bytes % sw == 0:
            return sw
    raise ValueError(f"tile rows of {row_bytes} bytes admit no swizzle (need a multiple of 32)")


def decode_e2m1_bits(code, decode: str = "mul"):
    """E2M1 codes (unsigned ints < 16, any integer array type incl. a Mosaic GPU fragment) ->
    bfloat16 value, by integer operations and one bfloat16 multiply (``"mul"``) or selects
    (``"select"``). Used inside the kernel; jnp-traceable, so tests run it in NumPy/XLA too."""
    c = code.astype(jnp.uint16)
    mag = c & jnp.uint16(7)
    sign = (c & jnp.uint16(8)) << jnp.uint16(12)
    if decode == "mul":
        bits = sign | (mag << jnp.uint16(6))
        two126 = lax.bitcast_convert_type(jnp.uint16(_BF16_2P126), jnp.bfloat16)
        return lax.bitcast_convert_type(bits, jnp.bfloat16) * two126
    if decode == "select":
        bits = (mag << jnp.uint16(6)) + jnp.uint16(0x3F00)
        bits = jnp.where(mag < jnp.uint16(2), mag * jnp.uint16(0x3F00), bits)
        return lax.bitcast_convert_type(sign | bits, jnp.bfloat16)
    raise ValueError(f"decode must be one of {DECODES}, got {decode!r}")


def kernel_scales(w_scales):
    """E8M0 scale bytes uint8 [N, K/32] -> the kernel's form, bfloat16 [K/32, N] (2^(b-127))."""
    bits = e8m0_to_bf16_bits(w_scales)
    return lax.bitcast_convert_type(bits, jnp.bfloat16).T


def _ptx_fragment_order():
    """Column j of a decoded [64, 16] half-fragment (one block) <- byte ``order[j]`` of the
    block's 16 bytes, for the "ptx" decode: in Mosaic GPU's WGMMA_LAYOUT_8BIT each thread holds
    bytes 4g..4g+3 of a row's block (g = lane % 4) and the bf16 WGMMA A layout asks it for
    columns 2g, 2g+1 (register 0) and 8+2g, 8+2g+1 (register 1); the decode turns bytes
    4g, 4g+1 into register 0 and 4g+2, 4g+3 into register 1."""
    j = np.arange(BLOCK_SIZE // 2)
    return 4 * ((j % 8) // 2) + 2 * (j // 8) + j % 2


def split_x(x, decode: str):
    """bfloat16 x [M, K] -> (x_lo, x_hi) [M, K/2]: the elements that meet the decoded low- and
    high-nibble fragments. Natural order (even, odd elements) for "mul"/"select"; for "ptx"
    each block's 16 columns follow :func:`_ptx_fragment_order` (a permutation of the
    contraction applied to both operands)."""
    if decode != "ptx":
        return e2m1_asm.split_even_odd(x)
    m, k = x.shape
    byte = _ptx_fragment_order()
    xb = x.reshape(m, k // BLOCK_SIZE, BLOCK_SIZE)
    return (xb[:, :, 2 * byte].reshape(m, k // 2), xb[:, :, 2 * byte + 1].reshape(m, k // 2))


def _decode_ptx(byt, s_ref, hb: int):
    """Packed bytes uint8 [64, hb] (WGMMA_LAYOUT_8BIT) and the scale block bfloat16 [hb/16, 64]
    (shared memory) -> bfloat16 (lo, hi) [64, hb] in the WGMMA layout, by the inline PTX of
    :mod:`jax_mxfp4.kernels.e2m1_asm` (the same instructions the Triton kernel runs): one 32-bit
    register of 4 bytes -> 4 bfloat16x2 registers (low / high nibbles of bytes 0,1 and 2,3)."""
    plgpu = _plgpu()
    nb = hb // (BLOCK_SIZE // 2)
    ret = plgpu.ShapeDtypeStruct((_WG_ROWS, hb), jnp.bfloat16, layout=plgpu.Layout.WGMMA)

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA_8BIT, plgpu.RefType()), return_type=(ret, ret))
    def decode(ctx, fa, sref):
        del ctx
        import jax.experimental.mosaic.gpu as mgpu
        from jaxlib.mlir import ir
        from jaxlib.mlir.dialects import arith, llvm, memref

        i16, i32 = ir.IntegerType.get_signless(16), ir.IntegerType.get_signless(32)
        index = ir.IndexType.get()
        bf2 = ir.VectorType.get((2,), ir.BF16Type.get())
        regs = fa.registers
        assert regs.shape == (1, nb, 1, 1, 2, 1, 1, 1, 1), regs.shape
        out_shape = (1, 2 * nb, 1, 1, 2, 1, 1, 1, 1)
        lo = np.empty(out_shape, dtype=object)
        hi = np.empty(out_shape, dtype=object)
        struct = llvm.StructType.get_literal([i32] * 4)
        for (row, _col), ridx in zip(fa.layout.thread_idxs(fa.shape), np.ndindex(regs.shape)):
            b, rh = ridx[1], ridx[4]
            sc = memref.load(sref, [arith.constant(index, b), row])
            s32 = arith.extui(i32, arith.bitcast(i16, sc))
            s2 = arith.ori(s32, arith.shli(s32, arith.constant(i32, 16)))
            q = mgpu.utils.bitcast(regs[ridx], i32)
            res = llvm.inline_asm(struct, [q, s2, s2], e2m1_asm._DECODE_PTX, "=r,=r,=r,=r,r,r,r")
            outs = [mgpu.utils.bitcast(llvm.extractvalue(i32, res, [t]), bf2) for t in range(4)]
            for ct in range(2):
                lo[0, 2 * b + ct, 0, 0, rh, 0, 0, 0, 0] = outs[ct]
                hi[0, 2 * b + ct, 0, 0, rh, 0, 0, 0, 0] = outs[2 + ct]
        mk = lambda r: mgpu.FragmentedArray(_registers=r, _layout=mgpu.WGMMA_LAYOUT, _is_signed=None)
        return mk(lo), mk(hi)

    return decode(byt, s_ref)


def _kernel(xe_ref, xo_ref, w_ref, s_ref, o_ref, acc_ref, *, cfg: MgpuConfig, steps: int):
    plgpu = _plgpu()
    half = BLOCK_SIZE // 2  # bytes per row of one block; also the WGMMA K of one half-fragment
    if cfg.decode == "ptx":
        hb = cfg.bk // 2
        byt = plgpu.load(w_ref, (), layout=plgpu.Layout.WGMMA_8BIT)
        lo, hi = _decode_ptx(byt, s_ref, hb)
        plgpu.wgmma(acc_ref, lo, plgpu.transpose_ref(xe_ref, (1, 0)))
        plgpu.wgmma(acc_ref, hi, plgpu.transpose_ref(xo_ref, (1, 0)))
        plgpu.wgmma_wait(0)
    for b in range(0 if cfg.decode == "ptx" else cfg.bk // BLOCK_SIZE):
        byt = plgpu.load(w_ref.at[:, pl.ds(b * half, half)], (), layout=plgpu.Layout.WGMMA,
                         optimized=False)
        sc = plgpu.load(s_ref.at[b], (), layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
        scb = plgpu.layout_cast(lax.broadcast_in_dim(sc, (_WG_ROWS, half), (0,)),
                                plgpu.Layout.WGMMA)
        u = byt.astype(jnp.uint16)
        lo = decode_e2m1_bits(u & jnp.uint16(15), cfg.decode) * scb
        hi = decode_e2m1_bits(u >> jnp.uint16(4), cfg.decode) * scb
        xs = pl.ds(b * half, half)
        plgpu.wgmma(acc_ref, lo, plgpu.transpose_ref(xe_ref.at[:, xs], (1, 0)))
        plgpu.wgmma(acc_ref, hi, plgpu.transpose_ref(xo_ref.at[:, xs], (1, 0)))
    if cfg.decode != "ptx":
        plgpu.wgmma_wait(0)

    @pl.when(pl.program_id(2) == steps - 1)
    def _():
        o_ref[...] = acc_ref[...]


def mgpu_w4a16(x, w_data, w_scales, out_dtype=jnp.bfloat16, cfg: MgpuConfig | None = None,
               *, scales_prepared: bool = False, interpret=False):
    """``x · Wᵀ`` for bfloat16 x [M, K] and MXFP4 W -> [M, N] of ``out_dtype`` (float32 accumulation).

    Args:
      x: bfloat16 [M, K], M <= 256 (activation rows; padded to a multiple of 16 inside).
      w_data: uint8 [N, K/2] packed E2M1 (element 2j in the low nibble of byte j); N % 64 == 0.
      w_scales: uint8 [N, K/32] E8M0 bytes, or (``scales_prepared=True``) the bfloat16 [K/32, N]
        from :func:`kernel_scales`.
      out_dtype: float32, bfloat16 or float16. cfg: :class:`MgpuConfig` (default MgpuConfig()).
    Runs only on an NVIDIA Hopper GPU (sm_90a) through Mosaic GPU.
    Raises:
      ValueError: shapes, dtypes, or a K that is not a multiple of ``cfg.bk * cfg.split_k``.
    """
    cfg = cfg or MgpuConfig()
    plgpu = _plgpu()
    m, k = x.shape
    n, half_k = w_data.shape
    if x.dtype != jnp.bfloat16:
        raise ValueError(f"mgpu_w4a16: x must be bfloat16, got {x.dtype}")
    if w_data.dtype != jnp.uint8 or half_k * 2 != k:
        raise ValueError(f"mgpu_w4a16: w_data must be uint8 [N, K/2] with K={k}, got "
                         f"{w_data.dtype} {w_data.shape}")
    sshape = (k // BLOCK_SIZE, n) if scales_prepared else (n, k // BLOCK_SIZE)
    sdtype = jnp.bfloat16 if scales_prepared else jnp.uint8
    if w_scales.shape != sshape or w_scales.dtype != sdtype:
        raise ValueError(f"mgpu_w4a16: w_scales must be {jnp.dtype(sdtype).name} {sshape}, got "
                         f"{w_scales.dtype} {w_scales.shape}")
    if n % _WG_ROWS:
        raise ValueError(f"mgpu_w4a16: N={n} must be a multiple of {_WG_ROWS}")
    if not 1 <= m <= 256:
        raise ValueError(f"mgpu_w4a16: M={m} must be in [1, 256] (decode sizes)")
    if k % (cfg.bk * cfg.split_k):
        raise ValueError(f"mgpu_w4a16: K={k} is not a multiple of bk*split_k={cfg.bk * cfg.split_k}")
    scales = w_scales if scales_prepared else kernel_scales(w_scales)
    mp = -(-m // 16) * 16
    xp = jnp.pad(x, ((0, mp - m), (0, 0))) if mp != m else x
    xe, xo = split_x(xp, cfg.decode)
    steps = k // (cfg.bk * cfg.split_k)
    nt = n // _WG_ROWS
    hb = cfg.bk // 2
    sw = cfg.x_swizzle if cfg.decode != "ptx" else _swizzle(hb * 2)
    x_tr = (plgpu.TilingTransform((8, sw // 2)), plgpu.SwizzleTransform(sw))
    wsw = _swizzle(hb)
    w_tr = (plgpu.TilingTransform((8, wsw)), plgpu.SwizzleTransform(wsw)) if cfg.decode == "ptx" else ()
    x_spec = plgpu.BlockSpec((mp, hb), lambda i, s, t: (0, s * steps + t), transforms=x_tr)
    # shared memory: x halves, weight bytes and scales per stage, the output block (x2) below the
    # H100/H200 limit of 227 KiB
    per_stage = 2 * mp * hb * 2 + _WG_ROWS * hb + (cfg.bk // BLOCK_SIZE) * _WG_ROWS * 2
    fit = max(1, (_SMEM_BUDGET - 2 * _WG_ROWS * mp * 4) // per_stage)
    out = pl.pallas_call(
        functools.partial(_kernel, cfg=cfg, steps=steps),
        out_shape=jax.ShapeDtypeStruct((cfg.split_k * n, mp), jnp.float32),
        grid=(nt, cfg.split_k, steps),
        in_specs=[
            x_spec, x_spec,
            plgpu.BlockSpec((_WG_ROWS, hb), lambda i, s, t: (i, s * steps + t), transforms=w_tr),
            plgpu.BlockSpec((cfg.bk // BLOCK_SIZE, _WG_ROWS), lambda i, s, t: (s * steps + t, i)),
        ],
        out_specs=plgpu.BlockSpec((_WG_ROWS, mp), lambda i, s, t: (s * nt + i, 0)),
        scratch_shapes=[plgpu.ACC((_WG_ROWS, mp), jnp.float32)],
        compiler_params=plgpu.CompilerParams(
            dimension_semantics=["parallel", "parallel", "sequential"],
            max_concurrent_steps=max(1, min(cfg.stages, steps, fit)),
            lowering_semantics=plgpu.LoweringSemantics.Lane,
        ),
        name="mxfp4_w4a16_mgpu",
        interpret=interpret,
    )(xe, xo, w_data, scales)
    out = out.reshape(cfg.split_k, n, mp).sum(axis=0)
    return out[:, :m].T.astype(out_dtype)
