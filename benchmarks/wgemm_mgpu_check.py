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

``k_split_wgs`` variants ("ks2"/"ks4": one kernel per call, output written by the kernel) are
first run in child processes, one per variant, each with a time limit (--preflight-timeout): a
deadlock there is killed and reported, and the run goes on without that variant's structure. The
child runs the smoke case (16x256x1024: 2 K steps, so 2 stages), then the bisect cases
16x256xK with K steps = stages, stages + 1 and 2 stages + 1 (the pipeline's slots reused once,
twice), each line printed as it finishes, so a hang is placed by the last line before it.
History: on 2026-12-01 (H200, jax 0.11.2) "ks4" hung at the smoke case and "ks2" passed it; the
cause was ``plgpu.emit_pipeline_warp_specialized``'s ``setmaxnreg`` asking 4 compute warpgroups
for more registers than a 640-thread CTA is launched with (MgpuConfig.k_split_pipeline); the "ks"
variants now run the module's own pipeline ("own"), "ks2 jax" keeps jax's for comparison.

Usage: python benchmarks/wgemm_mgpu_check.py --out DIR [--budget 200] [--quick] [--only NAME,NAME,...]
       [--preflight-timeout S] [--ptxas-log]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

os.environ.setdefault("JAX_TRACEBACK_FILTERING", "off")  # keep jax's own frames in printed tracebacks

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

import jax_mxfp4 as mx  # noqa: E402
from benchmarks.gpu_check import bound_check, byte_reference, rand  # noqa: E402
from benchmarks.common import device_info, kernel_time, n_sets_for, out_dir, time_fn, write_json  # noqa: E402
from jax_mxfp4.decode_prepared import lanes_order_bytes, pair_order_bytes  # noqa: E402
from jax_mxfp4.kernels.wgemm_mgpu import MgpuConfig, kernel_scales, mgpu_w4a16, tile_major_layout  # noqa: E402
from jax_mxfp4.mx_format import as_e8m0, as_scale_bytes  # noqa: E402

DIMS2 = (((1,), (1,)), ((), ()))
XLA_W4A16 = mx.Recipe(backend="xla", quantize_activations=False)




def _one_kernel(decode="pairs", k_split_wgs=4, **more):
    """A one-kernel tiling (bk 512, 5 stages, warp-specialized) with ``more`` of MgpuConfig's fields."""
    return MgpuConfig(bk=512, split_k=1, stages=5, decode=decode, warp_specialized=True, k_split_wgs=k_split_wgs,
                      **more)


