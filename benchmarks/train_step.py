"""Training-step benchmark: one linear layer and one MLP block, bf16 against MXFP4, one process.

Configs (T tokens):
  linear  Y = X·W,              X [T, K], W [K, N], T = K = N = 8192
  mlp     Y = gelu(X·W1)·W2,    d = 8192, hidden 4d, T = 8192
  mlp-d1024  the same with d = 1024 (the MLP block of ``jax_mxfp4.demo --size large``)

One step = forward + backward for a fixed random cotangent dY (``jax.vjp`` in one jitted
function): the output Y and the gradients with respect to X and every weight, all quantization
included (Y is returned: before 2026-11-30 session 4 it was not, and XLA dropped the forward GEMM
of the linear config from both the bf16 and the MXFP4 step). Variants:
  bf16           ``lax.dot_general`` on bfloat16 operands (float32 accumulation, bf16 out), JAX's VJP;
  mxfp4          :func:`jax_mxfp4.dense`, ``Recipe()``: fprop, dgrad and wgrad in MXFP4 (dY
                 stochastically rounded), each GEMM on the backend "auto" picks at precision
                 DEFAULT (on an H200: the FP8 path for these shapes);
  mxfp4-nearest  the same with ``grad_rounding="nearest"`` (every quantization round to nearest);
  mxfp4-highest  ``Recipe(precision="highest")``: the exact float32-accumulation backends;
  The plain names run the library default ``JAX_MXFP4_FUSED_TRAINING=sr`` (since session 14):
                 dY's stochastic quantizations straight to the FP8 operand by one kernel reading
                 rows (jax_mxfp4/kernels/fp8_quantize.py; wgrad's dY transposed by XLA first),
                 the round-to-nearest operands by the quantizer, then the encode kernel;
  *-unfused      ``JAX_MXFP4_FUSED_TRAINING=0``: every operand in two passes;
  *-fused        ``JAX_MXFP4_FUSED_TRAINING=1``: every operand through the fused kernel, which
                 reads the strided operands in its transposed layout (no XLA transpose);
  *-tiled        ``JAX_MXFP4_FUSED_TRAINING=tiled``: every operand through the two-pass tiled
                 kernel (jax_mxfp4/kernels/fp8_quantize_tiled.py), both layouts, no XLA transpose;
  *-rows         ``JAX_MXFP4_FUSED_TRAINING=rows`` (the default before session 14): every operand
                 through the one-pass kernel reading rows, strided ones transposed by XLA first;
  mxfp4-rbg-key[-unfused|-fused|-tiled|-rows]  with an explicit "rbg" key (see KEY_IMPL): the fused kernels
                 read the uniforms XLA draws (the reference's draw), threefry keys have them
                 generated in the kernel.
With ``--kernel``: the fused quantize-to-FP8 kernel alone on a bf16 [T, K] array (both layouts,
XLA transpose + rows, nearest and stochastic rounding with a threefry and an rbg key, a few
tiles) against a bf16 copy (x + 1) and the unfused passes (the quantizer kernel, then the MXFP4
-> FP8 encode: ``encode_rows_on``, its Pallas kernel on CUDA), each checked bit for bit.
Timing: benchmarks/common.time_fn (fair timing). Reports ms/step, time relative to bf16 and
tokens/s, and the backend "auto" chose for each of the linear layer's GEMMs.

Usage: python benchmarks/train_step.py [--quick] [--kernel [--kernel-shape TxK]] [--profile] [--configs linear,mlp,mlp-d1024] [--variants bf16,mxfp4,...] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

import jax_mxfp4 as mx  # noqa: E402
from benchmarks.common import device_info, kernel_time, out_dir, time_fn, write_json  # noqa: E402
from jax_mxfp4.training import DEFAULT_FUSED_MODE, FUSED_ENV  # noqa: E402

FULL = {"linear": dict(t=8192, k=8192, n=8192), "mlp": dict(t=8192, d=8192),
        "mlp-d1024": dict(t=8192, d=1024)}  # the demo's large size: one MLP block of its step
QUICK = {"linear": dict(t=64, k=64, n=96), "mlp": dict(t=64, d=64), "mlp-d1024": dict(t=64, d=32)}
VARIANTS = {
    "bf16": None,
    "mxfp4": mx.Recipe(),
    "mxfp4-unfused": mx.Recipe(),
    "mxfp4-nearest": mx.Recipe(grad_rounding="nearest"),
    "mxfp4-highest": mx.Recipe(precision="highest"),
    "mxfp4-fused": mx.Recipe(),
    "mxfp4-nearest-fused": mx.Recipe(grad_rounding="nearest"),
    "mxfp4-rbg-key": mx.Recipe(),  # an explicit "rbg" key: SR uniforms from XLA's RngBitGenerator
    "mxfp4-rbg-key-unfused": mx.Recipe(),
    "mxfp4-rbg-key-fused": mx.Recipe(),  # rbg key + every pass fused (SR: the kernel reads the drawn uniforms)
    "mxfp4-tiled": mx.Recipe(),
    "mxfp4-nearest-tiled": mx.Recipe(grad_rounding="nearest"),
    "mxfp4-rbg-key-tiled": mx.Recipe(),
    "mxfp4-rows": mx.Recipe(),
    "mxfp4-rbg-key-rows": mx.Recipe(),
}
FUSED_MODE = ({v: "0" for v in VARIANTS if v.endswith("-unfused")} | {v: "1" for v in VARIANTS if v.endswith("-fused")}
              | {v: "tiled" for v in VARIANTS if v.endswith("-tiled")} | {v: "rows" for v in VARIANTS if v.endswith("-rows")})
"""$JAX_MXFP4_FUSED_TRAINING per variant ("0" unfused, "1" every pass fused, "tiled" every pass
through the two-pass tiled kernel, "rows" the one-pass kernel for every operand (the default
before session 14)); the others run the
library's default (``jax_mxfp4.training.DEFAULT_FUSED_MODE``, "sr": the fused kernel for dY's
stochastic quantizations, the unfused passes for the round-to-nearest operands)."""
KEY_IMPL = {v: "rbg" for v in VARIANTS if v.startswith("mxfp4-rbg-key")}
"""Variants given an explicit rounding key of this PRNG implementation (the others use the
data-derived key, threefry: bit-identical SR then costs ~80 integer operations per element)."""


class _env:
    """Set (or leave) one environment variable while the step is traced and timed."""

    def __init__(self, name, value):
        self.name, self.value = name, value

    def __enter__(self):
        self.old = os.environ.get(self.name)
        if self.value is not None:
            os.environ[self.name] = self.value

    def __exit__(self, *exc):
        if self.old is None:
            os.environ.pop(self.name, None)
        else:
            os.environ[self.name] = self.old


def _bf16_dense(x, w):
    return lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())), preferred_element_type=jnp.bfloat16)


def layer_fns(config, recipe, key_impl=None):
    key = None if key_impl is None else jax.random.key(0, impl=key_impl)
    dense = _bf16_dense if recipe is None else (lambda x, w: mx.dense(x, w, recipe=recipe, key=key))
    if config == "linear":
        return lambda x, w: dense(x, w)
    return lambda x, w1, w2: dense(jax.nn.gelu(dense(x, w1)), w2)


def shapes(config, s):
    if config == "linear":
        return (s["t"], s["k"]), [(s["k"], s["n"])], (s["t"], s["n"])
    return (s["t"], s["d"]), [(s["d"], 4 * s["d"]), (4 * s["d"], s["d"])], (s["t"], s["d"])


def make_step(f):
    """Forward and backward: returns (Y, dX, dW...). Y is returned so that the forward GEMM is
    part of the timed program (unused, XLA would drop it: dX and dW need only the residuals)."""
    def step(x, *rest):
        *ws, dy = rest
        y, pull = jax.vjp(f, x, *ws)
        return (y, *pull(dy))

    return step


def make_set(config, s, seed):
    xs, wss, ys = shapes(config, s)
    keys = jax.random.split(jax.random.key(seed), 2 + len(wss))
    x = jax.random.normal(keys[0], xs, jnp.bfloat16)
    ws = [(jax.random.normal(kk, sh, jnp.float32) / sh[0] ** 0.5).astype(jnp.bfloat16) for kk, sh in zip(keys[2:], wss)]
    dy = jax.random.normal(keys[1], ys, jnp.bfloat16)
    return (x, *ws, dy)


def routing(s):
    """Backend "auto" picks for the linear layer's fprop, dgrad and wgrad (canonical shapes)."""
    t, k, n = s["t"], s["k"], s["n"]
    sds = lambda *sh: jax.ShapeDtypeStruct(sh, jnp.bfloat16)  # noqa: E731
    tn = (((1,), (1,)), ((), ()))
    out = {}
    for name, (m_, n_, k_) in {"fprop": (t, n, k), "dgrad": (t, k, n), "wgrad": (n, k, t)}.items():
        d = mx.explain(sds(m_, k_), sds(n_, k_), tn)
        out[name] = {"backend": d.backend, "contract": d.contract, "mnk": [m_, n_, k_]}
    return out


