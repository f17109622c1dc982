"""Explicit-sharding meshes (``jax.make_mesh(..., axis_types=Explicit)``) on 8 simulated CPU devices:
every backend (pallas in the interpreter) and operation (forward, dgrad, wgrad, quantize, the Flax
layers) with the layouts users have -- 3-D activations sharded on batch, weights created outside
the mesh (replicated), batch dims, w4a16, per-device token counts that are not a multiple of 32 --
compared with the single-device run (bitwise where each output element is the same arithmetic,
else within the float32 reassociation bound) and with the output sharding of the plain-JAX
expression. Hypothesis draws random shardings (few examples, small shapes)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_mxfp4 as mx
import jax_mxfp4.flax as mxf

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")

NEAREST = mx.Recipe(grad_rounding="nearest")
BACKENDS = ["xla", "pallas"] + [b for b in ("ffi-cpu", "scaled_dot") if b in mx.available_backends()]


def mesh_2x4():
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)


def mesh_data2():
    return jax.make_mesh((2,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:2])


def normal(rng, *shape, dtype=jnp.float32, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, dtype)


def spec_of(x):
    s = tuple(jax.typeof(x).sharding.spec)
    s = s + (None,) * (x.ndim - len(s))
    return tuple(None if e is None else e for e in s)


def assert_within_reassociation(got, want, rel=1e-5):
    """Equal up to a different float32 summation order (partial sums over K shards)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=rel * (np.abs(want).max() + 1e-30))


# ----------------------------------------------------------------------------- (a0)
def _entry_points():
    """name -> (make params outside the mesh from (recipe, rng), apply(params, x))."""
    def dense(recipe, rng):
        w = normal(rng, 64, 32, scale=0.1)
        return w, lambda w, x: mx.dense(x, w, recipe=recipe)

    def linen_dense(recipe, rng):
        m = mxf.linen.Dense(32, recipe=recipe)
        return m.init(jax.random.key(0), jnp.ones((2, 64, 64))), lambda p, x: m.apply(p, x)

    def linen_general(recipe, rng):
        m = mxf.linen.DenseGeneral((4, 8), recipe=recipe)
        return m.init(jax.random.key(0), jnp.ones((2, 64, 64))), lambda p, x: m.apply(p, x).reshape(2, 64, 32)

    def nnx_linear(recipe, rng):
        lin = mxf.nnx.Linear(64, 32, recipe=recipe, rngs=nnx.Rngs(0))
        graph, state = nnx.split(lin)
        return state, lambda s, x: nnx.merge(graph, s)(x)

    return {"dense": dense, "linen.Dense": linen_dense, "linen.DenseGeneral": linen_general, "nnx.Linear": nnx_linear}


ENTRY_POINTS = _entry_points()


# every entry point on "xla"; every backend through dense and nnx.Linear (one GEMM path below them)
A0_CASES = [(e, "xla") for e in ENTRY_POINTS] + [(e, b) for b in BACKENDS[1:] for e in ("dense", "nnx.Linear")]


@pytest.mark.sweep(keep=2)
@pytest.mark.parametrize("entry,backend", A0_CASES)
def test_a0_batch_sharded_3d_activation_with_weight_made_outside_the_mesh(entry, backend, rng):
    """Issue case (a0): x [2, 64, 64] on P("data", None, None) of a 2-device explicit mesh, the
    weight created before entering the mesh. Output: the single-device values bit for bit and
    the sharding of plain ``x @ w``; gradients: the single-device ones (wgrad sums over the
    token shards: reassociation bound)."""
    recipe = NEAREST.replace(backend=backend)
    params, apply = ENTRY_POINTS[entry](recipe, rng)
    x = normal(rng, 2, 64, 64)
    loss = lambda p, a: jnp.sum(apply(p, a) * jnp.arange(32.0) / 32)  # noqa: E731
    single = jax.jit(apply)(params, x)
    g1 = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)
    mesh = mesh_data2()
    with jax.set_mesh(mesh):
        xx = jax.device_put(x, P("data", None, None))
        out = jax.jit(apply)(params, xx)
        plain = jax.jit(lambda a: a @ jnp.ones((64, 32)))(xx)
        g = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, xx)
    assert spec_of(out) == spec_of(plain) == ("data", None, None)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(single))
    for got, want in zip(jax.tree.leaves(g), jax.tree.leaves(g1)):
        assert_within_reassociation(got, want)
    assert spec_of(g[1]) == ("data", None, None)


