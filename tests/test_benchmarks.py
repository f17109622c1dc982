"""The maintained benchmarks (benchmarks/*.py): one --quick smoke test each (runs its main on CPU
into tmp_path; the JSON holds the expected rows with finite, positive timings), the fair-timing
rules of benchmarks/common.py, the kernel categories of the profile table, and the argument checks
that refuse what a run would skip.
benchmarks/sharded.py's smoke test is in tests/test_benchmark_sharded.py."""

from __future__ import annotations

import json
import math
import os
import shlex
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks import common, compile_time, gemm, moe, profile_steps, quantize, row_spans, train_step  # noqa: E402


def _png(path):
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def _finite_positive(*xs):
    return all(isinstance(x, (int, float)) and math.isfinite(x) and x > 0 for x in xs)


# ---- one --quick smoke test per benchmark


def test_gemm_quick(tmp_path):
    assert gemm.main(["--quick", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "gemm.json").read_text())
    rows = res["rows"]
    assert {r["pass"] for r in rows} == {"decode", "fprop", "dgrad", "wgrad"}
    assert {(r["variant"], r["backend"]) for r in rows} == {("bf16", "bf16")} | {
        (v, b) for v, names in gemm.QUICK_BACKENDS.items() for b in names}
    base = {(r["m"], r["n"], r["k"]): r["median_s"] for r in rows if r["variant"] == "bf16"}
    for r in rows:
        assert r["status"] == "ok" and _finite_positive(r["median_s"], r["tflops"]), r
        if r["variant"] != "bf16":  # one convention: time / bf16 time of the same shape
            assert r["time_ratio_vs_bf16"] == pytest.approx(r["median_s"] / base[(r["m"], r["n"], r["k"])], rel=1e-12)
    assert res["geomeans"] and "time / bf16" in (tmp_path / "gemm.md").read_text()
    _png(tmp_path / "gemm_geomean_time_ratio.png")
    _png(tmp_path / "gemm_time_ratio_vs_k.png")


def _check_moe_result(tmp_path, want_rows, command_tail):
    """moe.json/md/png of a --quick run: the rows ``want_rows`` ((tokens, variant) pairs), timed,
    ratios against the baseline at the same token count, the routes explained, the weight memory
    from the shapes, the header."""
    res = json.loads((tmp_path / "moe.json").read_text())
    cfg = res["config"]
    assert (cfg["experts"], cfg["top_k"]) == (moe.QUICK["experts"], moe.QUICK["top_k"])
    assert {(r["tokens"], r["variant"]) for r in res["rows"]} == want_rows
    ms = {(r["tokens"], r["variant"]): r["ms"] for r in res["rows"]}
    for r in res["rows"]:
        assert r["status"] == "ok" and _finite_positive(r["ms"], r["ratio_vs_bf16"]), r
        assert r["ms"] == pytest.approx(r["median_s"] * 1e3) and r["rows_m"] == r["tokens"] * cfg["top_k"]
        assert r["ratio_vs_bf16"] == pytest.approx(ms[(r["tokens"], r["variant"])] / ms[(r["tokens"], moe.BASELINE[r["variant"]])])
        if r["variant"] != moe.BASELINE[r["variant"]]:  # on a CPU: the exact route, for both grouped GEMMs
            assert {g: d["route"] for g, d in r["routes"].items()} == {"gate_up": "exact", "down": "exact"}
            assert 0 < r["rel_err_vs_bf16"] < 0.5, r  # FP4 rounding (another layer: ~1.4)
    e, d, f = cfg["experts"], cfg["d_model"], cfg["width"]
    params = e * d * 2 * f + e * f * d
    mem = res["memory"]
    assert (mem["bf16_bytes"], mem["mxfp4_data_bytes"], mem["mxfp4_scale_bytes"]) == (2 * params, params // 2, params // 32)
    assert mem["ratio"] == (0.5 + 1 / 32) / 2
    info = res["info"]
    assert info["jaxlib"] and info["date_utc"] and info["command"].endswith(command_tail)
    md = (tmp_path / "moe.md").read_text()
    assert "| 1 | 4 | 4 | bf16 |" in md and "0.2656x of bf16" in md and "explain_ragged_dot" in md
    _png(tmp_path / "moe.png")


def test_moe_quick_one_token(tmp_path):
    """The pipeline at its smallest: 1 token (4 of 8 expert groups empty), bf16 and w4a16."""
    argv = ["--quick", "--tokens", "1", "--variants", "mxfp4-w4a16", "--out", str(tmp_path)]
    assert moe.main(argv) == 0
    _check_moe_result(tmp_path, {(1, "bf16"), (1, "mxfp4-w4a16")}, " ".join(argv))


@pytest.mark.slow  # a whole benchmark program (test_moe_quick_one_token keeps a small one in the default tier)
def test_moe_quick(tmp_path):
    """Every --quick row: both token counts, every serving variant, and the training step."""
    assert moe.main(["--quick", "--train", "--out", str(tmp_path)]) == 0
    serving = {(t, v) for t in moe.QUICK["tokens"] for v in moe.SERVING}
    _check_moe_result(tmp_path, serving | {(max(moe.QUICK["tokens"]), v) for v in moe.TRAIN},
                      "--quick --train --out " + str(tmp_path))


def test_moe_routing_and_layer_match_a_per_token_reference(rng):
    """The benchmark's routing (top-k of the router logits, rows sorted by expert, softmax gates)
    and its expert layer, against a float64 loop over tokens and their k experts; 1 token of 8
    experts leaves 4 groups empty."""
    e, k, d, f = 8, 4, 32, 32
    for t in (1, 5):
        rows, gates, gs = moe.route(t, e, k, seed=3)
        logits = np.random.default_rng(3).standard_normal((t, e)).astype(np.float32)
        assert gs.sum() == t * k and (t > 1 or (gs == 0).sum() == e - k)
        experts = np.repeat(np.arange(e), gs)  # the expert of each sorted row
        assert sorted(zip(rows.tolist(), experts.tolist())) == sorted(
            (i, j) for i in range(t) for j in np.argsort(-logits[i])[:k])
        for g in range(e):  # tokens in order within each group
            assert np.all(np.diff(rows[experts == g]) > 0)
        top = np.sort(logits, axis=1)[:, -k:].astype(np.float64)
        want_gates = np.exp(logits[rows, experts]) / np.exp(top[rows]).sum(axis=1)
        np.testing.assert_allclose(gates, want_gates, rtol=1e-5)
        x = rng.standard_normal((t, d)).astype(np.float32)
        w1 = rng.standard_normal((e, d, 2 * f)).astype(np.float32)
        w2 = rng.standard_normal((e, f, d)).astype(np.float32)
        want = np.zeros((t, d))
        for row, ex, g in zip(rows, experts, gates):
            h = x[row].astype(np.float64) @ w1[ex]
            a = h[:f] / (1 + np.exp(-h[:f])) * h[f:]
            want[row] += g * (a @ w2[ex])
        got = moe.expert_layer(moe.grouped_gemm(None), f)(x, w1, w2, rows, gates, gs)
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-4 * np.abs(want).max())


