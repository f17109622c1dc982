"""Quantization rules: every scale mode, every E2M1 tie point, special values, subnormals,
stochastic rounding, layouts, against the independent float64 reference in mx_reference.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_mxfp4 as mx
from jax_mxfp4 import mx_format
from mx_reference import dequantize_ref, pack_ref, quantize_ref, unpack_ref

MODES = ["floor", "ceil", "even", "rceil"]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def scale_bytes(q):
    return np.asarray(q.plain_scales()).view(np.uint8)


def block_with_amax(amax, rest=0.0):
    x = np.full(32, rest, np.float32)
    x[0] = amax
    return x


def random_blocks(rng, shape, dtype):
    """Normal values times per-block random powers of two, so many exponents and ties occur."""
    span = 8 if dtype == jnp.float16 else 20  # keep float16 finite
    x = rng.standard_normal(shape) * np.exp2(rng.integers(-span, span, shape[:-1] + (1,)))
    return np.asarray(x, np.float32).astype(dtype)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_quantize_matches_reference_bit_for_bit(mode, dtype, rng):
    x = random_blocks(rng, (17, 96), dtype)
    q = mx.quantize(jnp.asarray(x), axis=1, scale_mode=mode)
    codes, sbytes = quantize_ref(np.asarray(x, np.float32), 1, mode)
    np.testing.assert_array_equal(scale_bytes(q), sbytes)
    np.testing.assert_array_equal(np.asarray(q.data), pack_ref(codes, 1))
    np.testing.assert_array_equal(
        np.asarray(mx.dequantize(q)), dequantize_ref(codes, sbytes, 1).astype(np.float32)
    )
    assert q.dtype == jnp.dtype(dtype) and q.shape == x.shape and q.axis == 1


# E8M0 bytes per mode for a block whose largest magnitude is `amax` (mxfp4-numerics.md §A2 table).
SCALE_TABLE = [
    (0.0, dict(floor=0x00, ceil=0x00, even=0x00, rceil=0x00)),
    (4.0, dict(floor=0x7F, ceil=0x7F, even=0x7F, rceil=0x7F)),
    (5.0, dict(floor=0x7F, ceil=0x80, even=0x7F, rceil=0x7F)),
    (6.0, dict(floor=0x7F, ceil=0x80, even=0x7F, rceil=0x7F)),
    (6.5, dict(floor=0x7F, ceil=0x80, even=0x7F, rceil=0x80)),
    (7.0, dict(floor=0x7F, ceil=0x80, even=0x80, rceil=0x80)),
    (7.5, dict(floor=0x7F, ceil=0x80, even=0x80, rceil=0x80)),
    (1.75 * 2.0**-125, dict(floor=0x00, ceil=0x01, even=0x01, rceil=0x01)),
]


@pytest.mark.parametrize("amax,expected", SCALE_TABLE, ids=[str(a) for a, _ in SCALE_TABLE])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_scale_table_edge_cases(amax, expected, sign):
    for mode in MODES:
        q = mx.quantize(jnp.asarray(block_with_amax(sign * amax)), scale_mode=mode)
        assert scale_bytes(q)[0] == expected[mode], mode
        _, ref = quantize_ref(block_with_amax(sign * amax), 0, mode)
        assert ref[0] == expected[mode], mode


def test_floor_clips_where_even_rounds_up():
    """[7.0, ...]: FLOOR decodes 6.0 (clipped), EVEN/RCEIL/CEIL decode 8.0 (numerics §A2)."""
    x = jnp.asarray(block_with_amax(7.0))
    assert float(mx.dequantize(mx.quantize(x, scale_mode="floor"))[0]) == 6.0
    for mode in ("even", "rceil", "ceil"):
        assert float(mx.dequantize(mx.quantize(x, scale_mode=mode))[0]) == 8.0


@pytest.mark.parametrize("mode", MODES)
def test_every_e2m1_tie_point_rounds_half_to_even(mode):
    # amax 4.0 pins the scale to 2^0 in every mode, so elements are rounded as they are.
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
    want = np.array([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0], np.float32)
    for sign in (1.0, -1.0):
        x = np.zeros(32, np.float32)
        x[0] = 4.0
        x[1 : 1 + len(ties)] = sign * ties
        got = np.asarray(mx.dequantize(mx.quantize(jnp.asarray(x), scale_mode=mode)))
        np.testing.assert_array_equal(got[1 : 1 + len(ties)], sign * want)
        # ml_dtypes' own RNE cast agrees.
        np.testing.assert_array_equal(
            (sign * ties).astype(ml_dtypes.float4_e2m1fn).astype(np.float32), sign * want
        )


def test_nearest_rounding_saturates_and_keeps_sign_of_zero():
    x = np.zeros(32, np.float32)
    x[:6] = [7.9, -7.9, 0.1, -0.1, -0.0, 6.0]
    q = mx.quantize(jnp.asarray(x), scale_mode="floor")  # floor: amax 7.9 -> scale 1, 7.9 clips
    got = np.asarray(mx.dequantize(q))
    np.testing.assert_array_equal(got[:6], [6.0, -6.0, 0.0, -0.0, -0.0, 6.0])
    assert np.signbit(got[3]) and np.signbit(got[4]) and not np.signbit(got[2])


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("mode", MODES)
def test_nan_or_inf_poisons_only_its_block(bad, mode, rng):
    x = rng.standard_normal((2, 96)).astype(np.float32)
    x[1, 40] = bad
    q = mx.quantize(jnp.asarray(x), scale_mode=mode)
    sb = scale_bytes(q)
    assert sb[1, 1] == 0xFF
    deq = np.asarray(mx.dequantize(q))
    assert np.isnan(deq[1, 32:64]).all()
    assert np.isfinite(deq[1, :32]).all() and np.isfinite(deq[1, 64:]).all()
    assert np.isfinite(deq[0]).all()
    codes, ref = quantize_ref(x, 1, mode)
    np.testing.assert_array_equal(sb, ref)
    np.testing.assert_array_equal(np.asarray(q.data), pack_ref(codes, 1))


def test_all_zero_block_has_scale_byte_zero():
    x = np.zeros((3, 64), np.float32)
    x[2, 33] = 1.0
    for mode in MODES:
        q = mx.quantize(jnp.asarray(x), scale_mode=mode)
        assert scale_bytes(q)[0, 0] == 0 and scale_bytes(q)[2, 0] == 0
        assert (np.asarray(q.data)[:2] == 0).all()
        np.testing.assert_array_equal(np.asarray(mx.dequantize(q)), x)


@pytest.mark.parametrize("jit", [False, True])
def test_subnormal_inputs_quantize_to_signed_zero_never_nan(jit):
    x = np.zeros(64, np.float32)
    x[:4] = [2.0**-130, -(2.0**-140), 2.0**-149, -(2.0**-127)]  # float32 subnormals
    x[32] = 2.0**-126  # smallest normal: kept
    x[33] = 2.0**-127  # subnormal in a block whose scale is 2^-127
    f = jax.jit(lambda v: mx.dequantize(mx.quantize(v))) if jit else (lambda v: mx.dequantize(mx.quantize(v)))
    for mode in MODES:
        q = mx.quantize(jnp.asarray(x), scale_mode=mode)
        got = np.asarray(f(jnp.asarray(x)) if mode == "even" else mx.dequantize(q))
        assert not np.isnan(got).any()
        np.testing.assert_array_equal(got[:4], [0.0, -0.0, 0.0, -0.0])
        assert np.signbit(got[1]) and np.signbit(got[3])
        assert got[32] == np.float32(2.0**-126)
        assert got[33] == 0.0
        codes, ref = quantize_ref(x, 0, mode)
        np.testing.assert_array_equal(scale_bytes(q), ref)
        np.testing.assert_array_equal(np.asarray(q.data), pack_ref(codes, 0))


def test_dequantized_values_below_min_normal_flush_to_zero_everywhere():
    # Scale byte 0x00 (2^-127): code 0.5 -> 2^-128, 1.5 -> 1.5 * 2^-127 (subnormal) -> 0;
    # code 2 -> 2^-126 (normal) is kept; byte 0x01: code 0.5 -> 2^-127 -> 0, code 1 -> 2^-126 kept.
    codes = np.zeros((2, 32), np.uint8)
    codes[0, :4] = [1, 3, 4, 0xB]  # 0.5, 1.5, 2.0, -1.5
    codes[1, :3] = [1, 2, 0x9]  # 0.5, 1.0, -0.5
    sbytes = np.array([[0], [1]], np.uint8)
    q = mx.MXFP4Array(
        jnp.asarray(pack_ref(codes, 1)), jnp.asarray(sbytes).view(jnp.float8_e8m0fnu), 1, (2, 32), jnp.float32
    )
    for fn in (mx.dequantize, jax.jit(mx.dequantize)):
        got = np.asarray(fn(q))
        np.testing.assert_array_equal(got[0, :4], [0.0, 0.0, 2.0**-126, -0.0])
        np.testing.assert_array_equal(got[1, :3], [0.0, 2.0**-126, -0.0])
        assert np.signbit(got[0, 3]) and np.signbit(got[1, 2])
        np.testing.assert_array_equal(got, dequantize_ref(codes, sbytes, 1).astype(np.float32))


def test_stochastic_rounding_is_unbiased_and_needs_a_key(rng):
    # amax 6 pins scale 2^0 (mode even); values strictly between grid points, both signs
    vals = rng.uniform(-6, 6, 31).astype(np.float32)
    x = np.concatenate([[6.0], vals]).astype(np.float32)
    draws = 4000
    keys = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), draws)
    deq = jax.vmap(lambda k: mx.dequantize(mx.quantize(jnp.asarray(x), rounding="stochastic", key=k)))(keys)
    deq = np.asarray(deq, np.float64)
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    assert np.isin(np.abs(deq), grid).all()
    mean = deq.mean(0)
    # std of one draw <= step/2 = 1; 5 sigma of the mean of `draws` draws
    np.testing.assert_allclose(mean, x, atol=5.0 / np.sqrt(draws))
    # nearest rounding is biased on the same values (sanity check that the test can fail)
    nearest = np.asarray(mx.dequantize(mx.quantize(jnp.asarray(x))))
    assert np.abs(nearest - x).max() > 5.0 / np.sqrt(draws)
    # values on the grid never move
    on_grid = np.concatenate([[6.0], np.resize(np.concatenate([grid, -grid]), 31)]).astype(np.float32)
    q = mx.quantize(jnp.asarray(on_grid), rounding="stochastic", key=jax.random.key(1))
    np.testing.assert_array_equal(np.asarray(mx.dequantize(q)), on_grid)
    with pytest.raises(ValueError, match="key"):
        mx.quantize(jnp.asarray(x), rounding="stochastic")


@pytest.mark.parametrize("axis", [0, 1, 2, -1])
def test_any_axis_matches_reference(axis, rng):
    shape = [64, 32, 96]
    x = random_blocks(rng, tuple(shape), np.float32)
    x = np.moveaxis(x, -1, axis)
    q = mx.quantize(jnp.asarray(x), axis=axis, scale_mode="rceil")
    ax = axis % 3
    codes, sb = quantize_ref(x, ax, "rceil")
    assert q.axis == ax
    np.testing.assert_array_equal(np.asarray(q.data), pack_ref(codes, ax))
    np.testing.assert_array_equal(scale_bytes(q), sb)


def test_pack_and_unpack_nibble_order():
    codes = np.arange(16, dtype=np.uint8)
    packed = np.asarray(mx_format.pack_nibbles(jnp.asarray(codes)))
    np.testing.assert_array_equal(packed, [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE])
    np.testing.assert_array_equal(np.asarray(mx_format.unpack_nibbles(jnp.asarray(packed))), codes)
    np.testing.assert_array_equal(unpack_ref(packed, 0), codes)
    # JAX's own float4 packing puts element 2i in the low nibble too (jax-ffi.md §0.1)
    f4 = jnp.asarray(codes.view(ml_dtypes.float4_e2m1fn)).reshape(8, 2)
    np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(f4, jnp.uint8)), packed)


class TestErrors:
    def test_axis_length_not_multiple_of_32(self):
        with pytest.raises(ValueError, match=r"axis 1 has length 48.*multiple of the MXFP4 block size 32"):
            mx.quantize(jnp.ones((4, 48)))

    def test_integer_input(self):
        with pytest.raises(TypeError, match="x must be a float32, bfloat16 or float16"):
            mx.quantize(jnp.ones((4, 32), jnp.int32))

    def test_float64_numpy_input(self):
        with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
            mx.quantize(np.ones((4, 32), np.float64))

    def test_axis_out_of_range(self):
        with pytest.raises(ValueError, match="axis=2 is out of range"):
            mx.quantize(jnp.ones((4, 32)), axis=2)

    @pytest.mark.parametrize("kw,msg", [
        (dict(scale_mode="round"), "scale_mode must be one of"),
        (dict(rounding="up"), "rounding must be one of"),
        (dict(scale_layout="tiled"), "scale_layout must be one of"),
    ])
    def test_bad_options(self, kw, msg):
        with pytest.raises(ValueError, match=msg):
            mx.quantize(jnp.ones((4, 32)), **kw)

    def test_mxfp4array_rejects_inconsistent_parts(self):
        q = mx.quantize(jnp.ones((4, 64)))
        with pytest.raises(ValueError, match="data shape"):
            mx.MXFP4Array(q.data[:, :16], q.scales, 1, (4, 64), jnp.float32)
        with pytest.raises(TypeError, match="scales must be float8_e8m0fnu"):
            mx.MXFP4Array(q.data, q.scales.view(jnp.uint8), 1, (4, 64), jnp.float32)
        with pytest.raises(TypeError, match="data must be uint8"):
            mx.MXFP4Array(q.data.astype(jnp.int8), q.scales, 1, (4, 64), jnp.float32)
        with pytest.raises(ValueError, match="not a multiple"):
            mx.MXFP4Array(q.data, q.scales, 0, (4, 64), jnp.float32)

    def test_dequantize_rejects_plain_arrays(self):
        with pytest.raises(TypeError, match="q must be an MXFP4Array"):
            mx.dequantize(jnp.ones((4, 32)))


def test_legacy_key_of_the_default_rbg_implementation_is_taken(rng):
    """With jax_default_prng_impl = "rbg" a legacy jax.random.PRNGKey is uint32[4]; it was refused
    with a message asking for exactly what was passed. Now it rounds as the reference does."""
    from jax_mxfp4.quantize import _quantize_impl

    x = jnp.asarray(rng.standard_normal((64, 8)), jnp.float32)
    prev = jax.config.jax_default_prng_impl
    jax.config.update("jax_default_prng_impl", "rbg")
    try:
        key = jax.random.PRNGKey(4)
        assert key.shape == (4,)
        got = mx.quantize(x, 0, rounding="stochastic", key=key)
        want = _quantize_impl(x, key, axis=0, scale_mode="even", rounding="stochastic")
        np.testing.assert_array_equal(np.asarray(got.data), np.asarray(want[0]))
        with pytest.raises(TypeError, match=r"legacy uint32\[4\]"):
            mx.quantize(x, 0, rounding="stochastic", key=jnp.zeros((2,), jnp.uint32))
    finally:
        jax.config.update("jax_default_prng_impl", prev)
