"""Custom VJP of jax_mxfp4.dot_general / dense against an emulated float64 reference.

The reference (``emulated``) applies the documented quantization of every pass explicitly:
nearest-rounded operands through the independent NumPy/ml_dtypes oracle (tests/mx_reference.py),
stochastically rounded gradients through ``jax_mxfp4.quantize`` with the key rebuilt here from the
documented formula (CRC32 call-site id, position-weighted hash of dY's bits), then float64
matmuls. The library accumulates in float32, so "equal" means: relative error at float32
accumulation level (<= 2e-6 of the largest magnitude), far below the ~1e-1 effect of any wrong
axis, rounding or key.
"""

from __future__ import annotations

import itertools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_mxfp4 as mx
from jax_mxfp4 import training
from jax_mxfp4.hadamard import random_hadamard_transform, random_signs

from mx_reference import bf16, pad, qdq

DIMS2 = (((1,), (0,)), ((), ()))


# ----------------------------------------------------------------------------- reference
def site_id(lshape, rshape, ldt, rdt, dims):
    return zlib.crc32(repr((tuple(lshape), tuple(rshape), ldt, rdt, dims)).encode()) & 0x7FFFFFFF


def documented_key(dy, site, tag):
    bits = np.asarray(dy, np.float32).view(np.uint32).ravel().astype(np.uint64)
    w = ((np.arange(bits.size, dtype=np.uint64) * np.uint64(0x9E3779B1)) & np.uint64(0xFFFFFFFF)) | np.uint64(1)
    h = int((bits * w).sum() & np.uint64(0xFFFFFFFF))
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(0x4D584634), site), tag)
    return jax.random.fold_in(key, np.uint32(h))


def sr_qdq(g, axis, key, mode="even"):
    q = mx.quantize(jnp.asarray(g, jnp.float32), axis, scale_mode=mode, rounding="stochastic", key=key)
    return np.asarray(mx.dequantize(q), np.float64)


def emulated(x, w, c, recipe, site):
    """(y, dx, dw) float64 for y = x [M, K] @ w [K, N] with cotangent c [M, N]."""
    x, w, c = (np.asarray(a, np.float32) for a in (x, w, c))
    if recipe.fprop == "mxfp4":
        y = qdq(pad(x, 1), 1, recipe.scale_mode) @ qdq(pad(w, 0), 0, recipe.scale_mode)
    else:
        y = bf16(x) @ bf16(w)
    sr = recipe.grad_rounding == "stochastic"
    # dgrad: along N
    if recipe.dgrad == "mxfp4":
        cp, wp = pad(c, 1), pad(w, 1)
        cq = sr_qdq(cp, 1, documented_key(c, site, 1), recipe.scale_mode) if sr else qdq(cp, 1, recipe.scale_mode)
        dx = cq @ qdq(wp, 1, recipe.scale_mode).T
    else:
        dx = bf16(c) @ bf16(w).T
    # wgrad: along M (tokens)
    if recipe.wgrad == "mxfp4":
        cp, xp = pad(c, 0), pad(x, 0)
        if recipe.hadamard:
            cp = np.asarray(random_hadamard_transform(jnp.asarray(cp), 0, site))
            xp = np.asarray(random_hadamard_transform(jnp.asarray(xp), 0, site))
        cq = sr_qdq(cp, 0, documented_key(c, site, 2), recipe.scale_mode) if sr else qdq(cp, 0, recipe.scale_mode)
        dw = qdq(xp, 0, recipe.scale_mode).T @ cq
    else:
        dw = bf16(x).T @ bf16(c)
    return y, dx, dw


def assert_close_f32(got, want, tol=2e-6):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    scale = np.max(np.abs(want)) + 1e-30
    err = np.max(np.abs(got - want)) / scale
    assert err <= tol, f"max error {err:.3e} of max |want| {scale:.3e}"


def rel_fro(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def data(m=40, k=50, n=24, seed=0):
    kx, kw, kc = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (m, k), jnp.float32)
    w = jax.random.normal(kw, (k, n), jnp.float32) * 0.1
    c = jax.random.normal(kc, (m, n), jnp.float32)
    return x, w, c


