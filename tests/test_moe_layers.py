"""MXFP4 expert layers (linen/nnx ``RaggedDense``), the Qwix ``ragged_dot`` interception and
expert parallelism on 8 simulated CPU devices.

References: NumPy float64 per group through the oracle of tests/mx_reference.py (``qdq``, ``pad``),
and bit-for-bit equality with :func:`jax_mxfp4.ragged_dot` on the zero-padded operands (the
layers' documented path). "Equal" to float64 means within 2e-6 of the largest magnitude (float32
accumulation), far below the ~1e-1 effect of a wrong axis, group or padding.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_mxfp4 as mx
import jax_mxfp4.flax as mxf
from jax_mxfp4 import qwix as mq
from jax_mxfp4.flax import linen as mxl
from jax_mxfp4.flax import nnx as mxn

from mx_reference import pad, qdq

NEAREST = mx.Recipe(grad_rounding="nearest")
E, N = 3, 48
GS_EMPTY_AND_TAIL = np.array([33, 0, 30], np.int32)  # an empty expert; rows 63..69 in no group


def bounds(gs):
    ends = np.cumsum(gs)
    return [(int(e - s), int(e)) for s, e in zip(gs, ends)]


def layer_ref(x, kernel, bias, gs):
    """float64 [M, N]: each group's rows, K zero-padded to 32 and quantized along K, times its
    expert (padded, quantized along K), plus its bias; rows past sum(gs): 0."""
    x = pad(np.asarray(x, np.float32), 1)
    out = np.zeros((x.shape[0], kernel.shape[2]))
    for g, (a, b) in enumerate(bounds(gs)):
        out[a:b] = qdq(x[a:b], 1) @ qdq(pad(np.asarray(kernel[g], np.float32), 0), 0)
        if bias is not None:
            out[a:b] += np.asarray(bias[g], np.float64)
    return out


def assert_close_f32(got, want, rel=2e-6):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=rel * max(np.abs(want).max(), 1e-30))


def normal(rng, *shape, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)


def padded(x, axis):
    return jnp.asarray(pad(np.asarray(x), axis))


# ----------------------------------------------------------------------------- layers
def test_linen_forward_odd_k_empty_expert_tail_rows_against_float64(rng):
    x, gs = normal(rng, 70, 40), jnp.asarray(GS_EMPTY_AND_TAIL)  # K = 40: padded to 64
    layer = mxl.RaggedDense(E, N, use_bias=True, recipe=NEAREST)
    params = layer.init(jax.random.key(0), x, gs)
    assert jax.tree.map(jnp.shape, params) == {"params": {"kernel": (E, 40, N), "bias": (E, N)}}
    bias = normal(rng, E, N)
    params = {"params": {"kernel": params["params"]["kernel"], "bias": bias}}
    y = jax.jit(layer.apply)(params, x, gs)
    kernel = params["params"]["kernel"]
    assert_close_f32(y, layer_ref(x, kernel, bias, GS_EMPTY_AND_TAIL))
    assert np.all(np.asarray(y)[63:] == 0)  # no bias on rows past the groups
    plain = mx.ragged_dot(padded(x, 1), padded(kernel, 1), gs)
    rows = np.repeat(np.arange(E), GS_EMPTY_AND_TAIL)
    np.testing.assert_array_equal(np.asarray(y)[:63], np.asarray(plain)[:63] + np.asarray(bias)[rows])


def test_default_kernel_init_fan_in_is_k_per_expert():
    layer = mxl.RaggedDense(8, 64)
    kernel = layer.init(jax.random.key(0), jnp.zeros((4, 64)), jnp.zeros(8, jnp.int32))["params"]["kernel"]
    # lecun_normal per expert: std 1/sqrt(K) = 0.125 (fan-in E*K would give 0.044)
    assert abs(float(np.std(kernel)) - 0.125) < 0.01


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_quantize_params_kernel_along_k_bit_identical(rng, api):
    x, gs = normal(rng, 70, 40), jnp.asarray(GS_EMPTY_AND_TAIL)
    if api == "linen":
        layer = mxl.RaggedDense(E, N, use_bias=True)
        params = layer.init(jax.random.key(1), x, gs)
        want = layer.apply(params, x, gs)
        q = mxf.quantize_params(params, model=layer, inputs=(x, gs))
        kernel, got = q["params"]["kernel"], layer.apply(q, x, gs)
    else:
        layer = mxn.RaggedDense(E, 40, N, use_bias=True, rngs=nnx.Rngs(1))
        want = layer(x, gs)
        q = mxf.quantize_params(nnx.state(layer, nnx.Param), model=layer)
        nnx.update(layer, q)
        kernel, got = layer.kernel.get_value(), layer(x, gs)
    assert isinstance(kernel, mx.MXFP4Array) and kernel.axis == 1 and kernel.shape == (E, 64, N)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_nnx_equals_linen_values_and_gradients(rng):
    x, gs = normal(rng, 70, 40), jnp.asarray(GS_EMPTY_AND_TAIL)
    dy = normal(rng, 70, N)
    lin = mxl.RaggedDense(E, N, use_bias=True, recipe=NEAREST)
    params = lin.init(jax.random.key(2), x, gs)
    params["params"]["bias"] = normal(rng, E, N)
    layer = mxn.RaggedDense(E, 40, N, use_bias=True, recipe=NEAREST, rngs=nnx.Rngs(0))
    layer.kernel.set_value(params["params"]["kernel"])
    layer.bias.set_value(params["params"]["bias"])

    gm, gx = nnx.grad(lambda m, x: jnp.vdot(m(x, gs), dy), argnums=(0, 1))(layer, x)
    g_nnx = (gm["kernel"].get_value(), gm["bias"].get_value(), gx)
    g_lin = jax.grad(lambda p, x: jnp.vdot(lin.apply(p, x, gs), dy), argnums=(0, 1))(params, x)
    for a, b in zip(g_nnx, (g_lin[0]["params"]["kernel"], g_lin[0]["params"]["bias"], g_lin[1])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # bias gradient: each expert's rows of dY summed (rows past the groups count in none)
    want = np.stack([np.asarray(dy)[a:b].sum(0) for a, b in bounds(GS_EMPTY_AND_TAIL)])
    np.testing.assert_allclose(np.asarray(g_nnx[1]), want, rtol=1e-5, atol=1e-5)


def test_layer_gradients_equal_ragged_dot_on_padded_operands_stochastic_key(rng, jax_key):
    x, gs = normal(rng, 70, 40), jnp.asarray(GS_EMPTY_AND_TAIL)
    kernel, dy = normal(rng, E, 40, N, scale=0.2), normal(rng, 70, N)
    layer = mxn.RaggedDense(E, 40, N, rngs=nnx.Rngs(0))  # Recipe(): stochastic dY

    layer.kernel.set_value(kernel)

    def via_layer(m, x):
        return jnp.vdot(m(x, gs, rngs=jax_key), dy)

    def via_ragged(x, kernel):
        y = mx.ragged_dot(jnp.pad(x, ((0, 0), (0, 24))), jnp.pad(kernel, ((0, 0), (0, 24), (0, 0))), gs, key=jax_key)
        return jnp.vdot(y, dy)

    gm, gx = nnx.grad(via_layer, argnums=(0, 1))(layer, x)
    for a, b in zip((gx, gm["kernel"].get_value()), jax.jit(jax.grad(via_ragged, (0, 1)))(x, kernel)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_linen_rounding_stream_gives_fresh_and_reproducible_noise(rng):
    x, gs, dy = normal(rng, 64, 64), jnp.array([40, 24, 0], jnp.int32), normal(rng, 64, N)
    layer = mxl.RaggedDense(E, N)
    params = layer.init(jax.random.key(0), x, gs)
    loss = lambda p, k: jnp.vdot(layer.apply(p, x, gs, rngs={"stochastic_rounding": k}), dy)
    grad = jax.jit(jax.grad(loss))
    g1, g1b, g2 = (grad(params, jax.random.key(s))["params"]["kernel"] for s in (1, 1, 2))
    np.testing.assert_array_equal(np.asarray(g1), np.asarray(g1b))
    assert not np.array_equal(np.asarray(g1), np.asarray(g2))


@pytest.mark.parametrize("case", ["inputs_3d", "mxfp4_k_mismatch", "recipe_type", "group_sizes_length"])
def test_layer_errors_name_argument_and_rule(rng, case):
    x, gs = normal(rng, 8, 64), jnp.array([4, 4, 0], jnp.int32)
    layer = mxl.RaggedDense(E, N)
    params = layer.init(jax.random.key(0), x, gs)
    if case == "inputs_3d":
        with pytest.raises(ValueError, match=r"inputs must be 2-D \[M, K\]"):
            layer.apply(params, x.reshape(2, 4, 64), gs)
    elif case == "mxfp4_k_mismatch":
        q = mxf.quantize_params(params, model=layer, inputs=(x, gs))
        with pytest.raises(ValueError, match="inputs has K=96 but the MXFP4Array kernel has K=64"):
            layer.apply(q, normal(rng, 8, 96), gs)
    elif case == "recipe_type":
        with pytest.raises(TypeError, match="recipe must be a jax_mxfp4.Recipe"):
            mxn.RaggedDense(E, 64, N, recipe="mxfp4", rngs=nnx.Rngs(0))
    else:
        with pytest.raises(ValueError, match=r"group_sizes has 2 entries but the kernel has 3 experts \(num_experts"):
            layer.apply(params, x, jnp.array([4, 4], jnp.int32))


# ----------------------------------------------------------------------------- Qwix
class _Experts(nn.Module):
    """An unmodified Flax MoE expert block: plain ``jax.lax.ragged_dot``."""

    features: int

    @nn.compact
    def __call__(self, x, gs):
        kernel = self.param("kernel", mxl.default_expert_kernel_init, (gs.shape[0], x.shape[-1], self.features))
        return jax.lax.ragged_dot(x, kernel, gs)


class _Net(nn.Module):
    plain: bool

    @nn.compact
    def __call__(self, x, gs):
        layer = _Experts(N, name="experts") if self.plain else mxl.RaggedDense(E, N, name="experts")
        return jnp.tanh(layer(x, gs))


def test_qwix_training_equals_layer_values_and_gradients_stochastic_stream(rng, jax_key):
    x, gs = normal(rng, 70, 40), jnp.asarray(GS_EMPTY_AND_TAIL)
    params = _Net(False).init(jax.random.key(0), x, gs)
    qmodel = qwix.quantize_model(_Net(True), mq.MxQtProvider([mq.MxRule(module_path=".*")]))
    rngs = {"stochastic_rounding": jax_key}

    def run(model):
        loss = lambda p, x: (model.apply(p, x, gs, rngs=rngs) ** 2).sum()
        return jax.jit(jax.value_and_grad(loss, (0, 1)))(params, x)

    (v1, (gp1, gx1)), (v2, (gp2, gx2)) = run(_Net(False)), run(qmodel)
    assert v1 == v2
    np.testing.assert_array_equal(np.asarray(gx1), np.asarray(gx2))
    np.testing.assert_array_equal(np.asarray(gp1["params"]["experts"]["kernel"]),
                                  np.asarray(gp2["params"]["experts"]["kernel"]))


def test_qwix_rule_for_other_ops_leaves_ragged_dot_to_lax(rng):
    x, gs = normal(rng, 70, 64), jnp.asarray(GS_EMPTY_AND_TAIL)
    params = _Net(True).init(jax.random.key(0), x, gs)
    qmodel = qwix.quantize_model(_Net(True), mq.MxQtProvider([mq.MxRule(module_path=".*", op_names=("dot_general",))]))
    np.testing.assert_array_equal(np.asarray(qmodel.apply(params, x, gs)), np.asarray(_Net(True).apply(params, x, gs)))


def test_qwix_serving_stores_mxfp4_experts_equal_to_layer_quantize_params(rng):
    x, gs = normal(rng, 70, 64), jnp.asarray(GS_EMPTY_AND_TAIL)
    params = _Net(False).init(jax.random.key(0), x, gs)
    smodel = qwix.quantize_model(_Net(True), mq.MxPtqProvider([mq.MxRule(module_path=".*")]))
    abstract = jax.eval_shape(smodel.init, jax.random.key(0), x, gs)
    served = mq.quantize_params(params["params"], abstract["params"])
    assert isinstance(served["experts"]["kernel"].array, mx.MXFP4Array)
    assert served["experts"]["kernel"].array.axis == 1
    got = jax.jit(smodel.apply)({"params": served}, x, gs)
    q = mxf.quantize_params(params, model=_Net(False), inputs=(x, gs))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(_Net(False).apply)(q, x, gs)))
    assert_close_f32(np.tanh(layer_ref(x, params["params"]["experts"]["kernel"], None, GS_EMPTY_AND_TAIL)), got)


def test_qwix_serving_k_not_multiple_of_32_names_module(rng):
    x, gs = normal(rng, 8, 40), jnp.array([4, 4, 0], jnp.int32)
    smodel = qwix.quantize_model(_Net(True), mq.MxPtqProvider([mq.MxRule(module_path=".*")]))
    with pytest.raises(ValueError, match="weight 'kernel' of module 'experts'.*multiple of 32"):
        smodel.init(jax.random.key(0), x, gs)


@pytest.mark.slow
def test_qwix_nnx_training_equals_nnx_layer(rng):
    x, gs = normal(rng, 70, 64), jnp.asarray(GS_EMPTY_AND_TAIL)

    class Experts(nnx.Module):
        def __init__(self, rngs):
            self.kernel = nnx.Param(mxl.default_expert_kernel_init(rngs.params(), (E, 64, N)))

        def __call__(self, x, gs):
            return jax.lax.ragged_dot(x, self.kernel[...], gs)

    plain = Experts(nnx.Rngs(0))
    layer = mxn.RaggedDense(E, 64, N, recipe=NEAREST, rngs=nnx.Rngs(0))
    layer.kernel.set_value(plain.kernel.get_value())
    qmodel = qwix.quantize_model(plain, mq.MxQtProvider([mq.MxRule(module_path=".*", recipe=NEAREST)]), x, gs)
    loss = lambda m, x: (m(x, gs) ** 2).sum()
    g1, g2 = nnx.grad(loss, argnums=(0, 1))(qmodel, x), nnx.grad(loss, argnums=(0, 1))(layer, x)
    np.testing.assert_array_equal(np.asarray(g1[1]), np.asarray(g2[1]))
    np.testing.assert_array_equal(np.asarray(g1[0]["kernel"].get_value()), np.asarray(g2[0]["kernel"].get_value()))


# ----------------------------------------------------------------------------- expert parallelism
needs8 = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")


@needs8
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_experts_sharded_tokens_sharded_equal_one_device(rng, axis_type):
    """Experts [E, K, N] sharded over "expert" (4), tokens over "data" (2): outputs and gradients
    bit-identical to one device (each element is the same float32 arithmetic: no shard splits a
    contraction); the scalar loss, a sum over token shards, within float32 reassociation."""
    e, m = 4, 64
    x, w, dy = normal(rng, m, 64), normal(rng, e, 64, N, scale=0.2), normal(rng, m, N)
    gs = jnp.array([10, 20, 0, 30], jnp.int32)  # an empty expert, 4 rows in no group
    layer = mxl.RaggedDense(e, N, recipe=NEAREST)
    step = jax.jit(jax.value_and_grad(lambda p, x, gs: jnp.vdot(layer.apply(p, x, gs), dy), (0, 1)))
    want_v, (want_p, want_x) = step({"params": {"kernel": w}}, x, gs)
    mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(axis_type,) * 2)
    xs = jax.device_put(x, NamedSharding(mesh, P("data", None)))
    ws = jax.device_put(w, NamedSharding(mesh, P("expert", None, None)))
    gss = jax.device_put(gs, NamedSharding(mesh, P()))
    with jax.set_mesh(mesh):
        v, (gp, gx) = step({"params": {"kernel": ws}}, xs, gss)
        y = jax.jit(lambda x, w, gs: mx.ragged_dot(x, w, gs))(xs, ws, gss)
    np.testing.assert_allclose(float(v), float(want_v), rtol=1e-6)  # the loss sums over token shards
    np.testing.assert_array_equal(np.asarray(gx), np.asarray(want_x))
    np.testing.assert_array_equal(np.asarray(gp["params"]["kernel"]), np.asarray(want_p["params"]["kernel"]))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(mx.ragged_dot(x, w, gs)))
    if axis_type == AxisType.Explicit:  # outputs typed as their operands: tokens as x, dW as W
        assert tuple(jax.typeof(y).sharding.spec)[:1] == ("data",)
        assert tuple(gp["params"]["kernel"].sharding.spec)[:1] == ("expert",)


@needs8
@pytest.mark.slow
def test_mxfp4_experts_sharded_on_explicit_mesh_equal_one_device(rng):
    x, w = normal(rng, 64, 64), normal(rng, 4, 64, N)
    gs = jnp.array([16, 16, 16, 16], jnp.int32)
    q = mx.quantize(w, 1)
    mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(AxisType.Explicit,) * 2)
    qs = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, P("expert"))), q)
    xs = jax.device_put(x, NamedSharding(mesh, P("data", None)))
    with jax.set_mesh(mesh):
        y = jax.jit(lambda x, q: mx.ragged_dot(x, q, gs))(xs, qs)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(mx.ragged_dot(x, q, gs)))
