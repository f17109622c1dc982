"""Measure training recipes on the demo LM: MXFP4 runs of ``examples/train_lm.py`` with chosen recipes.

Same data, model, seed, batches and optimizer as ``python examples/train_lm.py``; one bf16 run for
the baseline (skip it with ``--bf16-eval``), then one MXFP4 run per named recipe, one after the
other. After every run the results so far are written to ``--out``/recipes_<size>_seed<seed>.json
(an interrupted sweep keeps its results; a later sweep into the same folder adds to them); at
the end the table is printed and written beside it (.md) with the eval-loss curves (.png).
Default --out: recipes_out (recipes_out-quick with --quick).

    python examples/recipes.py --recipes default,had-all
    python examples/recipes.py --quick      (QUICK: a tiny model, two steps: checks the pipeline on a CPU)
    python examples/recipes.py --list

Recipe names: see ``RECIPES`` (``--list``). Gap = (MXFP4 eval loss - bf16 eval loss) / bf16.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import time

import train_lm
from jax_mxfp4 import Recipe

BF16 = dict(train_lm.BF16_RECIPE_FIELDS)
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
QUICK = dict(steps=2, batch=2, seq_len=32, eval_batches=1, d_model=32, layers=0)
"""--quick: a model of the embedding and the MXFP4 LM head only (no blocks: fast to compile),
two steps, one eval batch."""


def markdown(table) -> str:
    m = table["model"]
    lines = [f"# Demo recipes: size {table['size']} (d_model {m['d_model']}, {m['n_layers']} layers), "
             f"{table['steps']} steps, seed {table['seed']}, {table['device']} ({table['platform']}), "
             f"jax {table['jax']}", "",
             "Gap = (MXFP4 eval loss - bf16 eval loss) / bf16 eval loss (nats/byte).", "",
             "| run | eval loss | gap | train loss | tokens/s | wall s |", "|---|---|---|---|---|---|"]
    bf = table["bf16"]
    g = lambda r, k, f: format(r[k], f) if k in r else "-"  # noqa: E731
    lines.append(f"| bf16{'' if bf.get('measured') else ' (given)'} | {bf['eval_loss']:.4f} | | "
                 f"{g(bf, 'train_loss', '.4f')} | {g(bf, 'tokens_per_s', ',.0f')} | {g(bf, 'wall_s', '.1f')} |")
    for name, r in table["runs"].items():
        lines.append(f"| {name} | {r['eval_loss']:.4f} | {r['gap_pct']:+.2f}% | {r['train_loss']:.4f} | "
                     f"{r['tokens_per_s']:,.0f} | {r['wall_s']:.1f} |")
    return "\n".join(lines) + "\n"


def figure(table, path):
    """Eval loss against step for bf16 and every recipe run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in [("bf16", table["bf16"])] + list(table["runs"].items()):
        if r.get("eval_curve"):
            xs, ys = zip(*r["eval_curve"])
            ax.plot(xs, ys, marker="o", ms=3, label=name, color="k" if name == "bf16" else None)
    ax.set_xlabel("step")
    ax.set_ylabel("eval loss (nats/byte)")
    ax.set_title(f"demo {table['size']}: bf16 and MXFP4 recipes")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a tiny model (no blocks, d_model 32), two steps: checks "
                   "the pipeline and files on a CPU")
    p.add_argument("--recipes", default="default,had-all", help="comma-separated names from RECIPES (--list)")
    p.add_argument("--size", choices=sorted(train_lm.SIZES), default="small", help="the demo's model size")
    p.add_argument("--steps", type=int, default=None, help="training steps per run (default the size's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default="auto", help="the recipes' GEMM backend")
    p.add_argument("--eval-batches", type=int, default=None, help="held-out batches per evaluation (default 8)")
    p.add_argument("--bf16-eval", type=float, default=None, help="known bf16 eval loss: skip the bf16 run")
    p.add_argument("--out", default=None, help="output folder (default recipes_out, recipes_out-quick)")
    p.add_argument("--list", action="store_true", help="print the recipe names and exit")
    for flag in ("--batch", "--seq-len", "--d-model", "--layers"):
        p.add_argument(flag, type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:  # QUICK's values, where not given
        for key, val in QUICK.items():
            if getattr(args, key) is None:
                setattr(args, key, val)
    if args.eval_batches is None:
        args.eval_batches = 8
    if args.list:
        for name, (fields, head) in RECIPES.items():
            print(f"{name:24s} Recipe({fields}), head {head}")
        return 0
    names = [n for n in args.recipes.split(",") if n]
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        p.error(f"unknown recipe names {unknown}; known: {sorted(RECIPES)}")
    import jax

    cfg = dict(train_lm.SIZES[args.size])
    for key, val in (("batch", args.batch), ("seq_len", args.seq_len), ("d_model", args.d_model),
                     ("n_layers", args.layers)):
        if val is not None:
            cfg[key] = val
    cfg["n_heads"] = min(cfg["n_heads"], max(1, cfg["d_model"] // 32))
    steps = args.steps or cfg["steps"]
    eval_every = max(1, steps // 6)
    train_b, eval_b, data_info = train_lm.load_corpus()
    starts = train_lm.batch_starts(train_b.size, cfg["seq_len"], cfg["batch"], steps, args.seed)
    eval_starts = train_lm.batch_starts(eval_b.size, cfg["seq_len"], cfg["batch"], args.eval_batches, args.seed + 1)
    out = pathlib.Path(args.out or ("recipes_out-quick" if args.quick else "recipes_out"))
    try:  # before any training: a file in the way is a clear error, not a traceback
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SystemExit(f"error: --out must name a folder (made if missing), got {str(out)!r}: {e}") from None
    path = out / f"recipes_{args.size}_seed{args.seed}.json"
    table = json.loads(path.read_text()) if path.exists() else {"runs": {}}
    table.update(size=args.size, steps=steps, seed=args.seed, model=cfg, data=data_info,
                 platform=jax.default_backend(), device=jax.devices()[0].device_kind, cpu_count=os.cpu_count(),
                 jax=jax.__version__)

    def train(name, recipe, head_recipe):
        return train_lm.train_one(name, recipe, cfg, steps, args.seed, train_b, eval_b, starts, eval_starts,
                              eval_every, quiet=True, head_recipe=head_recipe)

    bf_recipe = Recipe(backend=args.backend, **BF16)
    if args.bf16_eval is None:
        r = train("bf16", bf_recipe, None)
        table["bf16"] = dict(eval_loss=r.eval_loss, train_loss=r.train_loss, wall_s=r.wall_s,
                             tokens_per_s=r.tokens_per_s, eval_curve=r.eval_curve, measured=True)
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
    md = markdown(table)
    path.with_suffix(".md").write_text(md)
    try:
        figure(table, path.with_suffix(".png"))
    except ImportError as e:  # matplotlib is optional (the "bench" extra)
        print(f"no figure: {e}")
    print("\n" + md)
    print(f"wrote {path} (.md, .png)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
