"""The fused Pallas quantizer (GPU fast path of jax_mxfp4.quantize) is bit-identical to the
reference ``_quantize_impl`` in every scale mode and rounding, special values included.

Runs the kernel in the Pallas interpreter on CPU. Tile 4 x 64 on [6, 96]-shaped inputs so row
and column edges (masked loads and stores) are exercised.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_mxfp4.kernels.quantize import QuantizeConfig, fast_path_enabled, quantize_impl
from jax_mxfp4.quantize import _quantize_impl

CFG = QuantizeConfig(rows=4, cols=64)


def _special_input(seed, dtype):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((6, 96)) * np.exp2(rng.integers(-30, 30, size=(6, 3, 1))).repeat(32, 1).reshape(6, 3, 32).reshape(6, 96)
    x = x.astype(np.float32)
    x[0, :32] = 0.0  # all-zero block
    x[1, 5] = np.nan  # NaN block
    x[1, 40] = np.inf  # Inf block
    x[2, 64:96] = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, -0.25, -0.75, -2.5] + [0.1] * 20)
    x[3, :32] = np.float32(1e-40)  # float32 subnormals (flushed)
    x[3, 32:64] = np.float32(3e38)  # near the top of float32
    x[4, 64:96] = -0.0
    return jnp.asarray(x).astype(dtype)


def _same_bits(a, b):
    ua = np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8))
    ub = np.asarray(jax.lax.bitcast_convert_type(b, jnp.uint8))
    np.testing.assert_array_equal(ua, ub)


@pytest.mark.parametrize("scale_mode", ["floor", "ceil", "even", "rceil"])
def test_nearest_bit_identical(scale_mode):
    x = _special_input(hash(scale_mode) % 1000, jnp.float32)
    got = quantize_impl(x, None, axis=1, scale_mode=scale_mode, rounding="nearest", interpret=True, cfg=CFG)
    ref = _quantize_impl(x, None, axis=1, scale_mode=scale_mode, rounding="nearest")
    _same_bits(got[0], ref[0])
    _same_bits(got[1], ref[1])


@pytest.mark.parametrize("dtype,axis", [(jnp.bfloat16, 0), (jnp.float16, 1)])
def test_half_inputs_and_other_axis(dtype, axis):
    x = _special_input(5, jnp.float32)
    x = jnp.where(jnp.isfinite(x), jnp.clip(x, -6e4, 6e4), x).astype(dtype)
    x = x.T.reshape(96, 6) if axis == 0 else x
    x = jnp.concatenate([x, x], axis=1 - axis) if axis == 0 else x
    got = quantize_impl(x, None, axis=axis, scale_mode="even", rounding="nearest", interpret=True, cfg=CFG)
    ref = _quantize_impl(x, None, axis=axis, scale_mode="even", rounding="nearest")
    _same_bits(got[0], ref[0])
    _same_bits(got[1], ref[1])


def test_stochastic_bit_identical():
    x = _special_input(9, jnp.float32).reshape(2, 3, 96)
    key = jax.random.key(123)
    got = quantize_impl(x, key, axis=2, scale_mode="rceil", rounding="stochastic", interpret=True, cfg=CFG)
    ref = _quantize_impl(x, key, axis=2, scale_mode="rceil", rounding="stochastic")
    _same_bits(got[0], ref[0])
    _same_bits(got[1], ref[1])


def test_fast_path_only_on_gpus(monkeypatch):
    assert not fast_path_enabled("cpu")
    assert fast_path_enabled("cuda") and fast_path_enabled("rocm")
    assert not fast_path_enabled("cuda", "stochastic")
    monkeypatch.setenv("JAX_MXFP4_FAST_QUANTIZE", "0")
    assert not fast_path_enabled("cuda")


def test_config_validation():
    with pytest.raises(ValueError):
        QuantizeConfig(cols=96)
    with pytest.raises(ValueError):
        QuantizeConfig(rows=3)
