"""Serving example: greedy decoding of the demo byte LM with bf16 weights vs MXFP4 weights (w4a16).

Run from a checkout, with the package installed: ``python examples/generate.py [--size small
--steps N --new-tokens 96 --batch 1 --out DIR]``.

1. Trains the demo model (``build_model`` of ``examples/train_lm.py``, same data, same optimizer) for
   ``--steps`` steps (default: the demo's, 400 for "small") with the MXFP4 training recipe
   (``--train-recipe bf16`` for bf16 GEMMs).
2. Pre-quantizes the weights once: every projection kernel (q/k/v, attention output, both MLP
   layers, LM head) becomes an :class:`jax_mxfp4.MXFP4Array` along its contraction axis (4.25
   bits per weight), arranged once for decode-size GEMMs by :func:`jax_mxfp4.prepare_decode`
   (the same bytes, quantized axis last and scales K-major: no per-call transpose of the Flax
   kernel layout [K, N]); the bf16 baseline casts the same kernels to bfloat16. Embeddings, norms and
   biases stay as they are in both.
3. Greedy-decodes ``--new-tokens`` bytes after a prompt from a held-out file (a line starting
   with ``def ``, :func:`prompt_starts`), with a KV cache, the whole prefill + decode loop
   being one ``jax.jit`` program (``lax.scan`` over positions). Activations are bfloat16 in both runs; the MXFP4 run multiplies them by the
   MXFP4 weights without quantizing them (``Recipe(quantize_activations=False)``: w4a16), both
   accumulate in float32.
4. Prints and saves (``generate.json`` in ``--out``) the decode speed (new tokens/s: batch x
   new tokens / median wall time of the jitted call after a warm-up), the bytes of the GEMM
   weights and of all parameters, how often the two runs pick the same next byte, and the first
   generated text of both.

With ``--moe ExK`` the model's MLPs are mixtures of experts (``examples/train_lm.py``): the
served expert kernels [E, K, N] are those :func:`jax_mxfp4.flax.quantize_params` makes of the
trained params (MXFP4Array along K, axis 1), multiplied by :func:`jax_mxfp4.ragged_dot` (w4a16)
after routing each decoded token with the float32 router; the bf16 baseline casts them and uses
``jax.lax.ragged_dot``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import statistics
import sys
import time

import numpy as np

from train_lm import (BF16_RECIPE_FIELDS, SIZES, batch_starts, build_model, load_corpus, make_train_step, moe_route,
                      moe_spec, windows)


def _layer_norm(x, p, eps=1e-6):  # flax.linen.LayerNorm's defaults (epsilon 1e-6, scale and bias)
    import jax.numpy as jnp

    x = x.astype(jnp.float32)
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return (x - mean) * (1.0 / jnp.sqrt(var + eps)) * p["scale"] + p["bias"]


DENSE_LAYERS = ("qkv", "proj", "mlp_in", "mlp_out")
EXPERT_LAYERS = ("experts_in", "experts_out")  # an MoE block's RaggedDense layers, under "moe"


def is_moe(params) -> bool:
    return any("moe" in sub for name, sub in params.items() if name.startswith("block"))


def serving_weights(params, kind: str, scale_mode: str = "even", prepare: bool = True, model=None):
    """The demo LM's params with every projection kernel as bf16 (``kind="bf16"``) or as an
    MXFP4Array along axis 0, the contraction axis (``kind="mxfp4"``), by default arranged once by
    :func:`jax_mxfp4.prepare_decode` (``prepare=False``: the plain MXFP4Array); everything else as is.

    MoE params (``--moe``): the expert kernels [E, K, N] too (bf16, or MXFP4Array along K, axis
    1, never prepared: :func:`jax_mxfp4.ragged_dot` takes the MXFP4Array); the router stays
    float32. The MXFP4 kernels are :func:`jax_mxfp4.flax.quantize_params` of the params with the
    linen ``model`` (required), which finds exactly the kernels its jax_mxfp4 layers consume."""
    import jax.numpy as jnp

    from jax_mxfp4 import prepare_decode, quantize

    if is_moe(params):
        return _moe_serving_weights(params, kind, scale_mode, prepare, model)

    def conv(k):
        if kind == "bf16":
            return k.astype(jnp.bfloat16)
        q = quantize(k, 0, scale_mode=scale_mode)
        return prepare_decode(q) if prepare else q

    out = {}
    for name, sub in params.items():
        if name == "head":
            out[name] = dict(sub, kernel=conv(sub["kernel"]))
        elif name.startswith("block"):
            out[name] = {n: (dict(v, kernel=conv(v["kernel"])) if n in DENSE_LAYERS else v) for n, v in sub.items()}
        else:
            out[name] = sub
    return out


def _moe_serving_weights(params, kind, scale_mode, prepare, model):
    import jax
    import jax.numpy as jnp

    from jax_mxfp4 import MXFP4Array, prepare_decode
    from jax_mxfp4.flax import quantize_params

    if kind == "bf16":
        return {name: ({n: _bf16_kernels(v) for n, v in sub.items()} if name.startswith("block")
                       else dict(sub, kernel=sub["kernel"].astype(jnp.bfloat16)) if name == "head" else sub)
                for name, sub in params.items()}
    if model is None:
        raise ValueError("serving_weights: MXFP4 weights of an MoE model need model= (the linen model, for "
                         "jax_mxfp4.flax.quantize_params)")
    q = quantize_params({"params": params}, model=model, inputs=(jnp.zeros((1, 8), jnp.int32),),
                        scale_mode=scale_mode)["params"]
    dense = lambda k: prepare_decode(k) if prepare and isinstance(k, MXFP4Array) and len(k.shape) == 2 else k
    return jax.tree.map(dense, q, is_leaf=lambda x: isinstance(x, MXFP4Array))


def _bf16_kernels(layer):
    """A block's sub-dict with its GEMM kernels (dense and, under "moe", expert) cast to bf16."""
    import jax.numpy as jnp

    if "experts_in" in layer:  # the "moe" sub-dict: experts cast, router as is
        return {n: (dict(v, kernel=v["kernel"].astype(jnp.bfloat16)) if n in EXPERT_LAYERS else v)
                for n, v in layer.items()}
    return dict(layer, kernel=layer["kernel"].astype(jnp.bfloat16)) if "kernel" in layer else layer


