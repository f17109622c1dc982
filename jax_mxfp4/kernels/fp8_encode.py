"""Fused MXFP4 -> FP8-operand pass on GPU: :func:`jax_mxfp4.fp8_prepared.encode_rows` as one Pallas kernel.

``encode_rows`` in jnp is several XLA fusions (nibble unpack, per-block reductions, the row
maximum, the encode), about ten times slower than its bytes at HBM speed on an H200
(docs/performance.md). Here one program owns ``br`` whole rows and reads them twice (the second
read mostly from L2): pass A gathers per row the largest and smallest scale byte of the blocks
holding a nonzero code, the NaN bytes and the special blocks
(:func:`jax_mxfp4.fp8_format.special_blocks`); pass B writes the FP8 bytes (E4M3 or E5M2) with the per-block
shift of :func:`jax_mxfp4.fp8_format._block_shift`. Both passes work on whole words (SWAR: 4-8
codes per integer operation). Every rule is the one of :mod:`jax_mxfp4.fp8_format` (imported,
not copied); only the E2M1 x 2^d -> FP8 byte step is new, done with integer operations
(:func:`e4m3_word`, :func:`e5m2_word`), and the result is bit-identical to ``encode_rows``
(tests/test_fp8_encode_kernel.py, Pallas interpreter; tests/gpu/test_gpu_fp8.py on the GPU).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .. import checks
from .. import fp8_format as rules
from ..mx_format import BLOCK_SIZE, E8M0_NAN, as_scale_bytes

ROW_CHUNK_BLOCKS = 256
"""Blocks per loop step (default): whole-row steps for K <= 8192."""


_U32 = np.uint32  # numpy scalars: literals inside a kernel (a jnp constant would be captured)
_BYTE_LSB = _U32(0x01010101)  # bit 0 of every byte of a uint32


def spread_nibbles(x):
    """uint32 holding one packed uint16 (4 E2M1 codes, low nibble first) -> uint32 with one code per
    byte in element order (byte 0 = the first byte's low nibble, little-endian). 4 operations."""
    x = x.astype(jnp.uint32)  # a uint16 argument would lose its high byte in x << 8
    t = (x | (x << 8)) & _U32(0x00FF00FF)
    return (t | (t << 4)) & _U32(0x0F0F0F0F)


def e4m3_word(y, big_d, normal_only: bool = False):
    """E4M3 bytes of E2M1 codes (sign in bit 3) times 2^d, d in [-8, 6], four codes at once
    (SWAR: one E2M1 code per byte of a uint32 ``y``). Exact for every code and d in the window.

    ``big_d`` = d + 8 (int32, in [0, 14] for d in [-8, 6]), the same for the word's four codes (one
    32-element block). Byte-wise integer arithmetic; no byte carries into its neighbour (each
    intermediate byte stays in [0, 255], noted per step). With m = |code| (0..7):
    - normal E4M3 (t = E + d >= -6, every code when d >= -5): m' = m with code 1's bit cleared
      (E2M1 0.5 is its only subnormal; E4M3 mantissa 0), byte = 4 m' + 8 (D - 2) = 4 m' + 0x30 + 8d
      (<= 28 + 96 = 124);
    - subnormal E4M3 (codes 1 at d <= -6, 2-3 at d <= -7, 4-5 at d = -8): byte = value / 2^-9 =
      v2(m) << D with v2 = 2 |E2M1| = m for m <= 4, 6 for m = 5 (<= 24);
    - sign bit 3 -> bit 7, so -0.0 stays 0x80 as in ``astype(float8_e4m3fn)``.
    ``normal_only=True`` takes D >= 3 as given (about 10 operations fewer); every case is
    checked against ml_dtypes in tests/test_fp8_encode_kernel.py.
    """
    y = y.astype(jnp.uint32)
    big_d = big_d.astype(jnp.uint32)
    m = y & _U32(0x07070707)
    sign = (y & _U32(0x08080808)) << 4
    hi = (m >> 1) | (m >> 2)  # bit 0 of each byte: bit 1 or bit 2 of its code (higher bits: ignored)
    nz = (m | hi) & _BYTE_LSB
    m1 = m & (hi | _U32(0xFEFEFEFE))  # code 1 -> 0
    if normal_only:
        return ((m1 << 2) + nz * (8 * big_d - 16)) | sign
    bit1 = (m >> 1) & _BYTE_LSB
    bit2 = (m >> 2) & _BYTE_LSB
    eq1 = nz & ~hi
    sub = jnp.where(big_d == 2, eq1,
                    jnp.where(big_d == 1, nz & ~bit2,
                              jnp.where(big_d == 0, nz & ~(bit1 & bit2), _U32(0))))
    eq5 = bit2 & m & ~bit1 & _BYTE_LSB
    q = (m + eq5) << jnp.minimum(big_d, 2)  # <= 28: no carry
    normal = nz & ~sub
    mag_n = (m1 << 2) + normal * (8 * big_d) - (normal << 4)  # normal bytes are >= 16 before the - 16
    return (mag_n & (normal * _U32(0xFF))) | (q & (sub * _U32(0xFF))) | sign


def e5m2_word(y, big_d, normal_only: bool = False):
    """E5M2 bytes of E2M1 codes (sign in bit 3) times 2^d, d in [-15, 13], four codes at once, as
    :func:`e4m3_word` (one E2M1 code per byte of a uint32 ``y``; ``big_d`` = d + 15, in [0, 28]).
    With m = |code| and m' = m with code 1's bit cleared (E2M1 0.5 = 2^-1 x 1.0, mantissa 0):
    - normal E5M2 (every code when d >= -13; D = big_d): byte = 2 m' + 4 (D - 1) (<= 14 + 108 =
      122): E2M1 code m >= 2 is 2 E + M with value 2^(E - 1) (1 + M / 2), so the E5M2 exponent
      field is E - 1 + d + 15 and the mantissa field 2 M;
    - subnormal E5M2 (codes 1-3 at d = -15, code 1 at d = -14): byte = value / 2^-16 = m << D;
    - sign bit 3 -> bit 7 (-0.0 stays 0x80 as in ``astype(float8_e5m2)``).
    ``normal_only=True`` takes D >= 2 as given. Checked against ml_dtypes for every code and d in
    tests/test_fp8_encode_kernel.py."""
    y = y.astype(jnp.uint32)
    big_d = big_d.astype(jnp.uint32)
    m = y & _U32(0x07070707)
    sign = (y & _U32(0x08080808)) << 4
    hi = (m >> 1) | (m >> 2)
    nz = (m | hi) & _BYTE_LSB
    m1 = m & (hi | _U32(0xFEFEFEFE))  # code 1 -> 0
    if normal_only:
        return ((m1 << 1) + nz * (4 * big_d - 4)) | sign
    bit2 = (m >> 2) & _BYTE_LSB
    eq1 = nz & ~hi
    sub = jnp.where(big_d == 1, eq1, jnp.where(big_d == 0, nz & ~bit2, _U32(0)))
    q = m << jnp.minimum(big_d, 1)  # <= 6: no carry
    normal = nz & ~sub
    mag_n = (m1 << 1) + normal * (4 * big_d) - (normal << 2)  # normal bytes are >= 4 before the - 4
    return (mag_n & (normal * _U32(0xFF))) | (q & (sub * _U32(0xFF))) | sign


_BYTE_WORDS = {"e4m3": (e4m3_word, 2), "e5m2": (e5m2_word, 1)}
"""Per format: the byte step and the largest D (= d - d_min) that has a subnormal byte."""


def _word_block_summary(w):
    """Per 32-element block, from its packed data as 4 uint32 words [..., 4]: (any nonzero code,
    any nonzero magnitude <= 3, any magnitude 1, any magnitude >= 4, any magnitude >= 6), as int32
    0/1: what :func:`jax_mxfp4.fp8_format.special_blocks` reads from the largest / smallest nonzero
    magnitude (each of its four conditions is one of these), with no per-nibble unpacking."""
    m = w & _U32(0x77777777)
    lsb = _U32(0x11111111)
    any_of = lambda v: jnp.max((v != 0).astype(jnp.int32), axis=-1)  # noqa: E731
    return (any_of(m), any_of((m | (m >> 1)) & ~(m >> 2) & lsb), any_of(m & ~((m >> 1) | (m >> 2)) & lsb),
            any_of(m & _U32(0x44444444)), any_of(m & (m << 1) & _U32(0x44444444)))


def _special_from_summary(sb, low, one, ge4, ge6):
    """:func:`jax_mxfp4.fp8_format.special_blocks` from :func:`_word_block_summary`'s flags: the rule reads
    only whether the smallest nonzero magnitude is 1 or <= 3 and the largest >= 4 or >= 6, so
    stand-ins with those answers (1 / 3 / 8, and 7 / 4 / 0) give its result."""
    min_mag = jnp.where(one != 0, 1, jnp.where(low != 0, 3, 8))
    max_mag = jnp.where(ge6 != 0, 7, jnp.where(ge4 != 0, 4, 0))
    return rules.special_blocks(sb, max_mag, min_mag)


def _row_rule_init(br):
    """Pass A's running row state (:func:`_row_rule_step`): largest and smallest counted scale byte
    (-1 / 256 where none yet), any special block, any NaN byte."""
    return (jnp.full((br,), -1, jnp.int32), jnp.full((br,), 256, jnp.int32),
            jnp.zeros((br,), jnp.int32), jnp.zeros((br,), jnp.int32))


def _row_rule_step(carry, sb, any_nonzero, spec):
    """One chunk of pass A, from its scale bytes ``sb`` int32 [br, nbc], whether each block holds a
    nonzero code and whether it is special (:func:`jax_mxfp4.fp8_format.special_blocks`): the rule of
    :func:`jax_mxfp4.fp8_format.encode_blocks` (NaN blocks are not counted)."""
    bmax, bmin, special, nan = carry
    is_nan = sb == E8M0_NAN
    counted = any_nonzero & ~is_nan
    bmax = jnp.maximum(bmax, jnp.max(jnp.where(counted, sb, -1), axis=-1))
    bmin = jnp.minimum(bmin, jnp.min(jnp.where(counted, sb, 256), axis=-1))
    special = special | jnp.max(spec.astype(jnp.int32), axis=-1)
    nan = nan | jnp.max(is_nan.astype(jnp.int32), axis=-1)
    return bmax, bmin, special, nan


def _row_rule_finish(bmax, bmin, special, fmt):
    """(b_max, exact) per row after pass A: an empty row takes ``fmt.row_exp_offset`` (e = 0); a
    row is exact when a counted block lies more than ``fmt.window_span`` binades below b_max or a
    block is special (:func:`jax_mxfp4.fp8_format.encode_block_stats`' rule)."""
    bmax = jnp.where(bmax < 0, fmt.row_exp_offset, bmax)
    return bmax, (bmin < bmax - fmt.window_span) | (special != 0)


def _encode_swar_kernel(w32_ref, h16_ref, scale_ref, codes_ref, exp_ref, flag_ref, *, n_rows, br, nbc,
                        n_chunks, fmt):
    """Pass A reads the packed data as uint32 words (8 codes each) and summarises each block with
    word operations; pass B reads it as uint16 (4 codes), spreads the nibbles to bytes and writes
    one uint32 of four FP8 bytes per uint16 (:func:`e4m3_word` / :func:`e5m2_word` for ``fmt``): a
    1:1 map, no interleave. A chunk with no scale byte in {0, 1, 253, 254} skips the special-block
    summary, and one whose blocks have no subnormal shift takes the byte step's normal-only form
    (``lax.cond`` per chunk)."""
    r0 = pl.program_id(0) * br
    ragged = n_rows % br != 0
    rows = r0 + lax.broadcasted_iota(jnp.int32, (br, nbc), 0)
    mask2 = rows < n_rows if ragged else None

    def load(ref, c, width, fill):
        view = ref.at[pl.ds(r0, br), pl.ds(c * nbc, nbc), :] if width else ref.at[pl.ds(r0, br), pl.ds(c * nbc, nbc)]
        if mask2 is None:
            return plgpu.load(view)
        m = jnp.broadcast_to(mask2[..., None], (br, nbc, width)) if width else mask2
        return plgpu.load(view, mask=m, other=fill)

    def pass_a(c, carry):
        w = load(w32_ref, c, 4, 0)
        sb = load(scale_ref, c, 0, 0).astype(jnp.int32)
        any_nz = jnp.max(((w & _U32(0x77777777)) != 0).astype(jnp.int32), axis=-1)
        extreme = jnp.max(((sb <= 1) | ((sb >= 253) & (sb <= 254))).astype(jnp.int32))
        spec = lax.cond(extreme != 0,
                        lambda: _special_from_summary(sb, *_word_block_summary(w)[1:]).astype(jnp.int32),
                        lambda: jnp.zeros((br, nbc), jnp.int32))
        return _row_rule_step(carry, sb, any_nz != 0, spec)

    bmax, bmin, special, nan = lax.fori_loop(0, n_chunks, pass_a, _row_rule_init(br))
    bmax, exact = _row_rule_finish(bmax, bmin, special, fmt)
    word, last_sub = _BYTE_WORDS[fmt.name]

    def pass_b(c, carry):
        h = load(h16_ref, c, BLOCK_SIZE // 4, 0).astype(jnp.uint32)
        sb = load(scale_ref, c, 0, 0).astype(jnp.int32)
        big_d = rules._block_shift(sb, bmax[:, None], exact[:, None], fmt) - fmt.d_min  # [br, nbc], >= 0
        y = spread_nibbles(h)
        dd = big_d[..., None]
        low = jnp.min(big_d) <= last_sub
        out = lax.cond(low, lambda: word(y, dd), lambda: word(y, dd, normal_only=True))
        _store_chunk(codes_ref, r0, br, c, nbc, out, mask2)
        return carry

    lax.fori_loop(0, n_chunks, pass_b, 0)
    _store_row_outputs(exp_ref, flag_ref, r0, br, n_rows, bmax, exact, nan, fmt)


def _store_chunk(codes_ref, r0, br, c, nbc, out, mask2):
    """Pass B's output for chunk ``c`` of the program's rows (rows past the end masked off)."""
    view = codes_ref.at[pl.ds(r0, br), pl.ds(c * nbc, nbc), :]
    if mask2 is None:
        plgpu.store(view, out)
    else:
        plgpu.store(view, out, mask=jnp.broadcast_to(mask2[..., None], out.shape))


def _store_row_outputs(exp_ref, flag_ref, r0, br, n_rows, bmax, exact, nan, fmt):
    """row_exp and row_flag of a program's rows (the rule of :func:`jax_mxfp4.fp8_format.encode_blocks`)."""
    row_exp = bmax - fmt.row_exp_offset
    row_flag = exact.astype(jnp.int32) * rules.FLAG_EXACT | jnp.where(nan != 0, rules.FLAG_NAN, 0)
    rmask = (r0 + lax.broadcasted_iota(jnp.int32, (br,), 0)) < n_rows if n_rows % br else None
    plgpu.store(exp_ref.at[pl.ds(r0, br)], row_exp, mask=rmask)
    plgpu.store(flag_ref.at[pl.ds(r0, br)], row_flag.astype(jnp.uint8), mask=rmask)


def _chunk_blocks(n_blocks: int, cap: int) -> int:
    """Largest power of two <= cap dividing n_blocks (the loop needs equal chunks)."""
    return min(cap, n_blocks & -n_blocks)


@functools.partial(jax.jit, static_argnames=("rows_per_program", "num_warps", "chunk_blocks", "interpret", "fmt"))
def encode_rows_kernel(data, scale_bytes, *, rows_per_program: int = 1, num_warps: int = 8,
                       chunk_blocks: int = ROW_CHUNK_BLOCKS, interpret: bool = False, fmt: str = "e4m3"):
    """:func:`jax_mxfp4.fp8_prepared.encode_rows` for 2-D operands in one Pallas kernel (bit-identical).

    Args:
      data: uint8 [R, K/2] packed E2M1 pairs (low nibble first), K a multiple of 32.
      scale_bytes: E8M0 scales [R, K/32], uint8 bytes or float8_e8m0fnu (read bit for bit), plain layout.
      rows_per_program: rows owned by one program (a power of two; default 1).
      num_warps: Triton warps per program (a power of two; default 8).
      chunk_blocks: most 32-element blocks of a row per loop step (a power of two; default
        :data:`ROW_CHUNK_BLOCKS`).
      interpret: run the Pallas interpreter (CPU tests).
      fmt: the code format, "e4m3" or "e5m2" (:mod:`jax_mxfp4.fp8_format`).
    Returns:
      (codes float8_e4m3fn / float8_e5m2 [R, K], row_exp int32 [R], row_flag uint8 [R]).
    Raises:
      TypeError: data not uint8, scales not uint8/float8_e8m0fnu (:func:`jax_mxfp4.fp8_format.check_packed_rows`);
        ``interpret`` not a bool.
      ValueError: shapes that are not [R, K/2] and [R, K/32]; a ``rows_per_program``,
        ``chunk_blocks`` or ``num_warps`` that is not a power of two; another ``fmt``.
    """
    checks.check_interpret(interpret, "encode_rows_kernel")
    rules.check_packed_rows(data, scale_bytes)
    f = rules.format_named(fmt)  # types first: a list or None is named, not an AttributeError
    if data.ndim != 2:
        raise ValueError(f"encode_rows_kernel: data must be 2-D [R, K/2], got shape {data.shape}")
    chunk_blocks = checks.power_of_two(chunk_blocks, "chunk_blocks")
    rows_per_program = checks.power_of_two(rows_per_program, "rows_per_program")
    num_warps = checks.power_of_two(num_warps, "num_warps", most=32)  # a CTA holds at most 1024 threads
    scale_bytes = as_scale_bytes(scale_bytes)  # bytes, not values (float8_e8m0fnu is bit-cast)
    n_rows, half = data.shape
    if n_rows == 0 or half == 0:  # nothing to launch: encode_rows' outputs for empty rows (e = 0, no flag)
        return (jnp.zeros((n_rows, 2 * half), f.dtype), jnp.zeros((n_rows,), jnp.int32),
                jnp.zeros((n_rows,), jnp.uint8))
    n_blocks = half * 2 // BLOCK_SIZE
    br = min(rows_per_program, 1 << max(0, (n_rows - 1).bit_length()))
    nbc = _chunk_blocks(n_blocks, chunk_blocks)
    # the same bytes viewed as uint32 words (pass A) and uint16 halves (pass B): bit casts, no copy
    words = lax.bitcast_convert_type(data.reshape(n_rows, n_blocks, 4, 4), jnp.uint32)
    halves = lax.bitcast_convert_type(data.reshape(n_rows, n_blocks, 8, 2), jnp.uint16)
    kernel = functools.partial(_encode_swar_kernel, n_rows=n_rows, br=br, nbc=nbc, n_chunks=n_blocks // nbc, fmt=f)
    codes, row_exp, row_flag = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((n_rows, n_blocks, 8), jnp.uint32),
                   jax.ShapeDtypeStruct((n_rows,), jnp.int32),
                   jax.ShapeDtypeStruct((n_rows,), jnp.uint8)),
        grid=(pl.cdiv(n_rows, br),),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="mxfp4_encode_fp8_rows_swar",
    )(words, halves, scale_bytes)
    codes = lax.bitcast_convert_type(codes, jnp.uint8)  # [R, nb, 8, 4], element order (little-endian)
    codes = lax.bitcast_convert_type(codes.reshape(n_rows, n_blocks * BLOCK_SIZE), f.dtype)
    return codes, row_exp, row_flag
