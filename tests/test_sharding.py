"""Sharded MXFP4 GEMMs on 8 simulated CPU devices (conftest sets the device count): data-parallel,
tensor-parallel column and row (K-sharded) linear layers, forward and backward, on AxisType.Auto
meshes and on explicit-sharding meshes (jax.make_mesh's default). Results are compared with the
single-device run, and the compiled HLO is checked for the expected collectives only."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_mxfp4 as mx

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")

DIMS = (((2,), (0,)), ((), ()))  # x [batch, seq, K] . w [K, N]
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")

LAYOUTS = {
    # name: (x spec, w spec, expected forward collectives)
    "data-parallel": (P("data", None, None), P(None, None), set()),
    "tp-column": (P("data", None, None), P(None, "model"), set()),
    "tp-row": (P("data", None, "model"), P("model", None), {"all-reduce"}),
}


def make_mesh(style):
    if style == "auto":
        return jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    return jax.make_mesh((2, 4), ("data", "model"))  # explicit axes by default


def collectives(compiled_text):
    return {c for c in COLLECTIVES if re.search(rf"\b{c}(-start)?\(", compiled_text)}


def operands(rng):
    x = jnp.asarray(rng.standard_normal((8, 16, 256)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((256, 128)) / 16, jnp.float32)
    return x, w


def rounding_bound(x, w, k):
    # float32 reassociation of a K-term sum: |err| <= K * 2^-24 * sum|x||w|
    return k * 2.0**-24 * np.einsum("bsk,kn->bsn", np.abs(np.asarray(x, np.float64)), np.abs(np.asarray(w, np.float64)))


def backend_params():
    return [
        "xla",
        pytest.param("ffi-cpu", marks=pytest.mark.skipif(
            "ffi-cpu" not in mx.available_backends(), reason="compiled extension not built")),
    ]


@pytest.mark.sweep(keep=4)
@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("style", ["auto", "explicit"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_forward_matches_single_device_with_expected_collectives(style, layout, backend, rng):
    """"xla" is partitioned by XLA itself; "ffi-cpu" (an opaque custom call) through the
    custom_partitioning rule of jax_mxfp4.partitioning: neither may all-gather an operand."""
    x, w = operands(rng)
    xs, ws, expected = LAYOUTS[layout]
    recipe = mx.Recipe(backend=backend)
    fwd = lambda a, b: mx.dot_general(a, b, DIMS, recipe=recipe)  # noqa: E731
    single = np.asarray(jax.jit(fwd)(x, w))
    mesh = make_mesh(style)
    with jax.set_mesh(mesh):
        xx = jax.device_put(x, NamedSharding(mesh, xs))
        ww = jax.device_put(w, NamedSharding(mesh, ws))
        f = jax.jit(fwd)
        out = f(xx, ww)
        text = f.lower(xx, ww).compile().as_text()
    assert collectives(text) == expected, collectives(text)
    got = np.asarray(out)
    if "all-reduce" in expected:  # partial sums in another order
        assert (np.abs(got - single) <= rounding_bound(x, w, 256)).all()
    else:  # the same arithmetic per element
        np.testing.assert_array_equal(got, single)
    if layout == "tp-column":
        assert out.sharding.spec[-1] == "model"


@pytest.mark.sweep(keep=2)
@pytest.mark.parametrize("style", ["auto", "explicit"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_backward_matches_single_device(style, layout, rng):
    x, w = operands(rng)
    xs, ws, _ = LAYOUTS[layout]
    recipe = mx.Recipe(grad_rounding="nearest")

    def loss(a, b):
        return jnp.sum(mx.dot_general(a, b, DIMS, recipe=recipe) ** 2)

    gx1, gw1 = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
    mesh = make_mesh(style)
    with jax.set_mesh(mesh):
        xx = jax.device_put(x, NamedSharding(mesh, xs))
        ww = jax.device_put(w, NamedSharding(mesh, ws))
        g = jax.jit(jax.grad(loss, argnums=(0, 1)))
        gx, gw = g(xx, ww)
        text = g.lower(xx, ww).compile().as_text()
    assert "all-gather" not in collectives(text) or layout != "data-parallel", collectives(text)
    for got, want in ((gx, gx1), (gw, gw1)):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        scale = np.abs(want).max()
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * scale)


def test_explicit_mesh_rejects_k_shards_that_split_blocks():
    mesh = make_mesh("explicit")
    x = jnp.ones((8, 64))  # K=64 over 4 model shards -> 16 elements per shard
    w = jnp.ones((64, 32))
    with jax.set_mesh(mesh):
        xx = jax.device_put(x, NamedSharding(mesh, P(None, "model")))
        ww = jax.device_put(w, NamedSharding(mesh, P("model", None)))
        with pytest.raises(ValueError, match=r"sharded over mesh axes \('model',\) \(4 shards\).*split a 32-element"):
            jax.jit(lambda a, b: mx.dot_general(a, b, (((1,), (0,)), ((), ()))))(xx, ww)


def test_out_sharding_is_honoured(rng):
    x, w = operands(rng)
    mesh = make_mesh("explicit")
    with jax.set_mesh(mesh):
        xx = jax.device_put(x, NamedSharding(mesh, P("data", None, "model")))
        ww = jax.device_put(w, NamedSharding(mesh, P("model", None)))
        out = jax.jit(lambda a, b: mx.dot_general(a, b, DIMS, out_sharding=P(None, None, "model")))(xx, ww)
    assert tuple(out.sharding.spec) == (None, None, "model")


@pytest.mark.skipif("ffi-cpu" not in mx.available_backends(), reason="compiled extension not built")
def test_partitioned_ffi_gemm_under_vmap_and_grad_of_activations(rng):
    """The outer primitive folds vmap into the canonical batch dim (custom_partitioning itself
    has no batching rule); its result equals the per-example calls."""
    xs = jnp.asarray(rng.standard_normal((3, 16, 64)), jnp.float32)
    wq = mx.quantize(jnp.asarray(rng.standard_normal((64, 32)), jnp.float32), axis=0)
    recipe = mx.Recipe(backend="ffi-cpu")
    dims = (((1,), (0,)), ((), ()))
    batched = jax.vmap(lambda x: mx.dot_general(x, wq, dims, recipe=recipe))(xs)
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(batched[i]), np.asarray(mx.dot_general(xs[i], wq, dims, recipe=recipe)))


def test_partitioning_rule_is_built_once_per_configuration_not_per_shape():
    """The custom_partitioning rule is cached by configuration (backend, kinds, dtypes, layout,
    platform, precision) with the shape left out, so the cache stays bounded; each call reads
    its shapes from its arguments."""
    import dataclasses

    from jax_mxfp4 import partitioning
    from jax_mxfp4.backends.base import GemmProblem

    p = GemmProblem(1, 64, 32, 256, np.dtype(np.float32), "plain", "cpu")
    same = [partitioning._partitioned_impl("ffi-cpu", dataclasses.replace(p, batch=b, m=m, n=n, k=k))
            for b, m, n, k in ((1, 64, 32, 256), (4, 8, 96, 1024), (2, 1000, 8, 32))]
    assert same[0] is same[1] is same[2]
    other = partitioning._partitioned_impl("ffi-cpu", dataclasses.replace(p, out_dtype=jnp.dtype(jnp.bfloat16)))
    assert other is not same[0]
