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
from jax import lax
from jax.experimental import pallas as pl

from ..mx_format import BLOCK_SIZE, e8m0_to_bf16_bits
from .e2m1_asm import split_even_odd

DECODES = ("mul", "select")
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


def _kernel(xe_ref, xo_ref, w_ref, s_ref, o_ref, acc_ref, *, cfg: MgpuConfig, steps: int):
    plgpu = _plgpu()
    half = BLOCK_SIZE // 2  # bytes per row of one block; also the WGMMA K of one half-fragment
    for b in range(cfg.bk // BLOCK_SIZE):
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
    xe, xo = split_even_odd(xp)
    steps = k // (cfg.bk * cfg.split_k)
    nt = n // _WG_ROWS
    hb = cfg.bk // 2
    sw = cfg.x_swizzle
    x_tr = (plgpu.TilingTransform((8, sw // 2)), plgpu.SwizzleTransform(sw))
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
            plgpu.BlockSpec((_WG_ROWS, hb), lambda i, s, t: (i, s * steps + t)),
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
