"""Sweep of the weight-stationary MXFP4 kernel (w4a16 and decode-size a4w4) on a GPU.

For each shape: bf16 ``dot_general`` (the baseline, same run), the previous Pallas kernel, and
weight-stationary variants (decode, tiles, split-K, warps, stages); at large M also the two-pass
route (weight decoded to bf16 once, then XLA's bf16 GEMM). Every variant is first checked against
a float32 reference on its own operands (relative Frobenius error must stay < 1e-5; bf16 out is
checked with float32 out). Timing: benchmarks/common.py (fair method).
Writes ``wgemm_tune.json`` (one row per variant) into --out and prints a table; time ratios are
time / bf16 time (< 1 is faster).

Usage: python benchmarks/wgemm_tune.py [--quick] [--shapes 16,1,...] [--out DIR]
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

from benchmarks.common import device_info, kernel_time, n_sets_for, out_dir, time_fn, write_json  # noqa: E402
from jax_mxfp4.kernels.gemm import default_config, mxfp4_gemm  # noqa: E402
from jax_mxfp4.kernels.wgemm import WTileConfig, default_wconfig, weight_stationary_gemm  # noqa: E402
from jax_mxfp4.mx_format import as_scale_bytes  # noqa: E402
from jax_mxfp4.array import MXFP4Array  # noqa: E402
from jax_mxfp4.quantize import _quantize_impl, dequantize, quantize  # noqa: E402

DIMS = (((2,), (2,)), ((0,), (0,)))


def operands(m, n, k, n_sets, seed):
    sets = []
    for i in range(n_sets):
        ka, kb = jax.random.split(jax.random.key(seed + i))
        x = jax.random.normal(ka, (1, m, k), jnp.bfloat16)
        w = jax.random.normal(kb, (1, n, k), jnp.float32) * 0.05
        d, sc = _quantize_impl(w, None, axis=2, scale_mode="floor", rounding="nearest")
        sets.append((x, d, as_scale_bytes(sc)))
    jax.block_until_ready(sets)
    return sets


def reference(x, d, s):
    from jax_mxfp4.mx_format import dequantize_blocks, unpack_nibbles

    codes = unpack_nibbles(d)
    wf = dequantize_blocks(codes.reshape(*codes.shape[:-1], -1, 32), s).reshape(codes.shape)
    return lax.dot_general(x.astype(jnp.float32), wf, DIMS, precision=lax.Precision.HIGHEST)


def variants(m, n, k, quick, full=True):
    base = default_wconfig(m, n, k)
    out = {"ws default": base}
    if quick:
        return {"ws default": WTileConfig(bn=64, bm=16, bk=64, decode="f16")}
    if m <= 128:
        bm = base.bm
        grid = [(sp, bk) for sp in (2, 4, 8) for bk in (128, 256, 512)] if full else [(2, 256), (4, 256), (4, 512), (8, 128)]
        for split, bk in grid:
            out[f"ws asm s{split} bk{bk}"] = WTileConfig(bn=128, bm=bm, bk=bk, split_k=split)
        if full:
            for name, over in (("3d bn64", dict(bn=64, layout3d=True)), ("3d s8", dict(split_k=8, layout3d=True)),
                               ("3d w2", dict(num_warps=2, layout3d=True)), ("3d st3", dict(num_stages=3, layout3d=True)),
                               ("bn64", dict(bn=64)), ("bn256 w8", dict(bn=256, num_warps=8)), ("3d", dict(layout3d=True)),
                               ("st3", dict(num_stages=3)), ("st5", dict(num_stages=5)), ("w8", dict(num_warps=8)),
                               ("f16", dict(decode="f16")), ("e4m3", dict(decode="e4m3"))):
                out[f"ws asm s4 bk256 {name}"] = WTileConfig(**{**dict(bn=128, bm=bm, bk=256, split_k=4), **over})
    else:
        for bn, bm, w, st in ((128, 128, 8, 3), (128, 256, 8, 3), (256, 128, 8, 3), (128, 128, 4, 4),
                              (64, 256, 8, 3)):
            out[f"ws asm bn{bn} bm{bm} w{w} st{st}"] = WTileConfig(bn=bn, bm=bm, bk=64, num_warps=w,
                                                                   num_stages=st)
        out["ws asm bk128 bn128 bm128"] = WTileConfig(bn=128, bm=128, bk=128, num_warps=8, num_stages=3)
    return out


def run(args):
    info = device_info()
    shapes = [(16, 64, 256)] if args.quick else [(m, 8192, 8192) for m in args.shapes]
    interpret = jax.devices()[0].platform == "cpu"
    rows = []
    t0 = time.time()
    timing = dict(reps=3, min_program_s=0.0) if args.quick else dict(reps=5, min_program_s=args.min_program_s, max_calls=768)

    def record(row):
        rows.append(row)
        print(f"[{time.time() - t0:6.1f}s] {row['m']}x{row['n']}x{row['k']} {row['variant']:34s} "
              f"{row.get('median_s', float('nan')) * 1e6:9.2f} us  ratio {row.get('ratio', float('nan')):.3f} "
              f"err {row.get('rel_err', float('nan')):.1e} {row.get('status', '')}", flush=True)
        write_json(os.path.join(args.out_path, "wgemm_tune.json"), {"info": info, "rows": rows})

    for m, n, k in shapes:
        per_set = 2 * m * k + n * k * 17 // 32 + 2 * n * k  # bf16 baseline operand bytes dominate
        sets = operands(m, n, k, n_sets_for(per_set), seed=m)
        bf_sets = [(x, jax.random.normal(jax.random.key(7 + i), (1, n, k), jnp.bfloat16))
                   for i, (x, _, _) in enumerate(sets)]
        bf = time_fn(lambda x, w: lax.dot_general(x, w, DIMS, preferred_element_type=jnp.bfloat16),
                     bf_sets, **timing)
        base = bf["median_s"]
        record({"m": m, "n": n, "k": k, "variant": "bf16 dot_general", **bf, "ratio": 1.0})
        if args.profile and not args.quick:
            kt = kernel_time(lambda x, w: lax.dot_general(x, w, DIMS, preferred_element_type=jnp.bfloat16),
                             bf_sets)
            record({"m": m, "n": n, "k": k, "variant": "bf16 (profiler kernel time)",
                    "median_s": kt.get("kernel_s", float("nan")), "ratio": kt.get("kernel_s", float("nan")) / base,
                    "detail": kt})
        del bf_sets
        ref = reference(*sets[0])
        cands = {}
        for name, cfg in variants(m, n, k, args.quick, full=m in args.full_sweep).items():
            cands[name] = (lambda x, d, s, out=jnp.bfloat16, cfg=cfg: weight_stationary_gemm(
                x, d, s, out_dtype=out, cfg=cfg, interpret=interpret), cfg)
        if m >= 512 and not args.quick:
            cands["two-pass dequant + XLA bf16"] = (
                lambda x, d, s, out=jnp.bfloat16: lax.dot_general(x, _deq(d, s), DIMS, preferred_element_type=out), None)
        old = default_config(m, n, k, a4w4=False)
        cands["previous pallas kernel"] = (
            lambda x, d, s, out=jnp.bfloat16: mxfp4_gemm(x, (d, s), m=m, n=n, k=k, out_dtype=out, cfg=old,
                                                         interpret=interpret), old)
        best = (None, float("inf"))
        for name, (fn, cfg) in cands.items():
            row = {"m": m, "n": n, "k": k, "variant": name, "cfg": repr(cfg)}
            try:
                out32 = jax.jit(lambda x, d, s: fn(x, d, s, out=jnp.float32))(*sets[0])
                err = float(jnp.linalg.norm(out32 - ref) / jnp.linalg.norm(ref))
                row["rel_err"] = err
                if not err < 1e-5:  # float32 out: only the summation order differs
                    row["status"] = "WRONG"
                    record(row)
                    continue
                r = time_fn(fn, sets, **timing)
                row.update(r, ratio=r["median_s"] / base, status="ok")
                if r["median_s"] < best[1] and name.startswith("ws"):
                    best = (fn, r["median_s"])
            except Exception as e:  # record and go on
                row["status"] = f"error {type(e).__name__}: {str(e)[:200]}"
            record(row)
        if args.profile and not args.quick and best[0] is not None:
            kt = kernel_time(best[0], sets)
            record({"m": m, "n": n, "k": k, "variant": "best ws (profiler kernel time)",
                    "median_s": kt.get("kernel_s", float("nan")), "ratio": kt.get("kernel_s", float("nan")) / base,
                    "detail": kt})
        if m <= 128 and not args.quick:  # a4w4 at decode size: activation MXFP4
            xq = [(quantize(x, 2, scale_mode="floor"), d, s) for x, d, s in sets]
            cfg = default_wconfig(m, n, k)

            def a4w4_pre(xq_, d, s):
                return weight_stationary_gemm(dequantize(xq_, jnp.bfloat16), d, s, out_dtype=jnp.bfloat16, cfg=cfg)

            def a4w4_call(x, d, s):  # the public quantizer (fused Pallas kernel on GPUs)
                xq_ = quantize(x, 2, scale_mode="floor")
                return weight_stationary_gemm(dequantize(xq_, jnp.bfloat16), d, s, out_dtype=jnp.bfloat16, cfg=cfg)

            def a4w4_call_jnp(x, d, s):  # the jnp quantizer: XLA fuses quantize + dequantize
                xd, xs = _quantize_impl(x, None, axis=2, scale_mode="floor", rounding="nearest")
                xq_ = MXFP4Array(xd, xs, 2, x.shape, x.dtype, "floor", "plain")
                return weight_stationary_gemm(dequantize(xq_, jnp.bfloat16), d, s, out_dtype=jnp.bfloat16, cfg=cfg)

            for name, fn, ss in (("a4w4 pre-quantized x (ws)", a4w4_pre, xq),
                                 ("a4w4 x quantized per call (ws)", a4w4_call, sets),
                                 ("a4w4 x quantized per call, jnp quantizer (ws)", a4w4_call_jnp, sets)):
                try:
                    r = time_fn(fn, ss, **timing)
                    record({"m": m, "n": n, "k": k, "variant": name, **r, "ratio": r["median_s"] / base, "status": "ok"})
                except Exception as e:
                    record({"m": m, "n": n, "k": k, "variant": name, "status": f"error {e!r}"[:200]})
        del sets
    return rows


def _deq(d, s):
    from jax_mxfp4.mx_format import dequantize_blocks, unpack_nibbles

    codes = unpack_nibbles(d)
    return dequantize_blocks(codes.reshape(*codes.shape[:-1], -1, 32), s).reshape(codes.shape).astype(jnp.bfloat16)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one tiny shape (CPU, interpreter)")
    ap.add_argument("--shapes", default="16,1,64,128,1024,8192", help="comma-separated M values (N = K = 8192)")
    ap.add_argument("--min-program-s", type=float, default=0.02, help="fair timing: seconds per timed program")
    ap.add_argument("--full-sweep", default="16", help="M values that get the full decode-size sweep")
    ap.add_argument("--profile", action="store_true", help="cross-check with profiler kernel times")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.shapes = [int(v) for v in args.shapes.split(",")]
    args.full_sweep = [int(v) for v in args.full_sweep.split(",")]
    args.out_path = out_dir(args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                       "wgemm_tune-quick" if args.quick else "wgemm_tune"))
    rows = run(args)
    print("\n| M x N x K | variant | us | time / bf16 |")
    print("|---|---|---|---|")
    for r in rows:
        if "median_s" in r:
            print(f"| {r['m']}x{r['n']}x{r['k']} | {r['variant']} | {r['median_s'] * 1e6:.2f} | {r.get('ratio', float('nan')):.3f} |")


if __name__ == "__main__":
    main()
