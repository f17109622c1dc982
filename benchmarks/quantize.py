"""MXFP4 quantization benchmark: GB/s of the fused Pallas quantizer (every scale mode x rounding x
input dtype) and of the reference jnp quantizer, against the same run's copy bandwidth, plus a
bit-exactness check of fused against reference on the device.

Fair timing (``fair_time`` = ``benchmarks.common.time_fn``, the method of every benchmark here):
one jitted program runs the operation on distinct input copies (together > 3x the 60 MB L2, so no
call finds its input in L2; every call's operands distinct, so XLA cannot merge calls), calls
grown until one program takes >= 20 ms; time per call = program time / calls, median over
several programs. Stochastic rounding draws its uniforms in every call, as in real use.

Bytes counted per quantization: input read once + packed data + scale bytes written once
("useful bytes"; stochastic rounding's float32 uniforms are extra traffic, not counted, except
in the "kernel only" row that takes them as an input and counts them; threefry keys have the
same uniforms generated inside the kernel, no extra traffic, and "rbg key" rows have them drawn
by XLA and read by the kernel). Copy: XLA elementwise
``x * 1.0001`` on the same input (bytes read + written).

Output: quantize.json, quantize.md (the table, also printed) and quantize_bandwidth.png in --out
(default bench_out/quantize, bench_out/quantize-quick with --quick).

``--strided``: the training passes' operands quantized along the token axis (axis 0 of a [T, K]
input: X and dY in wgrad; a [K, N] kernel along K in fprop), the library's route (the strided-axis
kernel, kernels/quantize_columns.py, reading x in place) beside the route it replaced (XLA's
transpose, then the row kernel; for the FP8 operand of dY: XLA's transpose, then the fused
quantize-to-FP8 kernel), each pair checked bit for bit in the run, then a few strided-kernel tiles
(the best is printed as a ColumnsConfig line).

Usage (from the repository root):
  python benchmarks/quantize.py [--quick] [--no-check] [--dtypes bfloat16,float32] [--modes ...] [--out DIR]
  python benchmarks/quantize.py --sweep --no-check   (tile configs; prints the best per dtype)
  python benchmarks/quantize.py --strided [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

from benchmarks.common import (  # noqa: E402
    default_out, device_info, n_sets_for, out_dir, save_figure, time_fn, write_json)
from jax_mxfp4 import dispatch  # noqa: E402
from jax_mxfp4.kernels.quantize_kernel import QuantizeConfig, default_config, quantize_2d, quantize_impl  # noqa: E402
from jax_mxfp4.kernels.quantize_columns import ColumnsConfig, quantize_columns_3d  # noqa: E402
from jax_mxfp4.mx_format import SCALE_MODES  # noqa: E402
from jax_mxfp4.quantize import _quantize_impl  # noqa: E402

FULL_SHAPE = (16384, 8192)
QUICK_SHAPE = (64, 256)
ROUNDINGS = ("nearest", "stochastic")
SWEEP = [QuantizeConfig(r, c, w) for (r, c, w) in [
    (1, 1024, 4), (1, 2048, 4), (1, 4096, 8), (2, 512, 2), (2, 512, 4), (2, 1024, 4), (2, 2048, 8),
    (4, 256, 2), (4, 256, 4), (4, 512, 4), (4, 1024, 8), (4, 2048, 8), (8, 256, 4), (8, 512, 4),
    (8, 512, 8), (8, 1024, 8), (16, 256, 8), (16, 512, 8), (16, 1024, 8), (32, 128, 4), (32, 256, 8)]]


def _nbytes(tree):
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree))


def fair_time(fn, make_inputs, *, programs=5, min_program_s=0.02, max_calls=512, max_sets=8):
    """Seconds per call of ``fn(*make_inputs(i))`` by :func:`benchmarks.common.time_fn` (the one
    fair-timing method of the benchmarks): ``n_sets_for`` distinct input copies (together > 3x
    the L2, at most ``max_sets``), calls grown until one program takes >= ``min_program_s``, median of ``programs``.

    ``make_inputs``: ``i -> tuple of arrays``, the i-th distinct input copy (cache them in the
    caller to share copies between measurements). Returns time_fn's dict ({"median_s", "min_s",
    "calls", ...}).
    """
    first = make_inputs(0)
    sets = [first] + [make_inputs(i) for i in range(1, n_sets_for(_nbytes(first), max_sets))]
    return time_fn(fn, sets, reps=programs, min_program_s=min_program_s, max_calls=max_calls)


# ------------------------------------------------------------------------------- inputs


def _block_spread(key, shape, dtype):
    """Normal data with one random power-of-two magnitude per 32-block (2^-135 .. 2^120)."""
    k1, k2 = jax.random.split(key)
    r, k = shape
    x = jax.random.normal(k1, (r, k // 32, 32), jnp.float32)
    lo, hi = (-30, 14) if dtype == jnp.float16 else (-135, 120)
    e = jax.random.randint(k2, (r, k // 32, 1), lo, hi).astype(jnp.float32)
    return (x * jnp.exp2(e)).reshape(shape).astype(dtype)


def _special_rows(k, dtype):
    """16 rows of width k: zeros, -0.0, NaN/Inf blocks, subnormals (and the largest one in a block
    whose scale is 2^-127), values near the dtype's max, every E2M1 midpoint and grid point +-."""
    import ml_dtypes

    fi = ml_dtypes.finfo(jnp.dtype(dtype))
    big, tiny = float(fi.max), float(fi.smallest_subnormal)
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0])
    x = np.zeros((16, k))
    x[1] = -0.0
    x[2, ::37], x[3, ::41], x[3, 1::41] = np.nan, np.inf, -np.inf
    x[4] = tiny * (np.arange(k) % 64 - 32)
    x[5] = np.resize(np.linspace(-1, 1, 32) * 1.5 * 2.0**-125, k)
    x[5, 7::32] = (2.0**-14 if dtype == jnp.float16 else 2.0**-126) - tiny
    x[6] = np.resize(big * np.linspace(-1, 1, 32), k)
    x[7] = np.resize([big, -0.0], k)
    for i, scale in enumerate([1.0, 0.5, 2.0, 2.0**-10, 2.0**10, -1.0, 0.25, 16.0]):
        x[8 + i] = np.resize(np.concatenate([[6.0], ties, -ties, [4.0]]), k) * scale
    with np.errstate(over="ignore"):
        return jnp.asarray(x.astype(np.float32)).astype(dtype)


