"""Fused quantize-to-FP8-operand in two tiled passes: float -> MXFP4 -> E4M3 codes x one power of
two per row, the same outputs as :func:`jax_mxfp4.kernels.fp8_quantize.quantize_fp8_2d` bit for
bit, without holding whole rows in registers.

Why two passes: a block's shift d (:mod:`jax_mxfp4.fp8`) depends on the largest counted scale
byte of its whole row and on the row's flags, so one pass must hold a row at a time; the
one-pass kernel does (:mod:`~jax_mxfp4.kernels.fp8_quantize`), which caps the row length, costs
occupancy, and reads transposed layouts as strided columns (1.1-1.6 ms for 8192x8192 bf16 on the
H200: training transposed such operands with XLA first, 0.07 ms each). Here

1. the stats pass reads x in tiles of ``rows`` output rows x ``blocks`` 32-element blocks and
   writes each block's scale byte and its largest / smallest nonzero E2M1 magnitude code
   (int32 [R, Kq/32], packed);
2. XLA turns the stats into the shifts, row exponents and flags with the one encoding rule
   (:func:`jax_mxfp4.fp8.encode_block_stats`; [R, Kq/32] arrays: 1/32 of the elements);
3. the values pass reads x again in the same tiles, quantizes and writes the E4M3 codes.

Both passes take either layout with coalesced reads: quantized axis last (rows of x are output
rows), or quantized axis FIRST (x [Kq, R], tiles of ``rows`` contiguous columns, transposed in
registers; the codes are written as [R, Kq]: the K-major operand of a wgrad GEMM without an XLA
transpose). Stochastic rounding uses the reference's uniforms (generated in the kernel from the
element's flat index for threefry keys, or read from the reference's draw): the stats pass needs
them only in tiles holding a special block (scale bytes 0, 1, 253, 254: their stats depend on
the rounded codes), which take the general path.

Measured (NVIDIA H200, jax 0.11.2, 2026-12-02, 8192x8192 bf16, benchmarks as of commit 02fcf53:
``train_step.py --kernel --tiled``):
SLOWER than what it was meant to replace, so training keeps it as an option
(``JAX_MXFP4_FUSED_TRAINING=tiled``), not the default. Along rows, round to nearest: 0.164-0.226
ms over eight tiles (64x4 blocks, 4 warps: 0.166; 32x8: 0.164) against 0.185 ms for the one-pass
kernel's 1-row x 16-warp tile and 0.120 ms for the unfused passes (SWAR quantizer + encode kernel);
stochastic rounding (threefry) 0.40-1.38 ms against 0.323. In the linear training step (T = K = N
= 8192): 0.860x of bf16 against 0.755x for the default (rows) mode; profile: the stats pass
0.045 ms along rows (read speed) but 0.10-0.20 ms transposed, the values pass 0.134 ms along rows
and 0.31-0.48 ms transposed (the in-register transpose of 3-D tiles and the per-element work, not
the bytes, limit it). Its use: quantized lengths above MAX_ROW, bit for bit.

Every rule is shared code from :mod:`jax_mxfp4.kernels.fp8_quantize` (plain / general paths)
and :mod:`jax_mxfp4.kernels.quantize` (scale, rounding, Threefry). Bit-identical to the
reference in the Pallas interpreter (tests/test_fp8_fused.py).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ..mx_format import BLOCK_SIZE, as_e8m0, pow2_from_exponent
from . import fp8_quantize as fq
from .quantize import _ABS, block_scale_bits, threefry_uniform

_STAT_MAG_SHIFT, _STAT_MIN_SHIFT = 8, 12  # packed stats: byte | max_mag << 8 | min_nz << 12


@dataclasses.dataclass(frozen=True)
class TiledConfig:
    """Tile of both passes: ``rows`` output rows x ``blocks`` 32-element blocks (powers of two),
    Triton ``num_warps``, and whether all-plain tiles take the plain path (False: the general
    path everywhere, for A/B timing; same bits)."""

    rows: int = 64
    blocks: int = 4
    num_warps: int = 4
    plain_path: bool = True

    def __post_init__(self):
        for name in ("rows", "blocks", "num_warps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1 or v & (v - 1):
                raise ValueError(f"TiledConfig.{name} must be a power of two, got {v!r}")
        if self.num_warps > 32:
            raise ValueError(f"TiledConfig.num_warps must be at most 32, got {self.num_warps}")
        if not isinstance(self.plain_path, bool):
            raise TypeError(f"TiledConfig.plain_path must be a bool, got {self.plain_path!r}")


def default_tiled_config(transposed: bool, stochastic: bool = False) -> TiledConfig:
    """The tile both passes use by default (layout and rounding of the call)."""
    del transposed, stochastic
    return TiledConfig()


def _tile(x_ref, r0, b0, br, bb, n_rows, n_blocks, transposed):
    """The float tile [br, bb, 32] (output layout) at output rows r0.., blocks b0.. (0 outside)."""
    over = n_rows % br != 0 or n_blocks % bb != 0
    if transposed:  # x viewed as [n_blocks, 32, n_rows]: output rows are columns of x
        shape = (bb, BLOCK_SIZE, br)
        view = x_ref.at[pl.ds(b0, bb), fq.from0(BLOCK_SIZE), pl.ds(r0, br)]
        mask = None
        if over:
            mask = ((b0 + lax.broadcasted_iota(jnp.int32, shape, 0) < n_blocks)
                    & (r0 + lax.broadcasted_iota(jnp.int32, shape, 2) < n_rows))
        x = plgpu.load(view) if mask is None else plgpu.load(view, mask=mask, other=0)
        return jnp.transpose(x, (2, 0, 1))
    view = x_ref.at[pl.ds(r0, br), pl.ds(b0, bb), fq.from0(BLOCK_SIZE)]
    return plgpu.load(view) if not over else plgpu.load(view, mask=_mask3(r0, b0, br, bb, n_rows, n_blocks), other=0)


def _mask3(r0, b0, br, bb, n_rows, n_blocks):
    shape = (br, bb, BLOCK_SIZE)
    return ((r0 + lax.broadcasted_iota(jnp.int32, shape, 0) < n_rows)
            & (b0 + lax.broadcasted_iota(jnp.int32, shape, 1) < n_blocks))


def _mask2(r0, b0, br, bb, n_rows, n_blocks):
    shape = (br, bb)
    return ((r0 + lax.broadcasted_iota(jnp.int32, shape, 0) < n_rows)
            & (b0 + lax.broadcasted_iota(jnp.int32, shape, 1) < n_blocks))


def _uniforms(rng_ref, rng, r0, b0, br, bb, n_rows, n_blocks):
    """The reference's uniforms of the tile [br, bb, 32], or None (round to nearest): element
    (row, col) of ``jax.random.uniform(key, [R, Kq])`` (threefry: generated from the flat index;
    "input": read from the drawn array, element-aligned with the output rows)."""
    if rng is None:
        return None
    if rng == "input":
        view = rng_ref.at[pl.ds(r0, br), pl.ds(b0, bb), fq.from0(BLOCK_SIZE)]
        if n_rows % br or n_blocks % bb:
            return plgpu.load(view, mask=_mask3(r0, b0, br, bb, n_rows, n_blocks), other=0)
        return plgpu.load(view)
    shape = (br, bb, BLOCK_SIZE)
    row = (r0 + lax.broadcasted_iota(jnp.int32, shape, 0)).astype(jnp.uint32)
    col = (BLOCK_SIZE * (b0 + lax.broadcasted_iota(jnp.int32, shape, 1))
           + lax.broadcasted_iota(jnp.int32, shape, 2)).astype(jnp.uint32)
    return threefry_uniform(rng_ref[0], rng_ref[1], row * jnp.uint32(n_blocks * BLOCK_SIZE) + col)


def _tile_terms(x_ref, r0, b0, br, bb, n_rows, n_blocks, transposed, scale_mode):
    """What both passes compute first from their tile: float32 bits, |bits|, each block's amax
    bits, (bad, scale byte) (:func:`~jax_mxfp4.kernels.quantize.block_scale_bits`) and inv = 2^-s
    [..., nb, 1]."""
    x = _tile(x_ref, r0, b0, br, bb, n_rows, n_blocks, transposed)
    bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)  # exact widening
    a = bits & _ABS
    amax_bits = jnp.max(a, axis=-1)
    bad, byte, s = block_scale_bits(amax_bits, scale_mode)
    return bits, a, amax_bits, bad, byte, pow2_from_exponent(-s)[..., None]


def _all_plain(amax_bits, byte):
    plain = (amax_bits == 0) | ((byte >= fq.PLAIN_MIN_BYTE) & (byte <= fq.PLAIN_MAX_BYTE))
    return jnp.min(jnp.min(plain.astype(jnp.int32), axis=-1), axis=-1) != 0


def _stats_kernel(*refs, n_rows, n_blocks, br, bb, scale_mode, rng, transposed, plain_path):
    x_ref, rng_ref, stats_ref = refs if rng is not None else (refs[0], None, refs[1])
    r0, b0 = pl.program_id(0) * br, pl.program_id(1) * bb
    bits, a, amax_bits, bad, byte, inv = _tile_terms(x_ref, r0, b0, br, bb, n_rows, n_blocks, transposed, scale_mode)

    def plain():  # no special byte: only "counted" (max_mag != 0) is read, from the amax
        return fq.plain_max_code(amax_bits, inv), jnp.full(amax_bits.shape, 8, jnp.int32)

    def general():  # special bytes: the rounded codes decide (the rounding's uniforms needed)
        u = _uniforms(rng_ref, rng, r0, b0, br, bb, n_rows, n_blocks)
        mag, _ = fq.general_codes(bits, a, u, inv, bad)
        return jnp.max(mag, axis=-1), jnp.min(jnp.where(mag != 0, mag, 8), axis=-1)

    if plain_path:
        max_mag, min_nz = lax.cond(_all_plain(amax_bits, byte), plain, general)
    else:
        max_mag, min_nz = general()
    stats = (byte.astype(jnp.int32) | (max_mag << _STAT_MAG_SHIFT) | (min_nz << _STAT_MIN_SHIFT))
    view = stats_ref.at[pl.ds(r0, br), pl.ds(b0, bb)]
    if n_rows % br or n_blocks % bb:
        plgpu.store(view, stats, mask=_mask2(r0, b0, br, bb, n_rows, n_blocks))
    else:
        plgpu.store(view, stats)


def _values_kernel(*refs, n_rows, n_blocks, br, bb, scale_mode, rng, transposed, plain_path):
    if rng is not None:
        x_ref, d_ref, rng_ref, codes_ref = refs
    else:
        (x_ref, d_ref, codes_ref), rng_ref = refs, None
    r0, b0 = pl.program_id(0) * br, pl.program_id(1) * bb
    over = n_rows % br != 0 or n_blocks % bb != 0
    bits, a, amax_bits, bad, byte, inv = _tile_terms(x_ref, r0, b0, br, bb, n_rows, n_blocks, transposed, scale_mode)
    dview = d_ref.at[pl.ds(r0, br), pl.ds(b0, bb)]
    d = (plgpu.load(dview, mask=_mask2(r0, b0, br, bb, n_rows, n_blocks), other=0) if over
         else plgpu.load(dview)).astype(jnp.int32)
    u = _uniforms(rng_ref, rng, r0, b0, br, bb, n_rows, n_blocks)

    def plain():
        return fq.plain_values(fq.plain_magnitudes(a, u, inv), bits, d)

    def general():
        _, code4 = fq.general_codes(bits, a, u, inv, bad)
        return fq.general_values(code4, d)

    vals = lax.cond(_all_plain(amax_bits, byte), plain, general) if plain_path else general()
    codes = vals.astype(jnp.float8_e4m3fn)
    view = codes_ref.at[pl.ds(r0, br), pl.ds(b0, bb), fq.from0(BLOCK_SIZE)]
    if over:
        plgpu.store(view, codes, mask=_mask3(r0, b0, br, bb, n_rows, n_blocks))
    else:
        plgpu.store(view, codes)


@functools.partial(jax.jit, static_argnames=("scale_mode", "transposed", "cfg", "interpret"))
def quantize_fp8_2d_tiled(x, key_data=None, uniform=None, *, scale_mode="even", transposed=False,
                          cfg: TiledConfig | None = None, interpret=False):
    """Quantize a 2-D float array to MXFP4 and encode it as FP8 rows, in two tiled passes.

    Args, returns and errors as :func:`jax_mxfp4.kernels.fp8_quantize.quantize_fp8_2d` (same
    bits), except that ``cfg`` is a :class:`TiledConfig` and the quantized axis has no length
    cap (:data:`~jax_mxfp4.kernels.fp8_quantize.MAX_ROW` does not apply): x float32 / bfloat16 /
    float16 [R, Kq] quantized along its last axis, or [Kq, R] along its first
    (``transposed=True``; codes written as [R, Kq]); ``key_data`` uint32[2] threefry key data or
    ``uniform`` float32 uniforms (the reference's draw, output-row-aligned) for stochastic
    rounding. Returns (codes float8_e4m3fn [R, Kq], scales float8_e8m0fnu [R, Kq/32], row_exp
    int32 [R], row_flag uint8 [R]).
    """
    from ..fp8 import encode_block_stats

    if cfg is not None and not isinstance(cfg, TiledConfig):
        raise TypeError(f"cfg must be a TiledConfig or None, got {cfg!r}")
    kq, n_rows = fq.check_call(x, key_data, uniform, transposed, "quantize_fp8_2d_tiled", max_row=None)
    stochastic = key_data is not None or uniform is not None
    cfg = cfg or default_tiled_config(transposed, stochastic)
    n_blocks = kq // BLOCK_SIZE
    br = min(cfg.rows, fq._pow2_at_least(n_rows))
    bb = min(cfg.blocks, fq._pow2_at_least(n_blocks))
    x3 = x.reshape(n_blocks, BLOCK_SIZE, n_rows) if transposed else x.reshape(n_rows, n_blocks, BLOCK_SIZE)
    rng, rng_arg = None, []
    if key_data is not None:
        rng, rng_arg = "threefry", [jnp.asarray(key_data, jnp.uint32).reshape(2)]
    elif uniform is not None:  # a free reshape: the row-major order of the output rows
        rng, rng_arg = "input", [uniform.reshape(n_rows, n_blocks, BLOCK_SIZE)]
    static = dict(n_rows=n_rows, n_blocks=n_blocks, br=br, bb=bb, scale_mode=scale_mode, rng=rng,
                  transposed=transposed, plain_path=cfg.plain_path)
    grid = (pl.cdiv(n_rows, br), pl.cdiv(n_blocks, bb))
    params = plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=1)
    suffix = "_t" if transposed else ""
    stats = pl.pallas_call(
        functools.partial(_stats_kernel, **static),
        out_shape=jax.ShapeDtypeStruct((n_rows, n_blocks), jnp.int32),
        grid=grid, compiler_params=params, interpret=interpret,
        name="mxfp4_fp8_tile_stats" + suffix,
    )(x3, *rng_arg)
    byte = stats & 0xFF
    d, row_exp, row_flag = encode_block_stats(byte, (stats >> _STAT_MAG_SHIFT) & 0xF,
                                              (stats >> _STAT_MIN_SHIFT) & 0xF)
    codes = pl.pallas_call(
        functools.partial(_values_kernel, **static),
        out_shape=jax.ShapeDtypeStruct((n_rows, n_blocks, BLOCK_SIZE), jnp.float8_e4m3fn),
        grid=grid, compiler_params=params, interpret=interpret,
        name="mxfp4_fp8_tile_values" + suffix,
    )(x3, d.astype(jnp.int8), *rng_arg)
    return codes.reshape(n_rows, kq), as_e8m0(byte), row_exp, row_flag


__all__ = ["TiledConfig", "default_tiled_config", "quantize_fp8_2d_tiled"]