@pytest.mark.sweep(keep=1)
# ----------------------------------------------------------------------------- (a)
@pytest.mark.parametrize("w4a16", [False, True], ids=["a4w4", "w4a16"])
def test_a_pallas_under_explicit_mesh_equals_single_device(w4a16, rng):
    """Issue case (a): bf16 lhs [16, 256] on P("data", None) of a 2x4 explicit mesh, rhs
    [256, 512], Recipe(backend="pallas") (interpreter on CPU): the single-device result exactly,
    forward and both gradients (the backward GEMMs run on pallas too)."""
    recipe = mx.Recipe(backend="pallas", quantize_activations=not w4a16, grad_rounding="nearest")
    x, w = normal(rng, 16, 256, dtype=jnp.bfloat16), normal(rng, 256, 512, dtype=jnp.bfloat16)
    if w4a16:
        w = mx.quantize(w, axis=0)
    f = lambda a, b: mx.dot_general(a, b, (((1,), (0,)), ((), ())), recipe=recipe)  # noqa: E731
    single = jax.jit(f)(x, w)
    gx1 = jax.jit(jax.grad(lambda a, b: jnp.sum(f(a, b)), argnums=0))(x, w)
    mesh = mesh_2x4()
    with jax.set_mesh(mesh):
        xx = jax.device_put(x, NamedSharding(mesh, P("data", None)))
        out = jax.jit(f)(xx, w)
        gx = jax.jit(jax.grad(lambda a, b: jnp.sum(f(a, b)), argnums=0))(xx, w)
    assert spec_of(out) == ("data", None)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(single, np.float32))
    assert_within_reassociation(np.asarray(gx, np.float32), np.asarray(gx1, np.float32), rel=1e-2)


@pytest.mark.sweep(keep=1)
# ----------------------------------------------------------------------------- (b)
@pytest.mark.parametrize("backend", BACKENDS)
def test_b_backward_whose_shards_split_a_block_equals_single_device(backend, rng):
    """Issue case (b): x [64, 256] on P("data", None), w [256, 64] on P(None, "model") of a 2x4
    explicit mesh: dY's N = 64 is 16 per shard, so dgrad (quantizing dY and w along N) regathers
    N first. Gradients equal the single-device ones."""
    recipe = NEAREST.replace(backend=backend)
    x, w = normal(rng, 64, 256), normal(rng, 256, 64, scale=0.1)
    loss = lambda a, b: jnp.sum(mx.dot_general(a, b, (((1,), (0,)), ((), ())), recipe=recipe) ** 2)  # noqa: E731
    g1 = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
    mesh = mesh_2x4()
    with jax.set_mesh(mesh):
        xx = jax.device_put(x, NamedSharding(mesh, P("data", None)))
        ww = jax.device_put(w, NamedSharding(mesh, P(None, "model")))
        gx, gw = jax.jit(jax.grad(loss, argnums=(0, 1)))(xx, ww)
    assert spec_of(gx) == ("data", None) and spec_of(gw) == (None, "model")
    assert_within_reassociation(gx, g1[0])
    assert_within_reassociation(gw, g1[1])


