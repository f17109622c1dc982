"""The FP8 path's flagged-row recompute (``kernels/fp8_fix.py``): its cost against the share of
flagged rows.

Why: the recompute's work should follow the flagged rows (H200 session 7: the earlier tile walk
cost 38 ms of a 112 ms demo step at d_model 4096 with few flagged rows). This script times
``fix_flagged`` on random FP8-path operands with a fraction ``p`` of the lhs rows and of the rhs
rows (output columns) flagged, at each ``--groups`` (listed rows per work unit), beside a copy of
the output (the call is timed without donation, so XLA copies ``out`` first; the copy's time is
printed to subtract). Fair timing (benchmarks/common.time_fn); with ``--profile`` also the
profiler's time of the kernel itself.

Usage: python benchmarks/fp8_fix.py [--quick] [--shapes 8192x16384x4096] [--fractions 0,0.001,0.01,0.1]
       [--groups 16,64] [--profile] [--out DIR]
(``--quick``: 1 x 64 x 48 x 128 in the Pallas interpreter, CPU CI.)
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

from benchmarks.common import device_info, kernel_time, n_sets_for, out_dir, save_figure, time_fn, write_json  # noqa: E402
from jax_mxfp4.dispatch import current_platform  # noqa: E402
from jax_mxfp4.fp8 import FLAG_EXACT  # noqa: E402
from jax_mxfp4.kernels import fp8_fix  # noqa: E402


def operand(key, b: int, r: int, k: int, frac: float):
    """FP8Prepared-like fields of random rows [b, r, k]: E4M3 codes of E2M1 magnitudes, scale
    bytes 120-134, row exponents 0, and FLAG_EXACT on round(frac * r) rows per batch element."""
    kc, ks, kf = jax.random.split(key, 3)
    e2m1 = jnp.asarray([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.5, -1, -1.5, -2, -3, -4, -6], jnp.float32)
    codes = e2m1[jax.random.randint(kc, (b, r, k), 0, e2m1.size)].astype(jnp.float8_e4m3fn)
    scales = jax.random.randint(ks, (b, r, k // 32), 120, 135).astype(jnp.uint8)
    n_flag = int(round(frac * r))
    flag = jnp.zeros((b, r), jnp.uint8)
    if n_flag:
        rows = jax.vmap(lambda kk: jax.random.permutation(kk, r)[:n_flag])(jax.random.split(kf, b))
        flag = flag.at[jnp.arange(b)[:, None], rows].set(FLAG_EXACT)
    return codes, scales, jnp.zeros((b, r), jnp.int32), flag


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shape in the Pallas interpreter (CPU CI)")
    ap.add_argument("--shapes", default="8192x16384x4096", help="comma list of MxNxK (batch 1)")
    ap.add_argument("--fractions", default="0,0.001,0.01,0.1", help="comma list of flagged-row shares in [0, 1]")
    ap.add_argument("--groups", default="16,64", help="comma list of FixConfig.group values (powers of two >= 16)")
    ap.add_argument("--profile", action="store_true", help="also the profiler's kernel times (GPU)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    def parse(flag, text, conv):
        try:
            return [conv(v) for v in text.split(",") if v.strip()]
        except ValueError:
            ap.error(f"{flag} must be a comma list of {conv.__name__ if flag != '--shapes' else 'MxNxK'}, got {text!r}")

    shapes = parse("--shapes", args.shapes, lambda s: tuple(int(v) for v in s.lower().split("x")))
    fracs = parse("--fractions", args.fractions, float)
    groups = parse("--groups", args.groups, int)
    if not shapes or any(len(s) != 3 or min(s) < 1 or s[2] % 64 for s in shapes):
        ap.error(f"--shapes: each must be MxNxK, all >= 1 and K a multiple of 64, got {args.shapes!r}")
    if not fracs or any(not 0 <= f <= 1 for f in fracs):
        ap.error(f"--fractions must be numbers in [0, 1], got {args.fractions!r}")
    try:
        cfgs = {g: fp8_fix.FixConfig(group=g) for g in groups}
    except ValueError as e:
        ap.error(f"--groups: {e}")
    if not cfgs:
        ap.error("--groups needs at least one value")
    if args.quick:  # checked above like any other value, then replaced by the tiny case
        shapes, fracs = [(64, 48, 128)], [0.0, 0.1]
    out = out_dir(args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                           "fp8_fix-quick" if args.quick else "fp8_fix"))
    interpret = current_platform() not in ("cuda", "rocm")
    timing = dict(reps=3, min_program_s=0.0) if args.quick else dict(reps=5)
    rows, t0 = [], time.time()
    print("| M x N x K | flagged share | group | fix ms (incl. out copy) | out copy ms | fix kernel ms (profile) |")
    print("|---|---|---|---|---|---|")
    for m, n, k in shapes:
        n_sets = 2 if args.quick else n_sets_for(m * n * 2 + (m + n) * k * 33 // 32)
        for frac in fracs:
            sets = [(jnp.zeros((1, m, n), jnp.bfloat16), *operand(jax.random.key(7 * i + 1), 1, m, k, frac),
                     *operand(jax.random.key(7 * i + 2), 1, n, k, frac)) for i in range(n_sets)]
            copy = time_fn(lambda o, *_: o + jnp.bfloat16(0), sets, **timing)
            for g, cfg in cfgs.items():
                fn = lambda *a, cfg=cfg: fp8_fix.fix_flagged(*a, cfg=cfg, interpret=interpret)  # noqa: E731
                r = time_fn(fn, sets, **timing)
                row = {"shape": [m, n, k], "fraction": frac, "group": g, "median_s": r["median_s"],
                       "copy_s": copy["median_s"]}
                if args.profile:
                    kt = kernel_time(fn, sets)
                    row["kernel_s"] = sum(t for name, t in kt.get("kernels", {}).items() if "fix_flagged" in name) \
                        if "kernels" in kt else float("nan")
                rows.append(row)
                print(f"| {m}x{n}x{k} | {frac:g} | {g} | {r['median_s'] * 1e3:.4f} | {copy['median_s'] * 1e3:.4f} | "
                      f"{row.get('kernel_s', float('nan')) * 1e3:.4f} |", flush=True)
    write_json(os.path.join(out, "fp8_fix.json"), {"device": device_info(), "rows": rows, "interpret": interpret})
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for m, n, k in shapes:
        for g in cfgs:
            pts = [(r["fraction"], (r["median_s"] - r["copy_s"]) * 1e3) for r in rows
                   if r["shape"] == [m, n, k] and r["group"] == g]
            ax.plot([max(f, 1e-4) for f, _ in pts], [t for _, t in pts], "o-", label=f"{m}x{n}x{k} group {g}")
    ax.set_xscale("log")
    ax.set_xlabel("flagged share of lhs rows and of rhs rows (0 drawn at 1e-4)")
    ax.set_ylabel("fix_flagged ms minus out copy")
    ax.set_title(f"flagged-row recompute, {device_info()['device']}")
    ax.legend(fontsize=7)
    save_figure(fig, out, "fp8_fix.png")
    print(f"wrote {out}/fp8_fix.json and fp8_fix.png ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
