"""MXFP4 operands as FP8 codes times one power of two per row: the "fp8" GEMM path.

The codes are E4M3 (the default, and every weight) or E5M2 (the gradient operand of the
training passes: a 29-binade window instead of 15, :mod:`jax_mxfp4.fp8_format`). The rules below
are written for E4M3; E5M2's are the same with d in [-15, 13], e = b_max - 140 and a span of 28.

Why it is exact: every E2M1 value times 2^d is a
``float8_e4m3fn`` value for d in [-8, 6] (2^-9 is E4M3's smallest subnormal, 6 x 2^6 = 384 <=
448). A row of K elements (the quantized axis) whose blocks holding a nonzero code have E8M0
bytes b within 14 of their maximum b_max is therefore, exactly,

    element = E4M3(E2M1(code) x 2^d) x 2^e,   d = b - b_max + 6 in [-8, 6],   e = b_max - 133

(2^(b - 127) = 2^d x 2^e). Blocks with only zero codes do not count towards b_max or the span.

A row gets the "exact" flag (bit 0 of ``row_flag``) and is left to an exact path by the
GEMM (:mod:`jax_mxfp4.backends.fp8`) when it holds

- a nonzero block with b < b_max - 14 (outside the window: its codes would round in E4M3);
- an element that :func:`jax_mxfp4.mx_format.dequantize_blocks` (the reference decoding) turns
  into a signed zero (|value| < 2^-126, scale bytes 0x00/0x01) or into ±Inf (value >= 2^128,
  scale bytes 0xFD/0xFE): the reference semantics of those elements are not a product of codes
  (:func:`special_blocks`).

Such rows store d = 0 in every block (the codes are the E2M1 values themselves), so the prepared
form still round-trips exactly. A row holding a scale byte 0xFF gets bit 1 ("NaN"): the reference
decodes the whole block to NaN, so every output of that row is NaN (0 x NaN = NaN too); the GEMM
poisons the row through its scale factor. Every rule here is computed from the scale bytes and
codes with :mod:`jax_mxfp4.mx_format`'s functions.

:class:`FP8Prepared` is the stored form (a pytree, like :class:`jax_mxfp4.MXFP4Array`): a weight
used many times pays the conversion once (:func:`prepare_fp8`), and :meth:`FP8Prepared.to_mxfp4`
gives back the original MXFP4Array bit for bit (plain scale layout).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import checks
from .array import MXFP4Array
from .prepared import PreparedWeight
from .pytree import ArraysWithRecord
from .platform import current_platform, kernels_enabled
from .sharding import kernel_may_run
from .mx_format import (
    BLOCK_SIZE,
    as_e8m0,
    as_scale_bytes,
    decode_e2m1,
    e2m1_code_nearest,
    pack_nibbles,
    pow2_from_exponent,
    unpack_nibbles,
)

from .fp8_format import (
    FLAG_EXACT,
    _block_shift,
    check_packed_rows,
    encode_blocks,
    format_named,
    format_of,
)


def encode_rows(data, scale_bytes, fmt: str = "e4m3"):
    """The fused MXFP4 -> FP8 pass on rows with the quantized axis last.

    Args:
      data: uint8 [..., K/2] packed E2M1 pairs (low nibble first).
      scale_bytes: uint8 or float8_e8m0fnu [..., K/32], plain layout.
      fmt: the code format, "e4m3" or "e5m2" (:mod:`jax_mxfp4.fp8_format`).
    Returns:
      (codes float8_e4m3fn / float8_e5m2 [..., K], row_exp int32 [...], row_flag uint8 [...]) as
      described in the module docstring.
    Raises:
      ValueError: another ``fmt``.
    """
    f = format_named(fmt)
    sb = as_scale_bytes(scale_bytes).astype(jnp.int32)
    codes4 = unpack_nibbles(data)
    if codes4.shape[-1] == 0:  # K = 0: no block, as a row of zero blocks (row_exp 0, no flag)
        lead = codes4.shape[:-1]
        return codes4.astype(f.dtype), jnp.zeros(lead, jnp.int32), jnp.zeros(lead, jnp.uint8)
    blocks = codes4.reshape(*codes4.shape[:-1], codes4.shape[-1] // BLOCK_SIZE, BLOCK_SIZE)
    d, row_exp, row_flag = encode_blocks(sb, (blocks & 7).astype(jnp.int32), f)
    vals = decode_e2m1(blocks) * pow2_from_exponent(d)[..., None]
    return vals.reshape(codes4.shape).astype(f.dtype), row_exp, row_flag


def encode_rows_on(data, scale_bytes, platform: str, fmt: str = "e4m3"):
    """:func:`encode_rows` computed the fastest way on ``platform`` (bit-identical either way).

    On "cuda" (unless custom kernels are off, ``JAX_MXFP4_KERNELS=0``, or where
    :func:`jax_mxfp4.sharding.kernel_may_run` says no: under a mesh, explicitly sharded or
    ``shard_map``-varying operands) one Pallas kernel
    (:func:`jax_mxfp4.kernels.fp8_encode.encode_rows_kernel`, its default tile; the jnp form is
    several XLA fusions, ~10x slower on an H200); elsewhere the jnp form above. Leading dims
    are flattened.
    """
    check_packed_rows(data, scale_bytes)
    if not isinstance(platform, str):
        raise TypeError(f"platform must be a platform name such as 'cpu' or 'cuda', got {platform!r}")
    format_named(fmt)
    use_kernel = platform == "cuda" and kernels_enabled() and kernel_may_run(data, scale_bytes)
    if not use_kernel or data.size == 0:
        return encode_rows(data, as_scale_bytes(scale_bytes), fmt)
    from .kernels.fp8_encode import encode_rows_kernel

    lead, half = data.shape[:-1], data.shape[-1]
    sb = as_scale_bytes(scale_bytes)
    codes, row_exp, row_flag = encode_rows_kernel(data.reshape(-1, half), sb.reshape(-1, sb.shape[-1]), fmt=fmt)
    return codes.reshape(*lead, half * 2), row_exp.reshape(lead), row_flag.reshape(lead)


def decode_rows(codes, scale_bytes, row_exp, row_flag):
    """Inverse of :func:`encode_rows` (either format, from the codes' dtype): packed E2M1 data
    uint8 [..., K/2] (bit-exact)."""
    f = format_of(codes.dtype)
    sb = as_scale_bytes(scale_bytes).astype(jnp.int32)
    q = codes.astype(jnp.float32)
    blocks = q.reshape(*q.shape[:-1], q.shape[-1] // BLOCK_SIZE, BLOCK_SIZE)
    exact = ((row_flag & FLAG_EXACT) != 0)[..., None, None]
    d = _block_shift(sb, (row_exp + f.row_exp_offset)[..., None], exact[..., 0], f)
    e2m1 = blocks * pow2_from_exponent(-d)[..., None]
    return pack_nibbles(e2m1_code_nearest(e2m1).reshape(q.shape))


@dataclasses.dataclass(frozen=True, eq=False)
class FP8Prepared(PreparedWeight, ArraysWithRecord):
    """An :class:`jax_mxfp4.MXFP4Array` converted for the FP8 GEMM path (:func:`prepare_fp8`).

    Children (stored with the quantized axis LAST, the K-contiguous layout an FP8 GEMM reads):
      codes:    ``float8_e4m3fn`` [*rest, K]: E2M1(code) x 2^d per element, d per block
                (``float8_e5m2`` for the training passes' gradient operand: module docstring).
      scales:   ``float8_e8m0fnu`` [*rest, K/32]: the original E8M0 scale bytes (plain layout).
      row_exp:  int32 [*rest]: e = b_max - 133 (E5M2: - 140); an element is codes x 2^e (unflagged rows).
      row_flag: uint8 [*rest]: bit 0 the row takes the exact path, bit 1 it holds a NaN scale.
    ``rest`` is the logical shape without ``axis``, in order. Static: ``axis``, ``shape``
    (logical), ``dtype``, ``scale_mode``, ``hadamard`` - those of the MXFP4Array it came from
    (``hadamard``: the ``(block, seed)`` rotation its values carry, as in MXFP4Array;
    :func:`jax_mxfp4.dot_general` rotates a float operand facing it the same way).

    Build one with :func:`prepare_fp8`: the constructor checks the children's shapes and dtypes,
    not that they encode one another (children are often traced, so their values cannot be read);
    children that are not an encoding (:func:`encode_rows`) give unspecified results, different
    between backends.

    Memory: 1 + 1/32 bytes per element plus 5 bytes per row (an MXFP4Array: 17/32).
    A pytree: ``jit``, ``device_put``/sharding and orbax handle it like any tuple of arrays;
    ``jax.export`` serializes it as an argument or result (:mod:`jax_mxfp4.serialization`).
    """

    holds = "an FP8Prepared holds FP8 codes with per-row exponents"

    codes: Any
    scales: Any
    row_exp: Any
    row_flag: Any
    axis: int
    shape: tuple[int, ...]
    dtype: Any
    scale_mode: str = "even"
    hadamard: tuple[int, int] | None = None

    CHILDREN = ("codes", "scales", "row_exp", "row_flag")

    @classmethod
    def _restore(cls, static, children):
        shape = checks.resolve_symbolic(tuple(static["shape"]), static["axis"], children[0], packed=False, axis_last=True)
        return {**static, "shape": shape}

    def __post_init__(self):
        checks.check_mx_dtype(self.dtype)
        object.__setattr__(self, "shape", tuple(self.shape))
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype))
        checks.check_scale_mode(self.scale_mode, "scale_mode")
        shape, axis = self.shape, self.axis
        if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)) or not 0 <= axis < len(shape):
            raise ValueError(f"FP8Prepared axis must be an int in [0, {len(shape)}), got {axis!r}")
        checks.check_block_multiple(shape[axis], axis, "FP8Prepared shape")
        rest = tuple(d for i, d in enumerate(shape) if i != axis)
        want = {
            "codes": (rest + (shape[axis],), format_named(self.fmt).dtype),
            "scales": (rest + (shape[axis] // BLOCK_SIZE,), jnp.float8_e8m0fnu),
            "row_exp": (rest, jnp.int32),
            "row_flag": (rest, jnp.uint8),
        }
        self._check_child_forms(want, f"logical shape {shape}, axis {axis} moved last; codes float8_e4m3fn, "
                                      "or float8_e5m2 for a gradient")
        self._check_hadamard()

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(v.shape)) * jnp.dtype(v.dtype).itemsize
                   for v in (self.codes, self.scales, self.row_exp, self.row_flag))

    def __repr__(self) -> str:
        return (f"FP8Prepared(shape={self.shape}, dtype={self.dtype.name}, axis={self.axis}, "
                f"scale_mode={self.scale_mode!r}, fmt={self.fmt!r}"
                + (f", hadamard={self.hadamard}" if self.hadamard is not None else "") + ")")

    def _check_children(self):
        """ValueError if the children no longer match the static shape (e.g. the output of
        ``vmap``/``scan``, which add a dim that the static fields do not describe)."""
        rest = tuple(d for i, d in enumerate(self.shape) if i != self.axis)
        if tuple(self.codes.shape) != rest + (self.shape[self.axis],):
            raise ValueError(
                f"FP8Prepared codes have shape {tuple(self.codes.shape)} but its static shape is {self.shape} "
                f"(axis {self.axis}): batching an FP8Prepared with vmap/scan is not supported; prepare the "
                "stacked MXFP4Array instead and use dot_general's batch dims"
            )

    def to_mxfp4(self) -> MXFP4Array:
        """The MXFP4Array this was prepared from, bit for bit (plain scale layout)."""
        self._check_children()
        data = decode_rows(self.codes, self.scales, self.row_exp, self.row_flag)
        return MXFP4Array(jnp.moveaxis(data, -1, self.axis), jnp.moveaxis(self.scales, -1, self.axis),
                          self.axis, self.shape, self.dtype, self.scale_mode, "plain", self.hadamard)

    @property
    def fmt(self) -> str:
        """The code format, "e4m3" or "e5m2" (:mod:`jax_mxfp4.fp8_format`)."""
        e5m2 = jnp.dtype(getattr(self.codes, "dtype", jnp.float8_e4m3fn)) == jnp.dtype(jnp.float8_e5m2)
        return "e5m2" if e5m2 else "e4m3"  # the constructor admits these two

    def exact_rows(self) -> jax.Array:
        """bool [*rest]: rows the FP8 GEMM computes on its exact path (module docstring)."""
        return (self.row_flag & FLAG_EXACT) != 0


def prepare_fp8(x: MXFP4Array) -> FP8Prepared:
    """Convert an MXFP4Array for the FP8 GEMM path once (a weight used many times).

    Args:
      x: an :class:`jax_mxfp4.MXFP4Array` of any rank, either scale layout.
    Returns:
      :class:`FP8Prepared` (quantized axis moved last). Passing it to
      :func:`jax_mxfp4.dot_general` in place of ``x`` gives the same result on every backend
      (others take ``to_mxfp4()``, an exact round trip).
    Raises:
      TypeError: ``x`` is not an MXFP4Array.
    """
    if not isinstance(x, MXFP4Array):
        raise TypeError(f"prepare_fp8 takes an MXFP4Array, got {type(x).__name__}")
    return to_fp8(x, "e4m3")


def to_fp8(x: MXFP4Array, fmt: str) -> FP8Prepared:
    """:func:`prepare_fp8` with the code format ``fmt`` ("e4m3" | "e5m2"): the training passes
    encode their gradient operand as E5M2 (module docstring).

    Raises:
      TypeError: ``x`` is not an MXFP4Array; ValueError: another ``fmt``.
    """
    if not isinstance(x, MXFP4Array):
        raise TypeError(f"to_fp8 takes an MXFP4Array, got {type(x).__name__}")
    format_named(fmt)
    data = jnp.moveaxis(x.data, x.axis, -1)
    scales = jnp.moveaxis(x.plain_scales(), x.axis, -1)
    codes, row_exp, row_flag = jax.jit(encode_rows_on, static_argnums=(2, 3))(data, scales, current_platform(), fmt)
    return FP8Prepared(codes, as_e8m0(as_scale_bytes(scales)), row_exp, row_flag, x.axis, x.shape, x.dtype,
                       x.scale_mode, x.hadamard)


def canonical(x: FP8Prepared, contracting, batch) -> FP8Prepared:
    """A prepared operand as the canonical [B, F, K] form (batch dims, then free dims; its
    quantized axis must be the single contracting dim: the caller checks that)."""
    x._check_children()
    (k_axis,) = contracting
    if k_axis != x.axis:
        raise ValueError(
            f"an FP8Prepared operand quantized along axis {x.axis} must be contracted along it, got "
            f"contracting dims {tuple(contracting)}"
        )
    nd = x.ndim
    moved = lambda d: d if d < x.axis else d - 1  # noqa: E731  logical dim -> position in `rest`
    free = tuple(d for d in range(nd) if d != x.axis and d not in batch)
    perm = tuple(moved(d) for d in tuple(batch) + free)
    bsz = int(np.prod([x.shape[d] for d in batch])) if batch else 1
    fsz = int(np.prod([x.shape[d] for d in free])) if free else 1
    k = x.shape[x.axis]

    def rows(v, last=None):
        v = jnp.transpose(v, perm + ((len(perm),) if last is not None else ()))
        return v.reshape((bsz, fsz) + ((last,) if last is not None else ()))

    return FP8Prepared(rows(x.codes, k), rows(x.scales, k // BLOCK_SIZE), rows(x.row_exp), rows(x.row_flag),
                       2, (bsz, fsz, k), x.dtype, x.scale_mode, x.hadamard)
