"""Sharded MXFP4 linear layer: one device against all devices of a mesh, bf16 against MXFP4.

For a linear layer Y = X·W (X [T, K], W [K, N]) it times, in one process:
  - "fprop": Y from float operands (MXFP4: both quantized on the fly along K),
  - "train": value and gradients of sum(Y²) with respect to X and W (fprop + dgrad + wgrad),
for "bf16" (``lax.dot_general`` on bf16 operands, float32 accumulation) and "mxfp4"
(``jax_mxfp4.dot_general``, backend "auto"), on a single device and with the operands sharded
over every device in three layouts:
  - "data":       X sharded along T (data parallel; W replicated),
  - "tp-column":  W sharded along N (no collectives in fprop),
  - "tp-row":     X and W sharded along K (partial products + an all-reduce).
Scaling efficiency = t(1 device) / (devices x t(mesh)). Timing: benchmarks/common.py. Output:
sharded.json, sharded.md (the table, also printed) and sharded.png in --out (default
bench_out/sharded, bench_out/sharded-quick with --quick).

Usage: python benchmarks/sharded.py [--quick] [--out DIR] [--t T --k K --n N]
(--quick: tiny shapes on QUICK_DEVICES devices (simulated CPU devices when given on the command
line: it sets XLA_FLAGS before JAX starts), few iterations: checks the pipeline in seconds.)
"""

from __future__ import annotations

import argparse
import os
import sys

QUICK_DEVICES = 4
QUICK_SHAPE = (128, 128, 128)  # T, K, N
if "--quick" in sys.argv and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={QUICK_DEVICES}").strip()

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_mxfp4 as mx  # noqa: E402
from benchmarks.common import default_out, device_info, save_figure, out_dir, time_fn, write_json  # noqa: E402

DIMS = (((1,), (0,)), ((), ()))
LAYOUTS = {"data": (P("x", None), P(None, None)), "tp-column": (P(None, None), P(None, "x")),
           "tp-row": (P(None, "x"), P("x", None))}


def layer_fns(variant):
    if variant == "bf16":
        def fwd(x, w):
            return lax.dot_general(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), DIMS,
                                   preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    else:
        def fwd(x, w):
            return mx.dot_general(x, w, DIMS, preferred_element_type=jnp.bfloat16)

    def train(x, w):
        return jax.value_and_grad(lambda a, b: jnp.sum(fwd(a, b).astype(jnp.float32) ** 2), argnums=(0, 1))(x, w)

    return {"fprop": fwd, "train": train}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help=f"T=K=N={QUICK_SHAPE[0]} on {QUICK_DEVICES} simulated CPU devices, few iterations")
    p.add_argument("--out", default=None, help="output folder (default bench_out/sharded, bench_out/sharded-quick)")
    p.add_argument("--t", type=int, default=8192, help="tokens (rows of X)")
    p.add_argument("--k", type=int, default=8192, help="inputs (contraction length)")
    p.add_argument("--n", type=int, default=8192, help="outputs")
    args = p.parse_args(argv)
    for flag in ("t", "k", "n"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    t, k, n = QUICK_SHAPE if args.quick else (args.t, args.k, args.n)
    out = out_dir(args.out or default_out("sharded-quick" if args.quick else "sharded"))
    devices = jax.devices()[:QUICK_DEVICES] if args.quick else jax.devices()
    ndev = len(devices)
    if ndev < 2:
        print(f"note: only {ndev} device: the mesh layouts run on that one device")
    mesh = jax.make_mesh((ndev,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), devices=devices)
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (t, k), jnp.bfloat16)
    w = (jax.random.normal(kw, (k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    timing = dict(reps=3, min_program_s=0.0) if args.quick else {}
    rows = []
    for variant in ("bf16", "mxfp4"):
        for step, fn in layer_fns(variant).items():
            single = time_fn(fn, [(x, w)], **timing)["median_s"]
            row = {"variant": variant, "step": step, "t": t, "k": k, "n": n, "devices": ndev, "single_s": single}
            for name, (xs, ws) in LAYOUTS.items():
                with jax.set_mesh(mesh):
                    xx = jax.device_put(x, NamedSharding(mesh, xs))
                    ww = jax.device_put(w, NamedSharding(mesh, ws))
                    sec = time_fn(fn, [(xx, ww)], **timing)["median_s"]
                row[f"{name}_s"] = sec
                row[f"{name}_efficiency"] = single / (ndev * sec)
            rows.append(row)
            print(f"{variant:6s} {step:6s} 1 dev {single * 1e3:9.3f} ms | " + " | ".join(
                f"{name} {row[f'{name}_s'] * 1e3:8.3f} ms (eff {row[f'{name}_efficiency']:.2f})" for name in LAYOUTS))
    by = {(r["variant"], r["step"]): r for r in rows}
    lines = [f"Sharded linear layer T={t} K={k} N={n} on {ndev} x {device_info()['device']}", "",
             "| step | layout | bf16 ms | MXFP4 ms | MXFP4 / bf16 | MXFP4 scaling efficiency |", "|---|---|---|---|---|---|"]
    for step in ("fprop", "train"):
        for name in ("single",) + tuple(LAYOUTS):
            key = f"{name}_s"
            b, m = by[("bf16", step)][key], by[("mxfp4", step)][key]
            eff = "1.00" if name == "single" else f"{by[('mxfp4', step)][f'{name}_efficiency']:.2f}"
            lines.append(f"| {step} | {name if name != 'single' else '1 device'} | {b * 1e3:.3f} | {m * 1e3:.3f} | {m / b:.2f}x | {eff} |")
    table = "\n".join(lines)
    print(table)
    with open(os.path.join(out, "sharded.md"), "w") as f:
        f.write(table + "\n")
    write_json(os.path.join(out, "sharded.json"), {"info": device_info(), "rows": rows})
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = ("single",) + tuple(LAYOUTS)
    for i, variant in enumerate(("bf16", "mxfp4")):
        vals = [by[(variant, "train")][f"{nm}_s"] * 1e3 for nm in names]
        ax.bar(np.arange(len(names)) + 0.4 * i, vals, 0.4, label=variant)
    ax.set_xticks(np.arange(len(names)) + 0.2, ["1 device"] + list(LAYOUTS))
    ax.set_ylabel("train step (ms)")
    ax.set_title(f"linear layer {t}x{k}x{n}, {ndev} devices")
    ax.legend()
    save_figure(fig, out, "sharded.png")
    print(f"wrote {out}/sharded.md, sharded.json, sharded.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
