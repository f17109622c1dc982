"""jax_mxfp4.ragged_dot / ragged_dot_general against independent NumPy float64 references.

The references quantize through the NumPy/ml_dtypes oracle of tests/mx_reference.py (``qdq``)
group by group, and write the per-group token blocking of wgrad out directly (:func:`blocked_ref`:
blocks of 32 rows starting at each group's first row, a partial last block padded with zeros).
Stochastically rounded operands are rebuilt with ``jax_mxfp4.quantize`` and the documented keys.
The library accumulates in float32: "equal" means within 2e-6 of the largest magnitude, far
below the ~1e-1 effect of a wrong axis, block or rounding.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_mxfp4 as mx
from jax_mxfp4 import group_blocks, ragged
from jax_mxfp4.errors import BackendUnavailableError

from mx_reference import bf16, pad, qdq

NK_DN = lax.RaggedDotDimensionNumbers((((1,), (2,)), ((), ())), (0,), (0,))  # experts [G, N, K]
WGRAD_DN = lax.RaggedDotDimensionNumbers((((0,), (0,)), ((), ())), (0,), ())  # [M, K] x [M, N] -> [G, K, N]


# ----------------------------------------------------------------------------- references
def bounds(gs):
    ends = np.cumsum(gs)
    return [(int(e - s), int(e)) for s, e in zip(gs, ends)]


def fprop_ref(x, w_kn, gs, mode="even", quantize_x=True):
    """float64 [M, N]: each group's rows (quantized along K) times its expert [K, N] (along K)."""
    x = np.asarray(x, np.float32)
    out = np.zeros((x.shape[0], w_kn.shape[2]))
    for g, (a, b) in enumerate(bounds(gs)):
        xa = qdq(x[a:b], 1, mode) if quantize_x else x[a:b].astype(np.float64)
        out[a:b] = xa @ qdq(np.asarray(w_kn[g], np.float32), 0, mode)
    return out


def blocked_ref(x, gs, mode="even"):
    """float64 [M, F]: x quantized along rows in blocks of 32 starting at each group's first row,
    a partial block padded with zero rows; rows past sum(gs) -> 0."""
    x = np.asarray(x, np.float32)
    out = np.zeros(x.shape)
    for a, b in bounds(gs):
        for s in range(a, b, 32):
            e = min(s + 32, b)
            out[s:e] = qdq(pad(x[s:e], 0), 0, mode)[: e - s]
    return out


def assert_close_f32(got, want, rel=2e-6):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=rel * max(np.abs(want).max(), 1e-30))


def rel_fro(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def operands(rng, m=70, k=64, n=48, g=3):
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((g, k, n)), jnp.float32)
    return x, w


GS_EMPTY_AND_TAIL = np.array([33, 0, 30], np.int32)  # an empty group; rows 63..69 in no group


# ----------------------------------------------------------------------------- forward
def test_forward_float_experts_with_empty_group_and_rows_past_the_groups(rng):
    x, w = operands(rng)
    y = mx.ragged_dot(x, w, jnp.asarray(GS_EMPTY_AND_TAIL))
    assert y.dtype == jnp.float32 and y.shape == (70, 48)
    assert_close_f32(y, fprop_ref(x, np.asarray(w), GS_EMPTY_AND_TAIL))
    assert np.all(np.asarray(y[63:]) == 0)  # rows past sum(group_sizes) give zeros, as lax does


@pytest.mark.parametrize("storage", ["GKN_axis1", "GNK_axis2"])
def test_forward_mxfp4_experts_in_both_storages(rng, storage):
    x, w = operands(rng)
    gs = jnp.asarray(GS_EMPTY_AND_TAIL)
    want = fprop_ref(x, np.asarray(w), GS_EMPTY_AND_TAIL)
    if storage == "GKN_axis1":
        y = mx.ragged_dot(x, mx.quantize(w, 1), gs)
    else:  # gpt-oss's storage, contracted along its last dim without a transpose
        y = mx.ragged_dot_general(x, mx.quantize(jnp.swapaxes(w, 1, 2), 2), gs, NK_DN)
    assert_close_f32(y, want)


def test_forward_mxfp4_activations(rng):
    x, w = operands(rng)
    gs = jnp.asarray(GS_EMPTY_AND_TAIL)
    y = mx.ragged_dot(mx.quantize(x, 1), w, gs)
    assert_close_f32(y, fprop_ref(x, np.asarray(w), GS_EMPTY_AND_TAIL))


