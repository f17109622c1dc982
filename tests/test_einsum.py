"""jax_mxfp4.einsum: values against a float64 NumPy einsum of the MXFP4-decoded operands
(independent reference: tests/mx_reference.py), gradients against the same contraction written
with dot_general, output dtypes as jnp.einsum's, and the contractions that are not one
dot_general raising clear errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_mxfp4 as mx
from jax_mxfp4.einsum import parse_subscripts

from mx_reference import dequantize_ref, quantize_ref


def qdq_along(x, axes):
    """Decode(quantize(x)) with K = the dims ``axes`` flattened in that order (row-major)."""
    x = np.asarray(x, np.float32)
    rest = [d for d in range(x.ndim) if d not in axes]
    xt = np.transpose(x, rest + list(axes))
    flat = xt.reshape(xt.shape[: len(rest)] + (-1,))
    q = dequantize_ref(*quantize_ref(flat, -1, "even"), -1).reshape(xt.shape)
    return np.transpose(q, np.argsort(rest + list(axes)))


CASES = [
    # subscripts, lhs shape, rhs shape
    ("mk,kn->mn", (8, 64), (64, 12)),
    ("mk,nk->nm", (8, 64), (12, 64)),          # transposed rhs and output
    ("bsd,dh->bsh", (2, 5, 96), (96, 7)),       # Flax Dense-like
    ("bqhd,bkhd->bhqk", (2, 3, 4, 32), (2, 5, 4, 32)),  # attention scores: batch b, h
    ("bhqk,bkhd->bqhd", (2, 4, 3, 32), (2, 32, 4, 8)),  # attention values: K = keys
    ("btnh,nhd->btd", (2, 3, 4, 16), (4, 16, 24)),      # two contracting letters: K = n*h = 64
    ("...k,kn->...n", (2, 3, 64), (64, 5)),
    ("ik,jk", (6, 32), (3, 32)),                # implicit output "ij"
]


@pytest.mark.sweep(keep=2)
@pytest.mark.parametrize("subscripts,ls,rs", CASES)
def test_values_match_float64_reference(subscripts, ls, rs, rng):
    a = rng.standard_normal(ls).astype(np.float32)
    b = rng.standard_normal(rs).astype(np.float32)
    (lc, rc), _ = parse_subscripts(subscripts, len(ls), len(rs))[0]
    want = np.einsum(subscripts, qdq_along(a, lc).astype(np.float64), qdq_along(b, rc).astype(np.float64))
    got = mx.einsum(subscripts, jnp.asarray(a), jnp.asarray(b))
    assert got.shape == want.shape == jnp.einsum(subscripts, a, b).shape
    assert got.dtype == jnp.float32
    bound = 1e-5 * np.einsum(subscripts, np.abs(qdq_along(a, lc)), np.abs(qdq_along(b, rc))) + 1e-30
    assert np.all(np.abs(np.asarray(got, np.float64) - want) <= bound)


def test_gradients_equal_the_dot_general_form(rng):
    a = jnp.asarray(rng.standard_normal((2, 3, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((64, 4, 8)), jnp.float32)
    f_es = lambda a, w: (mx.einsum("bsd,dnh->bsnh", a, w) ** 2).sum()  # noqa: E731
    f_dg = lambda a, w: (mx.dot_general(a, w, (((2,), (0,)), ((), ()))) ** 2).sum()  # noqa: E731
    ga, gw = jax.grad(f_es, argnums=(0, 1))(a, w)
    ha, hw = jax.grad(f_dg, argnums=(0, 1))(a, w)
    np.testing.assert_array_equal(ga, ha)
    np.testing.assert_array_equal(gw, hw)
    # and the transposed-output case: gradient flows back through the output permutation
    g1 = jax.grad(lambda w: (mx.einsum("mk,nk->nm", a[0], w[:, 0, :].T) * jnp.arange(3.0)[None]).sum())(w)
    g2 = jax.grad(lambda w: (mx.dot_general(a[0], w[:, 0, :].T, (((1,), (1,)), ((), ()))).T * jnp.arange(3.0)[None]).sum())(w)
    np.testing.assert_array_equal(g1, g2)


def test_output_dtype_follows_jnp_einsum_and_mxfp4_operands(rng):
    a = jnp.asarray(rng.standard_normal((4, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((64, 8)), jnp.bfloat16)
    assert mx.einsum("mk,kn->mn", a, w).dtype == jnp.bfloat16 == jnp.einsum("mk,kn->mn", a, w).dtype
    assert mx.einsum("mk,kn->mn", a, w.astype(jnp.float32)).dtype == jnp.float32
    assert mx.einsum("mk,kn->mn", a, w, preferred_element_type=jnp.float32).dtype == jnp.float32
    q = mx.quantize(w.astype(jnp.float32), axis=0)
    got = mx.einsum("mk,kn->nm", a.astype(jnp.float32), q)
    want = mx.dot_general(a.astype(jnp.float32), q, (((1,), (0,)), ((), ()))).T
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("subscripts,ls,rs,match", [
    ("mk,kn,np->mp", (4, 32), (32, 4), "exactly two operands"),
    ("mkj,kn->mn", (4, 32, 2), (32, 4), "summed over one operand"),
    ("mk,kn->mnk", (4, 32), (32, 4), "contracts no letter"),
    ("mn,kn->mnk", (4, 32), (32, 32), "neither operand|contracts no letter"),
    ("kk,kn->n", (32, 32), (32, 4), "appears twice"),
    ("mk,kn->mm", (4, 32), (32, 4), "appears twice in the output"),
    ("mk,kn->mn", (4, 32, 1), (32, 4), "has rank 3"),
    ("m1,1n->mn", (4, 32), (32, 4), "letters"),
])
def test_clear_errors(subscripts, ls, rs, match):
    with pytest.raises(ValueError, match=match):
        mx.einsum(subscripts, jnp.ones(ls), jnp.ones(rs))


def test_k_not_multiple_of_32_and_bad_operands():
    with pytest.raises(ValueError, match="multiple of the MXFP4 block size"):
        mx.einsum("mk,kn->mn", jnp.ones((2, 40)), jnp.ones((40, 3)))
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        mx.einsum("mk,kn->mn", jnp.ones((2, 32), jnp.int32), jnp.ones((32, 3)))
    with pytest.raises(TypeError, match="subscripts must be a str"):
        mx.einsum(3, jnp.ones((2, 32)), jnp.ones((32, 3)))


def test_einsum_precision_key_and_letter_sizes():
    """einsum honours precision like dot_general (a bad value or an impossible contract is an
    error, never silently ignored), takes a rounding key, and names a letter whose sizes differ."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 64)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(1).standard_normal((64, 8)), jnp.float32)
    with pytest.raises(ValueError, match="precision"):
        mx.einsum("bk,kn->bn", x, w, precision="ultra")
    with pytest.raises(mx.BackendUnavailableError, match="HIGHEST"):
        mx.einsum("bk,kn->bn", x, w, precision="highest", recipe=mx.Recipe(backend="fp8"))
    with pytest.raises(ValueError, match="letter 'k' has size 64 in lhs but 32 in rhs"):
        mx.einsum("bk,kn->bn", x, w[:32])
    loss = lambda a, k: (mx.einsum("bk,kn->bn", a, w, key=k) ** 2).sum()  # noqa: E731
    g1 = jax.grad(loss)(x, jax.random.key(1))
    g2 = jax.grad(loss)(x, jax.random.key(2))
    g1b = jax.grad(loss)(x, jax.random.key(1))
    np.testing.assert_array_equal(g1, g1b)  # reproducible from the key
    assert not np.array_equal(g1, g2)  # and the key is used (stochastic rounding of dY)


