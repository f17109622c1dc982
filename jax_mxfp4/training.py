"""Differentiable MXFP4 ``dot_general`` (custom VJP: MXFP4 fprop, dgrad and wgrad) and ``dense``.

For Y = X·W with X [M, K] (activations, the ``lhs``) and W [K, N] (the weight, the ``rhs``):

* **fprop**  Y  = X·W:   X and W quantized along K (round to nearest even),
* **dgrad**  dX = dY·Wᵀ: dY and W re-quantized along N (dY with ``Recipe.grad_rounding``),
* **wgrad**  dW = Xᵀ·dY: X and dY quantized along the token axis M (dY with
  ``Recipe.grad_rounding``).

Each pass named in ``Recipe.hadamard`` first rotates both of its operands along its contraction
(K, N or M) with the same blockwise random Hadamard transform (``Recipe.hadamard_block``;
:mod:`jax_mxfp4.hadamard`), which leaves the exact product unchanged.

**Higher-order derivatives** (gradient penalties, Hessian-vector products by reverse over
reverse): the backward passes are differentiated as the exact float products they approximate,
dA = dY·Bᵀ and dB = Aᵀ·dY (float32, ``Precision.HIGHEST``), at the saved float operands and the
incoming dY (:func:`jax_mxfp4.differentiation.straight_through`); the forward product keeps its
MXFP4 custom VJP at every order. E.g. for ``pen(w) = Σ (∂/∂w Σ y²)²``, y = x·w: ∂pen/∂w is the
MXFP4 VJP in w of 4·x·G, G the MXFP4 gradient. Forward mode (``jax.jvp``) raises JAX's
custom_vjp error. Differentiating ``quantize`` itself raises (the 4-bit codes would give zero).

The quantizers are treated as the identity in the backward pass (straight-through estimator):
the cotangents are computed from the float operands saved by the forward pass. Each pass may be
switched to bf16 (operands cast to bfloat16, float32 accumulation) with ``Recipe.fprop/dgrad/
wgrad = "bf16"``. General ``dimension_numbers`` are mapped onto the canonical batched form
[B, M, K] x [B, N, K] by transposes and reshapes (differentiated by JAX itself): batch dims give
B, the lhs free dims are flattened into M, the rhs free dims into N, the contracting dims into K.
The lhs gradient always uses the ``dgrad`` settings and the rhs gradient the ``wgrad`` settings
(Flax's convention: ``dot_general(inputs, kernel, ...)``).

Contraction lengths that are not a multiple of 32 are zero-padded inside (exact: a zero adds
nothing to a block's amax or to the dot product): N in dgrad, M in wgrad, and K in the forward of
:func:`dense` and the Flax layers (the public :func:`dot_general` asks for K % 32 == 0, as
:func:`jax_mxfp4.gemm.dot_general` does).

**Stochastic rounding keys.** With a ``key`` argument (:func:`dot_general`, :func:`dense`; the
Flax layers take it from an RNG stream) dgrad uses ``fold_in(key, 1)`` and wgrad
``fold_in(key, 2)``: pass a fresh key per step for noise that averages out over steps,
reproducible from the seed. Without one, the documented fallback derives the key from the data
(the same inputs always give the same gradients, and ``jax.checkpoint`` recomputation is
consistent, but the draw repeats whenever dY repeats):
``key = fold_in(fold_in(fold_in(key(0x4D584634), site), pass), hash32(dY))`` where ``site`` is
``zlib.crc32(repr((lhs.shape, rhs.shape, lhs_dtype_name, rhs_dtype_name, (lc, rc, lb, rb)))) &
0x7FFFFFFF`` (normalized contracting/batch dims; the call's static signature), ``pass`` is 1
for dgrad and 2 for wgrad, and ``hash32`` is a position-weighted wrapping sum of the float32 bit
patterns of dY (:func:`gradient_key`). The rounding noise therefore changes from step to step
with the data but never depends on global state. Any change of dY's bits (even one ulp, e.g.
from a different XLA fusion of the surrounding code under ``jit``) gives a fresh draw.

**Hadamard sign vectors** are fixed per call site and shared by both operands of the pass:
``numpy`` seed ``site`` for wgrad, ``crc32(repr((site, "dgrad")))`` for dgrad, and for fprop
:func:`jax_mxfp4.hadamard.weight_seed` of the rhs (the weight) alone, so that
:func:`jax_mxfp4.flax.quantize_params` can store kernels rotated exactly as training's forward
rotated them. An :class:`MXFP4Array` records its rotation (``MXFP4Array.hadamard``); a float
operand facing a rotated MXFP4Array is rotated the same way (:func:`jax_mxfp4.gemm.dot_general`),
and its gradient is pulled back through that rotation.

Sources: axis conventions of TransformerEngine's MX recipes (``mxfp8.rst``/``nvfp4.rst``);
stochastic rounding of the gradient operands and round-to-nearest for weights and activations as
in NVIDIA, "Pretraining Large Language Models with NVFP4" (arXiv 2509.25149) and Tseng et al.,
"Training LLMs with MXFP4" (arXiv 2502.20586), which also motivate the random Hadamard
transform on the wgrad operands. Measured effect of each option on a small LM: README and
``examples/train_lm.py``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero

from . import checks, dims, dispatch, gemm
from . import sharding as shd
from .array import MXFP4Array
from . import hadamard as hd
from .backends import fp8 as fp8_backend
from .decode_prepared import DecodePrepared
from .fp8_prepared import FP8Prepared, to_fp8
from .mx_format import BLOCK_SIZE
from .quantize import dequantize, fused_path, fused_rotation_path, quantize, quantize_rotated
from .platform import kernels_enabled
from .recipe import Recipe
from .differentiation import straight_through

ROOT_SEED = 0x4D584634  # "MXF4"
DGRAD_TAG, WGRAD_TAG = 1, 2
_CANON = (((2,), (2,)), ((0,), (0,)))

_FUSED_INTERPRET = False
"""Fused FP8 quantization of the training passes (:func:`_fused_route`): on CUDA the one-pass
fused kernel (:mod:`jax_mxfp4.kernels.fp8_quantize`) quantizes the stochastically rounded operand
quantized along rows (dY in dgrad, along N) straight to the FP8 operand; the others take the
unfused passes (the quantizer, then the fp8 backend's encode kernel): the round-to-nearest ones,
and dY in wgrad, whose token axis is strided (:func:`jax_mxfp4.backends.fp8.fused_operand`: the
strided-axis quantizer reads it in place). ``JAX_MXFP4_KERNELS=0``: every operand in the unfused
passes (the same bits). Why only the stochastic ones: on an NVIDIA H200 (jax 0.11.2, 2026-12-02)
the linear-layer training step at T = K = N = 8192 was ~1% faster so than with every operand
fused (the unfused passes round to nearest faster than the one-pass kernel; figures:
docs/performance.md).

This flag is for tests, not a user setting: True takes the same route off the GPU through the
Pallas interpreter."""


# ----------------------------------------------------------------------------- utilities
def _canonical(x, contracting, batch, pad_k: bool, name: str = "operand", kn: bool = False):
    """float x -> [B, F, K] (:func:`jax_mxfp4.dims.to_bfk`), K zero-padded to 32 if asked;
    ``kn``: -> [B, K, F] instead (the rhs of :func:`_kn_layout`: a reshape, no transpose)."""
    if kn:
        free = dims.free_dims(x.ndim, contracting, batch)
        x3 = dims.merge3(jnp.transpose(x, tuple(batch) + tuple(contracting) + free), len(batch), len(contracting))
        return _pad_axis(x3, 1) if pad_k else x3
    x3 = dims.to_bfk(x, contracting, batch, name)
    return _pad_axis(x3, 2) if pad_k else x3


def _kn_layout(rhs, contracting, batch) -> bool:
    """Whether the custom VJP holds the float rhs as [B, K, N] rather than the canonical [B, N, K]:
    where its contracting dims all precede its free dims (a Flax/``dense`` kernel [K, N]), outside
    explicit sharding (whose canonical shardings :func:`jax_mxfp4.dims.to_bfk` derives).

    Why: wgrad's GEMM then writes dW in the rhs's own layout ([B, K, N] = dW up to a reshape),
    where the canonical form made it [B, N, K] and XLA transposed it back to [K, N] afterwards (on
    the fp8 backend after the exact-row ``while_loop``, so the transpose could not be folded into
    the GEMM: one 8192 x 8192 bf16 transpose pass per step in the H200 profile of 2026-12-01).
    fprop and dgrad read the canonical ``swapaxes(b, 1, 2)``, the same operand as before."""
    free = dims.free_dims(len(rhs.shape), contracting, batch)
    return bool(free) and max(contracting) < min(free) and shd.explicit_spec(rhs) is None


def _out_sharding_3d(g, w, g_axis, w_axis):
    """Output sharding of a [B, ., .] x [B, ., .] contraction (batch dim 0) under an explicit mesh."""
    mesh, specs = shd.explicit_specs(g, w)
    if mesh is None:
        return None
    (gs, ws), g_free, w_free = specs, 3 - g_axis, 3 - w_axis  # the axis neither 0 nor the contraction
    return shd.named(
        mesh, *shd.canonical_out_spec((gs[0], gs[g_free], gs[g_axis]), (ws[0], ws[w_free], ws[w_axis]))
    )


def _pad_axis(x, axis):
    checks.check_concrete_block_dim(x.shape[axis], f"a contraction zero-padded to a multiple of {BLOCK_SIZE} (axis {axis})")
    extra = (-x.shape[axis]) % BLOCK_SIZE
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


_site_seed = hd.site_seed


def _check_hadamard_lengths(recipe: Recipe, m: int, n: int, k: int) -> None:
    """Every rotated MXFP4 pass's contraction (K; N and M padded to 32) must hold whole blocks."""
    pad = lambda v: -(-v // BLOCK_SIZE) * BLOCK_SIZE  # noqa: E731
    lengths = {"fprop": (k, "the fprop contraction K"),
               "dgrad": (pad(n), "the dgrad contraction N (rhs free dims, padded to a multiple of 32)"),
               "wgrad": (pad(m), "the wgrad contraction M (lhs free dims = tokens, padded to a multiple of 32)")}
    for name in recipe.hadamard_passes:
        # a symbolic N or M (shape polymorphism) is refused when the backward is traced
        if getattr(recipe, name) == "mxfp4" and not checks.is_symbolic(lengths[name][0]):
            hd.check_length(lengths[name][0], recipe.hadamard_block, f"Recipe.hadamard={recipe.hadamard_passes}: " + lengths[name][1])


def gradient_key(dy, site: int, tag: int):
    """The deterministic PRNG key for stochastic rounding of the gradient operand ``dy``.

    ``fold_in(fold_in(fold_in(key(ROOT_SEED), site), tag), h)`` with ``h`` the uint32 wrapping sum
    of ``bits(dy_i) * (0x9E3779B1 * i | 1)`` over the row-major float32 bit patterns of ``dy``.
    ``site``: CRC32 of the call's static signature; ``tag``: 1 (dgrad) or 2 (wgrad).
    Same ``dy``, ``site``, ``tag`` -> same key; works under ``jit``/``vmap`` (one key per example).
    """
    bits = lax.bitcast_convert_type(dy.astype(jnp.float32), jnp.uint32)
    # row-major position of every element, built without a reshape (sharding-friendly), mod 2^32
    spec = shd.explicit_spec(dy)
    iota_sharding = jax.typeof(dy).sharding if spec is not None else None
    pos = jnp.zeros(bits.shape, jnp.uint32)
    stride = 1
    for ax in reversed(range(bits.ndim)):
        iota = lax.broadcasted_iota(jnp.uint32, bits.shape, ax, out_sharding=iota_sharding)
        pos = pos + iota * jnp.uint32(stride & 0xFFFFFFFF)
        stride *= bits.shape[ax]
    weights = (pos * jnp.uint32(0x9E3779B1)) | jnp.uint32(1)
    h = jnp.sum(bits * weights, dtype=jnp.uint32)
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(ROOT_SEED), site), tag)
    return jax.random.fold_in(key, h)


