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
