"""One weight-quantization path for training and serving (the Flax layers quantize the
``param_dtype`` kernel, as ``quantize_params`` does), and the key source of every stochastic
draw (an explicit ``key``, a Flax RNG stream, the data-derived fallback). Expected values come
from the NumPy float64 + ml_dtypes oracle (tests/mx_reference.py) or from ``jax_mxfp4.quantize``
driven by the documented key."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import jax_mxfp4 as mx
import jax_mxfp4.flax as mxf
from mx_reference import pad, qdq

DIMS2 = (((1,), (0,)), ((), ()))


def bits(x):
    return np.asarray(x).view(np.uint16 if np.asarray(x).dtype.itemsize == 2 else np.uint32)


# ----------------------------------------------------------------------------- (c) weight path
def test_issue_case_nnx_bf16_trains_and_serves_the_same_weights(rng):
    """Issue case (c): nnx.Linear(64, 32, dtype=bfloat16) on a bf16 [4, 64] input, then the same
    input after quantize_params: bit-identical outputs. The float64 oracle confirms the forward
    used the float32 kernel's MXFP4 values (which differ from those of bfloat16(kernel))."""
    layer = mxf.nnx.Linear(64, 32, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    x = jnp.asarray(rng.standard_normal((4, 64)), jnp.bfloat16)
    kernel = np.asarray(layer.kernel.get_value(), np.float32)
    trained = layer(x)
    nnx.update(layer, mxf.quantize_params(nnx.state(layer, nnx.Param)))
    served = layer(x)
    assert trained.dtype == served.dtype == jnp.bfloat16
    np.testing.assert_array_equal(bits(trained), bits(served))
    # the fault this guards against is present in this kernel: bf16 rounding changes some codes
    via_bf16 = qdq(kernel.astype(ml_dtypes.bfloat16).astype(np.float32), 0)
    assert (via_bf16 != qdq(kernel, 0)).any()
    ref = qdq(np.asarray(x, np.float32), 1) @ qdq(kernel, 0)  # bias is zero
    ref_bf16 = ref.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
    np.testing.assert_allclose(np.asarray(trained, np.float64), ref_bf16, rtol=2**-7, atol=1e-6)


def _layers(rng, k, dtype, param_dtype, use_bias):
    """(name, init-and-apply callables) for every Flax layer: returns (train_fn, serve_fn)."""
    x = jnp.asarray(rng.standard_normal((3, 5, k)), jnp.bfloat16)

    def linen(module):
        params = module.init(jax.random.key(1), x)
        params = jax.tree.map(lambda p: p + 0.01 * jnp.arange(p.size, dtype=p.dtype).reshape(p.shape) % 0.07, params)
        return (lambda: module.apply(params, x)), (lambda: module.apply(mxf.quantize_params(params), x))

    kw = dict(dtype=dtype, param_dtype=param_dtype, use_bias=use_bias)
    yield "linen.Dense", linen(mxf.linen.Dense(24, **kw))
    yield "linen.DenseGeneral", linen(mxf.linen.DenseGeneral(24, **kw))
    lin = mxf.nnx.Linear(k, 24, rngs=nnx.Rngs(2), **kw)
    if use_bias:
        lin.bias.set_value(jnp.linspace(-1, 1, 24).astype(param_dtype))
    trained = lin(x)

    def serve():
        nnx.update(lin, mxf.quantize_params(nnx.state(lin, nnx.Param)))
        return lin(x)

    yield "nnx.Linear", ((lambda: trained), serve)


@pytest.mark.sweep(keep=2)
@pytest.mark.parametrize("k", [64, 50])
@pytest.mark.parametrize("dtype,param_dtype,use_bias", [
    (jnp.bfloat16, jnp.float32, True),   # the issue's layout: compute bf16, params float32
    (None, jnp.float32, False),          # promoted dtype from a bf16 input and a float32 kernel
    (jnp.float32, jnp.bfloat16, True),   # bf16 params, float32 compute
    (jnp.float16, jnp.float32, True),
])
def test_every_layer_serves_bit_identically_to_its_trained_forward(k, dtype, param_dtype, use_bias, rng):
    for name, (train, serve) in _layers(rng, k, dtype, param_dtype, use_bias):
        a, b = train(), serve()
        assert a.dtype == b.dtype, name
        np.testing.assert_array_equal(bits(a), bits(b), err_msg=name)


def test_orbax_restore_serves_the_trained_forward(tmp_path, rng):
    """train forward == quantize_params -> orbax save -> restore(abstract_params) -> serve."""
    model = mxf.linen.Dense(32, dtype=jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((8, 96)), jnp.bfloat16)
    params = model.init(jax.random.key(3), x)
    q = mxf.quantize_params(params)
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "q", q)
    ckpt.wait_until_finished()
    restored = ckpt.restore(tmp_path / "q", mxf.abstract_params(q))
    np.testing.assert_array_equal(bits(model.apply(params, x)), bits(model.apply(restored, x)))


