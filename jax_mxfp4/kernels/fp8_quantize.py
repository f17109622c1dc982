"""Fused quantize-to-FP8-operand: float rows -> MXFP4 -> FP8 codes (E4M3, or E5M2 for a
gradient) x one power of two per row, in one Pallas (Triton lowering) kernel that reads the float
input once.

Output: exactly ``jax_mxfp4.fp8_prepared.encode_rows(quantize(x, axis, ...), fmt)`` (codes ``float8_e4m3fn`` or ``float8_e5m2``,
E8M0 scale bytes, per-row exponent and flags; :mod:`jax_mxfp4.fp8_prepared`), i.e. the children of
``prepare_fp8(quantize(x, axis, ...))``, without writing the packed MXFP4 array in between. The
quantized axis is last: the rows of x are the output rows (an operand quantized along a strided
axis takes :mod:`jax_mxfp4.kernels.quantize_columns` and the encode kernel instead: strided
reads made this kernel several times slower, docs/performance.md).

Design: one program owns ``rows`` whole output rows (the full quantized length, padded to a
power of two with masked loads) and keeps them in registers: the per-row exponent needs the
row's largest counted block scale, and the row's flags (blocks outside the 15-binade window,
flushed or overflowing elements) decide the shift of every block of the row, so a tile shorter
than a row would have to read the input twice (a second sweep, or an amax pre-pass writing
and reading the scales). Whole rows in registers cost register pressure for long rows: the
quantized length is capped (:data:`MAX_ROW`), and the caller falls back to the unfused path
beyond it.

With the SWAR quantizer the unfused passes are faster for round to nearest, so training runs
this kernel for the stochastically rounded operands only (H200 timings: docs/performance.md).

Every rule is shared code: the block scale and the E2M1 rounding (nearest, or stochastic with
the reference's uniforms, generated in the kernel for Threefry keys and for rbg keys (Philox,
one block of four words per four elements), or read as an input array drawn by
``jax.random.uniform``) come from :mod:`jax_mxfp4.kernels.quantize_kernel`
(:func:`block_scale_bits`, :func:`magnitude_code_bits`, :func:`threefry_uniform`,
:func:`philox_uniforms`, :func:`sr_uniforms`), the row encoding from :func:`jax_mxfp4.fp8_format.encode_blocks`, the E2M1
decoding from :func:`jax_mxfp4.mx_format.decode_e2m1`. Bit-identical to the reference in the
Pallas interpreter (tests/test_fp8_fused.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .. import checks
from ..mx_format import (
    BLOCK_SIZE,
    as_e8m0,
    decode_e2m1,
    e2m1_magnitude_code,
    e2m1_nearest_magnitude,
    e2m1_stochastic_magnitude,
    pow2_from_exponent,
)
from .quantize_kernel import (_ABS, _MIN_NORMAL_BITS, block_scale_bits, check_key_data, check_uniform_dtype,
                             interleave4, magnitude_code_bits,
                             philox_uniforms, threefry_uniform)

_SIGN = -(2**31)  # int32 sign bit

MAX_ROW = 16384
"""Longest quantized axis the fused kernel takes (whole rows live in registers)."""


@dataclasses.dataclass(frozen=True)
class Fp8QuantizeConfig:
    """``rows`` output rows per program (a power of two), Triton ``num_warps``."""

    rows: int = 1
    num_warps: int = 8

    def __post_init__(self):
        for name in ("rows", "num_warps"):
            object.__setattr__(self, name, checks.power_of_two(getattr(self, name), f"Fp8QuantizeConfig.{name}",
                                                               most=32 if name == "num_warps" else None))


TILE_ELEMENTS = 8192
"""Default tile with stochastic rounding: rows x (quantized length rounded up to a power of two)
<= this many elements."""
ELEMENTS_PER_THREAD = 16
"""Default warps with stochastic rounding: the tile spread at about this many elements per thread
(up to 16 warps), so that the row's values and the Threefry state stay in registers."""
TILE_ELEMENTS_NEAREST, ELEMENTS_PER_THREAD_NEAREST = 16384, 128
"""The same for round to nearest: fewer, fuller threads (H200 sweep: docs/performance.md)."""