@pytest.mark.sweep(keep=1)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_forward_w4a16_keeps_activations(rng, dtype):
    x, w = operands(rng)
    x = x.astype(dtype)
    gs = np.array([10, 50, 10], np.int32)
    recipe = mx.Recipe(quantize_activations=False)
    want = fprop_ref(np.asarray(x.astype(jnp.float32)), np.asarray(w), gs, quantize_x=False)
    for rhs in (w, mx.quantize(w, 1)):
        y = mx.ragged_dot(x, rhs, jnp.asarray(gs), recipe=recipe, preferred_element_type=jnp.float32)
        assert_close_f32(y, want)


def test_forward_scale_mode_and_output_dtype(rng):
    x, w = operands(rng)
    gs = np.array([20, 20, 30], np.int32)
    xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    y = mx.ragged_dot(xb, wb, jnp.asarray(gs), recipe=mx.Recipe(scale_mode="floor"))
    assert y.dtype == jnp.bfloat16  # bf16 x bf16 -> bf16, as lax.ragged_dot
    want = fprop_ref(np.asarray(xb.astype(jnp.float32)), np.asarray(wb.astype(jnp.float32)), gs, "floor")
    np.testing.assert_allclose(np.asarray(y, np.float64), bf16(want), rtol=0, atol=1e-2 * np.abs(want).max())
    y16 = mx.ragged_dot(xb, wb, jnp.asarray(gs), preferred_element_type=jnp.float16, recipe=mx.Recipe(scale_mode="floor"))
    assert y16.dtype == jnp.float16


def test_fprop_bf16_recipe(rng):
    x, w = operands(rng)
    gs = np.array([20, 20, 30], np.int32)
    y = mx.ragged_dot(x, w, jnp.asarray(gs), recipe=mx.Recipe(fprop="bf16"))
    want = np.zeros((70, 48))
    for g, (a, b) in enumerate(bounds(gs)):
        want[a:b] = bf16(x[a:b]) @ bf16(w[g])
    assert_close_f32(y, want)


def test_equals_dot_general_group_by_group_bit_identical(rng):
    """K = 32: one block, every product and block sum exact in float32, so the grouped result is
    bit-identical to jax_mxfp4.dot_general applied to each group (same quantized values); for
    larger K only the float32 accumulation order may differ."""
    x, w = operands(rng, m=64, k=32, n=32, g=4)
    gs = np.array([7, 0, 33, 20], np.int32)
    y = np.asarray(mx.ragged_dot(x, w, jnp.asarray(gs)))
    for g, (a, b) in enumerate(bounds(gs)):
        if b > a:
            ref = mx.dot_general(x[a:b], w[g], (((1,), (0,)), ((), ())))
            np.testing.assert_array_equal(y[a:b], np.asarray(ref))


def test_jit_matches_eager_and_invalid_group_sizes_give_nan(rng):
    x, w = operands(rng)
    f = jax.jit(mx.ragged_dot)
    gs = jnp.asarray(GS_EMPTY_AND_TAIL)
    np.testing.assert_array_equal(np.asarray(f(x, w, gs)), np.asarray(mx.ragged_dot(x, w, gs)))
    for bad in ([50, 30, 0], [-1, 40, 0]):  # sum > M; a negative size: not checkable under jit
        assert np.all(np.isnan(np.asarray(f(x, w, jnp.asarray(bad, jnp.int32)))))
        dx, dw = jax.jit(jax.grad(lambda a, b: mx.ragged_dot(a, b, jnp.asarray(bad, jnp.int32)).sum(),
                                  argnums=(0, 1)))(x, w)
        assert np.all(np.isnan(np.asarray(dx))) and np.all(np.isnan(np.asarray(dw)))


# ----------------------------------------------------------------------------- routes
def test_bf16_decode_route_equals_exact_route(rng):
    """The GPU route (decode to bfloat16, float32 accumulation) gives the exact route's values:
    K = 32 keeps every sum exact, so they are bit-identical."""
    x, w = operands(rng, m=64, k=32, n=32, g=2)
    gs = jnp.asarray([40, 24], jnp.int32)
    xq, wq = mx.quantize(x, 1), mx.quantize(w, 1)
    dn = ragged._rows_dn(1)
    exact = ragged._product_on(ragged.EXACT, xq, wq, gs, dn)
    fast = ragged._product_on(ragged.BF16, xq, wq, gs, dn)
    np.testing.assert_array_equal(np.asarray(fast), np.asarray(exact))