@pytest.mark.sweep(keep=1)
@pytest.mark.parametrize("subscripts,ls,rs", [
    ("btnh,bsnh->bnts", (2, 8, 4, 32), (2, 8, 1, 32)),  # MQA: one key head broadcast over four query heads
    ("bnts,bsnh->btnh", (2, 1, 8, 32), (2, 32, 4, 16)),  # the size-1 letter in lhs
    ("btk,bsk->bts", (1, 8, 32), (3, 8, 32)),           # the batch letter itself of size 1 in lhs
])
def test_size1_batch_letter_broadcasts_like_jnp_einsum(subscripts, ls, rs, rng):
    a = rng.standard_normal(ls).astype(np.float32)
    b = rng.standard_normal(rs).astype(np.float32)
    (lc, rc), _ = parse_subscripts(subscripts, len(ls), len(rs))[0]
    qa, qb = qdq_along(a, lc), qdq_along(b, rc)
    want = np.einsum(subscripts, qa, qb)  # NumPy broadcasts size-1 letters too
    got = mx.einsum(subscripts, jnp.asarray(a), jnp.asarray(b))
    assert got.shape == want.shape == jnp.einsum(subscripts, a, b).shape
    bound = 1e-5 * np.einsum(subscripts, np.abs(qa), np.abs(qb)) + 1e-30
    assert np.all(np.abs(np.asarray(got, np.float64) - want) <= bound)
    # the gradient of the broadcast operand is summed over the broadcast letter (the size-1 shape)
    ga, gb = jax.grad(lambda a, b: (mx.einsum(subscripts, a, b) ** 2).sum(), argnums=(0, 1))(jnp.asarray(a), jnp.asarray(b))
    assert ga.shape == ls and gb.shape == rs and bool(jnp.isfinite(ga).all() & jnp.isfinite(gb).all())