def test_b_block_rule_is_checked_before_any_reshape_or_quantization(rng):
    """The documented error (names the dim, its mesh axes and the 32-block rule), never JAX's
    internal ShardingTypeError: forward K (incl. a K that dense would pad), quantize()'s axis."""
    mesh = mesh_2x4()
    rule = r"sharded over mesh axes \('model',\) \(4 shards\), so a shard would split a 32-element"
    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.ones((8, 64)), NamedSharding(mesh, P(None, "model")))
        with pytest.raises(ValueError, match=rule):
            jax.jit(lambda a: mx.quantize(a, axis=1))(x)
        with pytest.raises(ValueError, match=rule):
            jax.jit(lambda a: mx.dense(a, jnp.ones((64, 16))))(x)
        x40 = jax.device_put(jnp.ones((8, 40)), NamedSharding(mesh, P(None, ("data",))))
        with pytest.raises(ValueError, match=r"\('data',\) \(2 shards\).*40 is not a multiple of 32 x 2"):
            jax.jit(lambda a: mx.dense(a, jnp.ones((40, 16))))(x40)
        wq = mx.quantize(jnp.ones((64, 16)), axis=0)
        with pytest.raises(ValueError, match=r"\('data',\) \(2 shards\)"):
            jax.jit(lambda a: mx.dense(a, wq))(x40)
        # whole blocks per shard are fine: K = 256 over 4 shards, and quantize along it
        x256 = jax.device_put(normal(rng, 8, 256), NamedSharding(mesh, P(None, "model")))
        q = jax.jit(lambda a: mx.quantize(a, axis=1))(x256)
    np.testing.assert_array_equal(np.asarray(q.data), np.asarray(mx.quantize(np.asarray(x256), axis=1).data))


@pytest.mark.sweep(keep=1)
# ----------------------------------------------------------------------------- tokens per device
@pytest.mark.parametrize("variant", ["step-key", "fallback-key+hadamard"])
@pytest.mark.parametrize("tokens", [48, 100])
def test_data_parallel_training_with_token_counts_not_a_multiple_of_32(tokens, variant, rng):
    """Per-device token counts 48 and 100 (wgrad contracts the tokens: blocks straddle devices,
    and 200 tokens are padded to 224): a Flax training step with stochastic rounding gives the
    single-device gradients on the explicit mesh, as on an Auto mesh -- with a step key from the
    RNG stream, and with the data-derived fallback key plus the wgrad Hadamard transform."""
    hadamard = variant != "step-key"
    model = mxf.linen.Dense(32, recipe=mx.Recipe(hadamard=hadamard))
    x, t = normal(rng, 2 * tokens, 64), normal(rng, 2 * tokens, 32)
    params = model.init(jax.random.key(0), x)
    rngs = None if hadamard else {"stochastic_rounding": jax.random.key(7)}

    def step(p, a, b):
        return jax.grad(lambda p: jnp.sum((model.apply(p, a, rngs=rngs) - b) ** 2))(p)

    want = jax.jit(step)(params, x, t)
    for style in (AxisType.Explicit, AxisType.Auto):
        mesh = jax.make_mesh((2,), ("data",), axis_types=(style,), devices=jax.devices()[:2])
        with jax.set_mesh(mesh):
            xs = jax.device_put(x, NamedSharding(mesh, P("data", None)))
            ts = jax.device_put(t, NamedSharding(mesh, P("data", None)))
            got = jax.jit(step)(params, xs, ts)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert_within_reassociation(g, w)


@pytest.mark.slow
def test_wgrad_keeps_the_token_shards_that_hold_whole_blocks(rng):
    """256 tokens over ("data", "model") = 8 shards of 32 hold whole blocks (no regather); 128
    tokens over 8 shards of 16 do not: "model" is dropped from the token dim (2 shards of 64) and
    the partial wgrads are summed over "data". Both equal the single-device gradients."""
    for tokens in (256, 128):
        x, w = normal(rng, tokens, 64), normal(rng, 64, 32, scale=0.1)
        grad = jax.grad(lambda a, b: jnp.sum(mx.dense(a, b, recipe=NEAREST) ** 2), argnums=(0, 1))
        want = jax.jit(grad)(x, w)
        mesh = mesh_2x4()
        with jax.set_mesh(mesh):
            xx = jax.device_put(x, NamedSharding(mesh, P(("data", "model"), None)))
            got = jax.jit(grad)(xx, w)
        assert spec_of(got[0]) == (("data", "model"), None)
        for g, wnt in zip(got, want):
            assert_within_reassociation(g, wnt)