def _moe_mlp(y, p, top: int, backend: str):
    """The MoE MLP of one position: y [B, d] float32 (after ln2) -> [B, d] float32, as
    ``train_lm.MoE``: float32 router, top-k gates, the experts' grouped GEMMs on bf16 activations
    (MXFP4Array experts: jax_mxfp4.ragged_dot, w4a16; bf16 experts: jax.lax.ragged_dot)."""
    import jax
    import jax.numpy as jnp

    logits = y @ p["router"]["kernel"] + p["router"]["bias"]
    token, gates, group_sizes, _ = moe_route(logits, top)
    hid = jax.nn.gelu(_ragged(y.astype(jnp.bfloat16)[token], p["experts_in"]["kernel"], group_sizes, backend))
    out = _ragged(hid.astype(jnp.bfloat16), p["experts_out"]["kernel"], group_sizes, backend)
    return jnp.zeros_like(y).at[token].add(out * gates[:, None])


def _ragged(x, kernel, group_sizes, backend: str):
    import jax
    import jax.numpy as jnp

    from jax_mxfp4 import MXFP4Array, Recipe, ragged_dot

    if isinstance(kernel, MXFP4Array):
        return ragged_dot(x, kernel, group_sizes, preferred_element_type=jnp.float32,
                          recipe=Recipe(quantize_activations=False, backend=backend))
    return jax.lax.ragged_dot(x, kernel, group_sizes, preferred_element_type=jnp.float32)


def _matmul(x, layer, backend: str):
    """x [B, K] (bf16) · kernel + bias -> [B, N] float32 (bf16 kernel: XLA's bf16 dot, rounded to
    bf16; MXFP4Array or DecodePrepared: jax_mxfp4 w4a16, float32 out)."""
    import jax.numpy as jnp

    from jax_mxfp4 import DecodePrepared, MXFP4Array, Recipe, dot_general

    k = layer["kernel"]
    if isinstance(k, (MXFP4Array, DecodePrepared)):
        y = dot_general(x, k, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32,
                        recipe=Recipe(quantize_activations=False, backend=backend))
    else:  # bf16 out, as bf16 serving runs it: at one row, a float32 out makes XLA convert the
        # whole kernel to float32 per call before its gemv (NVIDIA H200: 45 vs 33 µs at 4096x14336)
        y = jnp.dot(x, k).astype(jnp.float32)
    return y + layer["bias"]


