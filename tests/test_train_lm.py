"""The LM training example (python examples/train_lm.py): a tiny end-to-end run, the data split
and the CLI."""

from __future__ import annotations

import collections
import json
import math
import pathlib
import tomllib

import numpy as np
import pytest

import train_lm as demo

TINY = ["--steps", "3", "--quiet", "--batch", "2", "--seq-len", "32", "--d-model", "32",
        "--layers", "0", "--eval-batches", "1"]  # 0 blocks: embeddings + MXFP4 LM head (fast compile)


@pytest.mark.slow
def test_tiny_run_writes_results_and_plot(tmp_path, capsys):
    res = demo.run(TINY + ["--out", str(tmp_path)])
    saved = json.loads((tmp_path / "results.json").read_text())
    for name in ("bf16", "mxfp4"):
        loss = saved[name]["eval_loss"]
        assert math.isfinite(loss) and 3.0 < loss < math.log(256) + 1.0  # 3 steps: still near uniform
        assert len(saved[name]["train_curve"]) == 3
        steps_s = saved[name]["step_s"]  # steps after the first (which compiles); tokens/s is their sum's
        assert len(steps_s) == 2 and all(t > 0 for t in steps_s)
        tok = res["model"]["batch"] * res["model"]["seq_len"]
        assert saved[name]["tokens_per_s"] == pytest.approx(tok * 2 / sum(steps_s))
    assert saved["model"]["steps"] == 3  # the steps run, not the size's default
    gap = 100 * (saved["mxfp4"]["eval_loss"] - saved["bf16"]["eval_loss"]) / saved["bf16"]["eval_loss"]
    assert saved["gap_pct"] == pytest.approx(gap)
    assert saved["steps"] == 3 and saved["backend"] in ("xla", "ffi-cpu", "scaled_dot", "pallas", "hipblaslt")
    assert saved["bf16"]["recipe"]["wgrad"] == "bf16" and saved["mxfp4"]["recipe"]["wgrad"] == "mxfp4"
    assert res["gap_pct"] == saved["gap_pct"]
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "unigram byte entropy" in out and "gap vs bf16" in out and "mxfp4" in out


def test_one_step_run_writes_strict_json_and_out_file_is_refused(tmp_path, capsys):
    """One step has no timed step: tokens/s is null in results.json (strict JSON, no NaN); an
    --out that names a file is refused before training with the reason."""
    argv = [a if a != "3" else "1" for a in TINY]
    demo.run(argv + ["--out", str(tmp_path)])
    text = (tmp_path / "results.json").read_text()
    saved = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    assert saved["bf16"]["tokens_per_s"] is None and saved["mxfp4"]["step_s"] == []
    afile = tmp_path / "afile"
    afile.write_text("")
    for out in (afile, afile / "sub"):
        with pytest.raises(SystemExit, match="--out must name a folder"):
            demo.run(TINY + ["--out", str(out)])


def test_data_split_is_fixed_and_disjoint():
    files = demo.stdlib_files()
    assert files == demo.stdlib_files() and len(files) >= 100
    names = [f.name for f in files]
    assert "os.py" in names and not any("site-packages" in f.parts for f in files)
    train, evals, info = demo.load_corpus()
    assert info["eval_files"] == len(files) // demo.HOLDOUT_EVERY
    assert info["train_files"] + info["eval_files"] == len(files)
    assert train.dtype == np.uint8 and evals.size == info["eval_bytes"] > 10_000


def test_unigram_entropy_against_counter():
    data = np.frombuffer(b"abracadabra, said the wizard" * 3, np.uint8)
    counts = collections.Counter(data.tolist())
    n = sum(counts.values())
    want = -sum(c / n * math.log(c / n) for c in counts.values())
    assert demo.unigram_entropy_nats(data) == pytest.approx(want, rel=1e-12)
    assert demo.unigram_entropy_nats(np.arange(256, dtype=np.uint8)) == pytest.approx(math.log(256))


def test_cli_rejects_bad_flags(capsys):
    with pytest.raises(SystemExit):
        demo.parse_args(["--steps", "0"])
    with pytest.raises(SystemExit):
        demo.parse_args(["--size", "huge"])
    # --eval-batches 0 gave NaN eval losses and gap, -2 a numpy traceback after loading the data;
    # --eval-every -1 evaluated after every step
    for flag, v in (("--eval-batches", "0"), ("--eval-batches", "-2"), ("--eval-every", "-1")):
        with pytest.raises(SystemExit):
            demo.parse_args([flag, v])
        err = capsys.readouterr().err
        assert f"{flag} must be >=" in err, err
    assert demo.parse_args(["--eval-every", "0"]).eval_every == 0
    for v in ("0", "-1e-3", "nan", "inf"):
        with pytest.raises(SystemExit):
            demo.parse_args([f"--lr={v}"])
        assert "--lr: must be a positive finite number" in capsys.readouterr().err
    for flag, v in (("--batch", "0"), ("--seq-len", "0"), ("--layers", "-1"), ("--d-model", "48"), ("--d-model", "0")):
        with pytest.raises(SystemExit):
            demo.parse_args([flag, v])
        assert f"{flag} must be" in capsys.readouterr().err
    assert demo.parse_args(["--layers", "0", "--d-model", "64"]).layers == 0
    assert demo.parse_args(["--lr", "2e-4"]).lr == 2e-4 and demo.parse_args(["--size", "xl"]).size == "xl"


