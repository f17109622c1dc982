"""Hadamard rotations per pass (``Recipe.hadamard``, ``Recipe.hadamard_block``) and rotated weights.

References: the transform's bits against a NumPy float32 twin performing the documented operations
(signs, butterfly stages, one scaling), and its values against the float64 matrix ``H diag(s)``
built from the Sylvester definition; every pass of the custom VJP against a float64 emulation
that rotates with that twin, quantizes with the independent NumPy/ml_dtypes oracle
(tests/mx_reference.py) and multiplies in float64. Seeds are rebuilt from the documented formulas.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_mxfp4 as mx
from jax_mxfp4 import flax as mxf
from jax_mxfp4.hadamard import random_hadamard_transform

from mx_reference import bf16, dequantize_ref, hadamard_transform_ref, pad, qdq, quantize_ref


def crc_seed(*parts):
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


def sylvester(n):
    return np.array([[(-1.0) ** bin(i & j).count("1") for j in range(n)] for i in range(n)]) / np.sqrt(n)


def signs(seed, n):
    return np.random.default_rng(seed).choice(np.array([-1.0, 1.0]), size=n)


def rotation_matrix(seed, n):
    """float64 H diag(s): the transform of one block is v -> M @ v."""
    return sylvester(n) * signs(seed, n)[None, :]


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    return float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-30))


@pytest.mark.sweep(keep=2)
# ----------------------------------------------------------------------------- the transform
@pytest.mark.parametrize("block", [32, 64, 128, 256])
@pytest.mark.parametrize("axis", [0, 1, 2])
def test_transform_bits_and_values(block, axis):
    rng = np.random.default_rng(block + axis)
    shape = [3, 5, 7]
    shape[axis] = 2 * block
    x = (rng.standard_normal(shape) * np.exp(rng.standard_normal(shape))).astype(np.float32)
    seed = int(rng.integers(0, 2**31))
    got = np.asarray(random_hadamard_transform(jnp.asarray(x), axis, seed, block))
    twin = hadamard_transform_ref(x, axis, seed, block)
    np.testing.assert_array_equal(got.view(np.uint32), twin.view(np.uint32))  # bit for bit
    # values: the float64 matrix H diag(s) on every block along ``axis``
    m = rotation_matrix(seed, block)
    xm = np.moveaxis(x.astype(np.float64), axis, -1)
    want = np.moveaxis((xm.reshape(*xm.shape[:-1], 2, block) @ m.T).reshape(xm.shape), -1, axis)
    assert rel_err(got, want) < 1e-6
    # orthogonal: dot products along the axis are preserved
    u = rng.standard_normal(shape).astype(np.float32)
    gu = np.asarray(random_hadamard_transform(jnp.asarray(u), axis, seed, block), np.float64)
    np.testing.assert_allclose(np.sum(got * gu, axis=axis), np.sum(x.astype(np.float64) * u, axis=axis),
                               rtol=1e-4, atol=1e-3)


def test_transform_bf16_input_and_bad_arguments():
    x = jax.random.normal(jax.random.key(0), (4, 64), jnp.bfloat16)
    got = np.asarray(random_hadamard_transform(x, 1, 3, 64))
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, hadamard_transform_ref(np.asarray(x, np.float32), 1, 3, 64))
    with pytest.raises(ValueError, match="not a multiple of the Hadamard block 64"):
        random_hadamard_transform(jnp.ones((4, 96)), 1, 0, 64)
    with pytest.raises(ValueError, match="power of two"):
        random_hadamard_transform(jnp.ones((4, 96)), 1, 0, 48)


# ----------------------------------------------------------------------------- Recipe option
def test_recipe_hadamard_option_normalizes_and_validates():
    assert mx.Recipe().hadamard is False and mx.Recipe().hadamard_passes == ()
    assert mx.Recipe(hadamard=None).hadamard_passes == ()
    r = mx.Recipe(hadamard=True)  # the original boolean keeps its value and meaning: wgrad only
    assert r.hadamard is True and r.hadamard_passes == ("wgrad",)
    assert mx.Recipe(hadamard="all").hadamard == ("fprop", "dgrad", "wgrad")
    assert mx.Recipe(hadamard=["wgrad", "fprop"]).hadamard == ("fprop", "wgrad")
    assert mx.Recipe(hadamard="dgrad") == mx.Recipe(hadamard={"dgrad"})
    assert hash(mx.Recipe(hadamard=["dgrad", "fprop"])) == hash(mx.Recipe(hadamard=("fprop", "dgrad")))
    assert mx.Recipe().hadamard_block == 32
    with pytest.raises(ValueError, match="unknown pass name"):
        mx.Recipe(hadamard="forward")
    with pytest.raises(TypeError, match="Recipe.hadamard must be"):
        mx.Recipe(hadamard=1)
    for bad in (16, 48, 512):
        with pytest.raises(ValueError, match="Recipe.hadamard_block must be a power of two from 32"):
            mx.Recipe(hadamard="all", hadamard_block=bad)
    with pytest.raises(TypeError, match="Recipe.hadamard_block must be an int"):
        mx.Recipe(hadamard_block=32.0)


def test_block_must_divide_every_rotated_contraction():
    x, w = jnp.ones((64, 96)), jnp.ones((96, 64))
    with pytest.raises(ValueError, match=r"fprop contraction K has length 96, not a multiple of the Hadamard block 64"):
        mx.dense(x, w, recipe=mx.Recipe(hadamard="fprop", hadamard_block=64))
    with pytest.raises(ValueError, match=r"dgrad contraction N .* has length 96"):
        mx.dense(jnp.ones((64, 64)), jnp.ones((64, 96)), recipe=mx.Recipe(hadamard="dgrad", hadamard_block=64))
    with pytest.raises(ValueError, match=r"wgrad contraction M .* has length 96"):
        mx.dense(jnp.ones((96, 64)), jnp.ones((64, 64)), recipe=mx.Recipe(hadamard="wgrad", hadamard_block=64))
    # a pass computed in bf16 is not rotated, so its length does not matter
    mx.dense(x, w, recipe=mx.Recipe(hadamard="fprop", hadamard_block=64, fprop="bf16"))
    # block 32 always fits: every contraction is padded to a multiple of 32
    mx.dense(jnp.ones((40, 50)), jnp.ones((50, 24)), recipe=mx.Recipe(hadamard="all"))


# ----------------------------------------------------------------------------- every pass
def emulated(x, w, c, passes, block, site):
    """(y, dx, dw) float64 for y = x [M, K] @ w [K, N], cotangent c; nearest rounding everywhere."""
    x, w, c = (np.asarray(a, np.float32) for a in (x, w, c))
    rot = hadamard_transform_ref
    xp, wp = pad(x, 1), pad(w, 0)
    if "fprop" in passes:
        s = crc_seed("fprop-hadamard", w.shape, (0,), ())
        xp, wp = rot(xp, 1, s, block), rot(wp, 0, s, block)
    y = qdq(xp, 1) @ qdq(wp, 0)
    cp, wp = pad(c, 1), pad(w, 1)
    if "dgrad" in passes:
        s = crc_seed(site, "dgrad")
        cp, wp = rot(cp, 1, s, block), rot(wp, 1, s, block)
    dx = qdq(cp, 1) @ qdq(wp, 1).T
    cp, xp = pad(c, 0), pad(x, 0)
    if "wgrad" in passes:
        cp, xp = rot(cp, 0, site, block), rot(xp, 0, site, block)
    dw = qdq(xp, 0).T @ qdq(cp, 0)
    return y, dx[:, : x.shape[1]], dw[: x.shape[1]]


@pytest.mark.sweep(keep=1)
@pytest.mark.parametrize("passes,block,shape", [
    (("fprop",), 32, (40, 50, 24)),
    (("dgrad",), 32, (40, 50, 24)),
    (("wgrad",), 32, (40, 50, 24)),
    (("fprop", "dgrad", "wgrad"), 32, (40, 50, 24)),
    (("fprop", "dgrad", "wgrad"), 64, (64, 128, 64)),
    (("fprop", "dgrad", "wgrad"), 128, (128, 256, 128)),
])
def test_each_rotated_pass_matches_emulated_reference(passes, block, shape):
    m, k, n = shape
    kx, kw, kc = jax.random.split(jax.random.key(m + k + block), 3)
    x = jax.random.normal(kx, (m, k)) * jnp.exp(jax.random.normal(kx, (m, k)))  # heavy tails
    w = jax.random.normal(kw, (k, n)) * 0.1
    c = jax.random.normal(kc, (m, n))
    recipe = mx.Recipe(hadamard=passes, hadamard_block=block, grad_rounding="nearest", backend="xla")
    y, pull = jax.vjp(lambda a, b: mx.dense(a, b, recipe=recipe), x, w)
    dx, dw = pull(c)
    site = crc_seed((m, k), (k, n), "float32", "float32", ((1,), (0,), (), ()))
    ry, rdx, rdw = emulated(x, w, c, passes, block, site)
    for got, want in ((y, ry), (dx, rdx), (dw, rdw)):
        assert rel_err(got, want) <= 2e-6
    # not vacuous: without the rotations the rotated passes give other numbers
    uy, udx, udw = emulated(x, w, c, (), block, site)
    for name, got, plain in (("fprop", y, uy), ("dgrad", dx, udx), ("wgrad", dw, udw)):
        assert (rel_err(got, plain) > 1e-3) == (name in passes), name


def test_rotation_is_close_to_the_exact_product():
    # the rotation cancels: y is the MXFP4 approximation of the exact x @ w either way
    x = jax.random.normal(jax.random.key(0), (64, 256))
    w = jax.random.normal(jax.random.key(1), (256, 64))
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    for block in (32, 256):
        y = mx.dense(x, w, recipe=mx.Recipe(hadamard="fprop", hadamard_block=block))
        assert np.linalg.norm(np.asarray(y) - exact) / np.linalg.norm(exact) < 0.2


@pytest.mark.slow
# ----------------------------------------------------------------------------- rotated weights
@pytest.mark.parametrize("block", [32, 64])
def test_quantize_params_serves_what_training_multiplied(block):
    from flax import nnx

    # (N = 16 and M = 6 pad to 32: only fprop, along K = 64, can use block 64 here)
    recipe = mx.Recipe(hadamard="all" if block == 32 else "fprop", hadamard_block=block)
    x = jax.random.normal(jax.random.key(4), (6, 50))
    m = mxf.linen.Dense(16, recipe=recipe)
    p = m.init(jax.random.key(0), x)
    q = mxf.quantize_params(p, recipe=recipe)
    kq = q["params"]["kernel"]
    seed = crc_seed("fprop-hadamard", (50, 16), (0,), ())
    assert kq.hadamard == (block, seed) and kq.shape == (64, 16) and "hadamard=" in repr(kq)
    # the stored codes/scales are the oracle's quantization of the rotated, padded kernel
    w = np.asarray(p["params"]["kernel"])
    codes, scales = quantize_ref(hadamard_transform_ref(pad(w, 0), 0, seed, block), 0, "even")
    np.testing.assert_array_equal((codes[0::2] | (codes[1::2] << 4)).astype(np.uint8), np.asarray(kq.data))
    np.testing.assert_array_equal(np.asarray(kq.scales).view(np.uint8), scales)
    # serving multiplies exactly the operands training's forward multiplied: the same output bits
    np.testing.assert_array_equal(np.asarray(m.apply(q, x)), np.asarray(m.apply(p, x)))
    # and it is the rotated product, not the plain one
    plain = mxf.quantize_params(p)
    assert rel_err(m.apply(plain, x), m.apply(q, x)) > 1e-3
    # the gradient w.r.t. x is pulled back through the rotation: dx = (c @ deq(rot W)^T) @ blockdiag(M)
    c = jax.random.normal(jax.random.key(5), (6, 16))
    bf_recipe = mx.Recipe(hadamard="fprop", hadamard_block=block, dgrad="bf16")
    mb = mxf.linen.Dense(16, recipe=bf_recipe)
    gx = jax.grad(lambda v: jnp.sum(mb.apply(q, v) * c))(x)
    g = bf16(c) @ bf16(dequantize_ref(codes, scales, 0)).T  # [6, 64] w.r.t. the rotated, padded x
    mm = rotation_matrix(seed, block)
    want = (g.reshape(6, 64 // block, block) @ mm).reshape(6, 64)[:, :50]
    assert rel_err(gx, want) <= 2e-6
    # nnx: the same through the Param state
    lin = mxf.nnx.Linear(50, 16, recipe=recipe, rngs=nnx.Rngs(0))
    y_float = lin(x)
    nnx.update(lin, mxf.quantize_params(nnx.state(lin, nnx.Param), recipe=recipe))
    assert lin.kernel.get_value().hadamard == (block, seed)
    np.testing.assert_array_equal(np.asarray(lin(x)), np.asarray(y_float))


def test_quantize_params_recipe_errors_and_defaults():
    p = {"params": {"kernel": jnp.ones((96, 8))}}
    with pytest.raises(ValueError, match="differs from recipe.scale_mode"):
        mxf.quantize_params(p, scale_mode="floor", recipe=mx.Recipe())
    with pytest.raises(ValueError, match="not a multiple of the Hadamard block 64"):
        mxf.quantize_params(p, recipe=mx.Recipe(hadamard="fprop", hadamard_block=64))
    # no fprop rotation in the recipe (or fprop in bf16): plain kernels, the recipe's scale rule
    for r in (mx.Recipe(hadamard=True, scale_mode="rceil"), mx.Recipe(hadamard="fprop", fprop="bf16", scale_mode="rceil")):
        kq = mxf.quantize_params(p, recipe=r)["params"]["kernel"]
        assert kq.hadamard is None and kq.scale_mode == "rceil"


def test_mxfp4_array_hadamard_field():
    w = jax.random.normal(jax.random.key(0), (64, 32))
    x = jax.random.normal(jax.random.key(1), (8, 64))
    s = 123
    wq0 = mx.quantize(random_hadamard_transform(w, 0, s, 64), 0)
    wq = mx.MXFP4Array(wq0.data, wq0.scales, 0, (64, 32), jnp.float32, hadamard=(64, s))
    dims = (((1,), (0,)), ((), ()))
    # a float lhs facing the rotated array is rotated the same way, under jit too
    y = jax.jit(lambda a, b: mx.dot_general(a, b, dims))(x, wq)
    xr = mx.quantize(random_hadamard_transform(x, 1, s, 64), 1)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(mx.dot_general(xr, wq0, dims)))
    # two arrays: same rotation fine, different rotations (or one missing) refused
    xq = mx.MXFP4Array(xr.data, xr.scales, 1, xr.shape, xr.dtype, hadamard=(64, s))
    np.testing.assert_array_equal(np.asarray(mx.dot_general(xq, wq, dims)), np.asarray(y))
    with pytest.raises(ValueError, match="different Hadamard rotations"):
        mx.dot_general(xr, wq, dims)
    # pytree: the record survives flatten/unflatten, device_put and jit
    leaves, tdef = jax.tree_util.tree_flatten(wq)
    assert jax.tree_util.tree_unflatten(tdef, leaves).hadamard == (64, s)
    assert jax.jit(lambda a: a)(wq).hadamard == (64, s)
    assert wq.with_scale_layout("swizzled").hadamard == (64, s)
    # validation
    with pytest.raises(ValueError, match="hadamard must be None or a tuple"):
        mx.MXFP4Array(wq0.data, wq0.scales, 0, (64, 32), jnp.float32, hadamard=64)
    with pytest.raises(ValueError, match="hadamard block must be a power of two"):
        mx.MXFP4Array(wq0.data, wq0.scales, 0, (64, 32), jnp.float32, hadamard=(48, 1))
    with pytest.raises(ValueError, match="not a multiple of the Hadamard block 128"):
        mx.MXFP4Array(wq0.data, wq0.scales, 0, (64, 32), jnp.float32, hadamard=(128, 1))


def test_demo_hadamard_flags():
    import train_lm as demo

    assert demo.parse_args(["--hadamard"]).hadamard == ("wgrad",)  # the original flag's meaning
    a = demo.parse_args(["--hadamard", "fprop,wgrad", "--hadamard-block", "64"])
    assert (a.hadamard, a.hadamard_block) == (("fprop", "wgrad"), 64)
    assert demo.parse_args(["--hadamard", "none"]).hadamard is False
    assert mx.Recipe(hadamard=demo.parse_args(["--hadamard", "all"]).hadamard).hadamard_passes == ("fprop", "dgrad", "wgrad")
    for bad in (["--hadamard", "fwd"], ["--hadamard-block", "48"]):
        with pytest.raises(SystemExit):
            demo.parse_args(bad)


def test_hadamard_spec_rules():
    """(block, seed) pairs: named errors for a bad shape of the pair, a non-int or negative seed,
    and advice that does not ask for an impossible block."""
    import pytest as _pt

    from jax_mxfp4 import hadamard as _hd

    assert _hd.check_spec((64, 3)) == (64, 3)
    for bad, exc, msg in [(32, TypeError, "pair"), ((32, 0, 1), TypeError, "pair"), ((32, 1.7), TypeError, "seed"),
                          ((32, "3"), TypeError, "seed"), ((32, -1), ValueError, "seed"), ((48, 0), ValueError, "block")]:
        with _pt.raises(exc, match=msg):
            _hd.check_spec(bad)
    with _pt.raises(ValueError, match="No block size"):
        _hd.check_length(3, 32, "x")
    with _pt.raises(ValueError, match=r"\[32\]"):
        _hd.check_length(96, 64, "x")