CHECK_KEYS = (None, "rbg")
"""Rounding keys of ``--check-fused``: the data-derived threefry key (uniforms generated in the
fused kernel) and an explicit rbg key (the reference's uniforms drawn by XLA, read by the kernel)."""


def check_fused(config, s, sets, report=lambda c: None):
    """The fused and unfused training passes on the device: step outputs (Y, dX, dW) compared
    bit for bit (expected identical: same quantized operands, same GEMMs), for both fused modes
    (rows, the default: strided operands transposed by XLA first; all: the kernel's transposed
    layout) and both rounding keys of :data:`CHECK_KEYS` (stochastic rounding of dY in dgrad and
    wgrad). Off CUDA the fused kernels run in the Pallas interpreter on backend "fp8" ("auto"
    would route the GEMMs to "xla", where no fused kernel runs and the comparison would hold
    trivially). ``fused_kernels``: pallas_calls in the fused step; ``fp8_quantize_kernels``: the
    fused quantize-to-FP8 kernels among them (6 when every operand of the three GEMMs is fused).
    ``report`` is called with each result as it comes (a run cut by a timeout keeps its lines)."""
    import re

    from jax_mxfp4.dispatch import current_platform

    cuda = current_platform() == "cuda"
    modes, recipe = ((("rows", "1", "tiled", "sr"), mx.Recipe()) if cuda
                     else (("interpret-rows", "interpret", "interpret-tiled", "interpret-sr"), mx.Recipe(backend="fp8")))
    out = []
    for key_impl in CHECK_KEYS:
        key_name = key_impl or "data-derived (threefry)"
        try:
            with _env(FUSED_ENV, "0"):
                want = jax.jit(make_step(layer_fns(config, recipe, key_impl)))(*sets[0])
        except Exception as e:  # record, keep going
            out.append({"config": config, "key": key_name, "error": f"unfused step: {type(e).__name__}: {str(e)[:300]}"})
            report(out[-1])
            continue
        for mode in modes:
            try:
                with _env(FUSED_ENV, mode):
                    step = make_step(layer_fns(config, recipe, key_impl))
                    jaxpr = str(jax.make_jaxpr(step)(*sets[0]))
                    got = jax.jit(step)(*sets[0])
                same = [bool(jnp.array_equal(a, b)) for a, b in zip(got, want)]
                diff = [float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))) for a, b in zip(got, want)]
                out.append({"config": config, "key": key_name, "bit_identical": same, "max_abs_diff": diff,
                            "fused_mode": mode, "fused_kernels": jaxpr.count("pallas_call"),
                            "fp8_quantize_kernels": len(re.findall(r"name=(?:mxfp4_quantize_fp8|mxfp4_fp8_tile_values)",
                                                                   jaxpr))})
            except Exception as e:  # record, keep going
                out.append({"config": config, "key": key_name, "fused_mode": mode,
                            "error": f"{type(e).__name__}: {str(e)[:300]}"})
            report(out[-1])
        del want
    return out