def _bf16_gemm(a, b, dimension_numbers):
    (ac,), (bc,) = dimension_numbers[0]
    return lax.dot_general(
        a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), dimension_numbers, preferred_element_type=jnp.float32,
        out_sharding=_out_sharding_3d(a, b, ac, bc),
    )


# ----------------------------------------------------------------------------- fused FP8 passes
def _fused_route(x, y, p: gemm.GemmPlan):
    """None, or ``interpret`` (bool) for :func:`jax_mxfp4.backends.fp8.fused_operand`: the fused passes are taken for the
    stochastically rounded operands when the GEMM of these two float operands (its plan ``p``)
    routes to backend "fp8" on this platform (CUDA; any platform with :data:`_FUSED_INTERPRET`), outside any mesh,
    and (on CUDA) where :func:`jax_mxfp4.quantize.fused_path` takes the fused quantizer (size
    limit; custom kernels on, :func:`jax_mxfp4.platform.kernels_enabled`). Every other backend
    and platform keeps the unfused passes."""
    if not kernels_enabled():
        return None
    platform = dispatch.current_platform()
    interpret = _FUSED_INTERPRET
    # the kernel is a pallas_call, opaque to SPMD partitioning: under a mesh the unfused passes
    # run (as quantize's fused_path rules for the MXFP4 quantizer)
    if not interpret and (platform != "cuda" or not (fused_path(x) and fused_path(y))):
        return None
    if not shd.kernel_may_run(x, y):
        return None
    if p.backend_here != "fp8":
        return None
    return interpret and platform not in ("cuda", "rocm")