def test_moe_refuses_bad_tokens_and_variants(tmp_path, capsys):
    for argv, msg in ((["--tokens", "1,x"], "--tokens takes a comma list of positive integers"),
                      (["--tokens", "0"], "--tokens takes a comma list of positive integers"),
                      (["--variants", "mxfp4-w4a8"], "--variants: unknown name(s) 'mxfp4-w4a8'")):
        with pytest.raises(SystemExit) as e:
            moe.main(["--quick", "--out", str(tmp_path)] + argv)
        assert e.value.code == 2 and msg in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


FAKE_KERNELS = {  # device seconds per call the profile of a GPU would give (one name per category)
    "nvjet_sm90_tst_128x128_64x6_2x1_v_bz_TNT": 8e-3, "mxfp4_quantize_fp8__4": 4e-3, "mxfp4_fp8_rescale__1": 2e-3,
    "input_transpose_fusion_1": 1e-3, "loop_add_fusion_3": 0.5e-3, "mystery_kernel": 0.25e-3}
FAKE_CATEGORIES = {"gemm": 8e-3, "quantize": 4e-3, "rescale / exact rows": 2e-3, "transpose / copy": 1e-3,
                   "elementwise / reduction": 0.5e-3, "other": 0.25e-3, "gaps": 3e-3}


@pytest.mark.slow  # a whole benchmark program (test_gemm_quick keeps one in the default tier)
def test_profile_steps_quick(tmp_path, monkeypatch):
    """--quick (the demo's training step and generate.py's decode step, bf16 and MXFP4, on a CPU):
    the steps are timed and profiled; the CPU's profile has no device kernels, so the profiler's
    result is replaced by a GPU-like one (bf16: FAKE_KERNELS, MXFP4: twice each) to run the GPU
    path: categories per step (per call / steps per call), gaps, the table's cells and ratios,
    the largest kernels, the figure, the partial JSON after each row."""
    calls = []
    real = common.device_kernel_times

    def fake(run, per=1.0, timeline=None):
        assert real(run, per, timeline) is None  # the program ran under the profiler; no GPU plane
        f = 1 + len(calls) % 2  # rows in order: bf16, mxfp4 of each workload
        calls.append(per)
        timeline.update(span_s=f * 18.75e-3, busy_s=f * 15.75e-3, idle_s=f * 3e-3, kernels=6)
        return {n: f * v for n, v in FAKE_KERNELS.items()}

    monkeypatch.setattr(common, "device_kernel_times", fake)
    partial = []
    monkeypatch.setattr(profile_steps, "write_json", lambda path, obj: partial.append(json.loads(json.dumps(obj))))
    argv = ["--quick", "--out", str(tmp_path)]
    assert profile_steps.main(argv) == 0
    assert [len(p["rows"]) for p in partial] == [1, 2, 3, 4]  # after each row (then the final report)
    assert calls == [profile_steps.PROFILE_TRAIN_STEPS] * 2 + [1, 1]  # 4 one-step calls; 1 call of the decode loop
    res = json.loads((tmp_path / "profile_steps.json").read_text())
    assert res == partial[-1]
    assert res["info"]["command"] == "python benchmarks/profile_steps.py " + " ".join(argv)
    assert list(res["workloads"]) == ["train-small", "serve-1"]
    assert res["workloads"]["train-small"]["recipes"]["mxfp4"] == repr(__import__("jax_mxfp4").Recipe())
    steps = {"train-small": 1, "serve-1": profile_steps.QUICK_SERVE["positions"]}
    for r in res["rows"]:
        f = 2 if r["variant"] == "mxfp4" else 1
        assert r["status"] == "ok" and _finite_positive(r["step_s"], r["wall_s"]), r
        assert r["steps_per_call"] == steps[r["workload"]] and r["calls"] >= 1
        p = r["profile"]
        want = {c: f * v / r["steps_per_call"] for c, v in FAKE_CATEGORIES.items()}
        assert p["categories"] == pytest.approx(want, rel=1e-12) and p["unmatched"] == ["mystery_kernel"]
        assert p["timeline"]["span_s"] == pytest.approx(f * 18.75e-3 / r["steps_per_call"])
    md = (tmp_path / "profile_steps.md").read_text()
    assert "| gemm | 8.000 | 16.000 | 2.00x | 2.000 | 4.000 | 2.00x |" in md
    assert "| gaps | 3.000 | 6.000 | 2.00x | 0.750 | 1.500 | 2.00x |" in md
    assert "| GPU span | 18.750 | 37.500 | 2.00x | 4.688 | 9.375 | 2.00x |" in md
    assert f"Command: `XLA_FLAGS={shlex.quote(os.environ['XLA_FLAGS'])} python benchmarks/profile_steps.py --quick" in md
    assert "**step time (fair timing)**" in md and "`mystery_kernel`" in md
    assert "- serve-1 mxfp4: `nvjet_sm90_tst_128x128_64x6_2x1_v_bz_TNT` 4.000 (gemm); `mxfp4_quantize_fp8__4` 2.000" in md
    _png(tmp_path / "profile_steps.png")