def test_kernel_gradient_keeps_param_dtype_and_scale_rule_mismatch_is_an_error():
    model = mxf.linen.Dense(16, dtype=jnp.bfloat16, recipe=mx.Recipe(scale_mode="rceil"))
    x = jnp.ones((4, 64), jnp.bfloat16)
    params = model.init(jax.random.key(0), x)
    g = jax.grad(lambda p: jnp.sum(model.apply(p, x).astype(jnp.float32)))(params)
    assert g["params"]["kernel"].dtype == jnp.float32
    with pytest.raises(ValueError, match=r"scale_mode='even', but this layer's recipe trains with scale_mode='rceil'"):
        model.apply(mxf.quantize_params(params), x)
    model.apply(mxf.quantize_params(params, scale_mode="rceil"), x)


# ----------------------------------------------------------------------------- (d) keys
def _dgrad_of_linear_loss(key, x, w):
    """dX of sum(0.3 * dense(x, w)): dY is the constant 0.3 whatever x is (the issue's case)."""
    return jax.grad(lambda a: jnp.sum(0.3 * mx.dense(a, w, key=key)))(x)


def test_issue_case_fresh_key_per_step_averages_out_the_rounding_noise(rng):
    """Issue case (d): loss = sum(0.3 * dense(x, W)), 32x32, fresh x every step. With a key per
    step (fold_in(seed, step)) the mean dgrad converges to its expectation (float64 oracle:
    0.3 * ones @ Q_nearest(W along N)^T, stochastic rounding being unbiased); with the
    data-derived fallback every step draws the same noise and the mean never moves."""
    w = jnp.asarray(rng.standard_normal((32, 32)) * 0.5, jnp.float32)
    xs = jnp.asarray(rng.standard_normal((256, 32, 32)), jnp.float32)
    expected = 0.3 * np.ones((32, 32)) @ qdq(np.asarray(w), 1).T
    seed = jax.random.key(int(rng.integers(1 << 31)))
    fresh = jax.jit(jax.vmap(lambda i, x: _dgrad_of_linear_loss(jax.random.fold_in(seed, i), x, w)))(
        jnp.arange(256), xs)
    fallback = jax.jit(jax.vmap(lambda x: _dgrad_of_linear_loss(None, x, w)))(xs)

    def err(d, steps):
        return float(np.mean(np.abs(np.asarray(d[:steps], np.float64).mean(0) - expected)))

    assert err(fresh, 1) > 0.05  # one draw is noisy ...
    assert err(fresh, 256) < 0.25 * err(fresh, 1)  # ... 256 fresh ones average out (~1/16)
    np.testing.assert_array_equal(np.asarray(fallback), np.broadcast_to(fallback[0], fallback.shape))
    assert err(fallback, 256) == pytest.approx(err(fallback, 1))


def test_explicit_key_is_the_documented_source_of_both_passes(rng):
    """dgrad rounds dY with fold_in(key, 1), wgrad with fold_in(key, 2): rebuilt here with
    jax_mxfp4.quantize on the canonical [1, M, N] dY and float64 products."""
    m, k, n = 40, 64, 48  # N and M padded to 64 inside
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((k, n)) * 0.1, jnp.float32)
    c = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
    key = jax.random.key(int(rng.integers(1 << 31)))
    recipe = mx.Recipe(backend="xla")
    _, pull = jax.vjp(lambda a, b: mx.dot_general(a, b, DIMS2, recipe=recipe, key=key), x, w)
    dx, dw = pull(c)
    c3 = jnp.asarray(np.asarray(c)[None])

    def sr(g, axis, tag):
        g = jnp.asarray(pad(np.asarray(g), axis))
        q = mx.quantize(g, axis, rounding="stochastic", key=jax.random.fold_in(key, tag))
        return np.asarray(mx.dequantize(q), np.float64)[0]

    want_dx = sr(c3, 2, 1) @ qdq(pad(np.asarray(w), 1), 1).T
    want_dw = qdq(pad(np.asarray(x), 0), 0).T @ sr(c3, 1, 2)
    for got, want in ((dx, want_dx), (dw, want_dw)):
        err = np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max()
        assert err < 2e-6, err
    # another key gives other noise; the same key the same bits
    _, pull2 = jax.vjp(lambda a, b: mx.dot_general(a, b, DIMS2, recipe=recipe, key=jax.random.fold_in(key, 9)), x, w)
    assert not np.array_equal(np.asarray(pull2(c)[0]), np.asarray(dx))
    np.testing.assert_array_equal(np.asarray(pull(c)[0]), np.asarray(dx))