def test_runs_as_a_script_outside_the_package(tmp_path):
    """`python examples/train_lm.py` with the installed package: the script imports the library,
    the wheel holds no application (no console script, nothing under jax_mxfp4 imports it)."""
    import subprocess
    import sys

    root = pathlib.Path(__file__).parents[1]
    pyproject = tomllib.loads((root / "pyproject.toml").read_text())
    assert "scripts" not in pyproject["project"]
    assert pyproject["tool"]["scikit-build"]["wheel"]["packages"] == ["jax_mxfp4"]
    r = subprocess.run([sys.executable, str(root / "examples" / "train_lm.py"), "--steps", "0"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--steps must be >= 1, got 0" in r.stderr, r.stderr[-2000:]


@pytest.mark.slow
def test_sharded_run_matches_single_device(tmp_path):
    """--mesh 2x2: batch over "data", Megatron column/row Dense layers over "model" (8 simulated
    CPU devices from conftest). Same data and seed as the single-device run, so the losses agree
    up to float32 reassociation of the sharded contractions. Round-to-nearest gradients here:
    the stochastic-rounding key hashes dY's bits, so a 1-ulp reassociation difference draws
    different (equally valid) rounding noise."""
    import jax

    if len(jax.devices()) < 4:
        pytest.skip("needs 4 (simulated) devices")
    small = ["--steps", "2", "--quiet", "--batch", "4", "--seq-len", "32", "--d-model", "64",
             "--layers", "1", "--eval-batches", "1", "--grad-rounding", "nearest"]
    one = demo.run(small + ["--out", str(tmp_path / "one")])
    mesh = demo.run(small + ["--out", str(tmp_path / "mesh"), "--mesh", "2x2"])
    assert mesh["mesh"] == [2, 2] and one["mesh"] is None
    for name in ("bf16", "mxfp4"):
        np.testing.assert_allclose(mesh[name]["train_curve"], one[name]["train_curve"], rtol=2e-3)
        assert mesh[name]["eval_loss"] == pytest.approx(one[name]["eval_loss"], rel=2e-3)


def test_mesh_flag_is_validated():
    with pytest.raises(SystemExit):
        demo.parse_args(["--mesh", "2by1"])


def test_hadamard_block_not_dividing_the_model_refused_before_training(capsys):
    """--hadamard-block 256 at --size small (d_model 128): refused before any data or training."""
    import time

    t0 = time.perf_counter()
    with pytest.raises(SystemExit, match="does not divide d_model = 128"):
        demo.run(["--hadamard", "all", "--hadamard-block", "256", "--steps", "1"])
    assert time.perf_counter() - t0 < 10  # no bf16 run first


# ----------------------------------------------------------------------------- mixture of experts
MOE_TINY = ["--quiet", "--batch", "2", "--seq-len", "32", "--d-model", "32", "--layers", "1", "--eval-batches", "1",
            "--moe", "4x2"]


def test_moe_route_against_numpy_ties_free_logits(rng):
    """Top-2 of 4 experts for 10 tokens: sorted assignments, renormalized gates, group sizes and the
    Switch load-balancing loss against a float64 reference (an expert no token picks included)."""
    import jax

    m, n_exp, top = 10, 4, 2
    logits = rng.standard_normal((m, n_exp)).astype(np.float32)
    logits[:, 3] -= 20.0  # expert 3: never in anyone's top 2 (an empty group)
    route = jax.jit(demo.moe_route, static_argnums=1)  # one compilation, not one per op
    token, gates, group_sizes, aux = route(logits, top)
    p = np.exp(logits.astype(np.float64))
    p /= p.sum(-1, keepdims=True)
    chosen = np.argsort(-p, axis=-1)[:, :top]
    pairs = sorted((int(e), t) for t in range(m) for e in chosen[t])  # by expert, then token
    assert np.asarray(token).tolist() == [t for _, t in pairs]
    want_gates = [p[t, e] / p[t, chosen[t]].sum() for e, t in pairs]
    np.testing.assert_allclose(np.asarray(gates), want_gates, rtol=1e-6)
    counts = np.bincount([e for e, _ in pairs], minlength=n_exp)
    assert np.asarray(group_sizes).tolist() == counts.tolist() and counts[3] == 0
    assert float(aux) == pytest.approx(n_exp * np.sum(counts / (m * top) * p.mean(0)), rel=1e-6)
    balanced = route(np.zeros((8, n_exp), np.float32), top)[3]  # uniform router: loss 1
    assert float(balanced) == pytest.approx(1.0, rel=1e-6)


def _gelu_tanh(x):  # jax.nn.gelu's default (approximate=True)
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


@pytest.mark.parametrize("run", [pytest.param("bf16", marks=pytest.mark.slow), "mxfp4"])
def test_moe_block_against_float64_mixture(run, rng, jax_key):
    """The MoE block's output (captured in the LM) against a float64 mixture computed from its input:
    sum over each token's top-2 experts of gate x W_out[e]ᵀ gelu(W_in[e]ᵀ x), the GEMM operands
    rounded as the run's recipe does (bf16; MXFP4 along K). A wrong routing, sort or combine is
    off by the size of the output."""
    import jax
    import jax.numpy as jnp

    from jax_mxfp4 import Recipe
    from mx_reference import bf16, qdq

    cfg = dict(d_model=32, n_layers=1, n_heads=1, seq_len=16, moe=[4, 2], moe_aux_weight=0.01)
    recipe = Recipe(**demo.BF16_RECIPE_FIELDS) if run == "bf16" else Recipe()
    rnd = (lambda x, axis: bf16(x)) if run == "bf16" else qdq
    model = demo.build_model(cfg, recipe)
    tokens = jnp.asarray(rng.integers(0, 256, size=(2, 16)), jnp.int32)
    params = model.init(jax_key, tokens)
    _, state = model.apply(params, tokens, capture_intermediates=True)
    inter = state["intermediates"]["block0"]
    x = np.asarray(inter["ln2"]["__call__"][0], np.float64).reshape(-1, 32)
    got = np.asarray(inter["moe"]["__call__"][0], np.float64).reshape(-1, 32)
    p = params["params"]["block0"]["moe"]
    w_in, w_out = (np.asarray(p[n]["kernel"], np.float32) for n in ("experts_in", "experts_out"))
    logits = x @ np.asarray(p["router"]["kernel"], np.float64) + np.asarray(p["router"]["bias"], np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    want = np.zeros_like(x)
    for t in range(x.shape[0]):
        chosen = np.argsort(-probs[t])[:2]
        for e in chosen:
            hid = _gelu_tanh(rnd(x[t:t + 1].astype(np.float32), 1) @ rnd(w_in[e], 0))
            want[t] += probs[t, e] / probs[t, chosen].sum() * (rnd(hid.astype(np.float32), 1) @ rnd(w_out[e], 0))[0]
    err = np.abs(got - want).max()
    assert err < 0.02 * np.abs(want).max(), (err, np.abs(want).max())


@pytest.mark.slow
def test_tiny_moe_run_reports_config_and_loss_decreases(tmp_path):
    res = demo.run(MOE_TINY + ["--steps", "4", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "results.json").read_text())
    moe = saved["moe"]
    assert (moe["experts"], moe["top_k"], moe["expert_width"], moe["aux_weight"]) == (4, 2, 128, 0.01)
    assert saved["model"]["moe"] == [4, 2] and moe["expert_layer"] == "jax_mxfp4.flax.linen.RaggedDense"
    for name in ("bf16", "mxfp4"):
        curve = saved[name]["train_curve"]
        assert len(curve) == 4 and all(math.isfinite(v) for v in curve) and curve[-1] < curve[0] - 0.3
        assert math.isfinite(saved[name]["eval_loss"]) and saved[name]["eval_loss"] < math.log(256)
        routing = moe["routing"][name]
        assert len(routing["load_balance"]) == 1 and routing["load_balance"][0] >= 1.0 - 1e-6  # 1: balanced
        assert len(routing["expert_load"][0]) == 4 and sum(routing["expert_load"][0]) == pytest.approx(1.0, abs=1e-3)
    assert saved["gap_pct"] == pytest.approx(
        100 * (saved["mxfp4"]["eval_loss"] - saved["bf16"]["eval_loss"]) / saved["bf16"]["eval_loss"])
    assert res["moe"] == saved["moe"]


@pytest.mark.slow
def test_moe_via_qwix_is_the_same_model(tmp_path):
    """--via qwix: plain Flax experts calling jax.lax.ragged_dot, intercepted by the providers,
    train exactly as the RaggedDense model (same params, same GEMMs, same rounding keys)."""
    layers = demo.run(MOE_TINY + ["--steps", "2", "--out", str(tmp_path / "layers")])
    via = demo.run(MOE_TINY + ["--steps", "2", "--out", str(tmp_path / "qwix"), "--via", "qwix"])
    assert via["moe"]["expert_layer"].startswith("plain jax.lax.ragged_dot")
    for name in ("bf16", "mxfp4"):
        assert via[name]["train_curve"] == layers[name]["train_curve"]
        assert via[name]["eval_loss"] == layers[name]["eval_loss"]


def test_moe_flags_are_validated(capsys):
    assert demo.parse_args(["--moe", "8x2"]).moe == (8, 2) and demo.parse_args([]).moe is None
    for v in ("8", "2x8", "8x0", "ax2"):
        with pytest.raises(SystemExit):
            demo.parse_args(["--moe", v])
        assert "--moe" in capsys.readouterr().err
    for extra in (["--backend", "ffi-cpu"], ["--hadamard", "all"], ["--moe-aux-weight", "-1"]):
        with pytest.raises(SystemExit):
            demo.parse_args(["--moe", "4x2"] + extra)
        assert "--moe" in capsys.readouterr().err