ALL_RECIPES = [
    mx.Recipe(fprop=f, dgrad=d, wgrad=wg, grad_rounding=r, hadamard=h, backend="xla")
    for f, d, wg, r, h in itertools.product(("mxfp4", "bf16"), ("mxfp4", "bf16"), ("mxfp4", "bf16"),
                                            ("stochastic", "nearest"), (False, True))
]


@pytest.mark.sweep(keep=2)
# ----------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("recipe", ALL_RECIPES, ids=lambda r: f"{r.fprop}-{r.dgrad}-{r.wgrad}-{r.grad_rounding}-h{int(r.hadamard)}")
def test_every_recipe_matches_emulated_reference(recipe):
    # M=40, K=50, N=24: no dim is a multiple of 32, so every pass pads its contraction.
    x, w, c = data()
    y, pull = jax.vjp(lambda a, b: mx.dense(a, b, recipe=recipe), x, w)
    dx, dw = pull(c)
    site = site_id(x.shape, w.shape, "float32", "float32", ((1,), (0,), (), ()))
    ry, rdx, rdw = emulated(x, w, c, recipe, site)
    assert_close_f32(y, ry)
    assert_close_f32(dx, rdx)
    assert_close_f32(dw, rdw)


def test_scale_modes_follow_recipe():
    x, w, c = data(m=64, k=64, n=32, seed=3)
    for mode in ("floor", "rceil"):
        recipe = mx.Recipe(scale_mode=mode, grad_rounding="nearest", backend="xla")
        y, pull = jax.vjp(lambda a, b: mx.dot_general(a, b, DIMS2, recipe=recipe), x, w)
        dx, dw = pull(c)
        ry, rdx, rdw = emulated(x, w, c, recipe, 0)
        assert_close_f32(y, ry)
        assert_close_f32(dx, rdx)
        assert_close_f32(dw, rdw)


def test_general_dimension_numbers_match_per_batch_reference():
    # lhs [B=2, 3, 64, 5] (batch 0, contract 2, free 1 and 3), rhs [2, 4, 64] (batch 0, contract 2)
    k1, k2, k3 = jax.random.split(jax.random.key(7), 3)
    lhs = jax.random.normal(k1, (2, 3, 64, 5))
    rhs = jax.random.normal(k2, (2, 4, 64))
    dims = (((2,), (2,)), ((0,), (0,)))
    recipe = mx.Recipe(grad_rounding="nearest", backend="xla")
    y, pull = jax.vjp(lambda a, b: mx.dot_general(a, b, dims, recipe=recipe), lhs, rhs)
    assert y.shape == lax.dot_general(lhs, rhs, dims).shape == (2, 3, 5, 4)
    c = jax.random.normal(k3, y.shape)
    dl, dr = pull(c)
    for b in range(2):
        x2 = np.moveaxis(np.asarray(lhs[b]), 1, 2).reshape(15, 64)  # free dims (3, 5) -> M = 15
        w2 = np.asarray(rhs[b]).T  # [K, N]
        ry, rdx, rdw = emulated(x2, w2, np.asarray(c[b]).reshape(15, 4), recipe, 0)
        assert_close_f32(y[b].reshape(15, 4), ry)
        assert_close_f32(np.moveaxis(np.asarray(dl[b]), 1, 2).reshape(15, 64), rdx)
        assert_close_f32(np.asarray(dr[b]).T, rdw)


def test_multiple_contracting_dims_are_flattened():
    x = jax.random.normal(jax.random.key(1), (6, 4, 16))
    w = jax.random.normal(jax.random.key(2), (4, 16, 8))
    dims = (((1, 2), (0, 1)), ((), ()))
    recipe = mx.Recipe(grad_rounding="nearest", backend="xla")
    c = jax.random.normal(jax.random.key(3), (6, 8))
    y, pull = jax.vjp(lambda a, b: mx.dot_general(a, b, dims, recipe=recipe), x, w)
    dx, dw = pull(c)
    ry, rdx, rdw = emulated(np.asarray(x).reshape(6, 64), np.asarray(w).reshape(64, 8), c, recipe, 0)
    assert_close_f32(y, ry)
    assert_close_f32(np.asarray(dx).reshape(6, 64), rdx)
    assert_close_f32(np.asarray(dw).reshape(64, 8), rdw)