def test_profile_steps_serving_step_is_generate_pys():
    """The serving workload's parameters have the tree, shapes and dtypes of the linen model's
    init (GEMM kernels bf16, as generate.py serves them); its decode loop gives the tokens of
    generate.py's own program (``make_generate`` with a one-byte prompt: prefill at position 0,
    then the same step), with bf16 and with prepared MXFP4 weights."""
    import jax
    import jax.numpy as jnp
    import generate as gen
    import train_lm as demo

    sm = profile_steps.ServeModel(quick=True)
    cfg, n = sm.cfg, sm.positions
    params = profile_steps.serve_params(cfg)
    model = demo.build_model(cfg, __import__("jax_mxfp4").Recipe(**demo.BF16_RECIPE_FIELDS))
    ref = model.init(jax.random.key(0), jnp.zeros((1, n), jnp.int32))["params"]
    assert jax.tree.structure(params) == jax.tree.structure(ref)
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(ref)):
        kernel = path[-1].key == "kernel"
        assert got.shape == want.shape and got.dtype == (jnp.bfloat16 if kernel else want.dtype), path
    tok = jnp.asarray([7, 200, 31], jnp.int32)
    generate = gen.make_generate(cfg, 1, n - 1)
    for variant in profile_steps.VARIANTS:
        w = sm.weights(variant)
        want, _ = generate(w, tok[:, None])  # [B, n - 1]: the bytes fed at positions 1 .. n-1
        got = profile_steps.make_decode_loop(cfg, n)(w, tok)  # [n, B]: the argmax after each position
        np.testing.assert_array_equal(np.asarray(got[:-1]).T, np.asarray(want))


def test_kernel_categories_of_the_libraries_kernels_read_from_the_source():
    """Every Pallas kernel name in jax_mxfp4 (a pallas_call's name=; Triton appends "__N") and
    every Mosaic GPU kernel (plgpu.kernel of a body function: "<body>_mosaic_gpu_kernel" in a
    profile) falls in its category: a new or renamed kernel fails here until the table knows it
    (a name of ``want`` may be missing: a kernel of another line of work, or one removed)."""
    import glob
    import re

    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "jax_mxfp4")
    names, mosaic = set(), {}
    for path in glob.glob(os.path.join(root, "**", "*.py"), recursive=True):
        text = open(path).read()
        for call in re.finditer(r"pallas_call\(", text):
            depth, end = 1, call.end()
            while depth and end < len(text):  # to the call's closing parenthesis
                depth += {"(": 1, ")": -1}.get(text[end], 0)
                end += 1
            names.update(re.findall(r"\bname=\"(\w+)\"", text[call.end():end]))
        for body in re.findall(r"plgpu\.kernel\(\s*(\w+)", text):
            mosaic.setdefault(os.path.basename(path), set()).add(body)
    want = {"mxfp4_wgemm": "gemm", "mxfp4_decode_bf16": "gemm", "mxfp4_grouped_wgemm": "gemm",
            "mxfp4_quantize": "quantize", "mxfp4_quantize_fp8": "quantize", "mxfp4_encode_fp8_rows_swar": "quantize",
            "mxfp4_quantize_columns": "quantize",
            "mxfp4_fp8_rescale": "rescale / exact rows", "mxfp4_fp8_exact_rows_index": "rescale / exact rows",
            "mxfp4_fp8_fix_flagged": "rescale / exact rows"}
    assert {"mxfp4_wgemm", "mxfp4_quantize_fp8", "mxfp4_fp8_rescale"} <= names <= set(want), names - set(want)
    for name, category in want.items():
        assert common.kernel_category(name) == category and common.kernel_category(name + "__12") == category
    assert mosaic == {"wgemm_mgpu.py": {"body"}, "wgemm_tiles_mgpu.py": {"body"}}  # the w4a16 GEMMs only
    assert common.kernel_category("body_mosaic_gpu_kernel") == "gemm"


@pytest.mark.parametrize("name,category", [
    # names from H200 profiles (benchmarks/results/*-h200): cuBLAS(Lt), Triton GEMM fusions, XLA fusions
    ("nvjet_sm90_qqtst_256x128_128x4_1x2_v_bz_coopA_TNN", "gemm"),
    ("sm90_xmma_gemm_f32f32_tf32f32_f32_nn_n_tilesize64x64x32_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas",
     "gemm"),
    ("gemm_fusion_dot_general_2", "gemm"), ("cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_32x6_tn_align8", "gemm"),
    ("loop_convert_shift_left_fusion", "quantize"), ("loop_shift_left_fusion", "quantize"),
    ("loop_xor_fusion_2", "quantize"), ("rng_bit_generator", "quantize"),
    ("wrapped_transpose_3", "transpose / copy"), ("input_multiply_transpose_fusion_3", "transpose / copy"),
    ("Memset 0", "transpose / copy"), ("input_concatenate_fusion_5", "transpose / copy"),
    ("loop_dynamic_update_slice_fusion", "transpose / copy"), ("wrapped_copy", "transpose / copy"),
    ("loop_convert_tanh_fusion", "elementwise / reduction"), ("input_reduce_fusion_65", "elementwise / reduction"),
    ("triton_softmax_384", "elementwise / reduction"),
    ("loop_select_fusion", "elementwise / reduction"), ("fusion_2716", "elementwise / reduction"),
    ("loop_and_fusion", "elementwise / reduction"),  # "and" alone is also a mask's: not counted as quantize
    ("wrapped_exponential", "elementwise / reduction"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "other"), ("", "other"),
])
def test_kernel_category_of_a_name(name, category):
    assert common.kernel_category(name) == category


