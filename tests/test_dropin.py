"""Drop-in fidelity for a Flax user: dot_general's default output dtype is lax.dot_general's;
quantize_params quantizes only kernels a jax_mxfp4 GEMM consumes (along the axis it contracts,
scanned layers per layer), leaves the rest float and refuses explicit requests it cannot serve;
nnx.Linear refuses dot_general; np/jnp.asarray on an MXFP4Array point to dequantize."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

flax = pytest.importorskip("flax")
import flax.linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

import jax_mxfp4 as mx  # noqa: E402
import jax_mxfp4.flax as mxf  # noqa: E402

DN = (((1,), (0,)), ((), ()))


def rnd(rng, shape, dtype=jnp.float32):
    return jnp.asarray(rng.standard_normal(shape), dtype)


@pytest.mark.sweep(keep=1)
@pytest.mark.parametrize("ldt,rdt", [(jnp.bfloat16, jnp.bfloat16), (jnp.float16, jnp.float16),
                                     (jnp.bfloat16, jnp.float32), (jnp.float32, jnp.float32),
                                     (jnp.bfloat16, jnp.float16)])
def test_default_output_dtype_is_lax_dot_generals(ldt, rdt, rng):
    a, b = rnd(rng, (4, 64), ldt), rnd(rng, (64, 8), rdt)
    want = jax.lax.dot_general(a, b, DN).dtype
    assert mx.dot_general(a, b, DN).dtype == want
    assert jax.grad(lambda a: mx.dot_general(a, b, DN).astype(jnp.float32).sum())(a).dtype == a.dtype
    q = mx.quantize(b, axis=0)  # an MXFP4Array counts as its logical dtype
    assert mx.dot_general(a, q, DN).dtype == want
    # the value is the float32 accumulator rounded once to the output dtype
    f32 = mx.dot_general(a, b, DN, preferred_element_type=jnp.float32)
    np.testing.assert_array_equal(mx.dot_general(a, b, DN), f32.astype(want))


def test_flax_dense_with_mxfp4_dot_general_keeps_bf16_like_flax(rng):
    x = rnd(rng, (2, 64), jnp.bfloat16)
    plain = nn.Dense(32, dtype=jnp.bfloat16)
    ours = nn.Dense(32, dtype=jnp.bfloat16, dot_general=mx.dot_general)
    p = plain.init(jax.random.key(0), x)
    assert plain.apply(p, x).dtype == ours.apply(p, x).dtype == jnp.bfloat16


def test_asarray_on_mxfp4array_points_to_dequantize(rng):
    q = mx.quantize(rnd(rng, (4, 64)))
    for conv in (np.asarray, np.array, jnp.asarray, jnp.array):
        with pytest.raises(TypeError, match="dequantize"):
            conv(q)
    # the parts are still reachable and jit/tree operations unaffected
    assert np.asarray(q.data).dtype == np.uint8
    np.testing.assert_array_equal(jax.jit(mx.dequantize)(q), mx.dequantize(q))


def test_grad_wrt_mxfp4array_with_allow_int_gives_the_clear_error(rng):
    q = mx.quantize(rnd(rng, (64, 8)), axis=0)
    x = rnd(rng, (2, 64))
    with pytest.raises(ValueError, match="inference only"):
        jax.grad(lambda q: mx.dot_general(x, q, DN).sum(), allow_int=True)(q)


def test_nnx_linear_refuses_dot_general():
    for kw in ("dot_general", "dot_general_cls"):
        with pytest.raises(TypeError, match=kw):
            mxf.nnx.Linear(64, 8, rngs=nnx.Rngs(0), **{kw: (mx.dot_general if kw == "dot_general" else object)})


class _Body(nn.Module):
    @nn.compact
    def __call__(self, c, _):
        return jax.nn.gelu(mxf.linen.Dense(64, name="ff")(c)), None


class Mixed2(nn.Module):
    """Every kernel kind quantize_params must tell apart (comments: what it should do)."""

    @nn.compact
    def __call__(self, x):
        y = mxf.linen.Dense(64, name="mx_dense")(x)                                   # axis 0
        y = y + nn.Dense(64, dot_general=mx.dot_general, name="flax_dense_mx")(x)    # Flax's: float
        y = y + nn.Dense(64, name="flax_dense")(x)                                    # float
        y = y + mxf.linen.DenseGeneral((2, 32), name="mx_dg")(x).reshape(x.shape[0], 64)  # axis 0
        y = y + mxf.linen.Einsum((64, 4, 16), "bk,khn->bhn", use_bias=False, name="mx_es")(x).reshape(-1, 64)
        y = y + mxf.linen.DenseGeneral(16, axis=(-2, -1), name="mx_dg2")(x.reshape(-1, 2, 32)).repeat(4, -1)  # 2 axes: float
        body = nn.scan(_Body, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
        y, _ = body(name="stack")(y, None)                                            # stacked: axis 1
        c = nn.Conv(8, (3, 3), name="conv")(y.reshape(-1, 8, 8, 1))                   # float
        return c.sum(axis=(1, 2, 3))


@pytest.mark.slow
def test_quantize_params_with_model_selects_exactly_and_apply_works(rng):
    x = rnd(rng, (4, 64))
    model = Mixed2()
    v = model.init(jax.random.key(0), x)
    q = mxf.quantize_params(v, model=model, inputs=(x,))
    qp, vp = q["params"], v["params"]
    want_axis = {("mx_dense", "kernel"): 0, ("mx_dg", "kernel"): 0, ("mx_es", "kernel"): 0,
                 ("stack", "ff", "kernel"): 1}
    flat = jax.tree_util.tree_flatten_with_path(qp, is_leaf=lambda l: isinstance(l, mx.MXFP4Array))[0]
    got_axis = {tuple(k.key for k in path): leaf.axis for path, leaf in flat if isinstance(leaf, mx.MXFP4Array)}
    assert got_axis == want_axis
    # everything else is untouched, bit for bit
    for path in (("flax_dense_mx", "kernel"), ("flax_dense", "kernel"), ("conv", "kernel"), ("mx_dg2", "kernel")):
        a, b = qp, vp
        for k in path:
            a, b = a[k], b[k]
        assert a is b
    # per layer of the scanned stack: the same bytes as quantizing that layer's kernel alone
    stacked = qp["stack"]["ff"]["kernel"]
    for i in range(3):
        one = mx.quantize(vp["stack"]["ff"]["kernel"][i], axis=0)
        np.testing.assert_array_equal(stacked.data[i], one.data)
        np.testing.assert_array_equal(stacked.scales[i].view(jnp.uint8), one.scales.view(jnp.uint8))
    # and the quantized model runs (Flax accepts every MXFP4Array it was given)
    y_q, y_f = model.apply(q, x), model.apply(v, x)
    assert y_q.shape == y_f.shape and bool(jnp.all(jnp.isfinite(y_q)))


def test_quantize_params_without_model_leaves_non_2d_kernels_float(rng):
    x = rnd(rng, (4, 64))
    model = Mixed2()
    v = model.init(jax.random.key(0), x)
    q = mxf.quantize_params(v)
    for path in (("conv", "kernel"), ("stack", "ff", "kernel"), ("mx_es", "kernel"), ("mx_dg", "kernel")):
        a = q["params"]
        for k in path:
            a = a[k]
        assert not isinstance(a, mx.MXFP4Array), path


def test_quantize_params_explicit_requests_it_cannot_serve(rng):
    x = rnd(rng, (4, 64))
    model = Mixed2()
    v = model.init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="conv/kernel.*no jax_mxfp4 layer"):
        mxf.quantize_params(v, model=model, inputs=(x,), select=lambda p, l: 0 if p[-2:] == ("conv", "kernel") else None)
    with pytest.raises(ValueError, match="stack/ff/kernel along axis 0.*contracts axis 1"):
        mxf.quantize_params(v, model=model, inputs=(x,), select=lambda p, l: 0 if p[-2:] == ("ff", "kernel") else None)
    with pytest.raises(ValueError, match="mx_dg2/kernel.*several"):
        mxf.quantize_params(v, model=model, inputs=(x,), select=lambda p, l: 0 if p[-2:] == ("mx_dg2", "kernel") else None)
    # a valid explicit request goes through
    q = mxf.quantize_params(v, model=model, inputs=(x,), select=lambda p, l: 1 if p[-2:] == ("ff", "kernel") else None)
    assert q["params"]["stack"]["ff"]["kernel"].axis == 1


def test_quantize_params_nnx_model_leaves_flax_layers_float(rng):
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.ours = mxf.nnx.Linear(64, 64, rngs=rngs)
            self.lin_mx = nnx.Linear(64, 64, dot_general=mx.dot_general, rngs=rngs)
            self.mha = nnx.MultiHeadAttention(2, 64, decode=False, rngs=rngs)
            self.es = nnx.Einsum("bk,kn->bn", (64, 64), rngs=rngs)
            self.es_mx = mxf.nnx.Einsum("bk,kn->bn", (64, 64), rngs=rngs)

        def __call__(self, x):
            y = self.ours(x) + self.lin_mx(x) + self.es(x) + self.es_mx(x)
            return self.mha(y[:, None, :])[:, 0]

    net = Net(nnx.Rngs(0))
    x = rnd(rng, (2, 64))
    state = nnx.state(net, nnx.Param)
    q = mxf.quantize_params(state, model=net)
    nnx.update(net, q)
    kinds = {n: isinstance(getattr(net, n).kernel.get_value(), mx.MXFP4Array) for n in ("ours", "lin_mx", "es", "es_mx")}
    assert kinds == {"ours": True, "lin_mx": False, "es": False, "es_mx": True}
    assert not isinstance(net.mha.query.kernel.get_value(), mx.MXFP4Array)
    assert net(x).shape == (2, 64)