@pytest.mark.parametrize("sizes", [[0, 3, 0, 0, 0, 1, 0, 0], [0, 0, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0, 0],
                                   [0, 0, 0, 0, 0, 0, 2, 1]], ids=["two_used", "none_used", "first_four", "tail"])
def test_bf16_decode_route_gathers_only_experts_with_rows(rng, sizes):
    """Fewer rows than experts (decode sizes): the GPU route gathers the experts that have rows
    before decoding them; same values, bit for bit, as decoding all G, under jit too (group
    sizes traced), with rows past the sum left zero. Both expert storages."""
    m, g = 4, len(sizes)
    x = jnp.asarray(rng.standard_normal((m, 64)), jnp.float32)
    gs = jnp.asarray(sizes, jnp.int32)
    for k_axis, w in ((1, rng.standard_normal((g, 64, 32))), (2, rng.standard_normal((g, 32, 64)))):
        xq, wq = mx.quantize(x, 1), mx.quantize(jnp.asarray(w, jnp.float32), k_axis)
        dn = ragged._rows_dn(k_axis)
        used, used_sizes = ragged._experts_with_rows(wq, gs, dn, m)
        assert used.shape[0] == m and int(used_sizes.sum()) == sum(sizes)
        every = lax.ragged_dot_general(xq.dequantize(jnp.bfloat16), wq.dequantize(jnp.bfloat16), gs, dn,
                                       preferred_element_type=jnp.float32)
        fast = jax.jit(lambda a, b, s: ragged._product_on(ragged.BF16, a, b, s, dn))(xq, wq, gs)
        np.testing.assert_array_equal(np.asarray(fast), np.asarray(every))


def test_explain_routes(rng):
    x, w = operands(rng)
    gs = jnp.asarray(GS_EMPTY_AND_TAIL)
    assert mx.ragged.explain_ragged_dot(x, w, gs, platform="cpu").route == "exact"
    assert mx.ragged.explain_ragged_dot(x, w, gs, platform="cuda").route == "grouped-kernel"
    assert mx.ragged.explain_ragged_dot(x, w, gs, platform="rocm", recipe=mx.Recipe(backend="xla")).route == "exact"
    w4a16 = mx.Recipe(quantize_activations=False)
    r = mx.ragged.explain_ragged_dot(x, mx.quantize(w, 1), gs, platform="cuda", recipe=w4a16)
    assert r.route == "exact" and "w4a16" in r.reason  # a float32 activation is not exact in bf16
    r = mx.ragged.explain_ragged_dot(x.astype(jnp.bfloat16), mx.quantize(w, 1), gs, platform="cuda", recipe=w4a16)
    assert r.route == "grouped-kernel"


# ----------------------------------------------------------------------------- the wgrad blocking rule
def test_group_blocked_values_follow_the_rule(rng):
    """Groups of 33 rows (a full block + a 1-row block), 1 row, 0 rows, 40 rows; rows past the
    sum (74 of 100) give 0. Scales differ per block, so any other blocking gives other values."""
    x = rng.standard_normal((100, 8)).astype(np.float32) * np.exp(rng.uniform(-4, 4, (100, 1))).astype(np.float32)
    gs = np.array([33, 1, 0, 40], np.int32)
    got = np.asarray(jax.jit(group_blocks.group_blocked_values)(jnp.asarray(x), jnp.asarray(gs)))
    want = blocked_ref(x, gs)
    np.testing.assert_array_equal(got, want)
    assert np.all(got[74:] == 0)
    global_blocks = qdq(x[:96], 0)[:74]  # blocks of 32 from row 0, across group boundaries
    assert not np.array_equal(got[:74], global_blocks)


