"""Mosaic GPU w4a16 kernel (jax_mxfp4/kernels/wgemm_mgpu.py) on an NVIDIA Hopper GPU: correctness,
then timing against XLA's bf16 GEMM and the Triton weight-stationary kernel, same run.

Correctness (every variant, before it is timed): output against backend "xla" (``dot_general``
with ``Recipe(backend="xla", quantize_activations=False)``) on fresh random data with mixed block
magnitudes; pass: elementwise |mgpu - xla| <= 2 K 2^-24 (|x|.|W|) (two float32 summation orders;
+ 2^-7 |xla| for bfloat16 out), finite. Edge case at a small shape: every E8M0 byte 0x00..0xFE on
the weight side and one 0xFF (NaN) block, against a float64 NumPy reference (finite products
within the bound, the NaN block poisons exactly its output column), for both decodes.
Timing: benchmarks/common.py ``time_fn`` (fair method) and ``kernel_time`` (profiler kernel sums);
ratio = time / bf16 time of the same run (< 1 is faster). Each case is caught separately; JSON is
rewritten after every row. Stops timing new variants after --budget seconds.

Usage: python benchmarks/wgemm_mgpu_check.py --out DIR [--budget 200] [--quick]
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
from jax import lax  # noqa: E402

import jax_mxfp4 as mx  # noqa: E402
from benchmarks.common import device_info, kernel_time, n_sets_for, out_dir, time_fn, write_json  # noqa: E402
from jax_mxfp4.kernels.wgemm_mgpu import DECODES, MgpuConfig, kernel_scales, mgpu_w4a16  # noqa: E402
from jax_mxfp4.mx_format import as_e8m0, as_scale_bytes  # noqa: E402

DIMS2 = (((1,), (1,)), ((), ()))
XLA_W4A16 = mx.Recipe(backend="xla", quantize_activations=False)


def rand(seed, shape, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    size = int(np.prod(shape))
    mags = np.exp2(rng.integers(-8, 9, size=-(-size // 32))).repeat(32)[:size].reshape(shape)
    return jnp.asarray(rng.standard_normal(shape) * mags, dtype)


def bound_check(out, ref, a_abs, b_abs, k, bf16_out):
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    ref = np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
    mag = np.asarray(a_abs, np.float64) @ np.asarray(b_abs, np.float64).T
    tol = 2 * k * 2.0**-24 * mag + (2.0**-7 * np.abs(ref) if bf16_out else 0) + 1e-30
    err = np.abs(out - ref)
    finite = bool(np.all(np.isfinite(out)))
    ratio = float(np.max(err / tol)) if finite else float("inf")
    rel = float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))
    return {"finite": finite, "max_err_over_bound": ratio, "rel_fro": rel, "ok": finite and ratio <= 1.0}


VARIANTS = {  # name -> MgpuConfig; the first two are also timed at M = 1 and 128
    "ptx bk256 s2 st4": MgpuConfig(bk=256, split_k=2, stages=4, decode="ptx"),
    "ptx bk256 s4 st4": MgpuConfig(bk=256, split_k=4, stages=4, decode="ptx"),
    "ptx bk512 s2 st3": MgpuConfig(bk=512, split_k=2, stages=3, decode="ptx"),
    "ptx bk128 s4 st6": MgpuConfig(bk=128, split_k=4, stages=6, decode="ptx"),
    "ptx bk256 s1 st4": MgpuConfig(bk=256, split_k=1, stages=4, decode="ptx"),
    "mul bk256 s2 st4": MgpuConfig(bk=256, split_k=2, stages=4),
    "select bk256 s2 st4": MgpuConfig(bk=256, split_k=2, stages=4, decode="select"),
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/wgemm_mgpu")
    ap.add_argument("--budget", type=float, default=200.0, help="seconds after which no new timing starts")
    ap.add_argument("--quick", action="store_true", help="small shapes only (smoke test)")
    args = ap.parse_args(argv)
    out = out_dir(args.out)
    info = device_info()
    t_start = time.time()
    rows = []

    def record(row):
        row["t"] = round(time.time() - t_start, 1)
        rows.append(row)
        write_json(os.path.join(out, "wgemm_mgpu_check.json"), {"info": info, "rows": rows})
        msg = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                       if k not in ("trace", "detail"))
        print(msg, flush=True)

    def guarded(kind, name, fn):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - report and keep going
            record({"kind": kind, "case": name, "ok": False, "error": f"{type(e).__name__}: {e}"[:2000],
                    "trace": traceback.format_exc()[-4000:]})
            return None

    # ---- edge case: every E8M0 byte + a NaN block, both decodes
    def edge(decode):
        rng = np.random.default_rng(5)
        m, n, k = 16, 256, 256
        data = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
        sb = (np.arange(n * (k // 32), dtype=np.int64).reshape(n, k // 32) % 255).astype(np.uint8)
        sb[17, 3] = 255
        x = jnp.asarray(rng.standard_normal((m, k)) * 2.0**-10, jnp.bfloat16)
        cfg = MgpuConfig(bk=64, split_k=2, stages=2, decode=decode)
        got = np.asarray(jax.jit(lambda a, d, s: mgpu_w4a16(a, d, s, jnp.float32, cfg))(
            x, jnp.asarray(data), jnp.asarray(sb)), np.float64)
        codes = np.stack([data & 15, data >> 4], -1).reshape(n, k)
        e2m1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])
        sc = np.where(sb == 255, np.nan, 2.0 ** (sb.astype(np.float64) - 127))
        with np.errstate(over="ignore", invalid="ignore"):
            w = (e2m1[codes] * np.repeat(sc, 32, axis=-1)).astype(np.float32).astype(np.float64)
            ref = np.asarray(x, np.float64) @ w.T
            mag = np.abs(np.asarray(x, np.float64)) @ np.abs(w).T
        fin = np.isfinite(ref) & (np.abs(ref) < 3e38)
        ok_vals = bool(np.all(np.abs(got[fin] - ref[fin]) <= 2 * k * 2.0**-24 * mag[fin] + 2.0**-126))
        ok_nan = bool(np.isnan(got[:, 17]).all()) and bool(np.isfinite(got[:, :17]).all())
        # also against backend "xla" through dot_general
        w_arr = mx.MXFP4Array(jnp.asarray(data), as_e8m0(jnp.asarray(sb)), 1, (n, k),
                              jnp.float32, "floor", "plain")
        xla = np.asarray(mx.dot_general(x, w_arr, DIMS2, recipe=XLA_W4A16,
                                        preferred_element_type=jnp.float32), np.float64)
        same_nan = bool(np.array_equal(np.isnan(xla), np.isnan(got)))
        ok_xla = bool(np.all(np.abs(got[fin] - xla[fin]) <= 2 * 2 * k * 2.0**-24 * mag[fin] + 2.0**-126))
        record({"kind": "check", "case": f"every E8M0 byte + NaN block ({decode})",
                "ok": ok_vals and ok_nan and same_nan and ok_xla, "ok_vals": ok_vals, "ok_nan": ok_nan,
                "nan_pattern_as_xla": same_nan, "ok_vs_xla": ok_xla})

    for dec in DECODES:
        guarded("check", f"edge {dec}", lambda dec=dec: edge(dec))

    # ---- random data vs backend "xla"
    def check(m, n, k, cfg, odt, name):
        x = rand(100 + m, (m, k)).astype(jnp.bfloat16)
        q = mx.quantize(rand(200 + m, (n, k)), 1)
        got = jax.jit(lambda a, d, s: mgpu_w4a16(a, d, s, odt, cfg))(x, q.data, as_scale_bytes(q.scales))
        ref = mx.dot_general(x, q, DIMS2, recipe=XLA_W4A16, preferred_element_type=odt)
        r = bound_check(got, ref, jnp.abs(x.astype(jnp.float32)), jnp.abs(mx.dequantize(q)), k,
                        odt == jnp.bfloat16)
        record({"kind": "check", "case": f"{m}x{n}x{k} {jnp.dtype(odt).name} {name}", **r})
        return r["ok"]

    shapes = [(16, 256, 1024), (3, 320, 2048)] if args.quick else [
        (16, 8192, 8192), (1, 8192, 8192), (128, 8192, 8192), (40, 1024, 4096)]
    passed = {}
    for name, cfg in VARIANTS.items():
        oks = [guarded("check", f"{s} {name}", lambda s=s, cfg=cfg, name=name: check(
            *s, cfg, jnp.float32 if s[0] == 40 else jnp.bfloat16, name)) for s in shapes[:1]]
        passed[name] = all(oks)
    for s in shapes[1:]:
        for name in list(VARIANTS)[:2] + ["mul bk256 s2 st4"]:
            guarded("check", f"{s} {name}", lambda s=s, name=name: check(*s, VARIANTS[name], jnp.float32, name))

    # ---- timing
    from jax_mxfp4.kernels.wgemm import default_wconfig, weight_stationary_gemm

    timing = dict(reps=5, min_program_s=0.02, max_calls=512)
    for m in ((16,) if args.quick else (16, 1, 128)):
        n = k = 256 if args.quick else 8192
        if time.time() - t_start > args.budget:
            record({"kind": "skip", "case": f"timing M={m}", "reason": "budget"})
            continue
        per_set = n * k * 17 // 32 + 2 * m * k
        n_sets = n_sets_for(max(per_set, 2 * n * k // 2))
        sets = []
        for i in range(n_sets):
            q = mx.quantize(jax.random.normal(jax.random.key(i), (n, k), jnp.float32) * 0.05, 1)
            x = jax.random.normal(jax.random.key(100 + i), (m, k), jnp.bfloat16)
            sets.append((x, q.data, as_scale_bytes(q.scales)))
        jax.block_until_ready(sets)
        base = {}

        def bf16():
            bsets = [(x, jax.random.normal(jax.random.key(7 + i), (n, k), jnp.bfloat16))
                     for i, (x, _, _) in enumerate(sets)]
            t = time_fn(lambda a, w: lax.dot_general(a, w, DIMS2, preferred_element_type=jnp.bfloat16),
                        bsets, **timing)
            kt = kernel_time(lambda a, w: lax.dot_general(a, w, DIMS2, preferred_element_type=jnp.bfloat16),
                             bsets)
            base["s"], base["k"] = t["median_s"], kt.get("kernel_s", float("nan"))
            record({"kind": "time", "m": m, "variant": "xla bf16", "us": t["median_s"] * 1e6, "ratio": 1.0,
                    "kernel_us": base["k"] * 1e6, "calls": t["calls"]})

        guarded("time", f"bf16 M={m}", bf16)
        if "s" not in base:
            continue

        def timed(name, fn, tsets, profile=True):
            if time.time() - t_start > args.budget:
                record({"kind": "skip", "m": m, "variant": name, "reason": "budget"})
                return
            t = time_fn(fn, tsets, **timing)
            row = {"kind": "time", "m": m, "variant": name, "us": t["median_s"] * 1e6,
                   "ratio": t["median_s"] / base["s"], "calls": t["calls"]}
            if profile:
                kt = kernel_time(fn, tsets)
                row.update(kernel_us=kt.get("kernel_s", float("nan")) * 1e6,
                           kernel_ratio=kt.get("kernel_s", float("nan")) / base["k"],
                           detail={kk: v * 1e6 for kk, v in kt.get("kernels", {}).items()})
            record(row)

        wcfg = default_wconfig(m, n, k)
        guarded("time", f"triton M={m}", lambda: timed(
            f"triton wgemm {wcfg}", lambda a, d, s: weight_stationary_gemm(
                a[None], d[None], s[None], out_dtype=jnp.bfloat16, cfg=wcfg)[0], sets))
        prepared = [(x, d, kernel_scales(s)) for x, d, s in sets]
        names = list(VARIANTS) if m == 16 else list(VARIANTS)[:2]
        for name in names:
            cfg = VARIANTS[name]
            if not passed.get(name, False):
                record({"kind": "skip", "m": m, "variant": name, "reason": "failed or errored check"})
                continue
            guarded("time", f"mgpu {name} M={m}", lambda cfg=cfg, name=name: timed(
                f"mgpu {name} (scales prepared)", lambda a, d, s: mgpu_w4a16(
                    a, d, s, jnp.bfloat16, cfg, scales_prepared=True), prepared))
            if name == next(iter(VARIANTS)):
                guarded("time", f"mgpu {name} raw M={m}", lambda cfg=cfg, name=name: timed(
                    f"mgpu {name} (raw scale bytes)", lambda a, d, s: mgpu_w4a16(a, d, s, jnp.bfloat16, cfg),
                    sets, profile=False))
        del sets, prepared

    print("\nsummary (ratio = time / bf16 time, same run):")
    for r in rows:
        if r["kind"] == "check" or "error" in r:
            print(f"  {'PASS' if r.get('ok') else 'FAIL'} {r['case']} {r.get('error', '')[:300]}")
        elif r["kind"] == "time" and "us" in r:
            print(f"  M={r['m']:4d} {r['variant'][:60]:60s} {r['us']:8.2f} us ratio {r['ratio']:.3f} "
                  f"kernel {r.get('kernel_us', float('nan')):8.2f} us")
    print(f"total {time.time() - t_start:.0f} s")


if __name__ == "__main__":
    main()
