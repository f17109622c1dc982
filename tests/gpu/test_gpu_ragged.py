"""MXFP4 ragged_dot on an NVIDIA GPU: the grouped kernel (inline-PTX decode, masked K, split-K,
empty experts, 128-row passes for large groups) and the bfloat16-decode route (kernels off)
against the exact route (``Recipe(backend="xla")``) on the same device, both expert storages, a4w4 and w4a16, and
the gradients of a training step against the exact route's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_mxfp4 as mx
from gpu_reference import rand

pytestmark = [pytest.mark.gpu, pytest.mark.cuda]

NK_DN = lax.RaggedDotDimensionNumbers((((1,), (2,)), ((), ())), (0,), (0,))
KN_DN = lax.RaggedDotDimensionNumbers((((1,), (1,)), ((), ())), (0,), (0,))
EXACT = mx.Recipe(backend="xla")


def _sizes(seed, m, g, used):
    """group sizes over ``used`` random experts summing to m - 3 (3 rows past the groups)."""
    r = np.random.default_rng(seed)
    gs = np.zeros(g, np.int32)
    experts = r.choice(g, used, replace=False)
    np.add.at(gs, r.choice(experts, m - 3), 1)
    return jnp.asarray(gs)


CASES = [  # m, k, n, g, used experts, storage
    (4, 2880, 5760, 32, 4, "nk"),  # one token, top-4, gpt-oss-20b gate+up: K masked, split-K
    (64, 2880, 2880, 32, 29, "kn"),
    (256, 2880, 2880, 32, 32, "nk"),
    (2048, 1024, 768, 8, 8, "kn"),  # 256 rows per expert: 128-row passes
]


@pytest.mark.parametrize("m,k,n,g,used,storage", CASES)
@pytest.mark.parametrize("recipe", [mx.Recipe(), mx.Recipe(quantize_activations=False)], ids=["a4w4", "w4a16"])
def test_ragged_dot_routes_equal_the_exact_route(m, k, n, g, used, storage, recipe):
    dn = NK_DN if storage == "nk" else KN_DN
    k_axis = 2 if storage == "nk" else 1
    w = rand(m + k, (g, n, k) if storage == "nk" else (g, k, n), jnp.float32)
    wq = mx.quantize(w, k_axis)
    x = rand(m + n, (m, k), jnp.bfloat16)
    gs = _sizes(m, m, g, used)
    route = mx.ragged.explain_ragged_dot(x, wq, gs, dn, recipe=recipe)
    assert route.route == "grouped-kernel", route
    f = jax.jit(lambda x, w, gs, r: mx.ragged_dot_general(x, w, gs, dn, preferred_element_type=jnp.float32, recipe=r),
                static_argnums=3)
    got = np.asarray(f(x, wq, gs, recipe))
    want = np.asarray(f(x, wq, gs, EXACT.replace(quantize_activations=recipe.quantize_activations)))
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * scale)
    assert not got[int(gs.sum()):].any()


def test_kernels_off_take_the_bf16_decode_route(monkeypatch):
    m, k, n, g = 64, 512, 256, 8
    w = mx.quantize(rand(5, (g, k, n), jnp.float32), 1)
    x = rand(6, (m, k), jnp.bfloat16)
    gs = _sizes(7, m, g, 6)
    monkeypatch.setenv("JAX_MXFP4_KERNELS", "0")
    assert mx.ragged.explain_ragged_dot(x, w, gs).route == "bf16-decode"
    got = np.asarray(jax.jit(lambda x, w, gs: mx.ragged_dot(x, w, gs, preferred_element_type=jnp.float32))(x, w, gs))
    want = np.asarray(mx.ragged_dot(x, w, gs, preferred_element_type=jnp.float32, recipe=EXACT))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_training_step_gradients_equal_the_exact_route():
    m, k, n, g = 64, 512, 256, 8
    x = rand(1, (m, k), jnp.float32)
    w = rand(2, (g, k, n), jnp.float32)
    dy = rand(3, (m, n), jnp.float32)
    gs = _sizes(4, m, g, 6)

    def grads(recipe):
        loss = lambda x, w: jnp.sum(mx.ragged_dot(x, w, gs, recipe=recipe, key=jax.random.key(0)) * dy)
        return jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)

    for got, want in zip(grads(mx.Recipe()), grads(EXACT)):
        got, want = np.asarray(got), np.asarray(want)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("sizes", [[40, -8, 40, 0], [50, 30, 20, 10]], ids=["negative", "sum-past-m"])
def test_invalid_group_sizes_under_jit_give_nan_not_a_fault(sizes):
    """The grouped kernel runs before ragged_dot's NaN poisoning: its rows stay inside x."""
    m, k, n = 64, 256, 128
    w = mx.quantize(rand(8, (4, k, n), jnp.float32), 1)
    x = rand(9, (m, k), jnp.bfloat16)
    out = jax.jit(lambda x, w, gs: mx.ragged_dot(x, w, gs, preferred_element_type=jnp.float32))(
        x, w, jnp.asarray(sizes, jnp.int32))
    assert np.isnan(np.asarray(out)).all()