def test_block_layout_bounds():
    layout = group_blocks.block_layout(jnp.asarray([33, 1, 0, 40], jnp.int32), 100)
    assert layout.rows == group_blocks.buffer_rows(100, 4) == 32 * -(-(100 + 31 * 4) // 32)
    np.testing.assert_array_equal(np.asarray(layout.padded_sizes), [64, 32, 0, 64])
    dest = np.asarray(layout.dest)
    np.testing.assert_array_equal(dest[:33], np.arange(33))
    assert dest[33] == 64 and dest[34] == 96 and dest[73] == 96 + 39
    assert np.all(dest[74:] == layout.rows)  # dropped


@pytest.mark.sweep(keep=1)
@pytest.mark.parametrize("storage", ["GNK", "GKN"])
def test_gradients_nearest_match_blocked_reference(rng, storage):
    """grad_rounding="nearest": dX = per group qdq_N(dY_g)·qdq_N(W_g)ᵀ (N = 48 zero-padded to 64);
    dW_g = blocked(X)_gᵀ·blocked(dY)_g with the per-group token blocks."""
    x, w = operands(rng)
    gs = np.array([33, 1, 30], np.int32) if storage == "GKN" else np.array([40, 0, 25], np.int32)
    c = rng.standard_normal((70, 48)).astype(np.float32)
    recipe = mx.Recipe(grad_rounding="nearest")
    if storage == "GKN":
        rhs, call = w, lambda a, b: mx.ragged_dot(a, b, jnp.asarray(gs), recipe=recipe)
    else:
        rhs = jnp.swapaxes(w, 1, 2)
        call = lambda a, b: mx.ragged_dot_general(a, b, jnp.asarray(gs), NK_DN, recipe=recipe)  # noqa: E731
    dx, dw = jax.jit(lambda a, b, ct: jax.vjp(call, a, b)[1](ct))(x, rhs, jnp.asarray(c))
    wn = np.asarray(w)
    want_dx = np.zeros((70, 64))
    for g, (a, b) in enumerate(bounds(gs)):
        want_dx[a:b] = qdq(pad(c[a:b], 1), 1) @ qdq(pad(wn[g], 1), 1).T
    assert_close_f32(dx, want_dx)
    bx, bc = blocked_ref(np.asarray(x), gs), blocked_ref(c, gs)
    want_dw = np.stack([bx[a:b].T @ bc[a:b] for a, b in bounds(gs)])
    if storage == "GNK":
        want_dw = np.swapaxes(want_dw, 1, 2)
    assert dw.shape == rhs.shape
    assert_close_f32(dw, want_dw)


def test_ragged_contracting_form_matches_blocked_reference(rng):
    x = rng.standard_normal((80, 64)).astype(np.float32)
    y = rng.standard_normal((80, 32)).astype(np.float32)
    gs = np.array([0, 33, 1, 40], np.int32)
    out = jax.jit(lambda a, b: mx.ragged_dot_general(a, b, jnp.asarray(gs), WGRAD_DN))(jnp.asarray(x), jnp.asarray(y))
    bx, by = blocked_ref(x, gs), blocked_ref(y, gs)
    assert out.shape == (4, 64, 32)
    assert_close_f32(out, np.stack([bx[a:b].T @ by[a:b] for a, b in bounds(gs)]))


# ----------------------------------------------------------------------------- training
def test_gradients_within_bound_of_float64(rng):
    """Stated bound: Gaussian operands, M = 160 tokens in 4 groups, K = N = 64: the all-MXFP4
    gradients (stochastic rounding of dY) are within 30% relative Frobenius error of the float64
    gradients, and further than 1% (the quantization happened); the bf16 recipe within 1%."""
    x, w = operands(rng, m=160, k=64, n=64, g=4)
    gs = np.array([60, 1, 35, 64], np.int32)
    c = rng.standard_normal((160, 64)).astype(np.float64)
    xf, wf = np.asarray(x, np.float64), np.asarray(w, np.float64)
    exact_dx = np.zeros_like(xf)
    exact_dw = np.zeros_like(wf)
    for g, (a, b) in enumerate(bounds(gs)):
        exact_dx[a:b] = c[a:b] @ wf[g].T
        exact_dw[g] = xf[a:b].T @ c[a:b]
    for recipe, lo, hi in ((mx.Recipe(), 0.01, 0.30), (mx.Recipe(dgrad="bf16", wgrad="bf16"), 0.0, 0.01)):
        dx, dw = jax.jit(lambda a, b, ct: jax.vjp(lambda p, q: mx.ragged_dot(p, q, jnp.asarray(gs), recipe=recipe),
                                                  a, b)[1](ct))(x, w, jnp.asarray(c, jnp.float32))
        for got, want in ((dx, exact_dx), (dw, exact_dw)):
            assert lo <= rel_fro(got, want) < hi


def documented_key(dy, site, tag):
    bits = np.asarray(dy, np.float32).view(np.uint32).ravel().astype(np.uint64)
    w = ((np.arange(bits.size, dtype=np.uint64) * np.uint64(0x9E3779B1)) & np.uint64(0xFFFFFFFF)) | np.uint64(1)
    h = int((bits * w).sum() & np.uint64(0xFFFFFFFF))
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(0x4D584634), site), tag)
    return jax.random.fold_in(key, np.uint32(h))