def test_kernel_summary_sums_categories_per_step_and_takes_gaps_from_the_timeline(capsys):
    """kernel_summary: per-kernel seconds / per into categories (several kernels per category),
    the timeline's idle time as gaps, kernels ranked, the unmatched names listed."""
    per_kernel = {"nvjet_a": 6.0, "gemm_fusion_dot": 2.0, "mxfp4_quantize__3": 1.0, "loop_add_fusion": 0.5,
                  "input_reduce_fusion": 0.25, "odd": 0.125}
    s = common.kernel_summary(per_kernel, {"span_s": 12.0, "busy_s": 9.875, "idle_s": 2.125, "kernels": 6},
                              per=2, top=3, label="x: ")
    assert s["categories"] == {"gemm": 4.0, "quantize": 0.5, "rescale / exact rows": 0.0, "transpose / copy": 0.0,
                               "elementwise / reduction": 0.375, "other": 0.0625, "gaps": 1.0625}
    assert s["kernel_s"] == 4.9375 and s["n_kernels"] == 6 and s["unmatched"] == ["odd"]
    assert s["top"] == {"nvjet_a": 3.0, "gemm_fusion_dot": 1.0, "mxfp4_quantize__3": 0.5}
    assert s["timeline"] == {"span_s": 6.0, "busy_s": 4.9375, "idle_s": 1.0625, "kernels": 3}
    assert "x: kernels 4937.500 ms, GPU span 6000.000 ms" in capsys.readouterr().out
    assert "gaps" not in common.kernel_summary({"a": 1.0})["categories"]  # no timeline: no gaps figure


def test_profile_steps_table_without_a_device_profile_and_with_a_failed_row():
    """On a CPU the categories are n/a (no ratio), the step time is measured; a failed row shows
    its status and is listed with its reason."""
    info = {"device": "cpu", "platform": "cpu", "jax": "0", "date_utc": "now", "command": "python x"}
    result = {"info": info, "workloads": {"serve-1": {"kind": "serve", "batch": 1, "steps_per_call": 4,
                                                      "model": {"d_model": 64, "n_layers": 1, "n_heads": 2,
                                                                "seq_len": 4}, "weights": {"mxfp4": "w4a16"}}},
              "rows": [{"workload": "serve-1", "variant": "bf16", "status": "ok", "step_s": 2e-3},
                       {"workload": "serve-1", "variant": "mxfp4", "status": "error", "reason": "Boom: no"}]}
    md = profile_steps.markdown(result)
    assert "| gemm | n/a | error | – |" in md and "| **step time (fair timing)** | 2.000 | error | – |" in md
    assert "- serve-1 mxfp4: Boom: no" in md
    result["rows"][1] = {"workload": "serve-1", "variant": "mxfp4", "status": "ok", "step_s": 1e-3}
    assert "| **step time (fair timing)** | 2.000 | 1.000 | 0.50x |" in profile_steps.markdown(result)


@pytest.mark.slow  # trains and compiles both recipes
def test_profile_steps_trained_steps_profiles_each_recipes_trained_parameters():
    """--trained-steps 2: each recipe's operand sets hold the parameters its own two steps of the
    demo reached (not the initial ones; bf16's and MXFP4's differ) and continue the demo's step
    count (3, 4, ...)."""
    import jax

    _, makers0 = profile_steps.train_workload("small", True)
    desc, makers = profile_steps.train_workload("small", True, trained_steps=2)
    assert desc["trained_steps"] == 2
    p0 = makers0["mxfp4"]()[1][0][0]
    leaves = {}
    for v in ("bf16", "mxfp4"):
        _, sets, _ = makers[v]()
        assert [int(s[3]) for s in sets] == list(range(3, 3 + profile_steps.N_SETS))
        leaves[v] = jax.tree.leaves(sets[0][0])
    init = jax.tree.leaves(p0)
    for v in leaves:
        assert any(not np.array_equal(a, b) for a, b in zip(leaves[v], init)), v
    assert any(not np.array_equal(a, b) for a, b in zip(leaves["bf16"], leaves["mxfp4"]))


def test_profile_steps_refuses_unknown_workloads_and_gpu_sizes_in_quick(tmp_path, capsys):
    for argv, msg in ((["--workloads", "train-large,serve-2"], "--workloads: unknown name(s) 'serve-2'"),
                      (["--quick", "--workloads", "serve-1,train-xl"], "--workloads: train-xl not a --quick workload"),
                      (["--quick", "--trained-steps", "-1"], "--trained-steps must be >= 0, got -1")):
        with pytest.raises(SystemExit) as e:
            profile_steps.main(["--out", str(tmp_path)] + argv)
        assert e.value.code == 2 and msg in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.mark.slow  # a whole benchmark program (test_gemm_quick keeps one in the default tier)
def test_quantize_quick(tmp_path):
    assert quantize.main(["--quick", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "quantize.json").read_text())
    assert [r["what"] for r in res["rows"]] == ["copy (x*1.0001)", "fused even/nearest", "fused even/stochastic",
                                                "fused even/stochastic (rbg key: uniforms read)"]
    assert all(_finite_positive(r["median_s"], r["gb_s"], r["ratio_vs_copy"]) for r in res["rows"])
    assert res["checks"] and all(c["ok"] for c in res["checks"])  # fused == reference, bit for bit
    assert "x copy" in (tmp_path / "quantize.md").read_text()
    _png(tmp_path / "quantize_bandwidth.png")


@pytest.mark.slow  # a whole benchmark program (test_gemm_quick keeps one in the default tier)
def test_quantize_strided_quick(tmp_path):
    """--strided: each library route beside the route it replaced, bit-checked in the run (the
    Pallas interpreter here), and the strided kernel's tiles."""
    assert quantize.main(["--strided", "--quick", "--dtypes", "float32", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "quantize.json").read_text())
    whats = [r["what"] for r in res["rows"]]
    assert whats[0] == "copy (x*1.0001)" and sum("strided-axis kernel" in w for w in whats) == 3
    assert sum("XLA transpose, then rows" in w for w in whats) == 3 and sum(w.startswith("sweep") for w in whats) == 2
    assert all(_finite_positive(r["median_s"], r["gb_s"], r["ratio_vs_copy"]) for r in res["rows"])
    assert len(res["checks"]) == 3 and all(c["ok"] for c in res["checks"])
    _png(tmp_path / "quantize_bandwidth.png")


