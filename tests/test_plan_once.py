"""Each GEMM is validated and dispatched once: the public entry points check the recipe once
per call, and every GEMM (fprop, dgrad, wgrad) chooses its backend once
(:func:`jax_mxfp4.gemm.plan`), whatever route the operands take."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_mxfp4 as mx
from jax_mxfp4 import dims, dispatch


@pytest.fixture
def counts(monkeypatch):
    seen = {"check_recipe": 0, "plan": 0}

    def counting(name, fn):
        def wrapped(*args, **kwargs):
            seen[name] += 1
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(dims, "check_recipe", counting("check_recipe", dims.check_recipe))
    monkeypatch.setattr(dispatch, "plan", counting("plan", dispatch.plan))
    return seen


def _operands(rng, m=64, k=64, n=32):
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
    return x, w


DN = (((1,), (0,)), ((), ()))


def test_float_forward_one_check_one_plan(rng, counts):
    x, w = _operands(rng)
    ref = mx.dot_general(x, w, DN)
    counts.update(check_recipe=0, plan=0)
    out = mx.dot_general(x, w, DN, precision=jax.lax.Precision.HIGHEST)
    assert counts == {"check_recipe": 1, "plan": 1}
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))  # same bits as the default precision on CPU


def test_mxfp4_weight_forward_one_plan(rng, counts):
    x, w = _operands(rng)
    wq = mx.quantize(w, axis=0)
    mx.dot_general(x, wq, DN)
    assert counts == {"check_recipe": 1, "plan": 1}


def test_einsum_one_check_one_plan(rng, counts):
    x, w = _operands(rng)
    mx.einsum("mk,kn->mn", x, w)
    assert counts == {"check_recipe": 1, "plan": 1}


def test_training_step_one_plan_per_gemm(rng, counts):
    """value_and_grad: fprop, dgrad and wgrad, three GEMMs, three plans; the recipe checked once."""
    x, w = _operands(rng)
    jax.value_and_grad(lambda x, w: jnp.sum(mx.dot_general(x, w, DN) ** 2), argnums=(0, 1))(x, w)
    assert counts == {"check_recipe": 1, "plan": 3}


def test_dense_with_mxfp4_kernel_gradient_one_plan_per_gemm(rng, counts):
    """An MXFP4Array kernel: the forward GEMM and dgrad only (no wgrad for a quantized weight)."""
    x, w = _operands(rng)
    wq = mx.quantize(w, axis=0)
    jax.grad(lambda x: jnp.sum(mx.dense(x, wq)))(x)
    assert counts == {"check_recipe": 1, "plan": 2}
