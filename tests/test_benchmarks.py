"""benchmarks/gemm.py, quantize.py and train_step.py --quick run on CPU and write their files."""

from __future__ import annotations

import json

import numpy as np

import pytest
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks import gemm, quantize, train_step  # noqa: E402


def _png(path):
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_gemm_quick_writes_json_markdown_png(tmp_path):
    assert gemm.main(["--quick", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "gemm.json").read_text())
    passes = {r["pass"] for r in res["rows"]}
    assert passes == {"decode", "fprop", "dgrad", "wgrad"}
    ok = {(r["variant"], r["backend"]) for r in res["rows"] if r.get("status") == "ok"}
    assert {("bf16", "bf16"), ("a4w4", "xla"), ("a4w4", "pallas"), ("w4a16", "pallas")} <= ok
    assert {("a4w4", "fp8"), ("a4w4", "fp8-prepared"), ("a4w4", "fp8-high"), ("e4m3", "xla-fp8")} <= ok
    base = {(r["m"], r["n"], r["k"]): r["median_s"] for r in res["rows"] if r["variant"] == "bf16"}
    for r in res["rows"]:
        if r.get("status") == "ok" and r["variant"] != "bf16":  # one convention: time / bf16 time
            assert r["median_s"] > 0
            assert abs(r["time_ratio_vs_bf16"] - r["median_s"] / base[(r["m"], r["n"], r["k"])]) < 1e-12
    assert res["geomeans"] and "time / bf16" in (tmp_path / "gemm.md").read_text()
    _png(tmp_path / "gemm_geomean_time_ratio.png")
    _png(tmp_path / "gemm_time_ratio_vs_k.png")


def test_quantize_quick_writes_json_markdown_png(tmp_path):
    assert quantize.main(["--quick", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "quantize.json").read_text())
    whats = [r["what"] for r in res["rows"]]
    assert whats[0].startswith("copy") and any(w.startswith("fused") for w in whats)
    assert all(r["gb_s"] > 0 for r in res["rows"])
    assert "x copy" in (tmp_path / "quantize.md").read_text()
    _png(tmp_path / "quantize_bandwidth.png")


@pytest.mark.parametrize("names,msg", [("bogus", "unknown variant token 'bogus' in 'bogus'"),
                                       ("swar,swar+nope", "unknown variant token 'nope' in 'swar+nope'"),
                                       ("16x48w4", "QuantizeConfig.cols must be a power of two"),
                                       (",", "give at least one name")])