def test_key_with_a_pre_quantized_weight_legacy_keys_and_vmap(rng):
    """The key also drives dgrad through an MXFP4Array weight; legacy uint32[2] keys work; under
    vmap each example may carry its own key."""
    x = jnp.asarray(rng.standard_normal((40, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((64, 24)), jnp.float32)
    wq = mx.quantize(w, axis=0)
    g = lambda k: jax.grad(lambda a: jnp.sum(mx.dense(a, wq, key=k) ** 2))(x)  # noqa: E731
    np.testing.assert_array_equal(g(jax.random.key(3)), g(jax.random.key(3)))
    assert not np.array_equal(g(jax.random.key(3)), g(jax.random.key(4)))
    np.testing.assert_array_equal(g(jax.random.PRNGKey(3)), g(jax.random.PRNGKey(3)))
    keys = jax.random.split(jax.random.key(0), 2)
    per_example = jax.vmap(lambda a, k: jax.grad(lambda a: jnp.sum(mx.dense(a, w, key=k) ** 2))(a))(
        jnp.stack([x, x]), keys)
    assert not np.array_equal(per_example[0], per_example[1])
    np.testing.assert_array_equal(per_example[1], jax.grad(lambda a: jnp.sum(mx.dense(a, w, key=keys[1]) ** 2))(x))


def test_bad_key_is_rejected_at_the_call():
    with pytest.raises(TypeError, match="key must be one PRNG key"):
        mx.dense(jnp.ones((4, 32)), jnp.ones((32, 8)), key=jnp.ones((3,)))


def test_linen_rng_stream_gives_reproducible_fresh_noise_and_falls_back_without_it(rng):
    model = mxf.linen.Dense(24)
    x = jnp.asarray(rng.standard_normal((40, 64)), jnp.float32)
    params = model.init(jax.random.key(0), x)

    def grads(rngs):
        return jax.jit(jax.grad(lambda p: jnp.sum(model.apply(p, x, rngs=rngs) ** 2)))(params)["params"]["kernel"]

    k0, k1 = jax.random.key(10), jax.random.key(11)
    g0 = grads({"stochastic_rounding": k0})
    np.testing.assert_array_equal(g0, grads({"stochastic_rounding": k0}))
    assert not np.array_equal(g0, grads({"stochastic_rounding": k1}))
    # without the stream: the data-derived fallback, i.e. dense(..., key=None)
    fallback = jax.grad(lambda w: jnp.sum(mx.dense(x, w, params["params"]["bias"]) ** 2))(params["params"]["kernel"])
    np.testing.assert_array_equal(grads(None), fallback)


def test_nnx_key_sources(rng):
    """Call-time rngs (a key) equals dense(..., key=key); a stream given at construction
    advances every call under nnx.jit and replays from the same seed."""
    x = jnp.asarray(rng.standard_normal((40, 64)), jnp.float32)
    lin = mxf.nnx.Linear(64, 24, rngs=nnx.Rngs(0))
    key = jax.random.key(5)
    g = nnx.grad(lambda m: jnp.sum(m(x, rngs=key) ** 2))(lin)
    want = jax.grad(lambda w: jnp.sum(mx.dense(x, w, lin.bias.get_value(), key=key) ** 2))(lin.kernel.get_value())
    np.testing.assert_array_equal(g.kernel.get_value(), want)

    def run():
        layer = mxf.nnx.Linear(64, 24, rngs=nnx.Rngs(0), rounding_rngs=nnx.Rngs(stochastic_rounding=3))
        step = nnx.jit(lambda m: nnx.grad(lambda m: jnp.sum(m(x) ** 2))(m).kernel.get_value())
        return [np.asarray(step(layer)) for _ in range(2)]

    a, b = run(), run()
    assert not np.array_equal(a[0], a[1])  # fresh noise every step
    np.testing.assert_array_equal(a[0], b[0])  # reproducible from the seed
    np.testing.assert_array_equal(a[1], b[1])
