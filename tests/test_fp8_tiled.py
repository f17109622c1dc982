"""The two-pass tiled quantize-to-FP8 kernel (jax_mxfp4/kernels/fp8_quantize_tiled.py) in the
Pallas interpreter: bit for bit the reference encode_rows(quantize(x)) (jax_mxfp4.quantize's jnp
path) and the one-pass kernel, both layouts, every scale rule, round to nearest and stochastic
rounding (threefry uniforms generated in the kernel; rbg uniforms read), tiles overhanging the
array on both axes, tiles mixing plain and special blocks; Triton lowering for CUDA."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_fp8_fused import SCALE_MODES, _assert_same, _hard_rows, _plain_rows, _reference

from jax_mxfp4.fp8 import FLAG_EXACT, FLAG_NAN
from jax_mxfp4.kernels import fp8_quantize as fq
from jax_mxfp4.kernels import fp8_quantize_tiled as ft
from jax_mxfp4.kernels import quantize as kquant

SMALL = ft.TiledConfig(rows=4, blocks=2, num_warps=4)  # tiles overhang 10 rows and 3 blocks

# The tiled kernel serves only the training mode JAX_MXFP4_FUSED_TRAINING=tiled, which no default
# selects: its interpreter checks run in the slow tier.
pytestmark = pytest.mark.slow


def _rows(rng, dtype, rows=10, kq=96):
    """_hard_rows (every special block kind) with plain rows after them: some tiles all plain."""
    hard = np.asarray(_hard_rows(rng, rows, kq, jnp.float32))
    plain = _plain_rows(rng, 6, kq // 32)
    return jnp.asarray(np.concatenate([hard, plain])).astype(dtype)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("rounding", ["nearest", "threefry", "rbg"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_tiled_bit_identical_to_reference(transposed, rounding, dtype, rng):
    xr = _rows(rng, dtype)
    x, axis = (xr.T, 0) if transposed else (xr, 1)
    key = None
    kd = u = None
    if rounding != "nearest":
        key = jax.random.key(int(rng.integers(2**31)), impl="threefry2x32" if rounding == "threefry" else "rbg")
        u, kd = kquant.sr_uniforms(key, (xr.shape[0], xr.shape[1] // 32, 32))
        assert (kd is None) == (rounding == "rbg")
    want = _reference(x, axis, "nearest" if key is None else "stochastic", key)
    got = ft.quantize_fp8_2d_tiled(x, kd, u, transposed=transposed, cfg=SMALL, interpret=True)
    _assert_same(got, want)
    flags = np.asarray(got[3])
    assert flags[2] & FLAG_EXACT and flags[5] & FLAG_EXACT and flags[7] & FLAG_EXACT  # named cases
    assert flags[3] & FLAG_NAN and flags[4] & FLAG_NAN
    assert not flags[10:].any() or (flags[15] & FLAG_EXACT)  # plain rows: only the window row flagged


@pytest.mark.parametrize("scale_mode", SCALE_MODES)
@pytest.mark.parametrize("transposed", [False, True])
def test_tiled_scale_modes_equal_the_one_pass_kernel(scale_mode, transposed, rng):
    """Every scale rule, both roundings: the same bits as the one-pass kernel and the reference."""
    xr = _rows(rng, jnp.float32, rows=8, kq=64)
    x, axis = (xr.T, 0) if transposed else (xr, 1)
    for rounding in ("nearest", "stochastic"):
        key = jax.random.key(int(rng.integers(2**31))) if rounding == "stochastic" else None
        kd = None if key is None else jax.random.key_data(key)
        got = ft.quantize_fp8_2d_tiled(x, kd, scale_mode=scale_mode, transposed=transposed,
                                       cfg=ft.TiledConfig(rows=8, blocks=1), interpret=True)
        _assert_same(got, _reference(x, axis, rounding, key, scale_mode))
        one_pass = fq.quantize_fp8_2d(x, kd, scale_mode=scale_mode, transposed=transposed,
                                      cfg=fq.Fp8QuantizeConfig(rows=2, num_warps=4), interpret=True)
        for a, b in zip(got, one_pass):
            np.testing.assert_array_equal(np.asarray(a).view(np.uint8) if a.dtype.itemsize == 1 else a,
                                          np.asarray(b).view(np.uint8) if b.dtype.itemsize == 1 else b)


@pytest.mark.parametrize("plain_path", [True, False])
def test_tiled_plain_and_general_paths(plain_path, rng):
    """A row of many blocks spread over several tiles along the quantized axis: its b_max (the
    row exponent) sits in one tile, its out-of-window block in another; tiles of plain blocks
    beside tiles with special blocks; the plain path on and off give the reference's bits."""
    x = np.array(_rows(rng, jnp.float32, rows=8, kq=256))
    x[9, :32] *= np.float32(2.0**30)  # this row's largest block in the first tile...
    x[9, 200:232] *= np.float32(2.0**-20)  # ... and a block 50 binades below it in the last
    x = jnp.asarray(x)
    cfg = ft.TiledConfig(rows=2, blocks=2, plain_path=plain_path)
    for rounding in ("nearest", "stochastic"):
        key = jax.random.key(int(rng.integers(2**31))) if rounding == "stochastic" else None
        kd = None if key is None else jax.random.key_data(key)
        got = ft.quantize_fp8_2d_tiled(x, kd, cfg=cfg, interpret=True)
        _assert_same(got, _reference(x, 1, rounding, key))
        assert np.asarray(got[3])[9] & FLAG_EXACT