def decode_step(params, cfg, tok, pos, cache, backend="auto"):
    """One position of the demo LM for a batch of tokens ``tok`` [B] at position ``pos``.

    ``cache``: per block a (k, v) pair [B, seq_len, heads, head_dim] (bf16), updated at ``pos``.
    Returns (logits [B, 256] float32, new cache). Same computation as the linen model's forward
    at that position (pre-LayerNorm, causal attention over positions <= pos, GELU MLP).
    """
    import jax
    import jax.numpy as jnp

    d, h = cfg["d_model"], cfg["n_heads"]
    dh = d // h
    bf = jnp.bfloat16
    x = params["embed"]["embedding"][tok] + params["pos"]["embedding"][pos]
    new_cache = []
    t_idx = jnp.arange(cache[0][0].shape[1]) if cache else None
    for i in range(cfg["n_layers"]):
        p = params[f"block{i}"]
        kc, vc = cache[i]
        y = _layer_norm(x, p["ln1"]).astype(bf)
        qkv = _matmul(y, p["qkv"], backend).reshape(-1, 3, h, dh).astype(bf)
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
        kc = jax.lax.dynamic_update_slice_in_dim(kc, k[:, None], pos, axis=1)
        vc = jax.lax.dynamic_update_slice_in_dim(vc, v[:, None], pos, axis=1)
        scores = jnp.einsum("bhd,bthd->bht", q, kc, preferred_element_type=jnp.float32) / math.sqrt(dh)
        att = jax.nn.softmax(jnp.where(t_idx[None, None] <= pos, scores, -1e30), axis=-1)
        y = jnp.einsum("bht,bthd->bhd", att.astype(bf), vc, preferred_element_type=jnp.float32).reshape(-1, d)
        x = x + _matmul(y.astype(bf), p["proj"], backend)
        if "moe" in p:
            x = x + _moe_mlp(_layer_norm(x, p["ln2"]), p["moe"], cfg["moe"][1], backend)
        else:
            y = _layer_norm(x, p["ln2"]).astype(bf)
            y = jax.nn.gelu(_matmul(y, p["mlp_in"], backend)).astype(bf)
            x = x + _matmul(y, p["mlp_out"], backend)
        new_cache.append((kc, vc))
    logits = _matmul(_layer_norm(x, params["ln_f"]).astype(bf), params["head"], backend)
    return logits, new_cache


def make_generate(cfg, prompt_len: int, new_tokens: int, backend: str = "auto"):
    """A jitted ``generate(params, prompt [B, prompt_len] int32) -> (tokens [B, new_tokens], logits
    of the first generated position [B, 256])``: prefill by ``lax.scan`` over the prompt, then
    greedy decoding by ``lax.scan``, with a KV cache of ``prompt_len + new_tokens`` positions."""
    import jax
    import jax.numpy as jnp

    total = prompt_len + new_tokens
    if total > cfg["seq_len"]:
        raise ValueError(f"prompt ({prompt_len}) + new tokens ({new_tokens}) exceed the model's "
                         f"{cfg['seq_len']} positions; lower --new-tokens or --prompt-len")
    h = cfg["n_heads"]
    dh = cfg["d_model"] // h

    @jax.jit
    def generate(params, prompt):
        b = prompt.shape[0]
        cache = [(jnp.zeros((b, total, h, dh), jnp.bfloat16),) * 2 for _ in range(cfg["n_layers"])]

        def prefill(carry, inp):
            cache, _ = carry
            tok, pos = inp
            logits, cache = decode_step(params, cfg, tok, pos, cache, backend)
            return (cache, logits), None

        (cache, logits), _ = jax.lax.scan(
            prefill, (cache, jnp.zeros((b, 256), jnp.float32)), (prompt.T, jnp.arange(prompt_len)))
        first_logits = logits

        def step(carry, pos):
            cache, logits = carry
            tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            logits, cache = decode_step(params, cfg, tok, pos, cache, backend)
            return (cache, logits), tok

        _, toks = jax.lax.scan(step, (cache, logits), jnp.arange(prompt_len, total))
        return toks.T, first_logits

    return generate


def prompt_starts(data: np.ndarray, prompt_len: int, batch: int, seed: int) -> np.ndarray:
    """Starts of ``batch`` prompts in the held-out bytes: lines beginning with ``def `` (random,
    seeded), so that the prompt gives the model something to continue; any position if none."""
    hits = np.flatnonzero((data[:-4] == 10) & (data[1:-3] == ord("d")) & (data[2:-2] == ord("e"))
                          & (data[3:-1] == ord("f")) & (data[4:] == ord(" "))) + 1
    hits = hits[hits < data.size - prompt_len]
    rng = np.random.default_rng(seed + 7)
    if hits.size == 0:
        return rng.integers(0, data.size - prompt_len, size=batch)
    return rng.choice(hits, size=batch)