# ----------------------------------------------------------------------------- accuracy
def test_gradients_close_to_bf16_gradients():
    """Stated bound: for Gaussian operands (K=N=M=256) the all-MXFP4 gradients (stochastic
    rounding of dY) are within 25% relative Frobenius error of the bf16-recipe gradients; the
    nearest-rounded ones within 20%; the bf16 recipe itself is within 1% of float64."""
    x, w, c = data(m=256, k=256, n=256, seed=11)
    exact = (np.asarray(c, np.float64) @ np.asarray(w, np.float64).T, np.asarray(x, np.float64).T @ np.asarray(c, np.float64))

    def grads(recipe):
        _, pull = jax.vjp(lambda a, b: mx.dot_general(a, b, DIMS2, recipe=recipe), x, w)
        return pull(c)

    gb = grads(mx.Recipe(fprop="bf16", dgrad="bf16", wgrad="bf16"))
    for g, e in zip(gb, exact):
        assert rel_fro(g, e) < 0.01
    for rounding, bound in (("stochastic", 0.25), ("nearest", 0.20)):
        g4 = grads(mx.Recipe(grad_rounding=rounding))
        for g, b in zip(g4, gb):
            err = rel_fro(g, b)
            assert 0.01 < err < bound, (rounding, err)  # > 0.01: the quantization really happened


def test_stochastic_rounding_is_unbiased_over_keys():
    """Averaging the SR dgrad over 64 cotangent scalings (each gives a new key) converges to the
    product with the *nearest*-quantized W (the only bias left), well below one draw's error."""
    x, w, c = data(m=32, k=64, n=64, seed=5)
    recipe = mx.Recipe(backend="xla")
    f = jax.jit(lambda c: jax.vjp(lambda a: mx.dot_general(a, w, DIMS2, recipe=recipe), x)[1](c)[0])
    scales = 1.0 + jnp.arange(64) * 2.0 ** -20  # tiny changes of dY -> different keys
    draws = np.stack([np.asarray(f(c * s)) / float(s) for s in scales])
    target = np.asarray(c, np.float64) @ qdq(np.asarray(w), 1).T
    one = rel_fro(draws[0], target)
    mean = rel_fro(draws.mean(0), target)
    assert mean < one / 4, (one, mean)


# ----------------------------------------------------------------------------- determinism
def test_gradients_are_deterministic_and_keyed_by_data():
    x, w, c = data(seed=2)

    def grads(c):
        return jax.vjp(lambda a, b: mx.dense(a, b), x, w)[1](c)

    g1, g2 = grads(c), grads(c)
    for a, b in zip(g1, g2):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    g3 = grads(c * (1 + 2.0 ** -20))
    assert not np.array_equal(np.asarray(g1[1]), np.asarray(g3[1]))  # new dY -> new SR noise


# ----------------------------------------------------------------------------- transformations
# Losses are linear in the outputs so that the cotangent dY reaching each dot_general has the same
# bits with and without the transformation (the stochastic-rounding key hashes dY's bits; XLA may
# fuse a nonlinearity differently under jit, which would legitimately change the draw).
def _loss(x, w, c):
    return jnp.sum(mx.dot_general(x, w, DIMS2) * c)


def test_jit_equals_eager():
    x, w, c = data(k=64, seed=4)
    eager = jax.grad(_loss, argnums=(0, 1))(x, w, c)
    jitted = jax.jit(jax.grad(_loss, argnums=(0, 1)))(x, w, c)
    for a, b in zip(eager, jitted):
        assert_close_f32(a, b, 1e-6)


