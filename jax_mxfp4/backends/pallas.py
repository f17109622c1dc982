"""Backend "pallas": fused MXFP4 GEMM kernels written in Pallas (Triton lowering).

Routes (``PallasBackend.route`` says which one a problem takes; ``explain()`` prints it):
  * w4a16, and a4w4 with one side of <= 128 rows: the weight-stationary kernel
    (:mod:`jax_mxfp4.kernels.wgemm`): the MXFP4 weight is decoded inside the K loop (inline-PTX
    E2M1 decode on CUDA, :mod:`jax_mxfp4.kernels.e2m1_asm`; portable decode on ROCm and in the
    interpreter); an MXFP4 activation is first dequantized exactly to bfloat16 (a small array);
  * w4a16 with >= ``W4A16_TWO_PASS_MIN_ROWS`` activation rows on a GPU: the weight is decoded to
    bfloat16 once (one memory-bound Pallas pass) and XLA's bfloat16 GEMM runs; on Hopper, below
    ``W4A16_TILES_MAX_ROWS`` rows (``W4A16_TILES_PLAIN_MAX_ROWS`` for a plain weight), the
    large-tile Mosaic GPU kernel instead
    (:mod:`jax_mxfp4.kernels.wgemm_tiles_mgpu`: the decode inside the GEMM's K loop; a weight
    from ``prepare_decode`` read as stored, a plain MXFP4Array's bytes as they are with its
    scales transposed per call);
  * a4w4 with both sides large: both operands decoded exactly to bfloat16 (the two-pass form:
    one memory-bound Pallas pass each, or the jnp dequantization where the pass does not tile
    them) and XLA's bfloat16 GEMM; "auto" prefers other backends there.
All are exact up to the order of float32 accumulation: decoded values are exact in bfloat16 and
bfloat16 products exact in float32; results equal backend "xla" up to that order.

"auto" picks it on CUDA and ROCm GPUs (``auto_platforms``), never on CPU. On CPU it can still be
named explicitly: it then runs the same kernels in the Pallas interpreter (slow; for tests).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ..array import MXFP4Array
from ..decode_prepared import DecodePrepared
from ..mx_format import as_scale_bytes
from ..platform import KERNELS_ENV, kernels_enabled
from .base import Backend, GemmProblem

FLOAT_OPERAND_DTYPES = (np.dtype(jnp.bfloat16),)

# Shape rule for "auto", from timings on an NVIDIA H200 (docs/performance.md): decode-size a4w4
# runs the weight-stationary kernel, faster than "scaled_dot" and "fp8" there; with both M and N
# large this backend's two-pass form (a bfloat16 GEMM after the decode passes) cannot beat the
# FP8 GEMM. For w4a16 neither "fp8" nor "scaled_dot" can run and pallas beats "xla" (the float32
# reference path) at every measured shape, so no rule applies.
A4W4_MAX_SMALL_SIDE = 128
# w4a16 with at least this many activation rows: decode the weight to bfloat16 once (one
# memory-bound Pallas pass) and run XLA's bfloat16 GEMM, rather than decoding every weight tile
# once per 128-row activation tile inside the kernel (slower from 128 rows on the H200).
W4A16_TWO_PASS_MIN_ROWS = 256
# ... and below this many rows, on an NVIDIA Hopper GPU, the large-tile Mosaic GPU kernel instead
# (jax_mxfp4/kernels/wgemm_tiles_mgpu.py: the decode inside the GEMM's K loop): with a
# prepare_decode'd weight at least as fast as two-pass up to 4096 rows on the H200; at 8192 XLA's
# GEMM on the decoded weight wins (docs/performance.md).
W4A16_TILES_MAX_ROWS = 4096
# ... for a plain MXFP4Array weight (natural bytes: the large-tile kernel's "natural" decode, its
# quad byte transpose and heavier decode not hidden behind the tensor cores as the "lanes" one is)
# only below this many rows: from 2048 rows two-pass is as fast on the H200 and simpler
# (docs/performance.md).
W4A16_TILES_PLAIN_MAX_ROWS = 2048


def _tiles_max_rows(order: str) -> int:
    """Activation rows from which a weight in byte ``order`` leaves the large-tile kernel for
    two-pass: natural bytes (a plain MXFP4Array) ``W4A16_TILES_PLAIN_MAX_ROWS``, else
    ``W4A16_TILES_MAX_ROWS``."""
    return W4A16_TILES_PLAIN_MAX_ROWS if order == "natural" else W4A16_TILES_MAX_ROWS
# w4a16 with <= 64 activation rows on an NVIDIA Hopper GPU (compute capability 9.0) through the
# Mosaic GPU kernel (jax_mxfp4/kernels/wgemm_mgpu.py: WGMMA with the decoded weight as the
# register operand) instead of the Triton weight-stationary kernel: faster on the H200
# (docs/performance.md; checked by tests/gpu/test_gpu_wgemm_mgpu.py). Decode-size a4w4 takes it
# too, after the exact bfloat16 dequantization of its small side (as for the Triton kernel).
W4A16_MOSAIC_GPU = True
"""Whether the Mosaic GPU routes (the decode-size and the large-tile kernels) are taken on Hopper;
not a user setting: tests set it False to reach the Triton routes on a Hopper GPU. The routing
decision is made when a program is lowered (inside jax_mxfp4.partitioning's custom partitioning,
after tracing), and jax reuses a compiled executable for an identical program: a change applies
to programs compiled after it (``jax.clear_caches()`` recompiles)."""


def mosaic_w4a16_enabled() -> bool:
    """Whether decode-size GEMMs on Hopper may take the Mosaic GPU kernel (``W4A16_MOSAIC_GPU``)."""
    return bool(W4A16_MOSAIC_GPU)


def _plain(x):
    """A DecodePrepared operand as its exact MXFP4Array (routes that do not read it as stored)."""
    return x.to_mxfp4() if isinstance(x, DecodePrepared) else x


class PallasBackend(Backend):
    """Fused Pallas/Triton MXFP4 GEMM (a4w4 and w4a16) for GPUs; interpreter on CPU."""

    name = "pallas"
    auto_platforms = ("cuda", "rocm")
    opaque = True  # a pallas_call: jax_mxfp4.partitioning gives it a sharding rule

    def unavailable_reason(self):
        try:
            from jax.experimental import pallas  # noqa: F401
            from jax.experimental.pallas import triton  # noqa: F401
        except Exception as e:  # pragma: no cover - depends on the installed jax
            return f"jax.experimental.pallas.triton cannot be imported ({e})"
        return None

    def rejects(self, problem: GemmProblem):
        if not kernels_enabled():
            return f"custom GPU kernels are off (${KERNELS_ENV}=0): every kernel of this backend is one"
        for kind, dtype, side in (
            (problem.lhs_kind, problem.lhs_dtype, "lhs"),
            (problem.rhs_kind, problem.rhs_dtype, "rhs"),
        ):
            if kind == "float" and np.dtype(dtype) not in FLOAT_OPERAND_DTYPES:
                return (
                    f"w4a16 kernels take a bfloat16 float operand; {side} is {np.dtype(dtype).name} "
                    f"(converting it would change the result; backend 'xla' keeps it exact)"
                )
        if problem.platform not in ("cuda", "rocm", "cpu"):
            return f"Pallas Triton kernels run on CUDA/ROCm GPUs (and interpreted on CPU), not {problem.platform}"
        return cuda_capability_reason(problem.platform)

    def auto_rejects(self, problem: GemmProblem):
        if not problem.has_float_operand and min(problem.m, problem.n) > A4W4_MAX_SMALL_SIDE:
            return (
                f"a4w4 with M={problem.m} and N={problem.n} both > {A4W4_MAX_SMALL_SIDE}: "
                "a bfloat16 GEMM after decoding both operands here, 'fp8' and 'scaled_dot' measured faster "
                "on the H200 (docs/performance.md)"
            )
        return None

    def route(self, problem: GemmProblem) -> str:
        plan = _plan(problem)
        decode = decode_for(problem.platform)
        if plan.kind == "tiles":
            how = (f"the weight from prepare_decode read as stored (\"{plan.mgpu_cfg.decode}\" decode)" if plan.w_prepared
                   else "a plain MXFP4Array weight: its natural bytes moved to the pairs order in registers by warp "
                        "shuffles (\"natural\" decode), its E8M0 scales transposed to K-major per call")
            top = _tiles_max_rows(plan.mgpu_cfg.decode)
            return (f"Mosaic GPU large-tile kernel, w4a16 with {W4A16_TWO_PASS_MIN_ROWS} <= {plan.rows} < "
                    f"{top} activation rows: the E2M1 decode inside the GEMM's K loop (WGMMA with "
                    f"the decoded tile in registers), {how}, {plan.mgpu_cfg}")
        if plan.kind == "two-pass" and not problem.has_float_operand:
            return (f"two-pass a4w4 (M={problem.m} and N={problem.n} both > {A4W4_MAX_SMALL_SIDE}): both operands "
                    f"decoded to bfloat16 once ({decode} decode), then XLA's bfloat16 GEMM" + _converted_note(problem))
        if plan.kind == "two-pass":
            return (f"two-pass w4a16: {plan.rows} activation rows >= {W4A16_TWO_PASS_MIN_ROWS}, weight decoded "
                    f"to bfloat16 once ({decode} decode), then XLA's bfloat16 GEMM" + _converted_note(problem))
        what = "w4a16" if problem.has_float_operand else "a4w4 with the small side dequantized to bfloat16"
        if plan.kind == "mosaic":
            scales = ("weight from prepare_decode read as stored, no per-call conversion"
                      + (f" (its \"{plan.mgpu_cfg.decode}\" byte order: x read as it is)"
                         if plan.mgpu_cfg.decode == "lanes" else "")
                      if plan.w_prepared else
                      "E8M0 scales transposed to K-major per call, and the packed data too unless the weight is stored "
                      "K-last (prepare_decode does both once)")
            return f"Mosaic GPU kernel (WGMMA, decoded weight in registers), {what}, {scales}, {plan.mgpu_cfg}"
        from ..kernels.wgemm import default_wconfig

        cfg = default_wconfig(plan.rows, plan.wrows, problem.k, problem.batch, decode=decode)
        return f"weight-stationary kernel, {what}, {decode} E2M1 decode, {cfg}" + _converted_note(problem)

    def takes_decode_prepared(self, problem: GemmProblem) -> tuple[bool, bool]:
        """The weight side of the Mosaic GPU route, when it is a DecodePrepared (read as stored)."""
        plan = _plan(problem)
        if plan.kind not in ("mosaic", "tiles"):
            return (False, False)
        return (plan.swap and problem.lhs_decode_prepared, not plan.swap and problem.rhs_decode_prepared)

    def gemm(self, lhs, rhs, problem: GemmProblem) -> jax.Array:
        return _weight_stationary(lhs, rhs, problem, _plan(problem))


def _converted_note(problem: GemmProblem) -> str:
    if not (problem.lhs_decode_prepared or problem.rhs_decode_prepared):
        return ""
    return ("; the DecodePrepared operand is converted back per call (to_mxfp4: a scales transpose), "
            "only the Mosaic GPU route reads it as stored")


MIN_CUDA_CAPABILITY = (8, 0)
"""The weight-stationary kernels multiply bfloat16 tiles on tensor cores: Ampere (sm_80) and later.
On Turing ptxas emulates the bfloat16 arithmetic (the decode pass spills registers there,
tests/test_cuda_compile.py) and XLA's GEMM of the exact path is the better route."""


