"""dot_general vs the float64 reference: NN/NT/TN/TT, batch dims, MXFP4Array operands, w4a16,
output dtypes, backends, and errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_mxfp4 as mx
from mx_reference import dequantize_ref, quantize_ref

MODES = ["floor", "ceil", "even", "rceil"]


def ref_operand(x, contracting_axis, mode):
    codes, sb = quantize_ref(np.asarray(x, np.float32), contracting_axis, mode)
    return dequantize_ref(codes, sb, contracting_axis)


def check_close(out, lhs64, rhs64, dims, k):
    """Relative Frobenius error < 1e-6 and the rigorous float32 accumulation bound per element."""
    ref = np.asarray(_np_dot_general(lhs64, rhs64, dims))
    mag = np.asarray(_np_dot_general(np.abs(lhs64), np.abs(rhs64), dims))
    out = np.asarray(out, np.float64)
    assert out.shape == ref.shape
    rel = np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-300)
    assert rel < 1e-6, rel
    assert (np.abs(out - ref) <= k * 2.0**-24 * mag + 1e-30).all()


def _np_dot_general(a, b, dims):
    (lc, rc), (lb, rb) = dims
    letters = iter("abcdefghijklmnopqrstuvwxyz")
    la = [next(letters) for _ in range(a.ndim)]
    ra = [next(letters) for _ in range(b.ndim)]
    for i, j in zip(lc, rc):
        ra[j] = la[i]
    for i, j in zip(lb, rb):
        ra[j] = la[i]
    out = [la[i] for i in lb] + [la[i] for i in range(a.ndim) if i not in lc and i not in lb]
    out += [ra[j] for j in range(b.ndim) if j not in rc and j not in rb]
    return np.einsum(f"{''.join(la)},{''.join(ra)}->{''.join(out)}", a, b)


# (lhs shape, rhs shape, dimension_numbers): NN, NT, TN, TT and batched forms
CASES = {
    "NN": ((24, 96), (96, 40), (((1,), (0,)), ((), ()))),
    "NT": ((24, 96), (40, 96), (((1,), (1,)), ((), ()))),
    "TN": ((96, 24), (96, 40), (((0,), (0,)), ((), ()))),
    "TT": ((96, 24), (40, 96), (((0,), (1,)), ((), ()))),
    "batch": ((3, 24, 64), (3, 64, 17), (((2,), (1,)), ((0,), (0,)))),
    "batch-mid": ((5, 3, 64), (64, 3, 7), (((2,), (0,)), ((1,), (1,)))),
    "free-dims": ((2, 5, 64), (64, 4, 3), (((2,), (0,)), ((), ()))),
}


@pytest.mark.sweep(keep=6)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mode", MODES)
def test_float_operands_vs_float64_reference(case, mode, rng):
    ls, rs, dims = CASES[case]
    (lc, rc), _ = dims
    ka, kb = jax.random.split(jax.random.key(rng.integers(1 << 30)))
    lhs = jax.random.normal(ka, ls)
    rhs = jax.random.normal(kb, rs)
    out = jax.jit(lambda a, b: mx.dot_general(a, b, dims, recipe=mx.Recipe(scale_mode=mode)))(lhs, rhs)
    assert out.dtype == jnp.float32
    check_close(out, ref_operand(lhs, lc[0], mode), ref_operand(rhs, rc[0], mode), dims, ls[lc[0]])


@pytest.mark.parametrize("case", ["NN", "TT", "batch"])
def test_mxfp4array_operands(case, rng):
    ls, rs, dims = CASES[case]
    (lc, rc), _ = dims
    lhs = jnp.asarray(rng.standard_normal(ls), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal(rs), jnp.float32)
    lq = mx.quantize(lhs, axis=lc[0], scale_mode="rceil")
    rq = mx.quantize(rhs, axis=rc[0], scale_mode="floor", scale_layout="swizzled")
    out = mx.dot_general(lq, rq, dims)
    check_close(out, ref_operand(lhs, lc[0], "rceil"), ref_operand(rhs, rc[0], "floor"), dims, ls[lc[0]])
    # mixing a pre-quantized operand with a float one quantizes the float one with the recipe
    mixed = mx.dot_general(lq, rhs, dims, recipe=mx.Recipe(scale_mode="even"))
    check_close(mixed, ref_operand(lhs, lc[0], "rceil"), ref_operand(rhs, rc[0], "even"), dims, ls[lc[0]])


def test_multiple_contracting_dims_flatten_into_one_k(rng):
    lhs = rng.standard_normal((6, 4, 16)).astype(np.float32)
    rhs = rng.standard_normal((4, 16, 5)).astype(np.float32)
    dims = (((1, 2), (0, 1)), ((), ()))
    out = mx.dot_general(jnp.asarray(lhs), jnp.asarray(rhs), dims)
    l64 = ref_operand(lhs.reshape(6, 64), 1, "even")
    r64 = ref_operand(rhs.reshape(64, 5), 0, "even")
    check_close(out, l64, r64, (((1,), (0,)), ((), ())), 64)


@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float16])
def test_output_dtypes(out_dtype, rng):
    ls, rs, dims = CASES["NT"]
    lhs, rhs = rng.standard_normal(ls).astype(np.float32), rng.standard_normal(rs).astype(np.float32)
    out = mx.dot_general(jnp.asarray(lhs), jnp.asarray(rhs), dims, preferred_element_type=out_dtype)
    assert out.dtype == jnp.dtype(out_dtype)
    ref = _np_dot_general(ref_operand(lhs, 1, "even"), ref_operand(rhs, 1, "even"), dims)
    # one rounding to the output dtype: relative half-ulp (bf16 2^-9, f16 2^-11) plus accumulation
    eps = 2.0**-8 if out_dtype == jnp.bfloat16 else 2.0**-10
    np.testing.assert_allclose(np.asarray(out, np.float64), ref, rtol=eps, atol=1e-3)


def test_w4a16_keeps_the_float_operand_unquantized(rng):
    x = jnp.asarray(rng.standard_normal((8, 64)), jnp.bfloat16)
    w = rng.standard_normal((64, 16)).astype(np.float32)
    wq = mx.quantize(jnp.asarray(w), axis=0)
    dims = (((1,), (0,)), ((), ()))
    out = mx.dot_general(x, wq, dims, recipe=mx.Recipe(quantize_activations=False))
    check_close(out, np.asarray(x, np.float64), ref_operand(w, 0, "even"), dims, 64)
    a4w4 = mx.dot_general(x, wq, dims)
    assert not np.array_equal(np.asarray(out), np.asarray(a4w4))  # activations really were quantized there


def test_scaled_dot_backend_agrees_with_xla(rng):
    ls, rs, dims = CASES["batch"]
    lhs, rhs = jnp.asarray(rng.standard_normal(ls), jnp.float32), jnp.asarray(rng.standard_normal(rs), jnp.float32)
    a = mx.dot_general(lhs, rhs, dims, recipe=mx.Recipe(backend="xla"))
    b = mx.dot_general(lhs, rhs, dims, recipe=mx.Recipe(backend="scaled_dot"))
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", mx.available_backends())
def test_jit_with_closed_over_constant_operands(backend):
    """jit of a GEMM whose operands are constants captured by the function (e.g. params closed
    over): XLA constant-folds what it can, and with jaxlib 0.10.2 on CPU a folded uint8 ->
    float4_e2m1fn bitcast gave wrong values (backend "scaled_dot": errors of ~50 on a K=128
    product). Compared with the float64 product of independently quantized operands."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((5, 128)).astype(np.float32)
    w = rng.standard_normal((64, 128)).astype(np.float32)
    dims = (((1,), (1,)), ((), ()))
    ref = ref_operand(x, 1, "even") @ ref_operand(w, 1, "even").T
    xq, wq = mx.quantize(jnp.asarray(x), axis=1), mx.quantize(jnp.asarray(w), axis=1)
    recipe = mx.Recipe(backend=backend)
    for name, f in (
        ("float x constant", jax.jit(lambda b: mx.dot_general(jnp.asarray(x), b, dims, recipe=recipe))),
        ("both MXFP4 constants", jax.jit(lambda: mx.dot_general(xq, wq, dims, recipe=recipe))),
    ):
        out = np.asarray(f(wq) if name == "float x constant" else f(), np.float64)
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-4, err_msg=f"{backend}: {name}")