@pytest.mark.parametrize("argv,msg", [(["--strided", "--sweep"], "takes no --sweep"),
                                      (["--dtypes", "float64"], "--dtypes: each must be"),
                                      (["--strided", "--dtypes", "int8"], "--dtypes: each must be")])
def test_quantize_refuses_bad_flags(argv, msg, tmp_path, capsys):
    """float64 ran as float32 (x64 off) under a float64 label; int8 ended in a traceback."""
    with pytest.raises(SystemExit) as e:
        quantize.main(argv + ["--out", str(tmp_path)])
    assert e.value.code == 2 and msg in capsys.readouterr().err


@pytest.mark.slow  # a whole benchmark program (test_gemm_quick keeps one in the default tier)
def test_row_spans_quick(tmp_path):
    """Three steps of a tiny main job: every sampled step reports each FP8 GEMM of the step (fprop,
    dgrad and wgrad of 5 layers), the gradient operand of dgrad and wgrad handed in as E5M2."""
    assert row_spans.main(["--quick", "--every", "2", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "row_spans.json").read_text())
    assert [s["step"] for s in res["samples"]] == [0, 2]
    for s in res["samples"]:
        fmts = [tuple(g["formats"]) for g in s["gemms"]]
        assert len(fmts) == 15 and fmts.count(("e4m3", "e4m3")) == 5, fmts
        assert fmts.count(("e5m2", "e4m3")) == 5 and fmts.count(("e4m3", "e5m2")) == 5, fmts
        for g in s["gemms"]:
            assert sum(g["lhs_hist"]) == g["batch"] * g["m"] and sum(g["rhs_hist"]) == g["batch"] * g["n"]
            assert sum(g["lhs_tensor_hist"]) == g["batch"] * g["m"]
            assert g["lhs_tensor"]["max"] >= g["lhs"]["max"] and g["rhs_tensor"]["median"] >= g["rhs"]["median"]
    assert "| GEMM | M x N x K |" in (tmp_path / "row_spans.md").read_text()
    _png(tmp_path / "row_spans.png")


def test_row_spans_histogram_and_summary(rng):
    """row_span_histogram against NumPy on rows with chosen spans (all-zero blocks not counted,
    an all-zero row spans 0), for an MXFP4Array and its E5M2 FP8Prepared; summarize's shares."""
    import jax.numpy as jnp

    import jax_mxfp4 as mx
    from jax_mxfp4.fp8_prepared import to_fp8
    from mx_reference import pack_ref

    r, nb = 7, 4
    codes = rng.integers(1, 16, (r, nb * 32)).astype(np.uint8)
    sb = np.full((r, nb), 120, np.uint8)
    want = [0, 3, 14, 15, 28, 29, 0]
    for i, s in enumerate(want[:-1]):
        sb[i, 2] = 120 - s
    codes[1, 32:64] = 0  # an all-zero block with a far scale: not counted
    sb[1, 1] = 2
    codes[6] = 0
    x = mx.MXFP4Array(jnp.asarray(pack_ref(codes, 1))[None], jnp.asarray(sb).view(jnp.float8_e8m0fnu)[None], 2,
                      (1, r, nb * 32), jnp.float32)
    expect = np.bincount(want, minlength=row_spans.MAX_SPAN + 1)
    for v in (x, to_fp8(x, "e5m2")):
        np.testing.assert_array_equal(np.asarray(row_spans.row_span_histogram(v)), expect)
    # from the operand's largest block: row 2 holds it (byte 120 + 3); the all-zero row still spans 0
    sb[2, 0] = 123
    x = mx.MXFP4Array(jnp.asarray(pack_ref(codes, 1))[None], jnp.asarray(sb).view(jnp.float8_e8m0fnu)[None], 2,
                      (1, r, nb * 32), jnp.float32)
    lows = [int(sb[i][codes[i].reshape(nb, 32).max(axis=1) > 0].min()) for i in range(r - 1)]
    expect_t = np.bincount([123 - lo for lo in lows] + [0], minlength=row_spans.MAX_SPAN + 1)
    np.testing.assert_array_equal(np.asarray(row_spans.row_span_histogram(x, "tensor")), expect_t)
    with pytest.raises(ValueError, match="anchor must be one of"):
        row_spans.row_span_histogram(x, "Tensor")
    with pytest.raises(ValueError, match="quantized along axis 2"):  # spans of the wrong axis, silently
        row_spans.row_span_histogram(mx.quantize(jnp.ones((1, 64, 32)), axis=1))
    assert row_spans.summarize(np.zeros(row_spans.MAX_SPAN + 1))["median"] == 0
    s = row_spans.summarize(expect)
    assert s == {"rows": 7, "past_14": 3 / 7, "past_28": 1 / 7, "median": 14, "max": 29}


@pytest.mark.slow  # a whole benchmark program (test_gemm_quick keeps one in the default tier)
def test_train_step_quick(tmp_path):
    assert train_step.main(["--quick", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "train_step.json").read_text())
    assert {(r["config"], r["variant"]) for r in res["rows"]} == {("linear", v) for v in train_step.VARIANTS}
    base = next(r["median_s"] for r in res["rows"] if r["variant"] == "bf16")
    for r in res["rows"]:
        assert r["status"] == "ok" and _finite_positive(r["median_s"], r["tokens_per_s"]), r
        assert r["tokens_per_s"] * r["median_s"] == pytest.approx(r["t"])
        assert r["time_ratio_vs_bf16"] == pytest.approx(r["median_s"] / base)
    assert set(res["routing_linear"]) == {"fprop", "dgrad", "wgrad"} and res["kernels_enabled"] is True
    assert "| linear |" in (tmp_path / "train_step.md").read_text()
    _png(tmp_path / "train_step.png")