def _fp8_operand(x, axis, scale_mode, route, rounding="nearest", key=None, fmt="e4m3"):
    """The FP8-path operand of a canonical float x: the fused kernel's :class:`FP8Prepared`
    (:func:`jax_mxfp4.backends.fp8.fused_operand`, ``fmt`` codes) for a stochastically rounded operand where ``route`` (from
    :func:`_fused_route`) and the layout allow, else the unfused ``quantize`` (an MXFP4Array the
    fp8 backend encodes; :func:`_gradient_operand` encodes a gradient's). Same bits either way."""
    q = None
    if route is not None and rounding == "stochastic":
        q = fp8_backend.fused_operand(x, axis, scale_mode, route, rounding, key, fmt)
    return q if q is not None else quantize(x, axis, scale_mode=scale_mode, rounding=rounding, key=key)


def _gradient_operand(gq, p: gemm.GemmPlan):
    """The quantized gradient ``gq`` as the GEMM ``p`` takes it: on backend "fp8", E5M2 codes
    (:func:`jax_mxfp4.fp8_prepared.to_fp8`; the fused kernel's already are). Why: a gradient row's
    block scales spread wider than the 15 binades of E4M3 codes once a model trains (a softmax
    gradient's rows, a qkv gradient's rows across q, k and v: 15-27 binades measured on the main
    job, docs/performance.md), and such rows left the FP8 GEMM for the exact recompute; E5M2 codes
    hold 29 binades. Same values either way (every E2M1 value is exact in both formats)."""
    if p.backend_here != "fp8" or isinstance(gq, FP8Prepared):
        return gq
    return to_fp8(gq, "e5m2")


def _swap_quantized(q: MXFP4Array) -> MXFP4Array:
    """A 3-D MXFP4Array [B, R, C] (plain scales) as [B, C, R]: its data and scales transposed (bytes)."""
    bsz, r, c = q.shape
    return MXFP4Array(jnp.swapaxes(q.data, 1, 2), jnp.swapaxes(q.plain_scales(), 1, 2), 3 - q.axis, (bsz, c, r),
                      q.dtype, q.scale_mode, "plain")


def _quantize_weight(w_kn, axis, scale_mode):
    """``quantize(swapaxes(w_kn, 1, 2), axis)`` (round to nearest) of a weight held as [B, K, N]
    (:func:`_kn_layout`), computed as the held array quantized along the same logical axis (3 -
    ``axis``) with the result's bytes swapped: the same bits, and no float transpose of the
    weight (:func:`jax_mxfp4.quantize` reads its input in place along either axis; on the GPU the
    row kernel or :mod:`jax_mxfp4.kernels.quantize_columns`, where a transposed input was
    materialized by XLA)."""
    return _swap_quantized(quantize(w_kn, 3 - axis, scale_mode=scale_mode))


