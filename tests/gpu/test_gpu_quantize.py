"""The fused quantizer kernel on an NVIDIA GPU against the reference ``_quantize_impl``, bit for
bit: every scale mode and both roundings, float32 and bfloat16 input, blocks along rows (axis 1)
and, for even/nearest, along columns (axis 0), on random data over 80 binades with special
values planted (zero block, NaN, -inf, subnormals, the E2M1 grid's midpoints, near float32 max).
The public ``quantize`` takes this kernel on a GPU for both roundings along the last axis, and the
strided-axis kernel along any other (tested the same way here)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_mxfp4.kernels.quantize_kernel import quantize_impl
from jax_mxfp4.quantize import _quantize_impl

pytestmark = [pytest.mark.gpu, pytest.mark.cuda]


@functools.lru_cache(maxsize=None)
def _input(dname):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((333, 4160)) * np.exp2(rng.integers(-40, 40, size=(333, 130, 1))).repeat(32, -1).reshape(
        333, 4160)
    x = x.astype(np.float32)
    x[0, :32] = 0
    x[1, 7] = np.nan
    x[2, 100] = -np.inf
    x[3, :64] = 1e-40
    x[4, 32:64] = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4)
    x[5, :32] = 3e38
    return jnp.asarray(x) if dname == "float32" else jnp.asarray(x).astype(jnp.bfloat16)


CASES = [(d, mode, rounding, axis) for d in ("float32", "bfloat16") for mode in ("floor", "ceil", "even", "rceil")
         for rounding in ("nearest", "stochastic")
         for axis in ((1, 0) if (mode == "even" and rounding == "nearest") else (1,))]


@pytest.mark.parametrize("dname,mode,rounding,axis", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_fused_quantizer_bit_identical_to_reference(dname, mode, rounding, axis):
    xx = _input(dname)
    xa = xx if axis == 1 else xx[:, :4160 // 32 * 32][:320].T  # axis 0 needs a multiple of 32
    key = jax.random.key(7) if rounding == "stochastic" else None
    got = quantize_impl(xa, key, axis=axis, scale_mode=mode, rounding=rounding)
    ref = _quantize_impl(xa, key, axis=axis, scale_mode=mode, rounding=rounding)
    gb = [np.asarray(jax.lax.bitcast_convert_type(g, jnp.uint8)) for g in got]
    rb = [np.asarray(jax.lax.bitcast_convert_type(r, jnp.uint8)) for r in ref]
    if all(g.shape == r.shape and np.array_equal(g, r) for g, r in zip(gb, rb)):
        return
    detail = {"data_bytes_differing": int(np.sum(gb[0] != rb[0])), "data_bytes": int(gb[0].size),
              "scale_bytes_differing": int(np.sum(gb[1] != rb[1]))}
    if axis == 1 and gb[0].shape == rb[0].shape and (gb[0] != rb[0]).any():
        i, j = map(int, np.argwhere(gb[0] != rb[0])[0])
        detail["first_diff"] = {"row": i, "byte": j, "got": int(gb[0][i, j]), "ref": int(rb[0][i, j]),
                                "x": [float(v) for v in np.asarray(xa[i, 2 * j:2 * j + 2], np.float32)],
                                "scale_byte": int(rb[1][i, 2 * j // 32])}
    pytest.fail(f"fused quantizer differs from the reference: {detail}")


def test_public_quantize_takes_the_fused_path_for_both_roundings():
    from jax_mxfp4.kernels.quantize_kernel import fast_path_enabled
    from jax_mxfp4.platform import current_platform

    platform = current_platform()
    assert fast_path_enabled(platform), platform


STRIDED = [(d, mode, rounding, impl) for d in ("float32", "bfloat16") for mode in ("floor", "ceil", "even", "rceil")
           for rounding, impl in (("nearest", None), ("stochastic", "threefry2x32"), ("stochastic", "rbg"))
           if mode == "even" or impl != "threefry2x32"]


@pytest.mark.parametrize("dname,mode,rounding,impl", STRIDED, ids=["-".join(map(str, c)) for c in STRIDED])
def test_strided_quantizer_bit_identical_to_reference(dname, mode, rounding, impl):
    """The strided-axis kernel (kernels/quantize_columns.py; the public quantize along any axis but
    the last on a GPU: the training passes' X and dY along the tokens, a kernel along K), its
    uniforms generated in the kernel (Threefry, Philox for rbg keys), against the reference."""
    from jax_mxfp4.kernels.quantize_columns import quantize_strided

    xa = _input(dname)[:, :4160 // 32 * 32][:320]  # quantized along axis 0 (320 rows = 10 blocks)
    key = jax.random.key(7, impl=impl) if rounding == "stochastic" else None
    for x, axis in ((xa, 0), (xa.reshape(2, 160, 4160 // 32 * 32 // 2, 2), 1)):
        got = quantize_strided(x, key, axis=axis, scale_mode=mode, rounding=rounding)
        ref = _quantize_impl(x, key, axis=axis, scale_mode=mode, rounding=rounding)
        for g, r, name in zip(got, ref, ("data", "scales")):
            g, r = (np.asarray(jax.lax.bitcast_convert_type(v, jnp.uint8)) for v in (g, r))
            assert g.shape == r.shape and np.array_equal(g, r), f"{name}: {int(np.sum(g != r))} bytes differ (axis {axis})"


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg", "unsafe_rbg"])
def test_fused_fp8_operand_generates_the_reference_uniforms(impl):
    """The fused quantize-to-FP8 kernel with stochastic rounding (the dgrad operand of training:
    dY along N) generates its uniforms in the kernel for threefry keys (Threefry-2x32) and rbg keys
    (Philox-4x32 with PTX mul.hi): bit-identical on the GPU to prepare_fp8 of the reference
    quantize, whose jax.random.uniform is XLA's own draw on this GPU."""
    from jax_mxfp4 import quantize
    from jax_mxfp4.backends import fp8 as fb
    from jax_mxfp4.fp8_prepared import prepare_fp8

    layout = "rows"
    xx = _input("bfloat16")[:320, :4096]
    x3, axis = xx[None], 2
    key = jax.random.key(11, impl=impl)
    got = jax.jit(lambda x, k: fb.fused_operand(x, axis, "even", False, "stochastic", k))(x3, key)
    want = jax.jit(lambda x, k: prepare_fp8(quantize(x, axis, scale_mode="even", rounding="stochastic", key=k)))(x3, key)
    for name in ("codes", "scales", "row_exp", "row_flag"):
        a, b = (np.asarray(jax.lax.bitcast_convert_type(getattr(v, name), jnp.uint8)) if getattr(v, name).dtype.itemsize == 1
                else np.asarray(getattr(v, name)) for v in (got, want))
        assert a.shape == b.shape, name
        np.testing.assert_array_equal(a, b, err_msg=f"{name} ({impl}, {layout})")
