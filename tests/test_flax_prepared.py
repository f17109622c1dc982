"""Flax layers with prepared kernels: ``quantize_params(..., prepare="decode")`` gives
DecodePrepared kernels (and ``prepare_fp8`` FP8Prepared ones) that the linen Dense/DenseGeneral/
Einsum and nnx Linear/Einsum layers use as is, with outputs bit-identical to the plain MXFP4Array
kernels (2-D, batch-dim and scanned/vmapped stacks, under jit), matching a NumPy float64 reference
decoded from the prepared bytes; bad kernels and bad ``prepare`` values are refused by name."""

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
from mx_reference import dequantize_ref, natural_from_stored, qdq, unpack_ref  # noqa: E402

XLA = mx.Recipe(backend="xla", grad_rounding="nearest")
IS_Q = lambda x: isinstance(x, (mx.MXFP4Array, mx.DecodePrepared, mx.FP8Prepared))  # noqa: E731


def rnd(rng, shape, dtype=jnp.float32):
    return jnp.asarray(rng.standard_normal(shape), dtype)


def kinds(tree):
    return [type(leaf).__name__ for leaf in jax.tree_util.tree_leaves(tree, is_leaf=IS_Q) if IS_Q(leaf)]


def as_fp8(tree):
    """Every MXFP4Array leaf converted by prepare_fp8 (what a user of backend "fp8" would serve)."""
    return jax.tree_util.tree_map(lambda x: mx.prepare_fp8(x) if isinstance(x, mx.MXFP4Array) else x, tree,
                                  is_leaf=IS_Q)


def bitwise_equal(a, b):
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


# ------------------------------------------------------------------------------------ linen
LINEN_CASES = {
    # name: (module, input shape); K = 50 or 64 (50: quantize_params pads it to 64)
    "Dense_K50": (lambda: mxf.linen.Dense(24, recipe=XLA), (3, 5, 50)),
    "DenseGeneral_features2": (lambda: mxf.linen.DenseGeneral((4, 8), recipe=XLA), (6, 64)),
    "DenseGeneral_axis0": (lambda: mxf.linen.DenseGeneral(16, axis=0, recipe=XLA), (64, 3)),
    "DenseGeneral_batch_dims": (lambda: mxf.linen.DenseGeneral(16, batch_dims=(0,), recipe=XLA), (2, 5, 64)),
    "Einsum_K50": (lambda: mxf.linen.Einsum((50, 4, 16), "bk,khn->bhn", recipe=XLA), (7, 50)),
    "Einsum_K_middle": (lambda: mxf.linen.Einsum((4, 64, 12), "bsk,hkn->bshn", use_bias=False, recipe=XLA), (2, 3, 64)),
}


@pytest.mark.sweep(keep=1)
@pytest.mark.parametrize("case", sorted(LINEN_CASES))
def test_linen_layers_prepared_kernels_are_bit_identical(case, rng):
    make, xshape = LINEN_CASES[case]
    model, x = make(), rnd(rng, xshape)
    v = model.init(jax.random.key(int(rng.integers(1 << 30))), x)
    q = mxf.quantize_params(v, model=model, inputs=(x,))
    qd = mxf.quantize_params(v, model=model, inputs=(x,), prepare="decode")
    assert kinds(q) == ["MXFP4Array"] and kinds(qd) == ["DecodePrepared"]
    kq, kd = q["params"]["kernel"], qd["params"]["kernel"]
    assert (kd.shape, kd.axis) == (kq.shape, kq.axis)
    np.testing.assert_array_equal(kd.to_mxfp4().data, kq.data)  # the same bytes, moved
    want = model.apply(q, x)
    bitwise_equal(model.apply(qd, x), want)
    bitwise_equal(jax.jit(model.apply)(qd, x), want)
    bitwise_equal(model.apply(as_fp8(q), x), want)  # FP8Prepared falls out of the same code


