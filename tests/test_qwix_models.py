"""jax_mxfp4.qwix on model code written without jax_mxfp4 in mind (tests/lm_model.py: RMSNorm,
MQA/GQA/MHA attention through jnp.einsum, a gated MLP with ``x @ self.param(...)``, a tied
embedding through ``nn.Embed.attend``, nn.scan/nn.remat blocks) under a catch-all MxRule:
every GEMM computes what calling jax_mxfp4 directly computes; keys drawn for stochastic rounding
are never captured across traces; jax.numpy's jitted matmul/dot/inner are intercepted even when
they were traced before without the provider."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

qwix = pytest.importorskip("qwix")
from flax import nnx  # noqa: E402

import jax_mxfp4 as mx  # noqa: E402
from jax_mxfp4.qwix import MxPtqProvider, MxQtProvider, MxRule, quantize_params  # noqa: E402

from lm_model import LM  # noqa: E402

CATCH_ALL = MxQtProvider([MxRule(module_path=".*")])
DENSE = (((2,), (0,)), ((), ()))  # x [b, t, d] . kernel [d, ...]


def same(a, b):
    return jax.tree.all(jax.tree.map(lambda u, v: bool(jnp.array_equal(u, v)), a, b))


def finite(tree):
    return all(bool(jnp.isfinite(leaf).all()) for leaf in jax.tree.leaves(tree))


def tokens_of(rng, batch=1, t=8):
    return jnp.asarray(rng.integers(0, 96, (batch, t)), jnp.int32)


def padded_einsum(subscripts, lhs, lhs_axis, rhs, rhs_axis):
    """jax_mxfp4.einsum with the one contracting axis zero-padded to 32 by hand (exact)."""
    pad = lambda x, ax: jnp.pad(x, [(0, (-x.shape[ax]) % 32 if d == ax else 0) for d in range(x.ndim)])  # noqa: E731
    return mx.einsum(subscripts, pad(lhs, lhs_axis), pad(rhs, rhs_axis))


def rms(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + 1e-6) * (1 + scale)


def direct_block(p, x, kv_heads):
    """tests/lm_model.Block written with jax_mxfp4's public functions (the reference)."""
    a, h = p["attn"], rms(x, p["pre_attn"]["scale"])
    b, t, _ = x.shape
    q = mx.dot_general(h, a["q"]["kernel"], DENSE) * 32**-0.5
    k, v = (mx.dot_general(h, a[n]["kernel"], DENSE) for n in ("k", "v"))
    mask = jnp.tril(jnp.ones((t, t), bool))
    if kv_heads in (1, 4):
        probs = jax.nn.softmax(jnp.where(mask, mx.einsum("btnh,bsnh->bnts", q, k), -1e30), axis=-1)
        enc = padded_einsum("bnts,bsnh->btnh", probs, 3, v, 1)
    else:
        q = q.reshape(b, t, kv_heads, -1, 32)
        probs = jax.nn.softmax(jnp.where(mask, mx.einsum("btkgh,bskh->bkgts", q, k), -1e30), axis=-1)
        enc = padded_einsum("bkgts,bskh->btkgh", probs, 4, v, 1).reshape(b, t, 4, 32)
    x = x + mx.dot_general(enc, a["o"]["kernel"], (((2, 3), (0, 1)), ((), ())))
    m, h = p["mlp"], rms(x, p["pre_mlp"]["scale"])
    gate = jax.nn.gelu(mx.dot_general(h, m["w_gate"], DENSE)) * mx.dot_general(h, m["w_up"], DENSE)
    return x + mx.dot_general(gate, m["w_down"], DENSE)


def direct_lm(params, tokens, kv_heads, blocks):
    p = params["params"]
    emb = p["embed"]["embedding"]
    x = jnp.take(emb, tokens, axis=0) * jnp.sqrt(64).astype(jnp.float32)
    for block in blocks(p):
        x = direct_block(block, x, kv_heads)
    return mx.dot_general(rms(x, p["final_norm"]["scale"]), emb.T, DENSE)  # tied: embed.attend


