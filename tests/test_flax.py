"""Flax layers: parameters interchangeable with Flax's, numerics equal to jax_mxfp4.dense /
the float64 reference, toy training with optax, quantize_params and an orbax round trip."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
import flax.linen as nn
from flax import nnx

import jax_mxfp4 as mx
import jax_mxfp4.flax as mxf
from mx_reference import dequantize_ref, quantize_ref

BF16 = mx.Recipe(fprop="bf16", dgrad="bf16", wgrad="bf16")
NEAREST = mx.Recipe(grad_rounding="nearest", backend="xla")


def qdq(x, axis):
    x = np.asarray(x, np.float32)
    w = [(0, 0)] * x.ndim
    w[axis] = (0, (-x.shape[axis]) % 32)
    return dequantize_ref(*quantize_ref(np.pad(x, w), axis, "even"), axis)


def same_tree(a, b):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        assert x.shape == y.shape and x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_linen_dense_params_and_numerics():
    x = jax.random.normal(jax.random.key(1), (3, 5, 50))
    ours, theirs = mxf.linen.Dense(24, recipe=NEAREST), nn.Dense(24)
    p = ours.init(jax.random.key(0), x)
    same_tree(p, theirs.init(jax.random.key(0), x))  # same names, shapes, dtypes, init values
    p = jax.tree_util.tree_map(lambda a: a + 0.01, p)  # non-zero bias
    y = ours.apply(p, x)
    k, b = p["params"]["kernel"], p["params"]["bias"]
    want = qdq(np.asarray(x).reshape(15, 50), 1) @ qdq(k, 0) + np.asarray(b, np.float64)
    np.testing.assert_allclose(np.asarray(y).reshape(15, 24), want, rtol=0, atol=2e-6 * np.abs(want).max())
    # bf16 recipe ~ Flax's float32 Dense
    y_bf16 = mxf.linen.Dense(24, recipe=BF16).apply(p, x)
    np.testing.assert_allclose(y_bf16, theirs.apply(p, x), atol=0.05, rtol=0.02)


def test_linen_dense_dtype_follows_flax():
    x = jnp.ones((2, 64), jnp.bfloat16)
    m = mxf.linen.Dense(8, dtype=jnp.bfloat16, param_dtype=jnp.float32)
    p = m.init(jax.random.key(0), x)
    assert p["params"]["kernel"].dtype == jnp.float32
    assert m.apply(p, x).dtype == nn.Dense(8, dtype=jnp.bfloat16).apply(p, x).dtype == jnp.bfloat16


@pytest.mark.sweep(keep=1)
@pytest.mark.parametrize(
    "features,axis,batch_dims,shape",
    [((4, 5), (1, -1), (), (2, 3, 6, 7)), (6, -1, (0,), (3, 4, 40)), ((2, 3), -2, (), (5, 33, 2))],
)
def test_linen_dense_general_matches_flax(features, axis, batch_dims, shape):
    x = jax.random.normal(jax.random.key(2), shape)
    ours = mxf.linen.DenseGeneral(features, axis=axis, batch_dims=batch_dims, recipe=BF16)
    theirs = nn.DenseGeneral(features, axis=axis, batch_dims=batch_dims)
    p = ours.init(jax.random.key(0), x)
    same_tree(p, theirs.init(jax.random.key(0), x))
    p = jax.tree_util.tree_map(lambda a: a + 0.01, p)
    y, y_ref = ours.apply(p, x), theirs.apply(p, x)
    assert y.shape == y_ref.shape
    np.testing.assert_allclose(y, y_ref, atol=0.05, rtol=0.02)
    y4 = mxf.linen.DenseGeneral(features, axis=axis, batch_dims=batch_dims).apply(p, x)
    assert 0.005 < float(jnp.linalg.norm(y4 - y_ref) / jnp.linalg.norm(y_ref)) < 0.25  # MXFP4 error
    g = jax.grad(lambda p: jnp.sum(ours.apply(p, x) ** 2))(p)
    assert jax.tree_util.tree_structure(g) == jax.tree_util.tree_structure(p)


def test_lazy_flax_attribute():
    assert mx.flax.linen.Dense is mxf.linen.Dense and mx.flax.quantize_params is mxf.quantize_params


def test_dense_general_rejects_bad_batch_dims():
    with pytest.raises(ValueError, match="batch_dims"):
        mxf.linen.DenseGeneral(4, batch_dims=(1,)).init(jax.random.key(0), jnp.ones((2, 3, 32)))


def test_nnx_linear_state_matches_flax_and_trains():
    ours = mxf.nnx.Linear(50, 16, recipe=NEAREST, rngs=nnx.Rngs(0))
    theirs = nnx.Linear(50, 16, rngs=nnx.Rngs(0))
    same_tree(nnx.state(ours, nnx.Param), nnx.state(theirs, nnx.Param))
    x = jax.random.normal(jax.random.key(1), (32, 50))
    want = qdq(x, 1) @ qdq(ours.kernel.get_value(), 0)
    np.testing.assert_allclose(ours(x), want, atol=2e-6 * np.abs(want).max())
    with pytest.raises(TypeError, match="recipe must be a jax_mxfp4.Recipe"):
        mxf.nnx.Linear(4, 4, recipe="bf16", rngs=nnx.Rngs(0))


def _toy(seed=0, n=128, k=40, n_out=8):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (n, k))
    y = jnp.tanh(x @ jax.random.normal(kw, (k, n_out)) / np.sqrt(k))
    return x, y


@pytest.mark.slow
def test_linen_mlp_trains_with_optax():
    x, y = _toy()

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = jax.nn.gelu(mxf.linen.Dense(64)(x))
            return mxf.linen.DenseGeneral(8)(h)

    model = MLP()
    params = model.init(jax.random.key(0), x)
    opt = optax.adam(1e-2)
    state = opt.init(params)

    @jax.jit
    def step(params, state):
        loss, g = jax.value_and_grad(lambda p: jnp.mean((model.apply(p, x) - y) ** 2))(params)
        upd, state = opt.update(g, state)
        return optax.apply_updates(params, upd), state, loss

    losses = []
    for _ in range(30):
        params, state, loss = step(params, state)
        losses.append(float(loss))
    assert np.isfinite(losses).all()
    assert losses[-1] < 0.3 * losses[0], losses


def test_nnx_model_trains_with_optax():
    x, y = _toy(seed=1)

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.a = mxf.nnx.Linear(40, 64, rngs=rngs)
            self.b = mxf.nnx.Linear(64, 8, rngs=rngs)

        def __call__(self, x):
            return self.b(jax.nn.gelu(self.a(x)))

    model = MLP(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt):
        loss, g = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        opt.update(model, g)
        return loss

    losses = [float(step(model, opt)) for _ in range(30)]
    assert losses[-1] < 0.3 * losses[0], losses


def test_drop_in_dot_general_for_flax_layers():
    x = jax.random.normal(jax.random.key(3), (4, 64))
    ours = mxf.linen.Dense(16, recipe=NEAREST)
    p = ours.init(jax.random.key(0), x)
    flax_dense = nn.Dense(16, dot_general=lambda *a, **k: mx.dot_general(*a, **k, recipe=NEAREST))
    np.testing.assert_allclose(flax_dense.apply(p, x), ours.apply(p, x), atol=1e-6)
    lin = nnx.Linear(64, 16, dot_general=mx.dot_general, rngs=nnx.Rngs(0))
    assert lin(x).shape == (4, 16)


def test_quantize_params_inference_equals_mxfp4_forward():
    # fprop quantizes the weight along K with round-to-nearest: a pre-quantized kernel is the same.
    x = jax.random.normal(jax.random.key(4), (6, 50))
    m = mxf.linen.Dense(16)
    p = m.init(jax.random.key(0), x)
    q = mxf.quantize_params(p)
    kq = q["params"]["kernel"]
    assert isinstance(kq, mx.MXFP4Array) and kq.shape == (64, 16) and kq.axis == 0  # K padded 50 -> 64
    assert not isinstance(q["params"]["bias"], mx.MXFP4Array)
    np.testing.assert_allclose(m.apply(q, x), m.apply(p, x), rtol=0, atol=1e-6)
    # gradients w.r.t. the activations still flow through a quantized kernel
    gx = jax.grad(lambda x: jnp.sum(m.apply(q, x)))(x)
    assert gx.shape == x.shape and bool(jnp.all(jnp.isfinite(gx)))
    # nnx: quantize the Param state and update the module
    lin = mxf.nnx.Linear(50, 16, rngs=nnx.Rngs(0))
    y_float = lin(x)
    nnx.update(lin, mxf.quantize_params(nnx.state(lin, nnx.Param)))
    assert isinstance(lin.kernel.get_value(), mx.MXFP4Array)
    np.testing.assert_allclose(lin(x), y_float, rtol=0, atol=1e-6)
    # DenseGeneral with one input axis
    g = mxf.linen.DenseGeneral((2, 8))
    pg = g.init(jax.random.key(1), x)
    np.testing.assert_allclose(g.apply(mxf.quantize_params(pg), x), g.apply(pg, x), rtol=0, atol=1e-6)


def test_quantize_params_select_and_errors():
    p = {"params": {"kernel": jnp.ones((64, 4)), "w": jnp.ones((4, 64)), "scale": jnp.ones((64,))}}
    q = mxf.quantize_params(p, select=lambda path, leaf: 1 if path[-1] == "w" else None)
    assert isinstance(q["params"]["w"], mx.MXFP4Array) and q["params"]["w"].axis == 1
    assert not isinstance(q["params"]["kernel"], mx.MXFP4Array)
    with pytest.raises(ValueError, match="scale_mode must be one of"):
        mxf.quantize_params(p, scale_mode="nearest")


def test_orbax_round_trip_is_bit_exact(tmp_path):
    x = jnp.ones((2, 96))
    m = mxf.linen.Dense(40)
    q = mxf.quantize_params(m.init(jax.random.key(0), x), scale_layout="swizzled")
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "q", q)
    ckpt.wait_until_finished()
    r = ckpt.restore(tmp_path / "q", mxf.abstract_params(q))
    kq, kr = q["params"]["kernel"], r["params"]["kernel"]
    assert isinstance(kr, mx.MXFP4Array) and kr.scale_layout == "swizzled" and kr.shape == kq.shape
    np.testing.assert_array_equal(np.asarray(kr.data), np.asarray(kq.data))
    np.testing.assert_array_equal(np.asarray(kr.scales).view(np.uint8), np.asarray(kq.scales).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(r["params"]["bias"]), np.asarray(q["params"]["bias"]))
    np.testing.assert_array_equal(np.asarray(m.apply(r, x)), np.asarray(m.apply(q, x)))



@pytest.mark.slow
def test_layers_take_a_prepared_kernel(rng):
    """A DecodePrepared / FP8Prepared kernel in a layer's params: the nnx layer took it, while
    linen reported its children as a kernel of the wrong shape (Flax's ScopeParamShapeError). Now
    every layer takes it: the same output as the MXFP4Array kernel, bit for bit, equal to the
    float64 reference, and a finite input gradient."""
    x = jnp.asarray(rng.standard_normal((4, 64)), jnp.float32)
    w = rng.standard_normal((64, 96)).astype(np.float32)
    q = mx.quantize(jnp.asarray(w), 0)
    ref = dequantize_ref(*quantize_ref(np.asarray(x), 1, "even"), 1) @ dequantize_ref(*quantize_ref(w, 0, "even"), 0)
    layers = (mxf.linen.Dense(96, use_bias=False), mxf.linen.DenseGeneral(96, use_bias=False),
              mxf.linen.Einsum((64, 96), "mk,kn->mn", use_bias=False))
    for layer in layers:
        want = np.asarray(layer.apply({"params": {"kernel": q}}, x))
        np.testing.assert_allclose(want.astype(np.float64), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
        for prepared in (mx.prepare_decode(q), mx.prepare_fp8(q)):
            f = lambda xx, k=prepared: layer.apply({"params": {"kernel": k}}, xx)  # noqa: E731
            np.testing.assert_array_equal(np.asarray(f(x)), want, err_msg=f"{type(layer).__name__} {type(prepared).__name__}")
            assert np.isfinite(np.asarray(jax.grad(lambda xx: f(xx).sum())(x))).all()
    lin = mxf.nnx.Linear(64, 96, use_bias=False, rngs=nnx.Rngs(0))
    for k in (q, mx.prepare_decode(q), mx.prepare_fp8(q)):
        lin.kernel.value = k
        np.testing.assert_allclose(np.asarray(lin(x), np.float64), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
