"""Does a random Hadamard rotation lower the MXFP4 error of the demo LM's forward GEMMs?

Trains the demo's byte LM (``--size small``) in bf16 for ``--steps`` steps, captures the input X
and kernel W of every projection on one training batch, and prints, per layer, the relative
Frobenius error of the MXFP4 product ``Q(X R)·Q(Rᵀ W)`` against the exact float64-accumulated
``X·W`` without rotation and with the blockwise random Hadamard rotation R of block 32, 64, 128
(:mod:`jax_mxfp4.hadamard`), plus the quantization error of X and W alone (no rotation / block
32). Writes ``rotation_error.json`` to ``--out``.

    python benchmarks/rotation_error.py --steps 150 --out benchmarks/results/demo
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

BLOCKS = (None, 32, 64, 128)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--d-model", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default="rotation_error_out")
    args = p.parse_args(argv)

    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jax_mxfp4 as mx
    from jax_mxfp4 import demo
    from jax_mxfp4.flax import linen as mxl
    from jax_mxfp4.hadamard import random_hadamard_transform as rht

    cfg = dict(demo.SIZES["small"])
    if args.d_model:
        cfg["d_model"] = args.d_model
    if args.layers is not None:
        cfg["n_layers"] = args.layers
    cfg["n_heads"] = min(cfg["n_heads"], max(1, cfg["d_model"] // 32))
    train_b, _, _ = demo.load_corpus()
    starts = demo.batch_starts(train_b.size, cfg["seq_len"], cfg["batch"], max(args.steps, 1), args.seed)
    model = demo.build_model(cfg, mx.Recipe(**demo.BF16_RECIPE_FIELDS))
    batch = lambda i: jnp.asarray(demo.windows(train_b, starts[i], cfg["seq_len"]))  # noqa: E731
    params = model.init(jax.random.key(args.seed), batch(0)[:, :-1])
    sched = optax.warmup_cosine_decay_schedule(0.0, cfg["lr"], max(1, args.steps // 10), max(args.steps, 2), cfg["lr"] * 0.1)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, b2=0.99, weight_decay=0.01))
    state = opt.init(params)

    def loss_fn(p, b):
        logits = model.apply(p, b[:, :-1]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, b[:, 1:]).mean()

    @jax.jit
    def step(p, s, b):
        loss, g = jax.value_and_grad(loss_fn)(p, b)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    t = time.perf_counter()
    loss = float("nan")
    for i in range(args.steps):
        params, state, loss = step(params, state, batch(i))
    print(f"bf16 training: {args.steps} steps, last loss {float(loss):.4f}, {time.perf_counter() - t:.0f} s")

    captured = []

    def intercept(f, a, kw, ctx):
        if isinstance(ctx.module, mxl.Dense) and ctx.method_name == "__call__":
            captured.append((ctx.module.scope.path_text, a[0], ctx.module.variables["params"]["kernel"]))
        return f(*a, **kw)

    with nn.intercept_methods(intercept):
        model.apply(params, batch(len(starts) - 1)[:, :-1])

    def qdq(x, axis):
        return mx.dequantize(mx.quantize(x, axis))

    def rel(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return float(np.linalg.norm(a - b) / np.linalg.norm(b))

    rows = []
    for name, x, w in captured:
        x = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
        w = w.astype(jnp.float32)
        exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
        gemm = {}
        for blk in BLOCKS:
            if blk and x.shape[1] % blk:
                continue
            xr, wr = (x, w) if blk is None else (rht(x, 1, 7, blk), rht(w, 0, 7, blk))
            gemm[str(blk or "none")] = rel(np.asarray(qdq(xr, 1), np.float64) @ np.asarray(qdq(wr, 0), np.float64), exact)
        rows.append(dict(layer=name, k=int(x.shape[1]), gemm_rel_err=gemm,
                         x_rel_err={"none": rel(qdq(x, 1), x), "32": rel(qdq(rht(x, 1, 7, 32), 1), rht(x, 1, 7, 32))},
                         w_rel_err={"none": rel(qdq(w, 0), w), "32": rel(qdq(rht(w, 0, 7, 32), 0), rht(w, 0, 7, 32))}))
    print("layer              K    | GEMM rel. error: none / b32 / b64 / b128 | X: none / b32 | W: none / b32")
    for r in rows:
        g = " / ".join(f"{v:.4f}" for v in r["gemm_rel_err"].values())
        print(f"{r['layer']:18s} {r['k']:4d} | {g} | {r['x_rel_err']['none']:.4f} / {r['x_rel_err']['32']:.4f} "
              f"| {r['w_rel_err']['none']:.4f} / {r['w_rel_err']['32']:.4f}")
    mean = {b: float(np.mean([r["gemm_rel_err"][b] for r in rows if b in r["gemm_rel_err"]]))
            for b in ("none", "32", "64", "128") if any(b in r["gemm_rel_err"] for r in rows)}
    print("mean GEMM rel. error:", {k: round(v, 4) for k, v in mean.items()})
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rotation_error.json").write_text(json.dumps(dict(steps=args.steps, seed=args.seed, model=cfg,
                                                              layers=rows, mean_gemm_rel_err=mean), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