def _mlp_block_reference(params, x, dy):
    """NumPy float64 loss and gradients (dparams, dx) of sum(gelu_tanh(x·W_up)·W_down · dY), the
    operands first rounded to bfloat16 as the model's bf16 dots see them (independent of JAX)."""
    import ml_dtypes

    bf = lambda a: np.asarray(a).astype(ml_dtypes.bfloat16).astype(np.float64)  # noqa: E731
    w1, w2, x, dy = bf(params["up"]["kernel"]), bf(params["down"]["kernel"]), bf(x), bf(dy)
    a = x @ w1
    u = np.sqrt(2 / np.pi) * (a + 0.044715 * a**3)
    h = 0.5 * a * (1 + np.tanh(u))
    dh_da = 0.5 * (1 + np.tanh(u)) + 0.5 * a * (1 - np.tanh(u) ** 2) * np.sqrt(2 / np.pi) * (1 + 3 * 0.044715 * a**2)
    da = (dy @ w2.T) * dh_da
    return float(((h @ w2) * dy).sum()), {"down": {"kernel": h.T @ dy}, "up": {"kernel": x.T @ da}}, da @ w1.T


@pytest.mark.slow  # a whole benchmark program (test_gemm_quick keeps one in the default tier)
def test_train_step_mlp_block_quick_qwix_peers(tmp_path, rng):
    """--configs mlp-block: one row per variant (timed, or its error recorded), ratios against the
    block's bf16 row; the bf16, jax_mxfp4-through-Qwix and Qwix FP8 steps give the loss and the
    gradients (params and x, their shapes) of a float64 reference, within each format's error, and
    the quantized ones differ from bf16 (their rule matched the Dense layers)."""
    pytest.importorskip("qwix")
    import jax
    import jax.numpy as jnp

    from benchmarks import mlp_block

    assert train_step.main(["--quick", "--out", str(tmp_path), "--configs", "mlp-block",
                            "--variants", ",".join(mlp_block.VARIANTS)]) == 0
    res = json.loads((tmp_path / "train_step.json").read_text())
    rows = {r["variant"]: r for r in res["rows"]}
    assert [(r["config"], r["variant"]) for r in res["rows"]] == [("mlp-block", v) for v in mlp_block.VARIANTS]
    for v, r in rows.items():
        assert r["status"] == "ok" or (r["status"] == "error" and r["reason"]), r
        if r["status"] == "ok":
            assert _finite_positive(r["median_s"]) and r["hidden"] == train_step.QUICK["mlp-block"]["hidden"]
            assert r["calls"] == 2  # one step on each of the 2 distinct operand sets of --quick
            assert r["time_ratio_vs_bf16"] == pytest.approx(r["median_s"] / rows["bf16"]["median_s"])
    assert all(rows[v]["status"] == "ok" for v in ("bf16", "mxfp4-qwix", "mxfp4-qwix-rbg", "qwix-fp8")), rows
    md = (tmp_path / "train_step.md").read_text()
    assert all(f"| mlp-block | T=64 d=64 hidden=256 | {v} |" in md for v in mlp_block.VARIANTS)
    # Qwix routes the block's GEMMs: no routing section of the plain linear layer, which was not run
    assert res["routing_linear"] == {} and "linear layer" not in md

    s = train_step.QUICK["mlp-block"]
    (t, d, hid) = s["t"], s["d"], s["hidden"]
    params = {"down": {"kernel": jnp.asarray(rng.standard_normal((hid, d)) / hid**0.5, jnp.float32)},
              "up": {"kernel": jnp.asarray(rng.standard_normal((d, hid)) / d**0.5, jnp.float32)}}
    x, dy = (jnp.asarray(rng.standard_normal((t, d)), jnp.bfloat16) for _ in range(2))
    like = mlp_block.make_set(s, seed=1)  # the benchmark's operands: the same tree, shapes and dtypes
    spec = lambda tree: jax.tree.map(lambda a: (a.shape, a.dtype), tree)  # noqa: E731
    assert spec((params, x, dy)) == spec(like)
    want_loss, want_dp, want_dx = _mlp_block_reference(params, x, dy)
    rel = lambda got, want: float(np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want))  # noqa: E731
    # relative error bounds: bf16 rounding of h and Y; FP8 e4m3/e5m2; MXFP4 (dY stochastically rounded)
    bounds = {"bf16": (0.0, 0.02), "qwix-fp8": (0.02, 0.2), "mxfp4-qwix": (0.1, 0.5), "mxfp4-qwix-rbg": (0.1, 0.5)}
    dxs = {}
    for v, (lo, hi) in bounds.items():
        loss, (dp, dx) = jax.jit(mlp_block.make_step(v, hid))(params, x, dy)
        dxs[v] = np.asarray(dx, np.float32)
        assert loss.shape == () and np.isfinite(float(loss)), v
        assert dx.shape == x.shape and jax.tree.map(jnp.shape, dp) == jax.tree.map(jnp.shape, params), v
        errs = [rel(dx, want_dx)] + [rel(g, w) for g, w in zip(jax.tree.leaves(dp), jax.tree.leaves(want_dp))]
        assert all(np.isfinite(e) and lo <= e <= hi for e in errs), (v, errs)
        assert abs(float(loss) - want_loss) <= hi * np.abs(want_loss) + hi * float(np.linalg.norm(want_dx)), (v, float(loss), want_loss)
    # the rbg stream's key reaches the rounding: another draw than the data-derived key's
    assert not np.array_equal(dxs["mxfp4-qwix"], dxs["mxfp4-qwix-rbg"])