@pytest.mark.sweep(keep=1)
@pytest.mark.parametrize("kv_heads", [1, 2, 4], ids=["mqa_broadcast_kv_head", "gqa_grouped", "mha"])
def test_catch_all_rule_on_third_party_lm_equals_direct_jax_mxfp4_calls(kv_heads, rng):
    tok = tokens_of(rng)
    model = LM(num_kv_heads=kv_heads)
    p = model.init(jax.random.key(0), tok)
    y = qwix.quantize_model(model, CATCH_ALL).apply(p, tok)
    # every GEMM (projections, q.k and probs.v einsums, x @ w, the tied embedding) went
    # through jax_mxfp4: an unquantized one would not give these bits
    np.testing.assert_array_equal(y, direct_lm(p, tok, kv_heads, lambda p: [p["block_0"]]))
    assert float(jnp.abs(y - model.apply(p, tok)).max()) > 0.05


def test_matmul_weight_key_is_not_captured_across_traces_and_plain_trace_is_not_reused(rng):
    class Mlp(nn.Module):  # a weight used as ``x @ self.param(...)`` (jnp.matmul)
        @nn.compact
        def __call__(self, x):
            return jax.nn.gelu(x @ self.param("w", nn.initializers.lecun_normal(), (64, 32)))

    x = jnp.asarray(rng.standard_normal((16, 64)), jnp.float32)
    model = Mlp()
    p = model.init(jax.random.key(0), x)
    y_plain = model.apply(p, x)  # jax.numpy's jitted matmul traced without the provider first
    q = qwix.quantize_model(model, CATCH_ALL)
    np.testing.assert_array_equal(q.apply(p, x), jax.nn.gelu(mx.dot_general(x, p["params"]["w"], (((1,), (0,)), ((), ())))))
    assert not same(q.apply(p, x), y_plain)
    loss = lambda p, key: (q.apply(p, x, rngs={"stochastic_rounding": key}) ** 2).sum()  # noqa: E731
    step = jax.jit(jax.grad(loss))
    g1 = step(p, jax.random.key(1))
    jax.clear_caches()  # a second trace: a key captured by the first would leak here
    assert same(step(p, jax.random.key(1)), g1) and finite(g1)
    assert not same(step(p, jax.random.key(2)), g1)  # the stream's key does drive the rounding


ROUTES = {  # how model code writes x [16, 64] . w [64, 32]; all are one MXFP4 GEMM under the provider
    "at_operator": lambda x, w: x @ w,
    "reflected_at": lambda x, w: np.asarray(x) @ w,  # numpy array on the left: w.__rmatmul__
    "jnp_matmul": lambda x, w: jnp.matmul(x, w),
    "jnp_dot": lambda x, w: jnp.dot(x, w),
    "dot_method": lambda x, w: x.dot(w),
    "jnp_inner_of_transpose": lambda x, w: jnp.inner(x, w.T),
    "jnp_einsum": lambda x, w: jnp.einsum("td,df->tf", x, w),
    "lax_dot_general": lambda x, w: jax.lax.dot_general(x, w, (((1,), (0,)), ((), ()))),
    "bf16_activations_promoted": lambda x, w: x.astype(jnp.bfloat16) @ w,
    "matmul_broadcast_batch": lambda x, w: (x.reshape(2, 8, 64) @ w[None]).reshape(16, 32),
}


class OneWeight(nn.Module):
    route: str

    @nn.compact
    def __call__(self, x):
        return ROUTES[self.route](x, self.param("w", nn.initializers.lecun_normal(), (64, 32)))


