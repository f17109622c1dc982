"""Weight-stationary MXFP4 GEMM in Pallas (Triton lowering): w4a16, and a4w4 at decode sizes.

Computes ``out[b] = x[b] · W[b]ᵀ`` for a bfloat16 operand x [B, M, K] and an MXFP4 operand W
(packed bytes [B, N, K/2], E8M0 scale bytes [B, N, K/32]). The weight rows sit on the matrix
units' M side (``bn`` rows per tile, decoded in registers inside the K loop); the activation
rows on the N side (``bm``, down to 16, so a decode-size GEMM wastes no tensor-core work on
padding rows). x is split once into its even and odd elements
(:func:`jax_mxfp4.kernels.e2m1_asm.split_even_odd`), so each decoded half-tile (low or high
nibbles) meets a contiguous bfloat16 half-tile of x: two dots per K step, no nibble interleave.
Decode: ``"asm"`` (inline PTX, NVIDIA), ``"f16"`` (portable: ROCm's Triton and the interpreter).
Split-K fills the GPU when N gives few tiles; float32 partial sums are added afterwards in a
fixed order (deterministic).

Exactness: decoded values E2M1 x 2^(s-127) are exact in bfloat16, bfloat16 products exact in
float32, accumulation float32: results equal backend "xla" up to the order of float32
accumulation (tests/test_pallas_gemm.py in the interpreter; tests/gpu/test_gpu_wgemm.py on a GPU).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .. import checks
from ..platform import sm_count
from ..mx_format import (
    BLOCK_SIZE,
    e2m1_times_2pow_minus14,
    e8m0_to_bf16_bits,
    flush_below_normal,
    scale_factors_for_f16_codes,
)
from . import e2m1_asm

DECODES = ("asm", "f16")


@dataclasses.dataclass(frozen=True)
class WTileConfig:
    """Tiling of the weight-stationary kernel.

    bn: weight rows per tile (MMA M side; 64, 128 or 256); bm: activation rows per tile (MMA N
    side; power of two >= 16); bk: K elements per step (power of two >= 64); split_k: K ranges
    summed afterwards; num_warps, num_stages: Triton launch parameters; decode: see module doc;
    layout3d: decode on [bn, bk/32, 16] tiles (block scales broadcast along the last axis) rather
    than on [bn, bk/2] tiles (scales broadcast then reshaped).
    """

    bn: int = 128
    bm: int = 16
    bk: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    decode: str = "asm"
    layout3d: bool = False

    def __post_init__(self):
        if self.decode not in DECODES:
            raise ValueError(f"WTileConfig.decode must be one of {DECODES}, got {self.decode!r}")
        for name, lo in (("bn", 16), ("bm", 16), ("bk", 32)):
            v = getattr(self, name)
            if v < lo or v & (v - 1):
                raise ValueError(f"WTileConfig.{name} must be a power of two >= {lo}, got {v}")
        if self.split_k < 1:
            raise ValueError(f"WTileConfig.split_k must be >= 1, got {self.split_k}")


def _dequant_halves(data, scale_bytes):
    """The portable decode (ROCm's Triton, the interpreter): uint8 data [r, bk/2] and scale bytes
    [r, bk/32] -> bf16 (low, high) nibble values [r, bk/2].

    low[:, j] is element 2j, high[:, j] element 2j+1; both use scale block j // 16.
    """
    r, half = data.shape
    nb = half // (BLOCK_SIZE // 2)
    f1, f2 = scale_factors_for_f16_codes(scale_bytes)
    f1 = f1.reshape(r, nb, 1)
    f2 = f2.reshape(r, nb, 1)
    d = data.reshape(r, nb, BLOCK_SIZE // 2)

    def scaled(v):
        return flush_below_normal((v.astype(jnp.float32) * f1) * f2).astype(jnp.bfloat16).reshape(r, half)

    return scaled(e2m1_times_2pow_minus14(d & 0xF)), scaled(e2m1_times_2pow_minus14(d >> 4))


def _decoded_weight_tile(data, sbytes, bn, bk, cfg):
    """Packed bytes [bn, bk/2] and scale bytes [bn, bk/32] -> bfloat16 (lo, hi) [bn, bk/2]:
    the values of elements 2j and 2j+1."""
    half, nb = bk // 2, bk // BLOCK_SIZE
    if cfg.decode != "asm":
        return _dequant_halves(data, sbytes)
    scale = lax.bitcast_convert_type(e8m0_to_bf16_bits(sbytes), jnp.bfloat16)
    if cfg.layout3d:
        d3 = data.reshape(bn, nb, BLOCK_SIZE // 2)
        s3 = jnp.broadcast_to(scale[:, :, None], d3.shape)
        lo, hi = e2m1_asm.decode_scaled_halves(d3, s3)
        return lo.reshape(bn, half), hi.reshape(bn, half)
    s2 = jnp.broadcast_to(scale[:, :, None], (bn, nb, BLOCK_SIZE // 2)).reshape(bn, half)
    return e2m1_asm.decode_scaled_halves(data, s2)


def _decoded_weight(w_ref, s_ref, b, n0, bn, kb0, bk, n_mask, cfg):
    """Load and decode one weight tile (rows past N read as zeros)."""
    data = plgpu.load(w_ref.at[b, pl.ds(n0, bn), pl.ds(kb0 // 2, bk // 2)], mask=n_mask[:, None], other=0)
    sbytes = plgpu.load(s_ref.at[b, pl.ds(n0, bn), pl.ds(kb0 // BLOCK_SIZE, bk // BLOCK_SIZE)],
                        mask=n_mask[:, None], other=127)
    return _decoded_weight_tile(data, sbytes, bn, bk, cfg)


def _kernel(xlo_ref, xhi_ref, w_ref, s_ref, o_ref, *, m, n, cfg: WTileConfig, k_per_split,
            n_tiles_n):
    bn, bm, bk = cfg.bn, cfg.bm, cfg.bk
    pid = pl.program_id(0)
    tile_n = pid % n_tiles_n
    tile_m = pid // n_tiles_n
    bs = pl.program_id(1)
    b = bs // cfg.split_k
    sidx = bs % cfg.split_k
    n0, m0 = tile_n * bn, tile_m * bm
    n_mask = (n0 + lax.broadcasted_iota(jnp.int32, (bn,), 0)) < n
    m_mask = (m0 + lax.broadcasted_iota(jnp.int32, (bm,), 0)) < m
    k_begin = sidx * k_per_split
    dims = (((1,), (1,)), ((), ()))

    def body(t, acc):
        kb0 = k_begin + t * bk
        lo, hi = _decoded_weight(w_ref, s_ref, b, n0, bn, kb0, bk, n_mask, cfg)
        xs = pl.ds(kb0 // 2, bk // 2)
        x_lo = plgpu.load(xlo_ref.at[b, pl.ds(m0, bm), xs], mask=m_mask[:, None], other=0)
        x_hi = plgpu.load(xhi_ref.at[b, pl.ds(m0, bm), xs], mask=m_mask[:, None], other=0)
        acc = acc + lax.dot_general(lo, x_lo, dims, preferred_element_type=jnp.float32)
        return acc + lax.dot_general(hi, x_hi, dims, preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, k_per_split // bk, body, jnp.zeros((bn, bm), jnp.float32))
    plgpu.store(o_ref.at[bs, pl.ds(m0, bm), pl.ds(n0, bn)], acc.T.astype(o_ref.dtype),
                mask=m_mask[:, None] & n_mask[None, :])


def weight_stationary_gemm(x, w_data, w_scales, *, out_dtype, cfg: WTileConfig,
                           interpret: bool = False):
    """``out[b] = x[b] · W[b]ᵀ`` with W MXFP4 -> [B, M, N] of ``out_dtype``, float32-accumulated.

    Args:
      x: bfloat16 [B, M, K] (the float operand, natural element order).
      w_data: uint8 [B, N, K/2] packed E2M1 (element 2j in the low nibble of byte j).
      w_scales: uint8 [B, N, K/32] E8M0 scale bytes (plain layout).
      out_dtype: float32, bfloat16 or float16. cfg: :class:`WTileConfig` (``decode="asm"`` only on
        NVIDIA GPUs). interpret: run the Pallas interpreter (CPU tests; needs a portable decode).
    Raises:
      ValueError: K not a multiple of ``cfg.bk * cfg.split_k``, mismatched shapes, dtypes, or the
        asm decode requested in the interpreter.
    """
    checks.check_interpret(interpret, "weight_stationary_gemm")
    bsz, m, k = x.shape
    if w_data.shape[0] != bsz or w_data.shape[2] * 2 != k or w_scales.shape != (*w_data.shape[:2], k // BLOCK_SIZE):
        raise ValueError(f"weight_stationary_gemm: x {x.shape}, w_data {w_data.shape} and w_scales "
                         f"{w_scales.shape} do not describe [B, M, K] x [B, N, K/2] / [B, N, K/32]")
    if x.dtype != jnp.bfloat16:
        raise ValueError(f"weight_stationary_gemm: x must be bfloat16, got {x.dtype}")
    if k % (cfg.bk * cfg.split_k):
        raise ValueError(f"weight_stationary_gemm: K={k} is not a multiple of bk*split_k="
                         f"{cfg.bk * cfg.split_k}")
    if interpret and cfg.decode == "asm":
        raise ValueError('weight_stationary_gemm: decode="asm" (inline PTX) cannot run in the interpreter')
    n = w_data.shape[1]
    x_lo, x_hi = e2m1_asm.split_even_odd(x)
    n_tiles_n = pl.cdiv(n, cfg.bn)
    n_tiles_m = pl.cdiv(m, cfg.bm)
    split = cfg.split_k > 1
    kdtype = jnp.float32 if split else jnp.dtype(out_dtype)
    kernel = functools.partial(_kernel, m=m, n=n, cfg=cfg, k_per_split=k // cfg.split_k,
                               n_tiles_n=n_tiles_n)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((bsz * cfg.split_k, m, n), kdtype),
        grid=(n_tiles_n * n_tiles_m, bsz * cfg.split_k),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="mxfp4_wgemm",
    )(x_lo, x_hi, w_data, w_scales)
    if split:
        out = out.reshape(bsz, cfg.split_k, m, n).sum(axis=1)
    return out.astype(out_dtype)


def default_wconfig(m: int, n: int, k: int, batch: int = 1, decode: str = "asm",
                    num_sms: int | None = None) -> WTileConfig:
    """Tiling by shape (an NVIDIA H200 sweep, docs/performance.md): bm covers the activation
    rows (16..128), bn = 128 weight rows, bk = 256, the 3-D decode layout at decode sizes, split-K
    until the grid has ~2 (bm <= 64) or ~4 (bm = 128) tiles per SM; ``num_sms`` (None: the
    device's own count, :func:`jax_mxfp4.platform.sm_count`)."""
    num_sms = num_sms or sm_count() or 1  # the interpreter (CPU) has no processors to fill: one
    bk = 256
    while k % bk and bk > 32:
        bk //= 2
    bm = 16
    while bm < min(m, 128):
        bm *= 2
    tiles = batch * pl.cdiv(n, 128) * pl.cdiv(m, bm)
    fill = 1.9 if bm <= 64 else 3.8  # H200: split 4 best at M <= 16, split 8 at M = 128 (N = 8192)
    split = 1
    steps = k // bk if k % bk == 0 else 0
    while steps and tiles * split < fill * num_sms and steps % (2 * split) == 0 and steps // (2 * split) >= 2:
        split *= 2
    warps = 4 if bm <= 64 else 8
    return WTileConfig(bn=128, bm=bm, bk=bk, split_k=split, num_warps=warps,
                       num_stages=4 if bm <= 64 else 3, decode=decode, layout3d=bm <= 64)


def _decode_kernel(d_ref, s_ref, o_ref, *, cfg: WTileConfig):
    bn, bk = d_ref.shape[0], d_ref.shape[1] * 2
    lo, hi = _decoded_weight_tile(d_ref[...], s_ref[...], bn, bk, cfg)
    o_ref[...] = jnp.stack([lo, hi], axis=-1).reshape(bn, bk)


def decode_to_bf16(w_data, w_scales, *, decode: str = "asm", bn: int = 64, bk: int = 512,
                   num_warps: int = 4, interpret: bool = False):
    """Decode MXFP4 [R, K] (packed bytes [R, K/2], E8M0 scale bytes [R, K/32]) to bfloat16 [R, K]
    in one memory-bound pass (exact: E2M1 x 2^(s-127) is a bfloat16 value).

    The weight half of the two-pass w4a16 route (decode once, then XLA's bfloat16 GEMM) used for
    many activation rows. ``bn`` must divide R and ``bk`` (a multiple of 64) must divide K.
    Raises ValueError otherwise.
    """
    checks.check_interpret(interpret, "decode_to_bf16")
    r, half = w_data.shape
    k = 2 * half
    if r % bn or k % bk or bk % 64:
        raise ValueError(f"decode_to_bf16: tile {bn}x{bk} does not divide the operand [{r}, {k}]")
    cfg = WTileConfig(bn=bn, bk=bk, decode=decode, layout3d=True)
    return pl.pallas_call(
        functools.partial(_decode_kernel, cfg=cfg),
        out_shape=jax.ShapeDtypeStruct((r, k), jnp.bfloat16),
        grid=(r // bn, k // bk),
        in_specs=[pl.BlockSpec((bn, bk // 2), lambda i, j: (i, j)),
                  pl.BlockSpec((bn, bk // BLOCK_SIZE), lambda i, j: (i, j))],
        out_specs=pl.BlockSpec((bn, bk), lambda i, j: (i, j)),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="mxfp4_decode_bf16",
    )(w_data, w_scales)
