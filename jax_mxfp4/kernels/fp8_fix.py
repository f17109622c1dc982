"""Exact recompute of the flagged rows and columns of an FP8-path GEMM result, in one Pallas
(Triton lowering) kernel with no host round trip.

The FP8 path (:mod:`jax_mxfp4.backends.fp8`) computes every output from FP8 codes (E4M3, or E5M2 for a gradient); rows of the
lhs and columns (rhs rows) flagged by the encoding (``FLAG_EXACT``: blocks outside the 15-binade
window, flushed or overflowing elements) must be recomputed exactly. The portable form of that
step is a ``lax.while_loop`` whose trip count depends on the flags: on a GPU XLA copies its
predicate to the host before every trip (a device-to-host sync per GEMM, which stalls the
stream), and its body holds three GEMMs that XLA's autotuner compiles for every call site. This
kernel replaces it on CUDA:

- the flagged lhs rows and rhs rows (output columns) are first listed by a small kernel
  (:func:`exact_rows_index`: their indices in order, then -1);
- grid (batch, at most ``FixConfig.max_programs``); the programs share two strided lists of work units
  whose lengths follow the flag counts: (a group of ``cfg.group`` listed rows, a ``bn``-column
  tile) and (a group of listed columns, a ``bm``-row tile); with no flag each program reads the
  two counts and stops;
- a unit gathers its rows (columns) from anywhere in the operand and recomputes them over all of
  K from the operands' exact values in bfloat16 (every dequantized MXFP4 value, E2M1 x 2^k, is
  exact in bfloat16) with float32 accumulation on tensor cores -- the exact path's arithmetic on
  CUDA (:func:`jax_mxfp4.backends.fp8.exact_operand_dtype`), equal to backend "xla" up to the
  order of float32 accumulation -- and scatters them over the result in place; a flagged column
  skips the flagged rows (the row units write those entries: one writer per entry).

So the work follows the flagged rows, not the 128 x 128 tiles they touch (a tile walk recomputed
a whole tile for one flagged row in it).

Exact values from the FP8 operand (:class:`jax_mxfp4.fp8_prepared.FP8Prepared` fields): a row without
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

from .. import checks
from ..fp8_format import FLAG_EXACT, FLAG_NAN
from ..mx_format import BLOCK_SIZE, pow2_from_exponent, scale_e2m1_values


@dataclasses.dataclass(frozen=True)
class FixConfig:
    """Tiles of the recompute: ``group`` listed (flagged) rows or columns per unit (>= 16: the
    tensor-core tile), ``bm`` rows of a column unit, ``bn`` columns of a row unit, K step ``bk``
    (a multiple of 32); Triton ``num_warps``; the most programs per batch element (each walks a
    strided list of work units, so a result with no flag costs two count reads per program)."""

    bm: int = 128
    bn: int = 128
    bk: int = 64
    num_warps: int = 4
    max_programs: int = 512
    group: int = 64  # 2-3x faster than 16 with 1-10% of the rows flagged (H200)

    def __post_init__(self):
        least = {"bm": 16, "bn": 16, "group": 16, "bk": BLOCK_SIZE, "num_warps": 1}  # tensor-core tiles; whole blocks
        for name, lo in least.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo or v & (v - 1):
                raise ValueError(f"FixConfig.{name} must be an int power of two >= {lo}, got {v!r}")
        if isinstance(self.max_programs, bool) or not isinstance(self.max_programs, int) or self.max_programs < 1:
            raise ValueError(f"FixConfig.max_programs must be a positive int, got {self.max_programs!r}")


def exact_values(codes, scale_bytes, row_exp, row_flag):
    """Exact float32 values of FP8-path operand rows (module docstring).

    Args:
      codes: float8_e4m3fn or float8_e5m2 [R, nb, 32]; scale_bytes: uint8 [R, nb] (plain layout);
      row_exp: int32 [R]; row_flag: uint8 [R].
    Returns:
      float32 [R, nb, 32]: the reference's dequantized MXFP4 values (NaN rows all NaN).
    """
    c = codes.astype(jnp.float32)
    e = row_exp[:, None, None]
    e1 = jnp.clip(e, -100, 100)  # row_exp in [-140, 121]: two factors, each a normal power of two
    plain = c * pow2_from_exponent(e1) * pow2_from_exponent(e - e1)
    flag = row_flag.astype(jnp.int32)[:, None, None]
    v = jnp.where((flag & FLAG_EXACT) != 0, scale_e2m1_values(c, scale_bytes), plain)
    return jnp.where((flag & FLAG_NAN) != 0, jnp.float32(jnp.nan), v)


INDEX_CHUNK = 8192
"""Flags per loop step of :func:`exact_rows_index` (at most; a power of two): one step for up to
8192 rows."""


def _index_kernel(*refs, sizes, chunk: int):
    """Program (s, b): operand s's batch element b. The count of its FLAG_EXACT rows (loop 1),
    then per chunk their positions in the list (running offset + cumulative sum) scattered as row
    indices, and -1 in the list's slots at or past the count (loop 2: addresses disjoint from the
    scatter's, so no race between the two stores)."""
    n_ops = len(sizes)
    flag_refs, idx_refs, cnt_refs = refs[:n_ops], refs[n_ops:2 * n_ops], refs[2 * n_ops:]
    side, b = pl.program_id(0), pl.program_id(1)
    lanes = lax.broadcasted_iota(jnp.int32, (chunk,), 0)

    for s_, (flag_ref, idx_ref, cnt_ref, (r, rp)) in enumerate(zip(flag_refs, idx_refs, cnt_refs, sizes)):
        @pl.when(side == s_)
        def _(flag_ref=flag_ref, idx_ref=idx_ref, cnt_ref=cnt_ref, r=r, rp=rp):
            def exact(c):
                rows = c * chunk + lanes
                f = plgpu.load(flag_ref.at[b, pl.ds(c * chunk, chunk)], mask=rows < r, other=0)
                return rows, ((f.astype(jnp.int32) & FLAG_EXACT) != 0).astype(jnp.int32)

            n_chunks = pl.cdiv(rp, chunk)
            total = lax.fori_loop(0, n_chunks, lambda c, t: t + jnp.sum(exact(c)[1]), jnp.int32(0))

            def fill(c, off):
                rows, f = exact(c)
                pos = off + jnp.cumsum(f) - 1
                listed = f != 0
                # masked-off lanes name slot rp (past the end): no two lanes of a store name one entry
                plgpu.store(idx_ref.at[b, jnp.where(listed, pos, rp)], rows, mask=listed)
                empty = (rows >= total) & (rows < rp)  # list slots (numbered like rows) past the count
                plgpu.store(idx_ref.at[b, jnp.where(empty, rows, rp)], jnp.full((chunk,), -1, jnp.int32),
                            mask=empty)
                return off + jnp.sum(f)

            lax.fori_loop(0, n_chunks, fill, jnp.int32(0))
            plgpu.store(cnt_ref.at[pl.ds(b, 1)], jnp.full((1,), total, jnp.int32))


