"""Row spans of the FP8 GEMMs' operands while the main job trains: which rows leave the FP8 path.

The FP8 path (backend "fp8", :mod:`jax_mxfp4.backends.fp8`) holds a row of an MXFP4 operand as FP8
codes x one power of two when its nonzero blocks' scale bytes lie within the format's window of
the row's largest (14 binades for E4M3, 28 for E5M2, :mod:`jax_mxfp4.fp8_format`); a row that
spans more is recomputed on the exact path, whose cost grows with the number of such rows. This
benchmark trains the MXFP4 run of ``examples/train_lm.py`` (its model, step, recipe and training
windows) and, every ``--every`` steps, takes the gradient of the loss at the current parameters
through a probe: a copy of the step's value-and-gradient compiled with every FP8 GEMM reporting,
for each operand, the histogram of its rows' spans (binades between the largest and smallest
nonzero block) and the code format it is handed in. Each span is also measured from the largest
block of the whole operand ("tensor anchor"): the rows one power of two per operand, instead of
one per row, would send to the exact path (such a scale could ride in the GEMM's own scalar
scaling instead of the rescale pass). The probe draws its own stochastic-rounding key (the spans
do not depend on it).

Output (``--out``, default bench_out/row_spans): row_spans.json (every GEMM at every sampled
step), row_spans.md (the table: per GEMM at the last step, the share of rows past 14 and past 28
binades and the share the GEMM recomputes with its formats), row_spans.png (rows past 14 binades
over the steps, the GEMMs that have any).

``python benchmarks/row_spans.py --size small`` runs on CPU (every GEMM on backend "fp8", which
XLA runs there in float32: the spans are those of the GPU run, the arithmetic is not); on CUDA the
default recipe routes the large GEMMs to "fp8" itself.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import benchmarks  # noqa: E402,F401  (puts examples/ on sys.path)

MAX_SPAN = 64
"""Spans counted one by one up to this; wider rows count as MAX_SPAN (an E8M0 byte spans 254)."""


ANCHORS = ("row", "tensor")
"""Where a row's span is measured from: its own largest block, or its matrix's."""


def row_span_histogram(x, anchor: str = "row"):
    """int32 [MAX_SPAN + 1]: how many rows of the canonical operand ``x`` (MXFP4Array or
    FP8Prepared [B, R, K] quantized along K, as the FP8 backend receives it) span each number of
    binades, counting blocks with a nonzero code: from the row's largest block (``anchor="row"``,
    the window the FP8 path encodes each row in) or from the largest block of the operand's
    batch element (``"tensor"``: the window of one power of two per [R, K] matrix). An all-zero
    row spans 0. Raises ValueError for another anchor or an operand not quantized along its last
    axis."""
    if anchor not in ANCHORS:
        raise ValueError(f"row_span_histogram: anchor must be one of {ANCHORS}, got {anchor!r}")
    if len(x.shape) != 3 or x.axis != 2:
        raise ValueError(f"row_span_histogram: x must be a canonical [B, R, K] operand quantized along axis 2, "
                         f"got shape {tuple(x.shape)} quantized along axis {x.axis}")
    import jax.numpy as jnp

    from jax_mxfp4.fp8_prepared import FP8Prepared
    from jax_mxfp4.mx_format import as_scale_bytes, unpack_nibbles

    q = x.to_mxfp4() if isinstance(x, FP8Prepared) else x
    sb = as_scale_bytes(q.plain_scales()).astype(jnp.int32)
    magnitudes = (unpack_nibbles(q.data) & 7).reshape(sb.shape + (32,))
    nz = jnp.max(magnitudes, axis=-1) > 0
    hi = jnp.max(jnp.where(nz, sb, -1), axis=-1)
    if anchor == "tensor":
        hi = jnp.where(hi >= 0, jnp.max(hi, axis=-1, keepdims=True), hi)  # per batch element
    lo = jnp.min(jnp.where(nz, sb, 256), axis=-1)
    span = jnp.clip(jnp.where(hi >= 0, hi - lo, 0), 0, MAX_SPAN).reshape(-1)
    return jnp.bincount(span, length=MAX_SPAN + 1).astype(jnp.int32)


def _fmt(x) -> str:
    from jax_mxfp4.fp8_prepared import FP8Prepared

    return x.fmt if isinstance(x, FP8Prepared) else "e4m3"  # the backend encodes an MXFP4Array as E4M3


def compile_probe(loss_fn, params, batch, rngs, sink):
    """``jax.value_and_grad(loss_fn)`` compiled ahead of time with every backend-"fp8" GEMM
    appending (shape, formats, span histograms) to ``sink`` when it runs. Jit caches are cleared
    around it, so no other program carries the probe."""
    import jax

    from jax_mxfp4.backends import fp8 as fp8_backend

    cls = fp8_backend.Fp8Backend
    plain = cls.gemm

    def reporting(self, lhs, rhs, problem):
        meta = dict(m=int(problem.m), n=int(problem.n), k=int(problem.k), batch=int(problem.batch),
                    formats=[_fmt(lhs), _fmt(rhs)])
        names = [f"{side}{'' if anchor == 'row' else '_' + anchor}" for anchor in ANCHORS for side in ("lhs", "rhs")]
        jax.debug.callback(lambda *h, meta=meta: sink.append({**meta, **{n: np.asarray(v).tolist()
                                                                          for n, v in zip(names, h)}}),
                           *[row_span_histogram(x, anchor) for anchor in ANCHORS for x in (lhs, rhs)], ordered=True)
        return plain(self, lhs, rhs, problem)

    jax.clear_caches()
    cls.gemm = reporting
    try:
        return jax.jit(jax.value_and_grad(loss_fn)).lower(params, batch, rngs).compile()
    finally:
        cls.gemm = plain
        jax.clear_caches()


def summarize(hist) -> dict:
    """Shares of rows past each format's window, the median and largest span, from a histogram."""
    h = np.asarray(hist, np.int64)
    n = max(int(h.sum()), 1)
    spans = np.arange(len(h))
    cum = np.cumsum(h)
    return {"rows": int(h.sum()), "past_14": float(h[15:].sum() / n), "past_28": float(h[29:].sum() / n),
            "median": int(np.searchsorted(cum, (n + 1) // 2)) if h.any() else 0, "max": int(spans[h > 0].max()) if h.any() else 0}


def run(size: str, steps: int | None, every: int, seed: int = 0, quick: bool = False) -> dict:
    import jax
    import train_lm as demo

    from benchmarks.common import demo_batches, device_info
    from jax_mxfp4 import Recipe
    from jax_mxfp4.fp8_format import format_named

    cfg = dict(demo.SIZES[size])
    if quick:
        cfg.update(d_model=64, n_layers=1, n_heads=2, seq_len=64, batch=4)
    steps = steps or cfg["steps"]
    cfg["steps"] = steps
    cfg["n_heads"] = min(cfg["n_heads"], max(1, cfg["d_model"] // 32))
    on_cpu = jax.default_backend() == "cpu"
    recipe = Recipe(backend="fp8") if on_cpu else Recipe()
    model = demo.build_model(cfg, recipe)
    batches = demo_batches(cfg, steps, "corpus")
    params = model.init(jax.random.key(seed), batches(0)[:, :-1])
    step, opt, loss_fn = demo.make_train_step(model, cfg, steps, seed)
    opt_state = opt.init(params)
    rngs = {"stochastic_rounding": jax.random.key(seed + 1)}
    sink: list = []
    probe = compile_probe(loss_fn, params, batches(0), rngs, sink)
    samples = []
    for i in range(steps):
        if i % every == 0 or i == steps - 1:
            sink.clear()
            loss, _ = probe(params, batches(i), rngs)
            jax.block_until_ready(loss)
            jax.effects_barrier()
            gemms = []
            for g in sink:
                row = {key: g[key] for key in ("m", "n", "k", "batch", "formats")}
                for side, fmt in zip(("lhs", "rhs"), g["formats"]):
                    for name in (side, side + "_tensor"):
                        s = summarize(g[name])
                        s["recomputed"] = float(np.asarray(g[name])[format_named(fmt).window_span + 1:].sum()
                                                / max(1, sum(g[name])))
                        row[name] = s
                        row[name + "_hist"] = g[name][:s["max"] + 1]  # rows per span 0..max
                gemms.append(row)
            samples.append({"step": i, "loss": float(loss), "gemms": gemms})
            print(f"step {i}: loss {float(loss):.3f}, {len(gemms)} FP8 GEMMs, rows past 14 binades in "
                  f"{sum(1 for g in gemms if g['lhs']['past_14'] or g['rhs']['past_14'])}", flush=True)
        params, opt_state, _ = step(params, opt_state, batches(i), i)
    return {"size": size, "quick": quick, "steps": steps, "every": every, "model": cfg, "info": device_info(),
            "recipe": "Recipe(backend='fp8')" if on_cpu else "Recipe()", "samples": samples,
            "rows": [{"status": "ok"}]}


def markdown(result) -> str:
    info = result["info"]
    last = result["samples"][-1]
    job = "a tiny model (`--quick`)" if result.get("quick") else f"main job `--size {result['size']}`"
    lines = [f"# Row spans of the FP8 GEMMs' operands: {job}, step {last['step']} of {result['steps']}", "",
             f"{info['device']} ({info['platform']}), jax {info['jax']}, {info['date_utc']} UTC; "
             f"Command: `{info['command']}`", "",
             "Rows past 14 / 28 binades: outside E4M3's / E5M2's window; recomputed: the rows the GEMM "
             "sends to the exact path with the formats it was handed; tensor anchor: the rows it would "
             "send with one power of two per operand (spans from the operand's largest block).", "",
             "| GEMM | M x N x K | formats | lhs past 14 | lhs past 28 | lhs median / max | lhs recomputed "
             "| rhs past 14 | rhs past 28 | rhs median / max | rhs recomputed | recomputed, tensor anchor (lhs / rhs) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    pct = lambda v: f"{100 * v:.1f}%"  # noqa: E731
    for j, g in enumerate(last["gemms"]):
        lh, rh = g["lhs"], g["rhs"]
        lines.append(f"| {j} | {g['m']} x {g['n']} x {g['k']} | {' x '.join(g['formats'])} | {pct(lh['past_14'])} | "
                     f"{pct(lh['past_28'])} | {lh['median']} / {lh['max']} | {pct(lh['recomputed'])} | "
                     f"{pct(rh['past_14'])} | {pct(rh['past_28'])} | {rh['median']} / {rh['max']} | "
                     f"{pct(rh['recomputed'])} | {pct(g['lhs_tensor']['recomputed'])} / "
                     f"{pct(g['rhs_tensor']['recomputed'])} |")
    return "\n".join(lines) + "\n"


def figure(result, out):
    """Share of rows past 14 binades over the steps, per GEMM operand that has any."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.common import save_figure

    fig, ax = plt.subplots(figsize=(7, 3.8))
    n_gemms = len(result["samples"][0]["gemms"])
    for j in range(n_gemms):
        for side in ("lhs", "rhs"):
            ys = [s["gemms"][j][side]["past_14"] for s in result["samples"] if j < len(s["gemms"])]
            if any(ys):
                g = result["samples"][0]["gemms"][j]
                ax.plot([s["step"] for s in result["samples"]][:len(ys)], [100 * y for y in ys], marker="o",
                        label=f"GEMM {j} {side} ({g['m']}x{g['n']}x{g['k']})")
    ax.set_xlabel("training step")
    ax.set_ylabel("rows past 14 binades (%)")
    ax.set_title(f"main job --size {result['size']}: rows outside E4M3's window")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    return save_figure(fig, out, "row_spans.png")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    import train_lm as demo

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=sorted(demo.SIZES), default="small", help="main job size (default small)")
    ap.add_argument("--steps", type=int, default=None, help="training steps (default: the size's)")
    ap.add_argument("--every", type=int, default=50, help="probe every N steps (and the last)")
    ap.add_argument("--quick", action="store_true", help="a tiny model and few steps: checks the pipeline")
    ap.add_argument("--out", default=None, help="output folder (default bench_out/row_spans)")
    args = ap.parse_args(argv)
    if args.every < 1 or (args.steps is not None and args.steps < 1):
        ap.error("--every and --steps must be positive")
    from benchmarks.common import default_out, out_dir, write_report

    out = out_dir(args.out or default_out("row_spans"))
    result = run(args.size, args.steps if not args.quick else (args.steps or 3), args.every, quick=args.quick)
    result["info"]["command"] = shlex.join(["python", "benchmarks/row_spans.py", *argv])
    return write_report(out, "row_spans", result, markdown, figure)


if __name__ == "__main__":
    sys.exit(main())
