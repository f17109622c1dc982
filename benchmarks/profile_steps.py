"""Profile table: where the device time of one step goes, bf16 next to MXFP4.

Workloads (``--workloads``):
  train-large, train-xl  one training step of the demo LM, examples/train_lm.py at ``--size large``
      / ``xl`` (train-small: ``--size small``, a CPU size): its model (``build_model``), its jitted
      step (``make_train_step``: AdamW with clipping, a fresh stochastic-rounding key per step from
      the size's ``sr_key``) and its two recipes (``run_recipes`` of the default flags: bf16 =
      ``Recipe(fprop="bf16", dgrad="bf16", wgrad="bf16")``, MXFP4 = ``Recipe()``). Parameters from
      ``model.init`` (seed 0, the same for both recipes), one batch of the demo's training windows.
  serve-1, serve-16, serve-64  one decode step at batch 1, 16, 64 of examples/generate.py's model:
      its ``decode_step`` (embeddings, per block LayerNorm, the qkv GEMM, the KV-cache write,
      attention over the cache, the output projection, LayerNorm, the GELU MLP's two GEMMs; the LM
      head) in a ``lax.scan`` over 64 positions, each position's greedy argmax the next one's token
      (:func:`make_decode_loop`: ``make_generate``'s decode loop without its prefill scan), with the
      weights as generate.py serves them (``serving_weights``): bf16 kernels, or MXFP4 kernels
      quantized along K and arranged once by :func:`jax_mxfp4.prepare_decode`, multiplied without
      quantizing the activations (w4a16).

Why this serving step: the demo's trained models are small (4 blocks), and benchmarks/gemm.py's
decode rows are single GEMMs. A whole decode step of generate.py's model holds what serving pays
besides the GEMMs (norms, attention over the cache, cache writes, the loop between positions), so
it is built at an 8B-class shape: d_model 4096, 32 blocks, 32 heads (qkv 4096 -> 12288, attention
output 4096 -> 4096, MLP 4096 -> 16384 -> 4096, LM head 4096 -> 256: 201M GEMM weights per block,
6.4B in all; a Llama-3-8B-like 4096/6144/14336 stack has 218M per block, with grouped-query
attention and a gated MLP that generate.py's model does not have). The weights are random (what a
decode step costs does not depend on what was learned), made from the linen model's parameter
shapes (``jax.eval_shape`` of ``model.init``). A serving step = one call of the loop / 64
positions, with a 64-position KV cache (a short context: the GEMMs' weight reads dominate).

Timing: ``benchmarks.common.time_fn`` (fair timing: programs >= 20 ms), starting from one call per
program (a program of one step, compiled once; grown only where one call takes < 20 ms). The
operands a step reads, parameters and optimizer state or the weights, are far past the L2, so the
operand sets share them; each set has its own batch (training: the demo's windows of steps 1, 2,
...) or first tokens (serving), so that no two calls of a grown program are alike. The step time
per step = time per call / steps per call (training: 1; serving: 64). Profile: the timed
program run again under the JAX profiler (``time_fn(profile_calls=...)``, no new compile): 4
training steps, or one call of the decode loop (64 decode steps). Device kernels are grouped by name
(``benchmarks.common.KERNEL_CATEGORIES``: gemm, quantize, rescale / exact rows, transpose / copy,
elementwise / reduction, other); "gaps" = the GPU timeline's span minus the union of the kernel
intervals (the GPU idle between kernels: launches, the host's part of a loop between positions).
Categories + gaps = the GPU span per step when kernels do not overlap; the step time (fair timing)
also holds the host's launch of the program. XLA fusions are grouped by the name XLA gives them
(their main operations), so quantization that XLA fuses into a plain convert counts as
elementwise. On a CPU the profile has no device kernels: the categories are "n/a", the step times
are measured.

Output: profile_steps.json, profile_steps.md (the table, also printed) and profile_steps.png (a
stacked bar per workload and variant) in --out (default bench_out/profile_steps,
bench_out/profile_steps-quick with --quick); the JSON and the table are written again after every
workload and variant, so a run cut short keeps what it finished.

Usage: python benchmarks/profile_steps.py [--quick] [--workloads train-large,train-xl,serve-1,serve-16,serve-64] [--out DIR]
(--quick: train-small and serve-1 at tiny shapes, few iterations: checks the pipeline on a CPU in
seconds; serve-16 and serve-64 may be named too.)
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import shlex
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import (  # noqa: E402  (importing benchmarks puts examples/ on sys.path)
    CATEGORIES, GAPS, default_out, demo_batches, device_info, kernel_category, kernel_summary, out_dir, save_figure,
    time_fn, write_json, write_report)

WORKLOADS = ("train-small", "train-large", "train-xl", "serve-1", "serve-16", "serve-64")
DEFAULT_WORKLOADS = ("train-large", "train-xl", "serve-1", "serve-16", "serve-64")
QUICK_WORKLOADS = ("train-small", "serve-1", "serve-16", "serve-64")  # what --quick may run
QUICK_DEFAULT = ("train-small", "serve-1")
VARIANTS = ("bf16", "mxfp4")
QUICK_TRAIN = dict(d_model=64, n_layers=1, n_heads=2, seq_len=32, batch=2)
"""--quick: these fields replace the small size's (one block: every projection kind, few compiles)."""
SERVE = dict(d_model=4096, n_layers=32, n_heads=32, positions=64)
QUICK_SERVE = dict(d_model=64, n_layers=1, n_heads=2, positions=4)
PROFILE_TRAIN_STEPS = 4  # training steps run under the profiler (serving: one call of the decode loop)
TOP_KERNELS = 6  # largest kernels per row listed under the table
N_SETS = 8
"""Operand sets per step: the same parameters (or weights), a distinct batch (or first tokens) each,
so that a program grown past one call holds calls XLA cannot merge (``time_fn``'s ``calls``)."""
ROWS = CATEGORIES + (GAPS,)  # the table's category rows, in order