VARIANTS = {  # name -> MgpuConfig, in order of priority (timing stops at --budget)
    # "pairs" decode (2026-12-01 default): one x operand; "P" = weight bytes in the "pairs" order
    # (what prepare_decode stores; x read as it is), "N" = natural bytes (x permuted per call)
    "k pairs bk256 s4 st4 P": MgpuConfig(bk=256, split_k=4, stages=4, decode="pairs", launcher="kernel"),  # default
    "k pairs bk256 s4 st4 N": MgpuConfig(bk=256, split_k=4, stages=4, decode="pairs", launcher="kernel"),
    "k ptx bk256 s4 st4": MgpuConfig(bk=256, split_k=4, stages=4, decode="ptx", launcher="kernel"),  # session 4's
    "ws pairs bk256 s2 st4 P": MgpuConfig(bk=256, split_k=2, stages=4, decode="pairs", warp_specialized=True),
    "k pairs bk256 s2 st4 P": MgpuConfig(bk=256, split_k=2, stages=4, decode="pairs", launcher="kernel"),
    "k pairs bk512 s4 st3 P": MgpuConfig(bk=512, split_k=4, stages=3, decode="pairs", launcher="kernel"),
    "k pairs bk128 s4 st8 P": MgpuConfig(bk=128, split_k=4, stages=8, decode="pairs", launcher="kernel"),
    "k pairs bk256 s4 st2 P": MgpuConfig(bk=256, split_k=4, stages=2, decode="pairs", launcher="kernel"),
    "k pairs bk256 s8 st4 P": MgpuConfig(bk=256, split_k=8, stages=4, decode="pairs", launcher="kernel"),
    "ws pairs bk256 s4 st4 P": MgpuConfig(bk=256, split_k=4, stages=4, decode="pairs", warp_specialized=True),
    "ws raw ptx bk256 s4 st4": MgpuConfig(bk=256, split_k=4, stages=4, decode="ptx", warp_specialized=True,
                                          raw_scales=True),
    # k_split_wgs (2026-12-01): ONE kernel per call, the final [M, N] output written by the kernel
    # (no XLA split-K sum/transpose after it); "ks2"/"ks4" = compute warpgroups sharing each
    # 64-row tile's K steps, grid N/64; stages are capped by shared memory (5 at bk 512, 16 rows)
    "ks2 pairs bk512 st5 P": MgpuConfig(bk=512, split_k=1, stages=5, decode="pairs", warp_specialized=True,
                                        k_split_wgs=2),
    "ks4 pairs bk512 st5 P": MgpuConfig(bk=512, split_k=1, stages=5, decode="pairs", warp_specialized=True,
                                        k_split_wgs=4),
    # session 9 (H200 runs a, b; kernel times at 16x8192x8192): the depth changes nothing (bk 512
    # with 5 or 3 stages 20.1-20.5 us, bk 256 with 8 stages 21.1); two tried and removed: a K
    # order rotated per CTA so that fewer CTAs read one x tile at once (20.39 vs 20.33 us), and a
    # table look-up decode with a third fewer instructions per byte (prmt on the bfloat16 bytes of
    # the 8 E2M1 magnitudes: 21.69 vs 20.09 us, M = 1 24.03 vs 22.35): the decode's instruction
    # count is not what limits this kernel
    # session 10: each CTA's per-step weight block contiguous in memory ("tm": tile_major_layout,
    # one 16 KiB run per step instead of 64 row segments), and x's tiles multicast by TMA to a
    # cluster of 2 or 4 CTAs ("c2"/"c4": each CTA reads 1/2 or 1/4 of them from L2). H200 run a
    # (kernel, 16x8192x8192): 20.53 us base, tm 20.17, c2 20.55, c2 tm 20.49, c4 tm 37.23: neither limits
    "ks4 tm pairs bk512 st5 P": _one_kernel(tile_major=True),
    "ks4 c2 pairs bk512 st5 P": _one_kernel(cluster=2),
    "ks4 c2 tm pairs bk512 st5 P": _one_kernel(cluster=2, tile_major=True),
    "ks4 c4 tm pairs bk512 st5 P": _one_kernel(cluster=4, tile_major=True),
    # session 10, after run b (the compute, not the data movement, limits: benchmarks/decode_probe.py):
    # each warpgroup's tile decoded in parts, each part's WGMMAs issued before the next decodes
    # ("ch2"/"ch4"); " B" = scales given as bfloat16 [K/32, N] (kernel_scales: no E8M0 conversion
    # in the kernel, 2 bytes per block)
    "ks4 ch2 pairs bk512 st5 P": _one_kernel(chunks=2),
    "ks2 ch2 pairs bk512 st5 P": _one_kernel(k_split_wgs=2, chunks=2),
    "ks2 ch4 pairs bk512 st5 P": _one_kernel(k_split_wgs=2, chunks=4),
    "ks4 pairs bk512 st5 P B": _one_kernel(),
    "ks4 ch2 pairs bk512 st5 P B": _one_kernel(chunks=2),
    # the "lanes" decode (weight nibbles regrouped per 32-bit word, lanes_order_bytes: a mask and a
    # multiply per bfloat16x2 register instead of a byte permute and two shifts); " L" = lanes bytes.
    # H200 run d (kernel, M = 16 / 1): pairs 20.22 / 19.31, lanes 18.33 / 16.75, lanes ch2 17.78 /
    # 16.91 (the dispatch default since), ks2 lanes ch2 17.65 / 16.99; pairs ch2 20.42 / 19.41,
    # pairs B 20.29 / 18.85
    "ks4 lanes bk512 st5 L": _one_kernel("lanes"),
    "ks4 ch2 lanes bk512 st5 L": _one_kernel("lanes", chunks=2),
    "ks2 ch2 lanes bk512 st5 L": _one_kernel("lanes", k_split_wgs=2, chunks=2),
    # session 11: x 2^126 and x scale as one multiply where a warp's scale bytes are <= 128
    # (fold_scale), each step's WGMMAs waited one step late with its slot released then (delay_release).
    # H200 run a (kernel us, M = 16 / 1): lanes ch2 17.90 / 16.90, + fold 16.54 / 15.41 (the dispatch
    # default since), + delay 18.65 / 17.89, + both 17.02 / 15.90; ks2 with both: WRONG (smoke check,
    # max error 1572x the bound), each alone correct at ks2 (run b): both together are refused now.
    "ks4 ch2 lanes fold L": _one_kernel("lanes", chunks=2, fold_scale=True),
    "ks4 ch2 lanes delay L": _one_kernel("lanes", chunks=2, delay_release=True),
    "ks2 ch2 lanes fold L": _one_kernel("lanes", k_split_wgs=2, chunks=2, fold_scale=True),
    "ks2 ch2 lanes delay L": _one_kernel("lanes", k_split_wgs=2, chunks=2, delay_release=True),
    "ks4 pairs bk256 st8 P": MgpuConfig(bk=256, split_k=1, stages=8, decode="pairs", warp_specialized=True,
                                        k_split_wgs=4),
    "ks4 pairs bk512 st3 P": MgpuConfig(bk=512, split_k=1, stages=3, decode="pairs", warp_specialized=True,
                                        k_split_wgs=4),
    "ks2 pairs bk256 st8 P": MgpuConfig(bk=256, split_k=1, stages=8, decode="pairs", warp_specialized=True,
                                        k_split_wgs=2),
    "ks2 ptx bk512 st5": MgpuConfig(bk=512, split_k=1, stages=5, decode="ptx", warp_specialized=True,
                                    k_split_wgs=2),
    # jax's plgpu.emit_pipeline_warp_specialized instead of the module's own pipeline (2 compute
    # warpgroups only: MgpuConfig.k_split_pipeline); the 2026-12-01 "ks2" structure
    "ks2 jax pairs bk512 st5 P": MgpuConfig(bk=512, split_k=1, stages=5, decode="pairs", warp_specialized=True,
                                            k_split_wgs=2, k_split_pipeline="jax"),
}
# one per structure (launcher x warp specialization x scales x decode x byte order); "k" =
# plgpu.kernel + emit_pipeline, "ws" = warp-specialized, "raw" = E8M0 bytes [N, K/32] read by the
# kernel. Session 4's other "ptx" tilings and the "mul" decode: benchmarks/results/session4.
SMOKE = ["k pairs bk256 s4 st4 P", "k pairs bk256 s4 st4 N", "k ptx bk256 s4 st4", "ws pairs bk256 s2 st4 P",
         "ks2 pairs bk512 st5 P", "ks4 pairs bk512 st5 P", "ks2 ptx bk512 st5", "ks2 jax pairs bk512 st5 P",
         "ks4 tm pairs bk512 st5 P", "ks4 c2 pairs bk512 st5 P", "ks4 c2 tm pairs bk512 st5 P",
         "ks4 c4 tm pairs bk512 st5 P", "ks4 ch2 pairs bk512 st5 P", "ks2 ch2 pairs bk512 st5 P",
         "ks2 ch4 pairs bk512 st5 P", "ks4 lanes bk512 st5 L", "ks4 ch2 lanes bk512 st5 L",
         "ks2 ch2 lanes bk512 st5 L", "ks4 ch2 lanes fold L", "ks4 ch2 lanes delay L",
         "ks2 ch2 lanes fold L", "ks2 ch2 lanes delay L"]


