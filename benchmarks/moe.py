"""Mixture-of-experts benchmark: a gpt-oss-20b-like expert layer, MXFP4 experts against bf16.

The layer (T tokens, E experts, top-k routing, d_model D, expert width F; gpt-oss-20b: E = 32,
k = 4, D = F = 2880):

  route    fixed random router logits [T, E] (seeded), top-k experts per token, gates = softmax
           of the k logits; the T*k (token, expert) pairs sorted by expert (stable) give the row
           order and ``group_sizes`` [E] (M = T*k rows; at decode sizes most groups are empty)
  gate+up  H = ragged_dot(X[rows] [M, D], W1 [E, D, 2F])   (one grouped GEMM, N = 2F)
  SwiGLU   A = silu(H[:, :F]) * H[:, F:]                     [M, F]  (gpt-oss clamps and
           interleaves gate and up: the same elementwise work, left out here)
  down     Y = ragged_dot(A, W2 [E, F, D])                   [M, D]
  combine  out[t] = sum of gate * Y over token t's k rows    [T, D]

The routing is computed once outside the timing; the timed function takes X, the experts, the
row order, the gates and ``group_sizes`` as operands (so the group sizes are runtime values, as
in serving) and runs gather, both grouped GEMMs, SwiGLU and combine. bf16 out everywhere.
Serving variants (forward only):
  bf16         ``jax.lax.ragged_dot`` on bf16 X and bf16 experts (the baseline);
  mxfp4-w4a16  :func:`jax_mxfp4.ragged_dot` with the experts as MXFP4Arrays quantized along K
               once, beforehand, and bf16 activations (``Recipe(quantize_activations=False)``:
               the serving form at decode sizes);
  mxfp4-a4w4   the same experts, activations quantized to MXFP4 in every call (``Recipe()``).
``--train``: one training step at the largest token count, ``jax.value_and_grad`` of
sum(out * dY) (dY a fixed random cotangent) with respect to X, W1 and W2 (float bf16 experts):
  train-bf16   ``lax.ragged_dot`` and JAX's VJP;
  train-mxfp4  :func:`jax_mxfp4.ragged_dot`, ``Recipe()``: MXFP4 fprop, dgrad and wgrad
               (dY stochastically rounded), all quantization inside the step.
Each MXFP4 row records the route :func:`jax_mxfp4.ragged.explain_ragged_dot` gives for both
grouped GEMMs' forward (also printed) and its relative error against the bf16 layer on the same data
(Frobenius norm of the difference over that of the bf16 output; FP4 rounding, not a bug, at
~0.1 for a4w4). Weight memory: bytes of the bf16 experts against the MXFP4 data + E8M0 scales
(ratio (1/2 + 1/32) / 2 = 0.2656).

Timing: benchmarks/common.time_fn (fair timing): operand sets rotate so that the bytes every
call must read (the experts its tokens select, and its activations) exceed 3x the L2 together
(each set its own copy of the experts); ratios are against bf16 at the same token count in the
same run. ``--profile``: each row's GPU time per call (the profiler's kernel span, free of the
host's per-call dispatch, see common.py) beside it. Output: moe.json, moe.md (the table, also
printed) and moe.png (time ratio vs tokens) in --out (default bench_out/moe, bench_out/moe-quick
with --quick).

Usage: python benchmarks/moe.py [--quick] [--tokens 1,16,64,256,4096] [--variants mxfp4-w4a16,...] [--train] [--profile] [--out DIR]
(--quick: 8 experts of 64x64, top-4, tokens 1 and 16, few iterations: checks the pipeline on a
CPU in seconds.)
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

import jax_mxfp4 as mx  # noqa: E402
from benchmarks.common import (  # noqa: E402
    default_out, device_info, kernel_time, n_sets_for, out_dir, save_figure, time_fn, write_json, write_report)
from jax_mxfp4.ragged import explain_ragged_dot  # noqa: E402

FULL = dict(experts=32, top_k=4, d_model=2880, width=2880, tokens=[1, 16, 64, 256, 4096])  # gpt-oss-20b
QUICK = dict(experts=8, top_k=4, d_model=64, width=64, tokens=[1, 16])
QUICK_SETS = 2  # operand sets per program with --quick (fewer unrolled calls to compile)
FULL_SETS = 8  # at most this many copies of the experts (MXFP4 at 1 token: 8 x 0.45 GB)

SERVING = {"bf16": None, "mxfp4-w4a16": mx.Recipe(quantize_activations=False), "mxfp4-a4w4": mx.Recipe()}
TRAIN = {"train-bf16": None, "train-mxfp4": mx.Recipe()}
BASELINE = {"bf16": "bf16", "mxfp4-w4a16": "bf16", "mxfp4-a4w4": "bf16", "train-bf16": "train-bf16",
            "train-mxfp4": "train-bf16"}


# ----------------------------------------------------------------------------- routing and the layer
def route(tokens: int, experts: int, top_k: int, seed: int = 0):
    """Fixed random top-k routing: (rows, gates, group_sizes) as NumPy arrays.

    rows int32 [T*k]: the token of each row, rows sorted by expert (stable: tokens in order within
    a group); gates float32 [T*k]: that row's routing weight (softmax over the token's k logits);
    group_sizes int32 [E]: rows per expert (sum T*k)."""
    logits = np.random.default_rng(seed).standard_normal((tokens, experts)).astype(np.float32)
    chosen = np.argsort(-logits, axis=1, kind="stable")[:, :top_k]  # [T, k]
    top = np.take_along_axis(logits, chosen, axis=1)
    gates = np.exp(top - top.max(axis=1, keepdims=True))
    gates /= gates.sum(axis=1, keepdims=True)
    ids = chosen.reshape(-1)
    order = np.argsort(ids, kind="stable")
    rows = (order // top_k).astype(np.int32)
    return rows, gates.reshape(-1)[order].astype(np.float32), np.bincount(ids, minlength=experts).astype(np.int32)


def expert_layer(matmul, width: int):
    """The expert layer of the module docstring with grouped GEMM ``matmul(a, w, group_sizes)``:
    ``f(x [T, D], w1 [E, D, 2F], w2 [E, F, D], rows, gates, group_sizes) -> [T, D]`` in x's dtype."""
    def f(x, w1, w2, rows, gates, group_sizes):
        h = matmul(x[rows], w1, group_sizes)
        a = jax.nn.silu(h[:, :width]) * h[:, width:]
        y = matmul(a, w2, group_sizes).astype(jnp.float32) * gates[:, None]
        return jax.ops.segment_sum(y, rows, num_segments=x.shape[0]).astype(x.dtype)

    return f


