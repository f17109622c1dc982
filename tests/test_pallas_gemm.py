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
from jax_mxfp4.mx_format import (
    as_scale_bytes,
    dequantize_blocks,
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


@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_a4w4_both_sides_large_two_pass_matches_xla_and_nan_block_poisons_its_row(out_dtype, rng):
    """a4w4 with M and N > 128 (no route of "auto"; backend "pallas" named): both operands decoded
    exactly to bfloat16 (192 rows by the decode pass in the interpreter, 144 by the jnp
    dequantization: the pass's 64-row tile does not divide them) and one bfloat16 GEMM with
    float32 accumulation: backend "xla" up to accumulation order; a NaN scale byte poisons
    exactly its output row."""
    m, n, k = 192, 144, 128
    qa = mx.quantize(_rand(rng, (1, m, k)), 2)
    qb = mx.quantize(_rand(rng, (1, n, k)), 2)
    sa = as_scale_bytes(qa.scales).at[0, 5, 2].set(255)
    qa = mx.MXFP4Array(qa.data, sa.view(jnp.float8_e8m0fnu), 2, qa.shape, qa.dtype, qa.scale_mode, "plain")
    d = mx.explain(qa, qb, CANON, preferred_element_type=out_dtype, recipe=PALLAS)
    assert d.backend == "pallas" and d.route.startswith("two-pass a4w4"), d.route
    out = mx.dot_general(qa, qb, CANON, preferred_element_type=out_dtype, recipe=PALLAS)
    ref = mx.dot_general(qa, qb, CANON, preferred_element_type=out_dtype, recipe=XLA)
    assert out.shape == (1, m, n) and out.dtype == out_dtype
    got = np.asarray(out.astype(jnp.float32))
    assert np.isnan(got[0, 5]).all()
    keep = np.delete(np.arange(m), 5)
    da, db = np.abs(np.asarray(mx.dequantize(qa)))[:, keep], np.abs(np.asarray(mx.dequantize(qb)))
    _check(out[:, keep], ref[:, keep], da, db, k, out_dtype)


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