def profile_step(config, variant, recipe, sets, top=25, hlo_dir=None):
    """Per-kernel device time of one step (``benchmarks.common.kernel_time``: profiler kernel
    durations per call, 4 distinct calls in one program): where the step's time goes. With
    ``hlo_dir``: also the optimized HLO of one step, ``hlo_<config>_<variant>.txt``."""
    with _env(FUSED_ENV, FUSED_MODE.get(variant, DEFAULT_FUSED_MODE)):
        step = make_step(layer_fns(config, recipe, KEY_IMPL.get(variant)))
        if hlo_dir:
            with open(os.path.join(hlo_dir, f"hlo_{config}_{variant}.txt"), "w") as f:
                f.write(jax.jit(step).lower(*sets[0]).compile().as_text())
        kt = kernel_time(step, sets, calls=4)
    if "error" in kt:
        print(f"    profile: {kt['error']}", flush=True)
        return kt
    ranked = sorted(kt["kernels"].items(), key=lambda kv: -kv[1])
    print(f"    profile {variant}: kernels sum {kt['kernel_s'] * 1e3:.3f} ms/step; top {min(top, len(ranked))} of {len(ranked)}:",
          flush=True)
    for name, sec in ranked[:top]:
        print(f"      {sec * 1e3:8.3f} ms  {name[:110]}", flush=True)
    return {"kernel_s": kt["kernel_s"], "n_kernels": len(ranked), "top": {n: v for n, v in ranked[:top]}}