def test_vmap_equals_per_example():
    xs = jax.random.normal(jax.random.key(9), (3, 40, 64))
    _, w, c = data(k=64, seed=4)
    batched = jax.vmap(jax.grad(_loss, argnums=(0, 1)), in_axes=(0, None, None))(xs, w, c)
    for i in range(3):
        gx, gw = jax.grad(_loss, argnums=(0, 1))(xs[i], w, c)
        assert_close_f32(batched[0][i], gx, 1e-6)
        assert_close_f32(batched[1][i], gw, 1e-6)


def test_scan_and_checkpoint_equal_unrolled():
    ws = jax.random.normal(jax.random.key(1), (2, 64, 64)) * 0.2
    x = jax.random.normal(jax.random.key(2), (32, 64))
    c = jax.random.normal(jax.random.key(3), (32, 64))

    def body(h, w):
        return mx.dot_general(h, w, DIMS2), None

    def scanned(ws, x):
        return jnp.sum(lax.scan(body, x, ws)[0] * c)

    def remat_scanned(ws, x):
        return jnp.sum(lax.scan(jax.checkpoint(body), x, ws)[0] * c)

    def unrolled(ws, x):
        h = x
        for i in range(2):
            h = body(h, ws[i])[0]
        return jnp.sum(h * c)

    ref = jax.grad(unrolled, argnums=(0, 1))(ws, x)
    for f in (scanned, remat_scanned):
        got = jax.jit(jax.grad(f, argnums=(0, 1)))(ws, x)
        for a, b in zip(got, ref):
            assert_close_f32(a, b, 1e-5)


def test_bfloat16_operands_give_bfloat16_gradients():
    x, w, _ = data(k=64, seed=6)
    gx, gw = jax.grad(lambda a, b: jnp.sum(mx.dot_general(a, b, DIMS2, preferred_element_type=jnp.bfloat16).astype(jnp.float32)), argnums=(0, 1))(
        x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    )
    assert gx.dtype == gw.dtype == jnp.bfloat16
    assert gx.shape == x.shape and gw.shape == w.shape


# ----------------------------------------------------------------------------- MXFP4Array operands
def test_prequantized_weight_forward_and_activation_gradient():
    x, w, c = data(m=40, k=64, n=24, seed=8)
    wq = mx.quantize(w, axis=0)
    recipe = mx.Recipe(grad_rounding="nearest", backend="xla")
    y, pull = jax.vjp(lambda a: mx.dot_general(a, wq, DIMS2, recipe=recipe), x)
    (dx,) = pull(c)
    wd = np.asarray(mx.dequantize(wq), np.float64)
    assert_close_f32(y, qdq(x, 1) @ wd)
    # dgrad re-quantizes the (dequantized) weight along N, like a float weight
    assert_close_f32(dx, qdq(pad(np.asarray(c), 1), 1) @ qdq(pad(wd.astype(np.float32), 1), 1).T)


def test_gradient_wrt_mxfp4array_raises_clear_error():
    x, w, _ = data(m=8, k=64, n=32)
    wq = mx.quantize(w, axis=0)
    with pytest.raises(ValueError, match="gradient with respect to rhs, an MXFP4Array"):
        jax.vjp(lambda q: mx.dot_general(x, q, DIMS2), wq)
    with pytest.raises(ValueError, match="gradient with respect to rhs, an MXFP4Array"):
        jax.grad(lambda q: mx.dot_general(x, q, DIMS2).sum(), allow_int=True)(wq)
    with pytest.raises(TypeError, match="uint8"):  # jax.grad itself refuses the uint8 codes
        jax.grad(lambda q: mx.dot_general(x, q, DIMS2).sum())(wq)


# ----------------------------------------------------------------------------- dense
def test_dense_pads_k_exactly():
    x = jax.random.normal(jax.random.key(0), (2, 5, 50))
    w = jax.random.normal(jax.random.key(1), (50, 16))
    b = jnp.arange(16.0)
    recipe = mx.Recipe(grad_rounding="nearest", backend="xla")
    y = mx.dense(x, w, b, recipe=recipe)
    assert y.shape == (2, 5, 16) and y.dtype == jnp.float32
    ref = qdq(pad(np.asarray(x).reshape(10, 50), 1), 1) @ qdq(pad(np.asarray(w), 0), 0) + np.arange(16.0)
    assert_close_f32(np.asarray(y).reshape(10, 16), ref)
    # an MXFP4Array kernel padded to K=64 accepts K=50 inputs
    wq = mx.quantize(jnp.pad(w, ((0, 14), (0, 0))), axis=0)
    y2 = mx.dense(x, wq, b, recipe=recipe)
    assert_close_f32(y2, y, 1e-6)
    gx = jax.grad(lambda x: mx.dense(x, wq, b).sum())(x)
    assert gx.shape == x.shape