def test_stochastic_dgrad_keys_as_documented(rng, jax_key):
    """dgrad rounds dY along N with fold_in(key, 1), or without a key with the data-derived key
    of the documented call site; the same key gives the same gradients, another key others."""
    x, w = operands(rng, m=64, k=32, n=64, g=2)
    gs = np.array([30, 34], np.int32)
    c = jnp.asarray(rng.standard_normal((64, 64)), jnp.float32)
    site = zlib.crc32(repr(("ragged_dot", (64, 32), (2, 32, 64), "float32", "float32", "ragged rows", 1)).encode()) & 0x7FFFFFFF

    @jax.jit
    def grads(key):
        return jax.vjp(lambda a, b: mx.ragged_dot(a, b, jnp.asarray(gs), key=key), x, w)[1](c)

    def dx_ref(k):
        cq = np.asarray(mx.dequantize(mx.quantize(c, 1, rounding="stochastic", key=k)), np.float64)
        out = np.zeros((64, 32))
        for g, (a, b) in enumerate(bounds(gs)):
            out[a:b] = cq[a:b] @ qdq(np.asarray(w[g]), 1).T
        return out

    dx, dw = grads(jax_key)
    assert_close_f32(dx, dx_ref(jax.random.fold_in(jax_key, 1)))
    dx2, dw2 = grads(jax_key)
    np.testing.assert_array_equal(np.asarray(dx), np.asarray(dx2))
    np.testing.assert_array_equal(np.asarray(dw), np.asarray(dw2))
    dx3, dw3 = grads(jax.random.fold_in(jax_key, 7))
    assert not np.array_equal(np.asarray(dx), np.asarray(dx3))
    assert not np.array_equal(np.asarray(dw), np.asarray(dw3))
    dxn, _ = grads(None)
    assert_close_f32(dxn, dx_ref(documented_key(c, site, 1)))


def test_wgrad_stochastic_uses_fold_in_key_2(rng, jax_key):
    """wgrad rounds the blocked dY with fold_in(key, 2) (quantize of the [P, N] block buffer)."""
    x, w = operands(rng, m=64, k=32, n=32, g=2)
    gs = jnp.asarray([33, 31], jnp.int32)
    c = jnp.asarray(rng.standard_normal((64, 32)), jnp.float32)
    _, dw = jax.jit(lambda a, b, ct: jax.vjp(lambda p, q: mx.ragged_dot(p, q, gs, key=jax_key), a, b)[1](ct))(x, w, c)

    @jax.jit
    def want_fn(x, c):
        layout = group_blocks.block_layout(gs, 64)
        xb = mx.dequantize(group_blocks.quantize_blocked(x, layout, scale_mode="even"))
        cb = mx.dequantize(group_blocks.quantize_blocked(c, layout, scale_mode="even", rounding="stochastic",
                                                         key=jax.random.fold_in(jax_key, 2)))
        return lax.ragged_dot_general(xb, cb, layout.padded_sizes, WGRAD_DN, precision=lax.Precision.HIGHEST)

    want = want_fn(x, c)
    assert_close_f32(dw, want)


def test_gradient_wrt_mxfp4_experts_raises_and_lhs_gradient_works(rng):
    x, w = operands(rng)
    gs = jnp.asarray(GS_EMPTY_AND_TAIL)
    wq = mx.quantize(w, 1)
    with pytest.raises(ValueError, match="gradient with respect to rhs, an MXFP4Array"):
        jax.grad(lambda q: mx.ragged_dot(x, q, gs).sum(), allow_int=True)(wq)
    # frozen MXFP4 experts: dX as for the float experts holding the same values
    dx = jax.grad(lambda a: mx.ragged_dot(a, wq, gs).sum())(x)
    dx_f = jax.grad(lambda a: mx.ragged_dot(a, mx.dequantize(wq), gs).sum())(x)
    np.testing.assert_array_equal(np.asarray(dx), np.asarray(dx_f))


def test_gradient_dtypes_follow_operands(rng):
    x, w = operands(rng)
    gs = jnp.asarray(GS_EMPTY_AND_TAIL)
    dx, dw = jax.jit(jax.grad(lambda a, b: mx.ragged_dot(a, b, gs).astype(jnp.float32).sum(), argnums=(0, 1)))(
        x.astype(jnp.bfloat16), w)
    assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.float32