def cuda_capability_reason(platform: str) -> str | None:
    """Why the kernels of this module and :mod:`jax_mxfp4.backends.grouped` skip this CUDA GPU
    (compute capability below :data:`MIN_CUDA_CAPABILITY`), else None (also where unknown)."""
    from .fp8 import _compute_capability

    capability = _compute_capability() if platform == "cuda" else None
    if capability is not None and tuple(capability) < MIN_CUDA_CAPABILITY:
        return (f"the Pallas kernels need bfloat16 tensor cores (compute capability >= "
                f"{MIN_CUDA_CAPABILITY[0]}.{MIN_CUDA_CAPABILITY[1]}); this GPU is {capability[0]}.{capability[1]}")
    return None


def decode_for(platform: str) -> str:
    """E2M1 decode of the weight-stationary kernels on ``platform``: inline PTX on a CUDA GPU of
    compute capability >= :data:`jax_mxfp4.kernels.e2m1_asm.MIN_COMPUTE_CAPABILITY` (its
    ``mul.rn.bf16x2`` needs sm_90), the portable float16-bits decode (the same values) elsewhere:
    Ampere and Ada GPUs, ROCm's Triton, the CPU interpreter, and a CUDA lowering made where no
    CUDA device is visible (its decode then assembles for any GPU of compute capability 8.0 or later)."""
    from ..kernels import e2m1_asm
    from .fp8 import _compute_capability

    if platform != "cuda" or e2m1_asm.LOWERING_ERROR is not None:
        return "f16"
    capability = _compute_capability()
    return "asm" if capability is not None and tuple(capability) >= e2m1_asm.MIN_COMPUTE_CAPABILITY else "f16"