def test_dense_errors():
    x = jnp.ones((4, 50))
    with pytest.raises(ValueError, match="kernel has K=40 rows but x has K=50"):
        mx.dense(x, jnp.ones((40, 8)))
    with pytest.raises(ValueError, match="bias must have shape"):
        mx.dense(x, jnp.ones((50, 8)), jnp.ones((7,)))
    with pytest.raises(ValueError, match="must be 2-D"):
        mx.dense(x, jnp.ones((50, 8, 2)))
    with pytest.raises(TypeError, match="x must be a float32"):
        mx.dense(jnp.ones((4, 50), jnp.int32), jnp.ones((50, 8)))
    wq = mx.quantize(jnp.ones((96, 8)), axis=0)
    with pytest.raises(ValueError, match="MXFP4Array kernel has K=96"):
        mx.dense(x, wq)
    with pytest.raises(ValueError, match="quantized along axis 0"):
        mx.dense(jnp.ones((4, 64)), mx.quantize(jnp.ones((64, 64)), axis=1))


def test_dot_general_errors():
    x, w = jnp.ones((4, 64)), jnp.ones((64, 8))
    with pytest.raises(ValueError, match=r"total length 50, which is not a multiple of the MXFP4 block size 32.*jax_mxfp4.dense"):
        mx.dot_general(jnp.ones((4, 50)), jnp.ones((50, 8)), DIMS2)
    with pytest.raises(TypeError, match="recipe must be a jax_mxfp4.Recipe"):
        mx.dot_general(x, w, DIMS2, recipe="mxfp4")
    with pytest.raises(ValueError, match="dimension_numbers must be"):
        mx.dot_general(x, w, ((1, 0),))
    with pytest.raises(TypeError, match="lhs must be a float32"):
        mx.dot_general(x.astype(jnp.int8), w, DIMS2)
    with pytest.raises(ValueError, match="no contracting dims"):
        mx.dot_general(x, w, (((), ()), ((), ())))
    with pytest.raises(TypeError):
        mx.dot_general(x, jnp.ones((32, 8)), DIMS2)  # lax shape rule
    with pytest.raises(ValueError, match="preferred_element_type"):
        mx.dot_general(x, w, DIMS2, preferred_element_type=jnp.int32)
    with pytest.raises(ValueError, match="Recipe.dgrad must be one of"):
        mx.Recipe(dgrad="fp8")


