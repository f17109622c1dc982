"""Backend "pallas" (fused Pallas/Triton MXFP4 GEMM) against backend "xla", on CPU (interpreter).

Bound used throughout: both backends compute every block product exactly (E2M1 x power of two
is exact in bfloat16, bf16 x bf16 exact in float32) and differ only in the order of float32
accumulation, so elementwise |pallas - xla| <= 2 * gamma_K * (|A| . |B|) with
gamma_K = K * 2^-24 (the standard bound for two summation orders), plus one bfloat16 rounding
of each result (one bf16 ulp, <= 2^-7 |ref|) when the output is bfloat16. |A| . |B| uses the exact dequantized
operands. A wrong nibble, scale, tile edge or mask moves results by O(|A| . |B|), far outside.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_mxfp4 as mx
from jax_mxfp4 import dispatch
from jax_mxfp4.kernels.tiled_gemm import TileConfig, default_config, mxfp4_gemm
from jax_mxfp4.mx_format import (
    as_scale_bytes,
    decode_e2m1,
    dequantize_blocks,
    e4m3_bits_from_packed,
    unpack_nibbles,
    e2m1_times_2pow_minus14,
    scale_factors_for_f16_codes,
)

XLA = mx.Recipe(backend="xla")
PALLAS = mx.Recipe(backend="pallas")
CANON = (((2,), (2,)), ((0,), (0,)))


def _rand(rng, shape, dtype=jnp.float32):
    # Mixed magnitudes across blocks so scales differ block to block.
    size = int(np.prod(shape))
    mags = np.exp2(rng.integers(-6, 7, size=-(-size // 32))).repeat(32)[:size].reshape(shape)
    x = rng.standard_normal(shape) * mags
    return jnp.asarray(x, dtype)


def _bound(a_abs, b_abs, k, ref, out_dtype):
    mag = np.einsum("bmk,bnk->bmn", a_abs.astype(np.float64), b_abs.astype(np.float64))
    tol = 2 * k * 2.0**-24 * mag
    if out_dtype == jnp.bfloat16:
        tol = tol + 2.0**-7 * np.abs(ref)
    return tol + 1e-30


def _check(out, ref, a_abs, b_abs, k, out_dtype):
    out = np.asarray(out.astype(jnp.float32), np.float64)
    ref = np.asarray(ref.astype(jnp.float32), np.float64)
    assert np.all(np.isfinite(out)), "non-finite output"
    err = np.abs(out - ref)
    tol = _bound(a_abs, b_abs, k, ref, out_dtype)
    assert np.all(err <= tol), f"max err/tol {np.max(err / tol):.3g}"
    # The check is not vacuous: the bound is far below the result's size.
    assert np.median(tol) < 1e-2 * np.median(np.abs(ref)) + 1e-30


def test_e4m3_code_decode_matches_reference_rule():
    """The FP8-E4M3 decode variant equals decode_e2m1 x 2^-6 for both nibbles of every byte."""
    d = jnp.arange(256, dtype=jnp.uint8)
    codes = unpack_nibbles(d[:, None])
    for bits, col in zip(e4m3_bits_from_packed(d), (0, 1)):
        v = jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn).astype(jnp.float32) * 64
        np.testing.assert_array_equal(np.asarray(v).view(np.uint32), np.asarray(decode_e2m1(codes[:, col])).view(np.uint32))


def test_f16_code_decode_matches_reference_rule():
    """The kernel's table-free decode equals dequantize_blocks for every code x normal byte."""
    codes = jnp.arange(16, dtype=jnp.uint8)
    for lo, hi in ((2, 120), (120, 253)):
        byts = jnp.arange(lo, hi, dtype=jnp.uint8)
        f1, f2 = scale_factors_for_f16_codes(byts)
        got = (e2m1_times_2pow_minus14(codes)[None, :].astype(jnp.float32) * f1[:, None]) * f2[:, None]
        ref = dequantize_blocks(jnp.broadcast_to(codes, (byts.size, 16))[:, None, :], byts[:, None])[:, 0, :]
        np.testing.assert_array_equal(
            np.asarray(got).view(np.uint32), np.asarray(ref).view(np.uint32)
        )
    f1, f2 = scale_factors_for_f16_codes(jnp.array([255], jnp.uint8))
    assert np.isnan(np.asarray(f2)).all()