@pytest.mark.sweep(keep=1)
# ----------------------------------------------------------------------------- MXFP4Array weights
@pytest.mark.parametrize("wspec", [P(None, None), P(None, "model")], ids=["replicated", "tp-column"])
def test_pre_quantized_weight_serving_and_activation_grad(wspec, rng):
    """quantize_params-style MXFP4Array weight (device_put replicated or column-sharded) against
    batch-sharded 3-D activations: forward bit-equal to one device with plain ``x @ w``'s
    sharding, and the activation gradient (e.g. for an adapter upstream) equal too."""
    x, w = normal(rng, 4, 16, 64), normal(rng, 64, 32, scale=0.1)
    wq = mx.quantize(w, axis=0)
    f = lambda a, b: mx.dense(a, b, recipe=NEAREST)  # noqa: E731
    single = jax.jit(f)(x, wq)
    g1 = jax.jit(jax.grad(lambda a, b: jnp.sum(f(a, b) ** 2)))(x, wq)
    mesh = mesh_2x4()
    with jax.set_mesh(mesh):
        xx = jax.device_put(x, NamedSharding(mesh, P("data", None, None)))
        wqs = jax.device_put(wq, NamedSharding(mesh, wspec))
        ws = jax.device_put(w, NamedSharding(mesh, wspec))
        out = jax.jit(f)(xx, wqs)
        plain = jax.jit(lambda a, b: a @ b)(xx, ws)
        g = jax.jit(jax.grad(lambda a, b: jnp.sum(f(a, b) ** 2)))(xx, wqs)
    assert spec_of(out) == spec_of(plain)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(single))
    assert_within_reassociation(g, g1)
    assert spec_of(g) == ("data", None, None)


def test_nnx_out_sharding_on_an_explicit_mesh(rng):
    lin = mxf.nnx.Linear(64, 32, rngs=nnx.Rngs(0))
    x = normal(rng, 4, 16, 64)
    single = lin(x)
    mesh = mesh_2x4()
    with jax.set_mesh(mesh):
        xx = jax.device_put(x, NamedSharding(mesh, P("data", None, None)))
        out = nnx.jit(lambda m, a: m(a, out_sharding=P("data", None, "model")))(lin, xx)
    assert spec_of(out) == ("data", None, "model")
    np.testing.assert_array_equal(np.asarray(out), np.asarray(single))


@pytest.mark.sweep(keep=1)
# ----------------------------------------------------------------------------- batch dims
@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_dims_sharded_against_a_replicated_weight(backend, rng):
    """dot_general with a batch dim sharded on "data" (lhs) against a weight with the same
    batch dim created outside the mesh: single-device values, plain-JAX output sharding."""
    recipe = NEAREST.replace(backend=backend)
    dims = (((2,), (1,)), ((0,), (0,)))
    x, w = normal(rng, 4, 16, 64), normal(rng, 4, 64, 32, scale=0.1)
    f = lambda a, b: mx.dot_general(a, b, dims, recipe=recipe)  # noqa: E731
    single = jax.jit(f)(x, w)
    g1 = jax.jit(jax.grad(lambda a, b: jnp.sum(f(a, b) ** 2), argnums=(0, 1)))(x, w)
    mesh = mesh_2x4()
    with jax.set_mesh(mesh):
        xx = jax.device_put(x, NamedSharding(mesh, P("data", "model", None)))
        out = jax.jit(f)(xx, w)
        plain = jax.jit(lambda a, b: lax.dot_general(a, b, dims))(xx, w)
        g = jax.jit(jax.grad(lambda a, b: jnp.sum(f(a, b) ** 2), argnums=(0, 1)))(xx, w)
    assert spec_of(out) == spec_of(plain)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(single))
    for got, want in zip(g, g1):
        assert_within_reassociation(got, want)


