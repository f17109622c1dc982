"""Training-step benchmark: one linear layer and one MLP block, bf16 against MXFP4, one process.

Configs (T tokens):
  linear  Y = X·W,              X [T, K], W [K, N], T = K = N = 8192
  mlp     Y = gelu(X·W1)·W2,    d = 8192, hidden 4d, T = 8192

One step = forward + backward for a fixed random cotangent dY (``jax.vjp`` in one jitted
function): the gradients with respect to X and every weight, all quantization included. Variants:
  bf16           ``lax.dot_general`` on bfloat16 operands (float32 accumulation, bf16 out), JAX's VJP;
  mxfp4          :func:`jax_mxfp4.dense`, ``Recipe()``: fprop, dgrad and wgrad in MXFP4 (dY
                 stochastically rounded), each GEMM on the backend "auto" picks at precision
                 DEFAULT (on an H200: the FP8 path for these shapes);
  mxfp4-nearest  the same with ``grad_rounding="nearest"`` (every quantization on the fused kernel);
  mxfp4-highest  ``Recipe(precision="highest")``: the exact float32-accumulation backends.
Timing: benchmarks/common.time_fn (fair timing). Reports ms/step, time relative to bf16 and
tokens/s, and the backend "auto" chose for each of the linear layer's GEMMs.

Usage: python benchmarks/train_step.py [--quick] [--configs linear,mlp] [--variants bf16,mxfp4,...] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

import jax_mxfp4 as mx  # noqa: E402
from benchmarks.common import device_info, out_dir, time_fn, write_json  # noqa: E402

FULL = {"linear": dict(t=8192, k=8192, n=8192), "mlp": dict(t=8192, d=8192)}
QUICK = {"linear": dict(t=64, k=64, n=96), "mlp": dict(t=64, d=64)}
VARIANTS = {
    "bf16": None,
    "mxfp4": mx.Recipe(),
    "mxfp4-nearest": mx.Recipe(grad_rounding="nearest"),
    "mxfp4-highest": mx.Recipe(precision="highest"),
}


def _bf16_dense(x, w):
    return lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())), preferred_element_type=jnp.bfloat16)


def layer_fns(config, recipe):
    dense = _bf16_dense if recipe is None else (lambda x, w: mx.dense(x, w, recipe=recipe))
    if config == "linear":
        return lambda x, w: dense(x, w)
    return lambda x, w1, w2: dense(jax.nn.gelu(dense(x, w1)), w2)


def shapes(config, s):
    if config == "linear":
        return (s["t"], s["k"]), [(s["k"], s["n"])], (s["t"], s["n"])
    return (s["t"], s["d"]), [(s["d"], 4 * s["d"]), (4 * s["d"], s["d"])], (s["t"], s["d"])


def make_step(f):
    def step(x, *rest):
        *ws, dy = rest
        y, pull = jax.vjp(f, x, *ws)
        return pull(dy)

    return step


def make_set(config, s, seed):
    xs, wss, ys = shapes(config, s)
    keys = jax.random.split(jax.random.key(seed), 2 + len(wss))
    x = jax.random.normal(keys[0], xs, jnp.bfloat16)
    ws = [(jax.random.normal(kk, sh, jnp.float32) / sh[0] ** 0.5).astype(jnp.bfloat16) for kk, sh in zip(keys[2:], wss)]
    dy = jax.random.normal(keys[1], ys, jnp.bfloat16)
    return (x, *ws, dy)


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


def run(args):
    sizes = QUICK if args.quick else FULL
    timing = dict(reps=3, min_program_s=0.0) if args.quick else dict(reps=5)
    rows = []
    t0 = time.time()
    for config, s in sizes.items():
        if args.configs and config not in args.configs:
            continue
        sets = [make_set(config, s, seed=1)]
        jax.block_until_ready(sets)
        base = None
        for variant, recipe in VARIANTS.items():
            if args.variants and variant not in args.variants and variant != "bf16":
                continue
            try:
                r = time_fn(make_step(layer_fns(config, recipe)), sets, **timing)
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
                  f"ratio {r.get('time_ratio_vs_bf16', float('nan')):.3f} {r['status']}", flush=True)
        del sets
    return {"info": device_info(), "quick": args.quick, "method": __doc__.split("Usage")[0].strip(),
            "routing_linear": routing(sizes["linear"]), "rows": rows}


def markdown(result):
    info = result["info"]
    lines = [f"# Training step: {info['device']} ({info['platform']}), jax {info['jax']}, {info['date_utc']} UTC", "",
             "Forward + backward (dX and every dW), all quantization included; time relative to the bf16 "
             "step in the same run (< 1 is faster).", "",
             "| config | shape | variant | ms / step | vs bf16 | tokens/s |", "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        shape = f"T={r['t']} K={r['k']} N={r['n']}" if r["config"] == "linear" else f"T={r['t']} d={r['d']} hidden={4 * r['d']}"
        if r["status"] != "ok":
            lines.append(f"| {r['config']} | {shape} | {r['variant']} | {r['status']}: {r.get('reason', '')[:80]} | | |")
            continue
        lines.append(f"| {r['config']} | {shape} | {r['variant']} | {r['median_s'] * 1e3:.3f} | "
                     f"{r.get('time_ratio_vs_bf16', float('nan')):.3f}x | {r['tokens_per_s']:.4g} |")
    lines += ["", "Backends \"auto\" picks for the linear layer (Recipe(), precision DEFAULT):", ""]
    for name, d in result["routing_linear"].items():
        lines.append(f"- {name} {d['mnk'][0]}x{d['mnk'][1]}x{d['mnk'][2]}: {d['backend']} ({d['contract']})")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU CI): checks the pipeline and files")
    ap.add_argument("--out", default=None, help="output folder (default benchmarks/results/train_step[-quick])")
    ap.add_argument("--configs", default="", help="comma list of configs (default: linear,mlp)")
    ap.add_argument("--variants", default="", help="comma list of variants besides bf16 (default: all)")
    args = ap.parse_args(argv)
    args.configs = [c for c in args.configs.split(",") if c]
    args.variants = [v for v in args.variants.split(",") if v]
    here = os.path.dirname(os.path.abspath(__file__))
    out = out_dir(args.out or os.path.join(here, "results", "train_step-quick" if args.quick else "train_step"))
    result = run(args)
    write_json(os.path.join(out, "train_step.json"), result)
    md = markdown(result)
    with open(os.path.join(out, "train_step.md"), "w") as f:
        f.write(md)
    print(md)
    return 0 if all(r["status"] == "ok" for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
