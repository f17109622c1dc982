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
from jax_mxfp4.qwix import MxPtqProvider, MxQtProvider, MxRule  # noqa: E402

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
