"""MXFP4Array as a pytree: jit, vmap, lax.scan, device_put; static fields; layouts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_mxfp4 as mx
from mx_reference import swizzle_index_ref


def make(shape=(8, 64), axis=-1, key=0):
    x = jax.random.normal(jax.random.key(key), shape)
    return x, mx.quantize(x, axis=axis)


def assert_same(a, b):
    assert type(a) is type(b) and a.shape == b.shape and a.axis == b.axis and a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))
    np.testing.assert_array_equal(np.asarray(a.scales).view(np.uint8), np.asarray(b.scales).view(np.uint8))


def test_fields_and_shapes():
    q = mx.quantize(jnp.ones((3, 64, 5), jnp.bfloat16), axis=1)
    assert q.axis == 1 and q.shape == (3, 64, 5) and q.dtype == jnp.bfloat16
    assert q.data.shape == (3, 32, 5) and q.data.dtype == jnp.uint8
    assert q.scales.shape == (3, 2, 5) and q.scales.dtype == jnp.float8_e8m0fnu
    assert q.nbytes == 3 * 32 * 5 + 3 * 2 * 5
    leaves, treedef = jax.tree_util.tree_flatten(q)
    assert len(leaves) == 2
    assert_same(jax.tree_util.tree_unflatten(treedef, leaves), q)


def test_passes_through_jit():
    x, q = make()
    out = jax.jit(lambda t: t)(q)
    assert_same(out, q)
    made = jax.jit(lambda v: mx.quantize(v, axis=0))(x.T)
    assert_same(made, mx.quantize(x.T, axis=0))
    np.testing.assert_array_equal(np.asarray(jax.jit(mx.dequantize)(q)), np.asarray(mx.dequantize(q)))


def test_passes_through_vmap_in_and_out():
    xs = jax.random.normal(jax.random.key(1), (4, 8, 64))
    qs = jax.vmap(lambda v: mx.quantize(v))(xs)
    assert qs.shape == (4, 8, 64) and qs.axis == 2
    assert_same(qs, mx.quantize(xs, axis=2))
    deq = jax.vmap(mx.dequantize)(qs)
    np.testing.assert_array_equal(np.asarray(deq), np.asarray(mx.dequantize(qs)))


def test_passes_through_scan():
    xs = jax.random.normal(jax.random.key(2), (3, 4, 32))

    def step(carry, x):
        q = mx.quantize(x)
        return carry + mx.dequantize(q).sum(), q

    total, qs = jax.lax.scan(step, 0.0, xs)
    assert qs.shape == (3, 4, 32)
    assert_same(qs, mx.quantize(xs, axis=2))
    np.testing.assert_allclose(float(total), float(mx.dequantize(mx.quantize(xs, axis=2)).sum()), rtol=1e-6)


def test_device_put():
    _, q = make()
    moved = jax.device_put(q, jax.devices()[0])
    assert_same(moved, q)


def test_swizzled_layout_matches_closed_form_for_nd_arrays():
    x = jax.random.normal(jax.random.key(3), (3, 64, 5))  # axis 1: 2-D view [3*5, 2]
    q = mx.quantize(x, axis=1)
    s = q.with_scale_layout("swizzled")
    assert s.scale_layout == "swizzled" and s.scales.shape == (32, 8)
    plain2d = np.moveaxis(np.asarray(q.scales).view(np.uint8), 1, -1).reshape(15, 2)
    _, _, dest = swizzle_index_ref(15, 2)
    np.testing.assert_array_equal(np.asarray(s.scales).view(np.uint8).reshape(-1)[dest], plain2d)
    with pytest.raises(ValueError, match="scale_layout must be one of"):
        q.with_scale_layout("tiled")


def test_vmap_along_other_axes_keeps_shape_and_axis_consistent():
    x = jax.random.normal(jax.random.key(4), (3, 4, 64))
    q = jax.vmap(mx.quantize, out_axes=1)(x)  # examples [4, 64] stacked along axis 1
    assert q.shape == (4, 3, 64) and q.axis == 2
    assert_same(q, mx.quantize(jnp.moveaxis(x, 0, 1), axis=2))
    q0 = jax.vmap(lambda a: mx.quantize(a, 0), out_axes=1)(jnp.ones((4, 64, 32)))
    assert q0.shape == (64, 4, 32) and q0.axis == 0
    # mapping over a non-leading axis on the way in
    y = jax.vmap(lambda t: mx.dot_general(t, jnp.ones((64, 5)), (((1,), (0,)), ((), ()))), in_axes=1)(mx.quantize(x))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(mx.dot_general(mx.quantize(x), jnp.ones((64, 5)), (((2,), (0,)), ((), ())))).transpose(1, 0, 2))


def test_constructor_rejects_non_arrays_and_bad_static_fields():
    q = mx.quantize(jnp.ones((2, 32)))
    with pytest.raises(TypeError, match="data and scales must be arrays"):
        mx.MXFP4Array(None, None, 1, (2, 32), jnp.float32)
    with pytest.raises(TypeError, match="dtype must be float32, bfloat16 or float16"):
        mx.MXFP4Array(q.data, q.scales, 1, (2, 32), jnp.int8)
    with pytest.raises(TypeError, match="shape must be a tuple of non-negative ints"):
        mx.MXFP4Array(q.data, q.scales, 1, (2.0, 32), jnp.float32)
    with pytest.raises(ValueError, match="axis must be an int"):
        mx.MXFP4Array(q.data, q.scales, True, (2, 32), jnp.float32)
    with pytest.raises(TypeError, match="already an MXFP4Array"):
        mx.quantize(q)


def test_weight_forms_share_one_pytree_protocol(rng):
    """MXFP4Array, FP8Prepared and DecodePrepared declare children once (jax_mxfp4.pytree): the
    arrays are leaves, every other field is static, and a flatten/unflatten keeps every field."""
    from jax_mxfp4.pytree import ArraysWithRecord

    q = mx.quantize(jnp.asarray(rng.standard_normal((64, 96)), jnp.bfloat16), 0, scale_mode="rceil")
    q = type(q)(q.data, q.scales, q.axis, q.shape, q.dtype, q.scale_mode, q.scale_layout, (32, 3))
    for form in (q, mx.prepare_fp8(q), mx.prepare_decode(q)):
        assert isinstance(form, ArraysWithRecord)
        leaves, treedef = jax.tree.flatten(form)
        assert len(leaves) == len(type(form).CHILDREN) and all(hasattr(v, "shape") for v in leaves)
        back = jax.tree.unflatten(treedef, leaves)
        for name in type(form).CHILDREN + type(form).static_fields():
            a, b = getattr(back, name), getattr(form, name)
            assert (a is b) or (a == b), name
        assert back.hadamard == (32, 3) and back.scale_mode == "rceil" and back.dtype == jnp.bfloat16
