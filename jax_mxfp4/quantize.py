"""Jitted MXFP4 quantization and dequantization (OCP MX v1.0)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import checks, sharding
from .array import MXFP4Array
from .differentiation import not_differentiable
from .platform import current_platform
from .mx_format import (
    BLOCK_SIZE,
    E8M0_BIAS,
    E8M0_NAN,
    as_e8m0,
    e2m1_code_nearest,
    e2m1_code_stochastic,
    e8m0_from_amax,
    flush_subnormal_inputs,
    pack_nibbles,
    pow2_from_exponent,
)


def quantize(
    x: jax.Array,
    axis: int = -1,
    *,
    scale_mode: str = "even",
    rounding: str = "nearest",
    key: jax.Array | None = None,
    scale_layout: str = "plain",
) -> MXFP4Array:
    """Quantize ``x`` to MXFP4 along ``axis``: blocks of 32, one E8M0 shared scale each.

    Args:
      x: float32, bfloat16 or float16 array of any rank; ``x.shape[axis]`` a multiple of 32.
      axis: the quantized (block) axis, usually the contracting dim of the GEMM that consumes it.
      scale_mode: rule for the shared scale from the block's amax (max |x| in float32, never
        rounded through bf16): "floor" (OCP MX v1.0 §6.3), "ceil", "even" (default; Quark /
        AITER-Triton / TE-ROCm) or "rceil" (NVIDIA / TE / torchao RCEIL). Formulas in
        :func:`jax_mxfp4.mx_format.e8m0_from_amax`.
      rounding: element rounding of x / scale to E2M1: "nearest" (round half to even, saturating
        to ±6; OCP §6.3) or "stochastic" (unbiased, driven by ``key``; method in
        :func:`jax_mxfp4.mx_format.e2m1_code_stochastic`).
      key: a ``jax.random`` key, required for ``rounding="stochastic"``, ignored otherwise.
      scale_layout: "plain" or "swizzled" (hipBLASLt 32x8, see :mod:`jax_mxfp4.layout`).

    Returns:
      An :class:`MXFP4Array` with ``shape=x.shape``, ``dtype=x.dtype`` and non-negative ``axis``.

    Special values (policy of torchao ``to_mx``):
      - an all-zero block has scale byte 0x00 and zero elements;
      - a block holding any NaN or ±Inf gets scale byte 0xFF and dequantizes to all-NaN; other
        blocks are untouched;
      - float32 subnormal inputs (|x| < 2^-126) are treated as zeros of the same sign on every
        backend (XLA on CPU would flush them anyway; the rule is applied explicitly);
      - with "even", "ceil" and "rceil", a block with amax >= 1.75 * 2^127 gets scale 2^126 and
        its largest elements the code 4: the value 2^128 is valid MXFP4 but dequantizes to +inf
        in float32 ("floor" clips to 6 * 2^125 instead).

    Raises:
      TypeError: ``x`` is not float32/bfloat16/float16, or ``axis`` is not an int.
      ValueError: ``axis`` out of range; ``x.shape[axis]`` not a multiple of 32, or symbolic
        (``jax.export`` shape polymorphism: the other dims may be symbolic, the quantized one
        must be concrete); an unknown ``scale_mode``, ``rounding`` or ``scale_layout``;
        "stochastic" without ``key``; under an explicit-sharding mesh, ``axis`` sharded so that a
        shard would split a 32-element block; a derivative with respect to ``x`` (the codes are
        integers: JAX would return an exact zero; :func:`jax_mxfp4.dot_general` passes gradients
        straight through its quantizers instead).
    """
    x, axis, key = _checked_input(x, axis, scale_mode, rounding, key, "jax_mxfp4.quantize")
    checks.check_scale_layout(scale_layout)
    # GPU fast path (both roundings): one fused Pallas pass, bit-identical to _quantize_impl; along
    # the last axis the row kernel, along any other the strided-axis kernel (no float transpose).
    from .kernels import quantize_columns as strided
    from .kernels import quantize_kernel as fused

    if not fused_path(x):
        impl = _quantize_impl
    else:
        impl = fused.quantize_impl if axis == x.ndim - 1 else strided.quantize_strided
    data, scales = impl(x, key, axis=axis, scale_mode=scale_mode, rounding=rounding)
    q = MXFP4Array(data, scales, axis, x.shape, x.dtype, scale_mode, "plain")
    return q.with_scale_layout(scale_layout)


def _checked_input(x, axis, scale_mode, rounding, key, fn: str):
    """The argument rules of :func:`quantize` (its Raises) for ``x`` quantized along ``axis``:
    returns (``x`` made non-differentiable, ``axis`` non-negative, ``key`` or None for "nearest")."""
    checks.check_float_input(x, "x")
    axis = checks.normalize_axis(axis, jnp.ndim(x), "axis")
    checks.check_block_multiple(x.shape[axis], axis, "x")
    sharding.check_dim_blocks(x, axis, "x", f"the quantized axis {axis}")
    checks.check_scale_mode(scale_mode)
    checks.check_rounding(rounding, key)
    return not_differentiable(x, fn), axis, (key if rounding == "stochastic" else None)


def fused_path(x) -> bool:
    """Whether :func:`quantize` of ``x`` runs the fused Pallas quantizer (GPU fast path,
    :func:`jax_mxfp4.kernels.quantize_kernel.fast_path_enabled`) rather than the reference jnp path.

    The fused kernel is a pallas_call, opaque to SPMD partitioning (XLA would all-gather its
    input): under a mesh, for an explicitly sharded ``x`` and inside ``shard_map``
    (:func:`jax_mxfp4.sharding.kernel_may_run`) the reference jnp path runs instead, which XLA
    partitions shard-locally.
    An empty ``x`` takes the reference path too (the kernel has no grid to launch).
    """
    from .kernels import quantize_kernel as fused

    if any(checks.is_symbolic(d) for d in x.shape):
        return False  # shape polymorphism: the kernel's grid needs static shapes; jnp takes symbolic dims
    # an empty array has no kernel grid: the reference path returns its empty result
    return x.size > 0 and fused.fast_path_enabled(current_platform(), x.size) and sharding.kernel_may_run(x)


def fused_rotation_path(x) -> bool:
    """Whether :func:`quantize_rotated` of ``x`` runs the rotation inside the fused quantizer:
    wherever :func:`fused_path` takes the fused quantizer (both forms give the same bits)."""
    return fused_path(x)


def quantize_rotated(
    x: jax.Array,
    axis: int,
    hadamard: tuple[int, int],
    *,
    scale_mode: str = "even",
    rounding: str = "nearest",
    key: jax.Array | None = None,
) -> MXFP4Array:
    """``quantize(random_hadamard_transform(x, axis, seed, block), axis, ...)``, one pass on GPUs.

    On the GPU fast path (:func:`fused_rotation_path`) the rotation is applied in registers inside the
    Pallas quantization kernel (``jax_mxfp4.kernels.quantize_kernel``, ``hadamard=(block, seed)``), with
    the same float32 operations in the same order as :func:`jax_mxfp4.hadamard.
    random_hadamard_transform`, so the result is bit-identical to the two-pass form, which runs
    everywhere else (CPU, under a mesh, ``JAX_MXFP4_KERNELS=0``). Not differentiable (used
    where the quantized operand is consumed: the backward passes and ``quantize_params``).

    Args:
      x: float32/bfloat16/float16 array; ``x.shape[axis]`` a multiple of ``block``.
      axis: the rotated and quantized axis.
      hadamard: ``(block, seed)``: block 32, 64, 128 or 256, seed of the sign vector
        (:func:`jax_mxfp4.hadamard.random_signs`).
      scale_mode, rounding, key: as in :func:`quantize`.

    Returns:
      An :class:`MXFP4Array` (plain scales) of ``x.shape``, dtype float32 (the rotated values'
      dtype), ``hadamard`` not recorded (the caller records it where the array leaves its hands).

    Raises:
      what :func:`quantize` raises; ValueError/TypeError from
      :func:`jax_mxfp4.hadamard.check_block` / :func:`~jax_mxfp4.hadamard.check_length`.
    """
    from . import hadamard as hd
    from .kernels import quantize_kernel as fused

    block, seed = hd.check_spec(hadamard, "hadamard")
    checks.check_float_input(x, "x")
    axis = checks.normalize_axis(axis, jnp.ndim(x), "axis")
    hd.check_length(x.shape[axis], block, "x")
    if not fused_rotation_path(x):
        return quantize(hd.random_hadamard_transform(x, axis, seed, block), axis, scale_mode=scale_mode,
                        rounding=rounding, key=key)
    x, axis, key = _checked_input(x, axis, scale_mode, rounding, key, "jax_mxfp4.quantize_rotated")
    data, scales = fused.quantize_impl(x, key, axis=axis, scale_mode=scale_mode, rounding=rounding,
                                       hadamard=(block, seed))
    return MXFP4Array(data, scales, axis, x.shape, jnp.dtype(jnp.float32), scale_mode, "plain")


@functools.partial(jax.jit, static_argnames=("axis", "scale_mode", "rounding"))
def _quantize_impl(x, key, *, axis, scale_mode, rounding):
    xm = jnp.moveaxis(flush_subnormal_inputs(x), axis, -1)
    blocks = xm.reshape(*xm.shape[:-1], xm.shape[-1] // BLOCK_SIZE, BLOCK_SIZE)
    finite = jnp.isfinite(blocks)
    bad_block = ~jnp.all(finite, axis=-1)
    amax = jnp.max(jnp.where(finite, jnp.abs(blocks), 0.0), axis=-1)
    byte = jnp.where(bad_block, jnp.uint8(E8M0_NAN), e8m0_from_amax(amax, scale_mode))
    # x / 2^s as x * 2^-s with 2^-s built from bits: s is in [-127, 126] for finite blocks.
    s = jnp.clip(byte.astype(jnp.int32) - E8M0_BIAS, -E8M0_BIAS, 126)
    y = jnp.where(finite, blocks * pow2_from_exponent(-s)[..., None], 0.0)
    if rounding == "stochastic":
        codes = e2m1_code_stochastic(y, jax.random.uniform(key, y.shape, jnp.float32))
    else:
        codes = e2m1_code_nearest(y)
    codes = jnp.where(bad_block[..., None], jnp.uint8(0), codes)
    data = pack_nibbles(codes.reshape(xm.shape))
    return jnp.moveaxis(data, -1, axis), as_e8m0(jnp.moveaxis(byte, -1, axis))


def dequantize(q: MXFP4Array, dtype=jnp.float32) -> jax.Array:
    """Decode an :class:`MXFP4Array` to a dense array of its logical shape.

    Each element is E2M1(code) x 2^(scale byte - 127) (OCP MX v1.0 §5.2), computed exactly in
    float32 and then cast to ``dtype``. Scale byte 0xFF gives NaN for the whole block. Values
    below 2^-126 in magnitude (only possible with scale bytes 0x00/0x01) become signed zeros on
    every backend. Casting to float16 overflows to ±Inf above 65504.

    Args:
      q: the quantized array (either scale layout).
      dtype: float32 (default), bfloat16 or float16.
    Returns:
      Array of shape ``q.shape`` and dtype ``dtype``.
    Raises:
      TypeError: ``q`` is not an MXFP4Array. ValueError: ``dtype`` is not a supported float.
    """
    if not isinstance(q, MXFP4Array):
        hint = (f" (a prepared weight, {type(q).__name__}: use q.dequantize(dtype) or q.to_mxfp4())" if hasattr(q, "to_mxfp4")
                else "")
        raise TypeError(f"q must be an MXFP4Array, got {type(q).__name__}{hint}")
    return q.dequantize(dtype)