def _stamp(t0: float) -> str:
    return f"[{time.strftime('%H:%M:%S')} +{time.time() - t0:6.1f}s]"


# ----------------------------------------------------------------------------- workloads
def train_workload(size: str, quick: bool, trained_steps: int = 0):
    """(description, {variant: () -> (step fn, [operand tuple], steps per call)}) of one training
    step of the demo at ``size`` (``QUICK_TRAIN`` shapes with ``quick``), at the initial parameters
    or, with ``trained_steps``, at those each recipe reaches after that many of the demo's steps
    (rows whose block scales spread past the FP8 window appear as a model trains, and their cost
    with them: docs/performance.md)."""
    import train_lm as demo

    cfg = dict(demo.SIZES[size])
    if quick:
        cfg.update(QUICK_TRAIN)
    recipes = dict(zip(VARIANTS, demo.run_recipes(demo.parse_args(["--size", size]))))
    batches = demo_batches(cfg, trained_steps + N_SETS, "corpus")
    state = {}

    def make(variant):
        model = demo.build_model(cfg, recipes[variant])
        if "params" not in state:  # the same initial parameters for both recipes (same tree)
            state["params"] = jax.jit(model.init)(jax.random.key(0), batches(0)[:, :-1])
        params = state["params"]
        step, opt, _ = demo.make_train_step(model, cfg, cfg["steps"], 0)
        opt_state = opt.init(params)
        for i in range(trained_steps):  # this recipe's own training run
            params, opt_state, _ = step(params, opt_state, batches(i), jnp.int32(i))
        t = trained_steps
        # steps t+1..t+N_SETS of the demo: its batches, the same parameters and optimizer state
        return step, [(params, opt_state, batches(t + i), jnp.int32(t + i + 1)) for i in range(N_SETS)], 1

    desc = {"kind": "train", "size": size + (" with --quick's shapes" if quick else ""), "model": {k: cfg[k] for k in ("d_model", "n_layers", "n_heads", "seq_len",
                                                                         "batch")},
            "tokens_per_step": cfg["batch"] * cfg["seq_len"], "sr_key": cfg.get("sr_key", demo.SR_KEY_DEFAULT),
            "trained_steps": trained_steps,
            "recipes": {v: repr(r) for v, r in recipes.items()}}
    return desc, {v: functools.partial(make, v) for v in VARIANTS}