class _Body(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return jax.nn.gelu(mxf.linen.Dense(64, recipe=XLA, name="ff")(x)), None


class _Scanned(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = mxf.linen.Dense(64, recipe=XLA, name="inp")(x)
        body = nn.scan(_Body, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
        y, _ = body(name="stack")(x, None)
        return y


@pytest.mark.slow
def test_linen_scanned_stack_prepared_kernels_are_bit_identical(rng):
    model, x = _Scanned(), rnd(rng, (4, 40))
    v = model.init(jax.random.key(0), x)
    q = mxf.quantize_params(v, model=model, inputs=(x,))
    qd = mxf.quantize_params(v, model=model, inputs=(x,), prepare="decode")
    stack = qd["params"]["stack"]["ff"]["kernel"]
    assert isinstance(stack, mx.DecodePrepared) and (stack.shape, stack.axis) == ((3, 64, 64), 1)
    assert stack.data.shape == (3, 64, 32) and stack.scales.shape == (3, 2, 64)  # [L, N, K/2], [L, K/32, N]
    want = model.apply(q, x)
    bitwise_equal(model.apply(qd, x), want)
    bitwise_equal(jax.jit(model.apply)(qd, x), want)
    bitwise_equal(model.apply(as_fp8(q), x), want)


# -------------------------------------------------------------------------------------- nnx
def _nnx_apply(model, state, x):
    nnx.update(model, state)
    return model(x)


@pytest.mark.parametrize("case", ["Linear", "Einsum"])
def test_nnx_layers_prepared_kernels_are_bit_identical(case, rng):
    rngs = nnx.Rngs(int(rng.integers(1 << 30)))
    if case == "Linear":
        model, x = mxf.nnx.Linear(50, 24, recipe=XLA, rngs=rngs), rnd(rng, (3, 5, 50))
    else:
        model, x = mxf.nnx.Einsum("bk,khn->bhn", (64, 4, 16), (4, 16), recipe=XLA, rngs=rngs), rnd(rng, (7, 64))
    state = nnx.state(model, nnx.Param)
    q = mxf.quantize_params(state, model=model)
    qd = mxf.quantize_params(state, model=model, prepare="decode")
    assert kinds(q) == ["MXFP4Array"] and kinds(qd) == ["DecodePrepared"]
    want = _nnx_apply(model, q, x)
    bitwise_equal(_nnx_apply(model, qd, x), want)
    assert isinstance(model.kernel.get_value(), mx.DecodePrepared)
    bitwise_equal(nnx.jit(lambda m, x: m(x))(model, x), want)
    bitwise_equal(_nnx_apply(model, as_fp8(q), x), want)


class _NnxStack(nnx.Module):
    def __init__(self, rngs):
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return mxf.nnx.Linear(64, 64, recipe=XLA, rngs=rngs)

        self.layers = make(rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def step(layer, x):
            return jax.nn.gelu(layer(x))

        return step(self.layers, x)


def test_nnx_vmapped_stack_prepared_kernels_are_bit_identical(rng):
    model, x = _NnxStack(nnx.Rngs(int(rng.integers(1 << 30)))), rnd(rng, (4, 64))
    state = nnx.state(model, nnx.Param)
    q = mxf.quantize_params(state, model=model)
    qd = mxf.quantize_params(state, model=model, prepare="decode")
    assert kinds(qd) == ["DecodePrepared"]
    k = qd["layers"]["kernel"].get_value() if hasattr(qd["layers"]["kernel"], "get_value") else qd["layers"]["kernel"]
    assert (k.shape, k.axis) == ((3, 64, 64), 1)
    want = _nnx_apply(model, q, x)
    bitwise_equal(_nnx_apply(model, qd, x), want)
    bitwise_equal(nnx.jit(lambda m, x: m(x))(model, x), want)


# ------------------------------------------------------------------------ float64 reference
def test_prepared_kernel_matches_float64_reference_decoded_from_its_bytes(rng):
    """The layer's output against NumPy float64: x's MXFP4 values (a4w4 forward) times the kernel
    decoded from the DecodePrepared's own bytes (data [N, K/2], scales K-major [K/32, N], read with
    the reference unpacker), which must equal the reference quantization of the float kernel."""
    k_in, n = 50, 24
    model, x = mxf.linen.Dense(n, recipe=XLA), rnd(rng, (9, k_in))
    v = model.init(jax.random.key(int(rng.integers(1 << 30))), x)
    v = jax.tree_util.tree_map(lambda a: a + 0.01, v)  # non-zero bias
    qd = mxf.quantize_params(v, prepare="decode")  # default_select: the 2-D kernel along axis 0
    kd = qd["params"]["kernel"]
    assert isinstance(kd, mx.DecodePrepared) and kd.shape == (64, n)
    codes = unpack_ref(natural_from_stored(np.asarray(kd.data), kd.byte_order), 1)  # [N, K]
    scale_bytes = np.asarray(kd.scales).view(np.uint8).T  # K-major [K/32, N] -> [N, K/32]
    w_ref = dequantize_ref(codes, scale_bytes, 1).T  # [K, N] float64
    kernel = np.pad(np.asarray(v["params"]["kernel"], np.float32), ((0, 64 - k_in), (0, 0)))
    np.testing.assert_array_equal(w_ref, qdq(kernel, 0))  # the bytes are the reference quantization
    xp = np.pad(np.asarray(x, np.float32), ((0, 0), (0, 64 - k_in)))
    want = qdq(xp, 1) @ w_ref + np.asarray(v["params"]["bias"], np.float64)
    got = np.asarray(model.apply(qd, x), np.float64)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())


# ---------------------------------------------------------------------- quantize_params rules
def test_prepare_decode_prepares_existing_mxfp4_leaves_and_keeps_prepared_ones(rng):
    model, x = mxf.linen.Dense(16, recipe=XLA), rnd(rng, (2, 64))
    v = model.init(jax.random.key(0), x)
    q = mxf.quantize_params(v)  # e.g. what a checkpoint restores
    qd = mxf.quantize_params(q, prepare="decode")
    assert kinds(qd) == ["DecodePrepared"]
    np.testing.assert_array_equal(qd["params"]["kernel"].to_mxfp4().data, q["params"]["kernel"].data)
    again = mxf.quantize_params(qd, prepare="decode")
    assert again["params"]["kernel"] is qd["params"]["kernel"]
    assert mxf.quantize_params(qd)["params"]["kernel"] is qd["params"]["kernel"]  # prepare=None keeps it
    f8 = as_fp8(q)
    assert mxf.quantize_params(f8, prepare="decode")["params"]["kernel"] is f8["params"]["kernel"]
    # with a model: the prepared kernels are not recorded as float kernels to quantize
    assert mxf.consumed_kernels(model, qd, (x,)) == {}


@pytest.mark.slow
def test_prepare_decode_keeps_rotation_and_scale_rule(rng):
    recipe = mx.Recipe(backend="xla", hadamard=("fprop",), scale_mode="rceil")
    model, x = mxf.linen.Dense(16, recipe=recipe), rnd(rng, (3, 64))
    v = model.init(jax.random.key(1), x)
    q = mxf.quantize_params(v, recipe=recipe)
    qd = mxf.quantize_params(v, recipe=recipe, prepare="decode")
    kq, kd = q["params"]["kernel"], qd["params"]["kernel"]
    assert kd.hadamard == kq.hadamard is not None and kd.scale_mode == "rceil"
    bitwise_equal(model.apply(qd, x), model.apply(q, x))


@pytest.mark.parametrize("bad", ["Decode", "fp8", True, 1, ""])
def test_bad_prepare_value_is_refused(bad):
    v = mxf.linen.Dense(16).init(jax.random.key(0), jnp.ones((1, 64)))
    with pytest.raises(ValueError, match=r"prepare must be one of \(None, 'decode'\)"):
        mxf.quantize_params(v, prepare=bad)


# ------------------------------------------------------------------------------- bad kernels
def _wrong_axis(kernel, axis):
    return mx.prepare_decode(mx.quantize(kernel, axis))


def test_prepared_kernel_along_the_wrong_axis_is_refused_by_name(rng):
    x = rnd(rng, (2, 64))
    w = rnd(rng, (64, 64))
    bad = {"params": {"kernel": _wrong_axis(w, 1), "bias": jnp.zeros((64,))}}
    with pytest.raises(ValueError, match=r"quantized kernel \(DecodePrepared\) must be 2-D \[K, N\] quantized along axis 0"):
        mxf.linen.Dense(64, recipe=XLA).apply(bad, x)
    with pytest.raises(ValueError, match="DenseGeneral: a DecodePrepared kernel must be quantized along the single "
                                         "contraction axis 0.*quantized along axis 1"):
        mxf.linen.DenseGeneral(64, recipe=XLA).apply(bad, x)
    fp8_bad = {"params": {"kernel": mx.prepare_fp8(mx.quantize(w, 1)), "bias": jnp.zeros((64,))}}
    with pytest.raises(ValueError, match="DenseGeneral: an FP8Prepared kernel must be quantized along"):
        mxf.linen.DenseGeneral(64, recipe=XLA).apply(fp8_bad, x)
    with pytest.raises(ValueError, match="DecodePrepared array quantized along axis 1.*single quantized axis"):
        mxf.linen.Einsum((64, 64), "bk,kn->bn", recipe=XLA).apply(bad, x)
    lin = mxf.nnx.Linear(64, 64, recipe=XLA, rngs=nnx.Rngs(0))
    lin.kernel.set_value(_wrong_axis(w, 1))
    with pytest.raises(ValueError, match=r"quantized kernel \(DecodePrepared\) must be 2-D"):
        lin(x)


def test_prepared_kernel_other_mismatches_are_refused_by_name(rng):
    w, x = rnd(rng, (64, 16)), rnd(rng, (2, 64))
    kd = mx.prepare_decode(mx.quantize(w, 0))
    with pytest.raises(ValueError, match="x has K=96 but the DecodePrepared kernel has K=64"):
        mxf.linen.Dense(16, recipe=XLA).apply({"params": {"kernel": kd, "bias": jnp.zeros((16,))}}, rnd(rng, (2, 96)))
    rceil = mx.prepare_decode(mx.quantize(w, 0, scale_mode="rceil"))
    with pytest.raises(ValueError, match=r"kernel: a DecodePrepared quantized with scale_mode='rceil', but this "
                                         r"layer's recipe trains with scale_mode='even'"):
        mxf.linen.Dense(16, recipe=XLA).apply({"params": {"kernel": rceil, "bias": jnp.zeros((16,))}}, x)


def test_prepared_kernel_sliced_along_a_non_leading_dim_is_refused(rng):
    """Only stacks along leading dims (nn.scan/nnx.vmap's default) are re-described per layer;
    children sliced otherwise keep DecodePrepared's own error (never a wrong answer)."""
    kd = mx.prepare_decode(mx.quantize(rnd(rng, (3, 64, 16)), 1))  # data [3, 16, 32], scales [3, 2, 16]
    leaves, treedef = jax.tree_util.tree_flatten(kd)
    sliced = jax.tree_util.tree_unflatten(treedef, [leaf[:, 0] for leaf in leaves])  # a dim-1 slice
    assert mxf.params.quantized_kernel(sliced) is sliced
    with pytest.raises(ValueError, match="batching a DecodePrepared with vmap/scan is not supported"):
        mxf.linen.Dense(16, recipe=XLA).apply({"params": {"kernel": sliced, "bias": jnp.zeros((16,))}}, rnd(rng, (2, 64)))
    with pytest.raises(ValueError, match="batching a DecodePrepared with vmap/scan is not supported"):
        mxf.linen.Einsum((3, 64, 16), "bk,lkn->bln", use_bias=False, recipe=XLA).apply(
            {"params": {"kernel": sliced}}, rnd(rng, (2, 64)))
    per_layer = jax.tree_util.tree_unflatten(treedef, [leaf[1] for leaf in leaves])  # a leading-dim slice
    fixed = mxf.params.quantized_kernel(per_layer)
    assert (fixed.shape, fixed.axis) == ((64, 16), 0)
    np.testing.assert_array_equal(fixed.dequantize(), kd.dequantize()[1])
