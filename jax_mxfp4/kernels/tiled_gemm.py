"""Fused MXFP4 GEMM kernels in Pallas (Triton lowering): a4w4 and w4a16.

One kernel computes ``out[b] = lhs[b] · rhs[b]ᵀ`` on the canonical operands of
:mod:`jax_mxfp4.backends.base`: each side is either MXFP4 (packed uint8 data [B, R, K/2] and E8M0
scale bytes [B, R, K/32]) or a bfloat16 array [B, R, K] (w4a16). Inside the K loop every MXFP4
tile is unpacked from its nibbles, scaled by its block scales and fed to ``dot`` as bfloat16; the
dequantized operand never goes to device memory. Accumulation is float32.

Exactness: an E2M1 value times a power-of-two scale has 2 significant bits, so it is exact in
bfloat16 (barring float32 overflow/underflow, which the reference shares); bfloat16 x bfloat16
products are exact in float32. The result therefore differs from backend "xla" (float32
dequantize + HIGHEST float32 dot) only by the order of float32 accumulation.

Packing: byte j of a row holds elements 2j (low nibble) and 2j+1 (high nibble), and both lie in
scale block j // 16. For a4w4 the contraction is split into two dots, low nibbles with low
nibbles and high with high; for w4a16 the MXFP4 tile is interleaved back to element order with
``jnp.stack`` so the bfloat16 side is read contiguously.

Nothing in the kernel source is vendor-specific (no inline assembly, no NVIDIA-only ops): it is
plain Pallas on ``jax.experimental.pallas.triton``, which lowers through Triton on CUDA and ROCm.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ..platform import sm_count
from ..mx_format import (
    BLOCK_SIZE,
    e2m1_times_2pow_minus14,
    e4m3_bits_from_packed,
    flush_below_normal,
    scale_factors_for_f16_codes,
)

NEUTRAL_SCALE_BYTE = 127  # 2^0: what masked-out scale loads read (the data there reads 0)


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Static tiling of one kernel launch.

    bm, bn: output tile (powers of two, bm >= 16 and bn >= 16 for ``dot``); bk: K elements per
    loop step (a power of two, multiple of 32); split_k: independent K ranges whose float32
    partial sums are added afterwards (fills the GPU when M and N give few tiles); group_m:
    tile-order swizzle for L2 reuse; num_warps, num_stages: Triton launch parameters;
    decode: how codes become numbers before scaling, "f16" (codes placed in float16 bits) or
    "e4m3" (codes placed in FP8 E4M3 bits, converted by the hardware); both exact;
    swap: compute outᵀ = rhs · lhsᵀ (bm, bn then tile the swapped problem) and transpose the
    small result: for decode shapes this puts the weight on the matrix units' M side.
    """

    bm: int = 64
    bn: int = 64
    bk: int = 128
    split_k: int = 1
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    decode: str = "f16"
    swap: bool = False

    def __post_init__(self):
        if self.decode not in ("f16", "e4m3"):
            raise ValueError(f'TileConfig.decode must be "f16" or "e4m3", got {self.decode!r}')
        for name in ("bm", "bn", "bk"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"TileConfig.{name} must be a power of two >= 16, got {v}")
        if self.bk % (2 * BLOCK_SIZE) and self.bk != BLOCK_SIZE:
            raise ValueError(f"TileConfig.bk must be 32 or a multiple of 64, got {self.bk}")
        if self.split_k < 1:
            raise ValueError(f"TileConfig.split_k must be >= 1, got {self.split_k}")