# ------------------------------------------------------------------------------- checks


def check_exact(dtype, k, rows, interpret, modes=SCALE_MODES):
    """Fused vs reference on the device for every scale mode x rounding, all in one jitted
    program (one compile): [(what, ok, mismatched bytes)]."""
    x = jnp.concatenate([_special_rows(k, dtype), _block_spread(jax.random.key(1), (rows, k), dtype),
                         jax.random.normal(jax.random.key(2), (rows, k), jnp.float32).astype(dtype)])
    if interpret:
        x = x[:24]  # the Pallas interpreter is slow
    # threefry keys: uniforms generated in the kernel; rbg keys: the drawn uniforms read by it
    cases = [(m, rd, "threefry") for rd in ROUNDINGS for m in modes] + [(m, "stochastic", "rbg") for m in modes]

    @jax.jit
    def mismatches(x, keys):
        counts = []
        for mode, rounding, impl in cases:
            key = keys[impl]
            got = quantize_impl(x, key, axis=1, scale_mode=mode, rounding=rounding, interpret=interpret)
            want = _quantize_impl(x, key, axis=1, scale_mode=mode, rounding=rounding)
            counts.append(sum(jnp.sum(lax.bitcast_convert_type(g, jnp.uint8) != lax.bitcast_convert_type(w, jnp.uint8))
                              for g, w in zip(got, want)))
        return jnp.stack(counts)

    counts = np.asarray(mismatches(x, {"threefry": jax.random.key(11), "rbg": jax.random.key(11, impl="rbg")}))
    out = []
    for (mode, rounding, impl), bad in zip(cases, counts.tolist()):
        what = f"{mode}/{rounding}" + (" (rbg key: uniforms read)" if impl == "rbg" else "")
        out.append((f"{jnp.dtype(dtype).name} {what}", bad == 0, bad))
        print(f"  exact {jnp.dtype(dtype).name:8s} {what:40s}: {'PASS' if bad == 0 else 'FAIL'}"
              f" ({bad} mismatched bytes of {x.size // 2 + x.size // 32})", flush=True)
    return out


# ------------------------------------------------------------------------------- runs


