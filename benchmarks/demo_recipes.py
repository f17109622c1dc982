"""Measure training recipes on the demo LM: MXFP4 runs of ``jax_mxfp4.demo`` with chosen recipes.

Same data, model, seed, batches and optimizer as ``python -m jax_mxfp4.demo``; one bf16 run for
the baseline (skip it with ``--bf16-eval``), then one MXFP4 run per named recipe, one after the
other. After every run the table so far is written to ``--out``/recipes.json, so an interrupted
sweep keeps its results.

    python benchmarks/demo_recipes.py --recipes default,had-all --out benchmarks/results/demo
    python benchmarks/demo_recipes.py --list

Recipe names: see ``RECIPES`` (``--list``). Gap = (MXFP4 eval loss - bf16 eval loss) / bf16.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import time

from jax_mxfp4 import demo
from jax_mxfp4.recipe import Recipe

BF16 = dict(demo.BF16_RECIPE_FIELDS)
# name -> (Recipe fields of the MXFP4 run, LM head precision)
RECIPES = {
    "default": (dict(), "mxfp4"),
    "had-wgrad": (dict(hadamard=True), "mxfp4"),
    "had-fprop": (dict(hadamard="fprop"), "mxfp4"),
    "had-fprop-wgrad": (dict(hadamard=("fprop", "wgrad")), "mxfp4"),
    "had-fprop-b128": (dict(hadamard="fprop", hadamard_block=128), "mxfp4"),
    "had-all": (dict(hadamard="all"), "mxfp4"),
    "had-all-b64": (dict(hadamard="all", hadamard_block=64), "mxfp4"),
    "had-all-b128": (dict(hadamard="all", hadamard_block=128), "mxfp4"),
    "had-all-b256": (dict(hadamard="all", hadamard_block=256), "mxfp4"),
    "head-bf16": (dict(), "bf16"),
    "had-all+head-bf16": (dict(hadamard="all"), "bf16"),
    "had-all-b128+head-bf16": (dict(hadamard="all", hadamard_block=128), "bf16"),
    "had-fprop+head-bf16": (dict(hadamard="fprop"), "bf16"),
    "had-wgrad+head-bf16": (dict(hadamard=True), "bf16"),
    "had-dgrad-wgrad": (dict(hadamard=("dgrad", "wgrad")), "mxfp4"),
}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipes", default="default,had-all", help="comma-separated names from RECIPES")
    p.add_argument("--size", choices=sorted(demo.SIZES), default="small")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default="auto")
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--bf16-eval", type=float, default=None, help="known bf16 eval loss: skip the bf16 run")
    p.add_argument("--out", default="demo_recipes_out")
    p.add_argument("--list", action="store_true")
    for flag in ("--batch", "--seq-len", "--d-model", "--layers"):
        p.add_argument(flag, type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.list:
        for name, (fields, head) in RECIPES.items():
            print(f"{name:24s} Recipe({fields}), head {head}")
        return 0
    names = [n for n in args.recipes.split(",") if n]
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        p.error(f"unknown recipe names {unknown}; known: {sorted(RECIPES)}")
    import jax

    cfg = dict(demo.SIZES[args.size])
    for key, val in (("batch", args.batch), ("seq_len", args.seq_len), ("d_model", args.d_model),
                     ("n_layers", args.layers)):
        if val is not None:
            cfg[key] = val
    cfg["n_heads"] = min(cfg["n_heads"], max(1, cfg["d_model"] // 32))
    steps = args.steps or cfg["steps"]
    eval_every = max(1, steps // 6)
    train_b, eval_b, data_info = demo.load_corpus()
    starts = demo.batch_starts(train_b.size, cfg["seq_len"], cfg["batch"], steps, args.seed)
    eval_starts = demo.batch_starts(eval_b.size, cfg["seq_len"], cfg["batch"], args.eval_batches, args.seed + 1)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"recipes_{args.size}_seed{args.seed}.json"
    table = json.loads(path.read_text()) if path.exists() else {"runs": {}}
    table.update(size=args.size, steps=steps, seed=args.seed, model=cfg, data=data_info,
                 platform=jax.default_backend(), device=jax.devices()[0].device_kind, cpu_count=os.cpu_count(),
                 jax=jax.__version__)

    def train(name, recipe, head_recipe):
        return demo.train_one(name, recipe, cfg, steps, args.seed, train_b, eval_b, starts, eval_starts,
                              eval_every, quiet=True, head_recipe=head_recipe)

    bf_recipe = Recipe(backend=args.backend, **BF16)
    if args.bf16_eval is None:
        r = train("bf16", bf_recipe, None)
        table["bf16"] = dict(eval_loss=r.eval_loss, train_loss=r.train_loss, wall_s=r.wall_s,
                             tokens_per_s=r.tokens_per_s, measured=True)
    elif "bf16" not in table:
        table["bf16"] = dict(eval_loss=args.bf16_eval, measured=False)
    bf = table["bf16"]["eval_loss"]
    print(f"bf16 eval loss {bf:.4f}")
    for name in names:
        fields, head = RECIPES[name]
        recipe = Recipe(backend=args.backend, **fields)
        t = time.perf_counter()
        r = train("mxfp4", recipe, bf_recipe if head == "bf16" else None)
        gap = 100.0 * (r.eval_loss - bf) / bf
        table["runs"][name] = dict(recipe=dataclasses.asdict(recipe), head=head, eval_loss=r.eval_loss,
                                   train_loss=r.train_loss, gap_pct=gap, wall_s=r.wall_s,
                                   tokens_per_s=r.tokens_per_s, eval_curve=r.eval_curve)
        path.write_text(json.dumps(table, indent=2))
        print(f"{name:24s} eval {r.eval_loss:.4f}  gap {gap:+.2f}%  train {r.train_loss:.4f}  "
              f"{r.tokens_per_s:,.0f} tok/s  {time.perf_counter() - t:.0f} s", flush=True)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
