"""The FP8 path's MXFP4 -> E4M3 row encode (``kernels/fp8_encode.py``): tile variants timed.

Why: in the 8192^3 ``fp8-prepared`` GEMM the activation's encode takes 0.13-0.16 ms (~0.8 TB/s;
H200 session 6 profiles) beside a 0.667 ms FP8 GEMM: the limiter of issue 10's 8192^3 goal.
This script, on the device:

1. checks every variant bit for bit against ``jax_mxfp4.fp8.encode_rows`` (the jnp rule) on
   random rows with edge rows (a block outside the window, NaN and special scale bytes);
2. times each variant (benchmarks/common.time_fn, fair timing: operand sets > 3x the L2) at
   R x K = 1024 x 8192 and 8192 x 8192 (``--quick``: 64 x 256 in the interpreter), with a bf16
   copy of the output's bytes as the bandwidth yardstick. GB/s counts packed data + scale bytes
   read once and E4M3 bytes written.

Variants: the tile dispatch ran until session 9 (one row per program, whole-row steps, 8 warps,
``pairs16``: both E4M3 bytes of a packed byte stored as one uint16), the word-parallel ``swar``
kernel (4-8 codes per integer operation; ``fast_path``: per-chunk branches past the special-block
summary and the subnormal E4M3 cases) at several tiles, and two older tiles. Each on two operand
kinds (``BANDS``): "narrow" scales (6 binades, like a quantized activation) and "wide" (the whole
15-binade window: blocks with subnormal E4M3 results in every row).

Usage: python benchmarks/fp8_encode.py [--quick] [--shapes 1024x8192,8192x8192] [--out DIR] [--budget-s S]
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import device_info, n_sets_for, out_dir, time_fn, write_json  # noqa: E402
from jax_mxfp4.dispatch import current_platform  # noqa: E402
from jax_mxfp4.fp8 import encode_rows  # noqa: E402
from jax_mxfp4.kernels.fp8_encode import encode_rows_kernel  # noqa: E402

VARIANTS = [  # (name, keyword arguments of encode_rows_kernel); the first is the tile dispatch runs
    ("rows=1 chunk=256 warps=8 pairs16", dict(rows_per_program=1, chunk_blocks=256, num_warps=8, pairs16=True)),
    ("swar fast rows=1 chunk=256 warps=8", dict(rows_per_program=1, chunk_blocks=256, num_warps=8, swar=True,
                                                fast_path=True)),
    ("swar rows=1 chunk=256 warps=8", dict(rows_per_program=1, chunk_blocks=256, num_warps=8, swar=True)),
    ("swar fast rows=1 chunk=256 warps=4", dict(rows_per_program=1, chunk_blocks=256, num_warps=4, swar=True,
                                                fast_path=True)),
    ("swar fast rows=2 chunk=128 warps=8", dict(rows_per_program=2, chunk_blocks=128, num_warps=8, swar=True,
                                                fast_path=True)),
    ("swar fast rows=1 chunk=256 warps=16", dict(rows_per_program=1, chunk_blocks=256, num_warps=16, swar=True,
                                                 fast_path=True)),
    ("swar fast rows=8 chunk=32 warps=4", dict(rows_per_program=8, chunk_blocks=32, swar=True, fast_path=True)),
    ("default", {}),
    ("rows=8 chunk=32 warps=8 pairs16", dict(rows_per_program=8, chunk_blocks=32, num_warps=8, pairs16=True)),
]
BANDS = {  # scale bytes per operand: "narrow" like a quantized activation (6 binades), "wide" fills
    # the 15-binade window (blocks at d = -8..-6 in every row: the subnormal E4M3 cases)
    "narrow": (125, 131),
    "wide": (120, 134),
}


def operand(key, rows: int, k: int, band=BANDS["wide"]):
    """Random packed E2M1 bytes [rows, K/2] and scale bytes [rows, K/32] in ``band`` (bytes, lower
    inclusive, upper exclusive), with edge rows: 0 a block 20 binades below the rest (outside the window), 1 a NaN byte,
    2 byte 0x00 over nonzero codes, 3 byte 0xFE over the largest codes."""
    kd, ks = jax.random.split(key)
    data = jax.random.randint(kd, (rows, k // 2), 0, 256, jnp.int32).astype(jnp.uint8)
    sb = jax.random.randint(ks, (rows, k // 32), *band, jnp.int32).astype(jnp.uint8)
    if rows >= 4:
        sb = sb.at[0, -1].set(100).at[1, 0].set(255).at[2, 0].set(0).at[3, 0].set(254)
        data = data.at[2, :16].set(0x11).at[3, :16].set(0x77).at[0, -16:].set(0x33)
    return data, sb


def _bytes(v):
    """Host copy with float8 codes as their bytes (compared bit for bit)."""
    return np.asarray(jax.lax.bitcast_convert_type(v, jnp.uint8) if v.dtype == jnp.float8_e4m3fn else v)


def plot(rows, out):
    """Bar chart of GB/s per variant and shape (``fp8_encode.png``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.common import save_figure

    ok = [x for x in rows if x["status"] == "ok"]
    shapes = sorted({(*x["shape"], x.get("band", "")) for x in ok})
    names = list(dict.fromkeys(x["variant"] for x in ok))
    fig, ax = plt.subplots(figsize=(10, 4))
    w = 0.8 / max(1, len(shapes))
    for i, sh in enumerate(shapes):
        vals = [next((x["gb_per_s"] for x in ok if (*x["shape"], x.get("band", "")) == sh and x["variant"] == n), 0)
                for n in names]
        ax.bar([j + i * w for j in range(len(names))], vals, w, label=f"{sh[0]}x{sh[1]} {sh[2]}")
    ax.set_xticks([j + w * (len(shapes) - 1) / 2 for j in range(len(names))], names, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("GB/s (bytes read once + written)")
    ax.set_title("MXFP4 -> E4M3 row encode, tile variants")
    ax.legend()
    return save_figure(fig, out, "fp8_encode.png")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="64 x 256 in the Pallas interpreter (CPU CI)")
    ap.add_argument("--shapes", default="1024x8192,8192x8192", help="comma list of RxK")
    ap.add_argument("--out", default=None)
    ap.add_argument("--budget-s", type=float, default=240.0, help="seconds after which no new timing starts")
    args = ap.parse_args(argv)
    if not (args.budget_s > 0 and math.isfinite(args.budget_s)):
        ap.error(f"--budget-s must be a positive number of seconds, got {args.budget_s}")
    try:
        shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes.split(",") if s]
    except ValueError:
        ap.error(f"--shapes must be a comma list of RxK, got {args.shapes!r}")
    if args.quick:
        shapes = [(64, 256)]
    if not shapes or any(len(s) != 2 or s[0] < 1 or s[1] < 32 or s[1] % 32 for s in shapes):
        ap.error(f"--shapes: each must be RxK with R >= 1 and K a positive multiple of 32, got {args.shapes!r}")
    here = os.path.dirname(os.path.abspath(__file__))
    d = out_dir(args.out or os.path.join(here, "results", "fp8_encode-quick" if args.quick else "fp8_encode"))
    interpret = current_platform() not in ("cuda", "rocm")
    timing = dict(reps=3, min_program_s=0.0) if args.quick else dict(reps=5)
    rows_out, t0 = [], time.time()
    variants = VARIANTS[:2] if args.quick else VARIANTS
    for (r, k), band in itertools.product(shapes, ("narrow",) if args.quick else tuple(BANDS)):
        base = operand(jax.random.key(r + k), r, k, BANDS[band])
        want = jax.jit(encode_rows)(*base)
        moved = r * (k // 2 + k // 32 + k)
        n = 2 if args.quick else n_sets_for(moved)
        sets = [operand(jax.random.key(1000 + i), r, k, BANDS[band]) for i in range(n)]
        jax.block_until_ready((want, sets))

        def record(name, status, **kw):
            rows_out.append({"shape": [r, k], "band": band, "variant": name, "status": status, **kw})
            ms = kw.get("median_s", float("nan")) * 1e3
            print(f"[{time.time() - t0:6.1f}s] {r}x{k} {band:6s} {name:38s} {ms:8.4f} ms "
                  f"{kw.get('gb_per_s', float('nan')):6.0f} GB/s {status}{' ' + kw['reason'] if 'reason' in kw else ''}",
                  flush=True)

        if time.time() - t0 < args.budget_s and band == "narrow":  # reads K/2 bytes per row, writes K
            c = time_fn(lambda d, s: jnp.broadcast_to(d[..., None], (r, k // 2, 2)).reshape(r, k) + jnp.uint8(1),
                        sets, **timing)
            record("copy (bytes read, each written twice + 1)", "ok", median_s=c["median_s"],
                   gb_per_s=1.5 * r * k / c["median_s"] / 1e9)
        for name, kw in variants:
            if time.time() - t0 > args.budget_s:
                record(name, "skipped", reason="budget")
                continue
            fn = lambda d, s, kw=kw: encode_rows_kernel(d, s, interpret=interpret, **kw)  # noqa: E731
            try:
                got = jax.jit(fn)(*base)
                same = all(np.array_equal(_bytes(g), _bytes(w)) for g, w in zip(got, want))
                if not same:
                    record(name, "WRONG", reason="differs from encode_rows")
                    continue
                t = time_fn(fn, sets, **timing)
                record(name, "ok", median_s=t["median_s"], gb_per_s=moved / t["median_s"] / 1e9, calls=t["calls"])
            except Exception as e:  # record, keep going
                record(name, "error", reason=f"{type(e).__name__}: {str(e)[:200]}")
    res = {"info": device_info(), "quick": args.quick, "method": __doc__.split("Usage")[0].strip(), "rows": rows_out}
    write_json(os.path.join(d, "fp8_encode.json"), res)
    plot(rows_out, d)
    print(f"wrote {d}/fp8_encode.json and fp8_encode.png")
    return 1 if any(x["status"] in ("WRONG", "error") for x in rows_out) else 0


if __name__ == "__main__":
    sys.exit(main())
