"""The "mlp-block" config of benchmarks/train_step.py: one Flax linen MLP block, trained through Qwix.

Model: ``y = Dense(d)(gelu(Dense(hidden)(x)))``, two ``nn.Dense`` without bias, float32 params,
``dtype=bfloat16`` (Flax casts x and the kernels to bf16 before each dot: bf16 operands, float32
accumulation, bf16 out, the rule of train_step.py's bf16 rows). One step: ``jax.value_and_grad``
of ``loss = sum(y * dY)`` (float32; dY a fixed random [T, d] array) with respect to the params
and x, so the step runs the GEMMs of the VJP with cotangent dY that the other configs time.
Variants (the same unmodified model, quantized by ``qwix.quantize_model``; every Dense matched):
  bf16        the plain model;
  mxfp4-qwix  jax_mxfp4's provider (:class:`jax_mxfp4.qwix.MxQtProvider`, ``MxRule`` with
              ``Recipe()``): MXFP4 fprop, dgrad and wgrad, dY stochastically rounded with the
              data-derived key (no RNG stream given), the GEMMs on the backend "auto" picks;
  mxfp4-qwix-rbg  the same with an "rbg" key in the rule's RNG stream (:data:`RBG_SEED`): the
              key kind the demo's GPU sizes use, whose uniforms the fused FP8 quantizer generates
              in the kernel (Philox) at less cost than the data-derived threefry key's;
  qwix-fp8    Qwix's own QAT (``qwix.QtProvider``): weights and activations float8_e4m3fn,
              gradients float8_e5m2, absmax per-channel scales, round to nearest;
  qwix-mxfp4  Qwix's own MXFP4 emulation: qtype "mxfp4" (float4_e2m1fn, power-of-two scale per
              32-element tile of the contraction axis, round to nearest) for every operand of
              fprop, dgrad and wgrad. ``QtRule``'s fields alone tile only the weight gradient's
              contraction, and the activation gradient's quantization then fails (qwix 0.1.8:
              "Format mxfp4 requires `tiled_axes` to be specified"); :data:`MXFP4_BWD` (Qwix's
              ``additional_qt_config``) tiles it too and quantizes the backward's residuals (x, W)
              to MXFP4 as well (Qwix keeps tiled residuals unquantized). On a GPU Qwix runs these
              products through ``jax.nn.scaled_matmul`` (XLA expands it on pre-Blackwell GPUs).
flax and qwix are imported when a model is built (train_step.py's other configs need neither).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

VARIANTS = ("bf16", "mxfp4-qwix", "mxfp4-qwix-rbg", "qwix-fp8", "qwix-mxfp4")
RBG_SEED = 0x5352
"""mxfp4-qwix-rbg: ``jax.random.key(RBG_SEED, impl="rbg")`` in the "stochastic_rounding" stream
(one fixed key: the benchmark times one step; a training loop folds in the step number)."""
MX_BLOCK = 32  # Qwix's tile for its "mxfp4" qtype (OCP MX block)
MXFP4_BWD = {"dlhs_tile_size": MX_BLOCK, "dlhs_residual_qtype": "mxfp4", "drhs_residual_qtype": "mxfp4"}
"""Qwix ``DotGeneralQtConfig`` fields completing its MXFP4 backward (module docstring, qwix-mxfp4)."""


def _rule(variant):
    """The Qwix provider quantizing every dot_general of the block for ``variant``."""
    import qwix

    if variant in ("mxfp4-qwix", "mxfp4-qwix-rbg"):
        import jax_mxfp4 as mx
        from jax_mxfp4.qwix import MxQtProvider, MxRule

        return MxQtProvider([MxRule(module_path=".*", recipe=mx.Recipe())])
    if variant == "qwix-fp8":
        return qwix.QtProvider([qwix.QtRule(module_path=".*", weight_qtype=jnp.float8_e4m3fn,
                                            act_qtype=jnp.float8_e4m3fn, bwd_qtype=jnp.float8_e5m2)])
    if variant == "qwix-mxfp4":
        return qwix.QtProvider([qwix.QtRule(module_path=".*", weight_qtype="mxfp4", act_qtype="mxfp4",
                                            bwd_qtype="mxfp4", tile_size=MX_BLOCK,
                                            bwd_weight_grad_tile_size=MX_BLOCK,
                                            additional_qt_config=MXFP4_BWD)])
    raise ValueError(f"mlp_block: unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")


@functools.cache
def _block_class():
    import flax.linen as nn

    class MlpBlock(nn.Module):
        """x [T, d] -> Dense(hidden) -> gelu -> Dense(d), bf16 compute on float32 params."""

        hidden: int

        @nn.compact
        def __call__(self, x):
            h = nn.Dense(self.hidden, use_bias=False, dtype=jnp.bfloat16, name="up")(x)
            return nn.Dense(x.shape[-1], use_bias=False, dtype=jnp.bfloat16, name="down")(jax.nn.gelu(h))

    return MlpBlock


def model(variant: str, hidden: int):
    """The block for ``variant`` (one of :data:`VARIANTS`): the plain linen model, or it quantized
    by ``qwix.quantize_model`` (the same params tree either way)."""
    plain = _block_class()(hidden)
    if variant == "bf16":
        return plain
    import qwix

    return qwix.quantize_model(plain, _rule(variant))


def make_set(s: dict, seed: int):
    """One operand set ``(params, x, dY)`` for sizes ``s`` (t, d, hidden): the block's Flax-initialised
    float32 params, x and dY bf16 [t, d]. x is the smallest leaf (first of the equal-sized x and dY),
    the one benchmarks.common.time_fn copies per extra call: it reaches every GEMM of the step."""
    kp, kx, ky = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (s["t"], s["d"]), jnp.bfloat16)
    params = model("bf16", s["hidden"]).init(kp, x[:1])["params"]  # kernel shapes need only d
    dy = jax.random.normal(ky, (s["t"], s["d"]), jnp.bfloat16)
    return params, x, dy


def make_step(variant: str, hidden: int):
    """``step(params, x, dY) -> (loss, (dparams, dx))``: value and gradients of ``sum(y * dY)``."""
    m = model(variant, hidden)

    rngs = {"stochastic_rounding": jax.random.key(RBG_SEED, impl="rbg")} if variant == "mxfp4-qwix-rbg" else None

    def loss(params, x, dy):
        y = m.apply({"params": params}, x, rngs=rngs)
        return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32))

    def step(params, x, dy):
        return jax.value_and_grad(loss, argnums=(0, 1))(params, x, dy)

    return step
