"""The FP8 GEMM's power-of-two rescale: XLA's fusion of ``rescale`` against the Pallas kernel.

Backend "fp8" multiplies each FP8 GEMM output by 2^(e_row + e_col) (NaN rows / columns poisoned)
and rounds it once (:func:`jax_mxfp4.backends.fp8.rescale`); on CUDA :func:`~jax_mxfp4.backends.
fp8.rescale_on` runs it as one Pallas kernel (:mod:`jax_mxfp4.kernels.rescale`) unless
``JAX_MXFP4_RESCALE_KERNEL=0``. This script, on the device:

1. checks the kernel bit for bit against XLA's ``rescale`` (the rule) on random data and on edge
   data (exponent sums at both ends of [-266, 242]: overflow to Inf and underflow to zero,
   float32 and bfloat16 subnormal results, NaN rows and columns, zeros and -0.0, Inf/NaN in the
   accumulator), for accumulator/output dtypes bf16->bf16 (training), f32->f32, f32->bf16 and
   ragged shapes;
2. times, at B x M x N = 1 x 8192 x 8192 (``--quick``: 1 x 256 x 384, interpreter off CUDA):
   XLA's fusion, the kernel at a few tiles, and a bf16 copy (x + 1) of the same bytes as the
   bandwidth yardstick (benchmarks/common.time_fn, fair timing: operand sets > 3x the L2).
   GB/s counts the accumulator read and the output written (the exponent vectors are negligible).

Usage: python benchmarks/rescale.py [--quick] [--out DIR] [--budget-s S]
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

from benchmarks.common import device_info, n_sets_for, out_dir, time_fn, write_json  # noqa: E402
from jax_mxfp4.backends.fp8 import rescale  # noqa: E402
from jax_mxfp4.dispatch import current_platform  # noqa: E402
from jax_mxfp4.kernels import rescale as rk  # noqa: E402

TILES = [(32, 256, 8), (16, 256, 4), (64, 256, 8), (32, 512, 8), (8, 1024, 8), (128, 128, 8)]
"""(bm, bn, num_warps) timed; the first is DEFAULT_TILE (checked below)."""


def random_case(key, b, m, n, acc_dtype, e_range=(-20, 20)):
    """FP8-GEMM-like accumulator (normal, spread over 2^-8 .. 2^8 x N(0,1)) and exponents in
    ``e_range`` per row / column, a few NaN rows and columns."""
    k = jax.random.split(key, 6)
    acc = jax.random.normal(k[0], (b, m, n), jnp.float32) * 2.0 ** jax.random.randint(k[1], (b, m, n), -8, 9)
    el = jax.random.randint(k[2], (b, m), *e_range, dtype=jnp.int32)
    er = jax.random.randint(k[3], (b, n), *e_range, dtype=jnp.int32)
    nl = jax.random.uniform(k[4], (b, m)) < 0.01
    nr = jax.random.uniform(k[5], (b, n)) < 0.01
    return acc.astype(acc_dtype), el, er, nl, nr


def edge_case(b, m, n, acc_dtype, seed=0):
    """Rows / columns chosen to hit every edge of the rule (module docstring), the rest random.

    Row exponents sweep [-133, 121] (the range of b_max - 133 for E8M0 bytes 0..254) and column
    exponents too, so sums cover [-266, 242]; accumulator entries include 0, -0.0, +-Inf, NaN, the
    smallest nonzero E4M3 product 2^-18 and large sums; where the sum puts 2^-18..2^8 into
    [2^-149, 2^-126) the results are float32 (and bf16) subnormals."""
    rng = np.random.default_rng(seed)
    acc = rng.standard_normal((b, m, n)) * 2.0 ** rng.integers(-18, 20, (b, m, n))
    flat = acc.reshape(-1)
    idx = rng.choice(flat.size, size=min(flat.size, 64), replace=False)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 2.0**-18, -(2.0**-18), 3 * 2.0**-10, 1.5, 2.0**30])
    flat[idx] = specials[np.arange(idx.size) % specials.size]
    el = np.linspace(-133, 121, m).round().astype(np.int32)[None].repeat(b, 0)
    er = rng.integers(-133, 122, (b, n)).astype(np.int32)
    er[:, : min(n, 8)] = [-133, -117, -100, -20, 0, 60, 110, 121][: min(n, 8)]
    nl = np.zeros((b, m), bool)
    nl[:, m // 3] = True
    nr = np.zeros((b, n), bool)
    nr[:, n // 2] = True
    return (jnp.asarray(acc, jnp.float32).astype(acc_dtype), jnp.asarray(el), jnp.asarray(er), jnp.asarray(nl),
            jnp.asarray(nr))


def exact_subnormals(acc, el, er):
    """How many exact results acc x 2^(el + er) (float64 ldexp) are float32 subnormals: the data
    reaches the range where an implementation flushing denormals would differ (XLA:CPU does)."""
    e = np.asarray(el)[:, :, None] + np.asarray(er)[:, None, :]
    with np.errstate(over="ignore"):
        v = np.abs(np.ldexp(np.asarray(acc).astype(np.float64), e))
    return int(((v > 0) & (v < 2.0**-126) & (v >= 2.0**-150)).sum())


def bits(x):
    return np.asarray(x).view({2: np.uint16, 4: np.uint32}[np.dtype(x.dtype).itemsize])


def compare(got, want):
    """(bit_identical, n_differing, n_nan_positions_differing, n_nan_bits_differing)."""
    g, w = np.asarray(got), np.asarray(want)
    nan_g, nan_w = np.isnan(g.astype(np.float32)), np.isnan(w.astype(np.float32))
    same_bits = bits(got) == bits(want)
    return (bool(same_bits.all()), int((~same_bits & ~(nan_g & nan_w)).sum()), int((nan_g != nan_w).sum()),
            int((~same_bits & nan_g & nan_w).sum()))


CHECKS = [  # (name, family, (b, m, n), acc dtype, out dtype)
    ("random bf16->bf16 8192^2", "random", (1, 8192, 8192), jnp.bfloat16, jnp.bfloat16),
    ("edge bf16->bf16", "edge", (1, 512, 1024), jnp.bfloat16, jnp.bfloat16),
    ("edge f32->f32", "edge", (1, 512, 1024), jnp.float32, jnp.float32),
    ("edge f32->bf16", "edge", (1, 512, 1024), jnp.float32, jnp.bfloat16),
    ("edge f32->f16", "edge", (1, 512, 1024), jnp.float32, jnp.float16),
    ("edge ragged B=3 bf16->bf16", "edge", (3, 100, 200), jnp.bfloat16, jnp.bfloat16),
    ("random full exponent range f32->f32", "random-wide", (2, 256, 384), jnp.float32, jnp.float32),
]


def run_checks(quick, interpret, log):
    out = []
    for name, family, shape, adt, odt in CHECKS:
        if quick:
            shape = (shape[0], min(shape[1], 64), min(shape[2], 96))
        try:
            if family == "edge":
                args = edge_case(*shape, adt)
            else:
                wide = (-133, 122) if family == "random-wide" else (-20, 20)
                args = random_case(jax.random.key(11), *shape, adt, wide)
            want = jax.jit(rescale, static_argnums=5)(*args, odt)
            n_sub_exact = exact_subnormals(*args[:3]) if np.prod(shape) <= 2**22 else None
            for bm, bn, nw in TILES[:2] if quick else TILES[:3]:
                got = rk.rescale_kernel(*args, odt, block=(bm, bn), num_warps=nw, interpret=interpret)
                ident, ndiff, nan_pos, nan_bits = compare(got, want)
                r = {"check": name, "shape": list(shape), "tile": [bm, bn, nw], "bit_identical": ident,
                     "n_diff_non_nan": ndiff, "n_nan_position_diff": nan_pos, "n_nan_bits_diff": nan_bits,
                     "n_nan": int(np.isnan(np.asarray(want).astype(np.float32)).sum()),
                     "n_inf": int(np.isinf(np.asarray(want).astype(np.float32)).sum()),
                     "n_subnormal": int(((a := np.abs(np.asarray(want).astype(np.float32))) < 2.0**-126).sum()
                                        - (a == 0).sum()),
                     "n_subnormal_exact": n_sub_exact}
                out.append(r)
                log(f"check {name:36s} tile {bm}x{bn}/{nw}w: bit-identical {ident} (non-NaN diffs {ndiff}, "
                    f"NaN position diffs {nan_pos}, NaN payload diffs {nan_bits}; {r['n_nan']} NaN, {r['n_inf']} Inf, "
                    f"{r['n_subnormal']} subnormal, {n_sub_exact} exact results subnormal)")
        except Exception as e:  # record, keep going
            out.append({"check": name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            log(f"check {name}: ERROR {out[-1]['error']}")
    return out


def step_check(quick, log):
    """The linear layer's training step (benchmarks/train_step.py, Recipe(), an rbg key; T = K = N
    = 2048, --quick 64) with the rescale kernel and with XLA's fusion (JAX_MXFP4_RESCALE_KERNEL=0):
    Y, dX and dW compared bit for bit. Only on CUDA does rescale_on take the kernel (3 in the step,
    counted in its jaxpr); elsewhere the comparison holds trivially (0 kernels either way)."""
    from benchmarks import train_step as ts
    from jax_mxfp4.backends import fp8 as fp8_backend

    size = 64 if quick else 2048
    s = dict(t=size, k=size, n=size)
    args = ts.make_set("linear", s, seed=5)
    outs = {}
    try:
        for switch in ("1", "0"):
            with ts._env(fp8_backend.RESCALE_KERNEL_ENV, switch):
                fp8_backend.fp8_gemm.clear_cache()  # the switch is read when fp8_gemm is traced
                step = ts.make_step(ts.layer_fns("linear", ts.VARIANTS["mxfp4-rbg-key"], "rbg"))
                jaxpr = str(jax.make_jaxpr(step)(*args))
                outs[switch] = (jax.jit(step)(*args), jaxpr.count("name=mxfp4_fp8_rescale"))
        fp8_backend.fp8_gemm.clear_cache()
        (got, n_kernel), (want, n_xla) = outs["1"], outs["0"]
        same = [bool(np.array_equal(bits(g), bits(w))) for g, w in zip(got, want)]
        r = {"check": f"training step T=K=N={size} (Y, dX, dW)", "bit_identical": all(same), "per_output": same,
             "rescale_kernels_in_step": [n_kernel, n_xla]}
    except Exception as e:  # record, keep going
        r = {"check": f"training step T=K=N={size}", "error": f"{type(e).__name__}: {str(e)[:300]}"}
    log(f"check {r['check']}: {r.get('per_output', r.get('error'))} "
        f"(rescale kernels in the step with the switch on / off: {r.get('rescale_kernels_in_step')})")
    return r


def run_timing(quick, interpret, log, budget_s):
    b, m, n = (1, 256, 384) if quick else (1, 8192, 8192)
    timing = dict(reps=3, min_program_s=0.0) if quick else dict(reps=5)
    nbytes = b * m * n * 2
    sets = [random_case(jax.random.key(i), b, m, n, jnp.bfloat16) for i in range(n_sets_for(nbytes))]
    jax.block_until_ready(sets)
    moved = 2 * nbytes  # bf16 accumulator read + bf16 output written
    cases = [("copy bf16 (acc + 1)", lambda acc, *_: acc + jnp.bfloat16(1)),
             ("XLA fusion of rescale (JAX_MXFP4_RESCALE_KERNEL=0)", lambda *a: rescale(*a, jnp.bfloat16))]
    for bm, bn, nw in (TILES[:2] if quick else TILES):
        cases.append((f"kernel tile {bm}x{bn} warps {nw}" + (" (default)" if (bm, bn, nw) == rk.DEFAULT_TILE else ""),
                      lambda *a, t=(bm, bn, nw): rk.rescale_kernel(*a, jnp.bfloat16, block=t[:2], num_warps=t[2],
                                                                   interpret=interpret)))
    rows, t0 = [], time.time()
    for name, fn in cases:
        if time.time() - t0 > budget_s:
            rows.append({"case": name, "status": "skipped", "reason": f"time budget {budget_s} s spent"})
            log(f"{name}: skipped (budget)")
            continue
        try:
            r = time_fn(fn, sets, **timing)
            r.update(status="ok", gb_per_s=moved / r["median_s"] / 1e9)
        except Exception as e:  # record, keep going
            r = {"status": "error", "reason": f"{type(e).__name__}: {str(e)[:300]}"}
        rows.append({"case": name, "shape": [b, m, n], **r})
        log(f"{name:52s} {r.get('median_s', float('nan')) * 1e3:8.4f} ms {r.get('gb_per_s', float('nan')):7.0f} GB/s "
            f"{r['status']} {r.get('reason', '')}")
    return rows


def markdown(result):
    info = result["info"]
    lines = [f"# FP8 rescale: {info['device']} ({info['platform']}), jax {info['jax']}, {info['date_utc']} UTC", "",
             "Bit-identity of the Pallas kernel against XLA's `rescale` (the rule), on the device:", "",
             "| check | shape | tile | bit-identical | non-NaN diffs | NaN payload diffs |", "|---|---|---|---|---|---|"]
    for c in result["checks"]:
        if "error" in c:
            lines.append(f"| {c['check']} | | | ERROR {c['error'][:80]} | | |")
        elif "tile" not in c:
            lines.append(f"| {c['check']} | | default | {c['bit_identical']} ({c['per_output']}) | | |")
        else:
            lines.append(f"| {c['check']} | {'x'.join(map(str, c['shape']))} | {c['tile'][0]}x{c['tile'][1]}/"
                         f"{c['tile'][2]}w | {c['bit_identical']} | {c['n_diff_non_nan']} | {c['n_nan_bits_diff']} |")
    lines += ["", "Timing (bf16 accumulator -> bf16; GB/s = 4 B per element / time):", "",
              "| case | B x M x N | ms | GB/s |", "|---|---|---|---|"]
    for r in result["timing"]:
        if r["status"] != "ok":
            lines.append(f"| {r['case']} | | {r['status']}: {r.get('reason', '')[:80]} | |")
        else:
            lines.append(f"| {r['case']} | {'x'.join(map(str, r['shape']))} | {r['median_s'] * 1e3:.4f} | "
                         f"{r['gb_per_s']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU CI; the kernel in the interpreter)")
    ap.add_argument("--out", default=None, help="output folder (default benchmarks/results/rescale[-quick])")
    ap.add_argument("--budget-s", type=float, default=90.0, help="stop starting new timed cases after this")
    args = ap.parse_args(argv)
    if not args.budget_s > 0:  # nan never stopped, <= 0 skipped every timed case
        ap.error(f"--budget-s must be a positive number of seconds, got {args.budget_s}")
    here = os.path.dirname(os.path.abspath(__file__))
    out = out_dir(args.out or os.path.join(here, "results", "rescale-quick" if args.quick else "rescale"))
    interpret = current_platform() != "cuda"
    t0 = time.time()

    def log(msg):
        print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)

    result = {"info": device_info(), "quick": args.quick, "interpret": interpret, "default_tile": rk.DEFAULT_TILE,
              "method": __doc__.split("Usage")[0].strip()}
    result["checks"] = run_checks(args.quick, interpret, log)
    result["checks"].append(step_check(args.quick, log))
    write_json(os.path.join(out, "rescale.json"), result)
    result["timing"] = run_timing(args.quick, interpret, log, args.budget_s)
    write_json(os.path.join(out, "rescale.json"), result)
    md = markdown(result)
    with open(os.path.join(out, "rescale.md"), "w") as f:
        f.write(md)
    print(md)
    ok = all(c.get("bit_identical") for c in result["checks"]) and all(r["status"] in ("ok", "skipped")
                                                                          for r in result["timing"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