def test_tiled_takes_rows_longer_than_max_row(rng):
    """No MAX_ROW cap: a quantized length above the one-pass kernel's (which refuses it)."""
    kq = 2 * fq.MAX_ROW
    x = jnp.asarray(rng.standard_normal((2, kq)) * 2.0 ** rng.integers(-5, 5, (2, kq)), jnp.float32)
    got = ft.quantize_fp8_2d_tiled(x, cfg=ft.TiledConfig(rows=2, blocks=64), interpret=True)
    _assert_same(got, _reference(x, 1, "nearest", None))
    with pytest.raises(ValueError, match="MAX_ROW"):
        fq.quantize_fp8_2d(jax.ShapeDtypeStruct((2, kq), jnp.float32), interpret=True)


def test_tiled_bad_input_named():
    with pytest.raises(ValueError, match="quantize_fp8_2d_tiled: x must be 2-D"):
        ft.quantize_fp8_2d_tiled(jnp.zeros((2, 2, 32)), interpret=True)
    with pytest.raises(ValueError, match="multiple of 32"):
        ft.quantize_fp8_2d_tiled(jnp.zeros((4, 40)), interpret=True)
    with pytest.raises(ValueError, match="not both"):
        ft.quantize_fp8_2d_tiled(jnp.zeros((2, 32)), jnp.zeros(2, jnp.uint32), jnp.zeros((2, 32)), interpret=True)
    with pytest.raises(TypeError, match="TiledConfig"):
        ft.quantize_fp8_2d_tiled(jnp.zeros((2, 32)), cfg=fq.Fp8QuantizeConfig(), interpret=True)
    with pytest.raises(TypeError, match="float"):
        ft.quantize_fp8_2d_tiled(jnp.zeros((2, 32), jnp.int32), interpret=True)
    for bad in (dict(rows=3), dict(blocks=0), dict(num_warps=64), dict(rows=True)):
        with pytest.raises(ValueError, match="TiledConfig"):
            ft.TiledConfig(**bad)
    with pytest.raises(TypeError, match="plain_path"):
        ft.TiledConfig(plain_path=1)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("rng_kind", [None, "kernel", "input"])
def test_tiled_lowers_for_cuda(transposed, rng_kind):
    """Triton lowering of both passes (no GPU needed): ragged tiles on both axes, each rounding."""
    shape = (33, 96)  # rows x quantized length
    x = jax.ShapeDtypeStruct(shape[::-1] if transposed else shape, jnp.bfloat16)
    f = functools.partial(ft.quantize_fp8_2d_tiled, transposed=transposed, cfg=SMALL)
    if rng_kind is None:
        traced = jax.jit(f).trace(x)
    elif rng_kind == "kernel":
        traced = jax.jit(f).trace(x, jax.ShapeDtypeStruct((2,), jnp.uint32))
    else:
        traced = jax.jit(lambda x, u: f(x, uniform=u)).trace(x, jax.ShapeDtypeStruct((33, 3, 32), jnp.float32))
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("triton") >= 2, "both passes lower to Triton kernels"


@pytest.mark.parametrize("transposed", [False, True])
def test_both_kernels_run_under_x64(transposed, rng):
    """With jax_enable_x64 on, float32 input: every view of both quantize-to-FP8 kernels starts at
    int32 indices (a bare ':' or a Python 0 became int64 beside the int32 program ids: the
    interpreter raised a dynamic_slice TypeError)."""
    xr = _rows(rng, jnp.float32, rows=8, kq=64)
    x, axis = (xr.T, 0) if transposed else (xr, 1)
    key = jax.random.key(int(rng.integers(2**31)))
    want = _reference(x, axis, "stochastic", key)
    with jax.enable_x64(True):
        kd = jax.random.key_data(key)
        got_tiled = ft.quantize_fp8_2d_tiled(x, kd, transposed=transposed, cfg=SMALL, interpret=True)
        got_one = fq.quantize_fp8_2d(x, kd, transposed=transposed, cfg=fq.Fp8QuantizeConfig(rows=4, num_warps=4),
                                     interpret=True)
    _assert_same(got_tiled, want)
    _assert_same(got_one, want)