def _dequant_halves(data, scale_bytes, decode="f16"):
    """uint8 data [r, bk/2] and scale bytes [r, bk/32] -> bf16 (low, high) nibble values [r, bk/2].

    low[:, j] is element 2j, high[:, j] element 2j+1; both use scale block j // 16.
    """
    r, half = data.shape
    nb = half // (BLOCK_SIZE // 2)
    f1, f2 = scale_factors_for_f16_codes(scale_bytes, 14 if decode == "f16" else 6)
    f1 = f1.reshape(r, nb, 1)
    f2 = f2.reshape(r, nb, 1)
    d = data.reshape(r, nb, BLOCK_SIZE // 2)

    def scaled(v):
        return flush_below_normal((v.astype(jnp.float32) * f1) * f2).astype(jnp.bfloat16).reshape(r, half)

    if decode == "e4m3":
        lo, hi = e4m3_bits_from_packed(d)
        as_f8 = lambda b: lax.bitcast_convert_type(b, jnp.float8_e4m3fn)  # noqa: E731
        return scaled(as_f8(lo)), scaled(as_f8(hi))
    return scaled(e2m1_times_2pow_minus14(d & 0xF)), scaled(e2m1_times_2pow_minus14(d >> 4))


def _mx_tile(data_ref, scale_ref, b, row0, rows, k0, bk, row_mask, k_limit, decode):
    """Load one MXFP4 tile (rows x bk elements at column k0) -> bf16 (low, high) halves.

    Rows at or past the operand's end and (when ``k_limit`` is given) elements at or past K read
    as code 0 with a neutral scale, i.e. as zeros.
    """
    dmask = row_mask[:, None]
    smask = row_mask[:, None]
    if k_limit is not None:
        byte_k = k0 + 2 * lax.broadcasted_iota(jnp.int32, (bk // 2,), 0)
        block_k = k0 + BLOCK_SIZE * lax.broadcasted_iota(jnp.int32, (bk // BLOCK_SIZE,), 0)
        dmask = dmask & (byte_k < k_limit)[None, :]
        smask = smask & (block_k < k_limit)[None, :]
    data = plgpu.load(
        data_ref.at[b, pl.ds(row0, rows), pl.ds(k0 // 2, bk // 2)], mask=dmask, other=0
    )
    sbytes = plgpu.load(
        scale_ref.at[b, pl.ds(row0, rows), pl.ds(k0 // BLOCK_SIZE, bk // BLOCK_SIZE)],
        mask=smask,
        other=NEUTRAL_SCALE_BYTE,
    )
    return _dequant_halves(data, sbytes, decode)


def _kernel(*refs, m, n, k, cfg: TileConfig, lhs_mx: bool, rhs_mx: bool, n_tiles_m, n_tiles_n,
            out_dtype, k_per_split):
    if lhs_mx and rhs_mx:
        a_ref, sa_ref, b_ref, sb_ref, o_ref = refs
    elif lhs_mx:
        a_ref, sa_ref, b_ref, o_ref = refs
    else:
        a_ref, b_ref, sb_ref, o_ref = refs
    bm, bn, bk, split = cfg.bm, cfg.bn, cfg.bk, cfg.split_k

    # Grouped tile order (GROUP_M rows of tiles share rhs tiles in L2).
    pid = pl.program_id(0)
    group = cfg.group_m
    width = group * n_tiles_n
    group_id = pid // width
    first_m = group_id * group
    group_size = jnp.minimum(n_tiles_m - first_m, group)
    tile_m = first_m + (pid % width) % group_size
    tile_n = (pid % width) // group_size

    bs = pl.program_id(1)
    bidx = bs // split
    sidx = bs % split

    row0_a = tile_m * bm
    row0_b = tile_n * bn
    rows_a = row0_a + lax.broadcasted_iota(jnp.int32, (bm,), 0)
    rows_b = row0_b + lax.broadcasted_iota(jnp.int32, (bn,), 0)
    mask_a = rows_a < m
    mask_b = rows_b < n
    steps = pl.cdiv(k_per_split, bk)
    k_exact = k_per_split % bk == 0
    k_begin = sidx * k_per_split

    def float_tile(ref, row0, rows, row_mask, k0, k_valid):
        mask = row_mask[:, None]
        if k_valid is not None:
            mask = mask & k_valid[None, :]
        return plgpu.load(ref.at[bidx, pl.ds(row0, rows), pl.ds(k0, bk)], mask=mask, other=0)

    dims = (((1,), (1,)), ((), ()))

    def body(t, acc):
        k0 = k_begin + t * bk
        if k_exact:
            k_limit = elem_mask = None
        else:
            k_limit = k_begin + k_per_split
            elem_mask = (k0 + lax.broadcasted_iota(jnp.int32, (bk,), 0)) < k_limit
        if lhs_mx and rhs_mx:
            a_lo, a_hi = _mx_tile(a_ref, sa_ref, bidx, row0_a, bm, k0, bk, mask_a, k_limit, cfg.decode)
            b_lo, b_hi = _mx_tile(b_ref, sb_ref, bidx, row0_b, bn, k0, bk, mask_b, k_limit, cfg.decode)
            acc = acc + lax.dot_general(a_lo, b_lo, dims, preferred_element_type=jnp.float32)
            acc = acc + lax.dot_general(a_hi, b_hi, dims, preferred_element_type=jnp.float32)
            return acc
        if lhs_mx:
            lo, hi = _mx_tile(a_ref, sa_ref, bidx, row0_a, bm, k0, bk, mask_a, k_limit, cfg.decode)
            a = jnp.stack([lo, hi], axis=-1).reshape(bm, bk)
            b = float_tile(b_ref, row0_b, bn, mask_b, k0, elem_mask)
        else:
            a = float_tile(a_ref, row0_a, bm, mask_a, k0, elem_mask)
            lo, hi = _mx_tile(b_ref, sb_ref, bidx, row0_b, bn, k0, bk, mask_b, k_limit, cfg.decode)
            b = jnp.stack([lo, hi], axis=-1).reshape(bn, bk)
        return acc + lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, steps, body, jnp.zeros((bm, bn), jnp.float32))
    out_mask = mask_a[:, None] & mask_b[None, :]
    plgpu.store(o_ref.at[bs, pl.ds(row0_a, bm), pl.ds(row0_b, bn)], acc.astype(out_dtype),
                mask=out_mask)


def mxfp4_gemm(lhs, rhs, *, m, n, k, out_dtype, cfg: TileConfig, interpret: bool = False):
    """Fused MXFP4 GEMM on canonical operands: ``out[b] = lhs[b] · rhs[b]ᵀ`` -> [B, M, N].

    Args:
      lhs, rhs: each either a pair ``(data uint8 [B, R, K/2], scale_bytes uint8 [B, R, K/32])``
        (MXFP4) or a bfloat16 array [B, R, K] (w4a16); at least one side must be MXFP4.
      m, n, k: sizes (K a multiple of 32). out_dtype: float32 or bfloat16 (float16 also works).
      cfg: :class:`TileConfig`. interpret: run the Pallas interpreter (CPU tests).
    Returns:
      [B, M, N] array of ``out_dtype``, float32-accumulated.
    Raises:
      ValueError: K not a multiple of 32, split_k not dividing K into multiples of 32, or
        neither operand MXFP4.
    """
    if cfg.swap:
        out = mxfp4_gemm(rhs, lhs, m=n, n=m, k=k, out_dtype=out_dtype,
                         cfg=dataclasses.replace(cfg, swap=False), interpret=interpret)
        return jnp.swapaxes(out, 1, 2)
    lhs_mx = isinstance(lhs, tuple)
    rhs_mx = isinstance(rhs, tuple)
    if not (lhs_mx or rhs_mx):
        raise ValueError("mxfp4_gemm needs at least one MXFP4 operand")
    if k % BLOCK_SIZE:
        raise ValueError(f"K={k} is not a multiple of {BLOCK_SIZE}")
    if k % (cfg.split_k * BLOCK_SIZE):
        raise ValueError(f"split_k={cfg.split_k} does not split K={k} into multiples of 32")
    batch = (lhs[0] if lhs_mx else lhs).shape[0]
    k_per_split = k // cfg.split_k
    n_tiles_m = pl.cdiv(m, cfg.bm)
    n_tiles_n = pl.cdiv(n, cfg.bn)
    split_out = cfg.split_k > 1
    kernel_out_dtype = jnp.float32 if split_out else jnp.dtype(out_dtype)
    args = (*(lhs if lhs_mx else (lhs,)), *(rhs if rhs_mx else (rhs,)))
    kernel = functools.partial(
        _kernel, m=m, n=n, k=k, cfg=cfg, lhs_mx=lhs_mx, rhs_mx=rhs_mx, n_tiles_m=n_tiles_m,
        n_tiles_n=n_tiles_n, out_dtype=kernel_out_dtype, k_per_split=k_per_split,
    )
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((batch * cfg.split_k, m, n), kernel_out_dtype),
        grid=(n_tiles_m * n_tiles_n, batch * cfg.split_k),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name=f"mxfp4_gemm_{'a4' if lhs_mx else 'a16'}{'w4' if rhs_mx else 'w16'}",
    )(*args)
    if split_out:
        out = out.reshape(batch, cfg.split_k, m, n).sum(axis=1)
    return out.astype(out_dtype)


def default_config(m: int, n: int, k: int, batch: int = 1, a4w4: bool = True,
                   num_sms: int | None = None) -> TileConfig:
    """Tile configuration by shape, from the tile sweep on an NVIDIA H200
    (2026-11-29; ``python benchmarks/gemm.py --tune``): decode-sized M uses split-K (and, for
    a4w4, the swapped orientation with FP8-E4M3 decode); large shapes use 256x128 tiles, K step
    64, 8 warps. Split-K grows until about ``fill`` tiles run per processor: ``num_sms`` (None:
    the device's own count, :func:`jax_mxfp4.platform.sm_count`)."""
    num_sms = num_sms or sm_count() or 1  # the interpreter (CPU) has no processors to fill: one
    bk = 256 if k % 256 == 0 else (128 if k % 128 == 0 else (64 if k % 64 == 0 else 32))
    if m <= 16:
        bk = min(bk, 128)
        if a4w4:  # weight rows on the matrix units' M side (bm), activation rows on N
            base = TileConfig(bm=128, bn=16, bk=bk, num_warps=4, num_stages=4, decode="e4m3", swap=True)
            tiles, fill = batch * pl.cdiv(n, 128), 1.9
        else:
            base = TileConfig(bm=16, bn=64, bk=bk, num_warps=4, num_stages=4)
            tiles, fill = batch * pl.cdiv(n, 64), 4
    else:
        if m <= 32:
            bm, bn, warps, stages, fill = 32, 64, 4, 4, 2
        elif m <= 64:
            bm, bn, warps, stages, fill = 64, 64, 4, 3, 2
        elif m <= 128:
            bm, bn, warps, stages, fill = 128, 128, 8, 3, 1
            bk = min(bk, 64)
        else:
            bm, bn, warps, stages, fill = 256, 128, 8, 3, 1
            bk = min(bk, 64)
        base = TileConfig(bm=bm, bn=bn, bk=bk, num_warps=warps, num_stages=stages)
        tiles = batch * pl.cdiv(m, bm) * pl.cdiv(n, bn)
    split = 1
    steps = k // bk
    while tiles * split < fill * num_sms and steps % (2 * split) == 0 and steps // (2 * split) >= 4:
        split *= 2
    return dataclasses.replace(base, split_k=split)
