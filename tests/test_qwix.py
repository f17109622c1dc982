"""jax_mxfp4.qwix: an unmodified Flax model (linen and nnx) quantized with qwix.quantize_model and
the jax_mxfp4 providers computes bit-identical outputs and gradients to the same model written with
jax_mxfp4.flax layers; unmatched modules are untouched; the serving provider stores MXFP4Array
weights through Qwix's parameter path and matches jax_mxfp4.flax.quantize_params."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

qwix = pytest.importorskip("qwix")
import flax.linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

import jax_mxfp4 as mx  # noqa: E402
import jax_mxfp4.flax as mxf  # noqa: E402
from jax_mxfp4.qwix import MxPtqProvider, MxQtProvider, MxRule, quantize_params  # noqa: E402

RECIPE = mx.Recipe()
W4A16 = mx.Recipe(quantize_activations=False)


def make_linen(dense, einsum, recipe=None):
    kw = {} if recipe is None else {"recipe": recipe}

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = dense(64, name="up", **kw)(x)
            h = einsum((64, 4, 16), "bk,khn->bhn", name="es", **kw)(jax.nn.gelu(h)).reshape(x.shape[0], 64)
            return nn.Dense(10, name="out")(h)  # never matched: stays Flax's float Dense

    return Net()


def x_of(rng, shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def same(a, b):
    return jax.tree.all(jax.tree.map(lambda u, v: bool(jnp.array_equal(u, v)), a, b))


def test_linen_training_provider_is_bit_identical_to_jax_mxfp4_layers(rng):
    x = x_of(rng, (8, 40))  # K=40: zero-padded to 64 inside, as the layers do
    plain = make_linen(nn.Dense, nn.Einsum)
    ours = make_linen(mxf.linen.Dense, mxf.linen.Einsum, RECIPE)
    qmodel = qwix.quantize_model(plain, MxQtProvider([MxRule(module_path="up|es", recipe=RECIPE)]))
    p = plain.init(jax.random.key(0), x)
    assert same(p, ours.init(jax.random.key(0), x))  # Flax's parameter names, shapes and initializers
    y = jax.jit(qmodel.apply)(p, x)
    np.testing.assert_array_equal(y, ours.apply(p, x))
    assert float(jnp.abs(y - plain.apply(p, x)).max()) > 0  # it did change the matched layers
    loss = lambda m: (lambda p: (m.apply(p, x) ** 2).sum())  # noqa: E731
    assert same(jax.grad(loss(qmodel))(p), jax.grad(loss(ours))(p))
    # under jit too (both jitted: stochastic-rounding keys hash dY's bits, which XLA's fusion
    # choices may change between eager and jit; jax_mxfp4/training.py)
    assert same(jax.jit(jax.grad(loss(qmodel)))(p), jax.jit(jax.grad(loss(ours)))(p))


def test_unmatched_modules_and_ops_are_untouched(rng):
    x = x_of(rng, (8, 64))
    plain = make_linen(nn.Dense, nn.Einsum)
    p = plain.init(jax.random.key(1), x)
    for rule in (MxRule(module_path="nothing_matches"), MxRule(module_path=".*", op_names=("conv_general_dilated",))):
        qmodel = qwix.quantize_model(plain, MxQtProvider([rule]))
        np.testing.assert_array_equal(qmodel.apply(p, x), plain.apply(p, x))
    # only "up" matched: the einsum and "out" are Flax's float ops, "up" is MXFP4
    qmodel = qwix.quantize_model(plain, MxQtProvider([MxRule(module_path="up", recipe=RECIPE)]))
    mixed = make_linen(lambda *a, **k: mxf.linen.Dense(*a, recipe=RECIPE, **k), nn.Einsum)
    np.testing.assert_array_equal(qmodel.apply(p, x), mixed.apply(p, x))


class NnxNet(nnx.Module):
    def __init__(self, linear, einsum, rngs, k=40, **kw):
        self.up = linear(k, 64, rngs=rngs, **kw)
        self.es = einsum("bk,khn->bhn", (64, 4, 16), (4, 16), rngs=rngs, **kw)
        self.out = nnx.Linear(64, 10, rngs=rngs)

    def __call__(self, x):
        return self.out(self.es(jax.nn.gelu(self.up(x))).reshape(x.shape[0], 64))


def test_nnx_training_provider_is_bit_identical_to_jax_mxfp4_layers(rng):
    x = x_of(rng, (8, 40))
    plain = NnxNet(nnx.Linear, nnx.Einsum, nnx.Rngs(0))
    ours = NnxNet(mxf.nnx.Linear, mxf.nnx.Einsum, nnx.Rngs(0), recipe=RECIPE)
    qmodel = qwix.quantize_model(plain, MxQtProvider([MxRule(module_path="up|es", recipe=RECIPE)]), x)
    np.testing.assert_array_equal(qmodel(x), ours(x))
    loss = lambda m: (m(x) ** 2).sum()  # noqa: E731
    assert same(nnx.to_pure_dict(nnx.grad(loss)(qmodel)), nnx.to_pure_dict(nnx.grad(loss)(ours)))


def test_linen_serving_provider_stores_mxfp4_weights_and_matches_quantize_params(rng):
    x = x_of(rng, (8, 32))
    plain = make_linen(nn.Dense, nn.Einsum)
    qmodel = qwix.quantize_model(plain, MxPtqProvider([MxRule(module_path="up|es", recipe=W4A16)]))
    p = plain.init(jax.random.key(2), x)
    abstract = jax.eval_shape(qmodel.init, jax.random.key(0), x)
    qp = quantize_params(p["params"], abstract["params"])
    for name, axis in (("up", 0), ("es", 0)):
        w = qp[name]["kernel"].array
        assert isinstance(w, mx.MXFP4Array) and w.axis == axis
    assert not hasattr(qp["out"]["kernel"], "array")
    ours = make_linen(mxf.linen.Dense, mxf.linen.Einsum, W4A16)
    want = ours.apply(mxf.quantize_params(p, model=ours, inputs=(x,)), x)
    np.testing.assert_array_equal(qmodel.apply({"params": qp}, x), want)  # both eager (XLA fusion may move 1 ulp)


def test_serving_provider_nnx_and_clear_error(rng):
    x = x_of(rng, (8, 32))
    plain = NnxNet(nnx.Linear, nnx.Einsum, nnx.Rngs(0), k=32)
    ours = NnxNet(mxf.nnx.Linear, mxf.nnx.Einsum, nnx.Rngs(0), k=32, recipe=W4A16)
    qmodel = qwix.quantize_model(plain, MxPtqProvider([MxRule(module_path="up|es", recipe=W4A16)]), x)
    assert isinstance(qmodel.up.kernel.array, mx.MXFP4Array)
    nnx.update(ours, mxf.quantize_params(nnx.state(ours, nnx.Param), model=ours))
    np.testing.assert_array_equal(qmodel(x), ours(x))
    bad = NnxNet(nnx.Linear, nnx.Einsum, nnx.Rngs(0), k=40)
    with pytest.raises(ValueError, match="'kernel' of module 'up'.*multiple of 32"):
        qwix.quantize_model(bad, MxPtqProvider([MxRule(module_path="up")]), x_of(rng, (8, 40)))
    with pytest.raises(TypeError, match="MxRule.recipe"):
        MxRule(recipe="a4w4")


@pytest.mark.slow
def test_demo_trains_through_qwix_like_the_layers(tmp_path):
    import train_lm as demo

    tiny = ["--steps", "3", "--quiet", "--batch", "2", "--seq-len", "32", "--d-model", "32", "--layers", "1",
            "--eval-batches", "1"]
    via_layers = demo.run(tiny + ["--out", str(tmp_path / "a")])
    via_qwix = demo.run(tiny + ["--out", str(tmp_path / "b"), "--via", "qwix"])
    assert via_qwix["via"] == "qwix"
    for name in ("bf16", "mxfp4"):
        # same parameters, same GEMMs: the same jitted step, so the same losses
        assert via_qwix[name]["train_curve"] == via_layers[name]["train_curve"]
        assert via_qwix[name]["eval_loss"] == via_layers[name]["eval_loss"]