def struct(c):
    """A variant's structure (same structure = same code path): decode, launcher, flags."""
    return (c.decode, c.warp_specialized, c.raw_scales, c.launcher, c.k_split_wgs, c.k_split_pipeline, c.cluster,
            c.tile_major, c.fold_scale, c.delay_release)


def bisect_ks(cfg):
    """The k_split_wgs bisect cases (m, n, k): 16x256xK with K steps = stages, stages + 1 and
    2 stages + 1 (the smoke case has 2 steps, so 2 stages and no slot reuse)."""
    return [(16, 256, cfg.bk * s) for s in sorted({cfg.stages, cfg.stages + 1, 2 * cfg.stages + 1})]


def edge_config(cfg):
    """The variant's config at the edge-case shape (16x256x1024, several K steps): bk 64 with two
    K splits, or for k_split_wgs its own bk (whole swizzle tiles per warpgroup), split_k 1."""
    if cfg.k_split_wgs > 1:
        return dataclasses.replace(cfg, stages=2)
    return dataclasses.replace(cfg, bk=64, split_k=2, stages=2)


def w_order(name):
    """The byte order a variant's weight is stored in (``mgpu_w4a16(w_order=...)``)."""
    if name.endswith(" L"):
        return "lanes"
    return "pairs" if name.endswith(" P") or name.endswith(" P B") else "natural"


