"""Higher-order differentiation through jax_mxfp4: the documented value, or a clear error.

Definition (jax_mxfp4.training): the backward passes' MXFP4 products are differentiated as the
exact float products of their operands (straight-through), in float32 at HIGHEST precision; the
forward product is differentiated by its MXFP4 custom VJP at every order. References are float64
NumPy of that definition; first-order pieces the definition reuses come from the library's own
(separately tested) VJP.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_mxfp4 as mx
from jax_mxfp4 import gemm

DIMS2 = (((1,), (0,)), ((), ()))
DIMS_BATCHED = (((2,), (1,)), ((0,), (0,)))
NEAREST = mx.Recipe(grad_rounding="nearest", backend="xla")


def f64(a):
    return np.asarray(a, np.float64)


def assert_close(got, want, tol):
    got, want = f64(got), f64(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    scale = np.max(np.abs(want))
    assert scale > 0
    err = np.max(np.abs(got - want)) / scale
    assert err <= tol, f"max error {err:.3e} of max |want| {scale:.3e}"


def mT(a):
    return np.swapaxes(a, -1, -2)


def normal(rng, shape, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)


# ----------------------------------------------------------------------------- the backward's derivative
@pytest.mark.sweep(keep=2)
@pytest.mark.parametrize("recipe", [
    mx.Recipe(backend="xla"),
    mx.Recipe(backend="xla", hadamard=("dgrad", "wgrad")),
    mx.Recipe(backend="xla", dgrad="bf16", wgrad="bf16"),
], ids=["mxfp4-sr", "mxfp4-hadamard", "bf16-passes"])
@pytest.mark.parametrize("shapes", [((40, 64), (64, 24), DIMS2), ((2, 24, 64), (2, 64, 40), DIMS_BATCHED)],
                         ids=["kernel-[K,N]", "batched"])
def test_backward_pass_is_differentiated_as_the_exact_products(rng, recipe, shapes):
    """(dx, dw) = pull(c) of y = dot_general(x, w): its VJP with cotangents (u, v) is that of
    dx = c·wᵀ, dw = xᵀ·c: gx = c·vᵀ, gw = uᵀ·c, gc = u·w + x·v (float64), not zero."""
    xs, ws, dn = shapes
    x, w = normal(rng, xs), normal(rng, ws, 0.1)
    c = normal(rng, xs[:-1] + ws[-1:])
    u, v = normal(rng, xs), normal(rng, ws)

    def backward(x, w, c):
        return jax.vjp(lambda a, b: mx.dot_general(a, b, dn, recipe=recipe), x, w)[1](c)

    gx, gw, gc = jax.jit(lambda *a: jax.vjp(backward, *a[:3])[1](a[3:]))(x, w, c, u, v)
    x, w, c, u, v = map(f64, (x, w, c, u, v))
    assert_close(gx, c @ mT(v), 1e-5)
    assert_close(gw, mT(u) @ c, 1e-5)
    assert_close(gc, u @ w + x @ v, 1e-5)


@pytest.mark.sweep(keep=2)
@pytest.mark.parametrize("form", ["MXFP4Array", "FP8Prepared", "DecodePrepared"])
def test_backward_pass_with_prequantized_weight_is_differentiated_exactly(rng, form):
    """dx = c·Dᵀ (D: the weight's dequantized values): d<dx, u>/dc = u·D, d/dx = 0 exactly."""
    x, w, c, u = normal(rng, (40, 64)), normal(rng, (64, 24)), normal(rng, (40, 24)), normal(rng, (40, 64))
    q = mx.quantize(w, 0)
    d = f64(mx.dequantize(q))
    q = {"MXFP4Array": q, "FP8Prepared": mx.prepare_fp8(q), "DecodePrepared": mx.prepare_decode(q)}[form]

    def backward(x, c):
        return jax.vjp(lambda a: mx.dot_general(a, q, DIMS2), x)[1](c)[0]

    gx, gc = jax.jit(lambda x, c, u: jax.vjp(backward, x, c)[1](u))(x, c, u)
    assert_close(gc, f64(u) @ d, 1e-5)
    assert not np.any(f64(gx))


# ----------------------------------------------------------------------------- the reported case
def loss(x, w, recipe=NEAREST):
    return jnp.sum(mx.dot_general(x, w, DIMS2, recipe=recipe) ** 2)


def test_gradient_penalty_through_dot_general_is_the_chain_rule_not_zero(rng):
    """pen(w) = Σ G², G = ∂loss/∂w = wgrad(2y, x). Chain rule of the definition: ∂pen/∂G = 2G,
    through the exact wgrad product ∂/∂y = 2·(x·2G), then the forward's MXFP4 VJP in w."""
    x, w = normal(rng, (64, 64)), normal(rng, (64, 32), 0.1)
    got = jax.jit(jax.grad(lambda w: jnp.sum(jax.grad(loss, argnums=1)(x, w) ** 2)))(w)
    g = jax.jit(jax.grad(loss, argnums=1))(x, w)
    ct_y = jnp.asarray(4.0 * f64(x) @ f64(g), jnp.float32)
    want = jax.jit(lambda w, ct: jax.vjp(lambda w: mx.dot_general(x, w, DIMS2, recipe=NEAREST), w)[1](ct)[0])(w, ct_y)
    assert_close(got, want, 1e-3)
    # and the float model's penalty gradient 8·xᵀx·xᵀx·w, to MXFP4 accuracy
    xtx = f64(x).T @ f64(x)
    assert_close(got, 8.0 * xtx @ xtx @ f64(w), 0.25)


def test_hessian_vector_product_reverse_over_reverse(rng):
    """H·v = ∂/∂w <∂loss/∂w, v>: the forward's MXFP4 VJP of 2·x·v (chain rule of the definition);
    close to the float Hessian 2·xᵀx·v."""
    x, w, v = normal(rng, (64, 64)), normal(rng, (64, 32), 0.1), normal(rng, (64, 32))
    hvp = jax.jit(jax.grad(lambda w: jnp.vdot(jax.grad(loss, argnums=1)(x, w), v)))(w)
    ct_y = jnp.asarray(2.0 * f64(x) @ f64(v), jnp.float32)
    want = jax.vjp(lambda w: mx.dot_general(x, w, DIMS2, recipe=NEAREST), w)[1](ct_y)[0]
    assert_close(hvp, want, 1e-3)
    assert_close(hvp, 2.0 * f64(x).T @ f64(x) @ f64(v), 0.25)


def test_gradient_penalty_with_mxfp4array_weight_is_the_chain_rule(rng):
    """pen(x) = Σ G², G = ∂loss/∂x = dgrad(2y, D): ∂/∂y = 2·(2G·D), then the MXFP4 VJP in x."""
    x, w = normal(rng, (64, 64)), normal(rng, (64, 32), 0.1)
    q = mx.quantize(w, 0)
    got = jax.jit(jax.grad(lambda x: jnp.sum(jax.grad(loss)(x, q) ** 2)))(x)
    g = jax.jit(jax.grad(loss))(x, q)
    ct_y = jnp.asarray(4.0 * f64(g) @ f64(mx.dequantize(q)), jnp.float32)
    want = jax.vjp(lambda x: mx.dot_general(x, q, DIMS2, recipe=NEAREST), x)[1](ct_y)[0]
    assert_close(got, want, 1e-3)


@pytest.mark.sweep(keep=1)
@pytest.mark.parametrize("entry", ["dense", "einsum"])
def test_gradient_penalty_of_dense_and_einsum_is_not_zero(rng, entry):
    """The other training entry points share the rule: their penalty gradient equals dot_general's."""
    x, w = normal(rng, (40, 64)), normal(rng, (64, 24), 0.1)
    call = {"dense": lambda x, w: mx.dense(x, w, recipe=NEAREST),
            "einsum": lambda x, w: mx.einsum("mk,kn->mn", x, w, recipe=NEAREST)}[entry]

    def pen(fn):
        return jax.jit(jax.grad(lambda w: jnp.sum(jax.grad(lambda w: jnp.sum(fn(x, w) ** 2))(w) ** 2)))(w)

    got = pen(call)
    assert np.any(f64(got))
    np.testing.assert_array_equal(got, pen(lambda x, w: mx.dot_general(x, w, DIMS2, recipe=NEAREST)))


def test_forward_over_reverse_raises_custom_vjp_error(rng):
    x, w = normal(rng, (32, 32)), normal(rng, (32, 32))
    with pytest.raises(TypeError, match="custom_vjp"):
        jax.jvp(lambda w: jax.grad(loss, argnums=1)(x, w), (w,), (w,))


# ----------------------------------------------------------------------------- quantizers: an error
@pytest.mark.sweep(keep=3)
@pytest.mark.parametrize("call", [
    "quantize", "dot_general(x, quantize(w))", "gemm.dot_general", "prepare_fp8(quantize(w))", "quantize_rotated",
])
def test_gradient_through_a_quantizer_raises_instead_of_zero(rng, call):
    """Codes and scales are integers: JAX would return an exact zero; a clear error names the quantizer."""
    from jax_mxfp4.quantize import quantize_rotated

    x = normal(rng, (32, 64))
    fn = {
        "quantize": lambda w: mx.dequantize(mx.quantize(w, 1)),
        "quantize_rotated": lambda w: mx.dequantize(quantize_rotated(w, 1, (32, 7))),
        "gemm.dot_general": lambda w: gemm.dot_general(x, w, (((1,), (1,)), ((), ()))),
        "dot_general(x, quantize(w))": lambda w: mx.dot_general(x, mx.quantize(w, 1), (((1,), (1,)), ((), ()))),
        "prepare_fp8(quantize(w))": lambda w: mx.prepare_fp8(mx.quantize(w, 1)).dequantize(),
    }[call]
    with pytest.raises(ValueError, match=r"jax_mxfp4\.quantize(_rotated)? is not differentiable"):
        jax.grad(lambda w: jnp.sum(fn(w)))(x)


def test_quantizing_a_constant_under_grad_is_allowed(rng):
    """A weight quantized inside the differentiated function but not differentiated (closed over,
    or behind stop_gradient) raises nothing: only a perturbed quantizer input does."""
    x, w = normal(rng, (32, 64)), normal(rng, (64, 16))
    d = f64(mx.dequantize(mx.quantize(w, 0)))

    def closed_over(x):
        return jnp.sum(mx.dot_general(x, mx.quantize(w, 0), DIMS2, recipe=NEAREST))

    def stopped(x):  # the weight is a function of x, its gradient stopped
        wx = w + 0.0 * jax.lax.stop_gradient(x[:, :16].sum())
        return jnp.sum(mx.dot_general(x, mx.quantize(wx, 0), DIMS2, recipe=NEAREST))

    for fn in (closed_over, stopped):
        # d/dx Σ x·D = 1·Dᵀ through the MXFP4 dgrad (cotangent of ones, quantized along N)
        assert_close(jax.jit(jax.grad(fn))(x), np.ones((32, 16)) @ d.T, 0.2)