@pytest.mark.sweep(keep=1)
@pytest.mark.parametrize(
    "batch,m,n,k,cfg,out_dtype,seed",
    [
        (2, 20, 40, 96, TileConfig(bm=16, bn=16, bk=64), jnp.float32, 1),  # K % bk != 0, edges
        (1, 33, 17, 192, TileConfig(bm=32, bn=16, bk=64, split_k=3), jnp.bfloat16, 2),
        (1, 5, 48, 160, TileConfig(bm=32, bn=16, bk=64, decode="e4m3", swap=True), jnp.float32, 4),
    ],
)
def test_a4w4_kernel_matches_xla(batch, m, n, k, cfg, out_dtype, seed):
    rng = np.random.default_rng(seed)
    qa = mx.quantize(_rand(rng, (batch, m, k)), 2)
    qb = mx.quantize(_rand(rng, (batch, n, k)), 2)
    ref = mx.dot_general(qa, qb, CANON, preferred_element_type=out_dtype, recipe=XLA)
    out = mxfp4_gemm(
        (qa.data, as_scale_bytes(qa.scales)), (qb.data, as_scale_bytes(qb.scales)),
        m=m, n=n, k=k, out_dtype=out_dtype, cfg=cfg, interpret=True,
    )
    assert out.shape == (batch, m, n) and out.dtype == out_dtype
    _check(out, ref, np.abs(np.asarray(mx.dequantize(qa))), np.abs(np.asarray(mx.dequantize(qb))), k, out_dtype)


@pytest.mark.parametrize("mx_side", ["rhs", "lhs"])
def test_w4a16_kernel_matches_xla(mx_side):
    rng = np.random.default_rng(7 if mx_side == "rhs" else 8)
    batch, m, n, k = 1, 18, 24, 160
    act = _rand(rng, (batch, m if mx_side == "rhs" else n, k), jnp.bfloat16)
    w = mx.quantize(_rand(rng, (batch, n if mx_side == "rhs" else m, k)), 2)
    wt = (w.data, as_scale_bytes(w.scales))
    cfg = TileConfig(bm=16, bn=16, bk=64, decode="e4m3" if mx_side == "rhs" else "f16",
                     swap=mx_side == "rhs")
    if mx_side == "rhs":
        out = mxfp4_gemm(act, wt, m=m, n=n, k=k, out_dtype=jnp.float32, cfg=cfg, interpret=True)
        a, b = act.astype(jnp.float32), mx.dequantize(w)
    else:
        out = mxfp4_gemm(wt, act, m=m, n=n, k=k, out_dtype=jnp.float32, cfg=cfg, interpret=True)
        a, b = mx.dequantize(w), act.astype(jnp.float32)
    ref = jnp.einsum("bmk,bnk->bmn", a, b, precision="highest")
    _check(out, ref, np.abs(np.asarray(a)), np.abs(np.asarray(b)), k, jnp.float32)


def test_nan_scale_block_gives_nan_rows():
    rng = np.random.default_rng(11)
    qa = mx.quantize(_rand(rng, (1, 16, 64)), 2)
    qb = mx.quantize(_rand(rng, (1, 16, 64)), 2)
    sa = as_scale_bytes(qa.scales).at[0, 3, 1].set(255)
    out = mxfp4_gemm((qa.data, sa), (qb.data, as_scale_bytes(qb.scales)), m=16, n=16, k=64,
                     out_dtype=jnp.float32, cfg=TileConfig(bm=16, bn=16, bk=64), interpret=True)
    out = np.asarray(out)
    assert np.isnan(out[0, 3]).all() and np.isfinite(np.delete(out[0], 3, axis=0)).all()


