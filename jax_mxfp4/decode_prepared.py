"""An MXFP4 weight arranged once for the decode-size GEMM kernel: :class:`DecodePrepared`.

The Mosaic GPU w4a16 kernel (:func:`jax_mxfp4.kernels.wgemm_mgpu.mgpu_w4a16`) reads the weight
as packed E2M1 bytes [N, K/2] (the quantized axis K last) and its E8M0 scale bytes K-major,
[K/32, N]. A plain :class:`jax_mxfp4.MXFP4Array` stored like a Flax kernel ([K, N] quantized
along axis 0) needs, on every call, a transpose of the whole packed weight to [N, K/2] and a
transpose of its scales; one stored [N, K] along axis 1 still needs the scale transpose. At
decode sizes (a few activation rows) those copies cost as much as the GEMM. :func:`prepare_decode`
does them once:

  data:   uint8 [*rest, K/2]: the packed bytes with the quantized axis moved last, by default
          in the "lanes" order: a 4x4 transpose of the bytes inside each 32-element block
          (:func:`pair_order_bytes`, so the kernel's register decode meets the activation in
          natural order), then each 32-bit word's nibbles regrouped by bfloat16 lane
          (:func:`lanes_order_bytes`); ``byte_order="natural"`` keeps the bytes in place (each
          byte's two E2M1 codes: element 2i in bits 0-3, 2i+1 in bits 4-7);
  scales: float8_e8m0fnu [*rest[:-1], K/32, rest[-1]]: the E8M0 bytes, K-major ("kmajor": the
          block index before the last non-quantized dim); [K/32] for a 1-D array.

``rest`` is the logical shape without the quantized axis, in order. For a 2-D weight [K, N]
along axis 0 or [N, K] along axis 1: data [N, K/2], scales [K/32, N]; for stacked layers
[L, K, N] along axis 1: data [L, N, K/2], scales [L, K/32, N]. The bytes are the MXFP4Array's
own, only moved: :meth:`DecodePrepared.to_mxfp4` gives it back bit for bit (plain scale layout).

:func:`jax_mxfp4.dot_general` takes a DecodePrepared wherever it takes an MXFP4Array operand
(contracted along its quantized axis). The pallas backend's Mosaic GPU route uses ``data`` and
``scales`` as they are (``scales_form="kmajor"``); every other backend and route computes with
``to_mxfp4()`` (exact; for the canonical form a transpose of the scales only).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from . import checks
from .array import MXFP4Array
from .pytree import ArraysWithRecord
from .prepared import PreparedWeight
from .mx_format import BLOCK_SIZE


BYTE_ORDERS = ("natural", "lanes")
# "pairs" (the lanes order's bytes before the nibble regrouping) was a stored order until the
# "lanes" decode measured faster on the H200 (docs/performance.md)
_REMOVED_ORDERS = {"pairs": '"lanes" replaces it (the same bytes with each word\'s nibbles regrouped)'}


def _check_byte_order(fn: str, byte_order) -> None:
    """ValueError naming ``fn``, the allowed orders and, for a removed one, what replaces it."""
    if not isinstance(byte_order, str) or byte_order not in BYTE_ORDERS:  # str first: `in` on an array is ambiguous
        why = _REMOVED_ORDERS.get(byte_order) if isinstance(byte_order, str) else None
        raise ValueError(f"{fn} byte_order must be one of {BYTE_ORDERS}, got {byte_order!r}"
                         + (f" (removed: {why})" if why else ""))


def _check_bytes_array(fn: str, data, need_uint8: bool = False) -> None:
    """``data`` must be a NumPy or jax array with at least one axis (uint8 where ``need_uint8``:
    a function that splits bytes into nibbles would silently drop the high bits of wider
    integers). TypeError / ValueError naming ``fn`` and the rule."""
    if not hasattr(data, "shape") or not hasattr(data, "dtype"):
        raise TypeError(f"{fn}: data must be a NumPy or jax array, got {type(data).__name__}")
    if len(data.shape) < 1:
        raise ValueError(f"{fn}: data must have at least one axis, got a 0-d array")
    if need_uint8 and data.dtype != np.uint8:
        raise TypeError(f"{fn}: data must be uint8 packed E2M1 bytes, got {data.dtype}")


def pair_order_bytes(data, axis: int = -1):
    """The "pairs" byte order of packed E2M1 bytes along ``axis`` (natural <-> pairs; an involution):
    within every 16-byte group (one 32-element block) a 4x4 transpose, stored byte 4g + t = natural
    byte g + 4t. Why: thread g of a Hopper warpgroup's 8-bit WGMMA register layout loads stored
    bytes 4g..4g+3 of each block, and its bfloat16 A-operand slots t = 0..3 hold K columns
    8t + 2g, 8t + 2g + 1; with the bytes in this order, decoding byte t into slot t gives the
    weight in natural K order (the first step of the "lanes" order; the large-tile kernel's
    "natural" decode makes it in registers). Nibbles stay in their bytes. jnp or NumPy arrays; ``axis`` of a length that is a multiple of 16."""
    _check_bytes_array("pair_order_bytes", data)  # any dtype: a permutation (x's element pairs too)
    axis = axis % data.ndim
    n = data.shape[axis]
    if n % (BLOCK_SIZE // 2):
        raise ValueError(f"pair_order_bytes: axis {axis} has {n} bytes, not whole 16-byte (32-element) blocks")
    grouped = data.reshape(data.shape[:axis] + (n // 16, 4, 4) + data.shape[axis + 1:])
    swap = np.swapaxes if isinstance(data, np.ndarray) else jnp.swapaxes
    return swap(grouped, axis + 1, axis + 2).reshape(data.shape)


def lanes_order_bytes(data, inverse: bool = False):
    """The "lanes" order of packed E2M1 bytes along the last axis, from the :func:`pair_order_bytes`
    order (``inverse``: back to it): in every 32-bit little-endian word (4 bytes, 8 nibbles), the
    low nibble of byte t moves to bits 4t..4t+3 and its high nibble to bits 16 + 4t..16 + 4t + 3.
    Why: the Mosaic GPU kernel's "lanes" decode (``e2m1_asm._DECODE_LANES_PTX``) then builds each
    bfloat16x2 register of two elements (the pairs PTX's output t) with a mask and a multiply
    instead of a byte permute and two shifts. An exact permutation of the nibbles within each
    word; jnp or NumPy uint8 arrays whose last axis is a multiple of 4."""
    _check_bytes_array("lanes_order_bytes", data, need_uint8=True)
    if not isinstance(inverse, (bool, np.bool_)):
        raise TypeError(f"lanes_order_bytes: inverse must be a bool, got {inverse!r}")
    n = data.shape[-1]
    if n % 4:
        raise ValueError(f"lanes_order_bytes: the last axis has {n} bytes, not whole 32-bit words")
    xp = np if isinstance(data, np.ndarray) else jnp
    b = data.reshape(data.shape[:-1] + (n // 4, 4)).astype(xp.uint32)
    w = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
    out = xp.zeros_like(w)
    for t in range(4):
        lo_src, hi_src = (8 * t, 8 * t + 4) if not inverse else (4 * t, 16 + 4 * t)
        lo_dst, hi_dst = (4 * t, 16 + 4 * t) if not inverse else (8 * t, 8 * t + 4)
        out = out | (((w >> lo_src) & 0xF) << lo_dst) | (((w >> hi_src) & 0xF) << hi_dst)
    parts = [((out >> (8 * j)) & 0xFF).astype(xp.uint8) for j in range(4)]
    return xp.stack(parts, axis=-1).reshape(data.shape)


def order_of(x) -> str | bool:
    """``x.byte_order`` for a :class:`DecodePrepared`, else False (GemmProblem's ``*_decode_prepared``)."""
    return x.byte_order if isinstance(x, DecodePrepared) else False


def _rest(shape, axis) -> tuple[int, ...]:
    return tuple(d for i, d in enumerate(shape) if i != axis)


def child_shapes(shape, axis) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(data shape, scales shape) of a DecodePrepared of logical ``shape`` quantized along
    ``axis`` (module docstring): the one place the layout is written down."""
    rest, k = _rest(shape, axis), shape[axis]
    scales = rest[:-1] + (k // BLOCK_SIZE,) + rest[-1:]
    return rest + (k // 2,), scales


def kmajor_from_plain(scales_last):
    """Scales [*rest, K/32] (quantized axis last) -> K-major [*rest[:-1], K/32, rest[-1]]."""
    return scales_last if scales_last.ndim < 2 else jnp.swapaxes(scales_last, -1, -2)


def plain_from_kmajor(scales_kmajor):
    """Inverse of :func:`kmajor_from_plain`."""
    return scales_kmajor if scales_kmajor.ndim < 2 else jnp.swapaxes(scales_kmajor, -1, -2)


@dataclasses.dataclass(frozen=True, eq=False)
class DecodePrepared(PreparedWeight, ArraysWithRecord):
    """An :class:`jax_mxfp4.MXFP4Array` arranged once for decode-size GEMMs (:func:`prepare_decode`).

    Children (see the module docstring for the layout):
      data:   uint8 [*rest, K/2], packed E2M1 pairs, quantized axis last.
      scales: ``float8_e8m0fnu`` [*rest[:-1], K/32, rest[-1]] (K-major), or [K/32] for 1-D.
    Static: ``axis``, ``shape`` (logical), ``dtype``, ``scale_mode``, ``hadamard`` - those of the
    MXFP4Array it came from (``hadamard``: the ``(block, seed)`` rotation its values carry, as in
    MXFP4Array; :func:`jax_mxfp4.dot_general` rotates a float operand facing it the same way);
    ``byte_order``: "lanes" (default, what :func:`prepare_decode` makes: :func:`lanes_order_bytes`
    of :func:`pair_order_bytes` along the last axis) or "natural" (byte j of a row = elements 2j,
    2j+1).

    Memory: the same 17/32 bytes per element as an MXFP4Array in the plain layout.
    A pytree: ``jit``, ``device_put``/sharding and orbax handle it like a pair of arrays;
    ``jax.export`` serializes it as an argument or result (:mod:`jax_mxfp4.serialization`). It
    cannot be batched by ``vmap``/``scan`` (the static shape would no longer describe the
    children: :meth:`to_mxfp4` and ``dot_general`` then raise); use a stacked array and
    ``dot_general``'s batch dims instead.

    Raises (construction): TypeError for a logical dtype other than float32/bfloat16/float16;
    ValueError for an unknown ``scale_mode`` or ``byte_order``, an ``axis`` out of range, a quantized length that
    is not a multiple of 32, or children of the wrong shape or dtype (naming the field).
    """

    holds = "a DecodePrepared holds packed E2M1 codes and K-major E8M0 scales"

    data: Any
    scales: Any
    axis: int
    shape: tuple[int, ...]
    dtype: Any
    scale_mode: str = "even"
    hadamard: tuple[int, int] | None = None
    byte_order: str = "lanes"

    CHILDREN = ("data", "scales")

    @classmethod
    def _restore(cls, static, children):
        shape = checks.resolve_symbolic(tuple(static["shape"]), static["axis"], children[0], packed=True, axis_last=True)
        return {**static, "shape": shape}

    def __post_init__(self):
        checks.check_mx_dtype(self.dtype, "DecodePrepared dtype")
        if not isinstance(self.shape, (tuple, list)) or not all(
                isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0 for d in self.shape):
            raise TypeError(f"DecodePrepared shape must be a tuple of non-negative ints, got {self.shape!r}")
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype))
        checks.check_scale_mode(self.scale_mode, "DecodePrepared scale_mode")
        _check_byte_order("DecodePrepared", self.byte_order)
        shape, axis = self.shape, self.axis
        if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)) or not 0 <= axis < len(shape):
            raise ValueError(f"DecodePrepared axis must be an int in [0, {len(shape)}), got {axis!r}")
        object.__setattr__(self, "axis", int(axis))
        checks.check_block_multiple(shape[axis], axis, "DecodePrepared shape")
        want_data, want_scales = child_shapes(shape, axis)
        self._check_child_forms({"data": (want_data, jnp.uint8), "scales": (want_scales, jnp.float8_e8m0fnu)},
                             f"packed E2M1 pairs and K-major E8M0 scales, quantized axis last; logical shape "
                             f"{shape}, axis {axis}")
        self._check_hadamard()

    @property
    def nbytes(self) -> int:
        """Bytes held by data and scales (4.25 bits per element, as an MXFP4Array)."""
        return int(np.prod(self.data.shape)) + int(np.prod(self.scales.shape))

    def __repr__(self) -> str:
        return (f"DecodePrepared(shape={self.shape}, dtype={self.dtype.name}, axis={self.axis}, "
                f"scale_mode={self.scale_mode!r}"
                + (f", hadamard={self.hadamard}" if self.hadamard is not None else "")
                + (f", byte_order={self.byte_order!r}" if self.byte_order != "lanes" else "") + ")")

    def _check_children(self):
        """ValueError if the children no longer match the static shape (e.g. the output of
        ``vmap``/``scan``, which add a dim that the static fields do not describe)."""
        want_data, want_scales = child_shapes(self.shape, self.axis)
        if tuple(self.data.shape) != want_data or tuple(self.scales.shape) != want_scales:
            raise ValueError(
                f"DecodePrepared data/scales have shapes {tuple(self.data.shape)}/{tuple(self.scales.shape)} "
                f"but its static shape {self.shape} (axis {self.axis}) asks for {want_data}/{want_scales}: "
                "batching a DecodePrepared with vmap/scan is not supported; prepare the stacked MXFP4Array "
                "instead and use dot_general's batch dims"
            )
        self._check_shardings()

    def _check_shardings(self):
        """ValueError if the scales carry an explicit-mesh sharding that is not the data's with the
        last two entries swapped (K-major): data [*rest, K/2] P(..., n, k) -> scales
        [*rest[:-1], K/32, rest[-1]] P(..., k, n). Replicated scales are fine (each shard reads them
        whole). ``jax.device_put(prepared, spec)`` gives both children one spec, which shards the
        scales along another dim than the data: JAX then failed deep inside the dequantization."""
        from . import sharding as shd

        try:
            ds, ss = shd.explicit_spec(self.data), shd.explicit_spec(self.scales)
        except Exception:  # children without an abstract value (e.g. ShapeDtypeStructs): nothing to check
            return
        if ss is None or all(e is None for e in ss):
            return
        ds = ds or (None,) * len(self.data.shape)
        want = ds if len(ds) < 2 else ds[:-2] + (ds[-1], ds[-2])
        if tuple(ss) != tuple(want):
            from jax.sharding import PartitionSpec as P

            raise ValueError(
                f"DecodePrepared.scales are sharded {P(*ss)} but .data {P(*ds)}: the K-major scales "
                f"[..., K/32, N] must be sharded as the data [..., N, K/2] with the last two entries swapped, "
                f"{P(*want)}, or replicated (jax.device_put(prepared, sharding) gives both children one "
                "spec: put each child with its own, or prepare_decode a sharded MXFP4Array)"
            )

    def to_mxfp4(self) -> MXFP4Array:
        """The MXFP4Array this was prepared from, bit for bit (plain scale layout)."""
        self._check_children()
        plain = plain_from_kmajor(self.scales)
        data = self.data
        if self.byte_order == "lanes":
            data = pair_order_bytes(lanes_order_bytes(data, inverse=True))
        return MXFP4Array(jnp.moveaxis(data, -1, self.axis), jnp.moveaxis(plain, -1, self.axis),
                          self.axis, self.shape, self.dtype, self.scale_mode, "plain", self.hadamard)


def prepare_decode(w: MXFP4Array, byte_order: str = "lanes") -> DecodePrepared:
    """Arrange an MXFP4Array once for decode-size GEMMs (a weight used by many calls).

    Args:
      w: an :class:`jax_mxfp4.MXFP4Array` of any rank, quantized along any axis, either scale
        layout (e.g. a Flax kernel [K, N] quantized along axis 0, as
        :func:`jax_mxfp4.flax.quantize_params` makes it).
      byte_order: "lanes" (default: the bytes of each 32-element block in the order the Mosaic
        GPU kernels' register decode reads with the activation unpermuted, :func:`pair_order_bytes`,
        then the nibbles of each 32-bit word regrouped by :func:`lanes_order_bytes`: a mask and
        a multiply per register) or "natural" (the bytes as in ``w``). The former "pairs" order
        (without the regrouping) is refused: "lanes" measured faster.
    Returns:
      :class:`DecodePrepared`: data uint8 [*rest, K/2] (quantized axis moved last) and scales
      float8_e8m0fnu [*rest[:-1], K/32, rest[-1]] (K-major; [K/32, N] for a 2-D weight), the
      same bytes moved (``to_mxfp4()`` is an exact round trip). Passing it to
      :func:`jax_mxfp4.dot_general` in place of ``w`` gives the same result on every backend; on
      an NVIDIA Hopper GPU the Mosaic GPU w4a16 route then reads it with no per-call transpose
      of the packed weight or of its scales (module docstring).
    Raises:
      TypeError: ``w`` is not an MXFP4Array (a :class:`jax_mxfp4.FP8Prepared` or
        DecodePrepared: call ``to_mxfp4()`` first; a float array: quantize it first).
      ValueError: a ``byte_order`` other than "lanes" or "natural" (for "pairs", the message says
        "lanes" replaces it).
    """
    if not isinstance(w, MXFP4Array):
        hint = " (call .to_mxfp4() first)" if hasattr(w, "to_mxfp4") else " (quantize it with jax_mxfp4.quantize first)"
        raise TypeError(f"prepare_decode takes an MXFP4Array, got {type(w).__name__}{hint}")
    _check_byte_order("prepare_decode:", byte_order)
    data = jnp.moveaxis(w.data, w.axis, -1)
    if byte_order == "lanes":
        data = lanes_order_bytes(pair_order_bytes(data))
    scales = kmajor_from_plain(jnp.moveaxis(w.plain_scales(), w.axis, -1))
    return DecodePrepared(data, scales, w.axis, w.shape, w.dtype, w.scale_mode, w.hadamard, byte_order)


def canonical(x: DecodePrepared, contracting, batch) -> DecodePrepared:
    """A prepared operand as the canonical [B, F, K] form: a DecodePrepared of logical shape
    (B, F, K) quantized along axis 2, i.e. data uint8 [B, F, K/2] and scales [B, K/32, F].

    Batch dims come first, then the free dims (the logical dims that are neither batch nor the
    quantized axis), each group in the given order. When the logical dims are already in that
    order (batch..., free..., with the quantized axis anywhere) and there is at most one free dim
    - the common cases: a 2-D weight [K, N] or [N, K], stacked weights [L, K, N] with L a batch
    dim - both children are only reshaped (no transpose). Other orders, or several free dims,
    transpose the children (correct, just a per-call copy).

    Raises:
      ValueError: ``contracting`` is not exactly the quantized axis; children that do not match
        the static shape (a DecodePrepared batched by vmap/scan).
    """
    x._check_children()
    if tuple(contracting) != (x.axis,):
        raise ValueError(
            f"a DecodePrepared operand quantized along axis {x.axis} must be contracted along it alone, got "
            f"contracting dims {tuple(contracting)}"
        )
    nd, k = x.ndim, x.shape[x.axis]
    moved = lambda d: d if d < x.axis else d - 1  # noqa: E731  logical dim -> position in `rest`
    free = tuple(d for d in range(nd) if d != x.axis and d not in batch)
    perm = tuple(moved(d) for d in tuple(batch) + free)
    bsz = int(np.prod([x.shape[d] for d in batch])) if batch else 1
    fsz = int(np.prod([x.shape[d] for d in free])) if free else 1
    nb = k // BLOCK_SIZE
    if perm != tuple(range(nd - 1)):
        data = jnp.transpose(x.data, perm + (nd - 1,))
    else:
        data = x.data
    data = data.reshape(bsz, fsz, k // 2)
    if perm == tuple(range(nd - 1)) and len(free) == 1:
        scales = x.scales.reshape(bsz, nb, fsz)  # [*batch, K/32, F]: already K-major over F
    else:  # to [*rest, K/32], then batch/free order, then K-major over the merged free dims
        plain = plain_from_kmajor(x.scales) if nd > 1 else x.scales
        plain = jnp.transpose(plain, perm + (nd - 1,)).reshape(bsz, fsz, nb)
        scales = jnp.swapaxes(plain, 1, 2)
    return DecodePrepared(data, scales, 2, (bsz, fsz, k), x.dtype, x.scale_mode, x.hadamard, x.byte_order)