def _decoded_bf16(w: MXFP4Array, platform: str) -> jax.Array:
    """The MXFP4 operand [B, R, K] as bfloat16, exactly: one fused decode pass where the tile
    divides it (in the Pallas interpreter on CPU), else the jnp dequantization (which XLA fuses)."""
    from ..kernels.wgemm import decode_to_bf16
    from ..quantize import dequantize

    b, r, k = w.shape
    bk = next((t for t in (512, 256, 128, 64) if k % t == 0), None)
    if bk is None or (b * r) % 64:
        return dequantize(w, jnp.bfloat16)
    flat = decode_to_bf16(w.data.reshape(b * r, k // 2), as_scale_bytes(w.plain_scales()).reshape(b * r, -1),
                          decode=decode_for(platform), bk=bk, interpret=platform == "cpu")
    return flat.reshape(b, r, k)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Which path of this backend a problem takes (the one place that decides it): ``kind``
    "tiles" (large-M w4a16 on Hopper: the large-tile Mosaic GPU kernel), "two-pass" (other
    large-M w4a16 on a GPU, and a4w4 with both sides large on every platform), "mosaic" (the decode-size Mosaic GPU kernel) or "triton" (the weight-stationary kernel);
    ``swap``: the lhs is the weight (the side decoded in the K loop); ``rows``/``wrows``:
    activation / weight rows; ``mgpu_cfg``: the MgpuConfig of "mosaic", the TilesConfig of
    "tiles"; ``w_prepared``: the weight is a DecodePrepared (read as stored on "mosaic" and
    "tiles")."""

    kind: str
    swap: bool = False
    rows: int = 0
    wrows: int = 0
    mgpu_cfg: object = None
    w_prepared: bool = False


def _plan(problem: GemmProblem) -> _Plan:
    if not (problem.has_float_operand or min(problem.m, problem.n) <= A4W4_MAX_SMALL_SIDE):
        return _Plan("two-pass", False, problem.m, problem.n)
    # w4a16: the float operand plays x; a4w4: the smaller side does (dequantized to bfloat16)
    swap = problem.lhs_kind != "float" if problem.has_float_operand else problem.m > problem.n
    rows, wrows = (problem.n, problem.m) if swap else (problem.m, problem.n)
    w_order = problem.lhs_decode_prepared if swap else problem.rhs_decode_prepared  # False, or the byte order
    w_prepared = bool(w_order)
    if problem.has_float_operand and rows >= W4A16_TWO_PASS_MIN_ROWS and problem.platform != "cpu":
        tcfg = _tiles_config(problem, rows, wrows, w_order)
        if tcfg is not None:
            return _Plan("tiles", swap, rows, wrows, tcfg, w_prepared)
        return _Plan("two-pass", swap, rows, wrows, None, w_prepared)
    mcfg = _mosaic_gpu_config(problem, rows, wrows, w_order or "natural")
    return _Plan("mosaic" if mcfg is not None else "triton", swap, rows, wrows, mcfg, w_prepared)


def _mosaic_gpu_config(problem: GemmProblem, rows: int, wrows: int, w_order: str):
    """The Mosaic GPU kernel's config where ``W4A16_MOSAIC_GPU`` routes this problem to it, else
    None: CUDA, device 0 of compute capability 9.0 (WGMMA), and a shape it takes. a4w4 problems
    come here with their small side already dequantized exactly to bfloat16 (the same input the
    Triton weight-stationary kernel gets), so the kernel serves both. ``w_order``: the weight's
    byte order ("lanes" for a DecodePrepared from prepare_decode), which picks the decode."""
    if problem.platform != "cuda" or not mosaic_w4a16_enabled():
        return None
    from ..kernels import wgemm_mgpu
    from .fp8 import _compute_capability

    if _compute_capability() != (9, 0) or wgemm_mgpu.unsupported_reason(rows, wrows, problem.k):
        return None
    return wgemm_mgpu.default_mgpu_config(rows, wrows, problem.k, w_order)


def _tiles_config(problem: GemmProblem, rows: int, wrows: int, w_order):
    """The large-tile Mosaic GPU kernel's tiling (:mod:`jax_mxfp4.kernels.wgemm_tiles_mgpu`: the
    decode inside the GEMM's K loop) where it takes this many-row w4a16 problem, else None: CUDA
    device 0 of compute capability 9.0, the Mosaic switch on (``W4A16_MOSAIC_GPU``), fewer than
    ``W4A16_TILES_MAX_ROWS`` activation rows (``W4A16_TILES_PLAIN_MAX_ROWS`` for natural bytes)
    and a shape it tiles. ``w_order``: the byte order of
    a DecodePrepared weight (read as stored; "lanes", prepare_decode's default, takes the "lanes"
    decode), False for a plain MXFP4Array (its natural bytes: the "natural" decode, which moves
    them to the "pairs" order in registers, so neither operand is rearranged per call; only the
    E8M0 scales are transposed to K-major, N x K/32 bytes). Arranging a plain weight per call
    outside the kernel cost more than the two-pass decode pass (docs/performance.md)."""
    order = w_order or "natural"  # False: a plain MXFP4Array's natural bytes
    if rows >= _tiles_max_rows(order) or problem.platform != "cuda" or not mosaic_w4a16_enabled():
        return None
    from ..kernels import wgemm_tiles_mgpu
    from .fp8 import _compute_capability

    if _compute_capability() != (9, 0):
        return None
    return wgemm_tiles_mgpu.default_tiles_config(rows, wrows, problem.k, problem.out_dtype, order)


def _weight_stationary(lhs, rhs, problem: GemmProblem, plan: _Plan | None = None) -> jax.Array:
    """w4a16, and a4w4 with one small side: the MXFP4 operand with more rows is the weight
    (decoded inside the kernel's K loop); the other side is bfloat16 (a4w4: its exact dequantized
    values, a small array by construction). Large-M w4a16 decodes the weight once instead and
    runs XLA's bfloat16 GEMM (``W4A16_TWO_PASS_MIN_ROWS``), as does a4w4 with both sides large
    after decoding both operands. ``plan``: :func:`_plan` of the problem (computed if None)."""
    from ..kernels.wgemm import default_wconfig, weight_stationary_gemm
    from ..quantize import dequantize

    plan = plan or _plan(problem)
    x, w = (rhs, lhs) if plan.swap else (lhs, rhs)
    x = _plain(x)
    if isinstance(x, MXFP4Array):  # a4w4 two-pass: both sides large, each decoded by one pass
        x = _decoded_bf16(x, problem.platform) if plan.kind == "two-pass" else dequantize(x, jnp.bfloat16)
    x = x.astype(jnp.bfloat16)
    if plan.kind not in ("mosaic", "tiles"):
        w = _plain(w)  # only the Mosaic GPU routes read a DecodePrepared as stored
    if plan.kind == "two-pass":
        wf = _decoded_bf16(w, problem.platform)
        # the GEMM writes bfloat16 / float32 itself (one rounding of its float32 accumulator, as a
        # float32 result then cast), saving a separate cast pass; float16 output through float32
        pet = problem.out_dtype if problem.out_dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)) else jnp.float32
        out = jax.lax.dot_general(x, wf, (((2,), (2,)), ((0,), (0,))),
                                  preferred_element_type=pet).astype(problem.out_dtype)
    elif plan.kind == "tiles":  # data [B, N, K/2], K-major scales [B, K/32, N]
        from ..kernels.wgemm_tiles_mgpu import mgpu_w4a16_tiles

        if isinstance(w, DecodePrepared):  # read as stored
            sbytes, order = as_scale_bytes(w.scales), w.byte_order
        else:  # natural bytes as they are; the scales [B, N, K/32] transposed to K-major
            sbytes, order = jnp.swapaxes(as_scale_bytes(w.plain_scales()), 1, 2), "natural"
        out = jnp.stack([mgpu_w4a16_tiles(x[i], w.data[i], sbytes[i], problem.out_dtype, plan.mgpu_cfg,
                                          w_order=order) for i in range(problem.batch)])
    elif plan.kind == "mosaic":
        from ..kernels.wgemm_mgpu import mgpu_w4a16

        order = "natural"
        if isinstance(w, DecodePrepared):  # data [B, N, K/2] and K-major scales [B, K/32, N] as stored
            sbytes, form, order = as_scale_bytes(w.scales), "kmajor", w.byte_order
        else:
            sbytes, form = as_scale_bytes(w.plain_scales()), "rows"
        out = jnp.stack([mgpu_w4a16(x[i], w.data[i], sbytes[i], problem.out_dtype, plan.mgpu_cfg, scales_form=form,
                                    w_order=order) for i in range(problem.batch)])
    else:
        cfg = default_wconfig(plan.rows, plan.wrows, problem.k, problem.batch, decode=decode_for(problem.platform))
        out = weight_stationary_gemm(x, w.data, as_scale_bytes(w.plain_scales()), out_dtype=problem.out_dtype,
                                     cfg=cfg, interpret=problem.platform == "cpu")
    return jnp.swapaxes(out, 1, 2) if plan.swap else out