def exact_rows_index(*row_flags, group: int = 1, interpret: bool = False):
    """The rows with FLAG_EXACT set, listed: for each of ``row_flags`` (the lhs and rhs of a GEMM:
    one launch for all) and each batch element, the row indices in increasing order, then -1 up
    to a multiple of ``group`` slots, and their count.

    Why: in XLA the list is a cumulative sum (a reduce_window over the whole row: O(R^2) work),
    a scatter, a sum and a pad, several launches per FP8-path GEMM; here one launch reads each
    flag array twice.

    Args:
      row_flags: one or more uint8 [B, R_i] (the encode's row flags), the same B.
      group: pad each list to a multiple of it. interpret: run the Pallas interpreter (CPU tests).
    Returns:
      one ``(index int32 [B, ceil(R_i / group) * group]`` (the FLAG_EXACT rows in increasing
      order, then -1), ``count int32 [B])`` per flag array, in order.
    Raises:
      TypeError: a flag array not uint8. ValueError: none given, not 2-D, batch sizes that differ,
      or ``group`` not a positive int.
    """
    checks.check_interpret(interpret, "exact_rows_index")
    if not row_flags:
        raise ValueError("exact_rows_index: give at least one row_flag array")
    for i, f in enumerate(row_flags):
        if getattr(f, "dtype", None) != jnp.uint8:
            raise TypeError(f"exact_rows_index: row_flags[{i}] must be uint8, got {getattr(f, 'dtype', type(f))}")
        if f.ndim != 2:
            raise ValueError(f"exact_rows_index: row_flags[{i}] must be [B, R], got shape {f.shape}")
    if len({f.shape[0] for f in row_flags}) != 1:
        raise ValueError(f"exact_rows_index: the row_flag arrays must share B, got {[f.shape for f in row_flags]}")
    if isinstance(group, bool) or not isinstance(group, int) or group < 1:
        raise ValueError(f"exact_rows_index: group must be a positive int, got {group!r}")
    bsz = row_flags[0].shape[0]
    sizes = tuple((f.shape[1], -(-f.shape[1] // group) * group) for f in row_flags)
    if bsz == 0 or any(r == 0 for r, _ in sizes):  # nothing to launch over (a zero-size grid does not lower)
        return tuple((jnp.full((bsz, rp), -1, jnp.int32),
                      jnp.sum((f & FLAG_EXACT) != 0, axis=1, dtype=jnp.int32)) for f, (_, rp) in zip(row_flags, sizes))
    chunk = min(INDEX_CHUNK, max(16, 1 << max(0, (max(rp for _, rp in sizes) - 1).bit_length())))
    outs = pl.pallas_call(
        functools.partial(_index_kernel, sizes=sizes, chunk=chunk),
        out_shape=(tuple(jax.ShapeDtypeStruct((bsz, rp), jnp.int32) for _, rp in sizes)
                   + tuple(jax.ShapeDtypeStruct((bsz,), jnp.int32) for _ in sizes)),
        grid=(len(sizes), bsz),
        compiler_params=plgpu.CompilerParams(num_warps=8, num_stages=1),
        interpret=interpret,
        name="mxfp4_fp8_exact_rows_index",
    )(*row_flags)
    n = len(sizes)
    return tuple(zip(outs[:n], outs[n:]))


def _kernel(li_ref, lc_ref, ri_ref, rc_ref, ac_ref, as_ref, ae_ref, af_ref, bc_ref, bs_ref, be_ref, bf_ref,
            o_in_ref, o_ref, *, m, n, k, n_prog, cfg: FixConfig, code_dtypes):
    del o_in_ref  # aliased with o_ref
    bi, p = pl.program_id(0), pl.program_id(1)
    g = cfg.group
    nj, ni = pl.cdiv(n, cfg.bn), pl.cdiv(m, cfg.bm)
    lhs = (ac_ref, as_ref, ae_ref, af_ref, code_dtypes[0])
    rhs = (bc_ref, bs_ref, be_ref, bf_ref, code_dtypes[1])

    def walk(units, do):  # units p, p + n_prog, ... below ``units`` (a traced count)
        def step(t, carry):
            do(p + t * n_prog)
            return carry

        lax.fori_loop(0, (units - p + n_prog - 1) // n_prog, step, 0)

    def row_unit(u):  # listed lhs rows [group] x a bn-column tile
        grp, j0 = u // nj, (u % nj) * cfg.bn
        rows = li_ref[bi, pl.ds(grp * g, g)]
        cols = j0 + lax.broadcasted_iota(jnp.int32, (cfg.bn,), 0)
        valid, cmask = rows >= 0, cols < n
        acc = _dot_exact(lambda kb: _gathered(lhs, bi, jnp.where(valid, rows, 0), kb, cfg),
                         lambda kb: _tile(rhs, bi, j0, cfg.bn, cmask, kb, cfg), (g, cfg.bn), k, cfg)
        # masked-off entries get indices past the end: no two lanes of a store name one entry
        plgpu.store(o_ref.at[bi, jnp.where(valid, rows, m)[:, None], cols[None, :]], acc.astype(o_ref.dtype),
                    mask=valid[:, None] & cmask[None, :])

    def col_unit(u):  # a bm-row tile x listed rhs rows (output columns) [group]
        grp, i0 = u // ni, (u % ni) * cfg.bm
        cols = ri_ref[bi, pl.ds(grp * g, g)]
        rows = i0 + lax.broadcasted_iota(jnp.int32, (cfg.bm,), 0)
        valid, rmask = cols >= 0, rows < m
        acc = _dot_exact(lambda kb: _tile(lhs, bi, i0, cfg.bm, rmask, kb, cfg),
                         lambda kb: _gathered(rhs, bi, jnp.where(valid, cols, 0), kb, cfg), (cfg.bm, g), k, cfg)
        # entries of flagged rows are the row units' (one writer per entry)
        row_free = (plgpu.load(af_ref.at[bi, pl.ds(i0, cfg.bm)], mask=rmask, other=1) & FLAG_EXACT) == 0
        plgpu.store(o_ref.at[bi, rows[:, None], jnp.where(valid, cols, n)[None, :]], acc.astype(o_ref.dtype),
                    mask=(rmask & row_free)[:, None] & valid[None, :])

    walk(pl.cdiv(lc_ref[bi], g) * nj, row_unit)
    walk(pl.cdiv(rc_ref[bi], g) * ni, col_unit)


def _dot_exact(a_step, b_step, shape, k: int, cfg: FixConfig):
    """float32 [R, C] = sum over K steps of a_step(kb) [R, bk] . b_step(kb) [C, bk]^T (bfloat16
    operands, kb the step's first K block)."""
    nbk = cfg.bk // BLOCK_SIZE

    def body(t, acc):
        a, b = a_step(t * nbk), b_step(t * nbk)
        return acc + lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

    return lax.fori_loop(0, k // cfg.bk, body, jnp.zeros(shape, jnp.float32))


def _values(codes_u8, s, e, f, nr, cfg: FixConfig, code_dtype):
    c = lax.bitcast_convert_type(codes_u8, code_dtype)
    return exact_values(c, s, e, f).astype(jnp.bfloat16).reshape(nr, cfg.bk)


def _tile(op, bi, r0, nr, rmask, kb, cfg: FixConfig):
    """Exact bfloat16 values [nr, bk] of operand rows r0..r0+nr (masked rows 0), K blocks kb.."""
    c_ref, s_ref, e_ref, f_ref, code_dtype = op
    nbk = cfg.bk // BLOCK_SIZE
    c = plgpu.load(c_ref.at[bi, pl.ds(r0, nr), pl.ds(kb, nbk), :], mask=rmask[:, None, None], other=0)
    s = plgpu.load(s_ref.at[bi, pl.ds(r0, nr), pl.ds(kb, nbk)], mask=rmask[:, None], other=0)
    e = plgpu.load(e_ref.at[bi, pl.ds(r0, nr)], mask=rmask, other=0)
    f = plgpu.load(f_ref.at[bi, pl.ds(r0, nr)], mask=rmask, other=0)
    v = _values(c, s, e, f, nr, cfg, code_dtype)
    return jnp.where(rmask[:, None], v, jnp.zeros((), jnp.bfloat16))


def _gathered(op, bi, rows, kb, cfg: FixConfig):
    """Exact bfloat16 values [len(rows), bk] of the operand rows ``rows`` (valid indices), K blocks kb.."""
    c_ref, s_ref, e_ref, f_ref, code_dtype = op
    nbk = cfg.bk // BLOCK_SIZE
    nr = rows.shape[0]
    blk = kb + lax.broadcasted_iota(jnp.int32, (nbk,), 0)
    lane = lax.broadcasted_iota(jnp.int32, (BLOCK_SIZE,), 0)
    c = plgpu.load(c_ref.at[bi, rows[:, None, None], blk[None, :, None], lane[None, None, :]])
    s = plgpu.load(s_ref.at[bi, rows[:, None], blk[None, :]])
    e = plgpu.load(e_ref.at[bi, rows])
    f = plgpu.load(f_ref.at[bi, rows])
    return _values(c, s, e, f, nr, cfg, code_dtype)


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
      a_codes: float8_e4m3fn or float8_e5m2 [B, M, K]; a_scales: uint8 [B, M, K/32]; a_exp: int32 [B, M];
        a_flag: uint8 [B, M] -- the lhs's :class:`jax_mxfp4.fp8_prepared.FP8Prepared` fields (scale bytes);
      b_*: the same for the rhs [B, N, K].
      cfg: :class:`FixConfig` (default :func:`default_config`); interpret: the Pallas interpreter.
    Returns:
      the updated ``out``.
    Raises:
      ValueError: shapes that do not pair up, or K not a multiple of 32 and of ``cfg.bk``.
      TypeError: dtypes other than those above; a ``cfg`` that is not a :class:`FixConfig`.
    An empty ``out`` comes back as it is; with K = 0 the flagged entries become 0 (an empty sum).
    """
    checks.check_interpret(interpret, "fix_flagged")
    if getattr(out, "ndim", None) != 3:
        raise ValueError(f"fix_flagged: out must be a [B, M, N] array, got shape {getattr(out, 'shape', type(out))}")
    want = {"out": (out, ("float32", "bfloat16", "float16")), "a_codes": (a_codes, ("float8_e4m3fn", "float8_e5m2")),
            "b_codes": (b_codes, ("float8_e4m3fn", "float8_e5m2")), "a_scales": (a_scales, ("uint8",)),
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
    nb, g = k // BLOCK_SIZE, cfg.group
    (li, lc), (ri, rc) = exact_rows_index(a_flag, b_flag, group=g, interpret=interpret)
    units = max(pl.cdiv(m, g) * pl.cdiv(n, cfg.bn), pl.cdiv(n, g) * pl.cdiv(m, cfg.bm))
    n_prog = min(cfg.max_programs, units)
    kernel = functools.partial(_kernel, m=m, n=n, k=k, n_prog=n_prog, cfg=cfg,
                               code_dtypes=(a_codes.dtype, b_codes.dtype))
    u8 = lambda c, r: lax.bitcast_convert_type(c, jnp.uint8).reshape(bsz, r, nb, BLOCK_SIZE)  # noqa: E731
    args = (li, lc, ri, rc, u8(a_codes, m), a_scales, a_exp, a_flag, u8(b_codes, n), b_scales, b_exp,
            b_flag, out)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(out.shape, out.dtype),
        grid=(bsz, n_prog),
        input_output_aliases={len(args) - 1: 0},
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=2),
        interpret=interpret,
        name="mxfp4_fp8_fix_flagged",
    )(*args)