def _fprop(a, b, recipe: Recipe, out_dtype, fprop_seed, b_kn=False):
    """Canonical forward: a [B, M, K] x b [B, N, K] -> [B, M, N] in ``out_dtype`` (b given as
    [B, K, N] with ``b_kn``)."""
    held, b = b, _nk(b, b_kn)
    if b_kn and recipe.fprop == "mxfp4" and "fprop" not in recipe.hadamard_passes:
        # the weight quantized in its held layout (no float transpose); the activation as below
        p = _plan(a, b, _CANON, out_dtype, recipe)
        route = _fused_route(a, b, p)
        a = _fp8_operand(a, 2, recipe.scale_mode, route) if route is not None else a
        return gemm.execute(a, _quantize_weight(held, 2, recipe.scale_mode), p)
    if recipe.fprop == "bf16":
        return _bf16_gemm(a, b, _CANON).astype(out_dtype)
    if "fprop" in recipe.hadamard_passes:
        h = (recipe.hadamard_block, fprop_seed)
        if recipe.quantize_activations and fused_rotation_path(a) and fused_rotation_path(b):
            # GPU: rotation fused into the quantizer pass; dot_general would quantize the rotated
            # float32 operands exactly so (along K, recipe.scale_mode, nearest, plain scales).
            a = quantize_rotated(a, 2, h, scale_mode=recipe.scale_mode)
            b = quantize_rotated(b, 2, h, scale_mode=recipe.scale_mode)
        else:
            a = hd.random_hadamard_transform(a, 2, fprop_seed, recipe.hadamard_block)
            b = hd.random_hadamard_transform(b, 2, fprop_seed, recipe.hadamard_block)
    p = _plan(a, b, _CANON, out_dtype, recipe)
    route = _fused_route(a, b, p) if "fprop" not in recipe.hadamard_passes else None
    if route is not None:
        a = _fp8_operand(a, 2, recipe.scale_mode, route)
        b = _fp8_operand(b, 2, recipe.scale_mode, route)
    return gemm.execute(a, b, p)


def _plan(a, b, contraction, out_dtype, recipe: Recipe) -> gemm.GemmPlan:
    """The plan of one canonical GEMM of the training passes (validated and dispatched once)."""
    return gemm.plan(gemm.abstract(a), gemm.abstract(b), contraction, out_dtype, recipe)


