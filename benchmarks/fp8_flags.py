"""Rows outside the FP8 window in the demo's training step: which GEMM operands, how many.

Why: the FP8 path (jax_mxfp4/backends/fp8.py) recomputes exactly every output of a FLAG_EXACT
row (blocks whose scales span more than the 15-binade window of one row exponent, or special
blocks). On the H200 (session 7) the demo's MXFP4 step at d_model 4096 spent most of its kernel
time in that recompute (mxfp4_fp8_fix_flagged) while d_model 1024 spent little. This script runs
one step of ``jax_mxfp4.demo``'s model (``--size``, ``--d-model``) with every operand the FP8
path prepares recorded (a ``jax.debug.callback``, so the step is slow: a diagnostic, not a
timing) and prints per operand shape: the fraction of FLAG_EXACT rows, and the fraction of
(row, K chunk) pairs that would still be outside the window if each chunk of ``--chunks``
elements had its own exponent (how much a per-chunk exponent would help).

Usage: python benchmarks/fp8_flags.py [--size large] [--d-model N] [--batch N] [--steps 1] [--chunks 4096,1024,256]
       [--data random|corpus] [--lr LR] [--out DIR]
"blocks_128": the fraction of 128-row groups holding a flagged row (what the flagged-row kernel
recomputed before session 8, when it walked 128 x 128 tiles; it now lists the flagged rows).
On a CPU the FP8 path is forced (``JAX_MXFP4_BACKEND=fp8``); use a small --batch there.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jax_mxfp4.demo import learning_rate  # noqa: E402  (stdlib + NumPy at import: no JAX yet)


BACKEND_ENV = "JAX_MXFP4_BACKEND"


def chunk_outside(scale_bytes: np.ndarray, counted: np.ndarray, chunk_blocks: int | None) -> float:
    """Fraction of (row, chunk) pairs whose counted blocks' scale bytes span more than the window
    (``jax_mxfp4.fp8.WINDOW_SPAN``); ``chunk_blocks`` None: the whole row (the path's rule,
    special blocks aside). ``scale_bytes``/``counted`` [rows, nb]."""
    from jax_mxfp4.fp8 import WINDOW_SPAN

    r, nb = scale_bytes.shape
    if r == 0 or nb == 0:  # no row or no block: no pair outside
        return 0.0
    c = nb if chunk_blocks is None or chunk_blocks >= nb else chunk_blocks
    pad = (-nb) % c
    sb = np.pad(scale_bytes.astype(np.int32), ((0, 0), (0, pad))).reshape(r, -1, c)
    cn = np.pad(counted, ((0, 0), (0, pad))).reshape(r, -1, c)
    hi = np.where(cn, sb, -1).max(-1)
    lo = np.where(cn, sb, 1 << 20).min(-1)
    return float(np.mean((hi >= 0) & (hi - lo > WINDOW_SPAN)))


def flagged_groups(flagged_rows: np.ndarray, group: int) -> float:
    """Fraction of ``group``-row groups (per batch element, the last one partial) holding a flagged
    row: with 128, the share of output tile rows (or columns) that the flagged-row kernel's former
    128 x 128 tile walk recomputed because of this operand (the kernel now lists flagged rows)."""
    f = np.asarray(flagged_rows, bool)
    if f.size == 0:
        return 0.0
    f = f.reshape(-1, f.shape[-1])
    pad = (-f.shape[1]) % group
    return float(np.mean(np.pad(f, ((0, 0), (0, pad))).reshape(f.shape[0], -1, group).any(-1)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="large")
    ap.add_argument("--d-model", type=int, default=None, help="override the model's width (a positive multiple of 32)")
    ap.add_argument("--batch", type=int, default=None, help="sequences per step (default the size's)")
    ap.add_argument("--steps", type=int, default=1, help="training steps; operands recorded in the last (default 1)")
    ap.add_argument("--chunks", default="4096,1024,256", help="K chunk lengths (elements, multiples of 32)")
    ap.add_argument("--out", default=None, help="folder for fp8_flags.json (made if missing)")
    ap.add_argument("--data", choices=("random", "corpus"), default="random",
                    help="random: one batch of uniform random bytes, the same every step (compile_time.py's); "
                         "corpus: the demo's own training windows (stdlib source), a new batch each step")
    ap.add_argument("--lr", type=learning_rate, default=None, help="peak learning rate (default the size's)")
    args = ap.parse_args(argv)
    try:
        chunks = [int(c) for c in args.chunks.split(",") if c.strip()]
    except ValueError:
        ap.error(f"--chunks must be comma-separated integers (multiples of 32), got {args.chunks!r}")
    if any(c < 32 or c % 32 for c in chunks):
        ap.error(f"--chunks must be multiples of 32, got {args.chunks!r}")
    if args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    if args.batch is not None and args.batch < 1:
        ap.error(f"--batch must be >= 1, got {args.batch}")
    if args.d_model is not None and (args.d_model < 32 or args.d_model % 32):
        # a width that is not a multiple of the head count fails inside the model's reshape
        ap.error(f"--d-model must be a positive multiple of 32, got {args.d_model}")
    if args.out is not None:  # made before the (slow) step: an empty name wrote nothing, a file failed after it
        if not args.out.strip():
            ap.error(f"--out must name a folder (made if missing), got {args.out!r}")
        from benchmarks.common import out_dir

        try:
            out_dir(args.out)
        except SystemExit as e:  # the shared rule's message, through argparse (usage and exit code 2)
            ap.error(str(e).removeprefix("error: "))

    import jax
    import jax.numpy as jnp

    from jax_mxfp4 import demo
    from jax_mxfp4.backends import fp8 as fp8_backend
    from jax_mxfp4.fp8 import FLAG_EXACT
    from jax_mxfp4.mx_format import BLOCK_SIZE, as_scale_bytes
    from jax_mxfp4.recipe import Recipe

    if args.size not in demo.SIZES:
        ap.error(f"--size must be one of {sorted(demo.SIZES)}")
    seen = collections.defaultdict(list)
    orig = fp8_backend._prepared

    def recording(x, platform):
        p = orig(x, platform)
        b, r, k = p.codes.shape
        counted = jnp.any(p.codes.reshape(b, r, k // BLOCK_SIZE, BLOCK_SIZE).astype(jnp.float32) != 0, axis=-1)

        def cb(flag, sb, counted, shape=(b, r, k)):
            rows2d = (shape[0] * shape[1], shape[2] // BLOCK_SIZE)  # explicit: empty operands too
            flag = np.asarray(flag)
            sb, counted = np.asarray(sb).reshape(rows2d), np.asarray(counted).reshape(rows2d)
            fl = (flag & FLAG_EXACT) != 0
            rec = {"flagged": float(np.mean(fl)) if flag.size else 0.0, "blocks_128": flagged_groups(fl, 128)}
            for c in [None, *chunks]:
                rec[f"outside_{c or 'row'}"] = chunk_outside(sb, counted, None if c is None else c // BLOCK_SIZE)
            seen[shape].append(rec)

        jax.debug.callback(cb, p.row_flag, as_scale_bytes(p.scales), counted)
        return p

    cfg = dict(demo.SIZES[args.size])
    if args.d_model:
        cfg["d_model"] = args.d_model
    if args.batch:
        cfg["batch"] = args.batch
    if args.lr:
        cfg["lr"] = args.lr
    model = demo.build_model(cfg, Recipe())
    from benchmarks.common import demo_batches

    batches = demo_batches(cfg, args.steps, args.data)
    params = model.init(jax.random.key(0), batches(0)[:, :-1])
    step, opt, _ = demo.make_train_step(model, cfg, cfg["steps"], 0)  # the size's schedule (its warmup)
    opt_state = opt.init(params)
    env_before = os.environ.get(BACKEND_ENV)
    try:  # the recording hook and a forced backend only for this step (main() may run in-process)
        fp8_backend._prepared = recording
        if jax.default_backend() == "cpu":
            os.environ.setdefault(BACKEND_ENV, "fp8")
        for i in range(args.steps):
            seen.clear()  # keep the last step's operands
            params, opt_state, loss = step(params, opt_state, batches(i), i)
            jax.block_until_ready(loss)
            jax.effects_barrier()
            recs = [r for v in seen.values() for r in v]
            if recs:
                print(f"step {i}: loss {float(loss):.4f}, most flagged rows of one operand "
                      f"{max(r['flagged'] for r in recs):.4f}, of 128-row groups {max(r['blocks_128'] for r in recs):.4f}",
                      flush=True)
    finally:
        fp8_backend._prepared = orig
        if env_before is None:
            os.environ.pop(BACKEND_ENV, None)
        else:
            os.environ[BACKEND_ENV] = env_before
        jax.clear_caches()  # jitted GEMMs traced here hold the recording callback
    what = "same random batch each step" if args.data == "random" else "corpus batches"
    print(f"demo size {args.size} d_model {cfg['d_model']} batch {cfg['batch']}x{cfg['seq_len']} lr {cfg['lr']}: "
          f"after {args.steps} step(s) ({what}): loss {float(loss):.4f}; the table is the last step's")
    cols = ["flagged", "blocks_128", "outside_row"] + [f"outside_{c}" for c in chunks]
    print("| operand [B, rows, K] | calls | " + " | ".join(cols) + " |")
    print("|---|---|" + "---|" * len(cols))
    rows = []
    for shape, recs in sorted(seen.items(), key=lambda kv: -max(r["flagged"] for r in kv[1])):
        for i, rec in enumerate(recs):
            rows.append({"shape": list(shape), "call": i, **rec})
        mean = {c: float(np.mean([r[c] for r in recs])) for c in cols}
        print(f"| {list(shape)} | {len(recs)} | " + " | ".join(f"{mean[c]:.4f}" for c in cols) + " |")
    if args.out:  # the folder was made before the step
        with open(os.path.join(args.out, "fp8_flags.json"), "w") as fh:
            json.dump({"size": args.size, "data": args.data, "cfg": cfg, "loss": float(loss), "rows": rows}, fh, indent=1)
    if not seen:  # an empty table is no answer: say why, exit 1
        env = os.environ.get(BACKEND_ENV, "").strip()
        why = f"$JAX_MXFP4_BACKEND={env!r} names another backend" if env not in ("", "fp8") else \
            "backend 'auto' picked another one for every GEMM of these shapes"
        print(f"error: no GEMM operand of the step went through the FP8 path ({why}): nothing to count; "
              "set JAX_MXFP4_BACKEND=fp8", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
