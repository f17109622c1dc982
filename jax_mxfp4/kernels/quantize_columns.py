"""MXFP4 quantization along a strided axis, written with the quantized axis last: one Pallas
(Triton lowering) kernel that reads each input element once and transposes only the packed bytes.

``x`` [L, R, T] quantized along R (its middle axis) gives what the row quantizer
(:func:`jax_mxfp4.kernels.quantize_kernel.quantize_2d`) gives for the rows of
``moveaxis(x, 1, 2)`` [L, T, R]: data uint8 [L, T, R/2] and scale bytes [L, T, R/32], bit for bit,
without writing and reading that float transpose. Any array quantized along any axis but its last
is such an [L, R, T] view (a free reshape: L the dims before the axis, T those after).

Why: the training passes quantize X and dY along the tokens for wgrad, and a Flax kernel [K, N]
along K for fprop; each was a float32 transpose by XLA (8 bytes per element moved) and then the row
kernel (4 more read). Here 4 bytes are read and the 0.53 bytes written per element are the same.

Design: one program owns ``nbt`` 32-row blocks x ``bc`` columns of one L slice. The input is
viewed (free reshape) as [L * R / 32, 8, 4 T]: row 4q + w of a block holds its T columns at
offset w T of quad q, so four contiguous loads give the four rows of every quad as separate
[nbt, 8, bc] tiles. Block amax is a reduction over the quad axis within the tile; four E2M1 codes
(rows 4q .. 4q + 3 of one column) are packed into one uint16 (two packed bytes, little-endian:
``code(4q) | code(4q + 1) << 4`` is the low byte, as :func:`jax_mxfp4.mx_format.pack_nibbles`
orders them); only those [nbt, 8, bc] words and the [nbt, bc] scale bytes are transposed in
registers before the store. Stochastic rounding uses the reference's uniforms
(``jax.random.uniform(key, [L, T, R/32, 32])``, the quantized axis last), generated from each
element's flat index (l T + t) R + r: Threefry-2x32 for threefry keys, Philox-4x32 for rbg keys
(one Philox block per quad: the four words are the quad's four rows, no interleave).

Every rule is shared code: block scale (:func:`~jax_mxfp4.kernels.quantize_kernel.block_scale_bits`),
E2M1 codes (:func:`~jax_mxfp4.kernels.quantize_kernel.magnitude_code_bits`), the uniforms
(:func:`~jax_mxfp4.kernels.quantize_kernel.threefry_uniform`,
:func:`~jax_mxfp4.kernels.quantize_kernel.philox_uniforms`). Bit-identical to the reference in the
Pallas interpreter (tests/test_quantize_columns.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .. import checks
from ..mx_format import BLOCK_SIZE, pow2_from_exponent
from .quantize_kernel import (_ABS, block_scale_bits, check_key_data, check_uniform_size, magnitude_code_bits,
                              nearest_codes, philox_uniforms, sr_uniforms, threefry_uniform)

_QUAD = 4  # rows packed into one uint16 word
_QUADS = BLOCK_SIZE // _QUAD  # quads per 32-row block


@dataclasses.dataclass(frozen=True)
class ColumnsConfig:
    """``blocks`` 32-row blocks x ``cols`` columns per program (powers of two), Triton
    ``num_warps``. The default: 2 blocks (32 contiguous output bytes per column) x 128 columns
    (512 contiguous input bytes per float32 row) on 16 warps, 16 elements per thread. Why 16
    warps: ptxas (CUDA 13.0, sm_90a, the kernel compiled by jaxlib 0.10.2's Triton) gives this
    tile 63-64 registers per thread (77 for 2-byte inputs with an rbg key: one CTA per SM), the
    row kernels' 40-64 at their H200-measured tiles (16-32 elements per thread); on 4 warps (64
    elements per thread) round to nearest takes 168 (float32) and 227 (bfloat16) registers, 2-3
    CTAs per SM. Not timed on a GPU (``benchmarks/quantize.py --strided`` sweeps tiles)."""

    blocks: int = 2
    cols: int = 128
    num_warps: int = 16

    def __post_init__(self):
        for name in ("blocks", "cols", "num_warps"):
            object.__setattr__(self, name, checks.power_of_two(getattr(self, name), f"ColumnsConfig.{name}",
                                                               most=32 if name == "num_warps" else None))


def _pow2_at_most(n: int, cap: int) -> int:
    return min(cap, 1 << max(0, (n - 1).bit_length()))


def _kernel(*refs, n_rows, n_cols, nb, nbt, bc, scale_mode, rng, ptx):
    if rng is None:
        x_ref, data_ref, scale_ref = refs
        key_ref = u_ref = None
    elif rng == "uniform":
        x_ref, u_ref, data_ref, scale_ref = refs
    else:
        x_ref, key_ref, data_ref, scale_ref = refs
    l, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    b0, c0 = i * nbt, j * bc
    shape = (nbt, _QUADS, bc)
    over_b, over_c = nb % nbt != 0, n_cols % bc != 0
    mask = None  # only where the tile overhangs the array (static): unmasked accesses vectorize
    if over_b or over_c:
        mask = ((b0 + lax.broadcasted_iota(jnp.int32, shape, 0) < nb)
                & (c0 + lax.broadcasted_iota(jnp.int32, shape, 2) < n_cols))

    def load(ref, w):
        view = ref.at[pl.ds(l * nb + b0, nbt), pl.ds(jnp.int32(0), _QUADS), pl.ds(w * n_cols + c0, bc)]
        return plgpu.load(view) if mask is None else plgpu.load(view, mask=mask, other=0)

    bits = [lax.bitcast_convert_type(load(x_ref, w).astype(jnp.float32), jnp.int32) for w in range(_QUAD)]
    a = [v & _ABS for v in bits]
    amax = jnp.max(jnp.maximum(jnp.maximum(a[0], a[1]), jnp.maximum(a[2], a[3])), axis=1)  # [nbt, bc]
    bad, byte, s = block_scale_bits(amax, scale_mode)
    inv = pow2_from_exponent(-s)[:, None, :]

    u = [None] * _QUAD
    if rng is not None and rng != "uniform":
        # flat index of row r = 32 b + 4 q + w, column t in the reference's [L, T, R] draw
        blk = (b0 + lax.broadcasted_iota(jnp.int32, shape, 0)).astype(jnp.uint32)
        quad = lax.broadcasted_iota(jnp.int32, shape, 1).astype(jnp.uint32)
        col = (l * n_cols + c0 + lax.broadcasted_iota(jnp.int32, shape, 2)).astype(jnp.uint32)
        first = col * jnp.uint32(n_rows) + blk * jnp.uint32(BLOCK_SIZE) + quad * jnp.uint32(_QUAD)
        if rng == "threefry":
            u = [threefry_uniform(key_ref[0], key_ref[1], first + jnp.uint32(w)) for w in range(_QUAD)]
        else:  # Philox block first / 4 holds the quad's four elements, words 0..3 in order
            u = list(philox_uniforms([key_ref[k] for k in range(4)], first // jnp.uint32(_QUAD), ptx))
    elif rng == "uniform":
        u = [load(u_ref, w) for w in range(_QUAD)]

    def codes(flush):
        word = jnp.zeros(shape, jnp.int32)
        for w in range(_QUAD):
            c = magnitude_code_bits(a[w], inv, u[w], flush) | ((bits[w] >> 28) & 0x8)  # sign to bit 3
            word = word | (c << (4 * w))
        return word

    word = nearest_codes(s, codes) if rng is None else codes(True)
    word = jnp.where(bad[:, None, :], 0, word).astype(jnp.uint16)
    # [nbt, 8, bc] -> [bc, nbt, 8] and [nbt, bc] -> [bc, nbt]: the quantized axis last
    word_t = jnp.transpose(word, (2, 0, 1))
    byte_t = jnp.transpose(byte, (1, 0))
    rows = pl.ds(l * n_cols + c0, bc)
    dview = data_ref.at[rows, pl.ds(b0, nbt), pl.ds(jnp.int32(0), _QUADS)]
    sview = scale_ref.at[rows, pl.ds(b0, nbt)]
    if mask is None:
        plgpu.store(dview, word_t)
        plgpu.store(sview, byte_t)
        return
    smask = ((c0 + lax.broadcasted_iota(jnp.int32, (bc, nbt), 0) < n_cols)
             & (b0 + lax.broadcasted_iota(jnp.int32, (bc, nbt), 1) < nb))
    plgpu.store(dview, word_t, mask=jnp.broadcast_to(smask[:, :, None], word_t.shape))
    plgpu.store(sview, byte_t, mask=smask)


@functools.partial(jax.jit, static_argnames=("scale_mode", "cfg", "interpret"))
def quantize_columns_3d(x, key_data=None, uniform=None, *, scale_mode="even", cfg: ColumnsConfig | None = None,
                        interpret=False):
    """Quantize x [L, R, T] along R, with the quantized axis written last.

    Args:
      x: float32/bfloat16/float16 [L, R, T], R a multiple of 32, fewer than 2^31 elements.
      key_data: None (round to nearest even, unless ``uniform``), or the data of one key for
        stochastic rounding with the uniforms of ``jax.random.uniform(key, [L, T, R/32, 32])``,
        generated in the kernel: uint32[2] for a threefry2x32 key
        (:func:`~jax_mxfp4.kernels.quantize_kernel.kernel_rng_supported`), uint32[4] for an rbg /
        unsafe_rbg key (:func:`~jax_mxfp4.kernels.quantize_kernel.philox_key_supported`).
      uniform: None, or that draw itself (float32 [L, T, R/32, 32], or [L, T, R] or flat in
        that row-major order) for keys whose uniforms the kernel cannot generate. Exclusive with
        ``key_data``.
      scale_mode: the scale rule (as :func:`jax_mxfp4.quantize`).
      cfg: :class:`ColumnsConfig` (None: its default; a tile larger than the array is
        shrunk to it).
      interpret: run the Pallas interpreter (CPU tests).
    Returns:
      (data uint8 [L, T, R/2], scale bytes uint8 [L, T, R/32]): the row quantizer's output for
      ``moveaxis(x, 1, 2)``, i.e. ``quantize(x, axis=1)``'s data and scales with axis 1 moved last.
    Raises:
      TypeError: x not a float array; key_data not uint32[2] / uint32[4]; uniform not float32;
        cfg of another type; interpret not a bool.
      ValueError: x not 3-D, empty or with symbolic dims, R not a multiple of 32, 2^31 elements
        or more; both key_data and uniform; uniform of another shape; threefry key data while
        ``jax_threefry_partitionable`` is off (the kernel's Threefry is the partitionable one).
    """
    checks.check_interpret(interpret, "quantize_columns_3d")
    checks.check_float_input(x, "x")
    checks.check_static_shape(x, "quantize_columns_3d")
    checks.check_scale_mode(scale_mode, "quantize_columns_3d: scale_mode")
    if cfg is None:
        cfg = ColumnsConfig()
    if not isinstance(cfg, ColumnsConfig):
        raise TypeError(f"quantize_columns_3d: cfg must be a ColumnsConfig or None, got {cfg!r}")
    if x.ndim != 3 or x.size == 0:
        raise ValueError(f"quantize_columns_3d: x must be a non-empty 3-D [L, R, T] array, got shape {x.shape}")
    n_l, n_rows, n_cols = x.shape
    if n_rows % BLOCK_SIZE:
        raise ValueError(f"quantize_columns_3d: quantized axis length R={n_rows} is not a multiple of {BLOCK_SIZE}")
    if x.size >= 2**31:
        raise ValueError(f"quantize_columns_3d: x has {x.size} elements; the kernel takes fewer than 2^31 "
                         "(int32 offsets)")
    if key_data is not None and uniform is not None:
        raise ValueError("quantize_columns_3d: give key_data (uniforms generated in the kernel) or uniform, not both")
    rng = None
    args = [x.reshape(n_l * n_rows // BLOCK_SIZE, _QUADS, _QUAD * n_cols)]  # free: quads of rows side by side
    if key_data is not None:
        check_key_data(key_data, ((2,), (4,)), "quantize_columns_3d")
        rng = "threefry" if key_data.shape == (2,) else "philox"
        args.append(jnp.asarray(key_data, jnp.uint32))
    elif uniform is not None:
        check_uniform_size(uniform, x.size, "quantize_columns_3d")
        if tuple(uniform.shape) not in ((n_l, n_cols, n_rows // BLOCK_SIZE, BLOCK_SIZE), (n_l, n_cols, n_rows),
                                        (x.size,)):
            raise ValueError(f"quantize_columns_3d: uniform must be the reference's draw [L, T, R/32, 32] = "
                             f"{[n_l, n_cols, n_rows // BLOCK_SIZE, BLOCK_SIZE]} (or [L, T, R], or flat), got "
                             f"{list(uniform.shape)} (x's own [L, R, T] order is not the draw's)")
        rng = "uniform"
        # the draw is [L, T, R] row-major: bring it to x's [L, R, T] layout (an XLA transpose of
        # the uniforms, read once: keys the kernel cannot generate are the rare case)
        u = jnp.swapaxes(uniform.reshape(n_l, n_cols, n_rows), 1, 2)
        args.append(u.reshape(n_l * n_rows // BLOCK_SIZE, _QUADS, _QUAD * n_cols))
    nb = n_rows // BLOCK_SIZE
    nbt = _pow2_at_most(nb, cfg.blocks)
    bc = _pow2_at_most(n_cols, cfg.cols)
    kernel = functools.partial(_kernel, n_rows=n_rows, n_cols=n_cols, nb=nb, nbt=nbt, bc=bc,
                               scale_mode=scale_mode, rng=rng, ptx=not interpret)
    words, byte = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((n_l * n_cols, nb, _QUADS), jnp.uint16),
                   jax.ShapeDtypeStruct((n_l * n_cols, nb), jnp.uint8)),
        grid=(n_l, pl.cdiv(nb, nbt), pl.cdiv(n_cols, bc)),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=1),
        interpret=interpret,
        name="mxfp4_quantize_columns",
    )(*args)
    # uint16 -> its two bytes, low first (little-endian on every platform JAX runs on)
    data = lax.bitcast_convert_type(words, jnp.uint8)
    return data.reshape(n_l, n_cols, n_rows // 2), byte.reshape(n_l, n_cols, nb)


@functools.partial(jax.jit, static_argnames=("axis", "scale_mode", "rounding", "interpret"))
def quantize_strided(x, key, *, axis, scale_mode, rounding, interpret=False):
    """The GPU path of :func:`jax_mxfp4.quantize` along an axis that is not the last: a drop-in
    for the reference ``_quantize_impl`` (data uint8 and E8M0 scales in x's layout, bit for bit).
    x is viewed as [L, R, T] (a free reshape) and quantized along R by
    :func:`quantize_columns_3d`, which reads it once; the result's move back to x's layout is a
    transpose of bytes that XLA cancels against a consumer reading the quantized axis last (the
    FP8 encoding, a canonical GEMM operand). Stochastic rounding: the reference's uniforms, those
    of rbg keys too generated in the kernel (Philox).

    Raises the argument errors of :func:`jax_mxfp4.kernels.quantize_kernel.quantize_impl` (an
    empty or symbolic x included) and of :func:`quantize_columns_3d`; ValueError for the last axis
    (the row kernel's).
    """
    checks.check_interpret(interpret, "quantize_strided")
    from ..mx_format import as_e8m0

    checks.check_float_input(x, "quantize_strided: x")
    checks.check_static_shape(x, "quantize_strided")
    checks.check_scale_mode(scale_mode, "quantize_strided: scale_mode")
    checks.check_rounding(rounding, key, "quantize_strided: rounding")
    axis = checks.normalize_axis(axis, x.ndim, "quantize_strided: axis")
    if axis == x.ndim - 1:
        raise ValueError(f"quantize_strided: axis {axis} is x's last axis: use quantize_kernel.quantize_impl (rows)")
    if x.size == 0:
        raise ValueError(f"quantize_strided: x of shape {tuple(x.shape)} is empty (no kernel grid): use jax_mxfp4.quantize")
    checks.check_block_multiple(x.shape[axis], axis, "quantize_strided: x")

    r = x.shape[axis]
    before, after = x.shape[:axis], x.shape[axis + 1:]
    n_l, n_t = math.prod(before), math.prod(after)
    uniform = key_data = None
    if rounding == "stochastic":  # the reference's draw: [*before, *after, R/32, 32]
        uniform, key_data = sr_uniforms(key, (*before, *after, r // BLOCK_SIZE, BLOCK_SIZE), philox=True)
    data, byte = quantize_columns_3d(x.reshape(n_l, r, n_t), key_data, uniform, scale_mode=scale_mode,
                                     interpret=interpret)
    data = jnp.moveaxis(data.reshape(*before, *after, r // 2), -1, axis)
    byte = jnp.moveaxis(byte.reshape(*before, *after, r // BLOCK_SIZE), -1, axis)
    return data, as_e8m0(byte)