def param_bytes(tree) -> int:
    import jax

    from jax_mxfp4 import DecodePrepared, MXFP4Array

    packed = (MXFP4Array, DecodePrepared)
    leaves = jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, packed))
    return int(sum(x.nbytes if isinstance(x, packed) else x.size * x.dtype.itemsize for x in leaves))


def gemm_weight_bytes(tree) -> int:
    """Bytes of the GEMM kernels: the dense projections, the LM head and (MoE) the experts."""
    blocks = [sub for k, sub in tree.items() if k.startswith("block")]
    experts = [v["kernel"] for sub in blocks for n, v in sub.get("moe", {}).items() if n in EXPERT_LAYERS]
    return param_bytes([tree["head"]["kernel"]] + [v["kernel"] for sub in blocks for n, v in sub.items()
                                                   if n in DENSE_LAYERS] + experts)


def train_params(cfg, steps, seed, recipe, train_b, quiet=True):
    """Train the demo LM (its optimizer and batches) and return the float params."""
    import jax
    import jax.numpy as jnp
    import optax

    model = build_model(cfg, recipe)
    starts = batch_starts(train_b.size, cfg["seq_len"], cfg["batch"], steps, seed)
    params = model.init(jax.random.key(seed), jnp.asarray(windows(train_b, starts[0], cfg["seq_len"]))[:, :-1])
    if cfg.get("moe"):  # the demo's step: cross-entropy + load-balancing loss
        train_step, opt, _ = make_train_step(model, cfg, steps, seed)
        opt_state = opt.init(params)
        for i in range(steps):
            batch = jnp.asarray(windows(train_b, starts[i], cfg["seq_len"]))
            params, opt_state, loss = train_step(params, opt_state, batch, i)
            if not quiet and (i + 1) % max(1, steps // 10) == 0:
                print(f"  train step {i + 1}/{steps}: loss {float(loss):.3f}", flush=True)
        return params["params"], float(loss), model
    warmup = max(1, steps // 10)
    sched = optax.warmup_cosine_decay_schedule(0.0, cfg["lr"], warmup, max(steps, warmup + 1), cfg["lr"] * 0.1)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, b2=0.99, weight_decay=0.01))
    opt_state = opt.init(params)

    def loss_fn(params, batch):
        logits = model.apply(params, batch[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch[:, 1:]).mean()

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    loss = float("nan")
    for i in range(steps):
        params, opt_state, loss = step(params, opt_state, jnp.asarray(windows(train_b, starts[i], cfg["seq_len"])))
        if not quiet and (i + 1) % max(1, steps // 10) == 0:
            print(f"  train step {i + 1}/{steps}: loss {float(loss):.3f}", flush=True)
    return params["params"], float(loss), model


def time_call(fn, *args, repeats: int = 5) -> float:
    """Median wall time (s) of ``fn(*args)`` after one warm-up call (compilation)."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="generate.py", description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--steps", type=int, default=None, help="training steps before serving (default: the demo's, per --size)")
    p.add_argument("--train-recipe", choices=["mxfp4", "bf16"], default="mxfp4",
                   help="GEMM precision of the training run (default mxfp4)")
    p.add_argument("--new-tokens", type=int, default=96, help="bytes to generate (default 96)")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt bytes from a held-out file (default 32)")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded at once (default 1)")
    p.add_argument("--backend", default="auto", help="jax_mxfp4 backend of the MXFP4 GEMMs (default auto)")
    p.add_argument("--repeats", type=int, default=5, help="timed calls after the warm-up (default 5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--d-model", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--seq-len", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--train-batch", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default="demo_out", help="directory for generate.json")
    p.add_argument("--moe", type=moe_spec, default=None, metavar="ExK",
                   help="serve a mixture-of-experts model (as train_lm.py --moe), e.g. 8x2")
    p.add_argument("--moe-aux-weight", type=float, default=0.01, help=argparse.SUPPRESS)
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    if args.moe and args.backend not in ("auto", "xla"):
        p.error(f"--moe needs --backend auto or xla (jax_mxfp4.ragged_dot's backends), got {args.backend!r}")
    for name in ("steps", "new_tokens", "prompt_len", "batch", "repeats"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def run(argv=None) -> dict:
    """Train, quantize, decode with both weight formats; print the table, write generate.json."""
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp

    from jax_mxfp4 import Recipe

    cfg = dict(SIZES[args.size])
    for key, val in (("d_model", args.d_model), ("n_layers", args.layers), ("seq_len", args.seq_len),
                     ("batch", args.train_batch)):
        if val is not None:
            cfg[key] = val
    cfg["n_heads"] = min(cfg["n_heads"], max(1, cfg["d_model"] // 32))
    if args.moe:
        cfg["moe"], cfg["moe_aux_weight"] = list(args.moe), args.moe_aux_weight
    args.steps = args.steps or cfg["steps"]
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train_b, eval_b, _ = load_corpus()
    recipe = Recipe(**BF16_RECIPE_FIELDS) if args.train_recipe == "bf16" else Recipe()
    if not args.quiet:
        print(f"training the demo LM ({args.size}, {args.steps} steps, {args.train_recipe} GEMMs) on "
              f"{jax.default_backend()} ...", flush=True)
    t0 = time.perf_counter()
    params, final_loss, model = train_params(cfg, args.steps, args.seed, recipe, train_b, quiet=args.quiet)
    train_s = time.perf_counter() - t0

    starts = prompt_starts(eval_b, args.prompt_len, args.batch, args.seed)
    prompt = jnp.asarray(np.stack([eval_b[s:s + args.prompt_len] for s in starts]).astype(np.int32))
    generate = make_generate(cfg, args.prompt_len, args.new_tokens, args.backend)
    runs = {}
    for kind in ("bf16", "mxfp4"):
        w = serving_weights(params, kind, model=model)
        toks, _ = generate(w, prompt)
        secs = time_call(generate, w, prompt, repeats=args.repeats)
        toks = np.asarray(toks)
        runs[kind] = dict(
            tokens_per_s=args.batch * args.new_tokens / secs, seconds=secs,
            gemm_weight_bytes=gemm_weight_bytes(w), param_bytes=param_bytes(w),
            text=bytes(toks[0].astype(np.uint8)).decode("utf-8", errors="replace"), tokens=toks.tolist(),
        )
    agree = float(np.mean(np.asarray(runs["bf16"]["tokens"]) == np.asarray(runs["mxfp4"]["tokens"])))
    prompt_text = bytes(np.asarray(prompt[0]).astype(np.uint8)).decode("utf-8", errors="replace")
    rows = [("weights", "new tokens/s", "ms per call", "GEMM weight bytes", "all param bytes")]
    for kind in ("bf16", "mxfp4"):
        r = runs[kind]
        rows.append((kind if kind == "bf16" else "mxfp4 (w4a16)", f"{r['tokens_per_s']:,.1f}",
                     f"{1e3 * r['seconds']:.1f}", f"{r['gemm_weight_bytes']:,}", f"{r['param_bytes']:,}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [" | ".join(c.ljust(wd) for c, wd in zip(r, widths)) for r in rows]
    lines.insert(1, "-+-".join("-" * wd for wd in widths))
    print("\n".join(lines))
    print(f"\nbatch {args.batch}, prompt {args.prompt_len} bytes, {args.new_tokens} new bytes, greedy, KV cache, "
          f"one jitted call per generation (median of {args.repeats}); same next byte in {100 * agree:.1f}% "
          f"of positions; GEMM weights {runs['bf16']['gemm_weight_bytes'] / runs['mxfp4']['gemm_weight_bytes']:.2f}x "
          f"smaller in MXFP4")
    print(f"prompt: {prompt_text!r}")
    for kind in ("bf16", "mxfp4"):
        print(f"{kind:>5}: {runs[kind]['text']!r}")
    results = dict(
        runs=runs, agreement=agree, prompt=prompt_text, model=cfg, size=args.size, steps=args.steps,
        train_recipe=args.train_recipe, final_train_loss=final_loss, train_s=train_s, batch=args.batch,
        new_tokens=args.new_tokens, prompt_len=args.prompt_len, backend=args.backend,
        platform=jax.default_backend(), device=jax.devices()[0].device_kind, cpu_count=os.cpu_count(),
    )
    (out / "generate.json").write_text(json.dumps(results, indent=2))
    print(f"wrote {out / 'generate.json'}")
    return results


def main(argv=None) -> int:
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