# ----------------------------------------------------------------------------- hadamard
def test_hadamard_transform_is_orthogonal_and_matches_numpy():
    sylvester = np.array([[(-1) ** bin(i & j).count("1") for j in range(32)] for i in range(32)]) / np.sqrt(32)
    x = np.random.default_rng(0).normal(size=(64, 3))
    y = np.asarray(random_hadamard_transform(jnp.asarray(x, jnp.float32), 0, 5), np.float64)
    m = sylvester * random_signs(5)[None, :]
    want = np.concatenate([m @ x[:32], m @ x[32:]])
    np.testing.assert_allclose(y, want, atol=1e-5)
    u = np.random.default_rng(1).normal(size=(64, 4))
    yu = np.asarray(random_hadamard_transform(jnp.asarray(u, jnp.float32), 0, 5), np.float64)
    np.testing.assert_allclose(y.T @ yu, x.T @ u, atol=1e-4)  # dot products preserved
    with pytest.raises(ValueError, match="not a multiple of the Hadamard block"):
        random_hadamard_transform(jnp.ones((40, 2)), 0, 1)
    with pytest.raises(ValueError, match="power of two"):
        random_hadamard_transform(jnp.ones((48, 2)), 0, 1, 24)


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")
def test_stochastic_gradients_under_explicit_data_parallel_mesh_match_single_device():
    from jax.sharding import NamedSharding, PartitionSpec as P

    x = jax.random.normal(jax.random.key(0), (8, 16, 64))
    w = jax.random.normal(jax.random.key(1), (64, 96)) * 0.1
    c = jax.random.normal(jax.random.key(2), (8, 16, 96))
    dims = (((2,), (0,)), ((), ()))
    recipe = mx.Recipe(hadamard=True, backend="xla")  # stochastic dY: the key hashes a sharded dY

    def loss(a, b, c):
        return jnp.sum(mx.dot_general(a, b, dims, recipe=recipe) * c)

    want = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w, c)
    mesh = jax.make_mesh((2, 4), ("data", "model"))  # explicit axes
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("data", None, None)))
        cs = jax.device_put(c, NamedSharding(mesh, P("data", None, None)))
        ws = jax.device_put(w, NamedSharding(mesh, P(None, None)))
        got = jax.jit(jax.grad(loss, argnums=(0, 1)))(xs, ws, cs)
    for g, r in zip(got, want):
        assert_close_f32(g, r, 1e-5)


# ----------------------------------------------------------------------------- wgrad output layout
def _producer_chain(jaxpr, var):
    """Primitives (pjit: its name) from ``var`` back through layout-free ops to the op computing it."""
    producers = {id(v): e for e in jaxpr.eqns for v in e.outvars}
    chain = []
    while id(var) in producers:
        eqn = producers[id(var)]
        if eqn.primitive.name == "custom_vjp_call":  # the straight-through wrapper: follow its body
            inner = eqn.params["call_jaxpr"].jaxpr
            return chain + _producer_chain(inner, inner.outvars[[id(v) for v in eqn.outvars].index(id(var))])
        chain.append(eqn.params.get("name", eqn.primitive.name) if eqn.primitive.name in ("pjit", "jit")
                     else eqn.primitive.name)
        if eqn.primitive.name not in ("reshape", "convert_element_type", "squeeze", "copy", "copy_p"):
            break
        var = eqn.invars[0]
    return chain


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("layout", ["kernel [K, N]", "kernel [N, K]", "tokens [2, 24]"])
def test_wgrad_gemm_writes_the_weight_gradient_without_transpose(monkeypatch, fused, layout):
    """dW comes out of the wgrad GEMM through reshapes only: for a kernel [K, N] the GEMM computes
    Xᵀ·dY [K, N] (the rhs held as [B, K, N], training._kn_layout) instead of dYᵀ·X [N, K] and a
    transpose, which XLA could not fold into the fp8 GEMM (its exact-row while_loop sits in
    between: 8192^2 bf16 transpose per step on the H200 profile of 2026-12-01). With and without
    the fused passes (the Pallas interpreter here), a kernel stored [N, K] (contracted along its
    dim 1) and a batch of token dims. dX likewise."""
    monkeypatch.setattr(training, "_FUSED_INTERPRET", fused)
    recipe = mx.Recipe(backend="fp8")
    x = jnp.zeros((2, 24, 64) if layout.startswith("tokens") else (48, 64), jnp.bfloat16)
    w = jnp.zeros((96, 64) if layout == "kernel [N, K]" else (64, 96), jnp.bfloat16)
    dims_ = (((x.ndim - 1,), (1 if layout == "kernel [N, K]" else 0,)), ((), ()))

    def step(x, w):
        y, pull = jax.vjp(lambda a, b: mx.dot_general(a, b, dims_, recipe=recipe), x, w)
        return pull(jnp.ones_like(y))

    closed = jax.make_jaxpr(step)(x, w)
    dx_chain, dw_chain = (_producer_chain(closed.jaxpr, v) for v in closed.jaxpr.outvars)
    assert dw_chain[-1] == "fp8_gemm" and "transpose" not in dw_chain, dw_chain
    assert dx_chain[-1] == "fp8_gemm" and "transpose" not in dx_chain, dx_chain