def test_nan_block_propagates_to_its_outputs_only():
    x = np.ones((4, 64), np.float32)
    x[1, 5] = np.nan
    w = np.ones((64, 3), np.float32)
    out = np.asarray(mx.dot_general(jnp.asarray(x), jnp.asarray(w), (((1,), (0,)), ((), ()))))
    assert np.isnan(out[1]).all() and np.isfinite(out[[0, 2, 3]]).all()
    np.testing.assert_array_equal(out[0], 64.0)


class TestErrors:
    dims = (((1,), (0,)), ((), ()))

    def test_k_not_multiple_of_32(self):
        with pytest.raises(ValueError, match=r"lhs: contracting dim\(s\) \(1,\) have total length 48"):
            mx.dot_general(jnp.ones((4, 48)), jnp.ones((48, 4)), self.dims)

    def test_mxfp4array_quantized_along_wrong_axis(self):
        q = mx.quantize(jnp.ones((64, 32)), axis=0)
        with pytest.raises(ValueError, match="must be quantized along its single contracting dim"):
            mx.dot_general(q, jnp.ones((32, 4)), self.dims)

    def test_mismatched_k(self):
        with pytest.raises(TypeError, match="dot_general requires contracting dimensions to have the same shape"):
            mx.dot_general(jnp.ones((4, 64)), jnp.ones((32, 4)), self.dims)

    def test_integer_operand(self):
        with pytest.raises(TypeError, match="rhs must be a float32, bfloat16 or float16"):
            mx.dot_general(jnp.ones((4, 64)), jnp.ones((64, 4), jnp.int8), self.dims)

    def test_bad_output_dtype(self):
        with pytest.raises(ValueError, match="preferred_element_type must be float32, bfloat16 or float16"):
            mx.dot_general(jnp.ones((4, 64)), jnp.ones((64, 4)), self.dims, preferred_element_type=jnp.int32)

    def test_malformed_dimension_numbers(self):
        with pytest.raises(ValueError, match="dimension_numbers must be"):
            mx.dot_general(jnp.ones((4, 64)), jnp.ones((64, 4)), (1, 0))

    def test_no_contracting_dims(self):
        with pytest.raises(ValueError, match="no contracting dims"):
            mx.dot_general(jnp.ones((4, 64)), jnp.ones((64, 4)), (((), ()), ((), ())))

    def test_bad_recipe(self):
        with pytest.raises(TypeError, match="recipe must be a jax_mxfp4.Recipe"):
            mx.dot_general(jnp.ones((4, 64)), jnp.ones((64, 4)), self.dims, recipe="mxfp4")
        with pytest.raises(ValueError, match="Recipe.scale_mode must be one of"):
            mx.Recipe(scale_mode="nearest")
        with pytest.raises(ValueError, match="Recipe.backend must be one of"):
            mx.Recipe(backend="cuda")


@pytest.mark.parametrize("backend", ["xla", "scaled_dot", "pallas"])
@pytest.mark.parametrize("ls,rs", [((4, 0), (0, 4)), ((0, 32), (32, 4)), ((4, 32), (32, 0))])
def test_empty_operands_give_exact_zeros_or_empty(backend, ls, rs):
    out = mx.dot_general(jnp.ones(ls), jnp.ones(rs), (((1,), (0,)), ((), ())), recipe=mx.Recipe(backend=backend))
    assert out.shape == (ls[0], rs[1])
    assert not np.asarray(out).any()


def test_argument_errors_name_the_argument():
    with pytest.raises(ValueError, match="dimension_numbers must be"):
        mx.dot_general(jnp.ones((4, 64)), jnp.ones((64, 4)), (((1.0,), (0,)), ((), ())))
    with pytest.raises(ValueError, match="preferred_element_type must be"):
        mx.dot_general(jnp.ones((4, 64)), jnp.ones((64, 4)), (((1,), (0,)), ((), ())), preferred_element_type="bogus")
    with pytest.raises(TypeError, match="key must be one PRNG key"):
        mx.quantize(jnp.ones((4, 32)), rounding="stochastic", key=0)