@functools.partial(jax.jit, static_argnums=(1,))
def _kernel_init(key, shape):
    """A bf16 GEMM kernel [K, N] of standard-normal / sqrt(K) entries (the float copy stays inside)."""
    return (jax.random.normal(key, shape, jnp.float32) / math.sqrt(shape[0])).astype(jnp.bfloat16)


def serve_params(cfg: dict, seed: int = 0) -> dict:
    """Random parameters of the demo LM of ``cfg`` in the tree ``model.init`` would give (its shapes
    from ``jax.eval_shape``): GEMM kernels bf16 (:func:`_kernel_init`, on the device), embeddings
    normal x 0.02, LayerNorm scales 1, biases 0 (float32, made on the host: no compile each)."""
    import train_lm as demo

    from jax_mxfp4 import Recipe

    model = demo.build_model(cfg, Recipe(**demo.BF16_RECIPE_FIELDS))
    shapes = jax.eval_shape(model.init, jax.random.key(seed), jnp.zeros((1, cfg["seq_len"]), jnp.int32))["params"]
    leaves, tree = jax.tree_util.tree_flatten_with_path(shapes)
    rng = np.random.default_rng(seed)
    out = []
    for i, (path, sds) in enumerate(leaves):
        kind = getattr(path[-1], "key", str(path[-1]))
        if kind == "kernel":
            out.append(_kernel_init(jax.random.fold_in(jax.random.key(seed), i), tuple(sds.shape)))
        elif kind == "embedding":
            out.append(jnp.asarray(0.02 * rng.standard_normal(sds.shape), sds.dtype))
        else:
            out.append(jnp.asarray(np.full(sds.shape, 1.0 if kind == "scale" else 0.0), sds.dtype))
    return jax.tree_util.tree_unflatten(tree, out)


def make_decode_loop(cfg: dict, positions: int):
    """A jitted ``decode(params, tok [B] int32) -> tokens [positions, B]``: examples/generate.py's
    ``decode_step`` at positions 0 .. positions-1 in one ``lax.scan``, each position's greedy argmax
    the next one's token, a KV cache of ``positions`` -- the decode loop of generate.py's
    ``make_generate`` without its prefill scan (the same step once more in the program: twice the
    compile, no new kind of work)."""
    import generate as gen

    h = cfg["n_heads"]
    dh = cfg["d_model"] // h

    @jax.jit
    def decode(params, tok):
        b = tok.shape[0]
        cache = [(jnp.zeros((b, positions, h, dh), jnp.bfloat16),) * 2 for _ in range(cfg["n_layers"])]

        def step(carry, pos):
            cache, tok = carry
            logits, cache = gen.decode_step(params, cfg, tok, pos, cache)
            tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            return (cache, tok), tok

        _, toks = jax.lax.scan(step, (cache, tok), jnp.arange(positions))
        return toks

    return decode


class ServeModel:
    """The serving model's parameters and served weights, made once for every serve-B workload."""

    def __init__(self, quick: bool):
        s = QUICK_SERVE if quick else SERVE
        self.positions = s["positions"]
        self.cfg = dict(d_model=s["d_model"], n_layers=s["n_layers"], n_heads=s["n_heads"], seq_len=s["positions"])
        self._params, self._weights = None, {}

    def weights(self, variant: str):
        import generate as gen

        if variant not in self._weights:
            if self._params is None:
                self._params = serve_params(self.cfg)
            self._weights[variant] = gen.serving_weights(self._params, variant)
            jax.block_until_ready(self._weights[variant])
        return self._weights[variant]

    def workload(self, batch: int):
        """(description, {variant: () -> (decode loop, [(weights, first tokens)], positions per call)})."""
        toks = jnp.asarray(np.random.default_rng(batch).integers(0, 256, (N_SETS, batch)), jnp.int32)
        decode = make_decode_loop(self.cfg, self.positions)

        def make(variant):
            return decode, [(self.weights(variant), t) for t in toks], self.positions

        desc = {"kind": "serve", "batch": batch, "model": dict(self.cfg), "steps_per_call": self.positions,
                "weights": {"bf16": "bf16 kernels", "mxfp4": "MXFP4 along K, prepare_decode (w4a16)"}}
        return desc, {v: functools.partial(make, v) for v in VARIANTS}


