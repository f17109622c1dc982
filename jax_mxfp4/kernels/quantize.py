"""Fused MXFP4 quantization in one pass: a Pallas (Triton lowering) kernel.

Reads each input element once and writes the packed E2M1 bytes and the E8M0 scale bytes once.
The kernel body applies the rules of :mod:`jax_mxfp4.mx_format` (``flush_subnormal_inputs``,
``e8m0_from_amax``, ``pow2_from_exponent``, ``e2m1_code_nearest`` / ``e2m1_code_stochastic``) in the
same order as the reference ``jax_mxfp4.quantize._quantize_impl``, so its output is bit-identical
in every scale mode and rounding (tests/test_fast_quantize.py checks this, special values too).

Each tile is loaded contiguously and split into its even and odd elements in registers, so a packed byte is
``code(even) | code(odd) << 4`` without an in-register interleave; block amax is the max over
both halves of the block's 16 + 16 elements. Stochastic rounding takes the same uniforms the
reference draws (``jax.random.uniform(key, blocks_shape)``), passed in as a second input.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ..mx_format import (
    BLOCK_SIZE,
    E8M0_BIAS,
    E8M0_NAN,
    e2m1_code_nearest,
    e2m1_code_stochastic,
    e8m0_from_amax,
    flush_subnormal_inputs,
    pow2_from_exponent,
)

ENV_VAR = "JAX_MXFP4_FAST_QUANTIZE"
"""Set to "0" to make :func:`jax_mxfp4.quantize` use the reference jnp path on GPUs too."""


@dataclasses.dataclass(frozen=True)
class QuantizeConfig:
    """Tile of the quantization kernel: ``rows`` x ``cols`` input elements (powers of two,
    cols a multiple of 64), Triton ``num_warps``."""

    rows: int = 16
    cols: int = 256
    num_warps: int = 4

    def __post_init__(self):
        if self.rows < 1 or self.rows & (self.rows - 1):
            raise ValueError(f"QuantizeConfig.rows must be a power of two, got {self.rows}")
        if self.cols < 64 or self.cols & (self.cols - 1):
            raise ValueError(f"QuantizeConfig.cols must be a power of two >= 64, got {self.cols}")


def _quantize_kernel(*refs, n_rows, k, cfg, scale_mode, stochastic):
    if stochastic:
        x_ref, u_ref, data_ref, scale_ref = refs
    else:
        x_ref, data_ref, scale_ref = refs
    br, bc = cfg.rows, cfg.cols
    half, nb = bc // 2, bc // BLOCK_SIZE
    r0 = pl.program_id(0) * br
    c0 = pl.program_id(1) * bc
    rows = r0 + lax.broadcasted_iota(jnp.int32, (br, 1), 0)
    cols = c0 + lax.broadcasted_iota(jnp.int32, (1, bc), 1)
    mask = (rows < n_rows) & (cols < k)
    pmask = (rows < n_rows) & ((c0 + 2 * lax.broadcasted_iota(jnp.int32, (1, half), 1)) < k)

    def load_halves(ref):
        # One contiguous load, split into even/odd elements in registers (Triton tt.split).
        v = plgpu.load(ref.at[pl.ds(r0, br), pl.ds(c0, bc)], mask=mask, other=0)
        even, odd = jnp.unstack(v.reshape(br, half, 2), axis=-1)
        shape = (br, nb, BLOCK_SIZE // 2)
        return even.reshape(shape), odd.reshape(shape)

    xe, xo = load_halves(x_ref)
    xe, xo = flush_subnormal_inputs(xe), flush_subnormal_inputs(xo)
    if stochastic:
        ue, uo = load_halves(u_ref)
    fin_e, fin_o = jnp.isfinite(xe), jnp.isfinite(xo)
    bad = jnp.maximum(
        jnp.max((~fin_e).astype(jnp.int32), axis=-1), jnp.max((~fin_o).astype(jnp.int32), axis=-1)
    ) > 0
    amax = jnp.maximum(
        jnp.max(jnp.where(fin_e, jnp.abs(xe), 0.0), axis=-1),
        jnp.max(jnp.where(fin_o, jnp.abs(xo), 0.0), axis=-1),
    )
    byte = jnp.where(bad, jnp.uint8(E8M0_NAN), e8m0_from_amax(amax, scale_mode))
    s = jnp.clip(byte.astype(jnp.int32) - E8M0_BIAS, -E8M0_BIAS, 126)
    inv = pow2_from_exponent(-s)[..., None]

    def codes(x, fin, u):
        y = jnp.where(fin, x * inv, 0.0)
        if stochastic:
            c = e2m1_code_stochastic(y, u)
        else:
            c = e2m1_code_nearest(y)
        return jnp.where(bad[..., None], jnp.uint8(0), c)

    packed = codes(xe, fin_e, ue if stochastic else None) | (
        codes(xo, fin_o, uo if stochastic else None) << 4
    )
    plgpu.store(data_ref.at[pl.ds(r0, br), pl.ds(c0 // 2, half)], packed.reshape(br, half), mask=pmask)
    brows = r0 + lax.broadcasted_iota(jnp.int32, (br, 1), 0)
    bcols = c0 // BLOCK_SIZE + lax.broadcasted_iota(jnp.int32, (1, nb), 1)
    plgpu.store(
        scale_ref.at[pl.ds(r0, br), pl.ds(c0 // BLOCK_SIZE, nb)],
        byte,
        mask=(brows < n_rows) & (bcols < k // BLOCK_SIZE),
    )


@functools.partial(jax.jit, static_argnames=("scale_mode", "cfg", "interpret"))
def quantize_2d(x, uniform=None, *, scale_mode="even", cfg: QuantizeConfig = QuantizeConfig(),
                interpret=False):
    """Quantize a 2-D array [R, K] along its last axis in one fused pass.

    Args:
      x: float32/bfloat16/float16 [R, K], K a multiple of 32.
      uniform: None for round-to-nearest-even; for stochastic rounding, float32 [R, K] uniforms
        in [0, 1) (element-aligned with x).
      scale_mode: as in :func:`jax_mxfp4.quantize`.
      cfg: :class:`QuantizeConfig`. interpret: run the Pallas interpreter (CPU tests).
    Returns:
      (data uint8 [R, K/2], scale bytes uint8 [R, K/32]), bit-identical to the reference.
    """
    n_rows, k = x.shape
    if k % BLOCK_SIZE:
        raise ValueError(f"quantized axis length {k} is not a multiple of {BLOCK_SIZE}")
    stochastic = uniform is not None
    args = [x] if uniform is None else [x, uniform.reshape(n_rows, k)]
    kernel = functools.partial(
        _quantize_kernel, n_rows=n_rows, k=k, cfg=cfg, scale_mode=scale_mode, stochastic=stochastic
    )
    return pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((n_rows, k // 2), jnp.uint8),
            jax.ShapeDtypeStruct((n_rows, k // BLOCK_SIZE), jnp.uint8),
        ),
        grid=(pl.cdiv(n_rows, cfg.rows), pl.cdiv(k, cfg.cols)),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=1),
        interpret=interpret,
        name="mxfp4_quantize",
    )(*args)


def fast_path_enabled(platform: str, rounding: str = "nearest") -> bool:
    """Whether :func:`jax_mxfp4.quantize` uses this kernel: round-to-nearest-even on CUDA/ROCm,
    unless disabled by ``JAX_MXFP4_FAST_QUANTIZE=0``.

    Stochastic rounding stays on the reference path on GPUs: the kernel matches the reference
    bit for bit in the CPU interpreter, but on the H200 it gave +0.0 (code 0x0) where the
    reference gives -0.0 (code 0x8) for negative values rounded to zero (8.6-16.5% of the data
    bytes; benchmarks/results/gpu_check.json). ``e2m1_code_stochastic`` negates a float zero,
    and the Pallas Triton lowering computes a negation as ``0 - x``, which gives +0.0 for
    -(+0.0). With its uniforms read from memory the kernel was also no faster there (0.99 vs
    0.94 ms, 16384x8192 bf16).
    """
    return (
        rounding == "nearest"
        and platform in ("cuda", "rocm")
        and os.environ.get(ENV_VAR, "1").strip() != "0"
    )


@functools.partial(
    jax.jit, static_argnames=("axis", "scale_mode", "rounding", "interpret", "cfg")
)
def quantize_impl(x, key, *, axis, scale_mode, rounding, interpret=False,
                  cfg: QuantizeConfig | None = None):
    """Drop-in for the reference ``_quantize_impl``: returns (data, E8M0 scales) for ``axis``."""
    from ..mx_format import as_e8m0

    xm = jnp.moveaxis(x, axis, -1)
    lead = xm.shape[:-1]
    x2 = xm.reshape(-1, xm.shape[-1])
    if cfg is None:
        cfg = QuantizeConfig(rows=32, cols=min(256, max(64, 1 << (x2.shape[1] - 1).bit_length())), num_warps=8)
    uniform = None
    if rounding == "stochastic":  # the reference's draw: same key, same [..., K/32, 32] shape
        blocks = (*lead, xm.shape[-1] // BLOCK_SIZE, BLOCK_SIZE)
        uniform = jax.random.uniform(key, blocks, jnp.float32).reshape(x2.shape)
    data, byte = quantize_2d(x2, uniform, scale_mode=scale_mode, cfg=cfg, interpret=interpret)
    data = data.reshape(*lead, data.shape[-1])
    byte = byte.reshape(*lead, byte.shape[-1])
    return jnp.moveaxis(data, -1, axis), as_e8m0(jnp.moveaxis(byte, -1, axis))
