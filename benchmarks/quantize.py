"""MXFP4 quantization benchmark: GB/s of the fused Pallas quantizer and of the reference jnp
quantizer, against the same run's device copy bandwidth.

Bytes counted per quantization: the input read once plus packed data and scale bytes written once
(stochastic rounding also reads its float32 uniforms; they are not counted, so its GB/s is the
useful-bytes rate). Copy bandwidth: XLA elementwise ``x * 1.0001`` on the same input (bytes read
plus bytes written), timed the same way. Timing: benchmarks/common.py.

Usage: python benchmarks/quantize.py [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.common import save_figure, device_info, n_sets_for, out_dir, time_fn, write_json  # noqa: E402
from jax_mxfp4 import dispatch  # noqa: E402
from jax_mxfp4.kernels.quantize import QuantizeConfig, quantize_impl  # noqa: E402
from jax_mxfp4.quantize import _quantize_impl  # noqa: E402

FULL_SHAPES = [((16384, 8192), jnp.bfloat16), ((16384, 8192), jnp.float32), ((8192, 28672), jnp.bfloat16)]
QUICK_SHAPES = [((64, 256), jnp.bfloat16)]
MODES = [("even", "nearest"), ("rceil", "nearest"), ("floor", "nearest"), ("even", "stochastic")]
TUNE = [QuantizeConfig(r, c, w) for (r, c, w) in [(16, 256, 4), (8, 512, 4), (32, 256, 8), (64, 128, 4),
                                                   (4, 1024, 4), (16, 512, 8), (32, 512, 8), (8, 256, 2)]]


def run(quick, tune=True):
    interpret = dispatch.current_platform() == "cpu"
    timing = dict(reps=3, min_program_s=0.0) if quick else dict(reps=7)
    rows = []
    t0 = time.time()
    for shape, dtype in QUICK_SHAPES if quick else FULL_SHAPES:
        r, k = shape
        nbytes_in = r * k * jnp.dtype(dtype).itemsize
        q_bytes = nbytes_in + r * k // 2 + r * k // 32
        sets = []
        for i in range(n_sets_for(nbytes_in)):
            sets.append((jax.random.normal(jax.random.key(i), shape, jnp.float32).astype(dtype),))
        copy = time_fn(lambda x: x * jnp.asarray(1.0001, dtype), sets, **timing)
        copy_gbs = 2 * nbytes_in / copy["median_s"] / 1e9
        rows.append({"shape": shape, "dtype": jnp.dtype(dtype).name, "what": "copy (x*1.0001)", "median_s": copy["median_s"],
                     "gb_s": copy_gbs, "ratio_vs_copy": 1.0})
        key = jax.random.key(42)
        modes = MODES[:1] if quick else MODES
        for scale_mode, rounding in modes:
            for name, fn in [
                ("fused", lambda x, m=scale_mode, rd=rounding: quantize_impl(x, key, axis=1, scale_mode=m, rounding=rd, interpret=interpret)),
                ("reference", lambda x, m=scale_mode, rd=rounding: _quantize_impl(x, key if rd == "stochastic" else None, axis=1, scale_mode=m, rounding=rd)),
            ]:
                t = time_fn(fn, sets, **timing)["median_s"]
                gbs = q_bytes / t / 1e9
                rows.append({"shape": shape, "dtype": jnp.dtype(dtype).name, "what": f"{name} {scale_mode}/{rounding}",
                             "median_s": t, "gb_s": gbs, "ratio_vs_copy": gbs / copy_gbs})
                print(f"[{time.time() - t0:6.1f}s] {shape} {jnp.dtype(dtype).name} {name} {scale_mode}/{rounding}: "
                      f"{t * 1e3:.4f} ms {gbs:.1f} GB/s = {gbs / copy_gbs:.3f} of copy ({copy_gbs:.1f} GB/s)", flush=True)
        if tune and not quick and shape == FULL_SHAPES[0][0] and dtype == FULL_SHAPES[0][1]:
            for cfg in TUNE:
                try:
                    t = time_fn(lambda x, cfg=cfg: quantize_impl(x, None, axis=1, scale_mode="even", rounding="nearest", cfg=cfg), sets, reps=5)["median_s"]
                except Exception as e:
                    print("  error", cfg, type(e).__name__, str(e)[:200])
                    continue
                gbs = q_bytes / t / 1e9
                rows.append({"shape": shape, "dtype": jnp.dtype(dtype).name, "what": f"fused even/nearest tile {cfg.rows}x{cfg.cols} w{cfg.num_warps}",
                             "median_s": t, "gb_s": gbs, "ratio_vs_copy": gbs / copy_gbs})
                print(f"  tune {cfg}: {gbs:.1f} GB/s = {gbs / copy_gbs:.3f} of copy", flush=True)
        del sets
    return {"info": device_info(), "quick": quick, "method": __doc__.split("Usage")[0].strip(), "rows": rows}


def markdown(res):
    info = res["info"]
    lines = [f"# MXFP4 quantization: {info['device']} ({info['platform']}), jax {info['jax']}, {info['date_utc']} UTC", "",
             "GB/s = (input bytes + packed data + scale bytes) / median time; ratio against the same run's "
             "XLA elementwise copy (bytes read + written).", "",
             "| shape | dtype | what | median ms | GB/s | x copy |", "|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['shape'][0]}x{r['shape'][1]} | {r['dtype']} | {r['what']} | {r['median_s'] * 1e3:.4g} | "
                     f"{r['gb_s']:.1f} | {r['ratio_vs_copy']:.3f} |")
    return "\n".join(lines) + "\n"


def figure(res, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in res["rows"] if "tile" not in r["what"]]
    labels = [f"{r['shape'][0]}x{r['shape'][1]} {r['dtype']}\n{r['what']}" for r in rows]
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(rows) + 1.5))
    ax.barh(range(len(rows)), [r["gb_s"] for r in rows],
            color=["gray" if r["what"].startswith("copy") else ("C0" if r["what"].startswith("fused") else "C1") for r in rows])
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(labels, fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("GB/s (gray: same-run copy; blue: fused Pallas; orange: reference jnp)")
    ax.set_title(f"MXFP4 quantization on {res['info']['device']}")
    p = save_figure(fig, out, "quantize_bandwidth.png")
    return p


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU CI): checks the pipeline and files")
    ap.add_argument("--no-tune", action="store_true", help="skip the tile sweep")
    ap.add_argument("--out", default=None, help="output folder (default benchmarks/results/quantize[-quick])")
    args = ap.parse_args(argv)
    here = os.path.dirname(os.path.abspath(__file__))
    out = out_dir(args.out or os.path.join(here, "results", "quantize-quick" if args.quick else "quantize"))
    res = run(args.quick, tune=not args.no_tune)
    write_json(os.path.join(out, "quantize.json"), res)
    md = markdown(res)
    with open(os.path.join(out, "quantize.md"), "w") as f:
        f.write(md)
    figure(res, out)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