def run(args):
    sizes = QUICK if args.quick else FULL
    timing = dict(reps=3, min_program_s=0.0) if args.quick else dict(reps=5)
    rows, checks = [], []
    t0 = time.time()
    for config, s in sizes.items():
        if args.configs and config not in args.configs:
            continue
        sets = [make_set(config, s, seed=1)]
        jax.block_until_ready(sets)
        if args.check_fused and config == "linear":
            def report(c):
                print(f"[{time.time() - t0:6.1f}s] fused vs unfused step outputs (Y, dX, dW): {c}", flush=True)

            try:
                checks += check_fused(config, s, sets, report)
            except Exception as e:  # record, keep going
                checks.append({"config": config, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                report(checks[-1])
        base = None
        for variant, recipe in VARIANTS.items():
            if args.variants and variant not in args.variants and variant != "bf16":
                continue
            try:
                with _env(FUSED_ENV, FUSED_MODE.get(variant, DEFAULT_FUSED_MODE)):
                    r = time_fn(make_step(layer_fns(config, recipe, KEY_IMPL.get(variant))), sets, **timing)
                r["status"] = "ok"
            except Exception as e:  # record, keep going
                r = {"status": "error", "reason": f"{type(e).__name__}: {str(e)[:300]}"}
            if variant == "bf16":
                base = r.get("median_s")
            if r["status"] == "ok":
                r["tokens_per_s"] = s["t"] / r["median_s"]
                if base:
                    r["time_ratio_vs_bf16"] = r["median_s"] / base
            rows.append({"config": config, **s, "variant": variant, **r})
            print(f"[{time.time() - t0:6.1f}s] {config:6s} {variant:14s} {r.get('median_s', float('nan')) * 1e3:9.3f} ms "
                  f"ratio {r.get('time_ratio_vs_bf16', float('nan')):.3f} {r['status']}", flush=True)
            if r["status"] == "ok" and (args.profile == "all" or variant in args.profile.split(",")):
                rows[-1]["profile"] = profile_step(config, variant, recipe, sets, hlo_dir=args.hlo)
        del sets
    return {"info": device_info(), "quick": args.quick, "method": __doc__.split("Usage")[0].strip(),
            "routing_linear": routing(sizes["linear"]), "rows": rows, "fused_checks": checks}


KERNEL_CONFIGS = {False: [(1, 16, True, True), (1, 16, False, True), (1, 4, True, True), (1, 4, False, True),
                          (1, 2, True, True), (2, 4, True, False), (1, 8, True, False)],
                  True: [(1, 16, True, False)]}
"""(rows per program, num_warps, plain_path, also with SR) timed per layout by ``--kernel`` with
round to nearest (and the stochastic roundings where the last field is True)."""


SR_KINDS = (None, "threefry", "rbg")
"""Roundings timed by ``--kernel``: nearest; stochastic with a threefry key (uniforms generated in
the fused kernel); stochastic with an rbg key (the reference's uniforms drawn by XLA's
RngBitGenerator inside the timed function, then read by the fused kernel)."""


def run_kernel(args):
    """The fused quantize-to-FP8 kernel alone against a bf16 copy and the unfused passes."""
    from jax_mxfp4.fp8 import encode_rows_on
    from jax_mxfp4.kernels import fp8_quantize as fq
    from jax_mxfp4.kernels import fp8_quantize_tiled as ft
    from jax_mxfp4.kernels.quantize import sr_uniforms
    from jax_mxfp4.mx_format import as_scale_bytes

    t, k = args.kernel_shape
    timing = dict(reps=3, min_program_s=0.0) if args.quick else dict(reps=5)
    from jax_mxfp4.dispatch import current_platform

    platform = current_platform()  # "cuda" (a jax Device says "gpu")
    interpret = platform not in ("cuda", "rocm")
    x = jax.random.normal(jax.random.key(3), (t, k), jnp.bfloat16)
    kd = jax.random.key_data(jax.random.key(4))
    rbg = jax.random.key(5, impl="rbg")
    sets = [(x + i, kd) for i in range(4)]  # 4 x 128 MiB at 8192^2: > 3x the H200's L2
    jax.block_until_ready(sets)
    moved = t * k * (2 + 1 + 1 / 32)  # bytes read + written by the fused kernel
    rows, t0 = [], time.time()

    def add(name, fn, nbytes):
        try:
            r = time_fn(fn, sets, **timing)
            r.update(status="ok", gb_per_s=nbytes / r["median_s"] / 1e9)
        except Exception as e:  # record, keep going
            r = {"status": "error", "reason": f"{type(e).__name__}: {str(e)[:300]}"}
        rows.append({"case": name, "t": t, "k": k, **r})
        print(f"[{time.time() - t0:6.1f}s] {name:52s} {r.get('median_s', float('nan')) * 1e3:8.3f} ms "
              f"{r.get('gb_per_s', float('nan')):7.0f} GB/s {r['status']}", flush=True)

    def key_of(sr, kd):
        return None if sr is None else jax.random.wrap_key_data(kd) if sr == "threefry" else rbg

    def fused(x, kd, tr, sr, cfg=None, via_transpose=False, tiled=False):
        """What training's _fp8_fused runs: the same uniforms as quantize(x, axis, key) (rbg: the
        reference's draw [rows, kq/32, 32], the quantized axis last, read by the kernel)."""
        n_out, kq = (x.shape[1], x.shape[0]) if tr else x.shape
        uniform, key_data = (None, None) if sr is None else sr_uniforms(key_of(sr, kd), (n_out, kq // 32, 32))
        if via_transpose and tr:  # rows mode: XLA's transpose, then the rows kernel
            x, tr = x.T, False
        if tiled:  # the two-pass tiled kernel (cfg: a TiledConfig or None)
            return ft.quantize_fp8_2d_tiled(x, key_data, uniform, transposed=tr, cfg=cfg, interpret=interpret)
        return fq.quantize_fp8_2d(x, key_data, uniform, transposed=tr, cfg=cfg, interpret=interpret)

    def sr_name(sr):
        return "RN" if sr is None else f"SR {sr}"

    add("copy bf16 (x + 1)", lambda x, kd: x + jnp.bfloat16(1), 4 * t * k)
    for transposed in (False, True):
        lay = "T" if transposed else "rows"
        for rows_, warps, plain, with_sr in KERNEL_CONFIGS[transposed][:2 if args.quick else args.one_pass]:
            cfg = fq.Fp8QuantizeConfig(rows=rows_, num_warps=warps, plain_path=plain)
            for sr in (SR_KINDS if with_sr else (None,)):
                add(f"fused {lay} {sr_name(sr)} rows={rows_} warps={warps}{'' if plain else ' general-only'}",
                    lambda x, kd, tr=transposed, sr=sr, cfg=cfg: fused(x, kd, tr, sr, cfg), moved)
        for i, tcfg in enumerate(args.tiled):  # the two-pass tiled kernel; SR with the first tile
            for sr in (SR_KINDS if i == 0 else (None, "threefry")):
                add(f"tiled {lay} {sr_name(sr)} {tcfg.rows}x{tcfg.blocks} blocks w{tcfg.num_warps}",
                    lambda x, kd, tr=transposed, sr=sr, cfg=tcfg: fused(x, kd, tr, sr, cfg, tiled=True), moved)
        if transposed:  # training's default (rows mode) for operands quantized along a strided axis
            for sr in SR_KINDS:
                add(f"XLA transpose + fused rows {sr_name(sr)}",
                    lambda x, kd, sr=sr: fused(x, kd, True, sr, via_transpose=True), moved)
        axis = 0 if transposed else 1
        for sr in SR_KINDS:
            def unfused(x, kd, axis=axis, sr=sr):
                q = mx.quantize(x, axis, rounding="nearest" if sr is None else "stochastic", key=key_of(sr, kd))
                data, scales = jnp.moveaxis(q.data, axis, -1), jnp.moveaxis(as_scale_bytes(q.plain_scales()), axis, -1)
                return (*encode_rows_on(data, scales, platform), scales)

            add(f"unfused {lay} {sr_name(sr)} (quantize + encode_rows_on)", unfused, moved)
            u8 = lambda v: lax.bitcast_convert_type(v, jnp.uint8) if v.dtype.itemsize == 1 else v  # noqa: E731
            for via in ((False, True, "tiled") if transposed else (False, "tiled")):
                try:  # on the device: the fused kernel (default tile) bit for bit against the unfused passes
                    got = jax.jit(lambda x, kd, tr=transposed, sr=sr, via=via: fused(
                        x, kd, tr, sr, via_transpose=via is True, tiled=via == "tiled"))(x, kd)
                    want = jax.jit(unfused)(x, kd)
                    same = [bool(jnp.array_equal(u8(g), u8(w))) for g, w in
                            ((got[0], want[0]), (got[1], want[3]), (got[2], want[1]), (got[3], want[2]))]
                    ok = all(same)
                    print(f"    fused{({True: ' (XLA transpose + rows)', 'tiled': ' (tiled)'}).get(via, '')} == unfused "
                          f"(codes, scales, row_exp, row_flag): {same}", flush=True)
                except Exception as e:
                    ok = f"error {type(e).__name__}: {str(e)[:200]}"
                    print("    check failed:", ok, flush=True)
                rows[-1][{True: "fused_via_transpose_bit_identical", "tiled": "tiled_bit_identical"}.get(
                    via, "fused_bit_identical")] = ok
    return {"info": device_info(), "quick": args.quick, "rows": rows}


def markdown_kernel(result):
    info = result["info"]
    lines = [f"# Fused quantize-to-FP8 kernel: {info['device']} ({info['platform']}), jax {info['jax']}, "
             f"{info['date_utc']} UTC", "", "GB/s = (2 B read + 1 + 1/32 B written per element) / time; the copy "
             "moves 4 B per element.", "", "| case | T x K | ms | GB/s |", "|---|---|---|---|"]
    for r in result["rows"]:
        if r["status"] != "ok":
            lines.append(f"| {r['case']} | {r['t']}x{r['k']} | {r['status']}: {r.get('reason', '')[:80]} | |")
            continue
        same = "".join(f" ({what}: {r[name]})" for name, what in (
            ("fused_bit_identical", "fused bit-identical"),
            ("fused_via_transpose_bit_identical", "XLA transpose + fused rows bit-identical"),
            ("tiled_bit_identical", "tiled bit-identical")) if name in r)
        lines.append(f"| {r['case']}{same} | {r['t']}x{r['k']} | {r['median_s'] * 1e3:.3f} | {r['gb_per_s']:.0f} |")
    return "\n".join(lines) + "\n"


def markdown(result):
    info = result["info"]
    lines = [f"# Training step: {info['device']} ({info['platform']}), jax {info['jax']}, {info['date_utc']} UTC", "",
             "Forward (Y) + backward (dX and every dW), all quantization included; time relative to the bf16 "
             "step in the same run (< 1 is faster).", "",
             "| config | shape | variant | ms / step | vs bf16 | tokens/s |", "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        shape = f"T={r['t']} K={r['k']} N={r['n']}" if r["config"] == "linear" else f"T={r['t']} d={r['d']} hidden={4 * r['d']}"
        if r["status"] != "ok":
            lines.append(f"| {r['config']} | {shape} | {r['variant']} | {r['status']}: {r.get('reason', '')[:80]} | | |")
            continue
        lines.append(f"| {r['config']} | {shape} | {r['variant']} | {r['median_s'] * 1e3:.3f} | "
                     f"{r.get('time_ratio_vs_bf16', float('nan')):.3f}x | {r['tokens_per_s']:.4g} |")
    lines += ["", "Backends \"auto\" picks for the linear layer (Recipe(), precision DEFAULT):", ""]
    for name, d in result["routing_linear"].items():
        lines.append(f"- {name} {d['mnk'][0]}x{d['mnk'][1]}x{d['mnk'][2]}: {d['backend']} ({d['contract']})")
    for c in result.get("fused_checks", []):
        lines.append(f"- fused vs unfused passes, {c['config']} (Y, dX, dW): {c.get('bit_identical', c.get('error'))}"
                     + ("" if "error" in c else f", max |diff| {c['max_abs_diff']} ({c['fused_kernels']} fused "
                        f"kernels, {c['fp8_quantize_kernels']} of them quantize-to-FP8, ${FUSED_ENV}={c['fused_mode']}, "
                        f"key {c['key']})"))
    return "\n".join(lines) + "\n"


def check_args(ap, args):
    """Refuse names that would otherwise be skipped silently (argparse error, exit code 2): an
    unknown config or variant, a profiled variant that is not run, --hlo without --profile. Makes
    the --hlo folder."""
    for flag, names, known in (("--configs", args.configs, FULL), ("--variants", args.variants, VARIANTS),
                               ("--profile", [] if args.profile in ("", "all") else args.profile.split(","),
                                VARIANTS)):
        bad = [n for n in names if n not in known]
        if bad:
            ap.error(f"{flag}: unknown name(s) {', '.join(map(repr, bad))}; choose from {', '.join(known)}")
    if args.profile not in ("", "all") and args.variants:
        idle = [v for v in args.profile.split(",") if v and v != "bf16" and v not in args.variants]
        if idle:
            ap.error(f"--profile: {', '.join(map(repr, idle))} not among the --variants run ({','.join(args.variants)})")
    if args.hlo is not None:
        if not args.profile:
            ap.error("--hlo DIR writes the HLO of each profiled step: give --profile too")
        os.makedirs(args.hlo, exist_ok=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU CI): checks the pipeline and files")
    ap.add_argument("--out", default=None, help="output folder (default benchmarks/results/train_step[-quick])")
    ap.add_argument("--configs", default="", help="comma list of configs (default: all: linear,mlp,mlp-d1024)")
    ap.add_argument("--variants", default="", help="comma list of variants besides bf16 (default: all)")
    ap.add_argument("--kernel", action="store_true", help="time the fused quantize-to-FP8 kernel alone")
    ap.add_argument("--kernel-shape", default=None, metavar="TxK",
                    help="shape of --kernel's bf16 input [T, K] (default 8192x8192, 256x256 with --quick; "
                         "K a multiple of 32, <= 16384)")
    ap.add_argument("--tiled", default="64x4w4", metavar="RxBwW,...",
                    help="--kernel: tiles of the two-pass tiled kernel to time (rows x blocks of 32, warps; "
                         "the first also with SR), default 64x4w4")
    ap.add_argument("--one-pass", type=int, default=None, metavar="N",
                    help="--kernel: time only the first N tiles of the one-pass kernel per layout (default all)")
    ap.add_argument("--profile", nargs="?", const="all", default="", metavar="VARIANTS",
                    help="after the timing of each variant (or of the comma-listed ones), its per-kernel "
                         "device times from the profiler")
    ap.add_argument("--hlo", default=None, metavar="DIR",
                    help="with --profile: also write each profiled step's optimized HLO into DIR")
    ap.add_argument("--check-fused", action="store_true",
                    help="first compare the linear layer's gradients with and without the fused passes")
    args = ap.parse_args(argv)
    if args.kernel_shape is None:
        args.kernel_shape = (256, 256) if args.quick else (8192, 8192)
    else:  # given: checked, and used with --quick too (was ignored without --kernel or with --quick)
        if not args.kernel:
            ap.error("--kernel-shape sets the input of --kernel: give --kernel too")
        try:
            t, k = (int(v) for v in args.kernel_shape.lower().split("x"))
        except ValueError:
            ap.error(f"--kernel-shape must be TxK (two positive integers), got {args.kernel_shape!r}")
        if t < 1 or k < 32 or k % 32 or k > 16384:
            ap.error(f"--kernel-shape: T must be >= 1 and K a multiple of 32 in [32, 16384], got {args.kernel_shape!r}")
        args.kernel_shape = (t, k)
    from jax_mxfp4.kernels.fp8_quantize_tiled import TiledConfig

    tiles = []
    for v in (v.strip() for v in args.tiled.split(",")):
        m = re.fullmatch(r"(\d+)x(\d+)w(\d+)", v)
        try:
            if not m:
                raise ValueError(f"{v!r} is not RxBwW")
            tiles.append(TiledConfig(rows=int(m[1]), blocks=int(m[2]), num_warps=int(m[3])))
        except ValueError as e:
            ap.error(f"--tiled: comma-separated RxBwW tiles (powers of two), e.g. 64x4w4,128x2w8: {e}")
    args.tiled = tiles
    if args.one_pass is not None and args.one_pass < 0:
        ap.error(f"--one-pass must be >= 0, got {args.one_pass}")
    args.configs = [c for c in args.configs.split(",") if c]
    args.variants = [v for v in args.variants.split(",") if v]
    check_args(ap, args)
    here = os.path.dirname(os.path.abspath(__file__))
    out = out_dir(args.out or os.path.join(here, "results", "train_step-quick" if args.quick else "train_step"))
    name, result, md = (("fp8_quantize", r := run_kernel(args), markdown_kernel(r)) if args.kernel
                        else ("train_step", r := run(args), markdown(r)))
    write_json(os.path.join(out, f"{name}.json"), result)
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write(md)
    print(md)
    return 0 if all(r["status"] == "ok" for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