def bf16_scales(name):
    """Whether the variant takes its scales as bfloat16 [K/32, N] (``kernel_scales``)."""
    return name.endswith(" B")


def stored(data, name):
    """The packed weight bytes as the variant ``name`` reads them."""
    if w_order(name) == "lanes":
        return lanes_order_bytes(pair_order_bytes(data))
    return pair_order_bytes(data) if w_order(name) == "pairs" else data


def call_args(name, cfg, data, scale_rows, kmajor=False):
    """(weight bytes, scales, scales_form) of ``mgpu_w4a16`` for the variant: the bytes in its
    byte order; the E8M0 scale bytes [N, K/32] as given ("rows"; ``kmajor``: transposed once to
    the kernel's K-major layout, as prepare_decode stores them, what the timing runs), bfloat16
    [K/32, N] for the " B" variants, or for ``tile_major`` both rearranged by
    ``tile_major_layout`` (K-major scales)."""
    d = stored(data, name)
    if bf16_scales(name):
        return d, kernel_scales(scale_rows), "bf16"
    if cfg.tile_major:
        d, s = tile_major_layout(d, scale_rows.T, cfg.bk)
        return d, s, "kmajor"
    return (d, scale_rows.T, "kmajor") if kmajor else (d, scale_rows, "rows")


