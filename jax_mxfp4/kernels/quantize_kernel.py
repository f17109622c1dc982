"""Fused MXFP4 quantization in one pass: a Pallas (Triton lowering) kernel.

Reads each input element once and writes the packed E2M1 bytes and the E8M0 scale bytes once.
The kernel body applies the rules of :mod:`jax_mxfp4.mx_format` to the same values as the
reference ``jax_mxfp4.quantize._quantize_impl``, so its output is bit-identical in every scale
mode, rounding and input dtype (tests/test_fast_quantize.py in the Pallas interpreter;
benchmarks/quantize.py compares on the GPU). Integer formulation:

- the input is viewed as [R, K/32, 32] (a free reshape) and a tile of whole 32-element blocks is
  loaded contiguously; the float32 bits of each element are split into even and odd elements in
  registers, so a packed byte is ``code(even) | code(odd) << 4 | signs`` without an interleave;
- block amax is an integer max of |bits| (sign bit cleared); a maximum at or above 0x7F800000
  marks a NaN/Inf block (scale byte 0xFF, codes 0), one below 0x00800000 an all-zero or
  subnormal block (amax 0): ``flush_subnormal_inputs`` and the NaN-block rule without float
  compares; the scale byte comes from :func:`~jax_mxfp4.mx_format.e8m0_from_amax`;
- element codes by :func:`~jax_mxfp4.mx_format.e2m1_magnitude_code` (magic add per binade),
  stochastic rounding by :func:`~jax_mxfp4.mx_format.e2m1_stochastic_magnitude`; the sign nibble
  is taken from the input bits with integer operations, so -0.0 and negatives rounded to zero
  keep code 0x8 (the Triton lowering computes a float negation as ``0 - x``, which loses -0.0).

Optionally (``hadamard=(block, seed)``) each loaded tile is first rotated by the blockwise random
Hadamard transform of :mod:`jax_mxfp4.hadamard` along the quantized axis, in registers, with the
same float32 operations in the same order (:func:`_rotate_tile`): bit-identical to quantizing the
output of ``random_hadamard_transform`` (tests/test_fused_hadamard.py), one pass instead of two.

Stochastic rounding consumes the uniforms the reference draws
(``jax.random.uniform(key, [..., K/32, 32])``, float32, element-aligned with the input): generated
in the kernel from the key and each element's flat index (Threefry-2x32 as in ``jax.random``, no
extra traffic) where :func:`kernel_rng_supported`, else passed in as a second input (4 more
bytes read per element). Either way the bits equal the reference's.
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
    E8M0_BIAS,
    E8M0_NAN,
    e2m1_magnitude_code,
    e2m1_stochastic_magnitude,
    e8m0_from_amax,
    pow2_from_exponent,
)
from ..platform import kernels_enabled

_ABS = 0x7FFFFFFF
_INF_BITS = 0x7F800000
_MIN_NORMAL_BITS = 0x00800000


@dataclasses.dataclass(frozen=True)
class QuantizeConfig:
    """Tile of the quantization kernel.

    ``rows`` x ``cols`` input elements per program (powers of two, cols >= 32, i.e. whole
    32-element blocks; the grid walks row tiles on program axis 0), Triton ``num_warps``.
    ``swar``: bfloat16 round-to-nearest as inline PTX on 32-bit words holding two elements
    (``_SWAR_PTX``: about 10 instructions per element instead of ~17; ``min.u16x2`` /
    ``max.u16x2`` need sm_90, NVIDIA only), bit-identical to the portable form. Other dtypes and
    stochastic rounding ignore it. The Pallas interpreter runs a NumPy-exact emulation of the same
    instructions.
    """

    rows: int = 8
    cols: int = 512
    num_warps: int = 4
    swar: bool = False

    def __post_init__(self):
        for name in ("rows", "cols", "num_warps"):  # ints (NumPy ints stored as int), never bool
            v = getattr(self, name)
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
                raise ValueError(f"QuantizeConfig.{name} must be an int, got {v!r}")
            object.__setattr__(self, name, int(v))
        if not isinstance(self.swar, (bool, np.bool_)):
            raise ValueError(f"QuantizeConfig.swar must be a bool, got {self.swar!r}")
        object.__setattr__(self, "swar", bool(self.swar))
        if self.rows < 1 or self.rows & (self.rows - 1):
            raise ValueError(f"QuantizeConfig.rows must be a power of two, got {self.rows}")
        if self.cols < BLOCK_SIZE or self.cols & (self.cols - 1):
            raise ValueError(f"QuantizeConfig.cols must be a power of two >= {BLOCK_SIZE}, got {self.cols}")
        if self.num_warps < 1 or self.num_warps > 32 or self.num_warps & (self.num_warps - 1):
            raise ValueError(f"QuantizeConfig.num_warps must be a power of two <= 32 (a CTA holds at most 1024 "
                             f"threads), got {self.num_warps}")


DEFAULT_CONFIG = QuantizeConfig()


def _split_pairs(v):
    """[..., 32] -> (even elements, odd elements), each [..., 16] (Triton tt.split, in registers)."""
    even, odd = jnp.unstack(v.reshape(*v.shape[:-1], BLOCK_SIZE // 2, 2), axis=-1)
    return even, odd


# --------------------------------------------------------------- SWAR bfloat16 (QuantizeConfig.swar)
#
# One 32-bit word w holds elements 2i (low lane) and 2i+1 (high lane) as bfloat16. Per block the
# kernel passes (each repeated in both 16-bit lanes): LO = the bfloat16 exponent field of 2^s
# ((127 + s) << 7), HI = LO + 0x100 (of 2^(s+2)), P = bfloat16 2^-s, C = 7 (0 in a NaN/Inf block)
# and S = 0x0008 (0 in a NaN/Inf block). Per word (every step keeps each lane inside its 16 bits):
#   x = w & 0x7F80 (exponent fields); m = 0xFFFF where x != 0 (bit 15 of x + 0x7F80, spread by a
#   sign-replicating prmt); a = w & m & 0x7FFF: |element| with subnormal inputs flushed
#   (flush_subnormal_inputs);
#   e = clamp(x, LO, HI): the binade e' = clamp(floor(log2 y), 0, 2) of y = a 2^-s, as an exponent
#   field of a; M = e - LO + 0x4280: bfloat16 2^(6 + e'), whose ulp is the E2M1 spacing 2^(e'-1);
#   t = fma.rn.bf16x2(a, P, M) = RNE(y + M) (one rounding; the same grid point as the reference's
#   float32 magic add y + 2^(22 + e'));
#   code = min(t - M + (e - LO) >> 6, C): steps above M plus 2e' codes below the binade, cap 7;
#   byte = low byte of v | v >> 12 with v = code | (w >> 12) & S (signs to bits 3 and 19).
# Four words per asm instance; their bytes are joined by prmt into the uint8x4 result register.

_SWAR_WORD = (  # (op, dst, src...): register names or int immediates; "w", "LO", ... per word
    ("and", "x", "w", 0x7F807F80),
    ("add", "f", "x", 0x7F807F80),
    ("prmt", "m", "f", "f", 0xBB99),
    ("and", "a", "w", "m"),
    ("and", "a", "a", 0x7FFF7FFF),
    ("max16", "e", "x", "LO"),
    ("min16", "e", "e", "HI"),
    ("add", "M", "e", 0x42804280),
    ("sub", "M", "M", "LO"),
    ("fma_bf16x2", "t", "a", "P", "M"),
    ("sub", "c", "t", "M"),
    ("sub", "d", "e", "LO"),
    ("shr", "d", "d", 6),
    ("add", "c", "c", "d"),
    ("min16", "c", "c", "C"),
    ("shr", "g", "w", 12),
    ("and", "g", "g", "S"),
    ("or", "v", "c", "g"),
    ("shr", "h", "v", 12),
    ("or", "r", "v", "h"),
)
_SWAR_INPUTS = ("w", "LO", "HI", "P", "C", "S")
_SWAR_PACK = 4
_PTX_OPS = {"and": "and.b32", "or": "or.b32", "add": "add.u32", "sub": "sub.u32", "shr": "shr.b32",
            "prmt": "prmt.b32", "max16": "max.u16x2", "min16": "min.u16x2", "fma_bf16x2": "fma.rn.bf16x2"}


def _swar_ptx() -> str:
    """The PTX of one asm instance: 4 words ($1..$4) and their block operands -> $0, 4 bytes."""
    regs = sorted({op[1] for op in _SWAR_WORD})
    lines = ["{", f".reg .b32 {', '.join(f'{r}{k}' for k in range(_SWAR_PACK) for r in regs)}, u01, u23;"]
    for k in range(_SWAR_PACK):
        where = {name: f"${1 + i * _SWAR_PACK + k}" for i, name in enumerate(_SWAR_INPUTS)}

        def opnd(v, k=k, where=where):
            if isinstance(v, int):
                return f"0x{v:08X}" if v > 0xFF else str(v)
            return where.get(v, f"{v}{k}")

        for op, dst, *src in _SWAR_WORD:  # (the packed max16/min16/fma_bf16x2 take registers only)
            lines.append(f"{_PTX_OPS[op]} {dst}{k}, {', '.join(opnd(v) for v in src)};")
    lines += ["prmt.b32 u01, r0, r1, 0x0040;", "prmt.b32 u23, r2, r3, 0x0040;", "prmt.b32 $0, u01, u23, 0x5410;", "}"]
    return "\n".join(lines)


_SWAR_PTX = _swar_ptx()


def _lanes(v):
    return v & jnp.uint32(0xFFFF), v >> jnp.uint32(16)


def _join(lo, hi):
    return (lo & jnp.uint32(0xFFFF)) | (hi << jnp.uint32(16))


def _prmt(a, b, sel):
    out = jnp.zeros_like(a)
    for i in range(4):
        n = (sel >> (4 * i)) & 0xF
        src = a if (n & 7) < 4 else b
        byte = (src >> jnp.uint32(8 * (n & 3))) & jnp.uint32(0xFF)
        if n & 8:  # replicate the byte's most significant bit
            byte = jnp.where(byte >= 0x80, jnp.uint32(0xFF), jnp.uint32(0))
        out = out | (byte << jnp.uint32(8 * i))
    return out


def _fma_bf16x2(a, b, c):
    def lane(x):
        return lax.bitcast_convert_type(x << jnp.uint32(16), jnp.float32)

    def rnd(x):  # float32 -> bfloat16 bits, round to nearest even (exact here, see swar_word_emulated)
        return lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16).astype(jnp.uint32)

    (a0, a1), (b0, b1), (c0, c1) = _lanes(a), _lanes(b), _lanes(c)
    return _join(rnd(lane(a0) * lane(b0) + lane(c0)), rnd(lane(a1) * lane(b1) + lane(c1)))


def swar_word_emulated(w, lo, hi, p, c, s):
    """The per-word program ``_SWAR_WORD`` with jnp uint32 operations (the Pallas interpreter's and
    the tests' stand-in for ``_SWAR_PTX``): returns uint32 whose low byte is the packed byte.

    Each PTX instruction has its exact semantics; ``fma.rn.bf16x2`` is float32 ``a * b + c``
    rounded to bfloat16, which equals the single rounding here: a * b is an exact power-of-two
    scaling (or far below the ulp of c, >= 2^-2), and a sum that needs more than float32's 24 bits
    (a * b < 2^-10) lies far from every bfloat16 midpoint of c's binade.
    """
    u32 = jnp.uint32
    env = {"w": w, "LO": lo, "HI": hi, "P": p, "C": c, "S": s}

    def val(v):
        return u32(v) if isinstance(v, int) else env[v]

    for op, dst, *src in _SWAR_WORD:
        a = [val(v) for v in src[:2]] if op != "fma_bf16x2" else [val(v) for v in src]
        if op == "and":
            r = a[0] & a[1]
        elif op == "or":
            r = a[0] | a[1]
        elif op == "add":
            r = a[0] + a[1]
        elif op == "sub":
            r = a[0] - a[1]
        elif op == "shr":
            r = a[0] >> a[1]
        elif op == "prmt":
            r = _prmt(a[0], a[1], src[2])
        elif op in ("max16", "min16"):
            f = jnp.maximum if op == "max16" else jnp.minimum
            (x0, x1), (y0, y1) = _lanes(a[0]), _lanes(a[1])
            r = _join(f(x0, y0), f(x1, y1))
        elif op == "fma_bf16x2":
            r = _fma_bf16x2(*a)
        else:  # pragma: no cover
            raise ValueError(op)
        env[dst] = r
    return env["r"]


def swar_block_operands(s, bad):
    """Per-block operands of ``_SWAR_PTX`` (uint32, both lanes): (LO, HI, P, C, S) for the scale
    exponents ``s`` (int32, [-127, 126]) and the NaN/Inf flags ``bad`` of :func:`block_scale_bits`."""
    u32 = jnp.uint32
    both = u32(0x10001)
    lo = ((s + 127).astype(u32) << u32(7)) * both
    hi = lo + u32(0x01000100)
    p = ((127 - s).astype(u32) << u32(7)) * both
    c = jnp.where(bad, u32(0), u32(0x00070007))
    sg = jnp.where(bad, u32(0), u32(0x00080008))
    return lo, hi, p, c, sg


def swar_quantize_words(w, lo, hi, p, c, s, interpret):
    """Packed E2M1 bytes (uint8, shape of ``w``) of bfloat16 pairs ``w`` (uint32 words) with their
    blocks' :func:`swar_block_operands` broadcast to ``w``'s shape: inline PTX in a Triton kernel
    (``interpret=False``; sm_90), the jnp emulation otherwise."""
    if interpret:
        return swar_word_emulated(w, lo, hi, p, c, s).astype(jnp.uint8)
    # The asm returns int8 (MLIR i8, signless; 4 per "=r" register): tt.elementwise_inline_asm takes
    # only signless integer results, and jax maps uint8 to ui8. The bitcast to uint8 is free.
    (out,) = plgpu.elementwise_inline_asm(
        _SWAR_PTX, args=[w, lo, hi, p, c, s], constraints="=r," + ",".join(["r"] * (len(_SWAR_INPUTS) * _SWAR_PACK)),
        pack=_SWAR_PACK, result_shape_dtypes=[jax.ShapeDtypeStruct(w.shape, jnp.int8)],
    )
    return lax.bitcast_convert_type(out, jnp.uint8)


_THREEFRY_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


def threefry_uniform(k1, k2, counter):
    """float32 uniforms equal to ``jax.random.uniform(key, shape).ravel()[counter]``.

    For a threefry2x32 key with data (k1, k2) (uint32 scalars) under
    ``jax_threefry_partitionable`` (the default since jax 0.5): element i of the draw hashes the
    64-bit counter (0, i) with Threefry-2x32 (20 rounds, Salmon et al. 2011; as
    ``jax._src.random.threefry2x32``), takes ``bits = x0 ^ x1`` and maps it to
    ``((bits >> 9) | 0x3F800000) as float - 1`` (``jax.random.uniform``). ``counter`` is uint32
    (draws of fewer than 2^32 elements). About 80 integer operations per element.
    """
    u32 = jnp.uint32
    counter = counter.astype(u32)

    def rotl(v, r):
        return (v << u32(r)) | lax.shift_right_logical(v, u32(32 - r))

    ks = (k1, k2, k1 ^ k2 ^ u32(0x1BD11BDA))
    x0 = jnp.zeros_like(counter) + ks[0]
    x1 = counter + ks[1]
    for i in range(5):
        for r in _THREEFRY_ROTATIONS[i % 2]:
            x0 = x0 + x1
            x1 = rotl(x1, r) ^ x0
        x0 = x0 + ks[(i + 1) % 3]
        x1 = x1 + ks[(i + 2) % 3] + u32(i + 1)
    bits = lax.shift_right_logical(x0 ^ x1, u32(9)) | u32(0x3F800000)
    return lax.bitcast_convert_type(bits, jnp.float32) - jnp.float32(1.0)


PHILOX_MULTIPLIERS = (0xD2511F53, 0xCD9E8D57)
PHILOX_KEY_STEPS = (0x9E3779B9, 0xBB67AE85)
_MUL_HI_PTX = "mul.hi.u32 $0, $1, $2;"


def _mul_hi_u32(x, m: int, ptx: bool):
    """High 32 bits of the 64-bit product of uint32 ``x`` and the constant ``m``: one PTX
    ``mul.hi.u32`` in a Triton kernel on CUDA (``ptx``), else four 16-bit partial products (the
    Pallas interpreter; no 64-bit integers without ``jax_enable_x64``)."""
    u32 = jnp.uint32
    if ptx:
        # signless int32 in and out (tt.elementwise_inline_asm refuses unsigned MLIR types)
        xi = lax.bitcast_convert_type(x, jnp.int32)
        (hi,) = plgpu.elementwise_inline_asm(
            _MUL_HI_PTX, args=[xi, jnp.full_like(xi, np.int32(np.uint32(m).view(np.int32)))],
            constraints="=r,r,r", pack=1, result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.int32)])
        return lax.bitcast_convert_type(hi, u32)
    a0, a1 = x & u32(0xFFFF), lax.shift_right_logical(x, u32(16))
    b0, b1 = u32(m & 0xFFFF), u32(m >> 16)
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1  # each < 2^32
    lo16 = lambda v: v & u32(0xFFFF)  # noqa: E731
    hi16 = lambda v: lax.shift_right_logical(v, u32(16))  # noqa: E731
    mid = hi16(p00) + lo16(p01) + lo16(p10)
    return p11 + hi16(p01) + hi16(p10) + hi16(mid)


def _uniform_from_bits(bits):
    """``jax.random.uniform``'s float32 map of 32 random bits: ((bits >> 9) | 0x3F800000) - 1."""
    u32 = jnp.uint32
    return lax.bitcast_convert_type(lax.shift_right_logical(bits, u32(9)) | u32(0x3F800000), jnp.float32) - jnp.float32(1.0)


def philox_uniforms(key_words, block, ptx: bool = False):
    """float32 uniforms equal to ``jax.random.uniform(key, shape).ravel()[4 * block + w]``, w = 0..3.

    For an ``rbg`` or ``unsafe_rbg`` key with data (k0, k1, k2, k3) (uint32 scalars): JAX draws its
    bits with ``lax.rng_bit_generator`` (default algorithm), which XLA expands on CPU and GPU to
    Philox-4x32-10 (Salmon et al. 2011; XLA's ``PhiloxRngBit32``, xla/hlo/builder/lib/prng.cc):
    the 128-bit counter of block b is (k2 | k3 << 32) + b with the carry into (k0 | k1 << 32)
    (XLA's state u64[2] = the key data, reversed into a u128), the Philox key is (k0, k1), and
    the four output words of block b are elements 4b .. 4b + 3 of the draw. Each word maps to a
    uniform as ``jax.random.uniform`` does. ``block`` is uint32 (draws of fewer than 2^34
    elements). About 25 integer operations per element with ``ptx`` (PTX ``mul.hi.u32``, CUDA
    only), against ~80 for :func:`threefry_uniform`.

    Returns: a tuple of 4 float32 arrays of ``block``'s shape (words 0..3)."""
    u32 = jnp.uint32
    k0, k1, k2, k3 = (jnp.asarray(k, u32) for k in key_words)
    c = block.astype(u32)
    zero = jnp.zeros_like(c)
    x0 = c + k2
    carry = (x0 < c).astype(u32)  # the 128-bit add: carry out of each 32-bit word
    x1 = zero + k3 + carry
    carry = carry & (x1 == 0).astype(u32)
    x2 = zero + k0 + carry
    carry = carry & (x2 == 0).astype(u32)
    x3 = zero + k1 + carry
    a, b = k0, k1
    (ma, mb), (wa, wb) = PHILOX_MULTIPLIERS, PHILOX_KEY_STEPS
    for _ in range(10):
        h0, l0 = _mul_hi_u32(x0, ma, ptx), x0 * u32(ma)
        h1, l1 = _mul_hi_u32(x2, mb, ptx), x2 * u32(mb)
        x0, x1, x2, x3 = h1 ^ x1 ^ a, l1, h0 ^ x3 ^ b, l0
        a, b = a + u32(wa), b + u32(wb)
    return tuple(_uniform_from_bits(w) for w in (x0, x1, x2, x3))


def interleave4(w0, w1, w2, w3):
    """[..., n] x 4 -> [..., 4n] with element 4j + w from ``w<w>``[..., j] (Triton: two joins and a
    reshape)."""
    j = jnp.stack([jnp.stack([w0, w2], axis=-1), jnp.stack([w1, w3], axis=-1)], axis=-1)  # [..., n, 2, 2]
    return j.reshape(*w0.shape[:-1], w0.shape[-1] * 4)


def philox_key_supported(key, n_elements: int) -> bool:
    """Whether :func:`philox_uniforms` reproduces ``jax.random.uniform(key, ...)``: a typed
    ``rbg`` or ``unsafe_rbg`` key (their bits come from ``lax.rng_bit_generator``), fewer than 2^34
    elements."""
    if not jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        return False
    return str(jax.random.key_impl(key)) in ("rbg", "unsafe_rbg") and n_elements < 2**34


def kernel_rng_supported(key, n_elements: int) -> bool:
    """Whether :func:`threefry_uniform` reproduces ``jax.random.uniform(key, ...)`` here: a
    threefry2x32 key (typed, or raw uint32[2] with that default implementation), the partitionable
    threefry (jax default), fewer than 2^32 elements."""
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        impl_name = str(jax.random.key_impl(key))
    else:
        impl_name = str(jax.config.jax_default_prng_impl)
    return ("threefry2x32" in impl_name and bool(jax.config.jax_threefry_partitionable)
            and n_elements < 2**32)


def block_scale_bits(amax_bits, scale_mode):
    """Scale of each 32-element block from the integer max of its |float32 bits| (sign cleared):
    (bad: a NaN/Inf in the block, scale byte uint8 (0xFF for bad blocks, else
    :func:`~jax_mxfp4.mx_format.e8m0_from_amax` of the amax with subnormal inputs flushed),
    s = the unbiased exponent clipped to [-127, 126] so that 2^-s is a normal float32).
    The reference's rule (``jax_mxfp4.quantize._quantize_impl``) in integer form, shared by the
    in-kernel quantizers (this module, :mod:`jax_mxfp4.kernels.fp8_quantize`)."""
    bad = amax_bits >= _INF_BITS  # a NaN or Inf in the block
    amax = lax.bitcast_convert_type(jnp.where(amax_bits < _MIN_NORMAL_BITS, 0, amax_bits), jnp.float32)
    byte = jnp.where(bad, jnp.uint8(E8M0_NAN), e8m0_from_amax(amax, scale_mode))
    s = jnp.clip(byte.astype(jnp.int32) - E8M0_BIAS, -E8M0_BIAS, 126)
    return bad, byte, s


def magnitude_code_bits(a_bits, inv, u=None, flush=True):
    """E2M1 magnitude code (int32 0..7) of elements given as |float32 bits| ``a_bits``, divided
    by their block scale as a multiplication by the exact ``inv`` = 2^-s: round to nearest even
    (``u`` None) or stochastically with uniforms ``u``. Subnormal inputs count as zeros
    (:func:`~jax_mxfp4.mx_format.flush_subnormal_inputs`) unless ``flush=False`` (callers that
    know the flush cannot change a code)."""
    if flush:
        a_bits = jnp.where(a_bits < _MIN_NORMAL_BITS, 0, a_bits)
    y = lax.bitcast_convert_type(a_bits, jnp.float32) * inv
    if u is not None:
        y = e2m1_stochastic_magnitude(y, u)
    return e2m1_magnitude_code(y)


def nearest_codes(s, codes):
    """``codes(flush)`` of a tile rounded to nearest, with block exponents ``s``: a float32
    subnormal (< 2^-126) times 2^-s stays below 0.25 (code 0, like the flushed zero) unless
    s <= -125, so the flush is needed only in tiles holding such a block (block max below
    ~2^-122): a branch taken per tile (``lax.cond``), not per element."""
    return lax.cond(jnp.min(s) <= -125, lambda: codes(True), lambda: codes(False))


def _rotate_tile(x, signs, block):
    """The random Hadamard transform of :func:`jax_mxfp4.hadamard.random_hadamard_transform` on a
    loaded tile ``x`` [br, nbt, 32] along its last two axes (``nbt * 32`` a multiple of ``block``),
    in registers and with the same float32 operations in the same order: times the signs
    (``signs`` float32 [block]), the butterfly stages h = 1, 2, ..., block/2 (each pair
    ``(v[j], v[j+h])`` -> ``(v[j] + v[j+h], v[j] - v[j+h])``), then times ``1/sqrt(block)``.

    Triton-lowerable: a stage splits ``[..., 2h]`` into halves with ``jnp.split`` (tt.reshape +
    tt.trans + tt.split), joins the sum and difference on a new last axis (tt.join) and moves it
    back with a transpose (tt.trans); no value slicing, no matrix product.
    """
    br, nbt, _ = x.shape
    length = nbt * BLOCK_SIZE
    y = x.astype(jnp.float32).reshape(br, length // block, block) * signs[None, None, :]
    h = 1
    while h < block:
        a, b = jnp.split(y.reshape(br, length // (2 * h), 2 * h), 2, axis=-1)  # each [.., h]
        y = jnp.swapaxes(jnp.stack([a + b, a - b], axis=-1), -1, -2)  # [.., 2, h]
        h *= 2
    y = y.reshape(br, nbt, BLOCK_SIZE)
    return y * jnp.float32(1.0 / math.sqrt(block))


def _quantize_kernel(*refs, n_rows, n_blocks, br, nbt, scale_mode, stochastic, kernel_rng=False,
                     hadamard_block=None, bf16_words=False, swar=False, interpret=False):
    refs = list(refs)
    signs_ref = refs.pop(1) if hadamard_block else None
    if kernel_rng:
        x_ref, key_ref, data_ref, scale_ref = refs
    elif stochastic:
        x_ref, u_ref, data_ref, scale_ref = refs
    else:
        x_ref, data_ref, scale_ref = refs
    r0 = pl.program_id(0) * br
    b0 = pl.program_id(1) * nbt
    # Masks only where the grid overhangs the array (static shapes): unmasked loads vectorize.
    mask2 = None
    if n_rows % br or n_blocks % nbt:
        mask2 = ((r0 + lax.broadcasted_iota(jnp.int32, (br, nbt), 0)) < n_rows) & (
            (b0 + lax.broadcasted_iota(jnp.int32, (br, nbt), 1)) < n_blocks
        )

    def load(ref, width=BLOCK_SIZE):
        shape = (br, nbt, width)
        view = ref.at[pl.ds(r0, br), pl.ds(b0, nbt), :]
        if mask2 is None:
            return plgpu.load(view)
        return plgpu.load(view, mask=jnp.broadcast_to(mask2[..., None], shape), other=0)

    def store(packed, byte):
        dview = data_ref.at[pl.ds(r0, br), pl.ds(b0, nbt), :]
        sview = scale_ref.at[pl.ds(r0, br), pl.ds(b0, nbt)]
        if mask2 is None:
            plgpu.store(dview, packed)
            plgpu.store(sview, byte)
        else:
            plgpu.store(dview, packed, mask=jnp.broadcast_to(mask2[..., None], packed.shape))
            plgpu.store(sview, byte, mask=mask2)

    if swar:
        # bfloat16 pairs, round to nearest, by the inline PTX of _SWAR_WORD (two elements per op).
        w = load(x_ref, BLOCK_SIZE // 2)
        u32 = jnp.uint32
        key = jnp.maximum(w & u32(0x7FFF0000), (w << u32(16)) & u32(0x7FFF0000))  # |bits| of each lane, f32
        bad, byte, s = block_scale_bits(lax.bitcast_convert_type(jnp.max(key, axis=-1), jnp.int32), scale_mode)
        ops = [jnp.broadcast_to(o[..., None], w.shape) for o in swar_block_operands(s, bad)]
        store(swar_quantize_words(w, *ops, interpret=interpret), byte)
        return

    if bf16_words:
        # bfloat16 input read as uint32 words, element 2i in the low half and 2i+1 in the high half
        # (little-endian): the float32 bits of each are one shift / one mask away, with no split of
        # a register tile into even and odd elements (a Triton layout conversion).
        w = load(x_ref, BLOCK_SIZE // 2)
        ev = lax.bitcast_convert_type(w << jnp.uint32(16), jnp.int32)
        od = lax.bitcast_convert_type(w & jnp.uint32(0xFFFF0000), jnp.int32)
    else:
        x = load(x_ref)
        if hadamard_block:
            x = _rotate_tile(x, plgpu.load(signs_ref.at[pl.ds(0, hadamard_block)]), hadamard_block)
        bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)  # exact widening
        ev, od = _split_pairs(bits)
    # Signs by integer ops: element 2i's sign to bit 3, element 2i+1's to bit 7.
    sign = ((ev >> 28) & 0x8) | ((od >> 24) & 0x80)
    a_ev, a_od = ev & _ABS, od & _ABS
    bad, byte, s = block_scale_bits(jnp.max(jnp.maximum(a_ev, a_od), axis=-1), scale_mode)  # [br, nbt]
    inv = pow2_from_exponent(-s)[..., None]  # 2^-s, exact

    def magnitude(a_bits, u, flush=True):
        return magnitude_code_bits(a_bits, inv, u, flush)

    if kernel_rng:  # the reference's uniforms, generated here from their flat index
        k1, k2 = key_ref[0], key_ref[1]
        shape = (br, nbt, BLOCK_SIZE // 2)
        row = (r0 + lax.broadcasted_iota(jnp.int32, shape, 0)).astype(jnp.uint32)
        col = (b0 * BLOCK_SIZE + BLOCK_SIZE * lax.broadcasted_iota(jnp.int32, shape, 1)
               + 2 * lax.broadcasted_iota(jnp.int32, shape, 2)).astype(jnp.uint32)
        idx = row * jnp.uint32(n_blocks * BLOCK_SIZE) + col
        u_ev = threefry_uniform(k1, k2, idx)
        u_od = threefry_uniform(k1, k2, idx + jnp.uint32(1))
    elif stochastic:
        u_ev, u_od = _split_pairs(load(u_ref))
    else:
        u_ev = u_od = None
    if stochastic:
        codes = magnitude(a_ev, u_ev) | (magnitude(a_od, u_od) << 4)
    else:
        codes = nearest_codes(s, lambda flush: magnitude(a_ev, None, flush) | (magnitude(a_od, None, flush) << 4))
    packed = codes | sign
    packed = jnp.where(bad[..., None], 0, packed).astype(jnp.uint8)
    store(packed, byte)


def _pow2_at_most(n, cap):
    return min(cap, 1 << max(0, (n - 1).bit_length()))


def check_key_data(key_data, shapes, fn):
    """A kernel's key data must be uint32 of one of ``shapes`` ((2,) for threefry2x32, (4,) for
    rbg / unsafe_rbg: what ``jax.random.key_data`` returns for one key). The shape, not just the
    size: a batch of two threefry keys (uint32[2, 2]) is not one rbg key. Raises TypeError naming
    ``fn``."""
    kd = jnp.asarray(key_data) if not hasattr(key_data, "dtype") else key_data
    if kd.dtype != jnp.uint32 or tuple(kd.shape) not in shapes:
        kinds = {(2,): "uint32[2], the data of one threefry2x32 key",
                 (4,): "uint32[4], that of one rbg / unsafe_rbg key"}
        want = " or ".join(kinds[s] for s in shapes)
        raise TypeError(f"{fn}: key_data must be {want} (jax.random.key_data(key)), got "
                        f"{kd.dtype}{list(kd.shape)}")
    if tuple(kd.shape) == (2,) and not jax.config.jax_threefry_partitionable:
        raise ValueError(f"{fn}: the kernel generates the uniforms of the partitionable Threefry "
                         "(jax_threefry_partitionable, on by default since jax 0.5), which is off here: pass the "
                         "reference's draw as uniform instead (jax_mxfp4.quantize does so itself)")


def check_uniform_dtype(uniform, fn):
    """``uniform`` must be a float32 array (the reference's draw); raises TypeError naming ``fn``."""
    dtype = getattr(uniform, "dtype", None)
    if dtype is None or jnp.dtype(dtype) != jnp.float32:
        raise TypeError(f"{fn}: uniform must be float32 (the reference's draw jax.random.uniform(key, "
                        f"shape, jnp.float32)), got {dtype if dtype is not None else type(uniform).__name__}")


def check_uniform_size(uniform, n_elements, fn):
    """``uniform`` must be float32 with ``n_elements`` elements (the reference's draw, element-aligned
    with x). Raises TypeError / ValueError naming ``fn``."""
    check_uniform_dtype(uniform, fn)
    if math.prod(uniform.shape) != n_elements:
        raise ValueError(f"{fn}: uniform must have as many elements as x ({n_elements}), got shape "
                         f"{tuple(uniform.shape)}")


@functools.partial(jax.jit, static_argnames=("scale_mode", "cfg", "interpret", "hadamard"))
def quantize_2d(x, uniform=None, *, key_data=None, scale_mode="even", cfg: QuantizeConfig = DEFAULT_CONFIG,
                interpret=False, hadamard=None):
    """Quantize a 2-D array [R, K] along its last axis in one fused pass.

    Args:
      x: float32/bfloat16/float16 [R, K], K a multiple of 32.
      uniform: None for round-to-nearest-even (unless ``key_data``); for stochastic rounding,
        float32 uniforms in [0, 1) with R * K elements, element-aligned with x (the reference's
        draw, any shape).
      key_data: uint32[2], the data of a threefry2x32 key: stochastic rounding with the uniforms
        of ``jax.random.uniform(key, [R, K])`` generated inside the kernel (no uniform traffic;
        see :func:`threefry_uniform`, :func:`kernel_rng_supported`). Exclusive with ``uniform``.
      scale_mode: as in :func:`jax_mxfp4.quantize`.
      cfg: :class:`QuantizeConfig` (a tile larger than the array is shrunk to it).
      interpret: run the Pallas interpreter (CPU tests).
      hadamard: None, or ``(block, seed)``: rotate every length-``block`` block of each row first
        (block 32..256, see :mod:`jax_mxfp4.hadamard`), fused into this pass: the result is bit-
        identical to quantizing ``random_hadamard_transform(x, 1, seed, block)`` (float32). The
        tile's columns are widened to at least ``block``.
    Returns:
      (data uint8 [R, K/2], scale bytes uint8 [R, K/32]), bit-identical to the reference.
    Raises:
      TypeError: key_data not uint32[2]; uniform not float32.
      ValueError: x is not 2-D or K is not a multiple of 32; K not a multiple of the Hadamard
        block, or a block not in 32..256; both uniform and key_data given; uniform without R * K
        elements.
    """
    checks.check_interpret(interpret, "quantize_2d")
    checks.check_static_shape(x, "quantize_2d")
    if x.ndim != 2:
        raise ValueError(f"quantize_2d: x must be 2-D, got shape {x.shape}")
    n_rows, k = x.shape
    if k % BLOCK_SIZE:
        raise ValueError(f"quantized axis length {k} is not a multiple of {BLOCK_SIZE}")
    n_blocks = k // BLOCK_SIZE
    br = _pow2_at_most(n_rows, cfg.rows)
    nbt = _pow2_at_most(n_blocks, cfg.cols // BLOCK_SIZE)
    hadamard_block = signs = None
    if hadamard is not None:
        from .. import hadamard as hd

        hadamard_block, seed = hd.check_spec(hadamard, "hadamard")
        hd.check_length(k, hadamard_block, "x's quantized axis")
        nbt = max(nbt, hadamard_block // BLOCK_SIZE)  # whole rotation blocks in a tile
        signs = jnp.asarray(hd.random_signs(seed, hadamard_block), jnp.float32)
    if uniform is not None and key_data is not None:
        raise ValueError("quantize_2d: give uniform or key_data, not both")
    if key_data is not None:
        check_key_data(key_data, ((2,),), "quantize_2d")
    if uniform is not None:
        check_uniform_size(uniform, n_rows * k, "quantize_2d")
    kernel_rng = key_data is not None
    stochastic = uniform is not None or kernel_rng
    bf16_words = x.dtype == jnp.bfloat16 and signs is None  # bfloat16 read as uint32 pairs
    swar = bf16_words and cfg.swar and not stochastic
    if bf16_words:  # a free bitcast in XLA: [R, K] bf16 -> [R, K/2] uint32
        args = [lax.bitcast_convert_type(x.reshape(n_rows, n_blocks, BLOCK_SIZE // 2, 2), jnp.uint32)]
    else:
        args = [x.reshape(n_rows, n_blocks, BLOCK_SIZE)]
    if signs is not None:
        args.append(signs)
    if kernel_rng:
        args.append(jnp.asarray(key_data, jnp.uint32).reshape(2))
    elif stochastic:
        args.append(uniform.reshape(n_rows, n_blocks, BLOCK_SIZE))
    kernel = functools.partial(
        _quantize_kernel, n_rows=n_rows, n_blocks=n_blocks, br=br, nbt=nbt,
        scale_mode=scale_mode, stochastic=stochastic, kernel_rng=kernel_rng, hadamard_block=hadamard_block,
        bf16_words=bf16_words, swar=swar, interpret=interpret,
    )
    data, byte = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((n_rows, n_blocks, BLOCK_SIZE // 2), jnp.uint8),
            jax.ShapeDtypeStruct((n_rows, n_blocks), jnp.uint8),
        ),
        grid=(pl.cdiv(n_rows, br), pl.cdiv(n_blocks, nbt)),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=1),
        interpret=interpret,
        name="mxfp4_quantize",
    )(*args)
    return data.reshape(n_rows, k // 2), byte


def fast_path_enabled(platform: str, size: int = 0) -> bool:
    """Whether :func:`jax_mxfp4.quantize` uses this kernel (both roundings): on CUDA/ROCm, for
    inputs of fewer than :data:`MAX_KERNEL_ELEMENTS` elements (``size``; the kernel's element
    offsets are int32), unless custom kernels are off (``JAX_MXFP4_KERNELS=0``,
    :func:`jax_mxfp4.platform.kernels_enabled`)."""
    return platform in ("cuda", "rocm") and size < MAX_KERNEL_ELEMENTS and kernels_enabled()


def default_config(dtype) -> QuantizeConfig:
    """Tile used by :func:`quantize_impl` for input ``dtype`` when none is given: the entry of
    :data:`DEFAULT_CONFIGS`, with ``swar`` on for bfloat16 where :func:`swar_supported` (the
    stochastic-rounding and Hadamard paths ignore ``swar``). TypeError for a dtype the kernel
    does not take (float32, bfloat16, float16 only)."""
    name = jnp.dtype(dtype).name if dtype is not None else None
    if name not in DEFAULT_CONFIGS:
        raise TypeError(f"default_config: dtype must be one of {tuple(DEFAULT_CONFIGS)}, got {dtype!r}")
    cfg = DEFAULT_CONFIGS[name]
    if jnp.dtype(dtype) == jnp.bfloat16 and swar_supported():
        cfg = dataclasses.replace(cfg, swar=True)
    return cfg


def swar_supported() -> bool:
    """Whether the default device runs the SWAR word program (``QuantizeConfig.swar``): an NVIDIA
    GPU of compute capability >= 9.0 (its ``max.u16x2``/``min.u16x2`` need sm_90; inline PTX is
    NVIDIA only, so ROCm, CPU and the interpreter keep the portable formulation). Bit-exact against
    the reference on an H200 and, over every scale exponent, in the CPU emulation
    (tests/test_fast_quantize.py); its speed: docs/performance.md."""
    from .. import platform  # not backends.fp8: kernels sit below the backends (no import cycle)

    cc = platform.compute_capability()
    return cc is not None and cc >= (9, 0)


DEFAULT_CONFIGS = {
    "bfloat16": QuantizeConfig(rows=32, cols=128, num_warps=4),
    "float16": QuantizeConfig(rows=32, cols=128, num_warps=4),
    "float32": QuantizeConfig(rows=2, cols=2048, num_warps=8),
}
"""Per input dtype, from ``benchmarks/quantize.py --sweep`` on an H200 (docs/performance.md);
float16 follows bfloat16 (not swept). :func:`default_config` adds ``swar`` for bfloat16 on Hopper."""


MAX_KERNEL_ELEMENTS = 2**31
"""Inputs with this many elements or more go to the reference path (the kernel's element
offsets are int32)."""

def sr_uniforms(key, blocks_shape, philox: bool = False):
    """Stochastic rounding's uniforms for a fused kernel, equal to the reference's draw.

    The reference (``jax_mxfp4.quantize._quantize_impl``) rounds the element at position i of
    ``blocks_shape`` = ``(*lead, K / 32, 32)`` (x with the quantized axis moved last, split into
    blocks) with ``jax.random.uniform(key, blocks_shape, float32)`` at i. A kernel generates the
    same values from the key data and each element's flat index: :func:`threefry_uniform` where
    :func:`kernel_rng_supported`, and, for a kernel that takes them (``philox``), rbg / unsafe_rbg
    keys with :func:`philox_uniforms` where :func:`philox_key_supported`. Elsewhere (non-partitionable
    threefry, 2^32 elements or more) the kernel reads that draw.

    Args:
      key: the PRNG key of the reference call (typed, or a legacy raw key).
      blocks_shape: the reference's draw shape ``(*lead, K / 32, 32)``.
      philox: whether the calling kernel generates rbg keys' uniforms (takes uint32[4] key data).
    Returns:
      ``(uniform, key_data)``, exactly one not None: ``uniform`` float32 of ``blocks_shape``
      (``jax.random.uniform(key, blocks_shape)``), or ``key_data`` uint32[2] (threefry) or
      uint32[4] (rbg, with ``philox``).
    """
    n = math.prod(blocks_shape)
    if kernel_rng_supported(key, n) or (philox and philox_key_supported(key, n)):
        typed = jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
        return None, (jax.random.key_data(key) if typed else key)
    return jax.random.uniform(key, blocks_shape, jnp.float32), None


@functools.partial(
    jax.jit, static_argnames=("axis", "scale_mode", "rounding", "interpret", "cfg", "hadamard")
)
def quantize_impl(x, key, *, axis, scale_mode, rounding, interpret=False,
                  cfg: QuantizeConfig | None = None, hadamard=None):
    """Drop-in for the reference ``_quantize_impl``: returns (data uint8, E8M0 scales) for
    ``axis``, bit-identical to it (stochastic rounding uses the same uniforms from ``key``,
    :func:`sr_uniforms`).

    ``hadamard=(block, seed)`` fuses the random Hadamard rotation along ``axis`` into the pass:
    bit-identical to ``_quantize_impl(random_hadamard_transform(x, axis, seed, block), ...)``
    (see :func:`quantize_2d`).

    Along an axis other than the last, x is moved (an XLA transpose) and this kernel reads rows;
    :func:`jax_mxfp4.quantize` takes :func:`jax_mxfp4.kernels.quantize_columns.quantize_strided`
    there instead, which reads x in place.

    Raises TypeError for an input dtype other than float32/bfloat16/float16, ValueError for an
    unknown ``scale_mode`` / ``rounding`` (or "stochastic" without a key), an empty ``x`` (no
    grid to launch: :func:`jax_mxfp4.quantize` takes the reference path there) or one too large
    for int32 offsets (the rules of :func:`jax_mxfp4.quantize`, checked here too for direct
    callers)."""
    checks.check_interpret(interpret, "quantize_impl")
    from ..mx_format import as_e8m0

    checks.check_float_input(x, "quantize_impl: x")
    checks.check_static_shape(x, "quantize_impl")
    checks.check_scale_mode(scale_mode, "quantize_impl: scale_mode")
    checks.check_rounding(rounding, key, "quantize_impl: rounding")
    if x.size == 0:
        raise ValueError(f"quantize_impl: x of shape {tuple(x.shape)} is empty (no kernel grid): use jax_mxfp4.quantize")
    if x.size >= MAX_KERNEL_ELEMENTS:  # int32 element offsets (fast_path_enabled routes these away)
        raise ValueError(f"quantize_impl: x has {x.size} elements; the fused kernel takes fewer than "
                         f"{MAX_KERNEL_ELEMENTS} (int32 offsets): use jax_mxfp4.quantize")
    xm = jnp.moveaxis(x, axis, -1)
    lead = xm.shape[:-1]
    x2 = xm.reshape(-1, xm.shape[-1])
    if cfg is None:
        cfg = default_config(x.dtype)
    uniform = key_data = None
    if rounding == "stochastic":  # the reference's draw: same key, same [..., K/32, 32] shape
        uniform, key_data = sr_uniforms(key, (*lead, xm.shape[-1] // BLOCK_SIZE, BLOCK_SIZE))
    if hadamard is not None:
        hadamard = (int(hadamard[0]), int(hadamard[1]))
    data, byte = quantize_2d(x2, uniform, key_data=key_data, scale_mode=scale_mode, cfg=cfg, interpret=interpret,
                             hadamard=hadamard)
    data = data.reshape(*lead, data.shape[-1])
    byte = byte.reshape(*lead, byte.shape[-1])
    return jnp.moveaxis(data, -1, axis), as_e8m0(jnp.moveaxis(byte, -1, axis))

