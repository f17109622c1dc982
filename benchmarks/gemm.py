"""MXFP4 GEMM benchmark: every available backend against bf16 ``dot_general`` in one process.

Configs run from decode (M = 1..128 rows against an 8192x8192 weight) to large LLM shapes (up to
8192x28672x8192), and the three GEMMs of a linear layer's training step for layers of T tokens,
K_in inputs and N_out outputs:

  fprop  Y  = X  · Wᵀ :  M = T,     N = N_out, K = K_in
  dgrad  dX = dY · W  :  M = T,     N = K_in,  K = N_out
  wgrad  dW = dYᵀ· X  :  M = N_out, N = K_in,  K = T

Every GEMM is timed in canonical form (operands [M, K] and [N, K], MXFP4 pre-quantized along K;
quantization is timed separately by benchmarks/quantize.py); identical canonical shapes are
measured once. Variants: "a4w4" (both MXFP4), "w4a16" (bf16 activation x MXFP4 weight), and
the baseline "bf16" (``lax.dot_general`` on bf16 operands, bf16 out; cuBLAS accumulates in
float32). Backend "fp8" (MXFP4 rows -> E4M3 x power of two, XLA's FP8 GEMM, exact rescale) is
timed at precision DEFAULT ("fp8"), HIGH ("fp8-high": fast accumulation off), with the weight
converted beforehand (":func:`jax_mxfp4.prepare_fp8`", "fp8-prepared"); its peer row "e4m3
xla-fp8" is XLA's FP8 ``dot_general`` on float8_e4m3fn operands (DEFAULT precision, bf16 out,
no scales), the ceiling of any FP8 route. Rows "pallas-KxN", "pallas-NxK" and "pallas-prepared"
time the whole dispatch path (``jax_mxfp4.dot_general``, backend "pallas") with the weight stored
like a Flax kernel ([K, N] quantized along axis 0: its packed bytes are transposed per call), stored
[N, K] along axis 1 (its scales moved per call), and [K, N] arranged once by
:func:`jax_mxfp4.prepare_decode` (read as stored on the Mosaic GPU route); "pallas-prepared-q"
(a4w4 only): the same prepared weight with the activation given in bfloat16 and quantized to
MXFP4 inside every call (``Recipe(quantize_activations=True)``), the per-call-quantized case. Timing: benchmarks/common.py (median of many samples after warm-up, rotating operand
sets past the L2). Output: JSON, a markdown table and PNG figures in --out (default
bench_out/gemm, bench_out/gemm-quick with --quick).

Usage: python benchmarks/gemm.py [--quick] [--profile] [--only NAME,...] [--out DIR]
(--quick: tiny shapes, a few backends (bf16, a4w4 xla/pallas/fp8, w4a16 pallas, e4m3 xla-fp8;
--only picks others), two operand sets per program: checks the pipeline on a CPU in seconds.)
(--profile: each timed row is run once more under the profiler; its kernels and their device
times per call are printed and stored under "profile".)
(--only: a comma list of backend names, e.g. "fp8,fp8-prepared,xla-fp8,scaled_dot"; bf16 is
always timed.)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

from benchmarks.common import (  # noqa: E402
    default_out, device_info, geomean, kernel_time, n_sets_for, out_dir, save_figure, time_fn, write_json)
from jax_mxfp4 import dispatch  # noqa: E402
from jax_mxfp4.backends.base import GemmProblem  # noqa: E402
from jax_mxfp4.quantize import quantize  # noqa: E402

FULL_DECODE = [(m, 8192, 8192) for m in (16, 1, 64, 128)]
FULL_LAYERS = [(1024, 8192, 8192), (8192, 8192, 8192), (8192, 8192, 28672)]  # (T, K_in, N_out)
QUICK_DECODE = [(16, 64, 64)]
QUICK_LAYERS = [(64, 64, 64)]  # fprop, dgrad and wgrad share one canonical shape: timed once
QUICK_SETS = 2  # operand sets per program with --quick (fewer unrolled calls to compile)

BACKENDS = {  # variant -> backends tried (each skipped with its reason where unavailable)
    "a4w4": ["xla", "scaled_dot", "pallas", "fp8", "fp8-prepared", "fp8-high",
             "hipblaslt", "hipblaslt-swizzled", "pallas-KxN", "pallas-NxK", "pallas-prepared", "pallas-prepared-q"],
    "w4a16": ["xla", "pallas", "pallas-KxN", "pallas-NxK", "pallas-prepared"],
    "e4m3": ["xla-fp8"],  # the peer: XLA's FP8 GEMM without any MXFP4 work
}
QUICK_BACKENDS = {"a4w4": ["xla", "pallas", "fp8"], "w4a16": ["pallas"], "e4m3": ["xla-fp8"]}
"""Backends --quick times (unless --only names others)."""


def pass_shapes(decode, layers):
    rows = [("decode", m, n, k) for (m, n, k) in decode]
    for t, kin, nout in layers:
        rows += [("fprop", t, nout, kin), ("dgrad", t, kin, nout), ("wgrad", nout, kin, t)]
    return rows


def _problem(m, n, k, variant, scale_layout="plain"):
    return GemmProblem(
        batch=1, m=m, n=n, k=k, out_dtype=np.dtype(jnp.bfloat16), scale_layout=scale_layout,
        platform=dispatch.current_platform(),
        lhs_kind="float" if variant == "w4a16" else "mxfp4", rhs_kind="mxfp4",
        lhs_dtype=np.dtype(jnp.bfloat16), rhs_dtype=np.dtype(jnp.bfloat16),
    )


def make_sets(m, n, k, variant, seed, scale_layout="plain", cap=8):
    """Fresh random operand sets (normal data, never zeros), enough to rotate past the L2 (at most
    ``cap``)."""
    per = {"bf16": 2 * (m + n) * k, "w4a16": 2 * m * k + (n * k * 17) // 32,
           "a4w4": ((m + n) * k * 17) // 32, "e4m3": (m + n) * k}[variant]
    sets = []
    for i in range(n_sets_for(per, cap)):
        ka, kb = jax.random.split(jax.random.key(seed * 100 + i))
        a = jax.random.normal(ka, (1, m, k), jnp.bfloat16)
        b = jax.random.normal(kb, (1, n, k), jnp.bfloat16)
        if variant == "bf16":
            sets.append((a[0], b[0]))
        elif variant == "e4m3":
            sets.append((a[0].astype(jnp.float8_e4m3fn), b[0].astype(jnp.float8_e4m3fn)))
        elif variant == "w4a16":
            sets.append((a, quantize(b, 2, scale_layout=scale_layout)))
        else:
            sets.append((quantize(a, 2, scale_layout=scale_layout), quantize(b, 2, scale_layout=scale_layout)))
    jax.block_until_ready(sets)
    return sets


DISPATCH_ROWS = ("pallas-KxN", "pallas-NxK", "pallas-prepared", "pallas-prepared-q")
"""Backend "pallas" timed through ``jax_mxfp4.dot_general`` with the weight in a stored layout."""


def dispatch_sets(m, n, k, variant, seed, name, cap=8):
    """Operand sets for a :data:`DISPATCH_ROWS` row: x [M, K] (bf16, or MXFP4 along K for a4w4)
    and the weight [K, N] along axis 0 (prepared once for "pallas-prepared") or [N, K] along 1."""
    import jax_mxfp4 as mx

    sets = []
    for i in range(n_sets_for({"w4a16": 2 * m * k + (n * k * 17) // 32, "a4w4": ((m + n) * k * 17) // 32}[variant], cap)):
        ka, kb = jax.random.split(jax.random.key(seed * 100 + i))
        a = jax.random.normal(ka, (m, k), jnp.bfloat16)
        b = jax.random.normal(kb, (k, n), jnp.bfloat16)
        w = quantize(b.T, 1) if name == "pallas-NxK" else quantize(b, 0)
        if name.startswith("pallas-prepared"):
            w = mx.prepare_decode(w)
        # "pallas-prepared-q": the a4w4 activation given as bf16 and quantized inside every call
        sets.append((quantize(a, 1) if variant == "a4w4" and name != "pallas-prepared-q" else a, w))
    jax.block_until_ready(sets)
    return sets


def dispatch_fn(name, m, n, k, variant):
    """(fn, "") for a :data:`DISPATCH_ROWS` row, or (None, reason)."""
    import jax_mxfp4 as mx

    be = dispatch.get_backend("pallas")
    why = be.unavailable_reason() or be.rejects(_problem(m, n, k, variant))
    if why:
        return None, why
    recipe = mx.Recipe(backend="pallas", quantize_activations=variant == "a4w4")
    dn = (((1,), (1,)), ((), ())) if name == "pallas-NxK" else (((1,), (0,)), ((), ()))
    return (lambda a, b: mx.dot_general(a, b, dn, preferred_element_type=jnp.bfloat16, recipe=recipe)), ""


def bf16_fn(a, b):
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16)


def backend_fn(name, m, n, k, variant):
    """(fn, scale_layout) for a backend, or (None, reason)."""
    if name == "xla-fp8":
        return bf16_fn, "plain"  # same dot_general, float8_e4m3fn operands (make_sets "e4m3")
    if name.startswith("fp8"):
        from dataclasses import replace

        be = dispatch.get_backend("fp8")
        problem = replace(_problem(m, n, k, variant), precision="high" if name == "fp8-high" else "default")
        why = be.unavailable_reason() or be.rejects(problem)
        if why:
            return None, why
        return (lambda a, b: be.gemm(a, b, problem)), "plain"
    base = name.split("-")[0]
    layout = "swizzled" if name.endswith("swizzled") else "plain"
    if base not in dispatch._REGISTRY:
        return None, f"backend {base!r} not registered in this build"
    be = dispatch.get_backend(base)
    problem = _problem(m, n, k, variant, layout)
    why = be.unavailable_reason() or be.rejects(problem)
    if why:
        return None, why
    return (lambda a, b: be.gemm(a, b, problem)), layout


def _profile(fn, sets, top=8, calls=None):
    """Profiler kernel times of one program over the rotating sets (``common.kernel_time``), with
    ``calls`` calls (the timed program's count, so the timeline shows where its time per call
    went): printed, and returned as {"kernel_s", "calls", "top": [[name, seconds per call], ...],
    "timeline"}."""
    kt = kernel_time(fn, sets, calls=calls)
    if "error" in kt:
        print(f"    profile: {kt['error']}", flush=True)
        return kt
    ranked = sorted(kt["kernels"].items(), key=lambda kv: -kv[1])
    tl = kt.get("timeline", {})
    print(f"    profile: kernels sum {kt['kernel_s'] * 1e6:.2f} us/call over {kt['calls']} calls; "
          + "; ".join(f"{name[:60]} {t * 1e6:.2f}" for name, t in ranked[:top]), flush=True)
    if tl:
        print(f"    timeline per call: GPU span {tl['span_s'] * 1e6:.2f} us, busy {tl['busy_s'] * 1e6:.2f}, "
              f"idle {tl['idle_s'] * 1e6:.2f}, {tl['kernels']:.2f} kernels", flush=True)
    return {"kernel_s": kt["kernel_s"], "calls": kt["calls"], "top": [[n, t] for n, t in ranked[:top]],
            "timeline": tl}


def run(args):
    info = device_info()
    quick = args.quick
    decode = QUICK_DECODE if quick else [d for d in FULL_DECODE if not args.decode_m or d[0] in args.decode_m]
    layers = QUICK_LAYERS if quick else [t for t in FULL_LAYERS if not args.layers or t in args.layers]
    shapes = pass_shapes(decode, layers)
    if args.fprop_only:
        shapes = [s for s in shapes if s[0] in ("decode", "fprop")]
    timing = dict(reps=3, min_program_s=0.0) if quick else dict(reps=7)
    cap = QUICK_SETS if quick else 8
    measured = {}  # (m, n, k, variant, backend) -> result dict
    rows = []
    t_start = time.time()
    for pass_name, m, n, k in shapes:
        for variant in ["bf16", "a4w4", "w4a16", "e4m3"]:
            if variant == "w4a16" and pass_name not in ("decode", "fprop"):
                continue  # weight-only quantization is an inference (forward) format
            names = ["bf16"] if variant == "bf16" else BACKENDS[variant]
            if args.only and variant != "bf16":
                names = [b for b in names if b in args.only]
            elif quick and variant != "bf16":
                names = QUICK_BACKENDS[variant]
            if pass_name != "decode":  # the stored-layout dispatch rows are about decode-size GEMMs
                names = [b for b in names if b not in DISPATCH_ROWS]
            for name in names:
                key = (m, n, k, variant, name)
                if key not in measured:
                    if name == "bf16":
                        fn, layout = bf16_fn, "plain"
                    elif name in DISPATCH_ROWS:
                        fn, layout = dispatch_fn(name, m, n, k, variant)
                    elif name == "xla" and m * n * k > 2**39 and not quick:
                        fn, layout = None, "float32 reference path: not timed above 8192^3 (75 ms at 8192x28672x8192 on an H200)"
                    else:
                        fn, layout = backend_fn(name, m, n, k, variant)
                    if fn is None:
                        measured[key] = {"status": "skipped", "reason": layout}
                    else:
                        try:
                            if name in DISPATCH_ROWS:
                                sets = dispatch_sets(m, n, k, variant, seed=m + n + k, name=name, cap=cap)
                            else:
                                sets = make_sets(m, n, k, "bf16" if name == "bf16" else variant, seed=m + n + k,
                                                 scale_layout=layout, cap=cap)
                            if name == "fp8-prepared":  # the weight converted once, outside the timing
                                from jax_mxfp4.fp8_prepared import prepare_fp8

                                sets = [(a, prepare_fp8(b)) for a, b in sets]
                                jax.block_until_ready(sets)
                            r = time_fn(fn, sets, **timing)
                            r["status"] = "ok"
                            if args.profile:
                                r["profile"] = _profile(fn, sets, calls=min(r.get("calls") or len(sets), 512))
                            measured[key] = r
                            del sets
                        except Exception as e:  # record, keep going
                            measured[key] = {"status": "error", "reason": f"{type(e).__name__}: {str(e)[:300]}"}
                    print(f"[{time.time() - t_start:7.1f}s] {pass_name:6s} {m}x{n}x{k} {variant:5s} {name:20s} "
                          f"{measured[key].get('median_s', float('nan')) * 1e3:9.4f} ms {measured[key]['status']}",
                          flush=True)
                    if args.out_path:
                        write_json(os.path.join(args.out_path, "gemm_partial.json"),
                                   [{"key": list(kk), **vv} for kk, vv in measured.items()])
                r = dict(measured[key])
                rows.append({"pass": pass_name, "m": m, "n": n, "k": k, "variant": variant, "backend": name, **r})
    # ratios against bf16 of the same shape, same run
    for r in rows:
        base = measured[(r["m"], r["n"], r["k"], "bf16", "bf16")]
        flops = 2.0 * r["m"] * r["n"] * r["k"]
        if r.get("status") == "ok":
            r["tflops"] = flops / r["median_s"] / 1e12
            if base.get("status") == "ok":
                r["time_ratio_vs_bf16"] = r["median_s"] / base["median_s"]
    geo = {}
    for r in rows:
        if r["variant"] == "bf16" or "time_ratio_vs_bf16" not in r:
            continue
        geo.setdefault((r["pass"], f"{r['variant']}:{r['backend']}"), []).append(r["time_ratio_vs_bf16"])
    geomeans = [{"pass": p, "backend": b, "geomean_time_ratio_vs_bf16": geomean(v), "configs": len(v)}
                for (p, b), v in sorted(geo.items())]
    result = {"info": info, "quick": quick, "method": __doc__.split("Usage")[0].strip(),
              "rows": rows, "geomeans": geomeans}
    return result


def markdown(result):
    info = result["info"]
    rows = result["rows"]
    lines = [f"# MXFP4 GEMM benchmark: {info['device']} ({info['platform']}), jax {info['jax']}, {info['date_utc']} UTC", "",
             "Median time per GEMM (ms) and, in brackets, time relative to bf16 `dot_general` of the same "
             "shape in the same run (< 1 is faster). bf16 out everywhere.", ""]
    cols = [("bf16", "bf16")] + [(v, b) for v in ("a4w4", "w4a16", "e4m3") for b in BACKENDS[v]]
    present = [c for c in cols if any(r["variant"] == c[0] and r["backend"] == c[1] and r.get("status") == "ok" for r in rows)]
    lines.append("| pass | M x N x K | " + " | ".join(f"{v} {b}" for v, b in present) + " |")
    lines.append("|---|---|" + "---|" * len(present))
    seen = []
    for r in rows:
        key = (r["pass"], r["m"], r["n"], r["k"])
        if key in seen:
            continue
        seen.append(key)
        cells = []
        for v, b in present:
            hit = [x for x in rows if (x["pass"], x["m"], x["n"], x["k"]) == key and x["variant"] == v and x["backend"] == b]
            if not hit or hit[0].get("status") != "ok":
                cells.append("–")
            elif v == "bf16":
                cells.append(f"{hit[0]['median_s'] * 1e3:.4g}")
            else:
                ratio = hit[0].get("time_ratio_vs_bf16", float("nan"))
                cells.append(f"{hit[0]['median_s'] * 1e3:.4g} ({ratio:.2f}x)")
        lines.append(f"| {key[0]} | {key[1]}x{key[2]}x{key[3]} | " + " | ".join(cells) + " |")
    spans = {(r["pass"], r["m"], r["n"], r["k"], r["variant"], r["backend"]): r["profile"]["timeline"]["span_s"]
             for r in rows if r.get("status") == "ok" and r.get("profile", {}).get("timeline", {}).get("span_s")}
    if spans:  # --profile: the GPU's own time per call, free of the host's per-argument dispatch cost
        lines += ["", "GPU time per call (ms; profiler span of the timed program's kernels / calls) and, in "
                  "brackets, relative to bf16's (`--profile`). At decode sizes the time per call above also "
                  "holds the host's dispatch of each call's arguments before the program starts (~11-16 us "
                  "per call on an H200 host, jax 0.11.2): this table is the GPU's part.", "",
                  "| pass | M x N x K | variant backend | GPU ms per call |", "|---|---|---|---|"]
        for (ps, m, n, k, v, b), span in spans.items():
            base = spans.get((ps, m, n, k, "bf16", "bf16"))
            rel = f" ({span / base:.2f}x)" if base and v != "bf16" else ""
            lines.append(f"| {ps} | {m}x{n}x{k} | {v} {b} | {span * 1e3:.4g}{rel} |")
    lines += ["", "Geometric mean of time / bf16 time (< 1 is faster), per pass and backend:", "",
              "| pass | backend | geomean time / bf16 | configs |", "|---|---|---|---|"]
    for g in result["geomeans"]:
        lines.append(f"| {g['pass']} | {g['backend']} | {g['geomean_time_ratio_vs_bf16']:.3f} | {g['configs']} |")
    skipped = {(r["variant"], r["backend"]): r.get("reason") for r in rows if r.get("status") in ("skipped", "error")}
    if skipped:
        lines += ["", "Not measured:", ""]
        lines += [f"- {v} {b}: {why}" for (v, b), why in skipped.items()]
    return "\n".join(lines) + "\n"


def figures(result, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    geos = result["geomeans"]
    passes = sorted({g["pass"] for g in geos}, key=["decode", "fprop", "dgrad", "wgrad"].index)
    backends = sorted({g["backend"] for g in geos})
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(len(backends), 1)
    for i, b in enumerate(backends):
        ys = [next((g["geomean_time_ratio_vs_bf16"] for g in geos if g["pass"] == p and g["backend"] == b), np.nan) for p in passes]
        ax.bar(np.arange(len(passes)) + i * width, ys, width, label=b)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(np.arange(len(passes)) + width * (len(backends) - 1) / 2)
    ax.set_xticklabels(passes)
    ax.set_ylabel("geomean time / bf16 time (<1 faster)")
    ax.set_yscale("log")
    ax.set_title(f"MXFP4 GEMM on {result['info']['device']}")
    ax.legend(fontsize=7)
    p = save_figure(fig, out, "gemm_geomean_time_ratio.png")
    paths.append(p)

    fig, ax = plt.subplots(figsize=(8, 4))
    markers = {"decode": "o", "fprop": "s", "dgrad": "^", "wgrad": "v"}
    for i, b in enumerate(backends):
        v, name = b.split(":")
        pts = [r for r in result["rows"] if r["variant"] == v and r["backend"] == name and "time_ratio_vs_bf16" in r]
        labelled = False
        for ps, marker in markers.items():
            sel = [r for r in pts if r["pass"] == ps]
            if sel:
                ax.scatter([r["k"] * (1 + 0.04 * i) for r in sel], [r["time_ratio_vs_bf16"] for r in sel],
                           marker=marker, color=f"C{i}", label=None if labelled else b)
                labelled = True
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("K (contraction length); marker = pass (o decode, s fprop, ^ dgrad, v wgrad)")
    ax.set_ylabel("time / bf16 time (<1 faster)")
    ax.legend(fontsize=7)
    p = save_figure(fig, out, "gemm_time_ratio_vs_k.png")
    paths.append(p)
    return paths


def check_args(ap, args):
    """Parse the comma lists, refusing what run() would skip silently (argparse error, exit 2):
    malformed numbers, decode M / layer shapes / backends not in this benchmark's lists, and
    --decode-m/--layers with --quick (which times its own tiny shapes)."""
    none = {f: getattr(args, f) == "none" for f in ("decode_m", "layers")}  # time none of them
    try:
        args.decode_m = [int(v) for v in args.decode_m.split(",") if v] if not none["decode_m"] else []
        args.layers = [tuple(int(x) for x in v.split("x")) for v in args.layers.split(",") if v] if not none["layers"] else []
    except ValueError:
        ap.error("--decode-m takes integers and --layers TxKxN shapes (e.g. 1024x8192x8192), comma-separated, "
                 "or 'none'")
    args.only = [b for b in args.only.split(",") if b]
    if args.quick and (args.decode_m or args.layers):
        ap.error("--quick times its own tiny shapes: leave out --decode-m and --layers")
    known_only = sorted({b for names in BACKENDS.values() for b in names})
    for flag, given, known in (("--decode-m", args.decode_m, [d[0] for d in FULL_DECODE]),
                               ("--layers", args.layers, FULL_LAYERS), ("--only", args.only, known_only)):
        bad = [v for v in given if v not in known]
        if bad:
            fmt = (lambda v: "x".join(map(str, v))) if flag == "--layers" else str  # noqa: E731
            ap.error(f"{flag}: {', '.join(map(fmt, bad))} not among this benchmark's {', '.join(map(fmt, known))}"
                     + (" (or 'none')" if flag != "--only" else ""))
    args.decode_m = args.decode_m or ([None] if none["decode_m"] else [])  # [None]: matches no shape
    args.layers = args.layers or ([None] if none["layers"] else [])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="tiny shapes, a few backends, few iterations: checks the pipeline and files on a CPU")
    ap.add_argument("--decode-m", default="", help="comma list of decode M values (default: all; 'none': no decode shapes)")
    ap.add_argument("--layers", default="", help="comma list of TxKxN layer shapes (default: all; 'none': no layer shapes)")
    ap.add_argument("--fprop-only", action="store_true", help="only the decode and fprop GEMMs of each shape")
    ap.add_argument("--only", default="", help="comma list of backends to time besides bf16 (default: all)")
    ap.add_argument("--out", default=None, help="output folder (default bench_out/gemm, bench_out/gemm-quick)")
    ap.add_argument("--profile", action="store_true",
                    help="also run each timed row once under the profiler and print its kernels (device times)")
    args = ap.parse_args(argv)
    check_args(ap, args)
    out = out_dir(args.out or default_out("gemm-quick" if args.quick else "gemm"))
    args.out_path = out
    result = run(args)
    write_json(os.path.join(out, "gemm.json"), result)
    md = markdown(result)
    with open(os.path.join(out, "gemm.md"), "w") as f:
        f.write(md)
    figures(result, out)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
