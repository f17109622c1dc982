"""The strided-axis quantizer (jax_mxfp4.kernels.quantize_columns) against the reference.

Runs the kernel in the Pallas interpreter on CPU. Oracles: the reference ``_quantize_impl`` (the
same bits required: data and scale bytes, stochastic rounding with the same key) and, for round
to nearest, the independent NumPy float64 + ml_dtypes model of tests/mx_reference.py.
Edge cases named in ``_hard_columns``: E2M1 ties, -0.0, float32 subnormals, NaN and Inf blocks, a
block 40 binades above the rest, tiny blocks (scale bytes 0/1), overflowing blocks, an empty
column; tiles that overhang the array in both directions (masked loads and stores).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mx_reference as ref
from jax_mxfp4.kernels import quantize_kernel as kq
from jax_mxfp4.kernels.quantize_columns import ColumnsConfig, quantize_columns_3d, quantize_strided
from jax_mxfp4.mx_format import SCALE_MODES
from jax_mxfp4.quantize import _quantize_impl


def _hard_columns(rng, n_l, r, t, dtype):
    """[L, R, T] normal data with per-block scales over ~12 binades and the named edge cases in
    columns 0..7 of slice 0 (each a column of the quantized axis R)."""
    x = rng.standard_normal((n_l, r, t)).astype(np.float32)
    x *= np.repeat(2.0 ** rng.integers(-6, 6, (n_l, r // 32, t)), 32, axis=1)
    cols = x[0]  # [R, T] view: column c is one output row
    cols[:, 0] = rng.choice([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -2.5, 6.0], r)  # E2M1 ties
    cols[:32, 1] = -0.0
    if r > 32:
        cols[32:64, 1] = 1e-40  # float32 subnormals: flushed
    cols[:32, min(2, t - 1)] *= 2.0**40
    if t > 3:
        cols[5, 3] = np.nan
    if t > 4:
        cols[min(40, r - 1), 4] = np.inf
    if t > 5:
        cols[:32, 5] = 2.0**-130 * np.arange(1, 33)  # scale byte 0/1
    if t > 6:
        cols[:, 6] = 0.0
    if t > 7:
        cols[:32, 7] = 3.0e38  # scale byte 0xFD/0xFE
    return jnp.asarray(x).astype(dtype)


def _want(x, key, rounding, scale_mode):
    """The reference quantized along axis 1, that axis moved last: [L, T, R/2] and [L, T, R/32]."""
    data, scales = _quantize_impl(x, key, axis=1, scale_mode=scale_mode, rounding=rounding)
    return np.moveaxis(np.asarray(data), 1, 2), np.moveaxis(np.asarray(scales).view(np.uint8), 1, 2)


def _check(got, want, what=""):
    np.testing.assert_array_equal(np.asarray(got[0]), want[0], err_msg=f"data {what}")
    np.testing.assert_array_equal(np.asarray(got[1]), want[1], err_msg=f"scale bytes {what}")


# (L, R, T), config: one tile, tiles overhanging R (3 blocks, 2 per tile) and T (300 = 2.3 x 128),
# a column tile narrower than T, the default tile on several L slices
SHAPES = [((1, 64, 8), None), ((1, 96, 300), ColumnsConfig()), ((2, 160, 40), ColumnsConfig(blocks=4, cols=16)),
          ((3, 32, 10), ColumnsConfig(blocks=1, cols=4, num_warps=2))]


@pytest.mark.sweep(keep=2)
@pytest.mark.parametrize("shape,cfg", SHAPES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_nearest_every_scale_mode(shape, cfg, dtype, rng):
    x = _hard_columns(rng, *shape, dtype)
    for mode in SCALE_MODES:
        got = quantize_columns_3d(x, scale_mode=mode, cfg=cfg, interpret=True)
        _check(got, _want(x, None, "nearest", mode), mode)


def test_nearest_against_float64_model(rng):
    """Independent oracle: NumPy float64 + ml_dtypes rounding (tests/mx_reference.py), on finite
    data (the model's NaN policy is checked through the reference above)."""
    x = np.asarray(_hard_columns(rng, 2, 64, 12, jnp.float32))
    x = np.where(np.isfinite(x), x, 1.0).astype(np.float32)
    for mode in SCALE_MODES:
        data, scales = quantize_columns_3d(jnp.asarray(x), scale_mode=mode, interpret=True)
        codes, sb = ref.quantize_ref(np.moveaxis(x, 1, 2), 2, mode)
        np.testing.assert_array_equal(np.asarray(data), ref.pack_ref(codes, 2), err_msg=mode)
        np.testing.assert_array_equal(np.asarray(scales), sb, err_msg=mode)


@pytest.mark.sweep(keep=3)
@pytest.mark.parametrize("impl", ["threefry2x32", "rbg", "unsafe_rbg", "uniform"])
@pytest.mark.parametrize("shape,cfg", SHAPES[1:])
def test_stochastic_uses_the_reference_draw(impl, shape, cfg, rng):
    """Uniforms generated in the kernel (Threefry for threefry keys, Philox for rbg keys: one block
    per quad of rows) or read as the reference's draw: the reference's bits in every case."""
    x = _hard_columns(rng, *shape, jnp.float32)
    key = jax.random.key(int(rng.integers(2**31)), impl="rbg" if impl == "uniform" else impl)
    mode = SCALE_MODES[int(rng.integers(len(SCALE_MODES)))]
    want = _want(x, key, "stochastic", mode)
    if impl == "uniform":
        n_l, r, t = x.shape
        got = quantize_columns_3d(x, None, jax.random.uniform(key, (n_l, t, r // 32, 32), jnp.float32),
                                  scale_mode=mode, cfg=cfg, interpret=True)
    else:
        got = quantize_columns_3d(x, jax.random.key_data(key), scale_mode=mode, cfg=cfg, interpret=True)
    _check(got, want, f"{impl} {mode}")


@pytest.mark.parametrize("axis,shape", [(0, (64, 24)), (1, (2, 96, 5)), (0, (32, 3, 4)), (2, (3, 2, 64, 6))])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_quantize_strided_any_axis(axis, shape, rounding, rng):
    """quantize_strided (the GPU path of jax_mxfp4.quantize along any axis but the last): leading
    and trailing dims folded into L and T, the result in the reference's layout, bit for bit."""
    x = jnp.asarray(rng.standard_normal(shape) * 3, jnp.float32)
    key = jax.random.key(int(rng.integers(2**31)), impl="rbg") if rounding == "stochastic" else None
    got = quantize_strided(x, key, axis=axis, scale_mode="even", rounding=rounding, interpret=True)
    want = _quantize_impl(x, key, axis=axis, scale_mode="even", rounding=rounding)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(g, jnp.uint8)),
                                      np.asarray(jax.lax.bitcast_convert_type(w, jnp.uint8)))


def test_quantize_routes_strided_axes_here(monkeypatch, rng):
    """jax_mxfp4.quantize on the GPU path (forced here, kernels interpreted): the last axis takes
    the row kernel, any other this one; both the reference's bits."""
    import jax_mxfp4 as mx
    from jax_mxfp4.kernels import quantize_columns as qc

    monkeypatch.setattr(kq, "fast_path_enabled", lambda platform, size: True)
    monkeypatch.setattr(kq, "quantize_impl", functools.partial(kq.quantize_impl, interpret=True))
    monkeypatch.setattr(qc, "quantize_strided", functools.partial(qc.quantize_strided, interpret=True))
    x = jnp.asarray(rng.standard_normal((64, 96)), jnp.float32)
    for axis, kernel, other in ((0, "mxfp4_quantize_columns", "mxfp4_quantize\\d* ="),
                                (1, "mxfp4_quantize", "mxfp4_quantize_columns")):
        jaxpr = str(jax.make_jaxpr(lambda v, a=axis: mx.quantize(v, a).data)(x))
        assert kernel in jaxpr and not re.search("let " + other, jaxpr), axis
        got = mx.quantize(x, axis)
        want = _quantize_impl(x, None, axis=axis, scale_mode="even", rounding="nearest")
        np.testing.assert_array_equal(np.asarray(got.data), np.asarray(want[0]))


def test_quantize_strided_refuses_the_last_axis():
    with pytest.raises(ValueError, match="last axis"):
        quantize_strided(jnp.zeros((4, 64)), None, axis=1, scale_mode="even", rounding="nearest", interpret=True)


@pytest.mark.parametrize("rng_kind", [None, "threefry", "philox"])
def test_lowers_for_cuda(rng_kind):
    """Triton lowering on a CPU machine (no GPU needed): the default tile at a training shape and
    an overhanging one, nearest and both in-kernel generators (Philox with its PTX mul.hi)."""
    kd = {None: None, "threefry": jax.ShapeDtypeStruct((2,), jnp.uint32),
          "philox": jax.ShapeDtypeStruct((4,), jnp.uint32)}[rng_kind]
    for shape, dtype in (((1, 8192, 4096), jnp.float32), ((3, 96, 300), jnp.bfloat16)):
        args = (jax.ShapeDtypeStruct(shape, dtype),) + (() if kd is None else (kd,))
        text = jax.jit(quantize_columns_3d).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "mxfp4_quantize_columns" in text


def test_bad_arguments_are_named():
    x = jnp.zeros((1, 64, 8), jnp.float32)
    with pytest.raises(TypeError, match="x"):
        quantize_columns_3d(jnp.zeros((1, 64, 8), jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="3-D"):
        quantize_columns_3d(jnp.zeros((64, 8), jnp.float32), interpret=True)
    with pytest.raises(ValueError, match="non-empty"):
        quantize_columns_3d(jnp.zeros((1, 64, 0), jnp.float32), interpret=True)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_columns_3d(jnp.zeros((1, 48, 8), jnp.float32), interpret=True)
    with pytest.raises(ValueError, match="scale_mode"):
        quantize_columns_3d(x, scale_mode="up", interpret=True)
    with pytest.raises(TypeError, match="key_data"):
        quantize_columns_3d(x, jnp.zeros((3,), jnp.uint32), interpret=True)
    with pytest.raises(ValueError, match="not both"):
        quantize_columns_3d(x, jnp.zeros((2,), jnp.uint32), jnp.zeros((512,), jnp.float32), interpret=True)
    with pytest.raises(ValueError, match="elements"):
        quantize_columns_3d(x, None, jnp.zeros((500,), jnp.float32), interpret=True)
    with pytest.raises(TypeError, match="ColumnsConfig"):
        quantize_columns_3d(x, cfg=(2, 128), interpret=True)
    with pytest.raises(ValueError, match="power of two"):
        ColumnsConfig(cols=96)


def test_kernel_entry_points_refuse_a_non_bool_interpret():
    """A truthy non-bool (``interpret="yes"``) silently chose the interpreter; every quantizer
    kernel entry point now names it."""
    from jax_mxfp4.kernels import fp8_quantize

    x = jnp.zeros((1, 64, 8), jnp.float32)
    calls = {
        "quantize_columns_3d": lambda: quantize_columns_3d(x, interpret="yes"),
        "quantize_strided": lambda: quantize_strided(x, None, axis=1, scale_mode="even", rounding="nearest",
                                                     interpret=1),
        "quantize_2d": lambda: kq.quantize_2d(x[0], interpret="yes"),
        "quantize_impl": lambda: kq.quantize_impl(x, None, axis=1, scale_mode="even", rounding="nearest", interpret=1),
        "quantize_fp8_2d": lambda: fp8_quantize.quantize_fp8_2d(x[0].T, interpret="no"),
    }
    for fn, call in calls.items():
        with pytest.raises(TypeError, match=f"{fn}: interpret must be a bool"):
            call()


def test_threefry_key_data_needs_the_partitionable_threefry(rng):
    """With jax_threefry_partitionable off the kernels' Threefry is not jax.random's: raw key data
    is refused by name (it gave other bits silently); jax_mxfp4.quantize's own route draws the
    uniforms there and keeps the reference's bits."""
    from jax_mxfp4.kernels import fp8_quantize

    x = jnp.asarray(rng.standard_normal((1, 64, 5)), jnp.float32)
    key = jax.random.key(1)
    kd = jax.random.key_data(key)
    prev = jax.config.jax_threefry_partitionable
    jax.config.update("jax_threefry_partitionable", False)
    try:
        for call in (lambda: quantize_columns_3d(x, kd, interpret=True),
                     lambda: kq.quantize_2d(x[0].T, key_data=kd, interpret=True),
                     lambda: fp8_quantize.quantize_fp8_2d(x[0].T, kd, interpret=True)):
            with pytest.raises(ValueError, match="jax_threefry_partitionable"):
                call()
        got = quantize_strided(x, key, axis=1, scale_mode="even", rounding="stochastic", interpret=True)
        want = _quantize_impl(x, key, axis=1, scale_mode="even", rounding="stochastic")
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    finally:
        jax.config.update("jax_threefry_partitionable", prev)


def test_symbolic_and_empty_inputs_are_named():
    """Shape polymorphism reached an InconclusiveDimensionOperation (neither error the docstrings
    name); an empty x named the internal [L, R, T] view instead of the caller's array."""
    from jax import export

    (b,) = export.symbolic_shape("b")
    for fn in (lambda v: quantize_columns_3d(v, interpret=True),
               lambda v: quantize_strided(v, None, axis=1, scale_mode="even", rounding="nearest", interpret=True),
               lambda v: kq.quantize_impl(v, None, axis=1, scale_mode="even", rounding="nearest", interpret=True)):
        with pytest.raises(ValueError, match="symbolic"):
            jax.jit(fn).trace(jax.ShapeDtypeStruct((b, 64, 3), jnp.float32))
    with pytest.raises(ValueError, match=r"quantize_strided: x of shape \(64, 0\) is empty"):
        quantize_strided(jnp.ones((64, 0)), None, axis=0, scale_mode="even", rounding="nearest", interpret=True)
    with pytest.raises(ValueError, match="quantize_strided: axis"):
        quantize_strided(jnp.ones((64, 8)), None, axis=2, scale_mode="even", rounding="nearest", interpret=True)


def test_uniform_in_xs_own_layout_is_refused():
    """The natural mistake, the uniforms in x's [L, R, T] order, has the right element count."""
    x = jnp.zeros((1, 64, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"\[L, T, R/32, 32\]"):
        quantize_columns_3d(x, None, jnp.zeros((1, 64, 8), jnp.float32), interpret=True)
    for shape in ((1, 8, 2, 32), (1, 8, 64), (512,)):  # the documented forms
        quantize_columns_3d(x, None, jnp.zeros(shape, jnp.float32), interpret=True)


def test_tile_configs_take_numpy_ints_and_bound_the_warps():
    """Tile sizes from NumPy were refused as 'not a power of two'; a CTA holds at most 32 warps."""
    from jax_mxfp4.kernels.fp8_quantize import Fp8QuantizeConfig

    assert ColumnsConfig(np.int64(2), np.int32(64), np.int64(4)) == ColumnsConfig(2, 64, 4)
    assert Fp8QuantizeConfig(np.int64(2), np.int64(8)) == Fp8QuantizeConfig(2, 8)
    for bad in (dict(num_warps=64), dict(blocks=2.0), dict(cols=True)):
        with pytest.raises(ValueError, match="must be a power of two"):
            ColumnsConfig(**bad)
    with pytest.raises(ValueError, match="at most 32"):
        Fp8QuantizeConfig(num_warps=64)