# ----------------------------------------------------------------------------- errors
def _errors(x, w):
    gs = jnp.asarray([30, 20, 20], jnp.int32)
    rd = mx.ragged_dot
    batch_dn = lax.RaggedDotDimensionNumbers((((2,), (1,)), ((0,), (0,))), (1,), ())
    rows1_dn = lax.RaggedDotDimensionNumbers((((0,), (1,)), ((), ())), (1,), (0,))
    return {
        "group_sizes_float_dtype": (lambda: rd(x, w, jnp.asarray([30.0, 20.0, 20.0])), TypeError, "integer"),
        "group_sizes_rank_2": (lambda: rd(x, w, gs[None]), ValueError, "rank 1"),
        "group_sizes_length_not_G": (lambda: rd(x, w, gs[:2]), ValueError, "G=3"),
        "group_sizes_negative": (lambda: rd(x, w, jnp.asarray([-1, 20, 20], jnp.int32)), ValueError, ">= 0"),
        "group_sizes_sum_above_M": (lambda: rd(x, w, jnp.asarray([30, 30, 30], jnp.int32)), ValueError, "sum to 90"),
        "K_not_multiple_of_32": (lambda: rd(x[:, :48], w[:, :48], gs), ValueError, "multiple of the MXFP4 block size"),
        "K_mismatch": (lambda: rd(x, w[:, :32], gs), ValueError, "contracting lengths must match"),
        "lhs_integer_dtype": (lambda: rd(x.astype(jnp.int32), w, gs), TypeError, "lhs must be a float32"),
        "rhs_mxfp4_wrong_axis": (lambda: rd(x, mx.quantize(w[:, :, :32], 2), gs), ValueError,
                                 "quantized along axis 2, but it is contracted along axis 1"),
        "lhs_mxfp4_wrong_axis": (lambda: rd(mx.quantize(x[:64], 0), w, gs), ValueError, "lhs is an MXFP4Array quantized along axis 0"),
        "group_offset": (lambda: rd(x, w, gs, group_offset=jnp.zeros((1,), jnp.int32)), ValueError, "group_offset"),
        "batch_dims_form": (lambda: mx.ragged_dot_general(x[None], w[None], gs, batch_dn), ValueError, "batch dims"),
        "ragged_dim_1_form": (lambda: mx.ragged_dot_general(x.T, w, gs, rows1_dn), ValueError, "not a supported form"),
        "dimension_numbers_type": (lambda: mx.ragged_dot_general(x, w, gs, (((1,), (1,)), ((), ()))), TypeError,
                                   "RaggedDotDimensionNumbers"),
        "hadamard_recipe": (lambda: rd(x, w, gs, recipe=mx.Recipe(hadamard="all")), ValueError, "Hadamard"),
        "backend_not_auto_or_xla": (lambda: rd(x, w, gs, recipe=mx.Recipe(backend="pallas")),
                                    BackendUnavailableError, "'auto'"),
        "mxfp4_in_contracting_form": (lambda: mx.ragged_dot_general(mx.quantize(x[:64], 0), x[:64, :32], gs, WGRAD_DN),
                                      ValueError, "float operands only"),
        "contracting_form_M_mismatch": (lambda: mx.ragged_dot_general(x, x[:64, :32], gs, WGRAD_DN), ValueError,
                                        "M=70 rows but rhs"),
        "key_not_a_key": (lambda: rd(x, w, gs, key=jnp.zeros((3,), jnp.uint32)), TypeError, "PRNG key"),
        "lhs_rank_3": (lambda: rd(x[None], w, gs), ValueError, r"lhs must be 2-D \[M, K\], got shape \(1, 70, 64\)"),
        "rhs_rank_2": (lambda: rd(x, w[0], gs), ValueError, r"rhs must be 3-D \[G, K, N\]"),
    }


ERROR_CASES = sorted(_errors(None, None))


@pytest.mark.parametrize("case", ERROR_CASES)
def test_errors_name_argument_and_rule(case):
    x, w = jnp.ones((70, 64), jnp.float32), jnp.ones((3, 64, 48), jnp.float32)
    fn, exc, match = _errors(x, w)[case]
    with pytest.raises(exc, match=match):
        fn()


def test_group_sizes_shape_errors_under_jit():
    """Under jit the static checks (dtype, rank, length) still raise; the values cannot be checked."""
    x, w = jnp.ones((70, 64), jnp.float32), jnp.ones((3, 64, 48), jnp.float32)
    with pytest.raises(ValueError, match="G=3"):
        jax.jit(mx.ragged_dot)(x, w, jnp.asarray([1, 2], jnp.int32))
