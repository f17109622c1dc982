"""Fused random-Hadamard rotation + MXFP4 quantization on the GPU: time and bit-exactness.

Times, on one input (bf16 16384x8192 by default), for Hadamard blocks 32 and 256 and both
roundings (stochastic: uniforms generated in the kernel from the key):
  * ``fused``     - one Pallas pass: load, rotate in registers, quantize
                    (``quantize_impl(x, key, hadamard=(block, seed))``);
  * ``two-pass``  - today's route: the exact jnp transform (``random_hadamard_transform``, float32
                    out) then the Pallas quantizer on its output;
  * ``quantize``  - the Pallas quantizer alone, no rotation (the floor for ``fused``);
  * ``copy``      - XLA elementwise ``x * s`` on the same input (bandwidth reference).
GB/s counts useful bytes: the input read once + packed data + scale bytes written once.

Bit-exactness on the device, before timing: ``fused`` against ``two-pass`` and against the pure
jnp reference (``_quantize_impl`` of the jnp transform), every scale mode (float32 input: "even" and
"rceil"), both roundings, both blocks, on fresh random rows plus outlier rows, -0.0, NaN/Inf and rows near the float32 subnormal
boundary (where a flush-to-zero in either compiler would show).

Fair timing: benchmarks/common.time_fn (calls grown until one program takes >= 20 ms; every call
gets distinct operands). Time budgets (``--check-s`` 50 s, ``--budget-s`` 150 s) skip the cases
left, so a run takes about 3.5 minutes at most.

Usage (from the repository root):
  python benchmarks/hadamard_quantize.py --out DIR            (GPU)
  python benchmarks/hadamard_quantize.py --quick --out DIR    (CPU, Pallas interpreter, tiny shape)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import device_info, out_dir, time_fn, write_json  # noqa: E402
from jax_mxfp4.hadamard import random_hadamard_transform  # noqa: E402
from jax_mxfp4.kernels.quantize import quantize_impl  # noqa: E402
from jax_mxfp4.mx_format import SCALE_MODES  # noqa: E402
from jax_mxfp4.quantize import _quantize_impl  # noqa: E402

SEED = 12345
BLOCKS = (32, 256)
ROUNDINGS = ("nearest", "stochastic")


def check_rows(k, rng):
    """float32 [24, k]: normal rows, outlier rows, -0.0, NaN/Inf, values near 2^-126."""
    x = rng.standard_normal((24, k))
    x[0] = -0.0
    x[1] = 0.0
    x[2, ::7] *= 1e4  # outliers
    x[3, 5::64] = 3e38
    x[4, ::97] = np.nan
    x[5, 3::101] = np.inf
    x[5, 4::101] = -np.inf
    x[6] = rng.uniform(1.0, 2.0, k) * 2.0**-126  # sums/differences of these are subnormal
    x[7] = np.where(rng.random(k) < 0.5, -1, 1) * rng.uniform(1.0, 1.01, k) * 2.0**-125
    x[8] = rng.standard_normal(k) * 2.0**-120
    x[9, ::2] = -0.0
    return x.astype(np.float32)


def _bits(a):
    return np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8))


def check_cases():
    """(dtype, block, rounding, scale mode), most informative first: every block x rounding with
    bfloat16 input, then float32, then the remaining scale modes."""
    first, rest = [], []
    for dtype in (jnp.bfloat16, jnp.float32):
        for i, (block, rounding) in enumerate((b, r) for b in BLOCKS for r in ROUNDINGS):
            modes = SCALE_MODES if dtype == jnp.bfloat16 else ("even", "rceil")
            lead = modes[(i + (dtype == jnp.float32)) % len(modes)]
            first.append((dtype, block, rounding, lead))
            rest += [(dtype, block, rounding, m) for m in modes if m != lead]
    return first + rest


def check(k, interpret, rng, deadline):
    rows = []
    xs = {d: jnp.asarray(check_rows(k, rng)).astype(d) for d in (jnp.bfloat16, jnp.float32)}
    for dtype, block, rounding, mode in check_cases():
        name = jnp.dtype(dtype).name
        if time.perf_counter() > deadline:
            rows.append({"dtype": name, "block": block, "rounding": rounding, "mode": mode, "skipped": "budget"})
            continue
        x = xs[dtype]
        key = jax.random.key(int(rng.integers(1 << 30)))
        kw = dict(axis=1, scale_mode=mode, rounding=rounding)
        try:
            got = quantize_impl(x, key, hadamard=(block, SEED), interpret=interpret, **kw)
            xr = random_hadamard_transform(x, 1, SEED, block)
            two = quantize_impl(xr, key, interpret=interpret, **kw)
            ref = _quantize_impl(xr, key, **kw)
            bad = {}
            for what, w in (("vs_two_pass", two), ("vs_jnp", ref)):
                diff = np.any(_bits(got[1]) != _bits(w[1]), axis=-1) | np.any(_bits(got[0]) != _bits(w[0]), axis=-1)
                bad[what] = int(np.sum(_bits(got[0]) != _bits(w[0])) + np.sum(_bits(got[1]) != _bits(w[1])))
                bad[what + "_rows"] = np.flatnonzero(diff).tolist()[:12]
            row = {"dtype": name, "block": block, "rounding": rounding, "mode": mode, **bad,
                   "ok": not (bad["vs_two_pass"] or bad["vs_jnp"])}
        except Exception as e:  # keep going: report per case
            row = {"dtype": name, "block": block, "rounding": rounding, "mode": mode, "ok": False,
                   "error": repr(e)[:400]}
        rows.append(row)
        print(f"check {name:8s} block {block:3d} {rounding:10s} {mode:5s}: "
              f"{'OK' if row['ok'] else 'MISMATCH ' + str(row)}", flush=True)
    return rows


def bench(shape, dtype, interpret, budget_s, rng, save=lambda rows: None, max_calls=64):
    t_start = time.perf_counter()
    r, k = shape
    x = jax.random.normal(jax.random.key(int(rng.integers(1 << 30))), shape, jnp.float32).astype(dtype)
    useful = x.size * x.dtype.itemsize + x.size // 2 + x.size // 32
    kd = jax.random.key_data(jax.random.key(1))
    res = []
    cap = 8 if interpret else max_calls  # calls per program: each nearest-rounding call copies x

    def add(name, block, rounding, fn, sets, nbytes):
        if res and time.perf_counter() - t_start > budget_s:  # the first case always runs
            print(f"skip {name} block {block} {rounding}: time budget spent", flush=True)
            res.append({"case": name, "block": block, "rounding": rounding, "skipped": "budget"})
            return
        try:
            t = time_fn(fn, sets, max_calls=cap, min_program_s=0.0 if interpret else 0.02)
            row = {"case": name, "block": block, "rounding": rounding, "us": t["median_s"] * 1e6,
                   "gbs": nbytes / t["median_s"] / 1e9, "calls": t["calls"]}
        except Exception as e:
            traceback.print_exc()
            row = {"case": name, "block": block, "rounding": rounding, "error": repr(e)[:400]}
        res.append(row)
        save(res)  # a run stopped from outside keeps the rows so far
        print(f"{name:9s} block {str(block):4s} {rounding:10s} "
              + (f"{row['us']:9.1f} us {row['gbs']:7.1f} GB/s" if "us" in row else row.get("error", "")), flush=True)

    s = jnp.ones((1,), dtype)
    for rounding in ROUNDINGS:  # most informative first: a time budget cuts the tail
        def q(x, kd, rounding=rounding, h=None, rotate=None):
            if rotate is not None:
                x = random_hadamard_transform(x, 1, SEED, rotate)
            return quantize_impl(x, jax.random.wrap_key_data(kd), axis=1, scale_mode="even", rounding=rounding,
                                 interpret=interpret, hadamard=h)
        # nearest ignores the key: give each call its own x copy instead (time_fn copies the smallest leaf)
        sets = [(x, kd)] if rounding == "stochastic" else [(x,)]
        wrap = (lambda f: f) if rounding == "stochastic" else (lambda f: (lambda x: f(x, kd)))
        for block in BLOCKS[::-1]:
            add("fused", block, rounding, wrap(lambda x, kd, b=block: q(x, kd, h=(b, SEED))), sets, useful)
            add("two-pass", block, rounding, wrap(lambda x, kd, b=block: q(x, kd, rotate=b)), sets, useful)
            if block == BLOCKS[-1]:
                add("quantize", "-", rounding, wrap(q), sets, useful)
        if rounding == "nearest":
            add("copy", "-", "-", lambda x, s: x * s[0], [(x, s)], 2 * x.size * x.dtype.itemsize)
    return res


def markdown(res):
    by = {(r["case"], r["block"], r["rounding"]): r for r in res}
    copy = by.get(("copy", "-", "-"), {}).get("us")
    lines = ["| rounding | block | quantize alone (us) | fused rotate+quantize (us) | two-pass (us) | fused GB/s |"
             " fused / quantize | two-pass / fused |", "|---|---|---|---|---|---|---|---|"]
    for rounding in ROUNDINGS:
        qa = by.get(("quantize", "-", rounding), {}).get("us")
        for block in BLOCKS:
            f = by.get(("fused", block, rounding), {})
            t = by.get(("two-pass", block, rounding), {}).get("us")
            fu = f.get("us")

            def fmt(v, spec="{:.1f}"):
                return spec.format(v) if v else "-"
            lines.append(f"| {rounding} | {block} | {fmt(qa)} | {fmt(fu)} | {fmt(t)} | {fmt(f.get('gbs'))} | "
                         f"{fmt(fu / qa if fu and qa else None, '{:.2f}')} | {fmt(t / fu if t and fu else None, '{:.2f}')} |")
    if copy:
        lines.append(f"\ncopy (x * s, read + write): {copy:.1f} us")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shape in the Pallas interpreter (CPU)")
    ap.add_argument("--no-check", action="store_true", help="skip the on-device bit-exactness check")
    ap.add_argument("--check-s", type=float, default=50.0, help="skip bit-exactness cases after this many seconds")
    ap.add_argument("--budget-s", type=float, default=150.0, help="skip timing cases after this many seconds")
    ap.add_argument("--max-calls", type=int, default=64, help="cap on calls per timed program (fewer: faster "
                    "compiles, more launch overhead per call)")
    ap.add_argument("--out", default=None, help="output folder (default benchmarks/results/hadamard_quantize)")
    a = ap.parse_args(argv)
    interpret = a.quick or jax.default_backend() == "cpu"
    shape = (64, 512) if a.quick else (16384, 8192)
    out = out_dir(a.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                        "hadamard_quantize" + ("-quick" if a.quick else "")))
    rng = np.random.default_rng()
    info = device_info()
    print(info, flush=True)
    result = {"info": info, "shape": shape, "dtype": "bfloat16", "seed": SEED}
    if not a.no_check:
        result["check"] = check(512 if a.quick else 8192, interpret, rng, time.perf_counter() + a.check_s)
        done = [r for r in result["check"] if "skipped" not in r]
        result["check_ok"] = bool(done) and all(r["ok"] for r in done)
        result["check_cases"] = f"{len(done)} of {len(result['check'])} (the rest: check time budget)"
        print("check cases run:", result["check_cases"], flush=True)
        print("bit-exact:", result["check_ok"], flush=True)
        write_json(os.path.join(out, "hadamard_quantize.json"), result)
    def save(rows):
        write_json(os.path.join(out, "hadamard_quantize.json"), {**result, "timing": rows})

    result["timing"] = bench(shape, jnp.bfloat16, interpret, a.budget_s, rng, save, a.max_calls)
    result["table"] = markdown(result["timing"])
    print(result["table"])
    write_json(os.path.join(out, "hadamard_quantize.json"), result)
    with open(os.path.join(out, "hadamard_quantize.md"), "w") as f:
        f.write(result["table"] + "\n")


if __name__ == "__main__":
    main()
