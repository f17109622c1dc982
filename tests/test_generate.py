"""Serving example (python examples/generate.py): the KV-cache decoder computes the demo LM's
forward (checked position by position against model.apply), the weight byte counts follow the
formats' sizes, and a tiny CLI run writes its results."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")

import generate as gen  # noqa: E402
import jax_mxfp4 as mx  # noqa: E402
import train_lm as demo  # noqa: E402

CFG = dict(d_model=64, n_layers=2, n_heads=2, seq_len=32, batch=2, steps=1, lr=1e-3)


CFG_MOE = dict(CFG, moe=[4, 2], moe_aux_weight=0.01)


def decode_all(params, tokens, cfg=CFG):
    """Logits at every position by running decode_step over the sequence with the KV cache."""
    b, t = tokens.shape
    h, dh = cfg["n_heads"], cfg["d_model"] // cfg["n_heads"]
    cache = [(jnp.zeros((b, t, h, dh), jnp.bfloat16),) * 2 for _ in range(cfg["n_layers"])]
    out = []
    for pos in range(t):
        logits, cache = gen.decode_step(params, cfg, tokens[:, pos], pos, cache)
        out.append(logits)
    return jnp.stack(out, axis=1)


@pytest.mark.slow  # the serving application (examples/), not the library
@pytest.mark.parametrize("kind", ["bf16", "mxfp4"])
def test_kv_cache_decoder_matches_the_linen_forward(kind, rng):
    tokens = jnp.asarray(rng.integers(0, 256, size=(2, 16)), jnp.int32)
    recipe = mx.Recipe(**demo.BF16_RECIPE_FIELDS) if kind == "bf16" else mx.Recipe(quantize_activations=False)
    model = demo.build_model(CFG, recipe)
    variables = model.init(jax.random.key(int(rng.integers(1 << 30))), tokens)
    served = gen.serving_weights(variables["params"], kind)
    if kind == "mxfp4":  # the linen model on the same MXFP4 weights, w4a16
        variables = mx.flax.quantize_params(variables, model=model, inputs=(tokens,))
        for path in (("head", "kernel"), ("block0", "qkv", "kernel")):
            a, b = served, variables["params"]
            for k in path:
                a, b = a[k], b[k]
            assert isinstance(a, mx.DecodePrepared)  # arranged once for decode (prepare_decode)
            np.testing.assert_array_equal(a.to_mxfp4().data, b.data)  # the very same MXFP4 weights
    want = model.apply(variables, tokens)
    got = decode_all(served, tokens)
    # the decoder keeps activations in bfloat16 (the linen model in float32): close, not equal
    err = float(jnp.abs(got - want).max())
    assert err < 0.03 * float(jnp.abs(want).max()) + 0.05, err
    assert float(jnp.mean(jnp.argmax(got, -1) == jnp.argmax(want, -1))) > 0.9


@pytest.mark.slow  # the serving application (examples/), not the library
def test_weight_bytes_follow_the_formats():
    params = demo.build_model(CFG, mx.Recipe()).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    d = CFG["d_model"]
    shapes = [(d, 3 * d), (d, d), (d, 4 * d), (4 * d, d)] * CFG["n_layers"] + [(d, 256)]
    elems = sum(k * n for k, n in shapes)
    assert gen.gemm_weight_bytes(gen.serving_weights(params, "bf16")) == 2 * elems
    assert gen.gemm_weight_bytes(gen.serving_weights(params, "mxfp4")) == elems // 2 + elems // 32
    assert gen.gemm_weight_bytes(gen.serving_weights(params, "mxfp4", prepare=False)) == elems // 2 + elems // 32


@pytest.mark.slow
def test_cli_runs_and_writes_results(tmp_path, capsys):
    gen.main(["--steps", "2", "--d-model", "32", "--layers", "1", "--seq-len", "32",
              "--train-batch", "2", "--prompt-len", "8", "--new-tokens", "8", "--repeats", "1", "--quiet",
              "--out", str(tmp_path)])
    res = json.loads((tmp_path / "generate.json").read_text())
    for kind in ("bf16", "mxfp4"):
        r = res["runs"][kind]
        assert r["tokens_per_s"] > 0 and len(r["tokens"][0]) == 8
    assert res["runs"]["mxfp4"]["gemm_weight_bytes"] < res["runs"]["bf16"]["gemm_weight_bytes"] / 3.5
    assert "mxfp4 (w4a16)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        gen.main(["--new-tokens", "0"])


@pytest.mark.slow  # the serving application (examples/), not the library
@pytest.mark.parametrize("kind", ["bf16", "mxfp4"])
def test_moe_kv_cache_decoder_matches_the_linen_forward(kind, rng):
    """--moe 4x2: the decoder routes each position's token with the float32 router and multiplies the
    experts that quantize_params made (MXFP4Array [E, K, N] along K) by jax_mxfp4.ragged_dot."""
    tokens = jnp.asarray(rng.integers(0, 256, size=(2, 16)), jnp.int32)
    recipe = mx.Recipe(**demo.BF16_RECIPE_FIELDS) if kind == "bf16" else mx.Recipe(quantize_activations=False)
    model = demo.build_model(CFG_MOE, recipe)
    variables = model.init(jax.random.key(int(rng.integers(1 << 30))), tokens)
    served = gen.serving_weights(variables["params"], kind, model=model)
    experts = served["block1"]["moe"]["experts_in"]["kernel"]
    router = served["block1"]["moe"]["router"]["kernel"]
    assert router.dtype == jnp.float32  # the router is never quantized
    if kind == "mxfp4":  # the linen model on the same MXFP4 weights, w4a16
        variables = mx.flax.quantize_params(variables, model=model, inputs=(tokens,))
        want_experts = variables["params"]["block1"]["moe"]["experts_in"]["kernel"]
        assert isinstance(experts, mx.MXFP4Array) and experts.axis == 1 and experts.shape == (4, 64, 256)
        np.testing.assert_array_equal(experts.data, want_experts.data)
        assert isinstance(served["block1"]["qkv"]["kernel"], mx.DecodePrepared)
    else:
        assert experts.dtype == jnp.bfloat16
    want = model.apply(variables, tokens)
    got = decode_all(served, tokens, CFG_MOE)
    err = float(jnp.abs(got - want).max())
    assert err < 0.03 * float(jnp.abs(want).max()) + 0.05, err
    assert float(jnp.mean(jnp.argmax(got, -1) == jnp.argmax(want, -1))) > 0.9


@pytest.mark.slow  # the serving application (examples/), not the library
def test_moe_weight_bytes_count_the_experts():
    model = demo.build_model(CFG_MOE, mx.Recipe())
    params = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    d, n_exp = CFG["d_model"], CFG_MOE["moe"][0]
    shapes = [(d, 3 * d), (d, d), (n_exp * d, 4 * d), (n_exp * 4 * d, d)] * CFG["n_layers"] + [(d, 256)]
    elems = sum(k * n for k, n in shapes)
    for prepare in (True, False):
        w = gen.serving_weights(params["params"], "mxfp4", prepare=prepare, model=model)
        assert gen.gemm_weight_bytes(w) == elems // 2 + elems // 32
    assert gen.gemm_weight_bytes(gen.serving_weights(params["params"], "bf16")) == 2 * elems
    with pytest.raises(ValueError, match="need model="):
        gen.serving_weights(params["params"], "mxfp4")


@pytest.mark.slow
def test_moe_cli_runs_and_writes_results(tmp_path):
    gen.main(["--steps", "2", "--d-model", "32", "--layers", "1", "--seq-len", "32", "--moe", "4x2",
              "--train-batch", "2", "--prompt-len", "8", "--new-tokens", "8", "--repeats", "1", "--quiet",
              "--out", str(tmp_path)])
    res = json.loads((tmp_path / "generate.json").read_text())
    assert res["model"]["moe"] == [4, 2]
    for kind in ("bf16", "mxfp4"):
        assert res["runs"][kind]["tokens_per_s"] > 0 and len(res["runs"][kind]["tokens"][0]) == 8
    assert res["runs"]["mxfp4"]["gemm_weight_bytes"] < res["runs"]["bf16"]["gemm_weight_bytes"] / 3.5
    with pytest.raises(SystemExit):
        gen.main(["--moe", "4x2", "--backend", "ffi-cpu"])
