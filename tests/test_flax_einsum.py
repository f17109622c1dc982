"""MXFP4 Flax Einsum layers (linen and nnx): Flax's own parameter names and shapes, forward equal
to jax_mxfp4.einsum plus the bias, any K (zero-padded), quantized kernels for inference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

flax = pytest.importorskip("flax")
import flax.linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

import jax_mxfp4 as mx  # noqa: E402
import jax_mxfp4.flax as mxf  # noqa: E402


def test_linen_einsum_params_match_flax_and_forward_is_mxfp4_einsum(rng):
    x = jnp.asarray(rng.standard_normal((2, 3, 64)), jnp.float32)
    ours = mxf.linen.Einsum((64, 4, 8), "bsd,dnh->bsnh")
    theirs = nn.Einsum((64, 4, 8), "bsd,dnh->bsnh")
    p = ours.init(jax.random.key(1), x)
    q = theirs.init(jax.random.key(1), x)
    assert jax.tree.map(jnp.shape, p) == jax.tree.map(jnp.shape, q) == {"params": {"kernel": (64, 4, 8), "bias": (4, 8)}}
    np.testing.assert_array_equal(p["params"]["kernel"], q["params"]["kernel"])
    bias = jnp.asarray(rng.standard_normal((4, 8)), jnp.float32)
    p = {"params": {"kernel": p["params"]["kernel"], "bias": bias}}
    want = mx.einsum("bsd,dnh->bsnh", x, p["params"]["kernel"]) + bias
    np.testing.assert_array_equal(ours.apply(p, x), want)
    # MXFP4 vs Flax's float einsum: close (4-bit operands), not equal
    err = np.abs(ours.apply(p, x) - theirs.apply(p, x)).max()
    assert 0 < err < 0.5 * np.abs(theirs.apply(p, x)).max()


def test_linen_einsum_any_k_and_quantized_kernel(rng):
    x = jnp.asarray(rng.standard_normal((5, 40)), jnp.float32)
    layer = mxf.linen.Einsum((40, 6), "mk,kn->mn")
    p = layer.init(jax.random.key(0), x)
    y = layer.apply(p, x)
    xp = jnp.pad(x, ((0, 0), (0, 24)))
    kp = jnp.pad(p["params"]["kernel"], ((0, 24), (0, 0)))
    np.testing.assert_array_equal(y, mx.einsum("mk,kn->mn", xp, kp) + p["params"]["bias"])
    qp = mxf.quantize_params(p, model=layer, inputs=(x,))
    assert isinstance(qp["params"]["kernel"], mx.MXFP4Array) and qp["params"]["kernel"].shape == (64, 6)
    np.testing.assert_array_equal(layer.apply(qp, x), y)  # same quantized values as the float path


def test_nnx_einsum_params_match_flax_forward_and_errors(rng):
    x = jnp.asarray(rng.standard_normal((2, 3, 32)), jnp.bfloat16)
    ours = mxf.nnx.Einsum("bsd,dnh->bsnh", (32, 4, 8), (4, 8), rngs=nnx.Rngs(0))
    theirs = nnx.Einsum("bsd,dnh->bsnh", (32, 4, 8), (4, 8), rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(ours.kernel[...], theirs.kernel[...])
    assert jax.tree.map(jnp.shape, nnx.state(ours, nnx.Param)) == jax.tree.map(jnp.shape, nnx.state(theirs, nnx.Param))
    y = ours(x)
    assert y.dtype == theirs(x).dtype == jnp.float32  # promoted with the float32 params, as Flax
    np.testing.assert_array_equal(y, mx.einsum("bsd,dnh->bsnh", x.astype(jnp.float32), ours.kernel[...]) + ours.bias[...])
    q = mxf.quantize_params(nnx.state(ours, nnx.Param), model=ours)
    assert isinstance(q["kernel"].get_value(), mx.MXFP4Array)
    nnx.update(ours, q)
    np.testing.assert_array_equal(ours(x), y)
    with pytest.raises(TypeError, match="einsum_op"):
        mxf.nnx.Einsum("ab,bc->ac", (32, 4), einsum_op=jnp.einsum, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="summed over one operand"):
        mxf.nnx.Einsum("abz,bc->ac", (32, 4), rngs=nnx.Rngs(0))(jnp.ones((2, 32, 3)))


@pytest.mark.parametrize("which", ["linen", "nnx"])
def test_einsum_layers_serve_the_weights_they_trained_with(which):
    """The Einsum layers serve the weights they trained with: with dtype=bfloat16 and float32 params the trained
    forward quantizes the float32 kernel (never a bf16 copy), so the output after
    quantize_params is bit-identical, and it differs from quantizing a bf16-rounded kernel
    (which would round some E2M1 codes differently: the test can fail)."""
    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.standard_normal((4, 64)), jnp.bfloat16)
    if which == "linen":
        layer = mxf.linen.Einsum((64, 32), "mk,kn->mn", dtype=jnp.bfloat16, use_bias=False)
        p = layer.init(jax.random.key(1), x)
        kernel = p["params"]["kernel"]
        y = layer.apply(p, x)
        y_served = layer.apply(mxf.quantize_params(p, model=layer, inputs=(x,)), x)
    else:
        layer = mxf.nnx.Einsum("mk,kn->mn", (64, 32), None, dtype=jnp.bfloat16, rngs=nnx.Rngs(1))
        kernel = layer.kernel[...]
        y = layer(x)
        nnx.update(layer, mxf.quantize_params(nnx.state(layer, nnx.Param), model=layer))
        y_served = layer(x)
    assert kernel.dtype == jnp.float32 and y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(y_served, np.float32), np.asarray(y, np.float32))
    q32 = mx.quantize(kernel, 0, scale_mode="even")
    q16 = mx.quantize(kernel.astype(jnp.bfloat16), 0, scale_mode="even")
    assert not np.array_equal(np.asarray(q32.data), np.asarray(q16.data))  # the fault is observable here