def run(quick, sweep=False, check=True, dtypes=("bfloat16", "float32"), modes=SCALE_MODES):
    interpret = dispatch.current_platform() == "cpu"
    shape = QUICK_SHAPE if quick else FULL_SHAPE
    r, k = shape
    timing = dict(min_program_s=0.0, programs=3, max_sets=2) if quick else {}
    rows, checks, t0 = [], [], time.time()

    def log(msg):
        print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)

    for dname in dtypes:
        dtype = jnp.dtype(dname)
        if check:
            # the timed shape (16 special rows + two kinds of random rows), so the kernels compiled
            # here are the ones timed below
            checks += check_exact(dtype, k, (r - 16) // 2, interpret, modes=modes if quick else SCALE_MODES)
            log(f"checks {dname} done")
        in_bytes = r * k * dtype.itemsize
        q_bytes = in_bytes + r * k // 2 + r * k // 32
        make_x = _input_maker(shape, dtype)

        def add(what, res, nbytes, copy_gbs):
            gbs = nbytes / res["median_s"] / 1e9
            row = {"shape": shape, "dtype": dname, "what": what, "median_s": res["median_s"], "min_s": res["min_s"],
                   "calls": res["calls"], "gb_s": gbs, "ratio_vs_copy": gbs / copy_gbs if copy_gbs else 1.0}
            rows.append(row)
            log(f"{r}x{k} {dname} {what}: {res['median_s'] * 1e6:.1f} us/call ({res['calls']} calls/program), "
                f"{gbs:.0f} GB/s = {row['ratio_vs_copy']:.3f} x copy")
            return gbs

        one = jnp.asarray(1.0001, dtype)
        copy = fair_time(lambda x: x * one, lambda i: (make_x(i),), **timing)
        copy_gbs = add("copy (x*1.0001)", copy, 2 * in_bytes, None)
        rows[-1]["ratio_vs_copy"] = 1.0

        def make_xk(i):
            return make_x(i), jax.random.key_data(jax.random.key(1000 + i))

        if sweep:  # tile configs only (even/nearest), then the best one with stochastic rounding
            for cfg in SWEEP[:2] if quick else SWEEP:
                fn = lambda x, cfg=cfg: quantize_2d(x, None, scale_mode="even", cfg=cfg, interpret=interpret)  # noqa: E731
                try:
                    res = fair_time(fn, lambda i: (make_x(i),), **(timing or {"programs": 3}))
                except Exception as e:  # a tile Triton cannot compile: report and go on
                    log(f"sweep {cfg}: error {type(e).__name__}: {str(e)[:300]}")
                    continue
                add(f"sweep even/nearest tile {cfg.rows}x{cfg.cols} w{cfg.num_warps}", res, q_bytes, copy_gbs)
                rows[-1]["cfg"] = [cfg.rows, cfg.cols, cfg.num_warps]
            best = max((x for x in rows if x["dtype"] == dname and "cfg" in x), key=lambda x: x["gb_s"], default=None)
            if best:
                cfg = QuantizeConfig(*best["cfg"])
                fn = lambda x, kd: quantize_impl(x, jax.random.wrap_key_data(kd), axis=1, scale_mode="even",  # noqa: E731
                                                 rounding="stochastic", cfg=cfg, interpret=interpret)
                add(f"sweep even/stochastic tile {cfg.rows}x{cfg.cols} w{cfg.num_warps} (best nearest tile)",
                    fair_time(fn, make_xk, **timing), q_bytes, copy_gbs)
                log(f"best tile for {dname}: DEFAULT_CONFIGS[{dname!r}] = QuantizeConfig(rows={cfg.rows}, "
                    f"cols={cfg.cols}, num_warps={cfg.num_warps})  # {best['ratio_vs_copy']:.3f} x copy")
            make_x.cache_clear()
            continue

        for rounding in ROUNDINGS:
            for mode in modes:
                fused = lambda x, kd, m=mode, rd=rounding: quantize_impl(  # noqa: E731
                    x, jax.random.wrap_key_data(kd), axis=1, scale_mode=m, rounding=rd, interpret=interpret)
                add(f"fused {mode}/{rounding}", fair_time(fused, make_xk, **timing), q_bytes, copy_gbs)
            if rounding == "stochastic":  # an rbg key: uniforms drawn by XLA, read by the kernel
                for mode in modes[:1] if quick else ("even",):
                    fused = lambda x, kd, m=mode: quantize_impl(  # noqa: E731
                        x, jax.random.key(kd[0], impl="rbg"), axis=1, scale_mode=m, rounding="stochastic",
                        interpret=interpret)
                    add(f"fused {mode}/stochastic (rbg key: uniforms read)",
                        fair_time(fused, make_xk, **timing), q_bytes, copy_gbs)
            if quick:
                continue
            refq = lambda x, kd, rd=rounding: _quantize_impl(  # noqa: E731
                x, jax.random.wrap_key_data(kd) if rd == "stochastic" else None, axis=1, scale_mode="even", rounding=rd)
            add(f"reference even/{rounding}", fair_time(refq, make_xk, **timing), q_bytes, copy_gbs)
        if not quick:  # the stochastic kernel alone, uniforms given (counted in its bytes)
            def make_xu(i):
                return make_x(i), jax.random.uniform(jax.random.key(2000 + i), shape, jnp.float32)

            kern = lambda x, u: quantize_2d(x, u, scale_mode="even", cfg=default_config(dtype))  # noqa: E731
            b = q_bytes + 4 * r * k
            add("fused even/stochastic, kernel only (uniforms given, counted)",
                fair_time(kern, make_xu), b, copy_gbs)
        make_x.cache_clear()
    return {"info": device_info(), "quick": quick, "method": __doc__.split("Usage")[0].strip(), "rows": rows,
            "checks": [{"what": w, "ok": ok, "mismatched_bytes": n} for w, ok, n in checks]}


COLUMN_TILES = [ColumnsConfig(b, c, w) for (b, c, w) in [  # the default first; 8-64 elements per thread
    (2, 128, 16), (1, 128, 8), (2, 128, 8), (1, 256, 8), (4, 64, 8), (4, 128, 16), (2, 128, 4), (1, 128, 4)]]


def run_strided(quick, dtypes=("float32", "bfloat16")):
    """``--strided`` (module docstring): rows as :func:`run`'s, plus ``same_bits`` for each pair."""
    from jax_mxfp4.fp8_prepared import encode_rows_on
    from jax_mxfp4.kernels import fp8_quantize as fq

    interpret = dispatch.current_platform() == "cpu"
    platform = dispatch.current_platform()
    shape = QUICK_SHAPE if quick else FULL_SHAPE  # [T, K], quantized along T
    t, k = shape
    timing = dict(min_program_s=0.0, programs=3, max_sets=2) if quick else {}
    rows, t0 = [], time.time()

    def log(msg):
        print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)

    def rbg(kd):
        return jax.random.wrap_key_data(kd, impl="rbg")

    def as_bytes(tree):
        return [lax.bitcast_convert_type(a, jnp.uint8) if a.dtype.itemsize == 1 else a for a in jax.tree.leaves(tree)]

    for dname in dtypes:
        dtype = jnp.dtype(dname)
        make_x = _input_maker(shape, dtype)

        def make_xk(i):
            return make_x(i), jax.random.key_data(jax.random.key(3000 + i, impl="rbg"))

        in_bytes = t * k * dtype.itemsize
        q_bytes = in_bytes + t * k // 2 + t * k // 32
        one = jnp.asarray(1.0001, dtype)
        copy = fair_time(lambda x: x * one, lambda i: (make_x(i),), **timing)
        copy_gbs = 2 * in_bytes / copy["median_s"] / 1e9

        def add(what, res, nbytes, same=None):
            gbs = nbytes / res["median_s"] / 1e9
            rows.append({"shape": shape, "dtype": dname, "what": what, "median_s": res["median_s"],
                         "min_s": res["min_s"], "calls": res["calls"], "gb_s": gbs, "ratio_vs_copy": gbs / copy_gbs,
                         "same_bits": same})
            log(f"{t}x{k} {dname} {what}: {res['median_s'] * 1e6:.1f} us/call, {gbs:.0f} GB/s = "
                f"{gbs / copy_gbs:.3f} x copy" + ("" if same is None else f", same bits: {same}"))

        rows.append({"shape": shape, "dtype": dname, "what": "copy (x*1.0001)", "median_s": copy["median_s"],
                     "min_s": copy["min_s"], "calls": copy["calls"], "gb_s": copy_gbs, "ratio_vs_copy": 1.0})
        # Each route's output in the layout its consumer reads (rows of x.T, the quantized axis last),
        # as the training passes use it: quantize_impl's move back to x's layout cancels there.
        pairs = {  # what -> (library route, the route it replaced, bytes counted)
            "MXFP4 along T, nearest": (
                lambda x, kd: quantize_columns_3d(x[None], scale_mode="even", interpret=interpret),
                lambda x, kd: quantize_2d(x.T, None, scale_mode="even", cfg=default_config(x.dtype),
                                          interpret=interpret),
                q_bytes),
            "MXFP4 along T, stochastic (rbg key)": (
                lambda x, kd: quantize_columns_3d(x[None], kd, scale_mode="even", interpret=interpret),
                lambda x, kd: quantize_2d(x.T, jax.random.uniform(rbg(kd), (k, t // 32, 32), jnp.float32),
                                          scale_mode="even", cfg=default_config(x.dtype), interpret=interpret),
                q_bytes),
            "E5M2 FP8 operand along T, stochastic (rbg key)": (
                lambda x, kd: _columns_then_encode(x, kd, platform, interpret, encode_rows_on),
                lambda x, kd: _without_scales(fq.quantize_fp8_2d(x.T, kd, scale_mode="even", interpret=interpret,
                                                                 fmt="e5m2")),
                in_bytes + t * k + t * k // 32),
        }
        for what, (new, old, nbytes) in pairs.items():
            x0, kd0 = make_xk(0)
            same = all(bool(jnp.array_equal(a.reshape(b.shape), b))
                       for a, b in zip(as_bytes(jax.jit(new)(x0, kd0)), as_bytes(jax.jit(old)(x0, kd0))))
            add(f"{what}: strided-axis kernel", fair_time(new, make_xk, **timing), nbytes, same)
            add(f"{what}: XLA transpose, then rows", fair_time(old, make_xk, **timing), nbytes, same)
        for cfg in COLUMN_TILES[:2] if quick else COLUMN_TILES:
            fn = lambda x, cfg=cfg: quantize_columns_3d(x[None], scale_mode="even", cfg=cfg, interpret=interpret)  # noqa: E731
            try:
                res = fair_time(fn, lambda i: (make_x(i),), **timing)
            except Exception as e:  # a tile Triton cannot compile: report and go on
                log(f"tile {cfg}: error {type(e).__name__}: {str(e)[:300]}")
                continue
            add(f"sweep strided nearest tile {cfg.blocks}x{cfg.cols} w{cfg.num_warps}", res, q_bytes)
            rows[-1]["cfg"] = [cfg.blocks, cfg.cols, cfg.num_warps]
        best = max((r for r in rows if r["dtype"] == dname and "cfg" in r), key=lambda r: r["gb_s"], default=None)
        if best:
            log(f"best strided tile for {dname}: ColumnsConfig(blocks={best['cfg'][0]}, cols={best['cfg'][1]}, "
                f"num_warps={best['cfg'][2]})  # {best['ratio_vs_copy']:.3f} x copy")
        make_x.cache_clear()
    return {"info": device_info(), "quick": quick, "method": __doc__.split("Usage")[0].strip(), "rows": rows,
            "checks": [{"what": f"{r['dtype']} {r['what']}", "ok": r["same_bits"], "mismatched_bytes": None}
                       for r in rows if r.get("same_bits") is not None and "strided-axis" in r["what"]]}


def _without_scales(out):
    codes, _, row_exp, row_flag = out
    return codes, row_exp, row_flag


def _columns_then_encode(x, kd, platform, interpret, encode_rows_on):
    """The library's E5M2 operand of dY along T: the strided-axis kernel (Philox uniforms of the
    rbg key), then the encode kernel on its rows: (codes, row_exp, row_flag)."""
    from jax_mxfp4.kernels.fp8_encode import encode_rows_kernel

    t, k = x.shape
    data, byte = quantize_columns_3d(x[None], kd, scale_mode="even", interpret=interpret)
    if interpret:
        return encode_rows_kernel(data[0], byte[0], interpret=True, fmt="e5m2")
    return encode_rows_on(data[0], byte[0], platform, "e5m2")


def markdown(res):
    info = res["info"]
    lines = [f"# MXFP4 quantization: {info['device']} ({info['platform']}), jax {info['jax']}, {info['date_utc']} UTC", "",
             "GB/s = (input bytes + packed data + scale bytes) / median time per call (fair timing, see "
             "benchmarks/quantize.py); x copy = GB/s / the same run's XLA elementwise copy GB/s (bytes read + written).", "",
             "| shape | dtype | what | median us | GB/s | x copy |", "|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['shape'][0]}x{r['shape'][1]} | {r['dtype']} | {r['what']} | {r['median_s'] * 1e6:.1f} | "
                     f"{r['gb_s']:.1f} | {r['ratio_vs_copy']:.3f} |")
    if res.get("checks"):
        lines += ["", "Bit-exactness, fused vs reference on this device:", "",
                  "| case | result | mismatched bytes |", "|---|---|---|"]
        lines += [f"| {c['what']} | {'PASS' if c['ok'] else 'FAIL'} | "
                  f"{'-' if c['mismatched_bytes'] is None else c['mismatched_bytes']} |" for c in res["checks"]]
    return "\n".join(lines) + "\n"


def figure(res, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in res["rows"] if not r["what"].startswith("sweep")]
    labels = [f"{r['shape'][0]}x{r['shape'][1]} {r['dtype']}\n{r['what']}" for r in rows]
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(rows) + 1.5))
    ax.barh(range(len(rows)), [r["gb_s"] for r in rows],
            color=["gray" if r["what"].startswith("copy") else ("C0" if r["what"].startswith("fused") else "C1") for r in rows])
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(labels, fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("GB/s (gray: same-run copy; blue: fused Pallas; orange: reference jnp)")
    ax.set_title(f"MXFP4 quantization on {res['info']['device']}")
    return save_figure(fig, out, "quantize_bandwidth.png")



def _input_maker(shape, dtype):
    """make_x(i): the i-th timed input (normal(0, 1) from key 100 + i, as ``dtype``), made once
    (``make_x.cache_clear()`` frees them)."""
    return functools.cache(lambda i: jax.random.normal(jax.random.key(100 + i), shape, jnp.float32).astype(dtype))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="tiny shape, one dtype and mode, few iterations: checks the pipeline and files on a CPU")
    ap.add_argument("--sweep", action="store_true", help="instead of the mode matrix, time the tile configs "
                    "(even/nearest) per dtype and print the best as a DEFAULT_CONFIGS line")
    ap.add_argument("--no-check", action="store_true", help="skip the fused-vs-reference bit-exactness check")
    ap.add_argument("--strided", action="store_true", help="instead of the mode matrix, the operands quantized along "
                    "the token axis: the strided-axis kernel beside XLA's transpose + the row kernels, and its tiles")
    ap.add_argument("--dtypes", default=None, help="comma-separated input dtypes (default bfloat16,float32; "
                    "--quick: bfloat16)")
    ap.add_argument("--modes", default=None, help="comma-separated scale modes to time (default all; --quick: even)")
    ap.add_argument("--out", default=None, help="output folder (default bench_out/quantize, bench_out/quantize-quick)")
    args = ap.parse_args(argv)
    if args.strided and (args.sweep or args.no_check or args.modes):
        ap.error("--strided times its own routes (scale mode even, always bit-checked): it takes no --sweep, "
                 "--no-check or --modes")
    for d in (args.dtypes.split(",") if args.dtypes is not None else ()):
        if d not in ("float32", "bfloat16", "float16"):
            ap.error(f"--dtypes: each must be float32, bfloat16 or float16 (the quantizer's inputs), got {d!r}")
    name = "quantize-strided" if args.strided else "quantize"
    out = out_dir(args.out or default_out(name + ("-quick" if args.quick else "")))
    dtypes = args.dtypes or ("bfloat16" if args.quick else "bfloat16,float32")
    modes = args.modes or ("even" if args.quick else ",".join(SCALE_MODES))
    if args.strided:
        res = run_strided(args.quick, dtypes=tuple(dtypes.split(",")))
    else:
        res = run(args.quick, sweep=args.sweep, check=not args.no_check, dtypes=tuple(dtypes.split(",")),
                  modes=tuple(modes.split(",")))
    write_json(os.path.join(out, "quantize.json"), res)
    md = markdown(res)
    with open(os.path.join(out, "quantize.md"), "w") as f:
        f.write(md)
    figure(res, out)
    print(md)
    return 0 if all(c["ok"] for c in res["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
