"""Grouped weight-stationary MXFP4 GEMM in Pallas (Triton lowering): the experts of a
mixture-of-experts layer at decode sizes, each selected expert's packed weights read once.

Computes the ragged product of ``jax.lax.ragged_dot``: rows ``start_g .. start_g + size_g - 1``
of a bfloat16 x [M, K] times expert g of an MXFP4 W, for W stored [G, N, K] (packed bytes
[G, N, K/2], E8M0 scale bytes [G, N, K/32]; gpt-oss's layout) or [G, K, N] ([G, K/2, N],
[G, K/32, N]; ``lax.ragged_dot``'s), both quantized along K and read as stored. Rows past
``sum(group_sizes)`` are zero.

One program per (N tile, slot, K split). The slots are the non-empty groups, in order (at most
min(M, G) of them, found in XLA before the call: an empty expert costs an idle program, no
weight bytes). A program loops over its group's rows ``bm`` at a time (one pass at decode sizes,
where a group has few rows) and, inside, over K: each weight tile is loaded and decoded in
registers (:mod:`jax_mxfp4.kernels.wgemm`'s decode: inline PTX on NVIDIA, the portable one
elsewhere) and meets the even and odd elements of x (``split_even_odd``). A K not a multiple
of ``bk`` is masked (K = 2880 in gpt-oss). Split-K fills the GPU when few experts are used;
float32 partial sums are added afterwards in a fixed order (deterministic).

Exactness: as the dense kernel, the decoded values are exact in bfloat16 and their products
exact in float32: the result equals the exact route up to the order of float32 accumulation.
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
from ..mx_format import BLOCK_SIZE, e8m0_to_bf16_bits
from ..platform import sm_count
from . import e2m1_asm
from .wgemm import DECODES, _dequant_halves, _decoded_weight_tile


@dataclasses.dataclass(frozen=True)
class GroupedConfig:
    """Tiling: bn weight columns (N) per tile, bm rows of a group per pass, bk K elements per
    step (powers of two; bn, bm >= 16, bk >= 64), split_k K ranges summed afterwards, Triton's
    num_warps / num_stages, the E2M1 decode ("asm" NVIDIA only, "f16" portable) and, for [G, N, K]
    storage, the dense kernel's decode tile shape (``layout3d``: :class:`~.wgemm.WTileConfig`)."""

    bn: int = 128
    bm: int = 16
    bk: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    decode: str = "asm"
    layout3d: bool = True

    def __post_init__(self):
        if self.decode not in DECODES:
            raise ValueError(f"GroupedConfig.decode must be one of {DECODES}, got {self.decode!r}")
        for name, lo in (("bn", 16), ("bm", 16), ("bk", 64)):
            v = getattr(self, name)
            if v < lo or v & (v - 1):
                raise ValueError(f"GroupedConfig.{name} must be a power of two >= {lo}, got {v}")
        if self.split_k < 1:
            raise ValueError(f"GroupedConfig.split_k must be >= 1, got {self.split_k}")