def _grad_gemm(g, w, g_axis, w_axis, precision, key, recipe: Recipe, hadamard_seed=None,
               grad_dtype=jnp.float32, w_first=False, w_kn=None):
    """Contract g (the incoming gradient) along ``g_axis`` with w along ``w_axis``, batch dim 0:
    [B, g free, w free], or with ``w_first`` [B, w free, g free] (w is then the GEMM's lhs and g
    its rhs: the same quantized operands and products, the output in the other layout).

    Returns float32, or ``grad_dtype`` (the dtype the caller casts the gradient to) on the fused
    FP8 route: the fp8 backend rounds its float32 result to it once, so the value is that of the
    float32 result cast to ``grad_dtype``, without writing and reading a float32 [M, N] array.

    MXFP4: both padded along the contraction to a multiple of 32, optionally Hadamard-transformed,
    g quantized with ``recipe.grad_rounding`` (key ``key``), w with round-to-nearest-even.
    ``w_kn``: w's held [B, K, N] form (w = its swapaxes; :func:`_quantize_weight`), or None.
    """
    contraction = (((g_axis,), (w_axis,)), ((0,), (0,)))
    if precision == "bf16":  # XLA's own dot, which folds the swap into the dot's layout
        out = _bf16_gemm(g, w, contraction)
        return jnp.swapaxes(out, 1, 2) if w_first else out
    # Under an explicit mesh a contraction whose shards would split a (padded) 32-block is
    # regathered first, as XLA does on an Auto mesh (e.g. 48 or 100 tokens per device in wgrad).
    padded = -(-g.shape[g_axis] // BLOCK_SIZE) * BLOCK_SIZE
    g, w = shd.gather_partial_blocks(g, g_axis, padded), shd.gather_partial_blocks(w, w_axis, padded)
    g, w = _pad_axis(g, g_axis), _pad_axis(w, w_axis)
    rounding = recipe.grad_rounding
    gkey = key if rounding == "stochastic" else None
    order = (lambda p, q: (q, p)) if w_first else (lambda p, q: (p, q))  # noqa: E731  -> (lhs, rhs)
    dims_ = (order((g_axis,), (w_axis,)), ((0,), (0,)))
    if hadamard_seed is not None:  # one fused rotate+quantize pass on GPUs (quantize_rotated)
        h = (recipe.hadamard_block, hadamard_seed)
        gq = quantize_rotated(g, g_axis, h, scale_mode=recipe.scale_mode, rounding=rounding, key=gkey)
        wq = quantize_rotated(w, w_axis, h, scale_mode=recipe.scale_mode)
        p = _plan(*order(gq, wq), dims_, jnp.float32, recipe)
        return gemm.execute(*order(_gradient_operand(gq, p), wq), p)
    p = _plan(*order(g, w), dims_, grad_dtype, recipe)
    route = _fused_route(*order(g, w), p)
    gq = _gradient_operand(_fp8_operand(g, g_axis, recipe.scale_mode, route, rounding, gkey, "e5m2"), p)
    if w_kn is not None:  # round to nearest: what _fp8_operand gives, from the held layout
        wq = _quantize_weight(_pad_axis(w_kn, 3 - w_axis), w_axis, recipe.scale_mode)
    else:
        wq = _fp8_operand(w, w_axis, recipe.scale_mode, route)
    # On backend "fp8" the GEMM writes ``grad_dtype`` directly (the float32 result rounded once,
    # the caller's cast: same value) instead of a float32 [M, N] array cast afterwards.
    if p.backend_here != "fp8":
        p = p.with_out_dtype(jnp.float32)
    return gemm.execute(*order(gq, wq), p)


def rounding_key(key, dy, site: int, tag: int):
    """The key for stochastic rounding of ``dy`` in pass ``tag`` (1 dgrad, 2 wgrad):
    ``fold_in(key, tag)`` for a caller's ``key``, else the data-derived :func:`gradient_key`."""
    if key is None:
        return gradient_key(dy, site, tag)
    return jax.random.fold_in(key, tag)


def _check_static_backward(dy):
    """ValueError naming shape polymorphism for a symbolic dY: wgrad contracts over the tokens M
    and dgrad over N (zero-padded to 32-blocks), and the rounding key hashes dY's positions."""
    if any(checks.is_symbolic(d) for d in dy.shape):
        raise ValueError(
            f"differentiating jax_mxfp4.dot_general with symbolic dims (shape polymorphism: jax.export with "
            f"symbolic shapes; dY has shape {tuple(dy.shape)}) is not supported: the backward passes contract "
            "over the token and output dims, which must be concrete; export the forward pass only, or export "
            "the training step with concrete shapes")


def _dgrad(dy, b, recipe: Recipe, site: int, key=None, grad_dtype=jnp.float32, b_kn=False):
    """dA [B, M, K] = dY [B, M, N] · b [B, N, K], contracted along N (float32; ``grad_dtype`` on the fused FP8 route).
    ``b_kn``: b is given as [B, K, N] (:func:`_kn_layout`)."""
    _check_static_backward(dy)
    sr = recipe.dgrad == "mxfp4" and recipe.grad_rounding == "stochastic"
    key = rounding_key(key, dy, site, DGRAD_TAG) if sr else None
    seed = _site_seed(site, "dgrad") if "dgrad" in recipe.hadamard_passes else None
    w_kn = b if (b_kn and seed is None) else None
    return _grad_gemm(dy, _nk(b, b_kn), 2, 1, recipe.dgrad, key, recipe, hadamard_seed=seed, grad_dtype=grad_dtype,
                      w_kn=w_kn)


def _wgrad(dy, a, recipe: Recipe, site: int, key=None, grad_dtype=jnp.float32, kn=False):
    """dB [B, N, K] = dYᵀ · a, both [B, M, ·], contracted along the token axis M (float32; ``grad_dtype`` on the fused FP8 route).
    ``kn``: dB as [B, K, N] = aᵀ · dY (:func:`_kn_layout`), the GEMM's own output layout."""
    _check_static_backward(dy)
    mx = recipe.wgrad == "mxfp4"
    key = rounding_key(key, dy, site, WGRAD_TAG) if mx and recipe.grad_rounding == "stochastic" else None
    seed = site if (mx and "wgrad" in recipe.hadamard_passes) else None
    return _grad_gemm(dy, a, 1, 1, recipe.wgrad, key, recipe, hadamard_seed=seed, grad_dtype=grad_dtype, w_first=kn)


def _exact_gemm(g, w, g_axis, w_axis, w_first=False):
    """The float32 (HIGHEST) product :func:`_grad_gemm` approximates: the derivative of the
    backward passes (:func:`jax_mxfp4.differentiation.straight_through`)."""
    contraction = (((g_axis,), (w_axis,)), ((0,), (0,)))
    out = lax.dot_general(g, w, contraction, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32,
                          out_sharding=_out_sharding_3d(g, w, g_axis, w_axis))
    return jnp.swapaxes(out, 1, 2) if w_first else out


def _materialize(dy):
    if isinstance(dy, SymbolicZero):
        return jnp.zeros(dy.shape, dy.dtype)
    return dy


# ----------------------------------------------------------------------------- float x float
# ``key`` (a PRNG key or None) is a primal argument with no cotangent: it may be a tracer.
# ``b_kn``: ``b`` is held as [B, K, N] (:func:`_kn_layout`), else canonical [B, N, K].
@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6))
def _mx_gemm(a, b, recipe, out_dtype, site, fprop_seed, b_kn, key):
    return _fprop(a, b, recipe, out_dtype, fprop_seed, b_kn)


def _nk(b, b_kn):
    """The canonical [B, N, K] rhs (a [B, K, N] one swapped; XLA cancels the swap against the
    transposes the passes apply to the weight, as it did with the canonical form)."""
    return jnp.swapaxes(b, 1, 2) if b_kn else b


def _mx_gemm_fwd(a, b, recipe, out_dtype, site, fprop_seed, b_kn, key):
    # the primal through _mx_gemm itself: an outer jax.grad then takes this custom VJP, not the
    # quantizer's zero derivative (higher-order differentiation)
    return _mx_gemm(a, b, recipe, out_dtype, site, fprop_seed, b_kn, key), (a, b, key)


def _mx_gemm_bwd(recipe, out_dtype, site, fprop_seed, b_kn, res, dy):
    a, b, key = res

    def quantized(args, key):
        dy, a, b = args
        da = shd.like(_dgrad(dy, b, recipe, site, key, grad_dtype=a.dtype, b_kn=b_kn).astype(a.dtype), a)
        db = shd.like(_wgrad(dy, a, recipe, site, key, grad_dtype=b.dtype, kn=b_kn).astype(b.dtype), b)
        return da, db

    def exact(args):
        dy, a, b = args
        return (_exact_gemm(dy, _nk(b, b_kn), 2, 1).astype(a.dtype),
                _exact_gemm(dy, a, 1, 1, w_first=b_kn).astype(b.dtype))

    return (*straight_through(quantized, exact)((dy, a, b), key), None)


_mx_gemm.defvjp(_mx_gemm_fwd, _mx_gemm_bwd)