def grouped_gemm(recipe):
    """``(a, w, group_sizes) -> a·w`` per group, output in a's dtype: ``lax.ragged_dot`` for
    recipe None, else :func:`jax_mxfp4.ragged_dot` with ``recipe``."""
    if recipe is None:
        return lambda a, w, gs: lax.ragged_dot(a, w, gs, preferred_element_type=a.dtype)
    return lambda a, w, gs: mx.ragged_dot(a, w, gs, preferred_element_type=a.dtype, recipe=recipe)


def train_step(recipe, width: int):
    """value_and_grad of sum(layer(x, w1, w2) * dy) with respect to (x, w1, w2)."""
    layer = expert_layer(grouped_gemm(recipe), width)

    def loss(x, w1, w2, rows, gates, gs, dy):
        return jnp.sum(layer(x, w1, w2, rows, gates, gs).astype(jnp.float32) * dy.astype(jnp.float32))

    return jax.value_and_grad(loss, argnums=(0, 1, 2))


# ----------------------------------------------------------------------------- operands
def expert_shapes(cfg):
    e, d, f = cfg["experts"], cfg["d_model"], cfg["width"]
    return (e, d, 2 * f), (e, f, d)


def weight_memory(cfg) -> dict:
    """Bytes of the bf16 experts and of the MXFP4 experts (data + scales, as ``quantize`` along K
    lays them out; shapes only, nothing computed)."""
    out = {"bf16_bytes": 0, "mxfp4_data_bytes": 0, "mxfp4_scale_bytes": 0}
    for shape in expert_shapes(cfg):
        w = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
        q = jax.eval_shape(lambda v: mx.quantize(v, 1), w)
        out["bf16_bytes"] += int(np.prod(shape)) * 2
        out["mxfp4_data_bytes"] += int(np.prod(q.data.shape)) * q.data.dtype.itemsize
        out["mxfp4_scale_bytes"] += int(np.prod(q.scales.shape)) * q.scales.dtype.itemsize
    out["mxfp4_bytes"] = out["mxfp4_data_bytes"] + out["mxfp4_scale_bytes"]
    out["ratio"] = out["mxfp4_bytes"] / out["bf16_bytes"]
    return out


