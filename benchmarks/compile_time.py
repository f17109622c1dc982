"""Compile time of the demo's training step (examples/train_lm.py), bf16 against MXFP4, per XLA flag set.

Why: on an NVIDIA H200 (jax 0.11.2, 2026-12-01) the MXFP4 step of ``python examples/train_lm.py
--size large`` did not finish compiling within ~200 s while the bf16 step compiled in ~10 s;
tracing and lowering take ~9 s on a CPU. This script separates the phases: per (recipe, XLA_FLAGS) it runs a fresh process
that builds the demo's model and jitted step (``demo.make_train_step``) and times
``jit(...).trace`` + ``lower`` and ``compile`` separately, and the first and a later step.
Each process is bounded by ``--timeout`` (a run cut there is reported as such).

Usage: python benchmarks/compile_time.py [--quick] [--size large] [--recipes bf16,mxfp4] [--flags default,autotune0]
       [--d-model N] [--data random|corpus] [--lr LR] [--timeout 240] [--profile] [--out DIR]
(--quick: the demo's small size cut to QUICK_MODEL (no blocks, d_model 32), flag set "default":
checks the pipeline on a CPU in seconds. --profile: after the timed steps, 3 steps under the
profiler; prints the top kernels per step.)
Flag sets: default (none); autotune0 ``--xla_gpu_autotune_level=0``; notriton
``--xla_gpu_enable_triton_gemm=false``. Prints a table and writes compile_time.json (after every
process: a cut run keeps its rows), compile_time.md and compile_time.png to --out (default
bench_out/compile_time, bench_out/compile_time-quick with --quick).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import benchmarks  # noqa: E402,F401  (puts examples/ on sys.path)
from train_lm import learning_rate  # noqa: E402  (stdlib + NumPy at import: no JAX yet)

FLAG_SETS = {"default": "", "autotune0": "--xla_gpu_autotune_level=0",
             "notriton": "--xla_gpu_enable_triton_gemm=false"}
QUICK_MODEL = dict(d_model=32, n_layers=0, seq_len=32, batch=2)
"""--quick: these fields replace the small size's (no blocks: the embedding and the MXFP4 LM head)."""
PHASES = ("trace_s", "lower_s", "compile_s")


def _profile_steps(compiled, params, opt_state, batches, steps: int = 3, top: int = 25) -> dict:
    """Device kernel time per step from the JAX profiler over ``steps`` steps (batches(9), ...): the
    sum and the ``top`` kernels (``benchmarks.common.device_kernel_times``)."""
    import jax

    from benchmarks.common import device_kernel_times

    def run():
        p, o = params, opt_state
        for i in range(steps):
            p, o, loss = compiled(p, o, batches(9 + i), 100 + i)
        jax.block_until_ready(loss)

    timeline: dict = {}
    per = device_kernel_times(run, per=steps, timeline=timeline)
    if not per:
        return {"error": "no GPU kernel events in the profile (not a GPU?)"}
    ranked = sorted(((name, t * 1e3) for name, t in per.items()), key=lambda kv: -kv[1])
    for name, ms in ranked[:top]:
        print(f"    {ms:8.3f} ms  {name[:90]}", flush=True)
    if timeline:
        print(f"  timeline per step: GPU span {timeline['span_s'] * 1e3:.2f} ms, busy {timeline['busy_s'] * 1e3:.2f}, "
              f"idle {timeline['idle_s'] * 1e3:.2f}, {timeline['kernels']:.0f} kernel launches", flush=True)
    return {"kernel_ms_per_step": sum(ms for _, ms in ranked), "kernels": len(per), "top": ranked[:top],
            "timeline": timeline}