def test_train_step_mlp_block_records_a_failing_peer(tmp_path, monkeypatch):
    """A Qwix variant whose step fails to trace (as Qwix's MXFP4 backward does without its tiled
    gradient) is a row with status "error" and the reason, in the JSON and the table; the run
    goes on and exits 0."""
    pytest.importorskip("qwix")
    from benchmarks import mlp_block

    real = mlp_block.make_step

    def make_step(variant, hidden):
        if variant != "qwix-mxfp4":
            return real(variant, hidden)

        def step(*args):
            raise ValueError("Format mxfp4 requires `tiled_axes` to be specified.")

        return step

    monkeypatch.setattr(mlp_block, "make_step", make_step)
    argv = ["--quick", "--out", str(tmp_path), "--configs", "mlp-block", "--variants", "qwix-mxfp4"]
    assert train_step.main(argv) == 1  # the exit status says a row is not ok
    rows = json.loads((tmp_path / "train_step.json").read_text())["rows"]
    assert [(r["variant"], r["status"]) for r in rows] == [("bf16", "ok"), ("qwix-mxfp4", "error")]
    assert rows[1]["reason"] == "ValueError: Format mxfp4 requires `tiled_axes` to be specified."
    assert "| qwix-mxfp4 | error: ValueError: Format mxfp4 requires" in (tmp_path / "train_step.md").read_text()


@pytest.mark.slow  # a whole benchmark program
def test_compile_time_quick(tmp_path):
    """One child process (the MXFP4 recipe) of the tiny model: its phase times come back."""
    assert compile_time.main(["--quick", "--recipes", "mxfp4", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "compile_time.json").read_text())
    (row,) = res["rows"]
    assert (row["flags"], row["recipe"], row["status"]) == ("default", "mxfp4", "ok"), row.get("reason")
    assert _finite_positive(*(row[k] for k in ("trace_s", "lower_s", "compile_s", "first_step_s", "step_s")))
    assert math.isfinite(row["loss"]) and row["hlo_dot_generals"] > 0
    assert "| default | mxfp4 |" in (tmp_path / "compile_time.md").read_text()
    _png(tmp_path / "compile_time.png")


# ---- heavier runs