# ----------------------------------------------------------------------------- with MXFP4Array
_QUANTIZED = (MXFP4Array, FP8Prepared, DecodePrepared)


def _as_float(x):
    if isinstance(x, (FP8Prepared, DecodePrepared)):
        return x.dequantize(jnp.float32)
    return dequantize(x, jnp.float32) if isinstance(x, MXFP4Array) else x


# ``p``: the forward GEMM's plan (:func:`jax_mxfp4.gemm.plan`), made once by :func:`_dot_general`.
@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _mixed_gemm(lhs, rhs, p, site, key):
    return gemm.execute(*gemm.match_rotation(lhs, rhs, _dimension_numbers(p)), p)


def _dimension_numbers(p):
    lc, rc, lb, rb = p.dims
    return ((lc, rc), (lb, rb))


def _mixed_fwd(lhs, rhs, p, site, key):
    values = []
    for name, arg in (("lhs", lhs), ("rhs", rhs)):
        is_mx = isinstance(arg, _QUANTIZED)
        leaves = jax.tree_util.tree_leaves(arg) if is_mx else [arg]
        if is_mx and any(leaf.perturbed for leaf in leaves):
            raise ValueError(
                f"jax_mxfp4.dot_general: a gradient with respect to {name}, an MXFP4Array, was "
                "requested. Pre-quantized MXFP4Arrays are for inference only (the 4-bit codes and "
                "E8M0 scales are not differentiable); differentiate with respect to the float "
                "weights instead and let dot_general quantize them (Recipe.fprop='mxfp4'), or "
                "close over the MXFP4Array so that only the float operand is differentiated"
            )
        values.append(jax.tree_util.tree_map(lambda p: p.value, arg) if is_mx else arg.value)
    lhs_v, rhs_v = values
    key_v = key.value if key is not None else None
    # through _mixed_gemm itself: an outer jax.grad takes this custom VJP (higher-order differentiation)
    y = _mixed_gemm(lhs_v, rhs_v, p, site, key_v)
    return y, (lhs_v, rhs_v, key_v)


def _mixed_bwd(p, site, res, dy):
    lhs, rhs, key = res
    recipe, dimension_numbers = p.recipe, _dimension_numbers(p)
    dy = _materialize(dy)
    lc, rc, lb, rb = p.dims
    lf, rf = _as_float(lhs), _as_float(rhs)
    a = _canonical(lf, lc, lb, pad_k=False)
    b = _canonical(rf, rc, rb, pad_k=False)
    dy3 = dims.merge3(dy, len(lb), len(dims.free_dims(lf.ndim, lc, lb)))  # [B, M, N]
    rhs_kn = not isinstance(rhs, _QUANTIZED) and _kn_layout(rhs, rc, rb)

    def grad_of(x, contracting, batch, canonical_grad, side, kn=False):
        # no gradient for a pre-quantized operand; else pull the canonical [B, F, K] gradient
        # ([B, K, F] with ``kn``) back through the transpose/reshape (and the Hadamard rotation
        # matching a rotated MXFP4Array operand, gemm.match_rotation) onto x's logical shape
        if isinstance(x, _QUANTIZED):
            return None

        def to_canonical(v):
            pair = gemm.match_rotation(v, rhs, dimension_numbers) if side == 0 else gemm.match_rotation(lhs, v, dimension_numbers)
            return _canonical(pair[side], contracting, batch, pad_k=False, kn=kn)

        x3, pull = jax.vjp(to_canonical, x)
        return shd.like(pull(shd.like(canonical_grad().astype(x3.dtype), x3))[0].astype(x.dtype), x)

    # straight-through: the quantized gradients, differentiated as the float products
    dgrad = straight_through(lambda args, k: _dgrad(*args, recipe, site, k),
                             lambda args: _exact_gemm(*args, 2, 1))
    wgrad = straight_through(lambda args, k: _wgrad(*args, recipe, site, k, kn=rhs_kn),
                             lambda args: _exact_gemm(*args, 1, 1, w_first=rhs_kn))
    return (grad_of(lhs, lc, lb, lambda: dgrad((dy3, b), key), 0),
            grad_of(rhs, rc, rb, lambda: wgrad((dy3, a), key), 1, rhs_kn), None)


_mixed_gemm.defvjp(_mixed_fwd, _mixed_bwd, symbolic_zeros=True)


