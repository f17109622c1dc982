"""Training-step benchmark: one linear layer and one MLP block, bf16 against MXFP4, one process.

Configs (T tokens):
  linear  Y = X·W,              X [T, K], W [K, N], T = K = N = 8192
  mlp     Y = gelu(X·W1)·W2,    d = 8192, hidden 4d, T = 8192
  mlp-d1024  the same with d = 1024 (the MLP block of ``examples/train_lm.py --size large``)
  mlp-block  a Flax linen MLP block (two ``nn.Dense``), d = 4096, hidden 16384, T = 8192, with
             Qwix's own QAT as peer rows (benchmarks/mlp_block.py: its step and variants
             bf16, mxfp4-qwix, qwix-fp8, qwix-mxfp4); run only when --configs names it

One step = forward + backward for a fixed random cotangent dY (``jax.vjp`` in one jitted
function): the output Y and the gradients with respect to X and every weight, all quantization
included. Y is returned so that XLA keeps the forward GEMM (dX and dW need only the residuals).
Variants:
  bf16           ``lax.dot_general`` on bfloat16 operands (float32 accumulation, bf16 out), JAX's VJP;
  mxfp4          :func:`jax_mxfp4.dense`, ``Recipe()``: fprop, dgrad and wgrad in MXFP4 (dY
                 stochastically rounded), each GEMM on the backend "auto" picks at precision
                 DEFAULT (on an H200: the FP8 path for these shapes);
  mxfp4-nearest  the same with ``grad_rounding="nearest"`` (every quantization round to nearest);
  mxfp4-highest  ``Recipe(precision="highest")``: the exact float32-accumulation backends;
  mxfp4-rbg-key  ``Recipe()`` with an explicit "rbg" rounding key (see KEY_IMPL): the stochastic
                 rounding's uniforms drawn by XLA's RngBitGenerator (the others use the
                 data-derived threefry key).
The MXFP4 steps run the library's kernels; with ``JAX_MXFP4_KERNELS=0`` the portable paths (the
JSON records which under "kernels_enabled"). ``--check-fused`` first compares the linear layer's
step outputs with and without the custom kernels (the fused training passes among them), bit for
bit.
Timing: benchmarks/common.time_fn (fair timing). Reports ms/step, time relative to bf16 and
tokens/s, and the backend "auto" chose for each of the linear layer's GEMMs. Output:
train_step.json, train_step.md (the table, also printed) and train_step.png in --out (default
bench_out/train_step, bench_out/train_step-quick with --quick).

Usage: python benchmarks/train_step.py [--quick] [--profile] [--configs linear,mlp,mlp-d1024,mlp-block]
       [--variants mxfp4,...] [--out DIR]
(--quick: tiny shapes, the linear config unless --configs says otherwise, few iterations: checks
the pipeline on a CPU in seconds.)
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

import jax_mxfp4 as mx  # noqa: E402
from benchmarks import mlp_block  # noqa: E402
from benchmarks.common import (  # noqa: E402
    default_out, device_info, kernel_summary, kernel_time, out_dir, save_figure, time_fn, write_report)
from jax_mxfp4 import training  # noqa: E402
from jax_mxfp4.platform import KERNELS_ENV, kernels_enabled  # noqa: E402

FULL = {"linear": dict(t=8192, k=8192, n=8192), "mlp": dict(t=8192, d=8192),
        "mlp-d1024": dict(t=8192, d=1024),  # the demo's large size: one MLP block of its step
        "mlp-block": dict(t=8192, d=4096, hidden=16384)}
QUICK = {"linear": dict(t=64, k=64, n=96), "mlp": dict(t=64, d=64), "mlp-block": dict(t=64, d=64, hidden=256)}
DEFAULT_CONFIGS = ["linear", "mlp", "mlp-d1024"]  # what a run without --configs runs
QUICK_CONFIGS = ["linear"]  # what --quick runs unless --configs names others
BLOCK_CONFIGS = ("mlp-block",)
"""Configs of benchmarks/mlp_block.py (a Flax model through Qwix, its own variants; needs flax and qwix)."""
BLOCK_PACKAGES = ("flax", "qwix")  # what the block configs import
BLOCK_SETS = 4
"""Operand sets (params, x, dY) of a block config, each with its own params: one program runs a
step on each (~4 x 10 ms on an H200, past time_fn's 20 ms without growing), so no two steps share
a weight and XLA cannot share the weights' casts and quantizations between them. --quick: 2
(each set is one more step to compile on a CPU)."""
VARIANTS = {
    "bf16": None,
    "mxfp4": mx.Recipe(),
    "mxfp4-nearest": mx.Recipe(grad_rounding="nearest"),
    "mxfp4-highest": mx.Recipe(precision="highest"),
    "mxfp4-rbg-key": mx.Recipe(),  # an explicit "rbg" key: SR uniforms from XLA's RngBitGenerator
}
KEY_IMPL = {"mxfp4-rbg-key": "rbg"}
"""Variants given an explicit rounding key of this PRNG implementation (the others use the
data-derived key, threefry: bit-identical SR then costs ~80 integer operations per element)."""


class _attr:
    """Set one module attribute while the step is traced (a test-only setting of the library)."""

    def __init__(self, obj, name, value):
        self.obj, self.name, self.value = obj, name, value

    def __enter__(self):
        self.old = getattr(self.obj, self.name)
        setattr(self.obj, self.name, self.value)

    def __exit__(self, *exc):
        setattr(self.obj, self.name, self.old)


class _env:
    """Set (or leave) one environment variable while the step is traced and timed."""

    def __init__(self, name, value):
        self.name, self.value = name, value

    def __enter__(self):
        self.old = os.environ.get(self.name)
        if self.value is not None:
            os.environ[self.name] = self.value

    def __exit__(self, *exc):
        if self.old is None:
            os.environ.pop(self.name, None)
        else:
            os.environ[self.name] = self.old


def _bf16_dense(x, w):
    return lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())), preferred_element_type=jnp.bfloat16)


def layer_fns(config, recipe, key_impl=None):
    key = None if key_impl is None else jax.random.key(0, impl=key_impl)
    dense = _bf16_dense if recipe is None else (lambda x, w: mx.dense(x, w, recipe=recipe, key=key))
    if config == "linear":
        return lambda x, w: dense(x, w)
    return lambda x, w1, w2: dense(jax.nn.gelu(dense(x, w1)), w2)


def shapes(config, s):
    if config == "linear":
        return (s["t"], s["k"]), [(s["k"], s["n"])], (s["t"], s["n"])
    return (s["t"], s["d"]), [(s["d"], 4 * s["d"]), (4 * s["d"], s["d"])], (s["t"], s["d"])


def make_step(f):
    """Forward and backward: returns (Y, dX, dW...). Y is returned so that the forward GEMM is
    part of the timed program (unused, XLA would drop it: dX and dW need only the residuals)."""
    def step(x, *rest):
        *ws, dy = rest
        y, pull = jax.vjp(f, x, *ws)
        return (y, *pull(dy))

    return step


def make_set(config, s, seed):
    xs, wss, ys = shapes(config, s)
    keys = jax.random.split(jax.random.key(seed), 2 + len(wss))
    x = jax.random.normal(keys[0], xs, jnp.bfloat16)
    ws = [(jax.random.normal(kk, sh, jnp.float32) / sh[0] ** 0.5).astype(jnp.bfloat16) for kk, sh in zip(keys[2:], wss)]
    dy = jax.random.normal(keys[1], ys, jnp.bfloat16)
    return (x, *ws, dy)


def config_variants(config):
    """The variant names timed for ``config`` (bf16 first: the baseline of the ratios)."""
    return mlp_block.VARIANTS if config in BLOCK_CONFIGS else tuple(VARIANTS)


def operand_set(config, s, seed):
    """One operand set of the step of ``config`` at sizes ``s``."""
    return mlp_block.make_set(s, seed) if config in BLOCK_CONFIGS else make_set(config, s, seed)


def step_fn(config, s, variant):
    """The timed step of ``config`` and ``variant``: (Y, dX, dW...) of the layer configs, or
    (loss, (dparams, dX)) of the Flax block (benchmarks/mlp_block.py)."""
    if config in BLOCK_CONFIGS:
        return mlp_block.make_step(variant, s["hidden"])
    return make_step(layer_fns(config, VARIANTS[variant], KEY_IMPL.get(variant)))


def routing(s):
    """Backend "auto" picks for the linear layer's fprop, dgrad and wgrad (canonical shapes)."""
    t, k, n = s["t"], s["k"], s["n"]
    sds = lambda *sh: jax.ShapeDtypeStruct(sh, jnp.bfloat16)  # noqa: E731
    tn = (((1,), (1,)), ((), ()))
    out = {}
    for name, (m_, n_, k_) in {"fprop": (t, n, k), "dgrad": (t, k, n), "wgrad": (n, k, t)}.items():
        d = mx.explain(sds(m_, k_), sds(n_, k_), tn)
        out[name] = {"backend": d.backend, "contract": d.contract, "mnk": [m_, n_, k_]}
    return out


CHECK_KEYS = (None, "rbg")
"""Rounding keys of ``--check-fused``: the data-derived threefry key (uniforms generated in the
fused kernel) and an explicit rbg key (the reference's uniforms drawn by XLA, read by the kernel)."""


def check_fused(config, s, sets, report=lambda c: None):
    """The training step with the custom kernels (the default: the fused quantize-to-FP8 kernel
    for dY's two stochastic quantizations) and without them (``JAX_MXFP4_KERNELS=0``: the
    unfused passes) on the device: step outputs (Y, dX, dW) compared bit for bit (expected
    identical: same quantized operands, same GEMMs), for both rounding keys of :data:`CHECK_KEYS`.
    Off CUDA the fused kernels run in the Pallas interpreter (``training._FUSED_INTERPRET``) on
    backend "fp8" ("auto" would route the GEMMs to "xla", where no fused kernel runs and the
    comparison would hold trivially). ``fused_kernels``: pallas_calls in the fused step;
    ``fp8_quantize_kernels``: the fused quantize-to-FP8 kernels among them. ``report`` is called
    with each result as it comes (a run cut by a timeout keeps its lines)."""
    import re

    from jax_mxfp4.dispatch import current_platform

    interpret = current_platform() != "cuda"
    recipe = mx.Recipe(backend="fp8") if interpret else mx.Recipe()
    out = []
    for key_impl in CHECK_KEYS:
        key_name = key_impl or "data-derived (threefry)"
        try:
            with _env(KERNELS_ENV, "0"):
                want = jax.jit(make_step(layer_fns(config, recipe, key_impl)))(*sets[0])
            jax.clear_caches()  # the switch is read at tracing: retrace the inner jitted GEMMs
        except Exception as e:  # record, keep going
            out.append({"config": config, "key": key_name, "error": f"unfused step: {type(e).__name__}: {str(e)[:300]}"})
            report(out[-1])
            continue
        try:
            with _attr(training, "_FUSED_INTERPRET", interpret):
                step = make_step(layer_fns(config, recipe, key_impl))
                jaxpr = str(jax.make_jaxpr(step)(*sets[0]))
                got = jax.jit(step)(*sets[0])
            same = [bool(jnp.array_equal(a, b)) for a, b in zip(got, want)]
            diff = [float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))) for a, b in zip(got, want)]
            out.append({"config": config, "key": key_name, "bit_identical": same, "max_abs_diff": diff,
                        "interpret": interpret, "fused_kernels": jaxpr.count("pallas_call"),
                        "fp8_quantize_kernels": len(re.findall(r"name=mxfp4_quantize_fp8", jaxpr))})
        except Exception as e:  # record, keep going
            out.append({"config": config, "key": key_name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
        report(out[-1])
        del want
    return out


def profile_step(config, s, variant, sets, top=25, hlo_dir=None):
    """Per-kernel device time of one step (``benchmarks.common.kernel_time``: profiler kernel
    durations per call, 4 distinct calls in one program): where the step's time goes, by kernel
    and by category (``benchmarks.common.kernel_summary``). With
    ``hlo_dir``: also the optimized HLO of one step, ``hlo_<config>_<variant>.txt``."""
    step = step_fn(config, s, variant)
    if hlo_dir:
        with open(os.path.join(hlo_dir, f"hlo_{config}_{variant}.txt"), "w") as f:
            f.write(jax.jit(step).lower(*sets[0]).compile().as_text())
    kt = kernel_time(step, sets, calls=4)
    if "error" in kt:
        print(f"    profile: {kt['error']}", flush=True)
        return kt
    return kernel_summary(kt["kernels"], kt["timeline"], top=top, label=f"profile {variant} per step: ")


def run(args):
    sizes = QUICK if args.quick else FULL
    timing = dict(reps=3, min_program_s=0.0) if args.quick else dict(reps=5)
    rows, checks = [], []
    t0 = time.time()
    for config, s in sizes.items():
        if args.configs and config not in args.configs:
            continue
        n_sets = (2 if args.quick else BLOCK_SETS) if config in BLOCK_CONFIGS else 1
        sets = [operand_set(config, s, seed=1 + i) for i in range(n_sets)]
        jax.block_until_ready(sets)
        if args.check_fused and config == "linear":
            def report(c):
                print(f"[{time.time() - t0:6.1f}s] fused vs unfused step outputs (Y, dX, dW): {c}", flush=True)

            try:
                checks += check_fused(config, s, sets, report)
            except Exception as e:  # record, keep going
                checks.append({"config": config, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                report(checks[-1])
        base = None
        for variant in config_variants(config):
            if args.variants and variant not in args.variants and variant != "bf16":
                continue
            try:
                r = time_fn(step_fn(config, s, variant), sets, **timing)
                r["status"] = "ok"
            except Exception as e:  # record, keep going
                r = {"status": "error", "reason": f"{type(e).__name__}: {str(e)[:300]}"}
            if variant == "bf16":
                base = r.get("median_s")
            if r["status"] == "ok":
                r["tokens_per_s"] = s["t"] / r["median_s"]
                if base:
                    r["time_ratio_vs_bf16"] = r["median_s"] / base
            rows.append({"config": config, **s, "variant": variant, **r})
            print(f"[{time.time() - t0:6.1f}s] {config:6s} {variant:14s} {r.get('median_s', float('nan')) * 1e3:9.3f} ms "
                  f"ratio {r.get('time_ratio_vs_bf16', float('nan')):.3f} {r['status']} {r.get('reason', '')}",
                  flush=True)
            if r["status"] == "ok" and (args.profile == "all" or variant in args.profile.split(",")):
                rows[-1]["profile"] = profile_step(config, s, variant, sets, hlo_dir=args.hlo)
        del sets
    return {"info": device_info(), "quick": args.quick, "method": __doc__.split("Usage")[0].strip(),
            "kernels_enabled": kernels_enabled(),
            # the routing of the plain layers' GEMMs; a run of block configs only (Qwix routes) has none
            "routing_linear": (routing(sizes["linear"]) if any(c not in BLOCK_CONFIGS for c in args.configs)
                               else {}),
            "rows": rows, "fused_checks": checks}


def markdown(result):
    info = result["info"]
    lines = [f"# Training step: {info['device']} ({info['platform']}), jax {info['jax']}, {info['date_utc']} UTC", "",
             "Forward (Y) + backward (dX and every dW), all quantization included; time relative to the bf16 "
             "step in the same run (< 1 is faster)."
             + (" mlp-block: a Flax linen block quantized by Qwix, value and gradients (params, X) of "
                "loss = sum(Y·dY), the same GEMMs." if any(r["config"] in BLOCK_CONFIGS for r in result["rows"])
                else ""),
             "",
             "| config | shape | variant | ms / step | vs bf16 | tokens/s |", "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        shape = (f"T={r['t']} K={r['k']} N={r['n']}" if r["config"] == "linear"
                 else f"T={r['t']} d={r['d']} hidden={r.get('hidden', 4 * r['d'])}")
        if r["status"] != "ok":
            lines.append(f"| {r['config']} | {shape} | {r['variant']} | {r['status']}: {r.get('reason', '')[:80]} | | |")
            continue
        lines.append(f"| {r['config']} | {shape} | {r['variant']} | {r['median_s'] * 1e3:.3f} | "
                     f"{r.get('time_ratio_vs_bf16', float('nan')):.3f}x | {r['tokens_per_s']:.4g} |")
    if result["routing_linear"]:
        lines += ["", "Backends \"auto\" picks for the linear layer (Recipe(), precision DEFAULT):", ""]
    for name, d in result["routing_linear"].items():
        lines.append(f"- {name} {d['mnk'][0]}x{d['mnk'][1]}x{d['mnk'][2]}: {d['backend']} ({d['contract']})")
    for c in result.get("fused_checks", []):
        lines.append(f"- fused vs unfused passes, {c['config']} (Y, dX, dW): {c.get('bit_identical', c.get('error'))}"
                     + ("" if "error" in c else f", max |diff| {c['max_abs_diff']} ({c['fused_kernels']} fused "
                        f"kernels, {c['fp8_quantize_kernels']} of them quantize-to-FP8"
                        f"{' (Pallas interpreter)' if c['interpret'] else ''}, against ${KERNELS_ENV}=0, key {c['key']})"))
    return "\n".join(lines) + "\n"


def check_args(ap, args):
    """Refuse names that would otherwise be skipped silently (argparse error, exit code 2): an
    unknown config, a variant that none of the configs run has, a profiled variant that is not
    run, --hlo without --profile; and a block config without flax and qwix installed. Makes the
    --hlo folder."""
    configs = args.configs or (QUICK_CONFIGS if args.quick else DEFAULT_CONFIGS)
    known_variants = list(dict.fromkeys(v for c in configs for v in config_variants(c)))
    for flag, names, known in (("--configs", args.configs, QUICK if args.quick else FULL),
                               ("--variants", args.variants, known_variants),
                               ("--profile", [] if args.profile in ("", "all") else args.profile.split(","),
                                known_variants)):
        bad = [n for n in names if n not in known]
        if bad:
            which = "" if flag == "--configs" else f" for configs {','.join(configs)}"
            ap.error(f"{flag}: unknown name(s) {', '.join(map(repr, bad))}{which}; choose from {', '.join(known)}")
    missing = [m for m in BLOCK_PACKAGES if importlib.util.find_spec(m) is None]
    if missing and any(c in BLOCK_CONFIGS for c in args.configs):
        ap.error(f"--configs {','.join(c for c in args.configs if c in BLOCK_CONFIGS)} builds a Flax model "
                 f"quantized by Qwix: {' and '.join(missing)} not installed (pip install 'jax-mxfp4[qwix]')")
    if args.profile not in ("", "all") and args.variants:
        idle = [v for v in args.profile.split(",") if v and v != "bf16" and v not in args.variants]
        if idle:
            ap.error(f"--profile: {', '.join(map(repr, idle))} not among the --variants run ({','.join(args.variants)})")
    if args.hlo is not None:
        if not args.profile:
            ap.error("--hlo DIR writes the HLO of each profiled step: give --profile too")
        os.makedirs(args.hlo, exist_ok=True)


def figure(result, out):
    """Time per step relative to bf16, per config and variant (train_step.png)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["status"] == "ok" and r["variant"] != "bf16" and "time_ratio_vs_bf16" in r]
    configs = list(dict.fromkeys(r["config"] for r in rows))
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(len(variants), 1)
    for i, v in enumerate(variants):
        ys = [next((r["time_ratio_vs_bf16"] for r in rows if r["config"] == c and r["variant"] == v), float("nan"))
              for c in configs]
        ax.bar([j + i * width for j in range(len(configs))], ys, width, label=v)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([j + width * (len(variants) - 1) / 2 for j in range(len(configs))])
    ax.set_xticklabels(configs)
    ax.set_ylabel("time per step / bf16 (<1 faster)")
    ax.set_title(f"Training step on {result['info']['device']}")
    if variants:  # a run whose MXFP4 variants all failed has no bar to label
        ax.legend(fontsize=7)
    return save_figure(fig, out, "train_step.png")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="tiny shapes, few iterations, config linear (unless --configs): checks the pipeline "
                         "and files on a CPU")
    ap.add_argument("--out", default=None, help="output folder (default bench_out/train_step, bench_out/train_step-quick)")
    ap.add_argument("--configs", default="", help="comma list of configs (default: linear,mlp,mlp-d1024; "
                    "mlp-block only when named; --quick: linear; linear,mlp,mlp-block allowed)")
    ap.add_argument("--variants", default="", help=f"comma list of variants besides bf16 (default: all of each "
                    f"config: {','.join(v for v in VARIANTS if v != 'bf16')}; mlp-block: "
                    f"{','.join(v for v in mlp_block.VARIANTS if v != 'bf16')})")
    ap.add_argument("--profile", nargs="?", const="all", default="", metavar="VARIANTS",
                    help="after the timing of each variant (or of the comma-listed ones), its per-kernel "
                         "device times from the profiler")
    ap.add_argument("--hlo", default=None, metavar="DIR",
                    help="with --profile: also write each profiled step's optimized HLO into DIR")
    ap.add_argument("--check-fused", action="store_true",
                    help="first compare the linear layer's step outputs with and without the custom kernels")
    args = ap.parse_args(argv)
    args.configs = [c for c in args.configs.split(",") if c]
    args.variants = [v for v in args.variants.split(",") if v]
    check_args(ap, args)
    if not args.configs:
        args.configs = list(QUICK_CONFIGS if args.quick else DEFAULT_CONFIGS)
    out = out_dir(args.out or default_out("train_step-quick" if args.quick else "train_step"))
    result = run(args)
    return write_report(out, "train_step", result, markdown, figure)


if __name__ == "__main__":
    sys.exit(main())