# ----------------------------------------------------------------------------- the run
def measure(make, timing: dict, label: str, t0: float) -> dict:
    """Time one step (fair timing) and profile the timed program: a result row (times per step)."""
    fn, sets, steps = make()
    r = time_fn(fn, sets, calls=1, profile_calls=1 if steps > 1 else PROFILE_TRAIN_STEPS, **timing)
    row = {"status": "ok", "step_s": r["median_s"] / steps, "steps_per_call": steps,
           **{k: r[k] for k in ("calls", "program_s", "reps", "min_s", "method")}}
    print(f"{_stamp(t0)} {label}: {row['step_s'] * 1e3:.4f} ms per step ({r['calls']} call(s) of {steps} step(s) "
          f"per program, {r['program_s'] * 1e3:.1f} ms)", flush=True)
    prof = r["profile"]
    if "error" in prof:
        row["profile_error"] = prof["error"]
        print(f"    {label} profile: {prof['error']}", flush=True)
    else:
        row["profile"] = kernel_summary(prof["kernels"], prof["timeline"], per=steps, top=15,
                                        label=f"{label} per step: ")
        row["profile"]["steps_profiled"] = prof["calls_profiled"] * steps
    return row


def run(args, report=lambda result: None) -> dict:
    timing = dict(reps=3, min_program_s=0.0) if args.quick else dict(reps=5)
    result = {"info": args.info, "quick": args.quick, "method": __doc__.split("Usage")[0].strip(),
              "categories": list(ROWS), "workloads": {}, "rows": []}
    t0 = time.time()
    serve = ServeModel(args.quick)
    for w in args.workloads:
        print(f"{_stamp(t0)} {w}: building", flush=True)
        try:
            desc, makers = (train_workload(w.split("-")[1], args.quick, args.trained_steps) if w.startswith("train")
                            else serve.workload(int(w.split("-")[1])))
        except Exception as e:  # record, keep going
            desc, makers = {"error": f"{type(e).__name__}: {str(e)[:300]}"}, {}
        result["workloads"][w] = desc
        for variant in VARIANTS:
            t_row = time.time()
            try:
                if variant not in makers:
                    raise RuntimeError(f"workload not built: {desc.get('error')}")
                row = measure(makers[variant], timing, f"{w} {variant}", t0)
            except Exception as e:  # record, keep going
                row = {"status": "error", "reason": f"{type(e).__name__}: {str(e)[:300]}"}
                print(f"{_stamp(t0)} {w} {variant}: {row['reason']}", flush=True)
            # wall_s: building, compiling, timing and profiling this row (where a run's minutes go)
            result["rows"].append({"workload": w, "variant": variant, **row, "wall_s": time.time() - t_row})
            report(result)
        makers = None  # this workload's parameters and optimizer state go before the next one's
    return result


def _command(info) -> str:
    """The reproducing command line, with the run's XLA_FLAGS (they change which GEMM kernels run)."""
    flags = info.get("xla_flags")
    return (f"XLA_FLAGS={shlex.quote(flags)} " if flags else "") + info["command"]


def _row(result, workload, variant):
    return next((r for r in result["rows"] if r["workload"] == workload and r["variant"] == variant), None)