def k_split_diagnosis(got, x, q, cfg, odt):
    """Where a failing k_split_wgs result goes wrong: rel_fro (Frobenius relative error) against
    the product of warpgroup 0's K slices only (~0: the other warpgroups' partial sums were not
    added, i.e. the barrier or shared-memory exchange), and per 64-column tile against the
    reference's values sorted (~0 while the plain comparison fails: right values, wrong places,
    i.e. the transposed store)."""
    from jax_mxfp4.kernels.wgemm_mgpu import _wg_k_slice

    k = x.shape[1]
    nb = cfg.bk // 32
    keep = np.zeros(k // 32, bool)
    _, (s0, sn), _ = _wg_k_slice(0, cfg.bk, cfg.k_split_wgs, 1)
    for t in range(k // cfg.bk):
        keep[t * nb + s0: t * nb + s0 + sn] = True
    x0 = x * jnp.asarray(np.repeat(keep, 32), x.dtype)
    rel = lambda a, b: float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
    g = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    ref = np.asarray(mx.dot_general(x, q, DIMS2, recipe=XLA_W4A16, preferred_element_type=odt).astype(jnp.float32),
                     np.float64)
    ref0 = np.asarray(mx.dot_general(x0, q, DIMS2, recipe=XLA_W4A16, preferred_element_type=odt).astype(jnp.float32),
                      np.float64)
    tiles = lambda a: np.sort(a.reshape(a.shape[0], -1, 64).transpose(1, 0, 2).reshape(a.shape[1] // 64, -1), axis=1)
    return {"rel_fro": rel(g, ref), "rel_fro_vs_wg0_slices_only": rel(g, ref0),
            "rel_fro_sorted_per_tile": rel(tiles(g), tiles(ref)),
            "nan_count": int(np.isnan(g).sum()), "zero_fraction": float(np.mean(g == 0))}


def preflight(names, args, out):
    """Runs the smoke and bisect checks of each of ``names`` in its own child process limited to
    --preflight-timeout seconds, before this process touches the GPU: a kernel that deadlocks
    (or faults, which would poison this process's CUDA context) is killed with its child instead
    of ending this run, and does not hide the other variants. Returns {name: reason} for the
    names that did not pass there (left out of this run); preflight_<i>.log has each child's
    output, the last check line before a kill placing the hang."""
    import subprocess

    left_out = {}
    for i, name in enumerate(names):
        cmd = [sys.executable, os.path.abspath(__file__), "--preflight-child", "--only", name,
               "--out", os.path.join(out, f"preflight_{i}")]
        t0 = time.time()
        try:
            env = dict(os.environ, **({"MOSAIC_GPU_DUMP_PTXAS": "1"} if args.ptxas_log else {}))
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.preflight_timeout, env=env)
            text, how = (r.stdout or "") + (r.stderr or ""), f"exit code {r.returncode}"
        except subprocess.TimeoutExpired as e:
            text = "".join(v.decode(errors="replace") if isinstance(v, bytes) else (v or "")
                           for v in (e.stdout, e.stderr))
            how = f"killed after --preflight-timeout {args.preflight_timeout:.0f} s (a hang?)"
        with open(os.path.join(out, f"preflight_{i}.log"), "w") as f:
            f.write(f"{' '.join(cmd)}\n{how}\n{text}")
        checks = [ln for ln in text.splitlines() if ln.startswith("kind=")]
        regs = sorted({ln.strip()[:160] for ln in text.splitlines() if "registers" in ln or "spill" in ln})
        print(f"preflight {name} ({time.time() - t0:.0f} s, {how}):\n" + "\n".join(checks[-12:] + regs[:8]),
              flush=True)
        if not any(ln.strip() == f"PREFLIGHT-OK {name}" for ln in text.splitlines()):
            errs = [ln[:400] for ln in checks if ("ok=False" in ln or "error=" in ln) and ln != checks[-1]]
            last = f"; last check line: {checks[-1][:400]}" if checks else "; no check finished"
            left_out[name] = (f"{how}{last}; log preflight_{i}.log; " + " | ".join(errs))[:1500]
    return left_out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/wgemm_mgpu")
    ap.add_argument("--budget", type=float, default=100.0, help="seconds after which no new timing starts")
    ap.add_argument("--quick", action="store_true", help="small shapes only (runs on CPU too: every case errors)")
    ap.add_argument("--only", default="", help="comma-separated variant names (default: all), in VARIANTS order")
    ap.add_argument("--preflight-timeout", type=float, default=90.0,
                    help="seconds for the child process that first runs the k_split_wgs variants' smoke checks")
    ap.add_argument("--ptxas-log", action="store_true",
                    help="preflight children print Mosaic GPU's ptxas log (MOSAIC_GPU_DUMP_PTXAS: registers per "
                         "thread, spills of each kernel); the summary shows its register/spill lines")
    ap.add_argument("--preflight-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    names = [nm.strip() for nm in args.only.split(",") if nm.strip()]
    unknown = [nm for nm in names if nm not in VARIANTS]
    if unknown:
        ap.error(f"--only: unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    variants = {nm: c for nm, c in VARIANTS.items() if not names or nm in names}
    smoke = [nm for nm in SMOKE if nm in variants]
    if names:  # a smoke check for every selected structure
        for nm, c in variants.items():
            if all(struct(variants[sm]) != struct(c) for sm in smoke):
                smoke.append(nm)
    out = out_dir(args.out)
    t_start = time.time()
    rows = []
    printed = set()
    left_out = {}
    if not args.preflight_child:  # before this process touches the GPU
        left_out = preflight([nm for nm in smoke if variants[nm].k_split_wgs > 1], args, out)
        smoke = [nm for nm in smoke if nm not in left_out]
        bad = {struct(VARIANTS[nm]) for nm in left_out}
        variants = {nm: c for nm, c in variants.items() if struct(c) not in bad}
    info = device_info()

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
            tb = traceback.format_exc()
            record({"kind": kind, "case": name, "ok": False, "error": f"{type(e).__name__}: {e}"[:1500],
                    "trace": tb[-6000:]})
            key = (type(e).__name__, tb.strip().splitlines()[-2][:200] if len(tb.splitlines()) > 1 else "")
            if key not in printed:  # the full traceback once per distinct failure
                printed.add(key)
                print(f"----- traceback ({name}) -----\n{tb[-6000:]}-----", flush=True)
            return None

    # ---- correctness vs backend "xla" (random data, mixed block magnitudes)
    operands = {}

    def check(m, n, k, cfg, odt, name):
        if (m, n, k) not in operands:  # drawn once per shape, shared by the variants
            operands[(m, n, k)] = (rand(100 + m + k, (m, k)).astype(jnp.bfloat16),
                                   mx.quantize(rand(200 + m + k, (n, k)), 1))
        x, q = operands[(m, n, k)]
        d, s, form = call_args(name, cfg, q.data, as_scale_bytes(q.scales))
        got = jax.jit(lambda a, d, s: mgpu_w4a16(a, d, s, odt, cfg, scales_form=form, w_order=w_order(name)))(x, d, s)
        ref = mx.dot_general(x, q, DIMS2, recipe=XLA_W4A16, preferred_element_type=odt)
        r = bound_check(got, ref, jnp.abs(x.astype(jnp.float32)), jnp.abs(mx.dequantize(q)), k,
                        odt == jnp.bfloat16)
        if not r["ok"] and cfg.k_split_wgs > 1:
            r["diag"] = guarded("diag", f"diag {name}", lambda: k_split_diagnosis(got, x, q, cfg, odt))
        record({"kind": "check", "case": f"{m}x{n}x{k} {jnp.dtype(odt).name} {name}", **r})
        return r["ok"]

    # ---- every E8M0 byte on the weight side + a NaN block, against float64 NumPy and backend "xla"
    def edge(cfg, name):
        rng = np.random.default_rng(5)
        m, n, k = 16, 256, 1024
        data = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
        sb = (np.arange(n * (k // 32), dtype=np.int64).reshape(n, k // 32) % 255).astype(np.uint8)
        sb[17, 3] = 255
        x = jnp.asarray(rng.standard_normal((m, k)) * 2.0**-10, jnp.bfloat16)
        cfg = edge_config(cfg)
        d, s, form = call_args(name, cfg, jnp.asarray(data), jnp.asarray(sb))
        got = np.asarray(jax.jit(lambda a, d, s: mgpu_w4a16(a, d, s, jnp.float32, cfg, scales_form=form,
                                                            w_order=w_order(name)))(x, d, s), np.float64)
        ref, mag = byte_reference(x, data, sb)
        fin = np.isfinite(ref) & (np.abs(ref) < 3e38)
        ok_vals = bool(np.all(np.abs(got[fin] - ref[fin]) <= 2 * k * 2.0**-24 * mag[fin] + 2.0**-126))
        # the NaN block poisons its whole output column; other columns may hold Inf/NaN legitimately
        # (scale bytes near 254 overflow float32), so their pattern is compared with backend "xla"
        ok_nan = bool(np.isnan(got[:, 17]).all())
        w_arr = mx.MXFP4Array(jnp.asarray(data), as_e8m0(jnp.asarray(sb)), 1, (n, k), jnp.float32, "floor", "plain")
        xla = np.asarray(mx.dot_general(x, w_arr, DIMS2, recipe=XLA_W4A16, preferred_element_type=jnp.float32),
                         np.float64)
        same_nan = bool(np.array_equal(np.isnan(xla), np.isnan(got)))
        ok_xla = bool(np.all(np.abs(got[fin] - xla[fin]) <= 4 * k * 2.0**-24 * mag[fin] + 2.0**-126))
        record({"kind": "check", "case": f"every E8M0 byte + NaN block ({name})",
                "ok": ok_vals and ok_nan and same_nan and ok_xla, "ok_vals": ok_vals, "ok_nan": ok_nan,
                "nan_pattern_as_xla": same_nan, "ok_vs_xla": ok_xla})
        return ok_vals and ok_nan and same_nan and ok_xla

    for name, why in left_out.items():
        record({"kind": "check", "case": f"preflight {name}", "ok": False,
                "error": f"smoke/bisect checks in a child process did not pass ({why}); its structure is "
                         "left out of this run"})
    # 1. smoke: one small case per structure (pallas_call / plgpu.kernel warp-specialized, decodes)
    alive = []
    for name in smoke:
        if guarded("check", f"smoke {name}", lambda name=name: check(16, 256, 1024, VARIANTS[name], jnp.float32, name)):
            alive.append(name)
    if args.preflight_child:  # k_split_wgs: the bisect cases, stopping at the first failure
        for name in list(alive):
            cfg = VARIANTS[name]
            for m, n, k in bisect_ks(cfg) if cfg.k_split_wgs > 1 else ():
                if not guarded("check", f"bisect {m}x{n}x{k} {name}",
                               lambda m=m, n=n, k=k, name=name: check(m, n, k, cfg, jnp.float32, name)):
                    alive.remove(name)
                    break
        for name in alive:
            print(f"PREFLIGHT-OK {name}", flush=True)
        return
    # 2. edge values for every structure that runs
    for name in alive:
        guarded("check", f"edge {name}", lambda name=name: edge(VARIANTS[name], name))
    if args.quick:
        print("quick: done")
        return
    # 3. full size, every variant whose structure ran (same structure = same decode and ws/raw flags)
    ok_structs = {struct(VARIANTS[nm]) for nm in alive}
    passed = {}
    for name, cfg in variants.items():
        if struct(cfg) in ok_structs:
            passed[name] = bool(guarded("check", f"16x8192 {name}", lambda cfg=cfg, name=name: check(
                16, 8192, 8192, cfg, jnp.bfloat16, name)))
    best = [nm for nm in variants if passed.get(nm)]
    for name in best[:3] + [nm for nm in best[3:] if VARIANTS[nm].k_split_wgs > 1]:  # padded rows, f32 out
        guarded("check", f"1x8192 {name}", lambda name=name: check(1, 8192, 8192, VARIANTS[name], jnp.float32, name))
        guarded("check", f"40x1024x4096 {name}", lambda name=name: check(40, 1024, 4096, VARIANTS[name],
                                                                          jnp.float32, name))

    # 4. timing (fair), M = 16 then M = 1
    from jax_mxfp4.kernels.wgemm import default_wconfig, weight_stationary_gemm

    timing = dict(reps=5, min_program_s=0.02, max_calls=512)
    for m in (16, 1):
        n = k = 8192
        if time.time() - t_start > args.budget:
            record({"kind": "skip", "case": f"timing M={m}", "reason": "budget"})
            continue
        n_sets = n_sets_for(n * k * 17 // 32)
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
            f = lambda a, w: lax.dot_general(a, w, DIMS2, preferred_element_type=jnp.bfloat16)
            t = time_fn(f, bsets, **timing)
            kt = kernel_time(f, bsets)
            base["s"], base["k"] = t["median_s"], kt.get("kernel_s", float("nan"))
            record({"kind": "time", "m": m, "variant": "xla bf16", "us": t["median_s"] * 1e6, "ratio": 1.0,
                    "kernel_us": base["k"] * 1e6, "calls": t["calls"]})

        guarded("time", f"bf16 M={m}", bf16)
        if "s" not in base:
            continue

        def timed(name, fn, tsets):
            if time.time() - t_start > args.budget:
                record({"kind": "skip", "m": m, "variant": name, "reason": "budget"})
                return
            t = time_fn(fn, tsets, **timing)
            kt = kernel_time(fn, tsets)
            record({"kind": "time", "m": m, "variant": name, "us": t["median_s"] * 1e6,
                    "ratio": t["median_s"] / base["s"], "calls": t["calls"],
                    "kernel_us": kt.get("kernel_s", float("nan")) * 1e6,
                    "kernel_ratio": kt.get("kernel_s", float("nan")) / base["k"],
                    "detail": {kk: v * 1e6 for kk, v in kt.get("kernels", {}).items()}})

        prepared = {}
        for name in (best if m == 16 or names else best[:4]):
            cfg = VARIANTS[name]
            if cfg.raw_scales:  # E8M0 bytes as stored, converted in the kernel
                guarded("time", f"mgpu {name} M={m}", lambda cfg=cfg, name=name: timed(
                    f"mgpu {name} (raw scale bytes)", lambda a, d, s: mgpu_w4a16(a, d, s, jnp.bfloat16, cfg), sets))
                continue
            layout = (w_order(name), cfg.bk if cfg.tile_major else None, bf16_scales(name))
            if layout not in prepared:  # the scales in the kernel's K-major layout, data in the variant's order
                prepared[layout] = [(x, *call_args(name, cfg, d, s, kmajor=True)[:2]) for x, d, s in sets]
            form = "bf16" if bf16_scales(name) else "kmajor"  # call_args(..., kmajor=True)'s form
            guarded("time", f"mgpu {name} M={m}", lambda cfg=cfg, name=name, layout=layout, form=form: timed(
                f"mgpu {name} ({form} scales)", lambda a, d, s: mgpu_w4a16(
                    a, d, s, jnp.bfloat16, cfg, scales_form=form, w_order=w_order(name)),
                prepared[layout]))
        wcfg = default_wconfig(m, n, k)
        if m == 16:
            guarded("time", f"triton M={m}", lambda: timed(
                f"triton wgemm {wcfg}", lambda a, d, s: weight_stationary_gemm(
                    a[None], d[None], s[None], out_dtype=jnp.bfloat16, cfg=wcfg)[0], sets))
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
