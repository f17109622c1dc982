"""Where the decode kernel's time goes (NVIDIA Hopper): profiler kernel times of the Mosaic GPU
w4a16 kernel (jax_mxfp4/kernels/wgemm_mgpu.py, the dispatch tiling) over K, whole and with its
compute removed, beside XLA's bf16 GEMM of the same shape.

Probes (kernel time per call, ``benchmarks.common.kernel_time``: one program over distinct operand
sets > 3x L2):
  * "full": the kernel as dispatch runs it (``default_mgpu_config`` for --order's bytes: random
    bytes, so the byte order changes nothing but the decode);
  * "no compute": the same kernel with each compute warpgroup's decode and WGMMAs removed
    (``_wgmma_step`` patched to nothing, for this probe only): the TMA pipeline (x, weight bytes,
    scales per step, ready/consumed barriers), the partial-sum exchange and the output store
    remain. Its output is NOT the product (zeros): a measurement of the data movement only.
Fitting time = a + b K over K in --ks separates a fixed cost per call (launch, pipeline fill,
epilogue) from the per-byte cost; "full" close to "no compute" says the memory pipeline limits,
far above it says the per-step compute does.

Usage: python benchmarks/decode_probe.py --out DIR [--m 16,1] [--n 8192] [--ks 2048,4096,8192,16384]
       [--order lanes|pairs]
Writes decode_probe.json and decode_probe.png; prints a table (us per call; ratio = time / bf16).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

from benchmarks.common import device_info, kernel_time, n_sets_for, out_dir, save_figure, write_json  # noqa: E402

DIMS2 = (((1,), (1,)), ((), ()))
PROBES = ("full", "no compute")


@contextlib.contextmanager
def probe(name):
    """The kernel module with the probe's change (nothing for "full")."""
    from jax_mxfp4.kernels import wgemm_mgpu as wm

    saved = wm._wgmma_step
    if name == "no compute":
        wm._wgmma_step = lambda *a, **k: None
    try:
        yield wm
    finally:
        wm._wgmma_step = saved


def fit(ks, us):
    """Least-squares (a, b) of us = a + b K (b in us per 1024 K)."""
    b, a = np.polyfit(np.asarray(ks, float) / 1024, np.asarray(us, float), 1)
    return float(a), float(b)


def _positive_ints(text):
    """argparse type: a comma list of positive ints."""
    try:
        vals = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of positive ints, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected a comma list of positive ints, got {text!r}")
    return vals


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/decode_probe")
    ap.add_argument("--m", type=_positive_ints, default=[16, 1], help="comma list of activation rows")
    ap.add_argument("--n", type=_positive_ints, default=[8192], help="weight rows (one value)")
    ap.add_argument("--ks", type=_positive_ints, default=[2048, 4096, 8192, 16384], help="comma list of K")
    ap.add_argument("--order", default="lanes", choices=("lanes", "pairs"),
                    help="the weight's byte order (prepare_decode's), which picks the decode")
    args = ap.parse_args(argv)
    out = out_dir(args.out)
    ms, ks = args.m, args.ks
    if len(args.n) != 1:
        ap.error(f"--n takes one value, got {args.n}")
    n = args.n[0]
    if jax.devices()[0].platform != "gpu":
        print(f"note: no GPU here ({jax.devices()[0].platform}): every row reports the kernel's error "
              "(the Mosaic GPU kernel needs an NVIDIA Hopper GPU)", flush=True)
    rows = []
    info = device_info()
    print(f"{'M':>3} {'K':>6} {'probe':12} {'kernel us':>10} {'bf16 us':>9} {'ratio':>6}", flush=True)
    for m in ms:
        for k in ks:
            nsets = n_sets_for(n * k * 17 // 32)
            w = [jax.random.randint(jax.random.key(i), (n, k // 2), 0, 256, jnp.int32).astype(jnp.uint8)
                 for i in range(nsets)]
            s = [jax.random.randint(jax.random.key(50 + i), (k // 32, n), 120, 130, jnp.int32).astype(jnp.uint8)
                 for i in range(nsets)]
            x = [jax.random.normal(jax.random.key(100 + i), (m, k), jnp.bfloat16) for i in range(nsets)]
            wb = [jax.random.normal(jax.random.key(200 + i), (n, k), jnp.bfloat16) for i in range(min(nsets, 4))]
            bsets = [(x[i], wb[i % len(wb)]) for i in range(nsets)]
            kb = kernel_time(lambda a, b: lax.dot_general(a, b, DIMS2, preferred_element_type=jnp.bfloat16), bsets)
            bf16_us = kb.get("kernel_s", float("nan")) * 1e6
            del wb, bsets
            for name in PROBES:
                try:
                    with probe(name) as wm:
                        cfg = wm.default_mgpu_config(m, n, k, args.order)
                        f = lambda a, d, sc, cfg=cfg, wm=wm: wm.mgpu_w4a16(  # noqa: E731
                            a, d, sc, jnp.bfloat16, cfg, scales_form="kmajor", w_order=args.order)
                        kt = kernel_time(f, list(zip(x, w, s)))
                    us = kt.get("kernel_s", float("nan")) * 1e6
                    row = {"m": m, "k": k, "n": n, "probe": name, "kernel_us": us, "bf16_kernel_us": bf16_us,
                           "ratio": us / bf16_us, "config": str(cfg), "kernels": kt.get("kernels")}
                except Exception as e:  # noqa: BLE001 - report and go on
                    row = {"m": m, "k": k, "n": n, "probe": name, "error": f"{type(e).__name__}: {e}"[:600]}
                rows.append(row)
                write_json(os.path.join(out, "decode_probe.json"), {"info": info, "rows": rows})
                if "error" in row:
                    print(f"{m:3d} {k:6d} {name:12} error {row['error'][:200]}", flush=True)
                else:
                    print(f"{m:3d} {k:6d} {name:12} {us:10.2f} {bf16_us:9.2f} {us / bf16_us:6.3f}", flush=True)
            del x, w, s
    fits = {}
    for m in ms:
        for name in PROBES:
            pts = [(r["k"], r["kernel_us"]) for r in rows if r["m"] == m and r["probe"] == name and "kernel_us" in r]
            if len(pts) >= 2:
                a, b = fit(*zip(*pts))
                fits[f"M={m} {name}"] = {"fixed_us": a, "us_per_1024_k": b}
                print(f"fit M={m} {name}: {a:.2f} us + {b:.3f} us per 1024 K", flush=True)
    write_json(os.path.join(out, "decode_probe.json"), {"info": info, "rows": rows, "fits": fits})
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for m in ms:
        for name in PROBES:
            pts = sorted((r["k"], r["kernel_us"]) for r in rows if r["m"] == m and r["probe"] == name
                         and "kernel_us" in r)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f"M={m} {name}")
        pts = sorted({(r["k"], r["bf16_kernel_us"]) for r in rows if r["m"] == m and "bf16_kernel_us" in r})
        if pts:
            ax.plot(*zip(*pts), ls="--", marker="x", label=f"M={m} bf16")
    ax.set_xlabel(f"K (N = {n})")
    ax.set_ylabel("kernel time per call (us)")
    ax.set_title(f"decode kernel probes, {info['device']}")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    save_figure(fig, out, "decode_probe.png")


if __name__ == "__main__":
    main()