# ----------------------------------------------------------------------------- public API
def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                out_sharding=None, *, recipe=None, key=None):
    """Differentiable MXFP4 ``jax.lax.dot_general`` (same signature; drop-in for Flax layers).

    Forward (fprop): both float operands quantized to MXFP4 along their contracting dim(s) and
    multiplied by the backend chosen by ``recipe.backend`` (see :func:`jax_mxfp4.explain`).
    Backward: custom VJP with MXFP4 dgrad and wgrad as described in :mod:`jax_mxfp4.training`
    (re-quantization along N and along the token axis M, stochastic rounding of dY with ``key``
    or a data-derived key, straight-through quantizers). ``recipe.hadamard`` rotates both operands
    of the chosen passes along their contraction first (``recipe.hadamard_block``). Works under
    ``jit``, ``vmap``, ``lax.scan`` and ``jax.checkpoint``.

    Args:
      lhs: float32/bfloat16/float16 array (the activations), or an :class:`MXFP4Array`
        quantized along its single contracting dim (forward only).
      rhs: same for the weight (e.g. a Flax kernel [K, N]).
      dimension_numbers: ``((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch))`` as in
        ``jax.lax.dot_general``; the total contracting length K must be a multiple of 32
        (:func:`dense` and the :mod:`jax_mxfp4.flax` layers zero-pad any K for you). The
        backward passes pad their own contractions (N, M) as needed.
      precision: the numerics contract of all three GEMMs, tightening ``recipe.precision``
        (the stricter counts): None/``DEFAULT`` lets backend "fp8" use FP8 tensor cores with
        hardware accumulation, ``HIGH`` turns fast accumulation off, ``HIGHEST`` keeps exact
        block products with float32 accumulation (README "FP8 path").
      preferred_element_type: output dtype: float32, bfloat16 or float16. None (default): what
        ``jax.lax.dot_general`` returns for these operand dtypes (an MXFP4Array counts as its
        logical dtype): bfloat16 x bfloat16 -> bfloat16, float32 with anything -> float32, so
        ``flax.linen.Dense(dtype=jnp.bfloat16, dot_general=jax_mxfp4.dot_general)`` keeps bf16
        activations as Flax's own Dense does. Accumulation is float32 either way.
      out_sharding: as in ``jax.lax.dot_general`` (``nnx.Linear`` passes it): the output's
        sharding (a ``NamedSharding``, or a ``PartitionSpec`` inside ``jax.set_mesh``), applied
        with ``jax.sharding.reshard``. By default, under an explicit-sharding mesh, the output
        keeps the operands' batch/free-dim shardings and a sharded K is reduced (each K shard must
        hold whole 32-element blocks); see :mod:`jax_mxfp4.sharding`.
      recipe: :class:`jax_mxfp4.Recipe`; default ``Recipe()`` (all three passes MXFP4,
        stochastic rounding of dY, no Hadamard, scale rule "even", backend "auto").
      key: optional ``jax.random`` key (typed or legacy uint32[2]) for the stochastic rounding of
        dY in the backward pass: dgrad uses ``fold_in(key, 1)``, wgrad ``fold_in(key, 2)``. Pass a
        fresh key per step (e.g. ``fold_in(seed_key, step)``) and a distinct one per call site
        for noise that averages out over steps and is reproducible from the seed. None (default):
        the documented fallback, a key derived from dY's bits and the call site
        (:func:`gradient_key`), which repeats whenever dY repeats.

    Returns:
      ``lax.dot_general``'s output shape (batch dims, lhs free dims, rhs free dims). Gradients
      have the operands' dtypes.

    Raises:
      ValueError: malformed ``dimension_numbers`` or no contracting dim; K not a multiple of
        32; a rotated pass whose contraction is not a multiple of ``recipe.hadamard_block``
        (K for fprop; N and M, padded to 32, for dgrad and wgrad); an MXFP4Array not
        quantized along its single contracting dim or with K not matching; a gradient requested
        with respect to an MXFP4Array operand (at differentiation time); unsupported output dtype.
      TypeError: an operand that is neither float nor MXFP4Array; a ``recipe`` that is not a
        Recipe; shape mismatches (``lax.dot_general``'s shape rule).
      TypeError: ``key`` not one PRNG key (``jax.random.key`` or a legacy uint32[2] key).
      ValueError: under ``jax.export`` shape polymorphism, a symbolic contracting dim, a symbolic
        weight with "fprop" in ``recipe.hadamard``, or differentiation with symbolic dims (the
        backward passes contract over them); symbolic batch and free dims export (backend "xla").
      BackendUnavailableError: the requested backend cannot compute a GEMM (or, for symbolic
        dims, is not backend "xla").

    Higher-order derivatives (``jax.grad`` of a function of gradients: gradient penalties,
    Hessian-vector products by reverse over reverse) differentiate the backward passes as the
    exact float products they approximate (module docstring of :mod:`jax_mxfp4.training`).
    """
    out = _dot_general(lhs, rhs, dimension_numbers, preferred_element_type, recipe, pad_k=False, key=key,
                       precision=precision)
    if out_sharding is not None:
        out = jax.sharding.reshard(out, out_sharding)
    return out


def with_precision(recipe, precision):
    """``recipe`` (validated) whose precision is tightened by a ``lax.dot_general``-style
    ``precision`` argument: the stricter of the two counts (README "FP8 path")."""
    recipe = dims.check_recipe(recipe)
    if precision is None:
        return recipe
    return recipe.replace(precision=checks.stricter_precision(checks.canonical_precision(precision), recipe.precision))