def table_values(result) -> dict:
    """{(workload, variant): {table row: seconds per step or None}}: the categories and gaps (None
    without a GPU profile), "GPU span" and "step time (fair timing)"."""
    out = {}
    for r in result["rows"]:
        if r["status"] != "ok":
            continue
        p = r.get("profile")
        vals = {c: (p["categories"].get(c) if p else None) for c in ROWS}
        vals["GPU span"] = p["timeline"].get("span_s") if p else None
        vals["step time (fair timing)"] = r["step_s"]
        out[(r["workload"], r["variant"])] = vals
    return out


def markdown(result) -> str:
    info = result["info"]
    vals = table_values(result)
    workloads = list(result["workloads"])
    lines = [f"# Profile table: {info['device']} ({info['platform']}), jax {info['jax']}, {info['date_utc']} UTC", "",
             f"Command: `{_command(info)}`", "",
             "Device time per step (ms) by kernel category, bf16 and MXFP4, and MXFP4 / bf16. Categories + gaps "
             "= the GPU span per step where kernels do not overlap; the step time (fair timing) also holds the "
             "host's launch of the program. n/a: no device kernels in the profile (a CPU).", ""]
    head = "| ms per step | " + " | ".join(f"{w} bf16 | {w} mxfp4 | {w} mxfp4/bf16" for w in workloads) + " |"
    lines += [head, "|---|" + "---|" * (3 * len(workloads))]

    def ms(v):
        return "n/a" if v is None else f"{v * 1e3:.3f}"

    for name in (*ROWS, "GPU span", "step time (fair timing)"):
        cells = []
        for w in workloads:
            b, m = (vals.get((w, v), {}).get(name) for v in VARIANTS)
            bad = {v: (_row(result, w, v) or {}).get("status", "missing") for v in VARIANTS}
            cells += [ms(b) if bad["bf16"] == "ok" else bad["bf16"], ms(m) if bad["mxfp4"] == "ok" else bad["mxfp4"],
                      f"{m / b:.2f}x" if b and m is not None else "–"]
        label = f"**{name}**" if name.startswith("step time") else name
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "Workloads:", ""]
    for w, d in result["workloads"].items():
        if "error" in d:
            lines.append(f"- {w}: not built: {d['error']}")
        elif d["kind"] == "train":
            m = d["model"]
            lines.append(f"- {w}: one training step of examples/train_lm.py --size {d['size']} (d_model {m['d_model']}, "
                         f"{m['n_layers']} blocks, {m['n_heads']} heads, batch {m['batch']} x {m['seq_len']} tokens, "
                         f"stochastic-rounding key {d['sr_key']})")
        else:
            m = d["model"]
            lines.append(f"- {w}: one decode step of examples/generate.py's model at batch {d['batch']} (d_model "
                         f"{m['d_model']}, {m['n_layers']} blocks, {m['n_heads']} heads; {d['steps_per_call']} positions "
                         f"per call, KV cache {m['seq_len']}); mxfp4: {d['weights']['mxfp4']}")
    tops = [r for r in result["rows"] if r.get("profile")]
    if tops:
        lines += ["", f"Largest kernels, ms per step ({TOP_KERNELS} per row; all in the JSON's \"top\"):", ""]
        for r in tops:
            lines.append(f"- {r['workload']} {r['variant']}: " + "; ".join(
                f"`{n[:60]}` {v * 1e3:.3f} ({kernel_category(n)})" for n, v in list(r["profile"]["top"].items())[:TOP_KERNELS]))
    unmatched = sorted({n for r in result["rows"] for n in r.get("profile", {}).get("unmatched", [])})
    if unmatched:
        lines += ["", "Kernels in \"other\" (no name pattern matched): " + ", ".join(f"`{n[:80]}`" for n in unmatched[:20])]
    errors = [r for r in result["rows"] if r["status"] != "ok"]
    if errors:
        lines += ["", "Not measured:", ""] + [f"- {r['workload']} {r['variant']}: {r.get('reason', '')}" for r in errors]
    return "\n".join(lines) + "\n"