def bytes_per_call(cfg, tokens, used_experts, variant):
    """Bytes one call must read at least: the experts its tokens select, and its activations."""
    e_params = sum(int(np.prod(s[1:])) for s in expert_shapes(cfg))
    per_param = 2 if variant in ("bf16", "train-bf16", "train-mxfp4") else 17 / 32
    return int(used_experts * e_params * per_param + 4 * tokens * cfg["d_model"])


def make_sets(cfg, tokens, variant, routing, n_sets):
    """``n_sets`` operand tuples (x, w1, w2, rows, gates, group_sizes[, dy]): set i draws its
    activations and experts from seed i (so every variant's set i holds the same values), the
    MXFP4 variants' experts quantized along K here, once."""
    rows, gates, gs = (jnp.asarray(a) for a in routing)
    sets = []
    for i in range(n_sets):
        kx, k1, k2, kd = jax.random.split(jax.random.key(1000 + i), 4)
        x = jax.random.normal(kx, (tokens, cfg["d_model"]), jnp.bfloat16)
        w1, w2 = ((jax.random.normal(k, s, jnp.float32) / s[1] ** 0.5).astype(jnp.bfloat16)
                  for k, s in zip((k1, k2), expert_shapes(cfg)))
        if variant.startswith("mxfp4"):
            w1, w2 = mx.quantize(w1, 1), mx.quantize(w2, 1)
        s = (x, w1, w2, rows, gates, gs)
        if variant.startswith("train"):
            s += (jax.random.normal(kd, (tokens, cfg["d_model"]), jnp.bfloat16),)
        sets.append(s)
        jax.block_until_ready(s)
    return sets


def variant_fn(variant, cfg):
    recipe = {**SERVING, **TRAIN}[variant]
    if variant.startswith("train"):
        return train_step(recipe, cfg["width"])
    return expert_layer(grouped_gemm(recipe), cfg["width"])


def explain_routes(cfg, variant, sets):
    """explain_ragged_dot of the gate+up and down GEMMs of ``variant`` on set 0's operands."""
    x, w1, w2, rows, _, gs = sets[0][:6]
    recipe = {**SERVING, **TRAIN}[variant]
    m = rows.shape[0]
    lhs = {"gate_up": jax.ShapeDtypeStruct((m, cfg["d_model"]), x.dtype),
           "down": jax.ShapeDtypeStruct((m, cfg["width"]), x.dtype)}
    out = {}
    for name, w in (("gate_up", w1), ("down", w2)):
        r = explain_ragged_dot(lhs[name], w, gs, preferred_element_type=x.dtype, recipe=recipe)
        out[name] = {"route": r.route, "reason": r.reason, "platform": r.platform}
    return out


def _rel_err(got, want):
    got, want = (jnp.asarray(a, jnp.float32) for a in (got, want))
    return float(jnp.linalg.norm(got - want) / jnp.maximum(jnp.linalg.norm(want), 1e-30))