def test_every_jnp_contraction_route_is_one_mxfp4_gemm_and_unmatched_ones_stay_jnp(rng):
    x = jnp.asarray(rng.standard_normal((16, 64)), jnp.float32)
    for route in ROUTES:
        model = OneWeight(route)
        p = model.init(jax.random.key(0), x)
        w = p["params"]["w"]
        xq = x.astype(jnp.bfloat16).astype(jnp.float32) if route.startswith("bf16") else x
        y_plain = model.apply(p, x)  # traces jax.numpy's jitted wrappers without the provider first
        y = qwix.quantize_model(model, CATCH_ALL).apply(p, x)
        if route == "jnp_inner_of_transpose":  # w.T [32, 64] is the rhs, contracted along its dim 1
            want = mx.dot_general(xq, w.T, (((1,), (1,)), ((), ())))
        else:
            want = mx.dot_general(xq, w, (((1,), (0,)), ((), ())))
        np.testing.assert_array_equal(y, want, err_msg=route)
        assert y.dtype == y_plain.dtype, route
        unmatched = qwix.quantize_model(model, MxQtProvider([MxRule(module_path="nothing")]))
        np.testing.assert_array_equal(unmatched.apply(p, x), y_plain, err_msg=route)


@pytest.mark.slow
@pytest.mark.parametrize("route", [r for r in ROUTES if r != "reflected_at"])
def test_no_route_captures_the_rounding_key_across_traces(route, rng):
    x = jnp.asarray(rng.standard_normal((16, 64)), jnp.float32)
    model = OneWeight(route)
    p = model.init(jax.random.key(0), x)
    q = qwix.quantize_model(model, CATCH_ALL)
    step = jax.jit(jax.grad(lambda p, key: (q.apply(p, x, rngs={"stochastic_rounding": key}) ** 2).sum()))
    g1 = step(p, jax.random.key(1))
    jax.clear_caches()
    assert same(step(p, jax.random.key(1)), g1) and finite(g1)
    assert not same(step(p, jax.random.key(2)), g1)


@pytest.mark.slow
def test_scanned_rematerialized_blocks_equal_direct_calls_and_train_across_traces(rng):
    tok = tokens_of(rng)
    model = LM(num_layers=2, scan=True, remat=True)
    p = model.init(jax.random.key(0), tok)
    q = qwix.quantize_model(model, CATCH_ALL)
    layers = lambda p: [jax.tree.map(lambda a: a[i], p["blocks"]) for i in range(2)]  # noqa: E731
    np.testing.assert_array_equal(q.apply(p, tok), direct_lm(p, tok, 1, layers))
    step = jax.jit(jax.grad(lambda p, key: jnp.mean(q.apply(p, tok, rngs={"stochastic_rounding": key}) ** 2)))
    g1 = step(p, jax.random.key(1))
    jax.clear_caches()
    assert same(step(p, jax.random.key(1)), g1) and finite(g1)


@pytest.mark.slow
def test_lm_gradients_equal_between_provider_and_direct_calls(rng):
    tok = tokens_of(rng, t=32)  # probs.v contracts 32 keys: no padding, in either route
    model = LM(num_kv_heads=1)
    p = model.init(jax.random.key(0), tok)
    q = qwix.quantize_model(model, CATCH_ALL)
    # eager: the same ops give the same dY bits, hence the same data-derived rounding keys (two
    # different jitted programs may fuse dY's producers differently; jax_mxfp4/training.py)
    g_q = jax.grad(lambda p: jnp.mean(q.apply(p, tok) ** 2))(p)
    g_d = jax.grad(lambda p: jnp.mean(direct_lm(p, tok, 1, lambda p: [p["block_0"]]) ** 2))(p)
    assert finite(g_q)
    assert same(g_q, g_d)


