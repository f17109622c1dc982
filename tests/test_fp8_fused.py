"""The fused quantize-to-FP8 kernel (jax_mxfp4/kernels/fp8_quantize.py) in the Pallas
interpreter against the reference: encode_rows(quantize(x)) with jax_mxfp4.quantize's jnp
path, both layouts, both roundings; and the fused training passes against the unfused ones."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_mxfp4 as mx
from jax_mxfp4 import training
from jax_mxfp4.fp8 import FLAG_EXACT, FLAG_NAN, encode_rows
from jax_mxfp4.kernels import fp8_quantize as fq
from jax_mxfp4.quantize import _quantize_impl


def _hard_rows(rng, rows, kq, dtype):
    """Random rows with the named edge cases (quantized axis last)."""
    x = rng.standard_normal((rows, kq)).astype(np.float32)
    nb = kq // 32
    # per-block scales spread over ~12 binades (inside the window) in every row
    x *= np.repeat(2.0 ** rng.integers(-6, 6, (rows, nb)), 32, axis=1)
    x[0, :] = rng.choice([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -2.5, 6.0], kq)  # E2M1 ties
    x[1, :32] = -0.0
    x[1, 32:64] = 1e-40  # float32 subnormals: flushed
    x[2, :32] *= 2.0**40  # a block 40 binades above the rest: row flagged (outside the window)
    x[3, 5] = np.nan
    if rows > 4:
        x[4, 40] = np.inf
    if rows > 5:
        x[5, :32] = 2.0**-130 * np.arange(1, 33)  # tiny block: scale byte 0/1 (flushed elements)
    if rows > 6:
        x[6, :] = 0.0  # empty row
    if rows > 7:
        x[7, :32] = 3.0e38  # overflowing block (scale byte 0xFD/0xFE)
    return jnp.asarray(x).astype(dtype)


def _reference(x, axis, rounding, key, scale_mode="even"):
    data, scales = _quantize_impl(x, key, axis=axis, scale_mode=scale_mode, rounding=rounding)
    data, scales = jnp.moveaxis(data, axis, -1), jnp.moveaxis(scales, axis, -1)
    return (*encode_rows(data, scales), scales)


def _assert_same(got, want):
    codes, scales, row_exp, row_flag = got
    wcodes, wexp, wflag, wscales = want
    np.testing.assert_array_equal(np.asarray(codes).view(np.uint8), np.asarray(wcodes).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(scales).view(np.uint8), np.asarray(wscales).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(row_flag), np.asarray(wflag))
    np.testing.assert_array_equal(np.asarray(row_exp), np.asarray(wexp))


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_bit_identical_to_reference(transposed, rounding, dtype):
    rng = np.random.default_rng()
    rows, kq = 10, 96  # rows not a multiple of the tile, 3 blocks (padded to 4) per row
    xr = _hard_rows(rng, rows, kq, dtype)  # [rows, kq], quantized axis last
    x = xr.T if transposed else xr
    axis = 0 if transposed else 1
    key = jax.random.key(int(rng.integers(2**31))) if rounding == "stochastic" else None
    want = _reference(x, axis, rounding, key)
    key_data = jax.random.key_data(key) if key is not None else None
    cfg = fq.Fp8QuantizeConfig(rows=4, num_warps=4)
    got = fq.quantize_fp8_2d(x, key_data, scale_mode="even", transposed=transposed, cfg=cfg, interpret=True)
    _assert_same(got, want)
    flags = np.asarray(got[3])
    assert flags[2] & FLAG_EXACT and flags[5] & FLAG_EXACT and flags[7] & FLAG_EXACT  # cases named above
    assert flags[3] & FLAG_NAN and flags[4] & FLAG_NAN


@pytest.mark.parametrize("scale_mode", ["floor", "ceil", "rceil"])
def test_kernel_scale_modes(scale_mode):
    rng = np.random.default_rng()
    x = _hard_rows(rng, 8, 64, jnp.float32)
    got = fq.quantize_fp8_2d(x, scale_mode=scale_mode, cfg=fq.Fp8QuantizeConfig(rows=2, num_warps=4),
                             interpret=True)
    _assert_same(got, _reference(x, 1, "nearest", None, scale_mode))


def test_kernel_rejects_bad_shapes():
    with pytest.raises(ValueError, match="multiple of 32"):
        fq.quantize_fp8_2d(jnp.zeros((4, 40)), interpret=True)
    with pytest.raises(ValueError, match="MAX_ROW"):
        fq.quantize_fp8_2d(jax.ShapeDtypeStruct((2, 2 * fq.MAX_ROW), jnp.float32), interpret=True)


def _grads(monkeypatch, mode, x, w, recipe, key):
    monkeypatch.setenv(training.FUSED_ENV, mode)
    f = lambda x, w: jnp.sum(mx.dense(x, w, recipe=recipe, key=key) * jnp.cos(jnp.arange(w.shape[1])))  # noqa: E731
    jaxpr = str(jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(x, w))
    out = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(x, w)
    return out, len(re.findall(r"let mxfp4_quantize_fp8\w* =", jaxpr))  # one per kernel body


@pytest.mark.parametrize("rounding,with_key,dtype", [("stochastic", True, jnp.float32), ("stochastic", False, jnp.bfloat16),
                                                     ("nearest", False, jnp.float32)])
def test_training_fused_equals_unfused(monkeypatch, rounding, with_key, dtype):
    """Recipe(backend="fp8") on CPU: the fused passes (interpreter) give bit-identical loss and
    gradients to today's quantize-then-convert passes, flagged rows included."""
    rng = np.random.default_rng()
    t, k, n = 40, 64, 96  # T not a multiple of 32: wgrad pads the token axis
    x = _hard_rows(rng, t, k, jnp.float32)
    x = jnp.where(jnp.isfinite(x), x, 1.0).astype(dtype)  # finite training data (NaN rows: kernel tests above)
    w = jnp.asarray(rng.standard_normal((k, n)) * 0.1, jnp.float32).at[:32, 0].mul(2.0**30).astype(dtype)  # flagged col
    recipe = mx.Recipe(backend="fp8", grad_rounding=rounding)
    key = jax.random.key(int(rng.integers(2**31))) if with_key else None
    (l0, g0), n0 = _grads(monkeypatch, "0", x, w, recipe, key)
    (l1, g1), n1 = _grads(monkeypatch, "interpret", x, w, recipe, key)
    (l2, g2), n2 = _grads(monkeypatch, "interpret-rows", x, w, recipe, key)
    assert n0 == 0 and n1 == 6  # fprop x, w; dgrad dY, w; wgrad dY, x
    # rows only: every operand through the rows kernel (x and W transposed by XLA first where they
    # are quantized along a strided axis) except wgrad's stochastically rounded dY (unfused)
    assert n2 == (5 if rounding == "stochastic" else 6)
    for l_, g_ in ((l1, g1), (l2, g2)):
        np.testing.assert_array_equal(np.asarray(l0), np.asarray(l_))
        for a, b in zip(g0, g_):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_fused_modes_parsed_and_typos_refused(monkeypatch):
    for value, mode in (("", "rows"), ("rows", "rows"), ("0", "off"), ("off", "off"), ("1", "all"),
                        ("all", "all"), ("interpret", "interpret"), ("Interpret-Rows", "interpret-rows")):
        monkeypatch.setenv(training.FUSED_ENV, value)
        assert training.fused_mode() == mode, value
    monkeypatch.delenv(training.FUSED_ENV)
    assert training.fused_mode() == "rows"  # the default
    monkeypatch.setenv(training.FUSED_ENV, "row")
    with pytest.raises(ValueError, match="JAX_MXFP4_FUSED_TRAINING"):
        training.fused_mode()