def child(size: str, recipe_name: str, layers: int | None, profile: bool = False, d_model: int | None = None,
          data: str = "random", lr: float | None = None, quick: bool = False) -> dict:
    """Runs in the fresh process: phase times of one demo step compile (seconds)."""
    import jax
    import train_lm as demo

    from jax_mxfp4.recipe import Recipe

    cfg = dict(demo.SIZES[size])
    if quick:
        cfg.update(QUICK_MODEL)
    if layers is not None:
        cfg["n_layers"] = layers
    if d_model is not None:
        cfg["d_model"] = d_model
    if lr is not None:
        cfg["lr"] = lr
    recipe = Recipe(**demo.BF16_RECIPE_FIELDS) if recipe_name == "bf16" else Recipe()
    model = demo.build_model(cfg, recipe)
    from benchmarks.common import demo_batches

    batches = demo_batches(cfg, 12, data)  # steps 0-5 timed together, 6-8 one by one, 9-11 profiled
    batch = batches(0)
    params = model.init(jax.random.key(0), batch[:, :-1])
    step, opt, _ = demo.make_train_step(model, cfg, cfg["steps"], 0)  # the size's schedule (its warmup)
    opt_state = opt.init(params)
    out = {}
    t0 = time.perf_counter()
    traced = step.trace(params, opt_state, batch, 0)
    out["trace_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    lowered = traced.lower()
    out["lower_s"] = time.perf_counter() - t0
    txt = lowered.as_text()
    out["hlo_while_loops"] = txt.count("stablehlo.while")
    out["hlo_dot_generals"] = txt.count("stablehlo.dot_general")
    out["hlo_custom_calls"] = txt.count("stablehlo.custom_call")
    print(f"  traced {out['trace_s']:.1f} s, lowered {out['lower_s']:.1f} s ({out['hlo_dot_generals']} dot_general, "
          f"{out['hlo_while_loops']} while, {out['hlo_custom_calls']} custom_call); compiling...", flush=True)
    t0 = time.perf_counter()
    compiled = lowered.compile()
    out["compile_s"] = time.perf_counter() - t0
    print(f"  compiled {out['compile_s']:.1f} s", flush=True)
    t0 = time.perf_counter()
    params, opt_state, loss = compiled(params, opt_state, batch, 0)
    jax.block_until_ready(loss)
    out["first_step_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(5):
        params, opt_state, loss = compiled(params, opt_state, batches(i + 1), i + 1)
    jax.block_until_ready(loss)
    out["step_s"] = (time.perf_counter() - t0) / 5
    each = []  # one step at a time, waited for (as the demo's loop runs): where a step's time goes
    for i in range(3):
        t0 = time.perf_counter()
        params, opt_state, loss = compiled(params, opt_state, batches(6 + i), 6 + i)
        jax.block_until_ready(loss)
        each.append(time.perf_counter() - t0)
    out["step_s_each_waited"] = each
    print(f"  steps waited for one at a time: {', '.join(f'{t * 1e3:.1f}' for t in each)} ms", flush=True)
    out["loss"] = float(loss)
    if profile:
        out["profile"] = _profile_steps(compiled, params, opt_state, batches)
        print(f"  profile: {out['profile'].get('kernel_ms_per_step', float('nan')):.2f} ms of kernels per step "
              f"(step {out['step_s'] * 1e3:.2f} ms)", flush=True)
    return out


def markdown(result) -> str:
    info = result["info"]
    lines = [f"# Demo step compile time: size {result['size']}, {info['device']} ({info['platform']}), "
             f"jax {info['jax']}, {info['date_utc']} UTC", "",
             "| flags | recipe | trace s | lower s | compile s | first step s | step ms | status |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        g = lambda k, s=1.0: f"{r[k] * s:.1f}" if k in r else "-"  # noqa: E731
        lines.append(f"| {r['flags']} | {r['recipe']} | {g('trace_s')} | {g('lower_s')} | {g('compile_s')} | "
                     f"{g('first_step_s')} | {g('step_s', 1e3)} | {r['status']} |")
    return "\n".join(lines) + "\n"


def figure(result, out):
    """Stacked trace / lower / compile seconds per (flags, recipe) run (compile_time.png)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.common import save_figure

    rows = [r for r in result["rows"] if r["status"] == "ok"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    bottom = [0.0] * len(rows)
    for phase in PHASES:
        vals = [r[phase] for r in rows]
        ax.bar(range(len(rows)), vals, 0.6, bottom=bottom, label=phase[:-2])
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(range(len(rows)), [f"{r['flags']}\n{r['recipe']}" for r in rows])
    ax.set_ylabel("seconds")
    ax.set_title(f"demo step compile, size {result['size']}")
    ax.legend()
    return save_figure(fig, out, "compile_time.png")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="the small size without blocks (d_model 32), flag set default: checks the pipeline on a CPU")
    ap.add_argument("--size", default=None, help="demo size (default large; --quick: small)")
    ap.add_argument("--layers", type=int, default=None, help="override the model's layer count")
    ap.add_argument("--d-model", type=int, default=None, help="override the model's width (a multiple of its head count and of 32)")
    ap.add_argument("--recipes", default="bf16,mxfp4", help="comma list of bf16, mxfp4")
    ap.add_argument("--flags", default=None, help=f"comma list of XLA flag sets, from {', '.join(FLAG_SETS)} "
                    "(default default,autotune0; --quick: default)")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per process")
    ap.add_argument("--out", default=None,
                    help="output folder (default bench_out/compile_time, bench_out/compile_time-quick)")
    ap.add_argument("--profile", action="store_true", help="also profile 3 steps and print the top kernels")
    ap.add_argument("--data", choices=("random", "corpus"), default="random",
                    help="random: one batch of uniform random bytes for every step; corpus: the demo's training "
                         "windows, a new batch per step (benchmarks.common.demo_batches)")
    ap.add_argument("--lr", type=learning_rate, default=None, help="peak learning rate (default the size's)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.size = args.size or ("small" if args.quick else "large")
    if args.flags is None:
        args.flags = "default" if args.quick else "default,autotune0"
    if args.child:
        print("RESULT " + json.dumps(child(args.size, args.child, args.layers, args.profile, args.d_model, args.data,
                                           args.lr, args.quick)), flush=True)
        return 0
    import train_lm as demo

    if args.size not in demo.SIZES:
        ap.error(f"--size must be one of {sorted(demo.SIZES)}")
    recipes = [r for r in args.recipes.split(",") if r]
    flags = [f for f in args.flags.split(",") if f]
    for r in recipes:
        if r not in ("bf16", "mxfp4"):
            ap.error(f"--recipes: {r!r} is not bf16 or mxfp4")
    for f in flags:
        if f not in FLAG_SETS:
            ap.error(f"--flags: {f!r} is not one of {sorted(FLAG_SETS)}")
    if not recipes or not flags:  # an empty list measured nothing: an empty table and exit 0
        ap.error("--recipes and --flags each need at least one name")
    if args.layers is not None and args.layers < 1:
        ap.error(f"--layers must be >= 1, got {args.layers}")
    if args.d_model is not None and (args.d_model < 32 or args.d_model % 32):
        ap.error(f"--d-model must be a positive multiple of 32, got {args.d_model}")
    if not args.timeout > 0:  # 0 or less cut every process before it started ("timeout" rows)
        ap.error(f"--timeout must be > 0 seconds, got {args.timeout}")
    from benchmarks.common import default_out, device_info, out_dir, write_json, write_report

    # made before the (slow) children: a file in the way failed after the first one
    out = out_dir(args.out or default_out("compile_time-quick" if args.quick else "compile_time"))
    result = {"info": device_info(), "size": args.size, "quick": args.quick, "rows": []}
    rows = result["rows"]
    for f in flags:
        for r in recipes:
            env = dict(os.environ)
            env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + FLAG_SETS[f]).strip()
            cmd = [sys.executable, os.path.abspath(__file__), "--child", r, "--size", args.size]
            if args.quick:
                cmd += ["--quick"]
            if args.layers is not None:
                cmd += ["--layers", str(args.layers)]
            if args.d_model is not None:
                cmd += ["--d-model", str(args.d_model)]
            if args.profile:
                cmd += ["--profile"]
            cmd += ["--data", args.data] + (["--lr", repr(args.lr)] if args.lr is not None else [])
            print(f"[{f} {r}] XLA_FLAGS={env['XLA_FLAGS']!r}", flush=True)
            t0 = time.perf_counter()
            row = {"flags": f, "recipe": r, "xla_flags": FLAG_SETS[f]}
            try:
                p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
                res = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
                sys.stdout.write("".join(ln + "\n" for ln in p.stdout.splitlines() if not ln.startswith("RESULT ")))
                if res:
                    row.update(json.loads(res[-1][len("RESULT "):]), status="ok")
                else:
                    row.update(status="error", reason=p.stderr[-1500:])
            except subprocess.TimeoutExpired as e:
                stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
                sys.stdout.write(stdout)
                row.update(status="timeout", reason=f"cut after {args.timeout:.0f} s")
            row["wall_s"] = time.perf_counter() - t0
            print(f"  -> {row['status']} in {row['wall_s']:.1f} s", flush=True)
            rows.append(row)
            write_json(os.path.join(out, "compile_time.json"), result)
    return write_report(out, "compile_time", result, markdown, figure)


if __name__ == "__main__":
    sys.exit(main())