@pytest.mark.slow
def test_serving_provider_on_third_party_lm(rng):
    """Stored MXFP4 weights for every single-K projection and ``x @ w`` weight; the tied embedding
    (read as ``embedding.T`` by attend) stays a float parameter; a two-dim contraction (the
    output projection) is refused by name until excluded."""
    tok = tokens_of(rng)
    model = LM(num_kv_heads=1)
    p = model.init(jax.random.key(0), tok)
    w4a16 = mx.Recipe(quantize_activations=False)
    with pytest.raises(ValueError, match="'kernel' of module 'block_0/attn/o'.*Exclude this module"):
        qwix.quantize_model(model, MxPtqProvider([MxRule(module_path=".*", recipe=w4a16)])).init(jax.random.key(0), tok)
    rule = MxRule(module_path="(?!.*attn/o$).*", recipe=w4a16)
    served = qwix.quantize_model(model, MxPtqProvider([rule]))
    abstract = jax.eval_shape(served.init, jax.random.key(0), tok)
    qp = quantize_params(p["params"], abstract["params"])
    kinds = jax.tree.map(lambda v: type(getattr(v, "array", v)).__name__, qp, is_leaf=lambda v: hasattr(v, "how"))
    blk = kinds["block_0"]
    assert {blk["attn"][n]["kernel"] for n in "qkv"} | set(blk["mlp"].values()) == {"MXFP4Array"}
    assert kinds["embed"]["embedding"] == blk["attn"]["o"]["kernel"] == "ArrayImpl"
    y = served.apply({"params": qp}, tok)
    serve = jax.jit(served.apply)
    y1 = serve({"params": qp}, tok)
    jax.clear_caches()  # nothing of the first trace is captured by the second
    np.testing.assert_array_equal(serve({"params": qp}, tok), y1)
    # the same GEMMs as training's forward with this recipe (weights quantized once vs per call)
    trained = qwix.quantize_model(model, MxQtProvider([rule])).apply(p, tok)
    np.testing.assert_allclose(y, trained, rtol=1e-5, atol=1e-5)


class NnxMqa(nnx.Module):
    """nnx attention block as third-party code writes it: Linear projections, one key/value head
    broadcast by jnp.einsum, an output weight used as ``enc @ self.w_out[...]``."""

    def __init__(self, rngs):
        self.q = nnx.Linear(64, 128, use_bias=False, rngs=rngs)
        self.kv = nnx.Linear(64, 32, use_bias=False, rngs=rngs)
        self.w_out = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (128, 64)))

    def __call__(self, x):
        b, t, _ = x.shape
        q, kv = self.q(x).reshape(b, t, 4, 32), self.kv(x).reshape(b, t, 1, 32)
        probs = jax.nn.softmax(jnp.einsum("btnh,bsnh->bnts", q, kv), axis=-1)
        return jnp.einsum("bnts,bsnh->btnh", probs, kv).reshape(b, t, 128) @ self.w_out[...]


@pytest.mark.slow
def test_nnx_mqa_block_equals_direct_calls_and_trains_across_traces(rng):
    x = jnp.asarray(rng.standard_normal((1, 32, 64)), jnp.float32)
    model = NnxMqa(nnx.Rngs(0))
    q = qwix.quantize_model(model, CATCH_ALL, x)
    q.set_attributes(qwix_rngs=nnx.data(nnx.Rngs(stochastic_rounding=1)))  # nnx >= 0.12: data, not static
    wq, wkv, wo = model.q.kernel[...], model.kv.kernel[...], model.w_out[...]
    kv = mx.dot_general(x, wkv, DENSE).reshape(1, 32, 1, 32)
    probs = jax.nn.softmax(mx.einsum("btnh,bsnh->bnts", mx.dot_general(x, wq, DENSE).reshape(1, 32, 4, 32), kv), axis=-1)
    want = mx.dot_general(mx.einsum("bnts,bsnh->btnh", probs, kv).reshape(1, 32, 128), wo, DENSE)
    np.testing.assert_array_equal(q(x), want)
    step = nnx.jit(nnx.grad(lambda m: jnp.mean(m(x) ** 2)))
    g1 = nnx.to_pure_dict(nnx.state(step(q), nnx.Param))
    jax.clear_caches()  # a second trace: keys are drawn from the module's qwix_rngs each time
    g2 = nnx.to_pure_dict(nnx.state(step(q), nnx.Param))
    assert finite(g1) and finite(g2)
    assert not same(g1, g2)  # the stream advanced: a fresh rounding key per step
