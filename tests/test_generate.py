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


def decode_all(params, tokens):
    """Logits at every position by running decode_step over the sequence with the KV cache."""
    b, t = tokens.shape
    h, dh = CFG["n_heads"], CFG["d_model"] // CFG["n_heads"]
    cache = [(jnp.zeros((b, t, h, dh), jnp.bfloat16),) * 2 for _ in range(CFG["n_layers"])]
    out = []
    for pos in range(t):
        logits, cache = gen.decode_step(params, CFG, tokens[:, pos], pos, cache)
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