def _decoded_kn_tile(data, sbytes, cfg: GroupedConfig):
    """[G, K, N] storage: packed bytes [bk/2, bn] and scale bytes [bk/32, bn] -> bfloat16 (lo, hi)
    [bk/2, bn], the values of K elements 2j and 2j+1."""
    half, bn = data.shape
    if cfg.decode != "asm":
        lo, hi = _dequant_halves(data.T, sbytes.T)
        return lo.T, hi.T
    scale = lax.bitcast_convert_type(e8m0_to_bf16_bits(sbytes), jnp.bfloat16)
    s2 = jnp.broadcast_to(scale[:, None, :], (half // (BLOCK_SIZE // 2), BLOCK_SIZE // 2, bn)).reshape(half, bn)
    return e2m1_asm.decode_scaled_halves(data, s2)


def _kernel(slots_ref, xlo_ref, xhi_ref, w_ref, s_ref, o_ref, *, k, n, kn: bool, cfg: GroupedConfig, steps: int):
    bn, bm, bk = cfg.bn, cfg.bm, cfg.bk
    tile_n, slot, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    g, start, size = slots_ref[0, slot], slots_ref[1, slot], slots_ref[2, slot]
    n0 = tile_n * bn
    n_mask = (n0 + lax.broadcasted_iota(jnp.int32, (bn,), 0)) < n
    k_first = split * steps * bk
    masked_k = k % (bk * cfg.split_k) != 0

    def k_mask(kb0, length, per):  # columns of a tile along K (in units of ``per`` elements) inside K
        return (kb0 // per + lax.broadcasted_iota(jnp.int32, (length,), 0)) < k // per

    def weight(kb0):
        hs, ss = pl.ds(kb0 // 2, bk // 2), pl.ds(kb0 // BLOCK_SIZE, bk // BLOCK_SIZE)
        kd = k_mask(kb0, bk // 2, 2) if masked_k else None
        ks = k_mask(kb0, bk // BLOCK_SIZE, BLOCK_SIZE) if masked_k else None
        if kn:  # [bk/2, bn] bytes, [bk/32, bn] scales
            dm = n_mask[None, :] if kd is None else kd[:, None] & n_mask[None, :]
            sm = n_mask[None, :] if ks is None else ks[:, None] & n_mask[None, :]
            data = plgpu.load(w_ref.at[g, hs, pl.ds(n0, bn)], mask=dm, other=0)
            sbytes = plgpu.load(s_ref.at[g, ss, pl.ds(n0, bn)], mask=sm, other=127)
            return _decoded_kn_tile(data, sbytes, cfg)
        dm = n_mask[:, None] if kd is None else n_mask[:, None] & kd[None, :]
        sm = n_mask[:, None] if ks is None else n_mask[:, None] & ks[None, :]
        data = plgpu.load(w_ref.at[g, pl.ds(n0, bn), hs], mask=dm, other=0)
        sbytes = plgpu.load(s_ref.at[g, pl.ds(n0, bn), ss], mask=sm, other=127)
        return _decoded_weight_tile(data, sbytes, bn, bk, cfg)

    def rows(r, carry):
        m0 = start + r * bm
        m_mask = (r * bm + lax.broadcasted_iota(jnp.int32, (bm,), 0)) < size

        def body(t, acc):
            kb0 = k_first + t * bk
            lo, hi = weight(kb0)
            xm = m_mask[:, None] if not masked_k else m_mask[:, None] & k_mask(kb0, bk // 2, 2)[None, :]
            xs = pl.ds(kb0 // 2, bk // 2)
            x_lo = plgpu.load(xlo_ref.at[pl.ds(m0, bm), xs], mask=xm, other=0)
            x_hi = plgpu.load(xhi_ref.at[pl.ds(m0, bm), xs], mask=xm, other=0)
            if kn:  # [bm, bk/2] . [bk/2, bn]
                nn = (((1,), (0,)), ((), ()))
                acc = acc + lax.dot_general(x_lo, lo, nn, preferred_element_type=jnp.float32)
                return acc + lax.dot_general(x_hi, hi, nn, preferred_element_type=jnp.float32)
            nt = (((1,), (1,)), ((), ()))  # [bn, bk/2] . [bm, bk/2]ᵀ: weight rows on the MMA's M side
            acc = acc + lax.dot_general(lo, x_lo, nt, preferred_element_type=jnp.float32)
            return acc + lax.dot_general(hi, x_hi, nt, preferred_element_type=jnp.float32)

        acc = lax.fori_loop(0, steps, body, jnp.zeros((bm, bn) if kn else (bn, bm), jnp.float32))
        acc = acc if kn else acc.T
        plgpu.store(o_ref.at[split, pl.ds(m0, bm), pl.ds(n0, bn)], acc.astype(o_ref.dtype),
                    mask=m_mask[:, None] & n_mask[None, :])
        return carry

    lax.fori_loop(0, pl.cdiv(size, bm), rows, 0)


def slots(group_sizes, m: int):
    """int32 [3, S], S = min(M, G): per slot the group index, its first row and its row count,
    for the non-empty groups in order; unused slots have 0 rows. Invalid sizes (negative, or
    summing past M: the caller's checks make such a result NaN) are clipped to rows 0 .. M-1
    first, so the kernel never touches a row outside x or the output."""
    g = group_sizes.shape[0]
    s = min(m, g)
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes, 0)), m)
    starts = jnp.concatenate([jnp.zeros((1,), ends.dtype), ends[:-1]])
    sizes = ends - starts
    used = sizes > 0
    idx = jnp.nonzero(used, size=s, fill_value=0)[0]
    count = jnp.where(jnp.arange(s) < jnp.sum(used), sizes[idx], 0)
    return jnp.stack([idx, starts[idx], count]).astype(jnp.int32)


def grouped_weight_gemm(x, w_data, w_scales, group_sizes, *, k_axis: int, out_dtype, cfg: GroupedConfig,
                        interpret: bool = False):
    """The ragged rows product of x and the MXFP4 experts -> [M, N] of ``out_dtype``, float32-accumulated.

    Args:
      x: bfloat16 [M, K], rows sorted by group.
      w_data, w_scales: uint8 packed E2M1 bytes and E8M0 scale bytes (plain layout):
        ``k_axis=2`` ([G, N, K] storage): [G, N, K/2] and [G, N, K/32];
        ``k_axis=1`` ([G, K, N] storage): [G, K/2, N] and [G, K/32, N].
      group_sizes: int32 [G], sizes >= 0 summing to at most M (not checked here: the caller does).
      out_dtype: float32, bfloat16 or float16. cfg: :class:`GroupedConfig`. interpret: the Pallas
        interpreter (CPU tests; needs ``decode="f16"``).
    Raises:
      ValueError: shapes that do not describe that product, x not 2-D bfloat16, weights not uint8,
        group_sizes not integer, out_dtype not float32/bfloat16/float16, K not a multiple of 32,
        split_k not dividing the K steps, the asm decode in the interpreter.
    """
    checks.check_interpret(interpret, "grouped_weight_gemm")
    if x.ndim != 2:
        raise ValueError(f"grouped_weight_gemm: x must be 2-D [M, K], got shape {x.shape}")
    for name, a in (("w_data", w_data), ("w_scales", w_scales)):
        if a.dtype != jnp.uint8:
            raise ValueError(f"grouped_weight_gemm: {name} must be uint8 (packed E2M1 / E8M0 bytes), got {a.dtype}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"grouped_weight_gemm: group_sizes must be an integer array, got {group_sizes.dtype}")
    if jnp.dtype(out_dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ValueError(f"grouped_weight_gemm: out_dtype must be float32, bfloat16 or float16, got {out_dtype}")
    m, k = x.shape
    if k_axis not in (1, 2) or w_data.ndim != 3:
        raise ValueError(f"grouped_weight_gemm: k_axis must be 1 or 2 with 3-D weights, got {k_axis}, {w_data.shape}")
    g = w_data.shape[0]
    n = w_data.shape[3 - k_axis]
    want = ((g, n, k // 2), (g, n, k // BLOCK_SIZE)) if k_axis == 2 else ((g, k // 2, n), (g, k // BLOCK_SIZE, n))
    if k % BLOCK_SIZE or (tuple(w_data.shape), tuple(w_scales.shape)) != want or group_sizes.shape != (g,):
        raise ValueError(f"grouped_weight_gemm: x {x.shape}, w_data {w_data.shape}, w_scales {w_scales.shape} and "
                         f"group_sizes {group_sizes.shape} do not describe [M, K] x {want} (K a multiple of 32)")
    if x.dtype != jnp.bfloat16:
        raise ValueError(f"grouped_weight_gemm: x must be bfloat16, got {x.dtype}")
    if interpret and cfg.decode == "asm":
        raise ValueError('grouped_weight_gemm: decode="asm" (inline PTX) cannot run in the interpreter')
    total_steps = pl.cdiv(k, cfg.bk)
    if total_steps % cfg.split_k:
        raise ValueError(f"grouped_weight_gemm: split_k={cfg.split_k} does not divide the {total_steps} K steps")
    table = slots(group_sizes.astype(jnp.int32), m)
    x_lo, x_hi = e2m1_asm.split_even_odd(x)
    split = cfg.split_k > 1
    kdtype = jnp.float32 if split else jnp.dtype(out_dtype)
    kernel = functools.partial(_kernel, k=k, n=n, kn=k_axis == 1, cfg=cfg, steps=total_steps // cfg.split_k)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((cfg.split_k, m, n), kdtype),
        grid=(pl.cdiv(n, cfg.bn), table.shape[1], cfg.split_k),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="mxfp4_grouped_wgemm",
    )(table, x_lo, x_hi, w_data, w_scales)
    out = out.sum(axis=0) if split else out[0]
    covered = jnp.arange(m) < jnp.sum(group_sizes)  # rows no group covers were never written
    return jnp.where(covered[:, None], out, 0).astype(out_dtype)


def default_grouped_config(m: int, n: int, k: int, g: int, decode: str = "asm", k_axis: int = 2,
                           num_sms: int | None = None) -> GroupedConfig:
    """Tiling by shape (NVIDIA H200, ``main()``'s sweep at gpt-oss-20b's gate+up, 2026-12-03):
    bm covers a group's expected rows (M / min(M, G), 16..128), bn = 128, bk = 128, 8 warps for
    [G, K, N] storage (4 for [G, N, K]), split-K until about two programs per SM when every slot
    is used."""
    num_sms = num_sms or sm_count() or 1
    per_group = pl.cdiv(m, min(m, g))
    bm = 16
    while bm < min(per_group, 128):
        bm *= 2
    bk = 128
    steps = pl.cdiv(k, bk)
    tiles = pl.cdiv(n, 128) * min(m, g)
    split = 1
    while tiles * split < 2 * num_sms and steps % (2 * split) == 0 and steps // (2 * split) >= 2:
        split *= 2
    return GroupedConfig(bn=128, bm=bm, bk=bk, split_k=split, num_warps=8 if k_axis == 1 or bm == 128 else 4,
                         num_stages=3, decode=decode)


def main(argv=None):
    """Tuning sweep on a GPU: ``python -m jax_mxfp4.kernels.grouped_wgemm`` times the kernel over
    tilings and both expert storages at gpt-oss-20b's gate+up shape (32 experts, K = 2880,
    N = 5760) for the rows of 1 and 16 tokens (top-4), beside the dense weight-stationary kernel
    on the same bytes (one [rows, K] x [used experts x N, K] product), and prints µs per call."""
    import argparse
    import itertools
    import time

    from .wgemm import default_wconfig, weight_stationary_gemm

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--tokens", default="1,16")
    ap.add_argument("--calls", type=int, default=30)
    args = ap.parse_args(argv)
    g, k, n = 32, 2880, 5760
    rng = jax.random.key(0)

    def timed(f, *xs):
        jax.block_until_ready(f(*xs))
        t = time.perf_counter()
        for _ in range(args.calls):
            out = f(*xs)
        jax.block_until_ready(out)
        return (time.perf_counter() - t) / args.calls * 1e6

    for tokens in (int(t) for t in args.tokens.split(",")):
        m = 4 * tokens
        experts = jax.random.choice(rng, g, (m,))
        gs = jnp.bincount(experts, length=g).astype(jnp.int32)
        used = int(jnp.sum(gs > 0))
        x = jax.random.normal(rng, (m, k), jnp.bfloat16)
        gbytes = used * n * k * (0.5 + 1 / 32) / 1e9
        print(f"tokens {tokens}: M={m}, {used} experts used, {gbytes * 1e3:.1f} MB of weights", flush=True)
        dense_w = jax.random.randint(rng, (1, used * n, k // 2), 0, 256, jnp.int32).astype(jnp.uint8)
        dense_s = jnp.full((1, used * n, k // BLOCK_SIZE), 120, jnp.uint8)
        for bk in (64, 128):  # K = 2880 = 45 x 64: the dense kernel needs bk | K
            cfg = dataclasses.replace(default_wconfig(m, used * n, k, 1), bk=bk)
            f = jax.jit(functools.partial(weight_stationary_gemm, out_dtype=jnp.bfloat16, cfg=cfg))
            try:
                us = timed(f, x[None], dense_w, dense_s)
                print(f"  dense  {cfg}: {us:8.1f} us  {gbytes / us * 1e6 / 1e3:.2f} TB/s", flush=True)
            except Exception as e:  # noqa: BLE001 - a sweep reports what does not compile
                print(f"  dense bk={bk}: {type(e).__name__}: {str(e)[:100]}", flush=True)
        for storage in ("nk", "kn"):
            shape = (g, n, k // 2) if storage == "nk" else (g, k // 2, n)
            sshape = (g, n, k // BLOCK_SIZE) if storage == "nk" else (g, k // BLOCK_SIZE, n)
            w = jax.random.randint(rng, shape, 0, 256, jnp.int32).astype(jnp.uint8)
            s = jnp.full(sshape, 120, jnp.uint8)
            base = default_grouped_config(m, n, k, g)
            for bk, split, warps, stages in itertools.product((128, 256, 512), (1, 2, 4), (4, 8), (3,)):
                if pl.cdiv(k, bk) % split:
                    continue
                cfg = dataclasses.replace(base, bk=bk, split_k=split, num_warps=warps, num_stages=stages)
                f = jax.jit(functools.partial(grouped_weight_gemm, k_axis=2 if storage == "nk" else 1,
                                              out_dtype=jnp.bfloat16, cfg=cfg))
                try:
                    us = timed(f, x, w, s, gs)
                    print(f"  {storage} bm={cfg.bm} bk={bk} split={split} warps={warps} stages={stages}: "
                          f"{us:8.1f} us  {gbytes / us * 1e6 / 1e3:.2f} TB/s", flush=True)
                except Exception as e:  # noqa: BLE001
                    print(f"  {storage} bk={bk} split={split} warps={warps}: {type(e).__name__}: {str(e)[:100]}",
                          flush=True)


if __name__ == "__main__":
    main()
