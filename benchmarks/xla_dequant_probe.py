"""w4a16 at many rows: can XLA fuse the MXFP4 weight's decode into its own GEMM?

Issue 9 asks w4a16 at 1024x8192x8192 and 8192x8192x8192 within 5% of bf16. The route in
dispatch today decodes the whole weight to bfloat16 in a Pallas pass and then runs XLA's bf16
GEMM (1.31x at 1024 rows, session 3: the decode pass writes 128 MB). This probe times, side by
side in one run, formulations that leave the decode to XLA inside one jitted function, so XLA's
GPU compiler may fuse it into the GEMM's operand (a Triton GEMM fusion with a prologue):

  * "bf16": ``lax.dot_general`` on the bf16 weight (the baseline);
  * "pallas": ``jax_mxfp4.dot_general`` with backend "pallas" on the plain MXFP4Array weight
    (the route dispatch gives it: since session 13 the large-tile kernel's "natural" decode);
  * "xla-f4": the packed bytes bitcast to ``float4_e2m1fn`` (low nibble = element 2j, the
    project's packing), converted to bf16, times the block scale (bf16 2^(b-127), the rule of
    ``mx_format.e8m0_to_bf16_bits``);
  * "xla-int-cat": the low and high nibbles decoded by integer operations
    (``wgemm_mgpu.decode_e2m1_bits``, "select": no bfloat16 subnormal, which XLA may flush) into
    two [N, K/2] halves concatenated along K, x permuted the same way (even elements, then odd):
    one GEMM, no nibble interleave;
  * "xla-int-2dot": the same halves in two GEMMs of K/2 (float32 sums added);
  * "tiles[-MTxBK][-sS][-cC][-nofold][-w2][-r][-n]": the Mosaic GPU kernel with the decode in a
    large-tile GEMM's K loop (:mod:`jax_mxfp4.kernels.wgemm_tiles_mgpu`) on the weight prepared
    once by ``prepare_decode`` (outside the timed calls: the serving form; "-n": the plain weight's
    natural bytes, the "natural" decode, its scales transposed to K-major inside each call, as
    dispatch does), default tiling or ``TilesConfig(mt=MT, bk=BK, stages=S, chunks=C, fold_scale=not
    nofold, wn=2 if w2, registers=r)``; checked with a float32 output, or bfloat16 (the bound plus its rounding,
    2^-8 |ref|) where a float32 output tile does not fit in shared memory;
  * "pallas-prepared": ``jax_mxfp4.dot_general`` (backend "pallas") with that prepared weight:
    the route dispatch gives a prepared weight;
  * "pallas-two-pass": "pallas" with the Mosaic GPU routes switched off
    (``backends.pallas.W4A16_MOSAIC_GPU = False`` while this variant is checked and timed: its GEMM
    is lowered after tracing, by custom partitioning): the two-pass route.

Each variant is checked against a float64 reference of x · dequantize(W)ᵀ (bf16 products exact,
float32 accumulation: |error| <= 2 K 2^-24 sum|x||w|) before it is timed, on activation rows
spread over every 128-row tile (the first and last 8 rows and 3 rows of each tile), all N
columns. Timing: fair
(``common.time_fn``) and the profiler (``common.kernel_time``: kernel names show whether the
decode was fused). Writes JSON and a PNG.

Usage: python benchmarks/xla_dequant_probe.py [--shapes 1024x8192x8192,...] [--only bf16,pallas,...]
[--out DIR] [--check-only] [--w-exp E] (bf16 is always timed first: the base of every ratio).
Exit status 1 when any variant failed its check or could not run (e.g. "tiles" off a Hopper GPU).
(shapes MxKxN; on CPU use small ones, e.g. --shapes 64x256x128: timings there mean nothing).
"""

from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

from benchmarks.common import device_info, kernel_time, n_sets_for, out_dir, save_figure, time_fn, write_json  # noqa: E402

DIMS2 = (((1,), (1,)), ((), ()))
VARIANTS = ("bf16", "pallas", "xla-f4", "xla-int-cat", "xla-int-2dot", "tiles", "pallas-prepared", "pallas-two-pass")


def uses_prepared(name):
    """Whether a variant takes the weight from prepare_decode ("pallas-prepared", "tiles" without "-n")."""
    return name == "pallas-prepared" or (name.startswith("tiles") and tiles_order(name) == "lanes")


