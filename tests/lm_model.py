"""A small Griffin/Gemma-style language model written the way third-party Flax code is, with no
knowledge of jax_mxfp4: RMSNorm, attention with multi-query (one key/value head broadcast by
``jnp.einsum``), grouped-query or multi-head attention, a gated MLP whose weights are used as
``x @ self.param(...)``, a tied embedding (``nn.Embed.attend``), optional ``nn.scan``/``nn.remat``
blocks. The Qwix tests quantize it unmodified."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp


class RMSNorm(nn.Module):
    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.zeros_init(), (x.shape[-1],))
        var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
        return x * jax.lax.rsqrt(var + 1e-6) * (1 + scale)


class Attention(nn.Module):
    num_heads: int = 4
    num_kv_heads: int = 1
    head_dim: int = 32

    @nn.compact
    def __call__(self, x):
        b, t, d = x.shape
        q = nn.DenseGeneral((self.num_heads, self.head_dim), use_bias=False, name="q")(x)
        k = nn.DenseGeneral((self.num_kv_heads, self.head_dim), use_bias=False, name="k")(x)
        v = nn.DenseGeneral((self.num_kv_heads, self.head_dim), use_bias=False, name="v")(x)
        q = q * self.head_dim**-0.5
        mask = jnp.tril(jnp.ones((t, t), bool))
        if self.num_kv_heads in (1, self.num_heads):  # MHA, or MQA with k, v broadcast over heads
            logits = jnp.einsum("btnh,bsnh->bnts", q, k)
            probs = jax.nn.softmax(jnp.where(mask, logits, -1e30), axis=-1)
            enc = jnp.einsum("bnts,bsnh->btnh", probs, v)
        else:  # GQA: query heads grouped per key/value head
            q = q.reshape(b, t, self.num_kv_heads, -1, self.head_dim)
            logits = jnp.einsum("btkgh,bskh->bkgts", q, k)
            probs = jax.nn.softmax(jnp.where(mask, logits, -1e30), axis=-1)
            enc = jnp.einsum("bkgts,bskh->btkgh", probs, v).reshape(b, t, self.num_heads, self.head_dim)
        return nn.DenseGeneral(d, axis=(-2, -1), use_bias=False, name="o")(enc)


class GatedMLP(nn.Module):
    hidden: int = 128

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        init = nn.initializers.lecun_normal()
        w_gate = self.param("w_gate", init, (d, self.hidden))
        w_up = self.param("w_up", init, (d, self.hidden))
        w_down = self.param("w_down", init, (self.hidden, d))
        return (jax.nn.gelu(x @ w_gate) * (x @ w_up)) @ w_down


class Block(nn.Module):
    num_kv_heads: int = 1

    @nn.compact
    def __call__(self, x, _=None):  # (carry, x) -> (carry, y): usable by nn.scan
        x = x + Attention(num_kv_heads=self.num_kv_heads, name="attn")(RMSNorm(name="pre_attn")(x))
        x = x + GatedMLP(name="mlp")(RMSNorm(name="pre_mlp")(x))
        return x, None


class LM(nn.Module):
    vocab: int = 96
    d_model: int = 64
    num_layers: int = 1
    num_kv_heads: int = 1
    scan: bool = False
    remat: bool = False

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(self.vocab, self.d_model, name="embed")
        x = embed(tokens) * jnp.sqrt(self.d_model).astype(jnp.float32)
        block = nn.remat(Block) if self.remat else Block
        if self.scan:
            x, _ = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True, "stochastic_rounding": True},
                           length=self.num_layers)(num_kv_heads=self.num_kv_heads, name="blocks")(x, None)
        else:
            for i in range(self.num_layers):
                x, _ = block(num_kv_heads=self.num_kv_heads, name=f"block_{i}")(x)
        return embed.attend(RMSNorm(name="final_norm")(x))