def default_config(kq: int, stochastic: bool = False) -> Fp8QuantizeConfig:
    """Tile for a quantized length ``kq`` (from an H200 sweep at 8192x8192 bf16; other shapes
    follow the same elements-per-thread rule).

    Args: ``kq`` the quantized axis length, an int: a positive multiple of 32, at most
    :data:`MAX_ROW` (what :func:`quantize_fp8_2d` takes); ``stochastic`` the rounding of the call.
    Raises:
      TypeError: ``kq`` not an int (bool included).
      ValueError: ``kq`` not a positive multiple of 32, or above :data:`MAX_ROW` (lengths the
        kernel does not take)."""
    if isinstance(kq, (bool, np.bool_)) or not isinstance(kq, (int, np.integer)):
        raise TypeError(f"default_config: kq must be an int (the quantized axis length), got {kq!r}")
    kq = int(kq)  # numpy integers: no bit_length
    if kq < BLOCK_SIZE or kq % BLOCK_SIZE or kq > MAX_ROW:
        raise ValueError(f"default_config: kq={kq} must be a positive multiple of {BLOCK_SIZE} "
                         f"at most MAX_ROW = {MAX_ROW}")
    nearest = not stochastic
    tile, per_thread = ((TILE_ELEMENTS_NEAREST, ELEMENTS_PER_THREAD_NEAREST) if nearest
                        else (TILE_ELEMENTS, ELEMENTS_PER_THREAD))
    kp = _pow2_at_least(kq)
    if nearest and kp > LONG_ROW_NEAREST:
        return Fp8QuantizeConfig(rows=1, num_warps=16)
    rows = max(1, min(16, tile // kp))
    warps = max(4, min(16, _pow2_at_least(rows * kp // (32 * per_thread))))
    return Fp8QuantizeConfig(rows=rows, num_warps=warps)


LONG_ROW_NEAREST = 8192
"""Round to nearest along rows longer than this: one row per program on 16 warps (the
elements-per-thread rule's 4 warps spilled registers at 16384: 11x slower on an H200)."""


def _pow2_at_least(n):
    return 1 << max(0, (n - 1).bit_length())


PLAIN_MIN_BYTE, PLAIN_MAX_BYTE = 3, 252
"""Scale bytes of the blocks the plain path takes (besides all-zero blocks). From 3: a float32
subnormal element (< 2^-126) over a scale of at least 2^-124 is below 0.25, which rounds to the
zero that the reference's subnormal flush gives, so round-to-nearest needs no per-element flush;
bytes 0/1 (flushed codes) and 253/254 (overflow) are :func:`jax_mxfp4.fp8_format.special_blocks`' and
0xFF (a NaN/Inf in the block) is the general path's."""


def encode_tile(bits, u, scale_mode, fmt=None):
    """Quantize and encode whole rows held in registers.

    Args:
      bits: int32 [R, nb, 32], the float32 bits of R rows of nb 32-element blocks.
      u: float32 uniforms [R, nb, 32] for stochastic rounding, or None (round to nearest even).
      scale_mode: the scale rule.
      fmt: the :class:`jax_mxfp4.fp8_format.Fp8Format` of the codes (default E4M3).
    A tile whose blocks are all plain (:data:`PLAIN_MIN_BYTE`) takes :func:`_encode_plain` (fewer
    operations per element), any other :func:`_encode_general`; both give the same bits
    (tests/test_fp8_fused.py).

    Returns:
      (float32 values E2M1 x 2^d [R, nb, 32] (exact E4M3 values), scale bytes uint8 [R, nb],
      row_exp int32 [R], row_flag uint8 [R]), as ``encode_rows(quantize(...))``.
    """
    a = bits & _ABS
    amax_bits = jnp.max(a, axis=-1)
    bad, byte, s = block_scale_bits(amax_bits, scale_mode)
    inv = pow2_from_exponent(-s)[..., None]
    plain = (amax_bits == 0) | ((byte >= PLAIN_MIN_BYTE) & (byte <= PLAIN_MAX_BYTE))
    all_plain = jnp.min(jnp.min(plain.astype(jnp.int32), axis=-1), axis=-1) != 0
    from ..fp8_format import E4M3

    fmt = E4M3 if fmt is None else fmt
    vals, row_exp, row_flag = lax.cond(all_plain, lambda: _encode_plain(bits, a, u, inv, amax_bits, byte, fmt),
                                       lambda: _encode_general(bits, a, u, inv, bad, byte, fmt))
    return vals, byte, row_exp, row_flag


def _encode_general(bits, a, u, inv, bad, byte, fmt):
    """Every block kind (NaN/Inf, flushed subnormals, special scale bytes): codes, then values."""
    from ..fp8_format import encode_blocks

    mag, code4 = general_codes(bits, a, u, inv, bad)
    d, row_exp, row_flag = encode_blocks(byte.astype(jnp.int32), mag, fmt)
    return general_values(code4, d), row_exp, row_flag


def general_codes(bits, a, u, inv, bad):
    """(E2M1 magnitude codes, 4-bit codes with the sign) int32 [..., nb, 32] of every block kind:
    NaN/Inf blocks (``bad``) get codes 0 (the reference's), the sign nibble comes from the input
    bits (-0.0 kept). ``a`` = bits with the sign cleared, ``inv`` = 2^-s [..., nb, 1], ``u`` the
    uniforms or None (nearest)."""
    mag = jnp.where(bad[..., None], 0, magnitude_code_bits(a, inv, u))
    code4 = mag | ((bits >> 28) & 0x8)
    code4 = jnp.where(bad[..., None], 0, code4)
    return mag, code4


def general_values(code4, d):
    """The FP8 values E2M1(code4) x 2^d (float32, exact) of :func:`general_codes`' codes."""
    return decode_e2m1(code4) * pow2_from_exponent(d)[..., None]


def _encode_plain(bits, a, u, inv, amax_bits, byte, fmt):
    """Tiles whose blocks are all plain (:data:`PLAIN_MIN_BYTE`): the E2M1 magnitude as a float
    (:func:`plain_magnitudes`) times 2^d, the input's sign bit OR-ed in; no code, no decode, no
    NaN masks; round to nearest takes each block's largest code from its amax (rounding is
    monotone) instead of a reduction over the elements."""
    from ..fp8_format import encode_block_stats

    q = plain_magnitudes(a, u, inv)
    if u is None:
        max_mag = plain_max_code(amax_bits, inv)
    else:
        max_mag = e2m1_magnitude_code(jnp.max(q, axis=-1))
    min_nz = jnp.full(max_mag.shape, 8, jnp.int32)  # read only for scale bytes 0/1: none here
    d, row_exp, row_flag = encode_block_stats(byte.astype(jnp.int32), max_mag, min_nz, fmt)
    return plain_values(q, bits, d), row_exp, row_flag


def plain_magnitudes(a, u, inv):
    """E2M1 magnitudes (float32 on the E2M1 grid) of plain blocks' elements, ``a`` their |bits|,
    ``inv`` = 2^-s [..., nb, 1]: round to nearest (``u`` None; no flush needed, see
    :data:`PLAIN_MIN_BYTE`) or stochastic with uniforms ``u`` (any nonzero value can round up:
    subnormal inputs flushed as the reference does)."""
    if u is None:
        return e2m1_nearest_magnitude(lax.bitcast_convert_type(a, jnp.float32) * inv)
    a = jnp.where(a < _MIN_NORMAL_BITS, 0, a)
    return e2m1_stochastic_magnitude(lax.bitcast_convert_type(a, jnp.float32) * inv, u)


def plain_max_code(amax_bits, inv):
    """Each plain block's largest E2M1 magnitude code with round to nearest, from its amax
    (rounding is monotone) [..., nb]. With stochastic rounding it is also nonzero exactly where
    the block is (a plain block's amax x 2^-s is > 2 for every scale rule of
    :func:`jax_mxfp4.mx_format.e8m0_from_amax`, which no rounding takes to 0), which is all
    :func:`jax_mxfp4.fp8_format.encode_block_stats` reads of it for plain scale bytes."""
    return e2m1_magnitude_code(lax.bitcast_convert_type(amax_bits, jnp.float32) * inv[..., 0])


def plain_values(q, bits, d):
    """The FP8 values (float32, exact) of plain blocks: magnitudes ``q`` x 2^d, the input's sign
    bit OR-ed in."""
    v = lax.bitcast_convert_type(q * pow2_from_exponent(d)[..., None], jnp.int32)
    return lax.bitcast_convert_type(v | (bits & _SIGN), jnp.float32)


def from0(n):
    """``pl.ds(0, n)`` started at an int32 0: a Python 0 (or a bare ``:``) becomes int64 under
    ``jax_enable_x64`` beside the int32 program ids, which the Pallas interpreter refuses (a
    dynamic_slice TypeError)."""
    return pl.ds(jnp.int32(0), n)


def _load_rows(ref, r0, br, nbp, mask):
    """Rows r0 .. r0 + br of a [rows, blocks, 32] array (blocks padded to ``nbp``), masked loads
    (0 outside) where ``mask`` is given."""
    view = ref.at[pl.ds(r0, br), from0(nbp), from0(BLOCK_SIZE)]
    return plgpu.load(view) if mask is None else plgpu.load(view, mask=mask, other=0)


def _kernel(*refs, n_rows, n_blocks, nbp, br, scale_mode, kernel_rng, uniform_input, fmt, ptx=False):
    if kernel_rng:
        x_ref, key_ref, codes_ref, scale_ref, exp_ref, flag_ref = refs
    elif uniform_input:
        x_ref, u_ref, codes_ref, scale_ref, exp_ref, flag_ref = refs
    else:
        x_ref, codes_ref, scale_ref, exp_ref, flag_ref = refs
    r0 = pl.program_id(0) * br
    rows_over = n_rows % br != 0
    blocks_over = nbp != n_blocks
    oshape = (br, nbp, BLOCK_SIZE)
    omask = None  # masks only where the tile overhangs the array (static): unmasked accesses vectorize
    if rows_over or blocks_over:
        omask = ((r0 + lax.broadcasted_iota(jnp.int32, oshape, 0) < n_rows)
                 & (lax.broadcasted_iota(jnp.int32, oshape, 1) < n_blocks))
    x = _load_rows(x_ref, r0, br, nbp, omask)
    bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)  # exact widening
    u = None
    if kernel_rng == "threefry":  # the reference's uniforms: element (row, col) of jax.random.uniform(key, [R, Kq])
        row = (r0 + lax.broadcasted_iota(jnp.int32, oshape, 0)).astype(jnp.uint32)
        col = (BLOCK_SIZE * lax.broadcasted_iota(jnp.int32, oshape, 1)
               + lax.broadcasted_iota(jnp.int32, oshape, 2)).astype(jnp.uint32)
        u = threefry_uniform(key_ref[0], key_ref[1], row * jnp.uint32(n_blocks * BLOCK_SIZE) + col)
    elif kernel_rng == "philox":  # the same for rbg keys: one Philox block per 4 elements, interleaved
        gshape = (br, nbp, BLOCK_SIZE // 4)
        row = (r0 + lax.broadcasted_iota(jnp.int32, gshape, 0)).astype(jnp.uint32)
        grp = (BLOCK_SIZE // 4 * lax.broadcasted_iota(jnp.int32, gshape, 1)
               + lax.broadcasted_iota(jnp.int32, gshape, 2)).astype(jnp.uint32)
        words = philox_uniforms([key_ref[i] for i in range(4)], row * jnp.uint32(n_blocks * BLOCK_SIZE // 4) + grp, ptx)
        u = interleave4(*words)
    elif uniform_input:  # the reference's draw read in, element-aligned with the output rows
        u = _load_rows(u_ref, r0, br, nbp, omask)
    vals, byte, row_exp, row_flag = encode_tile(bits, u, scale_mode, fmt)
    cview = codes_ref.at[pl.ds(r0, br), from0(nbp), from0(BLOCK_SIZE)]
    sview = scale_ref.at[pl.ds(r0, br), from0(nbp)]
    eview, fview = exp_ref.at[pl.ds(r0, br)], flag_ref.at[pl.ds(r0, br)]
    codes = vals.astype(fmt.dtype)  # exact values: no rounding
    if omask is None:
        plgpu.store(cview, codes)
        plgpu.store(sview, byte)
        plgpu.store(eview, row_exp)
        plgpu.store(fview, row_flag)
        return
    plgpu.store(cview, codes, mask=omask)
    smask = ((r0 + lax.broadcasted_iota(jnp.int32, oshape[:2], 0) < n_rows)
             & (lax.broadcasted_iota(jnp.int32, oshape[:2], 1) < n_blocks))
    plgpu.store(sview, byte, mask=smask)
    rmask = r0 + lax.broadcasted_iota(jnp.int32, (br,), 0) < n_rows
    plgpu.store(eview, row_exp, mask=rmask)
    plgpu.store(fview, row_flag, mask=rmask)


@functools.partial(jax.jit, static_argnames=("scale_mode", "cfg", "interpret", "fmt"))
def quantize_fp8_2d(x, key_data=None, uniform=None, *, scale_mode="even",
                    cfg: Fp8QuantizeConfig | None = None, interpret=False, fmt="e4m3"):
    """Quantize a 2-D float array to MXFP4 and encode it as FP8 rows, in one pass.

    Args:
      x: float32/bfloat16/float16 [R, Kq] quantized along its last axis, Kq a multiple of 32
        and at most :data:`MAX_ROW`.
      key_data: None (round to nearest even), or the data of the key: uint32[2] for a
        threefry2x32 key (:func:`~jax_mxfp4.kernels.quantize_kernel.threefry_uniform`), uint32[4]
        for an rbg / unsafe_rbg key (:func:`~jax_mxfp4.kernels.quantize_kernel.philox_uniforms`):
        stochastic rounding with the uniforms of the reference, ``jax.random.uniform(key,
        [R, Kq / 32, 32])`` (the quantized axis moved last), generated in the kernel.
      uniform: None, or float32 uniforms in [0, 1) for stochastic rounding read by the kernel
        (``jax_mxfp4.kernels.quantize_kernel.quantize_2d``'s convention): element-aligned with
        the rows, i.e. of shape [*lead, Kq] or [*lead, Kq / 32, 32] with prod(lead) = R in
        the row-major order of [R, Kq]: the reference's draw ``jax.random.uniform(key, (*lead, Kq / 32, 32))``
        (:func:`jax_mxfp4.kernels.quantize_kernel.sr_uniforms`), for keys whose uniforms the kernel
        cannot generate (custom key implementations; rbg keys past 2^34 elements). Exclusive with
        ``key_data``.
      scale_mode: the scale rule (as :func:`jax_mxfp4.quantize`).
      cfg: :class:`Fp8QuantizeConfig`; default :func:`default_config`.
      interpret: run the Pallas interpreter (CPU tests).
      fmt: the code format, "e4m3" or "e5m2" (:mod:`jax_mxfp4.fp8_format`).
    Returns:
      (codes float8_e4m3fn / float8_e5m2 [R, Kq], scales float8_e8m0fnu [R, Kq/32], row_exp
      int32 [R], row_flag uint8 [R]) = ``encode_rows(quantize(x, 1), fmt)``
      (:mod:`jax_mxfp4.fp8_prepared`), bit for bit.
    Raises:
      TypeError: x not a float array; key_data not of dtype uint32 and shape [2] or [4]; uniform
        not float32; cfg of
        another type.
      ValueError: fmt not "e4m3" / "e5m2"; x not 2-D or empty, Kq not a multiple of 32 or above :data:`MAX_ROW`; both
        key_data and uniform given; uniform's shape not [*lead, Kq] or [*lead, Kq / 32, 32]
        with prod(lead) = R.
    """
    checks.check_interpret(interpret, "quantize_fp8_2d")
    checks.check_static_shape(x, "quantize_fp8_2d")
    if cfg is not None and not isinstance(cfg, Fp8QuantizeConfig):
        raise TypeError(f"cfg must be an Fp8QuantizeConfig or None, got {cfg!r}")
    from ..fp8_format import format_named

    f = format_named(fmt)
    kq, n_rows = check_call(x, key_data, uniform, "quantize_fp8_2d")
    if cfg is None:
        cfg = default_config(kq, stochastic=key_data is not None or uniform is not None)
    n_blocks = kq // BLOCK_SIZE
    nbp = _pow2_at_least(n_blocks)
    br = min(cfg.rows, _pow2_at_least(n_rows))
    args = [x.reshape(n_rows, n_blocks, BLOCK_SIZE)]
    kernel_rng = None
    if key_data is not None:
        key_data = jnp.asarray(key_data, jnp.uint32).reshape(-1)
        kernel_rng = "threefry" if key_data.size == 2 else "philox"
        args.append(key_data)
    elif uniform is not None:  # a free reshape: the row-major order of the output rows
        args.append(uniform.reshape(n_rows, n_blocks, BLOCK_SIZE))
    kernel = functools.partial(_kernel, n_rows=n_rows, n_blocks=n_blocks, nbp=nbp, br=br,
                               scale_mode=scale_mode, kernel_rng=kernel_rng,
                               uniform_input=uniform is not None, fmt=f, ptx=not interpret)
    codes, byte, row_exp, row_flag = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((n_rows, n_blocks, BLOCK_SIZE), f.dtype),
            jax.ShapeDtypeStruct((n_rows, n_blocks), jnp.uint8),
            jax.ShapeDtypeStruct((n_rows,), jnp.int32),
            jax.ShapeDtypeStruct((n_rows,), jnp.uint8),
        ),
        grid=(pl.cdiv(n_rows, br),),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=1),
        interpret=interpret,
        name="mxfp4_quantize_fp8",
    )(*args)
    return codes.reshape(n_rows, kq), as_e8m0(byte), row_exp, row_flag


def check_call(x, key_data, uniform, fn):
    """The argument rules of :func:`quantize_fp8_2d`: returns (Kq, R); raises the TypeError /
    ValueError its docstring lists, named after ``fn``."""

    checks.check_float_input(x, "x")
    if x.ndim != 2:
        raise ValueError(f"{fn}: x must be 2-D, got shape {x.shape}")
    if x.size == 0:
        raise ValueError(f"{fn}: x must not be empty, got shape {x.shape}")
    if key_data is not None:
        check_key_data(key_data, ((2,), (4,)), fn)
    n_rows, kq = x.shape
    if kq % BLOCK_SIZE:
        raise ValueError(f"quantized axis length {kq} is not a multiple of {BLOCK_SIZE}")
    if uniform is not None:
        if key_data is not None:
            raise ValueError(f"{fn}: give key_data (uniforms generated in the kernel) or uniform "
                             "(uniforms read), not both")
        _check_uniform(uniform, n_rows, kq)
    if kq > MAX_ROW:
        raise ValueError(f"{fn}: quantized axis length {kq} > MAX_ROW = {MAX_ROW}")
    return kq, n_rows


def _check_uniform(uniform, n_rows, kq):
    """``uniform`` must be float32 [*lead, Kq] or [*lead, Kq / 32, 32] with prod(lead) = R
    (element-aligned with the [R, Kq] output rows; see :func:`quantize_fp8_2d`)."""
    check_uniform_dtype(uniform, "quantize_fp8_2d")
    shape = tuple(uniform.shape)
    nb = kq // BLOCK_SIZE
    ok = ((len(shape) >= 1 and shape[-1] == kq and math.prod(shape[:-1]) == n_rows)
          or (len(shape) >= 2 and shape[-2:] == (nb, BLOCK_SIZE) and math.prod(shape[:-2]) == n_rows))
    if not ok:
        raise ValueError(f"uniform must have shape [*lead, {kq}] or [*lead, {nb}, {BLOCK_SIZE}] with "
                         f"prod(lead) = {n_rows}: one uniform per element of the [{n_rows}, {kq}] rows, "
                         f"got {list(shape)}")