def figure(result, out):
    """One panel per workload, a stacked bar per variant: ms per step by category and gaps, a black
    tick at the step time (fair timing); without a GPU profile, the step time alone
    (profile_steps.png)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    vals = table_values(result)
    workloads = [w for w in result["workloads"] if any(k[0] == w for k in vals)]
    fig, axes = plt.subplots(1, max(1, len(workloads)), figsize=(2.2 * max(1, len(workloads)) + 2.5, 4.5),
                             squeeze=False)
    for ax, w in zip(axes[0], workloads):
        keys = [(w, v) for v in VARIANTS if (w, v) in vals]
        x = np.arange(len(keys))
        bottom = np.zeros(len(keys))
        for i, cat in enumerate(ROWS):
            ys = np.array([(vals[k][cat] or 0.0) * 1e3 for k in keys])
            ax.bar(x, ys, 0.6, bottom=bottom, label=cat, color=f"C{i}")
            bottom += ys
        step = np.array([vals[k]["step time (fair timing)"] * 1e3 for k in keys])
        if not bottom.any():  # no device profile: the measured step time alone
            ax.bar(x, step, 0.6, color="0.7", label="step time (no device profile)")
        ax.scatter(x, step, marker="_", s=600, color="k", zorder=3, label="step time (fair timing)")
        ax.set_xticks(x, [v for _, v in keys])
        ax.set_title(w, fontsize=9)
    axes[0][0].set_ylabel("ms per step")
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.suptitle(f"Where a step's device time goes, on {result['info']['device']}", fontsize=10)
    return save_figure(fig, out, "profile_steps.png")


def check_args(ap, args):
    """Parse --workloads, refusing unknown names and, with --quick, the GPU sizes (argparse error,
    exit 2, before any work)."""
    names = [w for w in args.workloads.split(",") if w] or list(QUICK_DEFAULT if args.quick else DEFAULT_WORKLOADS)
    bad = [w for w in names if w not in WORKLOADS]
    if bad:
        ap.error(f"--workloads: unknown name(s) {', '.join(map(repr, bad))}; choose from {', '.join(WORKLOADS)}")
    if args.quick:
        gpu = [w for w in names if w not in QUICK_WORKLOADS]
        if gpu:
            ap.error(f"--workloads: {', '.join(gpu)} not a --quick workload (GPU sizes); --quick runs "
                     f"{', '.join(QUICK_WORKLOADS)}")
    args.workloads = list(dict.fromkeys(names))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="tiny shapes (train-small, serve-1 unless --workloads), few iterations: checks the pipeline "
                         "on a CPU")
    ap.add_argument("--workloads", default="", help=f"comma list from {','.join(WORKLOADS)} (default "
                    f"{','.join(DEFAULT_WORKLOADS)}; --quick: {','.join(QUICK_DEFAULT)})")
    ap.add_argument("--trained-steps", type=int, default=0,
                    help="profile the training workloads after this many of the demo's steps of each recipe "
                         "(default 0: at the initial parameters)")
    ap.add_argument("--out", default=None,
                    help="output folder (default bench_out/profile_steps, bench_out/profile_steps-quick)")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(argv)
    if args.trained_steps < 0:
        ap.error(f"--trained-steps must be >= 0, got {args.trained_steps}")
    check_args(ap, args)
    out = out_dir(args.out or default_out("profile_steps-quick" if args.quick else "profile_steps"))
    from importlib.metadata import version

    args.info = {**device_info(), "jaxlib": version("jaxlib"), "xla_flags": os.environ.get("XLA_FLAGS", ""),
                 "command": shlex.join(["python", "benchmarks/profile_steps.py", *argv])}

    def report(result):  # after every workload: a run cut short keeps what it finished
        write_json(os.path.join(out, "profile_steps.json"), result)
        with open(os.path.join(out, "profile_steps.md"), "w") as f:
            f.write(markdown(result))

    result = run(args, report)
    return write_report(out, "profile_steps", result, markdown, figure)


if __name__ == "__main__":
    sys.exit(main())
