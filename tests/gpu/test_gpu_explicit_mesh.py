"""Explicit-sharding meshes on real GPUs (2 at least): on ``AxisType.Explicit`` and
``AxisType.Auto`` meshes, with backend "auto" (on CUDA: pallas for small GEMMs, scaled_dot for
large ones) and "pallas" (compiled), against the single-device run:
  - a0:     dense(x [D, 64, 64] on P("data", None, None), w [64, 32] made outside the mesh),
            forward and gradients;
  - a:      dot_general(bf16 [16, 256] on P("data", None), bf16 [256, 512]), forward;
  - b:      gradients of sum(dot_general(x [64, 256] on P("data"), w [256, 48] on P(None, "model"))**2)
            (dY's N = 48 split over "model": dgrad regathers N), grad_rounding="nearest";
  - tokens: a flax linen Dense training step with 48 and 100 tokens per device (stochastic
            rounding, one step key).
Pass: output sharding as in plain JAX (a0, a), and every value within 1e-5 of the largest
magnitude of the single-device run (float32 reassociation level, as tests/test_sharding.py; a
wrong block, axis or key is off by ~1e-1), one bf16 ulp (2^-7) for bf16 outputs. The same cases
run on simulated CPU devices in tests/test_explicit_mesh.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_mxfp4 as mx

pytestmark = pytest.mark.gpu

DIMS = (((1,), (0,)), ((), ()))
D = 2  # devices along "data"


@pytest.fixture
def meshes(style):
    """(mesh, mesh for case b) over the GPUs: ("data", "model") = (2, n // 2) with 4 or more,
    (2, 1) with 2 or 3 (case b then splits "model" over 2 devices)."""
    devices = jax.devices()
    n = len(devices)
    if n < 2:
        pytest.skip(f"needs at least 2 GPUs, JAX sees {n}")
    model = n // D if n >= 4 else 1
    mesh = jax.make_mesh((D, model), ("data", "model"), axis_types=(style,) * 2, devices=devices[:D * model])
    if n < 4:
        mesh_b = jax.make_mesh((1, 2), ("data", "model"), axis_types=(style,) * 2, devices=devices[:2])
    else:
        mesh_b = mesh
    return mesh, mesh_b


def normal(seed, shape, dtype=jnp.float32, scale=1.0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * scale, dtype)


def assert_close(got, want, bf16=False):
    got = [np.asarray(g, np.float64) for g in jax.tree.leaves(got)]
    want = [np.asarray(w, np.float64) for w in jax.tree.leaves(want)]
    assert len(got) == len(want)
    err = max(float(np.abs(g - w).max()) for g, w in zip(got, want))
    bound = (2.0**-7 if bf16 else 1e-5) * max(float(np.abs(w).max()) for w in want)
    assert err <= bound, (err, bound)


def spec(x):
    s = tuple(jax.typeof(x).sharding.spec)
    return s + (None,) * (x.ndim - len(s))


STYLES = pytest.mark.parametrize("style", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
BACKENDS = pytest.mark.parametrize("backend", ["auto", "pallas"])


@BACKENDS
@STYLES
def test_a0_dense_forward_and_gradients(meshes, style, backend):
    mesh, _ = meshes
    recipe = mx.Recipe(backend=backend)
    x, w = normal(1, (D, 64, 64)), normal(2, (64, 32), scale=0.1)
    f = lambda a, b: mx.dense(a, b, recipe=recipe)  # noqa: E731
    g = jax.grad(lambda a, b: jnp.sum(f(a, b) * jnp.arange(32.0)), argnums=(0, 1))
    want = (jax.jit(f)(x, w), jax.jit(g)(x, w))
    with jax.set_mesh(mesh):
        xx = jax.device_put(x, NamedSharding(mesh, P("data", None, None)))
        got = (jax.jit(f)(xx, w), jax.jit(g)(xx, w))
        plain = jax.jit(lambda a, b: a @ b)(xx, w)
    assert_close(got, want)
    assert spec(got[0]) == spec(plain)


@BACKENDS
@STYLES
def test_a_dot_general_bf16_forward(meshes, style, backend):
    mesh, _ = meshes
    recipe = mx.Recipe(backend=backend)
    x, w = normal(3, (16, 256), jnp.bfloat16), normal(4, (256, 512), jnp.bfloat16)
    f = lambda a, b: mx.dot_general(a, b, DIMS, recipe=recipe)  # noqa: E731
    want = jax.jit(f)(x, w)
    with jax.set_mesh(mesh):
        xx = jax.device_put(x, NamedSharding(mesh, P("data", None)))
        got = jax.jit(f)(xx, w)
        plain = jax.jit(lambda a, b: a @ b)(xx, w)
    assert_close(got, want, bf16=True)
    assert spec(got) == spec(plain)


@BACKENDS
@STYLES
def test_b_gradients_with_n_split_over_model(meshes, style, backend):
    _, mesh_b = meshes
    rec = mx.Recipe(backend=backend, grad_rounding="nearest")
    x, w = normal(5, (64, 256)), normal(6, (256, 48), scale=0.1)
    loss = lambda a, b: jnp.sum(mx.dot_general(a, b, DIMS, recipe=rec) ** 2)  # noqa: E731
    g = jax.grad(loss, argnums=(0, 1))
    want = jax.jit(g)(x, w)
    with jax.set_mesh(mesh_b):
        xx = jax.device_put(x, NamedSharding(mesh_b, P("data", None)))
        ww = jax.device_put(w, NamedSharding(mesh_b, P(None, "model")))
        got = jax.jit(g)(xx, ww)
    assert_close(got, want)


@pytest.mark.parametrize("tokens", [48, 100])
@BACKENDS
@STYLES
def test_tokens_flax_dense_training_step(meshes, style, backend, tokens):
    pytest.importorskip("flax")
    from jax_mxfp4.flax import linen as mxl

    mesh, _ = meshes
    model = mxl.Dense(32, recipe=mx.Recipe(backend=backend))
    x, t = normal(7, (D * tokens, 64)), normal(8, (D * tokens, 32))
    params = model.init(jax.random.key(0), x)
    rngs = {"stochastic_rounding": jax.random.key(9)}
    step = jax.grad(lambda p, a, b: jnp.sum((model.apply(p, a, rngs=rngs) - b) ** 2))
    want = jax.jit(step)(params, x, t)
    with jax.set_mesh(mesh):
        s = NamedSharding(mesh, P("data", None))
        got = jax.jit(step)(params, jax.device_put(x, s), jax.device_put(t, s))
    assert_close(got, want)