# ----------------------------------------------------------------------------- property test
AXES = [None, "data", "model", ("data", "model")]
SIZES = {"data": 2, "model": 4}


def _shards(entry):
    return int(np.prod([SIZES[a] for a in ((entry,) if isinstance(entry, str) else entry or ())]))


@st.composite
def sharded_problem(draw):
    """x [*lead, K] and w [K, N] with a random valid PartitionSpec each (a mesh axis once per
    array, every sharded dim divisible by its shard count)."""
    lead = draw(st.sampled_from([(16,), (2, 24), (4, 8), (8, 2)]))
    k = draw(st.sampled_from([40, 64, 128]))
    n = draw(st.sampled_from([8, 16, 48]))

    def spec(shape):
        used, out = set(), []
        for size in shape:
            choices = [e for e in AXES if e is None or (
                not ({e} if isinstance(e, str) else set(e)) & used and size % _shards(e) == 0)]
            e = draw(st.sampled_from(choices))
            used |= {e} if isinstance(e, str) else set(e or ())
            out.append(e)
        return P(*out)

    return lead, k, n, spec(lead + (k,)), spec((k, n))


RECIPES = {
    "a4w4": NEAREST,
    "w4a16": NEAREST.replace(quantize_activations=False),
    "bf16-fprop": NEAREST.replace(fprop="bf16"),
    "bf16-backward": NEAREST.replace(dgrad="bf16", wgrad="bf16"),
}


@pytest.mark.slow
@settings(max_examples=8, deadline=None)
@given(sharded_problem(), st.sampled_from(["xla", "ffi-cpu"]), st.sampled_from(list(RECIPES)), st.booleans())
def test_random_shardings_train_like_one_device(problem, backend, recipe_name, weight_outside_mesh):
    """Forward and gradients of mx.dense under random explicit shardings (the weight possibly
    made outside the mesh) and recipes equal the single-device run (or raise the documented
    block-rule error when a K shard would split a block); the output sharding equals plain
    ``x @ w``'s wherever plain JAX accepts the shardings."""
    if backend not in mx.available_backends() or recipe_name == "w4a16":  # ffi-cpu: a4w4 only
        backend = "xla"
    lead, k, n, xs, ws = problem
    if weight_outside_mesh:
        ws = P(None, None)
    recipe = RECIPES[recipe_name].replace(backend=backend)
    rng = np.random.default_rng(0)  # a fixed seed: hypothesis draws the shapes
    x, w, c = normal(rng, *lead, k), normal(rng, k, n, scale=0.1), normal(rng, *lead, n)
    f = lambda a, b: mx.dense(a, b, recipe=recipe)  # noqa: E731
    grad = jax.grad(lambda a, b: jnp.sum(f(a, b) * c), argnums=(0, 1))  # dY = c: no forward dependence
    single, g1 = jax.jit(f)(x, w), jax.jit(grad)(x, w)
    mesh = mesh_2x4()
    splits = any(e is not None and k % (32 * _shards(e)) for e in (xs[-1], ws[0]))
    with jax.set_mesh(mesh):
        xx = jax.device_put(x, NamedSharding(mesh, xs))
        ww = w if weight_outside_mesh else jax.device_put(w, NamedSharding(mesh, ws))
        if splits:
            with pytest.raises(ValueError, match="split a 32-element MXFP4 block"):
                jax.jit(f)(xx, ww)
            return
        out = jax.jit(f)(xx, ww)
        gx, gw = jax.jit(grad)(xx, ww)
        try:
            plain = jax.jit(lambda a, b: a @ b)(xx, ww)
        except Exception:  # plain JAX rejects some combinations (e.g. one axis on M and N)
            plain = None
    if plain is not None:
        assert spec_of(out) == spec_of(plain), (xs, ws)
    assert_within_reassociation(out, single)
    assert_within_reassociation(gx, g1[0])
    assert_within_reassociation(gw, g1[1])