def _dot_general(lhs, rhs, dimension_numbers, preferred_element_type, recipe, *, pad_k: bool, key=None,
                 precision=None):
    """:func:`dot_general`; ``pad_k=True`` zero-pads a float x float contraction to 32 (dense, layers).
    The one place that validates the recipe of a call (every public entry point comes here)."""
    recipe = with_precision(recipe, precision)
    if key is not None:
        checks.check_rounding("stochastic", key)  # one PRNG key
    if isinstance(lhs, _QUANTIZED) or isinstance(rhs, _QUANTIZED):
        for name, x in (("lhs", lhs), ("rhs", rhs)):
            if not isinstance(x, _QUANTIZED):
                checks.check_float_input(x, name)
        out_dtype = checks.dot_output_dtype(preferred_element_type, lhs.dtype, rhs.dtype)
        p = gemm.plan(*gemm.match_rotation(gemm.abstract(lhs), gemm.abstract(rhs), dimension_numbers),
                      dimension_numbers, out_dtype, recipe)
        lc, rc, lb, rb = p.dims
        _, m, k = dims.canonical_sizes(lhs.shape, lc, lb)
        _check_hadamard_lengths(recipe.replace(hadamard=tuple(p for p in recipe.hadamard_passes if p != "fprop")),
                                m, dims.canonical_sizes(rhs.shape, rc, rb)[1], k)
        site = _site_seed(lhs.shape, rhs.shape, str(jnp.dtype(lhs.dtype)), str(jnp.dtype(rhs.dtype)), (lc, rc, lb, rb))
        return _mixed_gemm(lhs, rhs, p, site, key)
    checks.check_float_input(lhs, "lhs")
    checks.check_float_input(rhs, "rhs")
    out_dtype = checks.dot_output_dtype(preferred_element_type, lhs.dtype, rhs.dtype)
    lc, rc, lb, rb, out_shape = dims.parse_dimension_numbers(dimension_numbers, jnp.shape(lhs), jnp.shape(rhs))
    if not pad_k:
        dims.check_block_k(math.prod(lhs.shape[d] for d in lc), lc)
    site = _site_seed(lhs.shape, rhs.shape, str(jnp.dtype(lhs.dtype)), str(jnp.dtype(rhs.dtype)), (lc, rc, lb, rb))
    a = _canonical(lhs, lc, lb, pad_k=pad_k, name="lhs")
    b_kn = _kn_layout(rhs, rc, rb)
    b = _canonical(rhs, rc, rb, pad_k=pad_k, name="rhs", kn=b_kn)
    _check_hadamard_lengths(recipe, a.shape[1], b.shape[2 if b_kn else 1], a.shape[2])
    fprop_seed = hd.weight_seed(rhs.shape, rc, rb) if "fprop" in recipe.hadamard_passes else None
    out = _mx_gemm(a, b, recipe, out_dtype, site, fprop_seed, b_kn, key)
    return dims.to_logical(out, out_shape, lhs, rhs, lc, rc, lb, rb)


def dense(x, kernel, bias=None, *, recipe=None, key=None):
    """MXFP4 dense layer: ``x [..., K] · kernel [K, N] (+ bias [N]) -> [..., N]``, differentiable.

    Args:
      x: float32/bfloat16/float16 array [..., K], any K.
      kernel: float array [K, N], or an :class:`MXFP4Array` [Kp, N] quantized along axis 0 with
        Kp = K rounded up to a multiple of 32 (what :func:`jax_mxfp4.flax.quantize_params` makes),
        or the same converted by :func:`jax_mxfp4.prepare_fp8` (:class:`FP8Prepared`) or
        :func:`jax_mxfp4.prepare_decode` (:class:`DecodePrepared`); x is then
        zero-padded to Kp (exact).
      bias: optional float array [N], added in the output dtype.
      recipe: :class:`jax_mxfp4.Recipe` (see :func:`dot_general`).
      key: optional PRNG key for the stochastic rounding of the gradients (see :func:`dot_general`).

    Returns:
      [..., N] in ``jnp.result_type(x, kernel)`` (``x.dtype`` for an MXFP4Array kernel), computed
      with float32 accumulation; K is zero-padded to a multiple of 32 inside.

    Raises:
      TypeError: non-float ``x``/``kernel``/``bias``.
      ValueError: ``kernel`` not 2-D; an MXFP4Array kernel not quantized along axis 0; K of ``x``
        and ``kernel`` incompatible; ``bias`` not of shape [N]; under an explicit mesh, a sharded
        K whose shards would split a 32-element block.
    """
    return _dense(x, kernel, bias, recipe, key)


def _dense(x, kernel, bias, recipe, key, out_dtype=None):
    """:func:`dense`; ``out_dtype`` (default: as documented there) is the GEMM's output dtype, so a
    layer can compute in its ``dtype`` while the kernel is quantized from its ``param_dtype`` value."""
    checks.check_float_input(x, "x")
    if jnp.ndim(x) < 1:
        raise ValueError("x must have at least one dim (the contraction dim K last)")
    k = x.shape[-1]
    if isinstance(kernel, _QUANTIZED):
        if isinstance(kernel, (FP8Prepared, DecodePrepared)):
            kernel._check_children()  # batched by vmap/scan: say so, not "must be 2-D"
        if kernel.ndim != 2 or kernel.axis != 0:
            raise ValueError(
                f"kernel: a quantized kernel ({type(kernel).__name__}) must be 2-D [K, N] quantized along "
                f"axis 0 (K), got {kernel}"
            )
        kp = kernel.shape[0]
        if k != kp:
            if -(-k // BLOCK_SIZE) * BLOCK_SIZE != kp:
                raise ValueError(
                    f"x has K={k} but the {type(kernel).__name__} kernel has K={kp}; expected K={kp} or K padded "
                    f"up to it (K rounded up to a multiple of {BLOCK_SIZE})"
                )
            shd.check_dim_blocks(x, x.ndim - 1, "x")  # before padding the sharded dim
            x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, kp - k)])
        out_dtype = jnp.dtype(x.dtype) if out_dtype is None else out_dtype
    else:
        checks.check_float_input(kernel, "kernel")
        if jnp.ndim(kernel) != 2:
            raise ValueError(f"kernel must be 2-D [K, N], got shape {jnp.shape(kernel)}")
        if kernel.shape[0] != k:
            raise ValueError(f"kernel has K={kernel.shape[0]} rows but x has K={k} (last dim)")
        out_dtype = jnp.result_type(x.dtype, kernel.dtype) if out_dtype is None else out_dtype
    n = kernel.shape[1]
    y = _dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), out_dtype, recipe, pad_k=True, key=key)
    if bias is not None:
        checks.check_float_input(bias, "bias")
        if tuple(jnp.shape(bias)) != (n,):
            raise ValueError(f"bias must have shape ({n},) to match kernel [K, {n}], got {jnp.shape(bias)}")
        y = y + bias.astype(y.dtype)
    return y