def test_quantize_variants_refuses_bad_names_before_running(tmp_path, capsys, names, msg):
    """--variants: every name parses for every dtype before any timing, else an argparse error
    naming --variants and the rule (helper trial, session 13: a bad name exited 0 after timing the
    copy and wrote a broken table); nothing is written."""
    with pytest.raises(SystemExit) as e:
        quantize.main(["--quick", "--variants", names, "--out", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--variants:" in err and msg in err, err
    assert not list(tmp_path.iterdir())


def test_train_step_quick_writes_json_markdown(tmp_path):
    assert train_step.main(["--quick", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "train_step.json").read_text())
    got = {(r["config"], r["variant"]) for r in res["rows"] if r["status"] == "ok"}
    assert got == {(c, v) for c in ("linear", "mlp", "mlp-d1024") for v in train_step.VARIANTS}
    for r in res["rows"]:
        assert r["median_s"] > 0 and abs(r["tokens_per_s"] * r["median_s"] - r["t"]) < 1e-6 * r["t"]
        assert abs(r["time_ratio_vs_bf16"] - r["median_s"] / next(
            x["median_s"] for x in res["rows"] if x["config"] == r["config"] and x["variant"] == "bf16")) < 1e-9
    assert set(res["routing_linear"]) == {"fprop", "dgrad", "wgrad"}
    assert "| linear |" in (tmp_path / "train_step.md").read_text()


def test_fair_timing_grows_programs_and_keeps_calls_distinct():
    """time_fn grows the calls per program until one program takes min_program_s, and every
    call beyond the given sets gets its own copy of the smallest operand (no two calls alike)."""
    import jax.numpy as jnp

    from benchmarks.common import _with_distinct_calls, kernel_time, time_fn

    sets = [(jnp.full((64, 64), float(i)), jnp.full((4,), float(i))) for i in range(2)]
    r = time_fn(lambda a, b: (a @ a).sum() + b.sum(), sets, reps=3, min_program_s=0.05, max_calls=4096)
    assert r["program_s"] >= 0.05 * 0.5 and r["calls"] > len(sets)  # grown past the 2 sets
    assert abs(r["median_s"] * r["calls"] - r["program_s"]) < 1e-12
    calls = _with_distinct_calls(sets, 5)
    small = [c[1] for c in calls]
    assert len({id(x) for x in small}) == 5 and all(float(x[0]) == i % 2 for i, x in enumerate(small))
    assert all(c[0] is sets[i % 2][0] for i, c in enumerate(calls))  # the large operand rotates
    assert "error" in kernel_time(lambda a, b: a @ a, sets)  # no GPU plane on the CPU


def test_busy_span_counts_overlaps_once_and_gaps_as_idle():
    """The timeline's busy time is the union of kernel intervals; idle = span - busy."""
    import random

    from benchmarks.common import busy_span

    assert busy_span([]) == (0.0, 0.0)
    assert busy_span([(10, 20), (30, 35)]) == (25, 15)  # one 10-unit gap
    assert busy_span([(0, 10), (5, 12), (11, 13), (20, 21)]) == (21, 14)  # overlaps merged
    rng = random.Random()
    ivs = [(s, s + rng.randint(0, 9)) for s in (rng.randint(0, 200) for _ in range(40))]
    covered = {t for s, e in ivs for t in range(s, e)}  # unit cells: an independent union
    span, busy = busy_span(ivs)
    assert busy == len(covered) and span == max(e for _, e in ivs) - min(s for s, _ in ivs)


def test_train_step_refuses_names_it_would_skip(tmp_path, capsys):
    """Unknown configs/variants/profiled variants and --hlo without --profile were skipped
    silently (exit 0, an empty or bf16-only table); --hlo into a missing folder crashed after
    the timing. Now: argparse errors naming the flag, and the folder is made."""
    import pytest

    for argv, msg in ((["--configs", "linera"], "--configs: unknown name(s) 'linera'; choose from linear, mlp"),
                      (["--variants", "mxfp4,bogus"], "--variants: unknown name(s) 'bogus'"),
                      (["--profile", "bogus"], "--profile: unknown name(s) 'bogus'"),
                      (["--variants", "mxfp4-nearest", "--profile", "mxfp4"],
                       "--profile: 'mxfp4' not among the --variants run"),
                      (["--hlo", str(tmp_path / "h")], "--hlo DIR writes the HLO of each profiled step")):
        with pytest.raises(SystemExit) as e:
            train_step.main(["--quick", "--out", str(tmp_path)] + argv)
        assert e.value.code == 2 and msg in capsys.readouterr().err
    hlo = tmp_path / "new" / "hlo"
    assert train_step.main(["--quick", "--out", str(tmp_path), "--configs", "linear", "--variants",
                            "mxfp4-nearest", "--profile", "mxfp4-nearest", "--hlo", str(hlo)]) == 0
    assert "HloModule" in (hlo / "hlo_linear_mxfp4-nearest.txt").read_text()


def test_gemm_refuses_what_it_would_skip(tmp_path, capsys):
    """--only/--layers/--decode-m values outside the benchmark's lists were skipped silently (an
    empty table, exit 0), malformed ones raised a bare int() traceback, and --quick ignored them."""
    import pytest

    for argv, msg in ((["--quick", "--only", "bogus"], "--only: bogus not among this benchmark's"),
                      (["--layers", "64x64x48"], "--layers: 64x64x48 not among this benchmark's 1024x8192x8192"),
                      (["--decode-m", "3"], "--decode-m: 3 not among this benchmark's 16, 1, 64, 128"),
                      (["--layers", "axbxc"], "--layers TxKxN shapes"),
                      (["--decode-m", "x"], "--decode-m takes integers"),
                      (["--quick", "--decode-m", "16"], "--quick times its own tiny shapes")):
        with pytest.raises(SystemExit) as e:
            gemm.main(["--out", str(tmp_path)] + argv)
        assert e.value.code == 2 and msg in capsys.readouterr().err
    # "none" selects no shapes of that kind (was spelled with an unknown shape, e.g. --layers 1x1x1)
    ns = gemm.argparse.Namespace(decode_m="16", layers="none", only="", quick=False)
    gemm.check_args(gemm.argparse.ArgumentParser(), ns)
    assert ns.decode_m == [16] and ns.layers == [None] and not [t for t in gemm.FULL_LAYERS if t in ns.layers]


def test_compile_time_refuses_what_would_measure_nothing(tmp_path, capsys):
    """Empty --recipes/--flags printed an empty table and exited 0, --layers -1 built a model with
    no layers and reported it "ok", --timeout 0 or -1 reported every run as a timeout; all are
    refused before any process starts (argparse error, exit 2)."""
    import pytest

    from benchmarks import compile_time

    base = ["--size", "small", "--out", str(tmp_path)]
    for argv, msg in ((["--recipes", ""], "--recipes and --flags each need at least one name"),
                      (["--flags", ","], "--recipes and --flags each need at least one name"),
                      (["--layers", "0"], "--layers must be >= 1, got 0"),
                      (["--layers", "-1"], "--layers must be >= 1, got -1"),
                      (["--timeout", "0"], "--timeout must be > 0 seconds, got 0.0"),
                      (["--timeout", "-1"], "--timeout must be > 0 seconds"),
                      (["--timeout", "nan"], "--timeout must be > 0 seconds"),
                      (["--recipes", "fp4"], "--recipes: 'fp4' is not bf16 or mxfp4"),
                      (["--flags", "turbo"], "--flags: 'turbo' is not one of"),
                      (["--size", "tiny"], "--size must be one of")):
        with pytest.raises(SystemExit) as e:
            compile_time.main(base + argv)
        assert e.value.code == 2 and msg in capsys.readouterr().err, argv
    assert not os.listdir(tmp_path)  # nothing ran


def test_train_step_check_fused_runs_the_fused_kernels_off_cuda(tmp_path):
    """--check-fused compared "1" with "0" on the platform's default route: off CUDA neither ran a
    fused kernel and "bit-identical" held trivially. Now it runs them in the Pallas interpreter
    (backend fp8) and says how many kernels the fused step has: every fused mode (rows, all,
    tiled; sr: dY's two stochastic quantizations only) with the data-derived threefry key and an
    rbg key, every one of the six operands fused (two for "sr")."""
    assert train_step.main(["--quick", "--out", str(tmp_path), "--check-fused", "--configs", "linear",
                            "--variants", "mxfp4-nearest"]) == 0
    checks = json.loads((tmp_path / "train_step.json").read_text())["fused_checks"]
    assert {(c["fused_mode"], c["key"]) for c in checks} == {
        (m, k) for m in ("interpret-rows", "interpret", "interpret-tiled", "interpret-sr")
        for k in ("data-derived (threefry)", "rbg")}
    for c in checks:
        n = 2 if c["fused_mode"] == "interpret-sr" else 6
        assert c["fused_kernels"] >= n and c["fp8_quantize_kernels"] == n, c
        assert c["bit_identical"] == [True, True, True] and c["max_abs_diff"] == [0.0, 0.0, 0.0], c
    md = (tmp_path / "train_step.md").read_text()
    assert "quantize-to-FP8, $JAX_MXFP4_FUSED_TRAINING=interpret-rows, key rbg" in md


def test_demo_batches():
    """random: one batch for every step; corpus: the demo's windows, a new one per step."""
    from benchmarks.common import demo_batches

    cfg = dict(batch=2, seq_len=16)
    rnd = demo_batches(cfg, 3, "random")
    assert rnd(0).shape == (2, 17) and rnd(0) is rnd(2)
    cor = demo_batches(cfg, 3, "corpus")
    a, b = np.asarray(cor(0)), np.asarray(cor(1))
    assert a.shape == (2, 17) and a.dtype == np.int32 and not np.array_equal(a, b)
    assert a.min() >= 0 and a.max() < 256
    with pytest.raises(ValueError, match="data must be"):
        demo_batches(cfg, 1, "text")


@pytest.mark.parametrize("script,argv", [
    ("compile_time", ["--d-model", "100"]), ("compile_time", ["--d-model", "0"]), ("compile_time", ["--lr", "0"]),
    ("compile_time", ["--lr", "nan"]), ("compile_time", ["--lr", "inf"]),
    ("train_step", ["--kernel", "--kernel-shape", "8192x100"]), ("train_step", ["--kernel", "--kernel-shape", "8192"]),
    ("train_step", ["--kernel", "--kernel-shape", "0x1024"]), ("train_step", ["--kernel", "--kernel-shape", "64x32768"])])
def test_shape_overrides_refuse_bad_values(script, argv, capsys):
    import importlib

    mod = importlib.import_module(f"benchmarks.{script}")
    with pytest.raises(SystemExit):
        mod.main(argv)
    err = capsys.readouterr().err
    assert "--d-model" in err or "--kernel-shape" in err or "--lr" in err


def test_train_step_kernel_shape_is_used_or_refused(tmp_path, capsys, monkeypatch):
    """--kernel-shape was silently ignored without --kernel (the training-step benchmark ran) and
    with --quick (--kernel timed 256x256 whatever was asked): now refused without --kernel, and
    the shape given is the one --kernel times (quick or not); the defaults stay 8192x8192 and
    256x256 with --quick."""
    from benchmarks import train_step

    with pytest.raises(SystemExit):
        train_step.main(["--quick", "--out", str(tmp_path), "--configs", "linear", "--variants", "mxfp4",
                         "--kernel-shape", "64x64"])
    assert "give --kernel too" in capsys.readouterr().err

    class Seen(Exception):
        pass

    def fake_run_kernel(args):
        raise Seen(args.kernel_shape)

    monkeypatch.setattr(train_step, "run_kernel", fake_run_kernel)
    for argv, want in ((["--quick", "--kernel-shape", "64x96"], (64, 96)), (["--kernel-shape", "8X16384"], (8, 16384)),
                       (["--quick"], (256, 256)), ([], (8192, 8192))):
        with pytest.raises(Seen) as e:
            train_step.main(["--kernel", "--out", str(tmp_path)] + argv)
        assert e.value.args[0] == want, argv


def test_gemm_markdown_gpu_span_table():
    """With profiles, gemm.py's report adds the GPU time per call (timeline span) and its ratio to
    bf16's of the same shape; without, no such table."""
    info = {"device": "X", "platform": "gpu", "jax": "0", "date_utc": "now"}

    def row(variant, backend, median, span=None):
        r = {"pass": "decode", "m": 16, "n": 64, "k": 64, "variant": variant, "backend": backend,
             "status": "ok", "median_s": median, "time_ratio_vs_bf16": median / 50e-6}
        if span is not None:
            r["profile"] = {"timeline": {"span_s": span}}
        return r

    rows = [row("bf16", "bf16", 50e-6, 40e-6), row("w4a16", "pallas-prepared", 36e-6, 20e-6)]
    md = gemm.markdown({"info": info, "rows": rows, "geomeans": []})
    assert "GPU time per call" in md and "| decode | 16x64x64 | w4a16 pallas-prepared | 0.02 (0.50x) |" in md
    md = gemm.markdown({"info": info, "rows": [row("bf16", "bf16", 50e-6)], "geomeans": []})
    assert "GPU time per call" not in md


def test_out_folder_that_cannot_be_made_is_a_clear_error_before_the_work(tmp_path, capsys):
    """common.out_dir: a file in the way is SystemExit naming --out (was a FileExistsError
    traceback, in fp8_fix/fp8_encode after the whole run, in compile_time after a child)."""
    from benchmarks import compile_time
    from benchmarks.common import out_dir

    afile = tmp_path / "afile"
    afile.write_text("")
    assert out_dir(str(tmp_path / "new" / "sub")) == str(tmp_path / "new" / "sub")
    for bad in (afile, afile / "sub"):
        with pytest.raises(SystemExit, match="--out must name a folder"):
            out_dir(str(bad))
    t0 = __import__("time").time()
    with pytest.raises(SystemExit, match="--out must name a folder"):
        compile_time.main(["--size", "small", "--recipes", "bf16", "--flags", "default", "--out", str(afile)])
    assert __import__("time").time() - t0 < 20  # refused before any timing or child process


