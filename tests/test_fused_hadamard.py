"""The random Hadamard rotation fused into the Pallas quantizer (``hadamard=(block, seed)``) is
bit-identical to the separate exact transform followed by the quantizer; ``quantize_rotated`` and
the training passes route through it on the GPU fast path without changing a bit.

Kernel runs in the Pallas interpreter on CPU. Oracles: the two-pass jnp route
(``random_hadamard_transform`` then the reference ``_quantize_impl``, same bits required) and, for
round-to-nearest, the NumPy float32 twin of the transform (``hadamard_transform_ref``) followed by
the NumPy float64 + ml_dtypes quantizer model of tests/mx_reference.py. Plus: the kernel lowers
to a Triton custom call for CUDA (lowering rules only: no GPU here).
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mx_reference as ref
from jax_mxfp4 import training
from jax_mxfp4.hadamard import random_hadamard_transform
from mx_reference import hadamard_transform_ref
from jax_mxfp4.kernels import quantize_kernel as fused
from jax_mxfp4.kernels.quantize_kernel import QuantizeConfig, quantize_2d, quantize_impl
from jax_mxfp4.quantize import _quantize_impl, quantize, quantize_rotated
from jax_mxfp4.recipe import Recipe

quantize_mod = importlib.import_module("jax_mxfp4.quantize")  # the module (the package exports the function)
MODES = ["floor", "ceil", "even", "rceil"]
BLOCKS = [32, 64, 128, 256]
CFG = QuantizeConfig(rows=4, cols=64, num_warps=4)  # narrower than every block but 32: widened


def _bits(a):
    return np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8))


def _same(got, want):
    np.testing.assert_array_equal(_bits(got[0]), _bits(want[0]))
    np.testing.assert_array_equal(_bits(got[1]), _bits(want[1]))


def _input(rng, rows, k):
    """float32 [rows, k] (rows >= 12): fresh normal rows with spread magnitudes, then named rows:
    0 all -0.0, 1 -0.0/+0.0 alternating with one value, 2-3 outliers (x1e4 every 7th, 3e38),
    4 NaN, 5 +-Inf, 6 tiny (2^-120 scale), 7 one nonzero per block."""
    x = rng.standard_normal((rows, k)) * np.exp2(rng.integers(-20, 20, (rows, 1)))
    x[0] = -0.0
    x[1] = np.where(np.arange(k) % 2, -0.0, 0.0)
    x[1, 5] = -3.0
    x[2, ::7] *= 1e4
    x[3, 5::64] = 3e38
    x[4, 9] = np.nan
    x[5, 3::101] = np.inf
    x[5, 4::101] = -np.inf
    x[6] = rng.standard_normal(k) * 2.0**-120
    x[7] = 0.0
    x[7, ::32] = rng.standard_normal(k // 32) * 100
    return x.astype(np.float32)


@pytest.mark.sweep(keep=1)
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_fused_rotation_bit_identical_to_two_pass(block, rounding, rng):
    seed = int(rng.integers(1 << 31))
    rows, k = 13, 3 * block  # rows overhang the tile; K = 3 rotation blocks (the last tile part-masked)
    x32 = _input(rng, rows, k)
    for i, dtype in enumerate([jnp.float32, jnp.bfloat16]):
        mode = MODES[(BLOCKS.index(block) + 2 * i) % 4]
        x = jnp.asarray(x32).astype(dtype)
        key = jax.random.key(int(rng.integers(1 << 30))) if rounding == "stochastic" else None
        kw = dict(axis=1, scale_mode=mode, rounding=rounding)
        got = quantize_impl(x, key, interpret=True, cfg=CFG, hadamard=(block, seed), **kw)
        xr = random_hadamard_transform(x, 1, seed, block)
        _same(got, _quantize_impl(xr, key, **kw))
        if rounding == "stochastic":  # an rbg key: the kernel reads the drawn uniforms
            rbg = jax.random.key(int(rng.integers(1 << 30)), impl="rbg")
            _same(quantize_impl(x, rbg, interpret=True, cfg=CFG, hadamard=(block, seed), **kw),
                  _quantize_impl(xr, rbg, **kw))
        else:  # independent oracle: NumPy float32 transform + float64 quantizer model (not the tiny row)
            keep = np.arange(rows) != 6
            with np.errstate(invalid="ignore", over="ignore"):  # the NaN/Inf/3e38 rows
                xn = hadamard_transform_ref(np.asarray(x.astype(jnp.float32)), 1, seed, block)[keep]
            codes, byte = ref.quantize_ref(xn, 1, mode)
            np.testing.assert_array_equal(_bits(got[0])[keep], ref.pack_ref(codes, 1))
            np.testing.assert_array_equal(_bits(got[1])[keep], byte)


def test_fused_rotation_other_axis_and_float16(rng):
    x = jnp.asarray(rng.standard_normal((128, 6)) * 50, jnp.float16)  # rotated/quantized along axis 0
    key = jax.random.key(int(rng.integers(1 << 30)))
    for rounding in ("nearest", "stochastic"):
        k = key if rounding == "stochastic" else None
        got = quantize_impl(x, k, axis=0, scale_mode="even", rounding=rounding, interpret=True, hadamard=(64, 9))
        _same(got, _quantize_impl(random_hadamard_transform(x, 0, 9, 64), k, axis=0, scale_mode="even",
                                  rounding=rounding))


def test_fused_rotation_refuses_bad_blocks():
    x = jnp.ones((4, 96), jnp.float32)
    with pytest.raises(ValueError, match="multiple of the Hadamard block 64"):
        quantize_2d(x, hadamard=(64, 0), interpret=True)
    for bad in (16, 512, 48):
        with pytest.raises(ValueError, match="hadamard block must be a power of two"):
            quantize_2d(jnp.ones((4, 512)), hadamard=(bad, 0), interpret=True)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
def test_fused_rotation_lowers_to_triton_for_cuda(dtype):
    # lowering rules only (jax here can lower for CUDA without a GPU): split/join/trans/reshape
    for block in (32, 256):
        for variant in ("nearest", "kernel_rng", "uniforms"):
            def f(x, extra=None, variant=variant, block=block):
                if variant == "kernel_rng":
                    return quantize_2d(x, key_data=extra, hadamard=(block, 5))
                return quantize_2d(x, extra, hadamard=(block, 5), scale_mode="rceil")
            args = [jax.ShapeDtypeStruct((512, 1024), dtype)]
            if variant == "kernel_rng":
                args.append(jax.ShapeDtypeStruct((2,), jnp.uint32))
            elif variant == "uniforms":
                args.append(jax.ShapeDtypeStruct((512, 1024), jnp.float32))
            txt = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
            assert "__gpu$xla.gpu.triton" in txt, (block, variant)


@pytest.fixture
def fused_on_cpu(monkeypatch):
    """Route quantize/quantize_rotated to the fused kernels (Pallas interpreter) as on a GPU: the row
    kernel along the last axis, the strided-axis kernel along any other."""
    from jax_mxfp4.kernels import quantize_columns

    monkeypatch.setattr(quantize_mod, "fused_path", lambda x: True)
    monkeypatch.setattr(fused, "quantize_impl", functools.partial(quantize_impl, interpret=True))
    monkeypatch.setattr(quantize_columns, "quantize_strided",
                        functools.partial(quantize_columns.quantize_strided, interpret=True))


def _same_array(p, q):
    assert (p.axis, p.shape, p.dtype, p.scale_mode, p.scale_layout, p.hadamard) == \
        (q.axis, q.shape, q.dtype, q.scale_mode, q.scale_layout, q.hadamard)
    np.testing.assert_array_equal(_bits(p.data), _bits(q.data))
    np.testing.assert_array_equal(_bits(p.scales), _bits(q.scales))


def test_quantize_rotated_fused_equals_two_pass(fused_on_cpu, rng):
    x = jnp.asarray(rng.standard_normal((3, 256, 5)) * 7, jnp.bfloat16)
    key = jax.random.key(int(rng.integers(1 << 30)))
    for rounding, k in (("nearest", None), ("stochastic", key)):
        got = quantize_rotated(x, 1, (128, 77), scale_mode="ceil", rounding=rounding, key=k)
        want = quantize_mod._quantize_impl(random_hadamard_transform(x, 1, 77, 128), k, axis=1, scale_mode="ceil",
                                           rounding=rounding)
        _same((got.data, got.scales), want)
        assert got.dtype == jnp.float32 and got.shape == x.shape and got.axis == 1
    with pytest.raises(ValueError, match="multiple of the Hadamard block 256"):
        quantize_rotated(jnp.ones((4, 96)), 1, (256, 0))


def test_quantize_rotated_reference_path(rng):
    # CPU: the two-pass route, the same MXFP4Array as quantize(random_hadamard_transform(...))
    x = jnp.asarray(rng.standard_normal((64, 40)), jnp.float32)
    _same_array(quantize_rotated(x, 0, (32, 4), scale_mode="floor"),
                quantize(random_hadamard_transform(x, 0, 4, 32), 0, scale_mode="floor"))


def test_training_passes_fused_rotation_bit_identical(fused_on_cpu, monkeypatch, rng):
    # every pass rotated (block 64): loss and both gradients equal with and without the fused route
    x = jnp.asarray(rng.standard_normal((64, 128)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((128, 64)) * 0.1, jnp.float32)
    key = jax.random.key(int(rng.integers(1 << 30)))
    recipe = Recipe(hadamard="all", hadamard_block=64)

    def loss(x, w):
        return jnp.sum(jnp.sin(training.dense(x, w, recipe=recipe, key=key)))

    calls = []

    def counting(*a, **kw):
        calls.append(kw.get("hadamard"))
        return quantize_impl(*a, interpret=True, **kw)

    monkeypatch.setattr(fused, "quantize_impl", counting)
    got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)
    assert sum(h == (64, h[1]) for h in calls if h) == 6, calls  # fprop, dgrad, wgrad: 2 operands each
    calls.clear()
    # the two-pass form (the jnp rotation, then the fused quantizer)
    monkeypatch.setattr(quantize_mod, "fused_rotation_path", lambda x: False)
    monkeypatch.setattr(training, "fused_rotation_path", lambda x: False)
    want = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)
    assert calls and not any(calls)  # the quantizer kernel without the rotation
    for g, v in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(g).view(np.uint32), np.asarray(v).view(np.uint32))