@pytest.mark.parametrize(
    "dims,lshape,rshape",
    [
        ((((1,), (0,)), ((), ())), (20, 64), (64, 24)),  # NN
        ((((1,), (1,)), ((), ())), (20, 64), (24, 64)),  # NT
        ((((0,), (0,)), ((), ())), (64, 20), (64, 24)),  # TN
        ((((0,), (1,)), ((), ())), (64, 20), (24, 64)),  # TT
    ],
)
def test_dot_general_pallas_all_transposes(dims, lshape, rshape):
    rng = np.random.default_rng(sum(lshape) * 3 + rshape[0])
    lhs = _rand(rng, lshape[::-1]).T if dims[0][0] == (0,) else _rand(rng, lshape)
    rhs = _rand(rng, rshape[::-1]).T if dims[0][1] == (1,) else _rand(rng, rshape)
    ref = mx.dot_general(lhs, rhs, dims, recipe=XLA)
    out = mx.dot_general(lhs, rhs, dims, recipe=PALLAS)
    qa = mx.dequantize(mx.quantize(lhs, dims[0][0][0]))
    qb = mx.dequantize(mx.quantize(rhs, dims[0][1][0]))
    mag = np.abs(np.asarray(jnp.einsum("ik,kj->ij", *(
        (jnp.abs(qa) if dims[0][0] == (1,) else jnp.abs(qa).T),
        (jnp.abs(qb) if dims[0][1] == (0,) else jnp.abs(qb).T)), precision="highest")))
    err = np.abs(np.asarray(out) - np.asarray(ref))
    assert out.shape == ref.shape
    assert np.all(err <= 2 * 64 * 2.0**-24 * mag + 1e-30)


def test_w4a16_through_dot_general_and_recipe():
    rng = np.random.default_rng(21)
    x = _rand(rng, (3, 7, 96), jnp.bfloat16)  # [batch, tokens, K] activation
    w = mx.quantize(_rand(rng, (40, 96)), 1)  # [N, K] weight
    dims = (((2,), (1,)), ((), ()))
    recipe = mx.Recipe(quantize_activations=False)
    d = mx.explain(x, w, dims, recipe=recipe.replace(backend="pallas"))
    assert d.backend == "pallas" and d.problem.lhs_kind == "float"
    out = mx.dot_general(x, w, dims, recipe=recipe.replace(backend="pallas"))
    ref = mx.dot_general(x, w, dims, recipe=recipe.replace(backend="xla"))
    mag = np.einsum("btk,nk->btn", np.abs(np.asarray(x, np.float64)), np.abs(np.asarray(mx.dequantize(w), np.float64)))
    assert out.shape == (3, 7, 40)
    assert np.all(np.abs(np.asarray(out) - np.asarray(ref)) <= 2 * 96 * 2.0**-24 * mag + 1e-30)


def test_float32_activation_rejected_with_reason():
    x = jax.ShapeDtypeStruct((4, 64), jnp.float32)
    w = mx.quantize(jnp.ones((8, 64), jnp.float32), 1)
    recipe = mx.Recipe(quantize_activations=False, backend="pallas")
    with pytest.raises(mx.BackendUnavailableError, match="bfloat16"):
        mx.explain(x, w, (((1,), (1,)), ((), ())), recipe=recipe)


def test_auto_never_picks_pallas_on_cpu():
    assert "pallas" in dispatch._REGISTRY
    assert "cpu" not in dispatch.get_backend("pallas").auto_platforms
    x = jax.ShapeDtypeStruct((16, 64), jnp.float32)
    d = mx.explain(x, x, (((1,), (1,)), ((), ())))
    if dispatch.current_platform() == "cpu":
        assert d.backend != "pallas"


def test_default_config_shapes():
    decode = default_config(16, 8192, 8192, num_sms=132)
    assert decode.swap and decode.bn == 16 and decode.split_k > 1
    assert 8192 % (decode.split_k * decode.bk) == 0
    w4a16 = default_config(16, 8192, 8192, a4w4=False, num_sms=132)
    assert not w4a16.swap and w4a16.bm == 16 and w4a16.split_k > 1
    big = default_config(8192, 8192, 8192)
    assert big.split_k == 1 and big.bm >= 64
    odd = default_config(3, 5, 96)
    assert 96 % odd.bk == 0 or odd.bk == 32
    with pytest.raises(ValueError):
        TileConfig(bm=24)
    with pytest.raises(ValueError):
        TileConfig(decode="lut")


def test_default_config_fills_the_processors_it_is_given():
    from jax_mxfp4.platform import sm_count
    # Split-K grows with the processor count (read from the device unless passed in); the CPU
    # interpreter reports none and is sized as one processor.
    few, many = default_config(16, 8192, 8192, num_sms=8), default_config(16, 8192, 8192, num_sms=528)
    assert few.split_k < many.split_k
    if sm_count() is None:
        assert default_config(16, 8192, 8192) == default_config(16, 8192, 8192, num_sms=1)
