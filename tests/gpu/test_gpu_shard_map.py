"""``jax.shard_map`` and JAX's default (explicit) mesh on one NVIDIA GPU, where the GPU paths are
this platform's own (tests/test_shard_map.py runs the same cases on simulated CPU devices):
  - default mesh: ``jax.make_mesh((1, 1), ("data", "model"))`` with JAX's default axis types,
    x [256, 512] on P("data", None) and P("data", "model"), w [512, 384] on P(None, "model") and
    P("model", None), under ``jit``: "auto" runs backend "fp8" here, whose Pallas kernels must not
    be traced on explicitly sharded types (jax_mxfp4.sharding.kernel_may_run); also fp8 named
    explicitly and dense with gradients;
  - ``jax.shard_map`` with its defaults (check_vma on) over a 1-device Auto mesh: backends auto,
    xla, scaled_dot, pallas (its kernel through the partitioning rule inside shard_map) and fp8,
    forward and gradients (the replicated weight's cotangent typed invariant: out_specs P()),
    and linen.Dense.
Pass: every value within 1e-5 of the largest magnitude of the run without a mesh (float32
reassociation level, as tests/gpu/test_gpu_explicit_mesh.py): a wrong block, axis or dropped
sum is off by ~1e-1."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_mxfp4 as mx
import jax_mxfp4.flax as mxf
from gpu_reference import rand

pytestmark = [pytest.mark.gpu, pytest.mark.cuda]

DN = (((1,), (0,)), ((), ()))
NEAREST = mx.Recipe(grad_rounding="nearest")
LAYOUTS = {
    "rows-x-columns": (P("data", None), P(None, "model")),
    "rows-and-k-x-k": (P("data", "model"), P("model", None)),
}


def operands():
    return rand(1, (256, 512)), rand(2, (512, 384)) / 16


def assert_close(got, want):
    got = [np.asarray(g, np.float64) for g in jax.tree.leaves(got)]
    want = [np.asarray(w, np.float64) for w in jax.tree.leaves(want)]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        err, bound = float(np.abs(g - w).max()), 1e-5 * float(np.abs(w).max())
        assert err <= bound, (err, bound)


def value_and_grads(f):
    def run(w, x, t):
        return f(w, x), *jax.grad(lambda w, x: jnp.sum(f(w, x) * t), argnums=(0, 1))(w, x)
    return run


@pytest.mark.parametrize("backend", ["auto", "fp8"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_default_mesh_jit_forward(layout, backend):
    x, w = operands()
    recipe = mx.Recipe(backend=backend)
    f = jax.jit(lambda a, b: mx.dot_general(a, b, DN, preferred_element_type=jnp.float32, recipe=recipe))
    want = f(x, w)
    mesh = jax.make_mesh((1, 1), ("data", "model"), devices=jax.devices()[:1])
    xs, ws = LAYOUTS[layout]
    got = f(jax.device_put(x, NamedSharding(mesh, xs)), jax.device_put(w, NamedSharding(mesh, ws)))
    assert_close(got, want)


def test_default_mesh_dense_gradients():
    x, w = operands()
    t = rand(3, (256, 384))
    run = jax.jit(value_and_grads(lambda w, x: mx.dense(x, w, recipe=NEAREST)))
    want = run(w, x, t)
    mesh = jax.make_mesh((1, 1), ("data", "model"), devices=jax.devices()[:1])
    rows = NamedSharding(mesh, P("data", None))
    columns = NamedSharding(mesh, P(None, "model"))
    got = run(jax.device_put(w, columns), jax.device_put(x, rows), jax.device_put(t, rows))
    assert_close(got, want)


def _shard_map(fn, in_specs, out_specs):
    mesh = jax.make_mesh((1,), ("d",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs))


@pytest.mark.parametrize("backend", ["auto", "xla", "scaled_dot", "pallas", "fp8"])
def test_shard_map_forward_and_gradients(backend):
    if backend not in mx.available_backends() and backend != "auto":
        pytest.skip(f"backend {backend!r} unavailable here")
    x, w = operands()
    t = rand(3, (256, 384))
    recipe = NEAREST.replace(backend=backend)
    run = value_and_grads(lambda w, x: mx.dot_general(x, w, DN, recipe=recipe))
    want = jax.jit(run)(w, x, t)
    got = _shard_map(run, (P(), P("d", None), P("d", None)), (P("d", None), P(), P("d", None)))(w, x, t)
    assert_close(got, want)


def test_shard_map_linen_dense_gradients():
    x, w = operands()
    t = rand(3, (256, 384))
    m = mxf.linen.Dense(384, use_bias=False, recipe=NEAREST)
    run = value_and_grads(lambda p, x: m.apply(p, x))
    params = {"params": {"kernel": w}}
    want = jax.jit(run)(params, x, t)
    got = _shard_map(run, (P(), P("d", None), P("d", None)), (P("d", None), P(), P("d", None)))(params, x, t)
    assert_close(got, want)
