"""Train a small byte-level transformer LM twice -- bf16 GEMMs vs MXFP4 GEMMs -- and compare.

Run from a checkout, with the package installed (``pip install ".[flax]"``):
``python examples/train_lm.py [--steps N --size small|medium --backend auto --seed 0 --out DIR]``
(``--moe 8x2``: mixture-of-experts MLPs, below).
An application of the library, outside the package (nothing in ``jax_mxfp4`` imports it);
``examples/generate.py`` serves the trained model.

Data: the bytes of the Python standard library's own ``.py`` sources
(``sysconfig.get_paths()["stdlib"]``, test directories and ``site-packages`` excluded), as a
fixed sorted file list; every 10th file is held out for evaluation. Nothing is downloaded.

Model: a pre-LayerNorm decoder-only transformer (byte embedding + learned positions, causal
multi-head attention, GELU MLP, LM head). Every projection -- q/k/v, attention output, both MLP
layers and the LM head -- is a :class:`jax_mxfp4.flax.linen.Dense`; the two runs differ only in
the layers' recipe: ``Recipe(fprop="bf16", dgrad="bf16", wgrad="bf16")`` (bf16 operands,
float32 accumulation) versus ``Recipe()`` (MXFP4 fprop, dgrad and wgrad, stochastic rounding of
the gradients). Embeddings, LayerNorm, softmax attention scores and the optimizer stay in float32
in both runs. Same seed, same initial parameters, same batches, same optimizer (AdamW, warmup +
cosine decay).

Mixture of experts (``--moe ExK``, e.g. ``8x2``): every block's MLP becomes ``E`` experts of the
dense MLP's shape (d -> 4d GELU -> d, no biases), ``K`` of them per token (:class:`MoE`). The
router is a plain float32 ``flax.linen.Dense`` in both runs (its logits pick the experts: a
quantized router would change which experts run, not only how precisely). The expert GEMMs are
:class:`jax_mxfp4.flax.linen.RaggedDense` layers with the run's recipe (bf16: the same layer with
every pass "bf16"), so the two runs are the same model. The training objective adds the Switch
Transformer load-balancing loss (``--moe-aux-weight`` x E x sum_e f_e P_e, per block, summed);
the reported train and eval losses are the cross-entropy alone.

Output: a progress bar per run, a final table (train and eval loss in nats/byte, the gap in %,
tokens/s, the backend that ran the MXFP4 GEMMs), the unigram byte entropy of the eval data for
scale, and ``results.json`` and ``loss.png`` in ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import pathlib
import sys
import sysconfig
import time

import numpy as np

SIZES = {
    # d_model, layers, heads, seq_len, batch, default steps, learning rate
    "small": dict(d_model=128, n_layers=2, n_heads=4, seq_len=128, batch=16, steps=400, lr=3e-3),
    "medium": dict(d_model=256, n_layers=4, n_heads=8, seq_len=256, batch=16, steps=1000, lr=2e-3),
    # GPU size: 8192 tokens per step, GEMMs 8192 x 1024 x 1024 / 4096, where the FP8
    # path and the fused quantization passes apply; not meant for a CPU
    "large": dict(d_model=1024, n_layers=4, n_heads=16, seq_len=512, batch=16, steps=300, lr=1e-3, sr_key="rbg"),
    # a wider GPU size: GEMMs 8192 x 4096 x 4096 / 16384, where the FP8 GEMMs' gain
    # exceeds the quantize and rescale passes (at d = 1024 it does not: README "GPU speed");
    # lr 3e-4: at 1e-3 this width diverged within a few steps on the H200
    "xl": dict(d_model=4096, n_layers=4, n_heads=32, seq_len=512, batch=16, steps=300, lr=3e-4, sr_key="rbg"),
}
SR_KEY_DEFAULT = "threefry2x32"
"""PRNG implementation of the stochastic-rounding keys (a size's ``sr_key`` overrides it). The GPU
size uses "rbg": XLA draws the uniforms and the fused quantize kernels read them, where threefry's
bit-identical uniforms cost ~80 integer operations per element inside the kernels (README
"Training"); the CPU sizes keep threefry (their results in README reproduce bit for bit)."""
BF16_RECIPE_FIELDS = dict(fprop="bf16", dgrad="bf16", wgrad="bf16")
MX_HADAMARD, MX_HADAMARD_BLOCK = "none", 32  # the MXFP4 run's default rotation (README's recipe table)
HOLDOUT_EVERY = 10
EXCLUDED_DIRS = {"site-packages", "test", "tests", "idle_test"}


# ----------------------------------------------------------------------------- data
def stdlib_files(root: str | os.PathLike | None = None) -> list[pathlib.Path]:
    """Sorted ``.py`` files of the standard library, without tests and site-packages."""
    root = pathlib.Path(root or sysconfig.get_paths()["stdlib"])
    files = [
        f for f in root.rglob("*.py")
        if not (EXCLUDED_DIRS & set(f.relative_to(root).parts[:-1])) and f.is_file()
    ]
    return sorted(files, key=lambda f: f.relative_to(root).as_posix())


def load_corpus(root=None, max_train_bytes: int = 16 << 20):
    """(train bytes, eval bytes, info): every ``HOLDOUT_EVERY``-th sorted file goes to eval."""
    files = stdlib_files(root)
    if len(files) < HOLDOUT_EVERY:
        raise RuntimeError(f"found only {len(files)} Python files under the stdlib path; need >= {HOLDOUT_EVERY}")
    train, evals = [], []
    for i, f in enumerate(files):
        (evals if i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1 else train).append(f.read_bytes())
    train_b = np.frombuffer(b"".join(train), np.uint8)[:max_train_bytes]
    eval_b = np.frombuffer(b"".join(evals), np.uint8)
    info = dict(
        root=str(pathlib.Path(root or sysconfig.get_paths()["stdlib"])),
        files=len(files), train_files=len(train), eval_files=len(evals),
        train_bytes=int(train_b.size), eval_bytes=int(eval_b.size),
    )
    return train_b, eval_b, info


def unigram_entropy_nats(data: np.ndarray) -> float:
    """Entropy (nats/byte) of the byte frequencies of ``data``: a context-free model's best loss."""
    p = np.bincount(data, minlength=256).astype(np.float64)
    p = p[p > 0] / p.sum()
    return float(-(p * np.log(p)).sum())


def batch_starts(n_bytes: int, seq_len: int, batch: int, steps: int, seed: int) -> np.ndarray:
    """[steps, batch] window starts, the same for both runs."""
    return np.random.default_rng(seed).integers(0, n_bytes - seq_len - 1, size=(steps, batch))


def windows(data: np.ndarray, starts: np.ndarray, seq_len: int) -> np.ndarray:
    idx = starts[..., None] + np.arange(seq_len + 1)
    return data[idx].astype(np.int32)


# ----------------------------------------------------------------------------- model
MOE_COLLECTION = "moe"  # the linen collection the MoE blocks sow their load-balancing loss and loads into


def moe_spec(text: str) -> tuple[int, int]:
    """argparse type of ``--moe``: "ExK" (E experts, top-K) with 1 <= K <= E."""
    try:
        e, k = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must look like ExK (experts x top-k, e.g. 8x2), got {text!r}") from None
    if not 1 <= k <= e:
        raise argparse.ArgumentTypeError(f"needs 1 <= K <= E (top-k of E experts), got {text!r}")
    return e, k


def moe_route(logits, top: int):
    """Top-k routing of M tokens: logits [M, E] (float32) ->
    (token [M*k] int32, gates [M*k] float32, group_sizes [E] int32, load-balancing loss scalar).

    Assignment j (of the M*k token-expert pairs, sorted by expert, stably: tokens in order within
    each expert) sends row ``token[j]`` to its expert with weight ``gates[j]``: the softmax of the
    router logits, renormalized over each token's k chosen experts (Mixtral's gating).
    ``group_sizes[e]``: the pairs of expert e, the ``group_sizes`` of ``ragged_dot``.
    Loss: Switch Transformer's (Fedus et al. 2021, eq. 4) counted over all k choices,
    ``E * sum_e f_e * P_e`` with f_e = group_sizes[e] / (M*k) (no gradient) and P_e the mean
    router probability of expert e; 1 when perfectly balanced."""
    import jax
    import jax.numpy as jnp

    m, n_exp = logits.shape
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top_p, top_e = jax.lax.top_k(probs, top)
    gates = top_p / top_p.sum(-1, keepdims=True)
    flat_e = top_e.reshape(-1)
    order = jnp.argsort(flat_e, stable=True)
    group_sizes = jnp.bincount(flat_e, length=n_exp).astype(jnp.int32)
    frac = group_sizes.astype(jnp.float32) / (m * top)
    aux = n_exp * jnp.sum(frac * probs.mean(0))
    return (order // top).astype(jnp.int32), gates.reshape(-1)[order], group_sizes, aux


def moe_stats(state) -> dict:
    """The MoE blocks' sown values (``model.apply(..., mutable=[MOE_COLLECTION])``'s state), in
    block order: {"load_balance": [scalar per block], "group_sizes": [[E] per block]}."""
    import jax

    out = {"load_balance": [], "group_sizes": []}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state.get(MOE_COLLECTION, {}))[0]:
        names = [getattr(k, "key", None) for k in path]
        for key in out:
            if key in names:
                out[key].append(leaf)
    return out


def _plain_experts():
    """``PlainExperts``: the expert layer of ``--via qwix``, plain Flax calling ``jax.lax.ragged_dot``."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from jax_mxfp4.flax.linen import default_expert_kernel_init

    class PlainExperts(nn.Module):
        """x [M, K] by kernel [E, K, N] per group: jax.lax.ragged_dot (parameters as RaggedDense's)."""

        num_experts: int
        features: int
        recipe: object = None  # unused: the Qwix rules carry the recipe

        @nn.compact
        def __call__(self, x, group_sizes):
            shape = (self.num_experts, x.shape[-1], self.features)
            kernel = self.param("kernel", default_expert_kernel_init, shape, jnp.float32)
            return jax.lax.ragged_dot(x, kernel, group_sizes)

    return PlainExperts


def build_model(cfg: dict, recipe, head_recipe=None, via: str = "layers"):
    """The byte LM (a ``flax.linen`` module); ``head_recipe`` (default ``recipe``) for the LM head.

    ``via="layers"``: the projections are :class:`jax_mxfp4.flax.linen.Dense` layers.
    ``via="qwix"``: they are Flax's own ``nn.Dense`` (the model code knows nothing of MXFP4) and
    ``qwix.quantize_model`` with :class:`jax_mxfp4.qwix.MxQtProvider` routes them through
    jax_mxfp4 with the same recipes (same parameters, same GEMMs)."""
    import types

    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from jax_mxfp4.flax import linen as mxl

    PlainExperts = _plain_experts() if via == "qwix" else None
    if via == "qwix":  # plain Flax layers; the recipe goes to the Qwix rules below
        mxl = types.SimpleNamespace(Dense=lambda features, recipe=None, name=None: nn.Dense(features, name=name),
                                    RaggedDense=PlainExperts)

    d, h = cfg["d_model"], cfg["n_heads"]
    moe = cfg.get("moe")

    class MoE(nn.Module):
        """The MLP as a mixture of experts: y [B, T, d] -> [B, T, d] (see :func:`moe_route`)."""

        @nn.compact
        def __call__(self, y):
            n_exp, top = moe
            x = y.reshape(-1, d)
            logits = nn.Dense(n_exp, name="router")(x)  # float32: not a jax_mxfp4 layer, not a Qwix rule
            token, gates, group_sizes, aux = moe_route(logits, top)
            if not self.is_initializing():  # init returns the params alone
                self.sow(MOE_COLLECTION, "load_balance", aux)
                self.sow(MOE_COLLECTION, "group_sizes", group_sizes)
            hid = mxl.RaggedDense(n_exp, 4 * d, recipe=recipe, name="experts_in")(x[token], group_sizes)
            out = mxl.RaggedDense(n_exp, d, recipe=recipe, name="experts_out")(jax.nn.gelu(hid), group_sizes)
            return jnp.zeros_like(x).at[token].add(out * gates[:, None]).reshape(y.shape)

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            b, t, _ = x.shape
            y = nn.LayerNorm(name="ln1")(x)
            qkv = mxl.Dense(3 * d, recipe=recipe, name="qkv")(y).reshape(b, t, 3, h, d // h)
            q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
            scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // h)
            mask = jnp.tril(jnp.ones((t, t), bool))
            att = jax.nn.softmax(jnp.where(mask, scores, -1e30), axis=-1)
            y = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, d)
            x = x + mxl.Dense(d, recipe=recipe, name="proj")(y)
            y = nn.LayerNorm(name="ln2")(x)
            if moe:
                return x + MoE(name="moe")(y)
            y = mxl.Dense(4 * d, recipe=recipe, name="mlp_in")(y)
            return x + mxl.Dense(d, recipe=recipe, name="mlp_out")(jax.nn.gelu(y))

    class ByteLM(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            t = tokens.shape[1]
            x = nn.Embed(256, d, name="embed")(tokens)
            x = x + nn.Embed(cfg["seq_len"], d, name="pos")(jnp.arange(t))[None]
            for i in range(cfg["n_layers"]):
                x = Block(name=f"block{i}")(x)
            head = mxl.Dense(256, recipe=recipe if head_recipe is None else head_recipe, name="head")
            return head(nn.LayerNorm(name="ln_f")(x))

    if via == "qwix":
        import qwix

        from jax_mxfp4.qwix import MxQtProvider, MxRule

        rules = [MxRule(module_path="head", recipe=recipe if head_recipe is None else head_recipe),
                 MxRule(module_path=r"block\d+/(qkv|proj|mlp_in|mlp_out|moe/experts_in|moe/experts_out)",
                        recipe=recipe)]
        return qwix.quantize_model(ByteLM(), MxQtProvider(rules))
    return ByteLM()


# Megatron-style tensor parallelism over the "model" mesh axis: column-parallel layers split their
# outputs (N), row-parallel layers their inputs (K, a sharded contraction: partial GEMMs + psum).
COLUMN_PARALLEL = ("qkv", "mlp_in", "head")
ROW_PARALLEL = ("proj", "mlp_out")


def make_mesh(shape):
    """A (data, model) ``jax.sharding.Mesh`` of ``shape`` over the first devices (Auto axes)."""
    import jax

    n = shape[0] * shape[1]
    if n > len(jax.devices()):
        raise ValueError(f"--mesh {shape[0]}x{shape[1]} needs {n} devices; JAX sees {len(jax.devices())}")
    return jax.make_mesh(shape, ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=jax.devices()[:n])


def param_shardings(params, mesh):
    """NamedShardings for the LM's params: column/row-parallel Dense layers, the rest replicated."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    def spec(path, leaf):
        names = [getattr(k, "key", str(k)) for k in path]
        layer, kind = names[-2], names[-1]
        if layer in COLUMN_PARALLEL:
            return P(None, "model") if kind == "kernel" else P("model")
        if layer in ROW_PARALLEL and kind == "kernel":
            return P("model", None)
        return P()

    return jax.tree_util.tree_map_with_path(lambda p, x: NamedSharding(mesh, spec(p, x)), params)


@dataclasses.dataclass
class RunResult:
    name: str
    train_loss: float
    eval_loss: float
    tokens_per_s: float
    wall_s: float
    train_curve: list
    eval_curve: list
    step_s: list = dataclasses.field(default_factory=list)  # seconds of each step after the first
    moe: dict | None = None  # MoE models: the routing of the first eval batch (:func:`routing_summary`)


def make_train_step(model, cfg: dict, steps: int, seed: int):
    """(step, optimizer, loss_fn) of a run: ``step(params, opt_state, batch, i)`` jitted (AdamW with
    warm-up and cosine decay, gradient clipping; a fresh stochastic-rounding key per step) -> (params,
    opt_state, loss). ``loss`` (and ``loss_fn``'s) is the cross-entropy; an MoE model
    (``cfg["moe"]``) trains on it plus ``cfg["moe_aux_weight"]`` x its load-balancing losses.
    Shared by :func:`train_one` and benchmarks/compile_time.py."""
    import jax
    import jax.numpy as jnp
    import optax

    warmup = max(1, steps // 10)
    sched = optax.warmup_cosine_decay_schedule(0.0, cfg["lr"], warmup, max(steps, warmup + 1), cfg["lr"] * 0.1)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, b2=0.99, weight_decay=0.01))

    def cross_entropy(logits, batch):
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch[:, 1:]).mean()

    def loss_fn(params, batch, rngs=None):
        return cross_entropy(model.apply(params, batch[:, :-1], rngs=rngs), batch)

    def moe_objective(params, batch, rngs):  # (cross-entropy + weighted load-balancing loss, cross-entropy)
        logits, state = model.apply(params, batch[:, :-1], rngs=rngs, mutable=[MOE_COLLECTION])
        ce = cross_entropy(logits, batch)
        return ce + cfg["moe_aux_weight"] * sum(moe_stats(state)["load_balance"]), ce

    # Stochastic rounding of the gradients draws a fresh key every step from the seed (the Dense
    # layers' "stochastic_rounding" RNG stream; jax_mxfp4.flax.linen): reproducible runs whose
    # rounding noise averages out over steps.
    rounding_key = jax.random.fold_in(jax.random.key(seed, impl=cfg.get("sr_key", SR_KEY_DEFAULT)), 0x5352)  # "SR"

    @jax.jit
    def step(params, opt_state, batch, i):
        rngs = {"stochastic_rounding": jax.random.fold_in(rounding_key, i)}
        if cfg.get("moe"):  # the step returns the cross-entropy; the gradient includes the balancing loss
            (_, loss), grads = jax.value_and_grad(moe_objective, has_aux=True)(params, batch, rngs)
        else:
            loss, grads = jax.value_and_grad(loss_fn)(params, batch, rngs)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, opt, loss_fn


def train_one(name, recipe, cfg, steps, seed, train_b, eval_b, starts, eval_starts, eval_every, quiet=False,
              head_recipe=None, mesh=None, via="layers"):
    """Train one run; returns a :class:`RunResult` (losses in nats/byte). With ``mesh`` the
    batch is sharded over "data" and the Dense layers over "model" (:func:`param_shardings`)."""
    import jax
    import jax.numpy as jnp
    from tqdm.auto import tqdm

    model = build_model(cfg, recipe, head_recipe, via=via)
    tokens0 = jnp.asarray(windows(train_b, starts[0], cfg["seq_len"]))[:, :-1]
    params = model.init(jax.random.key(seed), tokens0)
    put_batch = jnp.asarray
    if mesh is not None:
        from jax.sharding import NamedSharding, PartitionSpec as P

        params = jax.device_put(params, param_shardings(params, mesh))
        batch_sharding = NamedSharding(mesh, P("data", None))

        def put_batch(b):
            return jax.device_put(b, batch_sharding)
    step, opt, loss_fn = make_train_step(model, cfg, steps, seed)
    opt_state = opt.init(params)

    eval_loss_j = jax.jit(loss_fn)
    eval_batches = [put_batch(windows(eval_b, s, cfg["seq_len"])) for s in eval_starts]

    def evaluate(params):
        return float(np.mean([float(eval_loss_j(params, b)) for b in eval_batches]))

    train_curve, eval_curve, step_s = [], [], []
    t_start = time.perf_counter()
    step_time = 0.0  # training steps after the first (which includes compilation), no evals
    bar = tqdm(range(steps), desc=f"{name:>5}", unit="step", disable=quiet, dynamic_ncols=True, file=sys.stdout)
    for i in bar:
        t = time.perf_counter()
        batch = put_batch(windows(train_b, starts[i], cfg["seq_len"]))
        params, opt_state, loss = step(params, opt_state, batch, i)
        loss = float(loss)
        if i > 0:
            step_s.append(time.perf_counter() - t)
            step_time += step_s[-1]
        if not math.isfinite(loss):
            raise FloatingPointError(f"{name}: training loss became {loss} at step {i}")
        train_curve.append(loss)
        if eval_every and ((i + 1) % eval_every == 0) and i + 1 < steps:
            eval_curve.append((i + 1, evaluate(params)))
        bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
    final_eval = evaluate(params)
    eval_curve.append((steps, final_eval))
    wall = time.perf_counter() - t_start
    tok = cfg["batch"] * cfg["seq_len"]
    tps = tok * (steps - 1) / step_time if steps > 1 and step_time > 0 else float("nan")
    tail = train_curve[-max(1, min(20, steps // 5)):]
    moe = routing_summary(model, params, eval_batches[0]) if cfg.get("moe") else None
    return RunResult(name, float(np.mean(tail)), final_eval, tps, wall, train_curve, eval_curve, step_s, moe)


def routing_summary(model, params, batch) -> dict:
    """Per MoE block on ``batch``: its load-balancing loss (1 = balanced) and the fraction of the
    token-expert assignments each expert received."""
    import jax

    _, state = jax.jit(lambda p, b: model.apply(p, b[:, :-1], mutable=[MOE_COLLECTION]))(params, batch)
    stats = moe_stats(state)
    loads = [np.asarray(g) / max(1, int(np.sum(g))) for g in stats["group_sizes"]]
    return dict(load_balance=[float(v) for v in stats["load_balance"]], expert_load=[v.round(4).tolist() for v in loads])


def mxfp4_backend_used(recipe, cfg) -> str:
    import jax
    import jax.numpy as jnp

    from jax_mxfp4 import explain

    x = jax.ShapeDtypeStruct((cfg["batch"] * cfg["seq_len"], cfg["d_model"]), jnp.float32)
    w = jax.ShapeDtypeStruct((cfg["d_model"], 4 * cfg["d_model"]), jnp.float32)
    return explain(x, w, (((1,), (0,)), ((), ())), recipe=recipe).backend


def plot(path, runs, unigram):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    colors = {"bf16": "tab:blue", "mxfp4": "tab:red"}
    for r in runs:
        c = np.asarray(r.train_curve)
        k = max(1, min(25, len(c) // 10))
        smooth = np.convolve(c, np.ones(k) / k, mode="valid")
        ax.plot(np.arange(k, len(c) + 1), smooth, color=colors[r.name], alpha=0.8, label=f"{r.name} train (avg {k})")
        ex, ey = zip(*r.eval_curve)
        ax.plot(ex, ey, "o--", color=colors[r.name], ms=4, label=f"{r.name} eval (held-out files)")
    ax.axhline(unigram, color="gray", ls=":", label=f"unigram byte entropy {unigram:.2f}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/byte)")
    ax.set_title("Byte LM on Python stdlib sources: bf16 vs MXFP4 GEMMs")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def learning_rate(text: str) -> float:
    """argparse type of ``--lr`` (the demo's and the benchmarks' that build its model): a positive
    finite float (0, a negative, NaN or Inf trains to nothing or to NaN)."""
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text!r}")
    return v


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="train_lm.py", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=None, help="training steps per run (default: per --size)")
    p.add_argument("--size", choices=sorted(SIZES), default="small", help="model size (default small: ~4 min for both runs on 2 CPU cores; medium: ~75 min; large, xl: GPU sizes)")
    p.add_argument("--lr", type=learning_rate, default=None, help="peak learning rate (default: per --size)")
    p.add_argument("--out", default="demo_out", help="directory for results.json and loss.png")
    p.add_argument("--backend", default="auto", help="jax_mxfp4 backend of the MXFP4 run (default auto)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-batches", type=int, default=8, help="held-out batches per evaluation")
    p.add_argument("--eval-every", type=int, default=None,
                   help="steps between evaluations (default steps/6; 0: at the end only)")
    p.add_argument("--batch", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--seq-len", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--d-model", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--grad-rounding", choices=["stochastic", "nearest"], default="stochastic",
                   help="rounding of the gradient operands in the MXFP4 run (default stochastic)")
    p.add_argument("--hadamard", nargs="?", const="wgrad", default=MX_HADAMARD, metavar="PASSES",
                   help="passes of the MXFP4 run whose two operands get a random Hadamard rotation along the "
                        "contraction before quantizing: comma-separated from fprop,dgrad,wgrad, or all, or none "
                        f"(default {MX_HADAMARD}; a bare --hadamard means wgrad, the original flag)")
    p.add_argument("--hadamard-block", type=int, default=MX_HADAMARD_BLOCK, choices=[32, 64, 128, 256],
                   help=f"Hadamard block size of the MXFP4 run (default {MX_HADAMARD_BLOCK})")
    p.add_argument("--scale-mode", default="even", choices=["floor", "ceil", "even", "rceil"],
                   help="E8M0 scale rule of the MXFP4 run (default even)")
    p.add_argument("--head", choices=["mxfp4", "bf16"], default="mxfp4",
                   help="precision of the LM head in the MXFP4 run (default mxfp4: every projection in MXFP4)")
    p.add_argument("--mesh", default=None, metavar="DxM",
                   help="run sharded on a (data x model) device mesh, e.g. 2x1 (data parallel) or 1x2 "
                        "(tensor parallel: Megatron column/row layers); default: one device")
    p.add_argument("--via", choices=["layers", "qwix"], default="layers",
                   help="layers: the model is written with jax_mxfp4.flax layers (default); qwix: plain "
                        "flax.linen.Dense layers routed through jax_mxfp4 by qwix.quantize_model")
    p.add_argument("--moe", type=moe_spec, default=None, metavar="ExK",
                   help="mixture-of-experts MLPs: E experts of the dense MLP's shape, top-K per token, e.g. 8x2 "
                        "(default: dense MLPs)")
    p.add_argument("--moe-aux-weight", type=float, default=0.01,
                   help="weight of the Switch load-balancing loss in the --moe objective (default 0.01)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    if args.mesh is not None:
        try:
            args.mesh = tuple(int(v) for v in args.mesh.lower().split("x"))
            assert len(args.mesh) == 2 and min(args.mesh) >= 1
        except (ValueError, AssertionError):
            p.error(f"--mesh must look like DxM with positive integers (e.g. 2x1), got {args.mesh!r}")
    if args.steps is not None and args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    for flag, v, lo in (("--batch", args.batch, 1), ("--seq-len", args.seq_len, 1), ("--layers", args.layers, 0)):
        if v is not None and v < lo:  # --batch 0 trained on nothing: a NaN loss at step 0
            p.error(f"{flag} must be >= {lo}, got {v}")
    if args.d_model is not None and (args.d_model < 32 or args.d_model % 32):  # whole 32-element MX blocks
        p.error(f"--d-model must be a positive multiple of 32 (the MX block size), got {args.d_model}")
    if args.eval_batches < 1:  # 0 averaged no batch: NaN eval losses and a NaN gap
        p.error(f"--eval-batches must be >= 1, got {args.eval_batches}")
    if args.eval_every is not None and args.eval_every < 0:  # -1 evaluated after every step
        p.error(f"--eval-every must be >= 0 (0: evaluate at the end only), got {args.eval_every}")
    passes = False if args.hadamard == "none" else "all" if args.hadamard == "all" else tuple(args.hadamard.split(","))
    bad = [v for v in ((passes,) if isinstance(passes, str) else passes or ()) if v not in ("all", "fprop", "dgrad", "wgrad")]
    if bad:
        p.error(f"--hadamard takes fprop, dgrad, wgrad (comma-separated), all or none; got {args.hadamard!r}")
    args.hadamard = passes
    if args.moe:  # the experts run through jax_mxfp4.ragged_dot (exact XLA route; no rotations)
        if args.backend not in ("auto", "xla"):
            p.error(f"--moe needs --backend auto or xla (jax_mxfp4.ragged_dot's backends), got {args.backend!r}")
        if args.hadamard:
            p.error("--moe takes no --hadamard: jax_mxfp4.ragged_dot has no Hadamard rotation")
    if not (args.moe_aux_weight >= 0 and math.isfinite(args.moe_aux_weight)):
        p.error(f"--moe-aux-weight must be a finite number >= 0, got {args.moe_aux_weight}")
    return args


def run_recipes(args):
    """(bf16 recipe, MXFP4 recipe) of the two runs for the flags ``args`` (:func:`parse_args`'s
    result); benchmarks/profile_steps.py times the same two."""
    from jax_mxfp4 import Recipe

    return (Recipe(backend=args.backend, **BF16_RECIPE_FIELDS),
            Recipe(backend=args.backend, grad_rounding=args.grad_rounding, hadamard=args.hadamard,
                   hadamard_block=args.hadamard_block, scale_mode=args.scale_mode))


def main(argv=None) -> int:
    """Entry point of ``python examples/train_lm.py``."""
    run(sys.argv[1:] if argv is None else list(argv))
    return 0


def _json_number(x: float):
    """``x``, or None where it is not finite (tokens/s of a 1-step run has no timed step): strict
    JSON has no NaN."""
    return x if math.isfinite(x) else None


def run(argv=None) -> dict:
    """Parse ``argv`` (the command-line flags), train both runs, write the outputs; returns the
    dict written to ``results.json``."""
    args = parse_args(argv)
    import jax

    cfg = dict(SIZES[args.size])
    for key, val in (("batch", args.batch), ("seq_len", args.seq_len), ("d_model", args.d_model), ("n_layers", args.layers),
                     ("lr", args.lr)):
        if val is not None:
            cfg[key] = val
    cfg["n_heads"] = min(cfg["n_heads"], max(1, cfg["d_model"] // 32))
    if args.moe:  # only then: the dense runs' cfg (results.json "model") stays as it was
        cfg["moe"], cfg["moe_aux_weight"] = list(args.moe), args.moe_aux_weight
    if args.hadamard and cfg["d_model"] % args.hadamard_block:
        # checked before any training: every projection contracts over d_model or a multiple of it
        raise SystemExit(f"error: --hadamard-block {args.hadamard_block} does not divide d_model = "
                         f"{cfg['d_model']} (--size {args.size}): the rotation acts on whole blocks of "
                         "each contraction axis")
    steps = cfg["steps"] = args.steps or cfg["steps"]  # results.json's "model" shows the steps run
    eval_every = args.eval_every if args.eval_every is not None else max(1, steps // 6)
    out = pathlib.Path(args.out)
    try:  # before any training: a file in the way is a clear error, not a traceback
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SystemExit(f"error: --out must name a folder (made if missing), got {args.out!r}: {e}") from None

    t0 = time.perf_counter()
    train_b, eval_b, data_info = load_corpus()
    unigram = unigram_entropy_nats(eval_b)
    starts = batch_starts(train_b.size, cfg["seq_len"], cfg["batch"], steps, args.seed)
    eval_starts = batch_starts(eval_b.size, cfg["seq_len"], cfg["batch"], args.eval_batches, args.seed + 1)
    print(
        f"data: {data_info['train_files']} train files ({data_info['train_bytes'] / 1e6:.1f} MB), "
        f"{data_info['eval_files']} held-out files ({data_info['eval_bytes'] / 1e6:.2f} MB) from {data_info['root']}"
    )
    print(
        f"model: {args.size} (d={cfg['d_model']}, layers={cfg['n_layers']}, heads={cfg['n_heads']}, "
        f"seq={cfg['seq_len']}, batch={cfg['batch']}, lr={cfg['lr']:g}), {steps} steps per run, seed {args.seed}, "
        f"JAX on {jax.default_backend()}"
    )
    if args.moe:
        print(f"MLPs: mixture of {args.moe[0]} experts (d -> {4 * cfg['d_model']} -> d), top-{args.moe[1]}, "
              f"float32 router, load-balancing loss weight {args.moe_aux_weight:g}")
    bf_recipe, mx_recipe = run_recipes(args)
    backend = mxfp4_backend_used(mx_recipe, cfg)
    mesh = make_mesh(args.mesh) if args.mesh else None
    if mesh is not None:
        print(f"mesh: {args.mesh[0]} (data) x {args.mesh[1]} (model) over {mesh.devices.size} x {jax.devices()[0].device_kind}")
    runs = []
    head_recipes = {"bf16": None, "mxfp4": bf_recipe if args.head == "bf16" else None}
    for name, recipe in (("bf16", bf_recipe), ("mxfp4", mx_recipe)):
        with (jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()):
            runs.append(train_one(name, recipe, cfg, steps, args.seed, train_b, eval_b, starts, eval_starts,
                                  eval_every, quiet=args.quiet, head_recipe=head_recipes[name], mesh=mesh,
                                  via=args.via))
    bf, mx4 = runs
    gap = 100.0 * (mx4.eval_loss - bf.eval_loss) / bf.eval_loss
    total = time.perf_counter() - t0

    rows = [("run", "train loss", "eval loss", "gap vs bf16", "tokens/s", "GEMM backend")]
    rows.append(("bf16", f"{bf.train_loss:.4f}", f"{bf.eval_loss:.4f}", "-", f"{bf.tokens_per_s:,.0f}", "XLA bf16 dot"))
    rows.append(("mxfp4", f"{mx4.train_loss:.4f}", f"{mx4.eval_loss:.4f}", f"{gap:+.2f}%", f"{mx4.tokens_per_s:,.0f}", backend))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    print()
    print("\n".join(lines))
    print(
        f"\nlosses in nats/byte; unigram byte entropy of the eval data: {unigram:.4f} nats "
        f"({unigram / math.log(2):.3f} bits); eval loss bf16 {bf.eval_loss / math.log(2):.3f} bits, "
        f"mxfp4 {mx4.eval_loss / math.log(2):.3f} bits per byte"
    )
    # what was measured (docs/performance.md): the CPU size's few steps and small width leave 3-4.5%;
    # medium to xl on an H200 stayed under 1% (+0.20% to +0.82%)
    target = ("3-4.5% expected at this size" if args.size == "small"
              else "under 1% measured on an H200 at sizes medium to xl")
    print(f"MXFP4 eval loss is {gap:+.2f}% vs bf16 ({target}); total wall time {total:.0f} s")

    results = {
        "bf16": {"eval_loss": bf.eval_loss, "train_loss": bf.train_loss, "tokens_per_s": _json_number(bf.tokens_per_s),
                 "wall_s": bf.wall_s, "recipe": dataclasses.asdict(bf_recipe),
                 "eval_curve": bf.eval_curve, "train_curve": bf.train_curve, "step_s": bf.step_s},
        "mxfp4": {"eval_loss": mx4.eval_loss, "train_loss": mx4.train_loss,
                  "tokens_per_s": _json_number(mx4.tokens_per_s),
                  "wall_s": mx4.wall_s, "recipe": dataclasses.asdict(mx_recipe),
                  "eval_curve": mx4.eval_curve, "train_curve": mx4.train_curve, "step_s": mx4.step_s},
        "mxfp4_head": args.head,
        "moe": None if not args.moe else dict(
            experts=args.moe[0], top_k=args.moe[1], expert_width=4 * cfg["d_model"], aux_weight=args.moe_aux_weight,
            aux_loss="switch", router="float32 flax.linen.Dense", expert_layer=(
                "plain jax.lax.ragged_dot, intercepted by jax_mxfp4.qwix" if args.via == "qwix"
                else "jax_mxfp4.flax.linen.RaggedDense"),
            routing={"bf16": bf.moe, "mxfp4": mx4.moe}),
        "via": args.via,
        "gap_pct": gap,
        "steps": steps,
        "backend": backend,
        "size": args.size,
        "seed": args.seed,
        "model": cfg,
        "unigram_entropy_nats": unigram,
        "data": data_info,
        "platform": jax.default_backend(),
        "device": jax.devices()[0].device_kind,
        "mesh": list(args.mesh) if args.mesh else None,
        "cpu_count": os.cpu_count(),
        "total_wall_s": total,
    }
    (out / "results.json").write_text(json.dumps(results, indent=2))
    plot(out / "loss.png", runs, unigram)
    print(f"wrote {out / 'results.json'} and {out / 'loss.png'}")
    return results


if __name__ == "__main__":
    sys.exit(main())
