"""jax.export with MXFP4 values: serialize -> deserialize -> call gives the jitted function's bits.

Covers MXFP4Array / FP8Prepared / DecodePrepared as arguments and as results, shape-polymorphic
exports (symbolic rows) of quantize and dot_general called at two row counts, multi-platform
export, and the clear refusals: a symbolic contracting/quantized dim, a static-shape backend,
differentiation with symbolic dims.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_mxfp4 as mx
from jax_mxfp4.ffi import export_safety_checks

DN = (((1,), (0,)), ((), ()))
PREPARE = {
    "MXFP4Array": lambda q: q,
    "FP8Prepared": mx.prepare_fp8,
    "DecodePrepared": mx.prepare_decode,
}


def round_trip(fn, *specs, platforms=None):
    """export -> serialize -> deserialize (what a serving process loads)."""
    exp = jax.export.export(jax.jit(fn), platforms=platforms, disabled_checks=export_safety_checks())(*specs)
    return jax.export.deserialize(exp.serialize())


def bits(tree):
    """Every leaf's raw bytes (e8m0 / e4m3 compared bit for bit, NaN scales included)."""
    return [np.asarray(leaf).view(np.uint8).tobytes() for leaf in jax.tree.leaves(tree)]


def assert_same_values(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    assert [np.shape(a) for a in jax.tree.leaves(got)] == [np.shape(a) for a in jax.tree.leaves(want)]
    assert bits(got) == bits(want)
    if hasattr(want, "shape"):
        assert got.shape == want.shape and got.dtype == want.dtype


@pytest.fixture
def operands(rng):
    x = jnp.asarray(rng.standard_normal((48, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((64, 32)), jnp.float32)
    return x, w


@pytest.mark.parametrize("form", list(PREPARE))
def test_prequantized_argument_round_trips(operands, form):
    x, w = operands
    wq = PREPARE[form](mx.quantize(w, 0))

    def f(x, wq):
        return mx.dot_general(x, wq, DN)

    exp = round_trip(f, x, wq)
    assert_same_values(exp.call(x, wq), jax.jit(f)(x, wq))


def test_ffi_cpu_custom_call_with_mxfp4array_argument_round_trips(operands):
    """The CPU FFI handler's custom call survives serialization and runs the same bits."""
    if "ffi-cpu" not in mx.available_backends():
        pytest.skip("the CPU FFI extension is not built here")
    x, w = operands
    q = mx.quantize(w, 0)

    def f(x, q):
        return mx.dot_general(x, q, DN, recipe=mx.Recipe(backend="ffi-cpu"))

    exp = round_trip(f, x, q)
    assert "stablehlo.custom_call @jax_mxfp4" in exp.mlir_module()
    np.testing.assert_array_equal(exp.call(x, q), jax.jit(f)(x, q))


@pytest.mark.parametrize("form", list(PREPARE))
def test_prequantized_result_round_trips(operands, form):
    """The result comes back as the same pytree type, static fields included."""
    _, w = operands

    def f(w):
        return PREPARE[form](mx.quantize(w, 0, scale_mode="rceil"))

    got, want = round_trip(f, w).call(w), jax.jit(f)(w)
    assert type(got) is type(want)
    assert_same_values(got, want)
    assert (got.axis, got.scale_mode) == (want.axis, want.scale_mode) == (0, "rceil")


def test_swizzled_rotated_mxfp4array_static_fields_round_trip(operands):
    """Every static field (scale layout, Hadamard record, dtype) survives serialization."""
    x, w = operands
    q = mx.quantize(w.astype(jnp.bfloat16), 0, scale_layout="swizzled")
    q = type(q)(q.data, q.scales, q.axis, q.shape, q.dtype, q.scale_mode, q.scale_layout, (32, 5))
    exp = round_trip(lambda q: q, q)
    got = exp.call(q)
    assert (got.scale_layout, got.hadamard, got.dtype) == ("swizzled", (32, 5), jnp.bfloat16)
    assert_same_values(got, q)


@pytest.mark.parametrize("form", ["FP8Prepared", "DecodePrepared"])
def test_rotated_serving_forms_keep_their_rotation_through_export(operands, form):
    """A serving form of a rotated weight keeps the rotation record across serialization, and the
    exported program rotates the float operand facing it as the jitted one does."""
    x, w = operands
    q = mx.quantize(w, 0)
    q = type(q)(q.data, q.scales, q.axis, q.shape, q.dtype, q.scale_mode, q.scale_layout, (32, 7))
    wq = PREPARE[form](q)
    assert wq.hadamard == (32, 7)
    got = round_trip(lambda v: v, wq).call(wq)
    assert type(got) is type(wq) and got.hadamard == (32, 7)
    assert_same_values(got, wq)

    def f(x, v):
        return mx.dot_general(x, v, DN)

    np.testing.assert_array_equal(round_trip(f, x, wq).call(x, wq), jax.jit(f)(x, wq))


# ----------------------------------------------------------------------------- shape polymorphism
def rows_spec(k=64):
    (m,) = jax.export.symbolic_shape("m")
    return jax.ShapeDtypeStruct((m, k), jnp.float32)


def test_symbolic_rows_quantize_at_two_row_counts(operands):
    x, _ = operands
    exp = round_trip(lambda x: mx.quantize(x, 1), rows_spec())
    for rows in (8, 40):
        got = exp.call(x[:rows])
        assert got.shape == (rows, 64)  # concrete again, from the children
        assert_same_values(got, mx.quantize(x[:rows], 1))


@pytest.mark.parametrize("weight", ["float", "MXFP4Array"])
def test_symbolic_rows_dot_general_at_two_row_counts(operands, weight):
    x, w = operands
    wv = w if weight == "float" else mx.quantize(w, 0)

    def f(x, w):
        return mx.dot_general(x, w, DN)

    exp = round_trip(f, rows_spec(), wv)
    for rows in (8, 40):
        np.testing.assert_array_equal(exp.call(x[:rows], wv), jax.jit(f)(x[:rows], wv))


def test_symbolic_rows_multi_platform_export(operands):
    """cpu + cuda + rocm: each platform's branch lowers with symbolic rows; the cpu one runs here."""
    x, w = operands

    def f(x, w):
        return mx.dot_general(x, w, DN)

    exp = round_trip(f, rows_spec(), w, platforms=("cpu", "cuda", "rocm"))
    assert exp.platforms == ("cpu", "cuda", "rocm")
    np.testing.assert_array_equal(exp.call(x[:8], w), jax.jit(f)(x[:8], w))


def test_symbolic_contraction_dim_names_shape_polymorphism():
    (k,) = jax.export.symbolic_shape("k")
    x, w = jax.ShapeDtypeStruct((8, k), jnp.float32), jax.ShapeDtypeStruct((k, 16), jnp.float32)
    for fn in (lambda x, w: mx.quantize(x, 1), lambda x, w: mx.dot_general(x, w, DN), lambda x, w: mx.dense(x, w)):
        with pytest.raises(ValueError, match="shape polymorphism.*concrete multiple of the MXFP4 block size 32"):
            jax.export.export(jax.jit(fn))(x, w)


def test_symbolic_rows_refused_by_static_backend_and_by_differentiation():
    w = jax.ShapeDtypeStruct((64, 32), jnp.float32)
    with pytest.raises(mx.BackendUnavailableError, match="ffi-cpu.*shape polymorphism"):
        jax.export.export(jax.jit(lambda x, w: mx.dot_general(x, w, DN, recipe=mx.Recipe(backend="ffi-cpu"))))(
            rows_spec(), w)
    with pytest.raises(ValueError, match="differentiating jax_mxfp4.dot_general with symbolic dims"):
        jax.export.export(jax.jit(jax.grad(lambda x, w: jnp.sum(mx.dot_general(x, w, DN)))))(rows_spec(), w)
