"""Backend "fp8": an a4w4 GEMM on FP8 tensor cores (for GPUs with FP8 and no FP4 units: Hopper).

Pipeline:

1. each operand row -> float8_e4m3fn codes x one power of two (:func:`jax_mxfp4.fp8_prepared.encode_rows`:
   one Pallas kernel on CUDA, jnp elsewhere and with ``JAX_MXFP4_KERNELS=0``; a weight can be converted once with
   :func:`jax_mxfp4.prepare_fp8`); the training passes hand in their gradient operand as
   float8_e5m2 codes (:func:`as_fp8`: a 29-binade window per row instead of 15, so the rows of a
   gradient that spread further take the FP8 GEMM instead of step 4; one operand at most, as
   Hopper multiplies E4M3 x E5M2 but not E5M2 x E5M2);
2. XLA's FP8 ``dot_general`` (cuBLASLt ``__cublas$lt$matmul$f8`` on CUDA; XLA on CPU upcasts the
   codes to float32), float32 accumulation requested (bfloat16 output for a bfloat16 result on
   CUDA: rounding there and scaling by a power of two commute);
3. the exact power-of-two rescale 2^(e_row + e_col) with the output conversion (a single
   rounding; applied as two factors so that no intermediate leaves float32's range): one XLA
   fusion, on CUDA one Pallas kernel (:func:`rescale_on`, :mod:`jax_mxfp4.kernels.rescale`);
4. rows or columns flagged by step 1 (outside the 15-binade window, or holding elements that
   the reference flushes to zero or overflows to Inf) are recomputed on the exact path (backend
   "xla"'s arithmetic: float32 HIGHEST, on CUDA the same values as bfloat16 operands on tensor
   cores, :func:`exact_operand_dtype`) and written over the FP8 result: up to ``fallback_capacity``
   flagged rows and columns per batch element as gathered strips, more as one full exact GEMM.
   This runs in a ``lax.while_loop`` that takes zero trips when no row is flagged (one predicate
   read, no copy of the result); on CUDA outside a mesh one Pallas kernel replaces it
   (:mod:`jax_mxfp4.kernels.fp8_fix`: no host round trip per GEMM, no exact GEMMs for XLA to
   autotune). Rows with a NaN scale byte come out NaN, as in the
   reference.

Products are exact (E4M3 x E4M3 in the tensor core); what is not exact is the hardware's
accumulation. The ``precision`` contract (:func:`numerics`):

- ``None``/``DEFAULT``: the FP8 dot with ``Precision.DEFAULT``: cuBLASLt fast accumulation on
  Hopper (products aligned to the largest exponent inside an MMA, ~14 bits kept, partial sums
  kept in the tensor core across K). Error bound in README ("FP8 path"), asserted by
  ``tests/gpu/test_gpu_fp8.py``.
- ``HIGH``: the FP8 dot with ``Precision.HIGHEST``, which turns fast accumulation off
  (``IsFastAccumEnabled`` in XLA's cuda_blas_lt.cc): partial sums are promoted to float32
  periodically, but the 14-bit alignment inside one MMA remains: not float32-faithful.
- ``HIGHEST``: the float32-accumulation contract of every other backend. This backend cannot
  give it through XLA (no per-32-block promotion), so it declines and "auto" routes elsewhere;
  naming it explicitly with HIGHEST raises.
On CPU XLA converts the codes to float32 and accumulates in float32 for every precision.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..array import MXFP4Array
from ..fp8_format import FLAG_EXACT, FLAG_NAN, rescale_elements
from ..fp8_prepared import FP8Prepared, encode_rows_on
from ..mx_format import as_scale_bytes
from ..platform import kernels_enabled
from ..sharding import canonical_out_sharding, explicit_spec, kernel_may_run
from .base import EXACT, Backend, Contract, GemmProblem
from .xla import CANONICAL_DIMS, _as_float32

MIN_COMPUTE_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (8.9) and Hopper (9.0) and later

# Shape rule for "auto" (provisional; benchmarks/gemm.py measures it): "auto" takes this path for
# a4w4 when both M and N are at least this large. Below it the Pallas kernels (decode shapes) or
# "scaled_dot" win: the conversion pass (~1.5 B/element written and read again) and the M x N
# rescale are fixed costs that the FP8 GEMM's 2x tensor rate pays back only for large M x N.
AUTO_MIN_SIDE = 256

FALLBACK_MIN_ROWS = 16
"""Flagged rows (columns) recomputed as gathered strips: max(16, rows / 64) per batch element."""

ERROR_BOUNDS = {  # (precision, data kind) -> max |out - exact| / sum_k |a_k b_k| over outputs
    # Set from the FP8 error measurement on one NVIDIA H200 (2026-11-30, K = 1024 and 8192), which
    # tests/gpu/test_gpu_fp8.py asserts; measured maxima:
    # DEFAULT random 3.2e-4, adversarial 4.4e-3; HIGH random 3.2e-4, adversarial 1.9e-3.
    # "random": normal data with block scales spread over the window; "adversarial": data built
    # against the accumulator (a large first block then many small products, cancellation,
    # equal-sign ramps; see tests/gpu/gpu_reference.fp8_operands). With fast accumulation (DEFAULT) Hopper keeps
    # the running sum inside the tensor core with ~13-14 significant bits across all of K, so
    # products below its last bit can be lost entirely: these are measured bounds on these data
    # families (about 3x over the maxima), not worst-case guarantees.
    ("default", "random"): 2.0**-10,
    ("default", "adversarial"): 2.0**-6,
    ("high", "random"): 2.0**-10,
    ("high", "adversarial"): 2.0**-7,
}


def fallback_capacity(rows: int) -> int:
    return int(min(rows, max(FALLBACK_MIN_ROWS, rows // 64)))


def numerics(precision: str, platform: str = "cuda") -> Contract:
    """The :class:`~jax_mxfp4.backends.base.Contract` of this path at ``precision``
    ("default"|"high"|"highest") on ``platform``: float32 accumulation of exact products on CPU
    (the exact contract), :data:`ERROR_BOUNDS` on a GPU."""
    if precision == "highest":
        return Contract("unavailable", "not available (HIGHEST asks for float32 accumulation; the FP8 path cannot give it)")
    if platform == "cpu":
        return dataclasses.replace(EXACT, summary=(
            "FP8 codes, which XLA on CPU converts to float32: exact products, float32 accumulation "
            "(on a GPU: FP8 tensor-core accumulation, see README 'FP8 path')"))
    mode = ("hardware FP8 fast accumulation (Precision.DEFAULT)" if precision == "default"
            else "FP8 accumulation with fast accumulation off (the FP8 dot at Precision.HIGHEST)")
    rel = tuple((kind, c) for (p, kind), c in ERROR_BOUNDS.items() if p == precision)
    return Contract(f"fp8-{precision}", (
        f"FP8: exact E4M3 products, {mode}; not float32-faithful, error bound in README 'FP8 path'; "
        "rows outside the FP8 window exact (float32 accumulation of exact products)"), rel)


def as_fp8(x, platform: str, fmt: str = "e4m3") -> FP8Prepared:
    """A canonical MXFP4Array [B, R, K] (axis 2) as this path's :class:`FP8Prepared` with ``fmt``
    codes ("e4m3" | "e5m2", :mod:`jax_mxfp4.fp8_format`); an FP8Prepared passes through as it is."""
    if isinstance(x, FP8Prepared):
        return x
    codes, row_exp, row_flag = encode_rows_on(x.data, as_scale_bytes(x.plain_scales()), platform, fmt)
    return FP8Prepared(codes, x.plain_scales(), row_exp, row_flag, 2, x.shape, x.dtype, x.scale_mode)


def _mxfp4(x) -> MXFP4Array:
    return x.to_mxfp4() if isinstance(x, FP8Prepared) else x


def rescale(acc, e_lhs, e_rhs, nan_rows, nan_cols, out_dtype):
    """acc [B, M, N] x 2^(e_lhs[:, :, None] + e_rhs[:, None, :]) -> out_dtype, one rounding.

    The exponent sum E (in [-273, 242]) is applied as 2^E1 x 2^E2 with E1 = clip(E, -100, 100):
    |acc| >= 2^-25 when nonzero (a sum of E4M3 x E4M3 or E5M2 x E4M3 products, multiples of
    2^-9 x 2^-16), so acc x 2^E1 is an exact normal float unless the result overflows anyway; the
    second factor rounds once. NaN rows/cols -> NaN.
    The elementwise rule is :func:`jax_mxfp4.fp8_format.rescale_elements` (shared with the CUDA kernel,
    :mod:`jax_mxfp4.kernels.rescale`; :func:`rescale_on` picks the implementation).
    """
    e = e_lhs[:, :, None] + e_rhs[:, None, :]
    return rescale_elements(acc, e, nan_rows[:, :, None] | nan_cols[:, None, :], out_dtype)


def pallas_here(platform: str, x) -> bool:
    """Whether this backend's CUDA Pallas kernels (rescale, flagged-row fix) may run on ``x``:
    on CUDA with custom kernels on (:func:`jax_mxfp4.platform.kernels_enabled`) where
    :func:`jax_mxfp4.sharding.kernel_may_run` allows (outside a mesh, no explicit sharding, not
    varying inside ``shard_map``); elsewhere the XLA formulations run (the same bits)."""
    return platform == "cuda" and kernels_enabled() and kernel_may_run(x)


def rescale_on(acc, e_lhs, e_rhs, nan_rows, nan_cols, out_dtype, platform: str):
    """:func:`rescale` computed the fastest way on ``platform`` (bit-identical either way).

    On "cuda" (unless ``JAX_MXFP4_KERNELS=0``, under a mesh or for an explicitly sharded
    ``acc``: a pallas_call is opaque to SPMD partitioning; :func:`pallas_here`) one Pallas kernel over 2-D tiles
    (:func:`jax_mxfp4.kernels.rescale.rescale_kernel`; XLA's fusion of :func:`rescale` ran at
    about half of HBM speed on an H200). Elsewhere XLA's fusion.
    """
    use_kernel = acc.size > 0 and pallas_here(platform, acc)
    if not use_kernel:
        return rescale(acc, e_lhs, e_rhs, nan_rows, nan_cols, out_dtype)
    from ..kernels.rescale import rescale_kernel

    return rescale_kernel(acc, e_lhs, e_rhs, nan_rows, nan_cols, out_dtype)


def _exact(a, b, out_dtype, operand_dtype=jnp.float32):
    """The exact path for flagged rows (backend "xla"'s arithmetic) on canonical MXFP4Arrays.

    ``operand_dtype`` float32 (float32 HIGHEST, bit-identical to backend "xla" on one platform) or
    bfloat16 (:func:`exact_operand_dtype`, on CUDA: tensor cores): every dequantized MXFP4 value is
    E2M1 x 2^k, at most two significant bits within float32's exponent range (or a signed zero,
    +-Inf, NaN; ``dequantize_blocks``), so bfloat16 holds it exactly; bfloat16 products are exact
    in float32 and accumulate in float32: backend "xla"'s values up to the order of float32
    accumulation (the pallas backend's argument)."""
    fa, fb = (_as_float32(v).astype(operand_dtype) for v in (a, b))  # exact (docstring)
    precision = lax.Precision.HIGHEST if fa.dtype == jnp.float32 else None
    out = lax.dot_general(fa, fb, CANONICAL_DIMS, precision=precision, preferred_element_type=jnp.float32,
                          out_sharding=canonical_out_sharding(fa, fb))
    return out.astype(out_dtype)


def exact_operand_dtype(platform: str):
    """Operand dtype of the exact-row path on ``platform``: bfloat16 on CUDA (tensor cores), else
    float32 (bit-identical to backend "xla" on CPU). Why: in an LM head most rows of the softmax
    gradient span more than 14 binades, so this path is not rare, and a float32 GEMM there runs
    on FFMA units (docs/performance.md)."""
    return jnp.bfloat16 if platform == "cuda" else jnp.float32


def _rows(x: MXFP4Array, idx) -> MXFP4Array:
    take = lambda v: jnp.take_along_axis(v, idx[:, :, None], axis=1)  # noqa: E731
    data, scales = take(x.data), take(x.plain_scales())
    return MXFP4Array(data, scales, 2, (x.shape[0], idx.shape[1], x.shape[2]), x.dtype, x.scale_mode, "plain")


def _fix_flagged(out, lhs, rhs, flag_l, flag_r, platform: str = "cpu"):
    """``out`` with flagged rows (flag_l [B, M]) and columns (flag_r [B, N]) recomputed exactly.

    A ``lax.while_loop`` whose body runs only while flags remain: each trip recomputes up to
    ``fallback_capacity`` flagged rows and columns (or, with more flagged than that, every flagged
    entry at once from the full exact GEMM) and clears their flags. With no flagged row (the
    common case) it runs zero trips and ``out`` passes through in place (a ``lax.cond`` made XLA
    copy the result buffer). Prepared operands are decoded back to MXFP4 inside the body only.
    """
    bsz, m, n = out.shape
    cap_l, cap_r = fallback_capacity(m), fallback_capacity(n)
    opd = exact_operand_dtype(platform)
    bidx = jnp.arange(bsz)[:, None]

    def full(carry):
        out, fl, fr = carry
        exact = _exact(_mxfp4(lhs), _mxfp4(rhs), out.dtype, opd)
        return jnp.where(fl[:, :, None] | fr[:, None, :], exact, out), jnp.zeros_like(fl), jnp.zeros_like(fr)

    def strips(carry):
        out, fl, fr = carry
        a, b = _mxfp4(lhs), _mxfp4(rhs)
        il = lax.top_k(fl.astype(jnp.int32), cap_l)[1]
        rows = _exact(_rows(a, il), b, out.dtype, opd)  # [B, cap_l, N]
        keep = jnp.take_along_axis(fl, il, axis=1)[:, :, None]
        out = out.at[bidx, il].set(jnp.where(keep, rows, out[bidx, il]))
        ir = lax.top_k(fr.astype(jnp.int32), cap_r)[1]
        cols = _exact(a, _rows(b, ir), out.dtype, opd)  # [B, M, cap_r]
        keep = jnp.take_along_axis(fr, ir, axis=1)[:, None, :]
        cur = jnp.take_along_axis(out, jnp.broadcast_to(ir[:, None, :], (bsz, m, cap_r)), axis=2)
        out = out.at[bidx[:, :, None], jnp.arange(m)[None, :, None], ir[:, None, :]].set(jnp.where(keep, cols, cur))
        return out, fl.at[bidx, il].set(False), fr.at[bidx, ir].set(False)

    def body(carry):
        if explicit_spec(out) is not None:  # explicit-sharding mesh: no gathered strips across shards
            return full(carry)
        _, fl, fr = carry
        too_many = (jnp.max(jnp.sum(fl, axis=1)) > cap_l) | (jnp.max(jnp.sum(fr, axis=1)) > cap_r)
        return lax.cond(too_many, full, strips, carry)

    flagged = lambda carry: jnp.any(carry[1]) | jnp.any(carry[2])  # noqa: E731
    return lax.while_loop(flagged, body, (out, flag_l, flag_r))[0]


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def fp8_gemm(lhs, rhs, out_dtype, precision: str = "default", platform: str = "cpu"):
    """Canonical a4w4 GEMM [B, M, K] x [B, N, K] -> [B, M, N] on the FP8 path.

    ``lhs``/``rhs``: canonical MXFP4Arrays (axis 2) or canonical :class:`FP8Prepared`.
    ``precision``: "default" or "high" (module docstring). Two E5M2 operands: the rhs is
    re-encoded as E4M3 (FP8 tensor cores multiply E4M3 x E5M2 at most; :mod:`jax_mxfp4.fp8_format`).
    Raises ValueError for "highest".
    """
    if precision not in ("default", "high"):
        raise ValueError(f"the FP8 path takes precision 'default' or 'high', got {precision!r}")
    out_dtype = np.dtype(out_dtype)  # (jit: an np.dtype or a jnp scalar type, both hashable)
    a, b = as_fp8(lhs, platform), as_fp8(rhs, platform)
    if a.fmt == b.fmt == "e5m2":
        rhs = _mxfp4(rhs)
        b = as_fp8(rhs, platform)
    # bfloat16 out on CUDA: cuBLASLt rounds the float32 accumulator to bf16 in its epilogue and
    # the power-of-two rescale commutes with that rounding (same exponent range as float32).
    acc_dtype = jnp.bfloat16 if (platform == "cuda" and out_dtype == np.dtype(jnp.bfloat16)) else jnp.float32
    acc = lax.dot_general(
        a.codes, b.codes, CANONICAL_DIMS,
        precision=lax.Precision.DEFAULT if precision == "default" else lax.Precision.HIGHEST,
        preferred_element_type=acc_dtype, out_sharding=canonical_out_sharding(a.codes, b.codes),
    )
    nan_l, nan_r = (a.row_flag & FLAG_NAN) != 0, (b.row_flag & FLAG_NAN) != 0
    out = rescale_on(acc, a.row_exp, b.row_exp, nan_l, nan_r, out_dtype, platform)
    if pallas_here(platform, out):  # no host round trip
        from ..kernels.fp8_fix import fix_flagged

        return fix_flagged(out, a.codes, as_scale_bytes(a.scales), a.row_exp, a.row_flag,
                           b.codes, as_scale_bytes(b.scales), b.row_exp, b.row_flag)
    flag_l, flag_r = (a.row_flag & FLAG_EXACT) != 0, (b.row_flag & FLAG_EXACT) != 0
    # flagged rows/columns get the reference's values, NaN rows included (0 x NaN = NaN there)
    return _fix_flagged(out, lhs, rhs, flag_l, flag_r, platform)


def fused_operand(x, axis, scale_mode, interpret, rounding="nearest", key=None, fmt="e4m3"):
    """``as_fp8(quantize(x, axis, ...), platform, fmt)`` for a canonical float operand x [B, R, K]
    quantized along its last axis (``axis`` 2) in one fused kernel
    (:mod:`jax_mxfp4.kernels.fp8_quantize`), or None where the kernel cannot take it; the caller
    then keeps the unfused passes for this operand. An operand quantized along axis 1 always
    takes them: the kernel keeps whole output rows in registers, which a strided axis would make
    an XLA transpose first, while :func:`jax_mxfp4.quantize` reads it in place
    (:mod:`jax_mxfp4.kernels.quantize_columns`) before the encode kernel.

    Stochastic rounding (``key``) uses exactly the reference's uniforms, those of
    ``quantize(x, axis, rounding="stochastic", key=key)``: generated in the kernel from the key
    data for threefry keys (Threefry-2x32) and rbg / unsafe_rbg keys (Philox-4x32, as XLA expands
    their ``rng_bit_generator``); read as ``jax.random.uniform``'s draw only where the kernel
    cannot generate it (:func:`jax_mxfp4.kernels.quantize_kernel.sr_uniforms`).
    """
    from ..kernels import fp8_quantize as fq
    from ..kernels.quantize_kernel import sr_uniforms
    from ..mx_format import BLOCK_SIZE

    kq = x.shape[axis]
    if axis != x.ndim - 1 or kq > fq.MAX_ROW or kq % BLOCK_SIZE or x.size >= 2**31:
        return None
    rest = x.shape[:-1]  # the output rows, in order
    uniform = key_data = None
    if rounding == "stochastic":
        # quantize(x, axis)'s draw: uniform(key, rest + (kq / 32, 32)): element-aligned with the
        # kernel's rows (generated in the kernel from that flat index, or the drawn array read in)
        uniform, key_data = sr_uniforms(key, rest + (kq // BLOCK_SIZE, BLOCK_SIZE), philox=True)
    codes, scales, row_exp, row_flag = fq.quantize_fp8_2d(
        x.reshape(-1, kq), key_data, uniform, scale_mode=scale_mode, interpret=interpret, fmt=fmt)
    return FP8Prepared(codes.reshape(rest + (kq,)), scales.reshape(rest + (kq // BLOCK_SIZE,)),
                       row_exp.reshape(rest), row_flag.reshape(rest), axis, x.shape, x.dtype, scale_mode)


def _compute_capability():
    """(major, minor) of CUDA device 0, or None if unknown (:func:`jax_mxfp4.platform.compute_capability`;
    this name is what the backends call, and what tests replace)."""
    from .. import platform

    return platform.compute_capability()


class Fp8Backend(Backend):
    """a4w4 GEMM on FP8 tensor cores with exact per-row/per-column power-of-two scales."""

    name = "fp8"
    auto_platforms = ("cuda",)

    def rejects(self, problem: GemmProblem):
        if problem.has_float_operand:
            return "takes two MXFP4 operands only (a4w4; a w4a16 float operand is not E4M3)"
        if problem.platform not in ("cuda", "cpu"):
            return f"runs on CUDA GPUs (and on CPU, for tests), not {problem.platform}"
        if problem.precision == "highest":
            return ("precision HIGHEST asks for float32 accumulation; XLA's FP8 GEMM aligns products "
                    "inside an MMA to ~14 bits (README 'FP8 path')")
        return None

    def auto_rejects(self, problem: GemmProblem):
        cc = _compute_capability()
        if cc is not None and cc < MIN_COMPUTE_CAPABILITY:
            return f"needs FP8 tensor cores (compute capability >= 8.9); device 0 has {cc[0]}.{cc[1]}"
        if min(problem.m, problem.n) < AUTO_MIN_SIDE:
            return (f"min(M, N) = {min(problem.m, problem.n)} < {AUTO_MIN_SIDE}: the conversion and "
                    "rescale passes outweigh the FP8 GEMM's gain there (provisional rule)")
        return None

    def numerics(self, problem: GemmProblem) -> Contract:
        return numerics(problem.precision, problem.platform)

    def gemm(self, lhs, rhs, problem: GemmProblem) -> jax.Array:
        return fp8_gemm(lhs, rhs, problem.out_dtype, problem.precision, problem.platform)