def tiles_order(name):
    """The weight byte order of a "tiles..." variant: "natural" with "-n", else "lanes"."""
    return "natural" if "n" in name.split("-")[1:] else "lanes"


def tiles_config(name):
    """TilesConfig of a "tiles[-MTxBK][-sS][-cC][-nofold][-w2][-r][-n]" variant name (None: the
    default tiling of its byte order); ValueError for a name that does not parse."""
    from jax_mxfp4.kernels.wgemm_tiles_mgpu import TilesConfig

    parts = name.split("-")
    if parts[0] != "tiles":
        raise ValueError(name)
    if len(parts) == 1:
        return None
    kw = {}
    for p in parts[1:]:
        if re.fullmatch(r"\d+x\d+", p):
            kw["mt"], kw["bk"] = map(int, p.split("x"))
            kw.setdefault("chunks", kw["bk"] // 64 if kw["bk"] <= 128 else 2)
        elif re.fullmatch(r"[sc]\d+", p):
            kw["stages" if p[0] == "s" else "chunks"] = int(p[1:])
        elif p == "nofold":
            kw["fold_scale"] = False
        elif p == "w2":
            kw["wn"] = 2
        elif p == "r":
            kw["registers"] = True
        elif p == "n":
            kw["decode"] = "natural"
        else:
            raise ValueError(name)
    if set(kw) <= {"decode"}:
        return None  # "tiles-n": the default tiling of natural bytes
    return TilesConfig(**kw)


def base_variant(name):
    """The VARIANTS entry a name belongs to ("tiles-..." -> "tiles")."""
    return "tiles" if name.startswith("tiles") else name


def _scale_bf16(scales):
    """E8M0 scales (float8_e8m0fnu [N, K/32]) -> bf16 2^(b-127), NaN for 0xFF."""
    from jax_mxfp4.mx_format import as_scale_bytes, e8m0_to_bf16_bits

    return lax.bitcast_convert_type(e8m0_to_bf16_bits(as_scale_bytes(scales)), jnp.bfloat16)


def dequant_f4(data, scales):
    """uint8 [N, K/2] + scales [N, K/32] -> bf16 [N, K] through the float4_e2m1fn dtype."""
    n, hk = data.shape
    w = lax.bitcast_convert_type(data, jnp.float4_e2m1fn).reshape(n, 2 * hk).astype(jnp.bfloat16)
    return (w.reshape(n, -1, 32) * _scale_bf16(scales)[..., None]).reshape(n, 2 * hk)


def dequant_halves(data, scales):
    """uint8 [N, K/2] + scales -> bf16 (lo, hi) [N, K/2]: elements 2j and 2j+1, by integer ops."""
    from jax_mxfp4.kernels.wgemm_mgpu import decode_e2m1_bits

    n, hk = data.shape
    s = jnp.repeat(_scale_bf16(scales), 16, axis=1)  # one scale per byte
    return decode_e2m1_bits(data & 15, "select") * s, decode_e2m1_bits(data >> 4, "select") * s


def variant_fn(name, out_dtype):
    """fn(x, w) for a variant; w: an MXFP4Array [N, K] along axis 1 (bf16 [N, K] for "bf16")."""
    import jax_mxfp4 as mx

    if name == "bf16":
        return lambda x, w: lax.dot_general(x, w, DIMS2, preferred_element_type=out_dtype)
    if name == "pallas":
        recipe = mx.Recipe(backend="pallas", quantize_activations=False)
        return lambda x, w: mx.dot_general(x, w, DIMS2, preferred_element_type=out_dtype, recipe=recipe)
    if name.startswith("tiles"):
        from jax_mxfp4.kernels.wgemm_tiles_mgpu import mgpu_w4a16_tiles

        cfg, order = tiles_config(name), tiles_order(name)
        if order == "natural":  # a plain MXFP4Array: scales [N, K/32] to K-major per call
            from jax_mxfp4.mx_format import as_scale_bytes

            return lambda x, w: mgpu_w4a16_tiles(x, w.data, as_scale_bytes(w.scales).T, out_dtype, cfg, "natural")
        return lambda x, w: mgpu_w4a16_tiles(x, w.data, w.scales, out_dtype, cfg)
    if name in ("pallas-prepared", "pallas-two-pass"):  # two-pass: main() switches the Mosaic GPU routes off
        recipe = mx.Recipe(backend="pallas", quantize_activations=False)
        return lambda x, w: mx.dot_general(x, w, DIMS2, preferred_element_type=out_dtype, recipe=recipe)
    if name == "xla-f4":
        return lambda x, w: lax.dot_general(x, dequant_f4(w.data, w.scales), DIMS2, preferred_element_type=out_dtype)

    def halves(x, w):
        lo, hi = dequant_halves(w.data, w.scales)
        xr = x.reshape(x.shape[0], -1, 2)
        return (xr[..., 0], xr[..., 1]), (lo, hi)

    if name == "xla-int-cat":
        def cat(x, w):
            (xe, xo), (lo, hi) = halves(x, w)
            return lax.dot_general(jnp.concatenate([xe, xo], 1), jnp.concatenate([lo, hi], 1), DIMS2,
                                   preferred_element_type=out_dtype)
        return cat

    def two(x, w):
        (xe, xo), (lo, hi) = halves(x, w)
        f = lambda a, b: lax.dot_general(a, b, DIMS2, preferred_element_type=jnp.float32)  # noqa: E731
        return (f(xe, lo) + f(xo, hi)).astype(out_dtype)
    return two


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1024x8192x8192,8192x8192x8192", help="comma list of MxKxN")
    ap.add_argument("--only", default="", help="comma list of variants (default: all)")
    ap.add_argument("--out", default="results/xla_dequant_probe")
    ap.add_argument("--check-only", action="store_true", help="check every variant's values, time nothing")
    ap.add_argument("--w-exp", type=int, default=0,
                    help="weights times 2^E (E8M0 scale bytes near 127 + E: E > 1 takes the kernels' two-multiply "
                         "decode instead of the folded one)")
    args = ap.parse_args()
    try:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
        if not all(len(s) == 3 and min(s) > 0 and s[1] % 64 == 0 for s in shapes):
            raise ValueError(args.shapes)
    except ValueError:
        ap.error(f"--shapes: comma list of MxKxN with K a multiple of 64, got {args.shapes!r}")
    if not -100 <= args.w_exp <= 100:  # 2^E times normal(0, 1) stays finite and normal in bf16
        ap.error(f"--w-exp must be in [-100, 100] (weights times 2^E stay finite, normal bfloat16), got {args.w_exp}")
    names = [v for v in args.only.split(",") if v] or list(VARIANTS)
    try:
        for v in names:
            if base_variant(v) not in VARIANTS:
                raise ValueError(v)
            if v.startswith("tiles"):
                tiles_config(v)
    except (ValueError, TypeError) as e:
        ap.error(f"--only: choose from {VARIANTS} (tiles as tiles[-MTxBK][-sS][-cC][-nofold][-w2][-r][-n]); {e}")
    names = ["bf16"] + [v for v in dict.fromkeys(names) if v != "bf16"]  # bf16 first: every ratio's base
    import jax_mxfp4 as mx

    out = out_dir(args.out)
    rows, info = [], device_info()
    print(f"{'shape':>18} {'variant':22} {'ok':>4} {'fair ms':>9} {'kernel ms':>10} {'ratio':>6}  kernels", flush=True)
    for m, k, n in shapes:
        nsets = 1 if args.check_only else n_sets_for(2 * n * k + 2 * m * k)
        keys = [jax.random.split(jax.random.key(7 + i)) for i in range(nsets)]
        xs = [jax.random.normal(a, (m, k), jnp.bfloat16) for a, _ in keys]
        wb = [jax.random.normal(b, (n, k), jnp.bfloat16) * jnp.bfloat16(2.0**args.w_exp) for _, b in keys]
        wq = [mx.quantize(w, 1) for w in wb]
        wp = [mx.prepare_decode(w) for w in wq] if any(uses_prepared(v) for v in names) else None
        # check: float64 reference on rows spread over every 128-row tile (first and last 8, 3 per tile)
        check_rows = np.unique(np.concatenate([np.arange(min(8, m)), np.arange(max(0, m - 8), m)] + [
            np.clip(t + np.array([0, 61, 127]), 0, m - 1) for t in range(0, m, 128)]))
        xr = np.asarray(xs[0], np.float64)[check_rows]
        wr = np.asarray(mx.dequantize(wq[0]), np.float64)
        ref, mag = xr @ wr.T, np.abs(xr) @ np.abs(wr).T
        base = None
        from jax_mxfp4.backends import pallas

        for name in names:
            row = {"shape": [m, k, n], "variant": name}
            # "pallas-two-pass": the switch stays off until the variant is timed (its GEMM is lowered
            # by jax_mxfp4.partitioning's custom partitioning, after tracing)
            pallas.W4A16_MOSAIC_GPU = False if name == "pallas-two-pass" else None
            jax.clear_caches()  # an executable compiled with the other setting has the same HLO (run d reused one)
            try:
                wsets = wb if name == "bf16" else wp if uses_prepared(name) else wq
                tol = 2 * k * 2.0**-24 * mag + 2.0**-126
                try:
                    got = jax.jit(variant_fn(name, jnp.float32))(xs[0], wsets[0])
                except ValueError as e:  # a float32 output tile that does not fit: check bfloat16
                    if "shared memory" not in str(e):
                        raise
                    got = jax.jit(variant_fn(name, jnp.bfloat16))(xs[0], wsets[0])
                    tol = tol + 2.0**-8 * np.abs(ref)
                    row["checked_dtype"] = "bfloat16"
                got = np.asarray(got, np.float64)[check_rows]
                bad = ~(np.abs(got - ref) <= tol)
                row["ok"] = bool(name == "bf16" or not bad.any())
                if not row["ok"]:  # where: which activation rows / weight columns (tiles of 128)
                    r, c = np.nonzero(bad)
                    row["bad"] = {"count": int(bad.sum()), "of": int(bad.size), "rows": sorted(set(
                        check_rows[r].tolist()))[:16], "col_tiles": sorted(set((c // 128).tolist()))[:16]}
                    print(f"  {name}: {row['bad']}", flush=True)
                fn = variant_fn(name, jnp.bfloat16)
                sets = list(zip(xs, wsets))
                row["fair_s"] = None if args.check_only else time_fn(fn, sets)["median_s"]
                kt = {"error": "--check-only"} if args.check_only else kernel_time(fn, sets)
                if "error" not in kt:
                    row["kernel_s"] = kt["kernel_s"]
                    row["kernels"] = sorted(kt["kernels"].items(), key=lambda kv: -kv[1])[:4]
            except Exception as e:  # noqa: BLE001 - a variant XLA cannot compile is a result
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            if name == "bf16":
                base = row
            t, tb = row.get("kernel_s", row.get("fair_s")), (base or {}).get("kernel_s", (base or {}).get("fair_s"))
            row["ratio"] = t / tb if t and tb else None
            rows.append(row)
            ks = "; ".join(f"{kn[:40]} {kv * 1e3:.3f}" for kn, kv in row.get("kernels", []))
            print(f"{'x'.join(map(str, (m, k, n))):>18} {name:22} {str(row.get('ok', '-')):>4} "
                  f"{(row.get('fair_s') or float('nan')) * 1e3:9.4f} {row.get('kernel_s', float('nan')) * 1e3:10.4f} "
                  f"{row['ratio'] or float('nan'):6.3f}  {ks or row.get('error', '')}", flush=True)
    write_json(os.path.join(out, "xla_dequant_probe.json"), {"device": info, "rows": rows,
                                                             "ratio": "kernel time (else fair) / bf16's, same run"})
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.5))
        labels = [f"{r['variant']}\n{r['shape'][0]}" for r in rows if r.get("ratio")]
        ax.bar(range(len(labels)), [r["ratio"] for r in rows if r.get("ratio")])
        ax.axhline(1.05, color="k", lw=0.8, ls="--")
        ax.set_xticks(range(len(labels)), labels, fontsize=7)
        ax.set_ylabel("time / bf16 time")
        save_figure(fig, out, "xla_dequant_probe")
    except Exception as e:  # noqa: BLE001
        print(f"(no figure: {e})")
    bad = [f"{r['variant']} {'x'.join(map(str, r['shape']))}" for r in rows if "error" in r or r.get("ok") is False]
    if bad:
        print(f"{len(bad)} variant(s) failed their check or could not run: {', '.join(bad)}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
