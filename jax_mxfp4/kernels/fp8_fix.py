"""Exact recompute of the flagged rows and columns of an FP8-path GEMM result, in one Pallas
(Triton lowering) kernel with no host round trip.

The FP8 path (:mod:`jax_mxfp4.backends.fp8`) computes every output from E4M3 codes; rows of the
lhs and columns (rhs rows) flagged by the encoding (``FLAG_EXACT``: blocks outside the 15-binade
window, flushed or overflowing elements) must be recomputed exactly. The portable form of that
step is a ``lax.while_loop`` whose trip count depends on the flags: on a GPU XLA copies its
predicate to the host before every trip (a device-to-host sync per GEMM, which stalls the stream:
~20 us of a 176 us 1024x8192x8192 call on an H200, session 6 run b), and its body holds three
GEMMs that XLA's autotuner compiles for every call site (90 s to compile one FP8 GEMM with
default flags, run a). This kernel replaces it on CUDA:

- grid (batch, at most :data:`MAX_PROGRAMS`); each program walks a strided list of bm x bn output
  tiles, reads the flags of each tile's rows and columns and moves on when none is set (the
  common case: one small read per tile);
- a program with a flagged row or column recomputes its whole tile from the operands' exact
  values in bfloat16 (every dequantized MXFP4 value, E2M1 x 2^k, is exact in bfloat16) with
  float32 accumulation on tensor cores -- the exact path's arithmetic on CUDA
  (:func:`jax_mxfp4.backends.fp8.exact_operand_dtype`), equal to backend "xla" up to the order
  of float32 accumulation -- and writes the flagged entries over the result in place.

Exact values from the FP8 operand (:class:`jax_mxfp4.fp8.FP8Prepared` fields): a row without
flags holds ``code x 2^row_exp`` exactly; a FLAG_EXACT row stores d = 0, so its codes are the E2M1
values and the reference's rule :func:`jax_mxfp4.mx_format.scale_e2m1_values` applies with the
block's scale byte; a FLAG_NAN row makes every product of its dot NaN, as in the reference.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ..fp8 import FLAG_EXACT, FLAG_NAN
from ..mx_format import BLOCK_SIZE, pow2_from_exponent, scale_e2m1_values


@dataclasses.dataclass(frozen=True)
class FixConfig:
    """Output tile (bm x bn), K step bk (a multiple of 32), Triton ``num_warps``, and the most
    programs per batch element (:data:`MAX_PROGRAMS`)."""

    bm: int = 128
    bn: int = 128
    bk: int = 64
    num_warps: int = 8
    max_programs: int = 512

    def __post_init__(self):
        for name in ("bm", "bn", "bk", "num_warps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1 or v & (v - 1):
                raise ValueError(f"FixConfig.{name} must be a power of two, got {v!r}")
        if isinstance(self.max_programs, bool) or not isinstance(self.max_programs, int) or self.max_programs < 1:
            raise ValueError(f"FixConfig.max_programs must be a positive int, got {self.max_programs!r}")
        if self.bm < 16 or self.bn < 16 or self.bk < BLOCK_SIZE:
            raise ValueError(f"FixConfig: bm, bn >= 16 (tensor-core tiles) and bk >= {BLOCK_SIZE}, got {self}")


def exact_values(codes, scale_bytes, row_exp, row_flag):
    """Exact float32 values of FP8-path operand rows (module docstring).

    Args:
      codes: float8_e4m3fn [R, nb, 32]; scale_bytes: uint8 [R, nb] (plain layout);
      row_exp: int32 [R]; row_flag: uint8 [R].
    Returns:
      float32 [R, nb, 32]: the reference's dequantized MXFP4 values (NaN rows all NaN).
    """
    c = codes.astype(jnp.float32)
    e = row_exp[:, None, None]
    e1 = jnp.clip(e, -100, 100)  # row_exp in [-133, 121]: two factors, each a normal power of two
    plain = c * pow2_from_exponent(e1) * pow2_from_exponent(e - e1)
    flag = row_flag.astype(jnp.int32)[:, None, None]
    v = jnp.where((flag & FLAG_EXACT) != 0, scale_e2m1_values(c, scale_bytes), plain)
    return jnp.where((flag & FLAG_NAN) != 0, jnp.float32(jnp.nan), v)


MAX_PROGRAMS = FixConfig.max_programs
"""Programs per batch element at most (about 4 per H200 SM): each walks a strided list of output
tiles, so a result with no flag costs one flag read per tile, not one program launch per tile
(a grid of one program per 128 x 128 tile took 21 us at 8192^2 and 68 us at 8192x28672 with no
flag set, session 6 run c)."""


def _kernel(fl_ref, fr_ref, ac_ref, as_ref, ae_ref, bc_ref, bs_ref, be_ref, o_in_ref, o_ref, *,
            m, n, k, n_prog, cfg: FixConfig):
    del o_in_ref  # aliased with o_ref
    bi, p = pl.program_id(0), pl.program_id(1)
    nj = pl.cdiv(n, cfg.bn)
    n_tiles = pl.cdiv(m, cfg.bm) * nj

    def tile_step(t, carry):
        tile_id = p + t * n_prog
        _fix_tile(fl_ref, fr_ref, ac_ref, as_ref, ae_ref, bc_ref, bs_ref, be_ref, o_ref, bi,
                  (tile_id // nj) * cfg.bm, (tile_id % nj) * cfg.bn, m=m, n=n, k=k, cfg=cfg)
        return carry

    lax.fori_loop(0, (n_tiles - p + n_prog - 1) // n_prog, tile_step, 0)


def _fix_tile(fl_ref, fr_ref, ac_ref, as_ref, ae_ref, bc_ref, bs_ref, be_ref, o_ref, bi, i0, j0, *, m, n, k,
              cfg: FixConfig):
    """One bm x bn output tile: nothing unless one of its rows or columns is flagged."""
    rows = i0 + lax.broadcasted_iota(jnp.int32, (cfg.bm,), 0)
    cols = j0 + lax.broadcasted_iota(jnp.int32, (cfg.bn,), 0)
    rmask, cmask = rows < m, cols < n
    fl = plgpu.load(fl_ref.at[bi, pl.ds(i0, cfg.bm)], mask=rmask, other=0).astype(jnp.int32)
    fr = plgpu.load(fr_ref.at[bi, pl.ds(j0, cfg.bn)], mask=cmask, other=0).astype(jnp.int32)
    fix_r, fix_c = (fl & FLAG_EXACT) != 0, (fr & FLAG_EXACT) != 0

    @pl.when(jnp.maximum(jnp.max(fix_r.astype(jnp.int32)), jnp.max(fix_c.astype(jnp.int32))) != 0)
    def _():
        ea = plgpu.load(ae_ref.at[bi, pl.ds(i0, cfg.bm)], mask=rmask, other=0)
        eb = plgpu.load(be_ref.at[bi, pl.ds(j0, cfg.bn)], mask=cmask, other=0)
        nbk = cfg.bk // BLOCK_SIZE

        def tile(c_ref, s_ref, r0, nr, rmask_, e, f, kb):
            c = plgpu.load(c_ref.at[bi, pl.ds(r0, nr), pl.ds(kb, nbk), :],  # uint8: masked loads need an int fill
                           mask=rmask_[:, None, None], other=0)
            c = lax.bitcast_convert_type(c, jnp.float8_e4m3fn)
            s = plgpu.load(s_ref.at[bi, pl.ds(r0, nr), pl.ds(kb, nbk)], mask=rmask_[:, None], other=0)
            v = exact_values(c, s, e, f)
            return jnp.where(rmask_[:, None, None], v, 0).astype(jnp.bfloat16).reshape(nr, cfg.bk)

        def body(t, acc):
            kb = t * nbk
            a = tile(ac_ref, as_ref, i0, cfg.bm, rmask, ea, fl, kb)
            b = tile(bc_ref, bs_ref, j0, cfg.bn, cmask, eb, fr, kb)
            return acc + lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

        acc = lax.fori_loop(0, k // cfg.bk, body, jnp.zeros((cfg.bm, cfg.bn), jnp.float32))
        view = o_ref.at[bi, pl.ds(i0, cfg.bm), pl.ds(j0, cfg.bn)]
        fix = fix_r[:, None] | fix_c[None, :]
        plgpu.store(view, acc.astype(o_ref.dtype), mask=fix & rmask[:, None] & cmask[None, :])


def default_config(k: int) -> FixConfig:
    """bk 64 where it divides K (K is a multiple of 32), else 32."""
    return FixConfig(bk=64 if k % 64 == 0 else 32)


@functools.partial(jax.jit, static_argnames=("cfg", "interpret"))
def fix_flagged(out, a_codes, a_scales, a_exp, a_flag, b_codes, b_scales, b_exp, b_flag, *,
                cfg: FixConfig | None = None, interpret: bool = False):
    """``out`` [B, M, N] with every entry in a FLAG_EXACT row (lhs) or column (rhs) replaced by
    the exact dot product of its row and column (module docstring), in place.

    Args:
      out: float32/bfloat16/float16 [B, M, N], the FP8 GEMM's rescaled result (aliased with the
        output).
      a_codes: float8_e4m3fn [B, M, K]; a_scales: uint8 [B, M, K/32]; a_exp: int32 [B, M];
        a_flag: uint8 [B, M] -- the lhs's :class:`jax_mxfp4.fp8.FP8Prepared` fields (scale bytes);
      b_*: the same for the rhs [B, N, K].
      cfg: :class:`FixConfig` (default :func:`default_config`); interpret: the Pallas interpreter.
    Returns:
      the updated ``out``.
    Raises:
      ValueError: shapes that do not pair up, or K not a multiple of 32 and of ``cfg.bk``.
      TypeError: dtypes other than those above; a ``cfg`` that is not a :class:`FixConfig`.
    An empty ``out`` comes back as it is; with K = 0 the flagged entries become 0 (an empty sum).
    """
    if getattr(out, "ndim", None) != 3:
        raise ValueError(f"fix_flagged: out must be a [B, M, N] array, got shape {getattr(out, 'shape', type(out))}")
    want = {"out": (out, ("float32", "bfloat16", "float16")), "a_codes": (a_codes, ("float8_e4m3fn",)),
            "b_codes": (b_codes, ("float8_e4m3fn",)), "a_scales": (a_scales, ("uint8",)),
            "b_scales": (b_scales, ("uint8",)), "a_exp": (a_exp, ("int32",)), "b_exp": (b_exp, ("int32",)),
            "a_flag": (a_flag, ("uint8",)), "b_flag": (b_flag, ("uint8",))}
    for name, (v, dts) in want.items():
        if str(getattr(v, "dtype", None)) not in dts:
            raise TypeError(f"fix_flagged: {name} must be {' or '.join(dts)}, got {getattr(v, 'dtype', type(v))}")
    bsz, m, n = out.shape
    k = a_codes.shape[-1]
    if (a_codes.shape != (bsz, m, k) or b_codes.shape != (bsz, n, k) or a_scales.shape != (bsz, m, k // BLOCK_SIZE)
            or b_scales.shape != (bsz, n, k // BLOCK_SIZE) or a_exp.shape != (bsz, m) or b_exp.shape != (bsz, n)
            or a_flag.shape != (bsz, m) or b_flag.shape != (bsz, n)):
        raise ValueError(f"fix_flagged: operands do not pair up with out {out.shape}: lhs codes {a_codes.shape}, "
                         f"scales {a_scales.shape}, rhs codes {b_codes.shape}, scales {b_scales.shape}")
    if cfg is not None and not isinstance(cfg, FixConfig):
        raise TypeError(f"fix_flagged: cfg must be a FixConfig or None, got {cfg!r}")
    cfg = cfg or default_config(k)
    if k % BLOCK_SIZE or k % cfg.bk:
        raise ValueError(f"fix_flagged: K={k} must be a multiple of {BLOCK_SIZE} and of bk={cfg.bk}")
    if out.size == 0:  # nothing to fix (a zero-size grid or block does not lower)
        return out
    if k == 0:  # every dot product is an empty sum: flagged entries are 0 (unflagged ones already are)
        fix = ((a_flag & FLAG_EXACT) != 0)[:, :, None] | ((b_flag & FLAG_EXACT) != 0)[:, None, :]
        return jnp.where(fix, jnp.zeros((), out.dtype), out)
    nb = k // BLOCK_SIZE
    n_prog = min(cfg.max_programs, pl.cdiv(m, cfg.bm) * pl.cdiv(n, cfg.bn))
    kernel = functools.partial(_kernel, m=m, n=n, k=k, n_prog=n_prog, cfg=cfg)
    u8 = lambda c, r: lax.bitcast_convert_type(c, jnp.uint8).reshape(bsz, r, nb, BLOCK_SIZE)  # noqa: E731
    args = (a_flag, b_flag, u8(a_codes, m), a_scales, a_exp, u8(b_codes, n), b_scales, b_exp, out)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(out.shape, out.dtype),
        grid=(bsz, n_prog),
        input_output_aliases={len(args) - 1: 0},
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=2),
        interpret=interpret,
        name="mxfp4_fp8_fix_flagged",
    )(*args)