@pytest.mark.parametrize("mode,want", [("", (False, True)), ("1", (False, False)), ("0", None)])
def test_fused_route_on_cuda(monkeypatch, mode, want):
    """The CUDA branch of the route (a CPU test cannot run the kernels, but it can take the
    decision): an 8192-class bf16 GEMM routed to "fp8" takes the fused passes, rows only by
    default. Guards the code path that only CUDA reaches (an import lost in a merge broke it)."""
    import importlib

    qmod = importlib.import_module("jax_mxfp4.quantize")  # the module (the package exports the function)
    kq = importlib.import_module("jax_mxfp4.kernels.quantize")

    monkeypatch.setenv(training.FUSED_ENV, mode)
    monkeypatch.setattr(training.dispatch, "current_platform", lambda: "cuda")
    monkeypatch.setattr(qmod, "current_platform", lambda: "cuda")
    monkeypatch.setattr(kq, "fast_path_enabled", lambda platform, rounding, size: platform == "cuda")
    x = jax.ShapeDtypeStruct((1, 1024, 512), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((1, 768, 512), jnp.bfloat16)
    canon = (((2,), (2,)), ((0,), (0,)))
    assert training._fused_route(x, w, canon, jnp.bfloat16, mx.Recipe()) == want
    assert training._fused_route(x, w, canon, jnp.bfloat16, mx.Recipe(backend="xla")) is None


def test_training_fused_hadamard_and_batch_dims(monkeypatch):
    """A rotated wgrad (it takes the rotate+quantize kernel, quantize_rotated; fprop and dgrad the
    fused FP8 passes) and a leading batch of tokens: still bit-identical."""
    rng = np.random.default_rng()
    x = jnp.asarray(rng.standard_normal((2, 24, 64)), jnp.float32)  # tokens [2, 24] -> M = 48
    w = jnp.asarray(rng.standard_normal((64, 64)) * 0.1, jnp.float32)
    recipe = mx.Recipe(backend="fp8", hadamard=("wgrad",))
    (l0, g0), _ = _grads(monkeypatch, "0", x, w, recipe, None)
    (l1, g1), n1 = _grads(monkeypatch, "interpret", x, w, recipe, None)
    assert n1 == 4  # fprop x, w; dgrad dY, w
    np.testing.assert_array_equal(np.asarray(l0), np.asarray(l1))
    for a, b in zip(g0, g1):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_training_other_backends_unfused(monkeypatch):
    """Only GEMMs routed to "fp8" take the fused passes: backend "xla" stays as it was."""
    rng = np.random.default_rng()
    x = jnp.asarray(rng.standard_normal((32, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((64, 32)), jnp.float32)
    (_, _), count = _grads(monkeypatch, "interpret", x, w, mx.Recipe(backend="xla"), None)
    assert count == 0


@pytest.mark.parametrize("transposed", [False, True])
def test_kernel_lowers_for_cuda(transposed):
    """Triton lowering (no GPU needed), ragged rows and a block count that is not a power of two
    (masked loads and stores), stochastic rounding (in-kernel Threefry)."""
    import functools

    shape = (33, 96)  # rows x quantized length
    x = jax.ShapeDtypeStruct(shape[::-1] if transposed else shape, jnp.bfloat16)
    f = functools.partial(fq.quantize_fp8_2d, transposed=transposed)
    lowered = jax.jit(f).trace(x, jax.ShapeDtypeStruct((2,), jnp.uint32)).lower(lowering_platforms=("cuda",))
    assert "triton" in lowered.as_text()