# ----------------------------------------------------------------------------- the run
def run(args, report=lambda result: None):
    cfg = dict(QUICK if args.quick else FULL)
    tokens = args.tokens or cfg["tokens"]
    timing = dict(reps=3, min_program_s=0.0) if args.quick else dict(reps=5)
    cap = QUICK_SETS if args.quick else FULL_SETS
    serving = ["bf16"] + [v for v in SERVING if v != "bf16" and (not args.variants or v in args.variants)]
    plan = [(t, v) for t in tokens for v in serving]
    if args.train:
        plan += [(max(tokens), v) for v in TRAIN]
    result = {"info": args.info, "quick": args.quick, "config": {k: v for k, v in cfg.items() if k != "tokens"},
              "method": __doc__.split("Usage")[0].strip(), "memory": weight_memory(cfg), "rows": []}
    t0 = time.time()
    base, base_out = {}, {}
    for t, variant in plan:
        routing = route(t, cfg["experts"], cfg["top_k"], seed=args.seed)
        used = int((routing[2] > 0).sum())
        row = {"tokens": t, "variant": variant, "rows_m": int(t * cfg["top_k"]), "experts_used": used}
        try:
            n = n_sets_for(bytes_per_call(cfg, t, used, variant), cap)
            sets = make_sets(cfg, t, variant, routing, n)
            fn = variant_fn(variant, cfg)
            if {**SERVING, **TRAIN}[variant] is not None:  # an MXFP4 row
                row["routes"] = explain_routes(cfg, variant, sets)
                for gemm_name, r in row["routes"].items():
                    print(f"    explain_ragged_dot {variant} {gemm_name}: {r['route']} ({r['reason']})", flush=True)
            out = jax.jit(fn)(*sets[0])
            out = out[1][0] if variant.startswith("train") else out  # a step: compare dX
            if variant == BASELINE[variant]:
                base_out[(t, variant)] = out
            elif (t, BASELINE[variant]) in base_out:  # the baseline's set 0 holds the same data
                row["rel_err_vs_bf16"] = _rel_err(out, base_out[(t, BASELINE[variant])])
            del out
            r = time_fn(fn, sets, **timing)
            row.update(status="ok", ms=r["median_s"] * 1e3, n_sets=n, **r)
            if variant == BASELINE[variant]:
                base[(t, variant)] = r["median_s"]
            b = base.get((t, BASELINE[variant]))
            if b:
                row["ratio_vs_bf16"] = r["median_s"] / b
            if args.profile:
                kt = kernel_time(fn, sets, calls=min(r["calls"], 256))
                row["gpu_span_s"] = kt.get("timeline", {}).get("span_s") or kt.get("error", "no timeline")
        except Exception as e:  # record, keep going
            row.update(status="error", reason=f"{type(e).__name__}: {str(e)[:300]}")
        sets = None  # free this row's expert copies before the next row's
        result["rows"].append(row)
        print(f"[{time.time() - t0:6.1f}s] tokens {t:5d} {variant:12s} {row.get('ms', float('nan')):9.4f} ms "
              f"ratio {row.get('ratio_vs_bf16', float('nan')):.3f} {row['status']}", flush=True)
        report(result)
    base_out.clear()
    for r in result["rows"]:  # GPU span ratios against the baseline's, same tokens
        b = next((x.get("gpu_span_s") for x in result["rows"]
                  if x["tokens"] == r["tokens"] and x["variant"] == BASELINE[r["variant"]]), None)
        if isinstance(r.get("gpu_span_s"), float) and isinstance(b, float) and b > 0:
            r["gpu_span_ratio_vs_bf16"] = r["gpu_span_s"] / b
    return result


def markdown(result):
    info, cfg, mem = result["info"], result["config"], result["memory"]
    lines = [f"# MoE expert layer: {info['device']} ({info['platform']}), jax {info['jax']} / jaxlib {info['jaxlib']}, "
             f"{info['date_utc']} UTC", "",
             f"{cfg['experts']} experts, top-{cfg['top_k']}, d_model {cfg['d_model']}, expert width {cfg['width']}, "
             "SwiGLU (gate+up [E, D, 2F] then down [E, F, D]); time per layer call (ms) and time relative to bf16 "
             "`lax.ragged_dot` at the same token count in the same run (< 1 is faster).", "",
             f"Command: `{info['command']}`", ""]
    span = any("gpu_span_ratio_vs_bf16" in r for r in result["rows"])
    head = "| tokens | rows M | experts used | variant | ms | vs bf16 | rel. error vs bf16 |" + (
        " GPU ms | GPU vs bf16 |" if span else "")
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for r in result["rows"]:
        cells = [str(r["tokens"]), str(r["rows_m"]), str(r["experts_used"]), r["variant"]]
        if r["status"] != "ok":
            cells += [f"{r['status']}: {r.get('reason', '')[:80]}", "", ""] + (["", ""] if span else [])
        else:
            cells += [f"{r['ms']:.4g}", f"{r.get('ratio_vs_bf16', float('nan')):.3f}x",
                      f"{r['rel_err_vs_bf16']:.3g}" if "rel_err_vs_bf16" in r else "–"]
            if span:
                g = r.get("gpu_span_s")
                cells += [f"{g * 1e3:.4g}" if isinstance(g, float) else "–",
                          f"{r['gpu_span_ratio_vs_bf16']:.3f}x" if "gpu_span_ratio_vs_bf16" in r else "–"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"Expert weight memory: bf16 {mem['bf16_bytes'] / 2**20:.2f} MiB; MXFP4 {mem['mxfp4_bytes'] / 2**20:.2f} "
              f"MiB (data {mem['mxfp4_data_bytes'] / 2**20:.2f} + scales {mem['mxfp4_scale_bytes'] / 2**20:.2f}): "
              f"{mem['ratio']:.4f}x of bf16.", ""]
    routes = {(r["variant"], g, d["route"], d["reason"]) for r in result["rows"] for g, d in r.get("routes", {}).items()}
    if routes:
        lines += ["Routes (`jax_mxfp4.ragged.explain_ragged_dot`):", ""]
        lines += [f"- {v} {g}: {route_} ({reason})" for v, g, route_, reason in sorted(routes)]
    return "\n".join(lines) + "\n"