@pytest.mark.slow
def test_gemm_quick_every_backend(tmp_path):
    """--quick with --only naming every backend: each one available on a CPU runs (hipBLASLt is
    skipped with its reason), including the stored-layout dispatch rows at decode size."""
    every = sorted({b for names in gemm.BACKENDS.values() for b in names})
    assert gemm.main(["--quick", "--only", ",".join(every), "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "gemm.json").read_text())["rows"]
    ok = {(r["variant"], r["backend"]) for r in rows if r.get("status") == "ok"}
    assert {("bf16", "bf16"), ("a4w4", "xla"), ("a4w4", "pallas"), ("w4a16", "pallas")} <= ok
    assert {("a4w4", "fp8"), ("a4w4", "fp8-prepared"), ("a4w4", "fp8-high"), ("e4m3", "xla-fp8")} <= ok
    assert {("a4w4", b) for b in gemm.DISPATCH_ROWS} | {("w4a16", b) for b in gemm.DISPATCH_ROWS[:3]} <= ok
    assert all(_finite_positive(r["median_s"]) for r in rows if r.get("status") == "ok")


def test_train_step_profile_writes_the_hlo(tmp_path):
    """--hlo into a missing folder (it crashed after the timing): the folder is made and holds the
    profiled step's HLO."""
    hlo = tmp_path / "new" / "hlo"
    assert train_step.main(["--quick", "--out", str(tmp_path), "--configs", "linear", "--variants",
                            "mxfp4-nearest", "--profile", "mxfp4-nearest", "--hlo", str(hlo)]) == 0
    assert "HloModule" in (hlo / "hlo_linear_mxfp4-nearest.txt").read_text()


@pytest.mark.slow
def test_train_step_check_fused_runs_the_fused_kernels_off_cuda(tmp_path):
    """--check-fused compared the fused with the unfused passes on the platform's default route:
    off CUDA neither ran a fused kernel and "bit-identical" held trivially. Now it runs them in the
    Pallas interpreter (backend fp8) against JAX_MXFP4_KERNELS=0 and says how many kernels the
    fused step has: dY's two stochastic quantizations fused, with the data-derived threefry key
    and with an rbg key."""
    assert train_step.main(["--quick", "--out", str(tmp_path), "--check-fused", "--configs", "linear",
                            "--variants", "mxfp4-nearest"]) == 0
    checks = json.loads((tmp_path / "train_step.json").read_text())["fused_checks"]
    assert [c["key"] for c in checks] == ["data-derived (threefry)", "rbg"]
    for c in checks:
        assert c["interpret"] and c["fused_kernels"] >= 2 and c["fp8_quantize_kernels"] == 2, c
        assert c["bit_identical"] == [True, True, True] and c["max_abs_diff"] == [0.0, 0.0, 0.0], c
    md = (tmp_path / "train_step.md").read_text()
    assert "quantize-to-FP8 (Pallas interpreter), against $JAX_MXFP4_KERNELS=0, key rbg" in md


# ---- benchmarks/common.py: fair timing and its parts


def test_fair_timing_grows_programs_and_keeps_calls_distinct():
    """time_fn grows the calls per program until one program takes min_program_s, and every
    call beyond the given sets gets its own copy of the smallest operand (no two calls alike)."""
    import jax.numpy as jnp

    from benchmarks.common import _with_distinct_calls, kernel_time, time_fn

    sets = [(jnp.full((256, 256), float(i)), jnp.full((4,), float(i))) for i in range(2)]
    r = time_fn(lambda a, b: (a @ a).sum() + b.sum(), sets, reps=3, min_program_s=0.02, max_calls=256)
    assert r["program_s"] >= 0.02 * 0.5 and r["calls"] > len(sets)  # grown past the 2 sets
    assert abs(r["median_s"] * r["calls"] - r["program_s"]) < 1e-12
    calls = _with_distinct_calls(sets, 5)
    small = [c[1] for c in calls]
    assert len({id(x) for x in small}) == 5 and all(float(x[0]) == i % 2 for i, x in enumerate(small))
    assert all(c[0] is sets[i % 2][0] for i, c in enumerate(calls))  # the large operand rotates
    assert "error" in kernel_time(lambda a, b: a @ a, sets)  # no GPU plane on the CPU
    # calls=1: one call per program where it is long enough (a training step), the sets kept for growth
    r = time_fn(lambda a, b: (a @ a).sum() + b.sum(), sets, reps=3, min_program_s=0.0, calls=1, profile_calls=3)
    assert r["calls"] == 1 and r["profile"] == {"error": "no GPU kernel events in the profile"}
    assert all(c is s for c, s in zip(_with_distinct_calls(sets, 2), sets))  # within the sets: no copies


def test_busy_span_counts_overlaps_once_and_gaps_as_idle(rng):
    """The timeline's busy time is the union of kernel intervals; idle = span - busy."""
    from benchmarks.common import busy_span

    assert busy_span([]) == (0.0, 0.0)
    assert busy_span([(10, 20), (30, 35)]) == (25, 15)  # one 10-unit gap
    assert busy_span([(0, 10), (5, 12), (11, 13), (20, 21)]) == (21, 14)  # overlaps merged
    ivs = [(int(s), int(s) + int(d)) for s, d in zip(rng.integers(0, 201, 40), rng.integers(0, 10, 40))]
    covered = {t for s, e in ivs for t in range(s, e)}  # unit cells: an independent union
    span, busy = busy_span(ivs)
    assert busy == len(covered) and span == max(e for _, e in ivs) - min(s for s, _ in ivs)


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


def test_out_folder_that_cannot_be_made_is_a_clear_error_before_the_work(tmp_path):
    """common.out_dir: a file in the way is SystemExit naming --out (was a FileExistsError
    traceback, in compile_time after a child process)."""
    from benchmarks.common import default_out, out_dir

    afile = tmp_path / "afile"
    afile.write_text("")
    assert out_dir(str(tmp_path / "new" / "sub")) == str(tmp_path / "new" / "sub")
    for bad in (afile, afile / "sub"):
        with pytest.raises(SystemExit, match="--out must name a folder"):
            out_dir(str(bad))
    t0 = __import__("time").time()
    with pytest.raises(SystemExit, match="--out must name a folder"):
        compile_time.main(["--size", "small", "--recipes", "bf16", "--flags", "default", "--out", str(afile)])
    assert __import__("time").time() - t0 < 20  # refused before any child process
    assert default_out("gemm") == os.path.join("bench_out", "gemm")  # outside the source tree (git-ignored)


# ---- what the scripts refuse (argparse errors, exit 2, before any work)


def test_no_benchmark_writes_into_the_source_tree_by_default(monkeypatch):
    """Every benchmark's default --out is under bench_out/ (git-ignored), never benchmarks/results."""
    from benchmarks import sharded

    seen = []

    def fake_out_dir(path):  # record the folder and stop before any work
        seen.append(path)
        raise SystemExit(0)

    monkeypatch.setattr("benchmarks.common.out_dir", fake_out_dir)  # compile_time imports it late
    for mod in (gemm, quantize, train_step, sharded, moe, profile_steps):
        monkeypatch.setattr(mod, "out_dir", fake_out_dir)
    for mod in (gemm, quantize, train_step, sharded, compile_time, moe, profile_steps):
        for argv in (["--quick"], []):
            with pytest.raises(SystemExit):
                mod.main(argv)
    assert len(seen) == 14 and all(p.startswith("bench_out" + os.sep) for p in seen), seen


def test_train_step_refuses_names_it_would_skip(tmp_path, capsys):
    """Unknown configs/variants/profiled variants and --hlo without --profile were skipped
    silently (exit 0, an empty or bf16-only table); now argparse errors naming the flag."""
    for argv, msg in ((["--configs", "linera"], "--configs: unknown name(s) 'linera'; choose from linear, mlp"),
                      (["--configs", "mlp-d1024"], "--configs: unknown name(s) 'mlp-d1024'"),  # not a --quick config
                      (["--variants", "mxfp4,bogus"], "--variants: unknown name(s) 'bogus'"),
                      # a variant of another config (mlp-block's Qwix rows), not of the configs run
                      (["--variants", "qwix-fp8"], "--variants: unknown name(s) 'qwix-fp8' for configs linear"),
                      (["--profile", "bogus"], "--profile: unknown name(s) 'bogus'"),
                      (["--variants", "mxfp4-nearest", "--profile", "mxfp4"],
                       "--profile: 'mxfp4' not among the --variants run"),
                      (["--hlo", str(tmp_path / "h")], "--hlo DIR writes the HLO of each profiled step")):
        with pytest.raises(SystemExit) as e:
            train_step.main(["--quick", "--out", str(tmp_path)] + argv)
        assert e.value.code == 2 and msg in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_train_step_mlp_block_without_qwix_is_refused_by_name(tmp_path, capsys, monkeypatch):
    """--configs mlp-block where a package it imports is missing: an argparse error naming the
    package and the extra to install (was an ImportError traceback after the start-up)."""
    monkeypatch.setattr(train_step, "BLOCK_PACKAGES", ("flax", "qwix_not_installed"))
    with pytest.raises(SystemExit) as e:
        train_step.main(["--quick", "--out", str(tmp_path), "--configs", "linear,mlp-block"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--configs mlp-block builds a Flax model quantized by Qwix" in err
    assert "qwix_not_installed not installed (pip install 'jax-mxfp4[qwix]')" in err
    assert not list(tmp_path.iterdir())


def test_gemm_refuses_what_it_would_skip(tmp_path, capsys):
    """--only/--layers/--decode-m values outside the benchmark's lists were skipped silently (an
    empty table, exit 0), malformed ones raised a bare int() traceback, and --quick ignored them."""
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
                      (["--size", "tiny"], "--size must be one of"),
                      (["--d-model", "100"], "--d-model must be a positive multiple of 32"),
                      (["--d-model", "0"], "--d-model must be a positive multiple of 32")):
        with pytest.raises(SystemExit) as e:
            compile_time.main(base + argv)
        assert e.value.code == 2 and msg in capsys.readouterr().err, argv
    for lr in ("0", "nan", "inf"):
        with pytest.raises(SystemExit):
            compile_time.main(base + ["--lr", lr])
        assert "--lr" in capsys.readouterr().err
    assert not os.listdir(tmp_path)  # nothing ran


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