def test_mqa_broadcast_equals_the_squeezed_contraction(rng):
    """Broadcasting one kv head is the contraction with that head squeezed out (values and gradients)."""
    q = jnp.asarray(rng.standard_normal((2, 8, 4, 32)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((2, 8, 1, 32)), jnp.float32)
    f = lambda q, k: (mx.einsum("btnh,bsnh->bnts", q, k) ** 2).sum()  # noqa: E731
    g = lambda q, k: (mx.einsum("btnh,bsh->bnts", q, k[:, :, 0]) ** 2).sum()  # noqa: E731
    np.testing.assert_array_equal(f(q, k), g(q, k))
    (gq, gk), (hq, hk) = jax.grad(f, argnums=(0, 1))(q, k), jax.grad(g, argnums=(0, 1))(q, k)
    np.testing.assert_array_equal(gq, hq)
    np.testing.assert_array_equal(gk, hk)


@pytest.mark.parametrize("subscripts,ls,rs,match", [
    ("bk,kn->bn", (2, 32), (1, 8), "letter 'k' has size 32 in lhs but 1 in rhs: a contracted letter of size 1"),
    ("btnh,bsnh->bnts", (2, 8, 4, 32), (2, 8, 2, 32), "letter 'n' has size 4 in lhs but 2 in rhs"),
])
def test_broadcast_refusals_name_the_letter(subscripts, ls, rs, match):
    with pytest.raises(ValueError, match=match):
        mx.einsum(subscripts, jnp.ones(ls), jnp.ones(rs))


def test_quantized_operand_is_not_broadcast(rng):
    w = mx.quantize(jnp.asarray(rng.standard_normal((1, 64, 8)), jnp.float32), axis=1)
    with pytest.raises(ValueError, match="letter 'n' has size 4 in lhs but 1 in rhs: rhs is a quantized MXFP4Array"):
        mx.einsum("bnk,nkf->bnf", jnp.ones((2, 4, 64)), w)


def test_flax_einsum_layer_broadcasts_a_size1_kernel_letter(rng):
    import jax_mxfp4.flax as mxf

    x = jnp.asarray(rng.standard_normal((2, 4, 64)), jnp.float32)
    layer = mxf.linen.Einsum((1, 64, 32), "bnd,ndh->bnh", use_bias=False)  # one kernel shared by 4 heads
    p = layer.init(jax.random.key(0), x)
    kernel = p["params"]["kernel"]
    np.testing.assert_array_equal(layer.apply(p, x), mx.einsum("bnd,dh->bnh", x, kernel[0]))
    assert jax.grad(lambda p: (layer.apply(p, x) ** 2).sum())(p)["params"]["kernel"].shape == (1, 64, 32)