def figure(result, out):
    """Time relative to bf16 against tokens, one line per variant (moe.png)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    rows = [r for r in result["rows"] if "ratio_vs_bf16" in r and r["variant"] != BASELINE[r["variant"]]]
    for v in dict.fromkeys(r["variant"] for r in rows):
        pts = sorted((r["tokens"], r["ratio_vs_bf16"]) for r in rows if r["variant"] == v)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=v)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens (rows M = tokens x top-k)")
    ax.set_ylabel("time / bf16 lax.ragged_dot (<1 faster)")
    cfg = result["config"]
    ax.set_title(f"MoE layer {cfg['experts']}x top-{cfg['top_k']}, d {cfg['d_model']}, on {result['info']['device']}",
                 fontsize=9)
    ax.legend(fontsize=7)
    return save_figure(fig, out, "moe.png")


def check_args(ap, args):
    """Refuse what a run would skip or crash on (argparse error, exit 2): token counts that are not
    positive integers, unknown variants."""
    try:
        args.tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
    except ValueError:
        ap.error(f"--tokens takes a comma list of positive integers, got {args.tokens!r}")
    if any(t < 1 for t in args.tokens):
        ap.error(f"--tokens takes a comma list of positive integers, got {args.tokens}")
    args.variants = [v for v in args.variants.split(",") if v]
    known = [v for v in SERVING if v != "bf16"]
    bad = [v for v in args.variants if v not in known]
    if bad:
        ap.error(f"--variants: unknown name(s) {', '.join(map(repr, bad))}; choose from {', '.join(known)} "
                 "(bf16 is always timed)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="tiny shapes (8 experts of 64x64, tokens 1,16), few iterations: checks the pipeline on a CPU")
    ap.add_argument("--tokens", default="", help="comma list of token counts (default 1,16,64,256,4096; --quick 1,16)")
    ap.add_argument("--variants", default="", help="comma list of MXFP4 serving variants (default: all: "
                    f"{','.join(v for v in SERVING if v != 'bf16')}); bf16 is always timed")
    ap.add_argument("--train", action="store_true",
                    help="also time one training step (value_and_grad) bf16 vs MXFP4 at the largest token count")
    ap.add_argument("--profile", action="store_true",
                    help="also record each row's GPU time per call (profiler kernel span)")
    ap.add_argument("--seed", type=int, default=0, help="router seed (default 0)")
    ap.add_argument("--out", default=None, help="output folder (default bench_out/moe, bench_out/moe-quick)")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(argv)
    check_args(ap, args)
    out = out_dir(args.out or default_out("moe-quick" if args.quick else "moe"))
    from importlib.metadata import version

    args.info = {**device_info(), "jaxlib": version("jaxlib"),
                 "command": shlex.join(["python", "benchmarks/moe.py", *argv])}
    result = run(args, report=lambda res: write_json(os.path.join(out, "moe.json"), res))
    return write_report(out, "moe", result, markdown, figure)


if __name__ == "__main__":
    sys.exit(main())
