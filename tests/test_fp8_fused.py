"""The fused quantize-to-FP8 kernel (jax_mxfp4/kernels/fp8_quantize.py) in the Pallas
interpreter against the reference: encode_rows(quantize(x)) with jax_mxfp4.quantize's jnp
path, both roundings (stochastic: uniforms generated in the kernel for threefry keys
(Threefry-2x32) and rbg keys (Philox-4x32), or read as an input array for any key), and the
NumPy float64 model of
tests/mx_reference.py; and the fused training passes against the unfused ones."""

import functools
import re

import jax
import jax.numpy as jnp
import mx_reference as ref
import numpy as np
import pytest

import jax_mxfp4 as mx
from jax_mxfp4 import training
from jax_mxfp4.backends import fp8 as fp8_backend
from jax_mxfp4.platform import KERNELS_ENV
from jax_mxfp4.fp8_format import FLAG_EXACT, FLAG_NAN, format_named
from jax_mxfp4.fp8_prepared import encode_rows, prepare_fp8
from jax_mxfp4.kernels import fp8_quantize as fq
from jax_mxfp4.kernels import quantize_columns as kcols
from jax_mxfp4.kernels import quantize_kernel as kquant
from jax_mxfp4.quantize import _quantize_impl

SCALE_MODES = ("floor", "ceil", "even", "rceil")


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


@pytest.mark.sweep(keep=2)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_bit_identical_to_reference(rounding, dtype, rng):
    rows, kq = 10, 96  # rows not a multiple of the tile, 3 blocks (padded to 4) per row
    x = _hard_rows(rng, rows, kq, dtype)  # [rows, kq], quantized axis last
    key = jax.random.key(int(rng.integers(2**31))) if rounding == "stochastic" else None
    want = _reference(x, 1, rounding, key)
    key_data = jax.random.key_data(key) if key is not None else None
    cfg = fq.Fp8QuantizeConfig(rows=4, num_warps=4)
    got = fq.quantize_fp8_2d(x, key_data, scale_mode="even", cfg=cfg, interpret=True)
    _assert_same(got, want)
    flags = np.asarray(got[3])
    assert flags[2] & FLAG_EXACT and flags[5] & FLAG_EXACT and flags[7] & FLAG_EXACT  # cases named above
    assert flags[3] & FLAG_NAN and flags[4] & FLAG_NAN


@pytest.mark.parametrize("scale_mode", ["floor", "ceil", "rceil"])
def test_kernel_scale_modes(scale_mode, rng):
    x = _hard_rows(rng, 8, 64, jnp.float32)
    got = fq.quantize_fp8_2d(x, scale_mode=scale_mode, cfg=fq.Fp8QuantizeConfig(rows=2, num_warps=4),
                             interpret=True)
    _assert_same(got, _reference(x, 1, "nearest", None, scale_mode))


def test_kernel_rejects_bad_shapes():
    with pytest.raises(ValueError, match="multiple of 32"):
        fq.quantize_fp8_2d(jnp.zeros((4, 40)), interpret=True)
    with pytest.raises(ValueError, match="MAX_ROW"):
        fq.quantize_fp8_2d(jax.ShapeDtypeStruct((2, 2 * fq.MAX_ROW), jnp.float32), interpret=True)


def _key(impl, rng):
    return jax.random.key(int(rng.integers(2**31)), impl=impl)


@pytest.mark.sweep(keep=3)
@pytest.mark.parametrize("impl", ["threefry2x32", "rbg", "unsafe_rbg"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_reads_the_reference_uniforms(impl, dtype, rng):
    """uniform= (the reference's draw, read by the kernel): bit-identical to quantize(x, axis,
    "stochastic", key) then encode_rows, for any key implementation; also equal to the in-kernel
    generation from key_data= (uint32[2] threefry, uint32[4] rbg / unsafe_rbg: Philox)."""
    rows, kq = 10, 96
    x = _hard_rows(rng, rows, kq, dtype)
    key = _key(impl, rng)
    uniform = jax.random.uniform(key, (rows, kq // 32, 32), jnp.float32)
    cfg = fq.Fp8QuantizeConfig(rows=4, num_warps=4)
    got = fq.quantize_fp8_2d(x, uniform=uniform, cfg=cfg, interpret=True)
    _assert_same(got, _reference(x, 1, "stochastic", key))
    in_kernel = fq.quantize_fp8_2d(x, jax.random.key_data(key), cfg=cfg, interpret=True)
    for a, b in zip(got, in_kernel):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8) if a.dtype.itemsize == 1 else a,
                                      np.asarray(b).view(np.uint8) if b.dtype.itemsize == 1 else b)


def test_sr_uniforms_chooses_the_source_and_draws_the_reference_values():
    """kernels.quantize_kernel.sr_uniforms: key data for threefry keys (typed or legacy raw); for
    rbg keys the key data where the kernel generates Philox uniforms (philox=True), else the
    reference's draw jax.random.uniform(key, shape)."""
    shape = (3, 2, 32)
    key = jax.random.key(7)
    u, kd = kquant.sr_uniforms(key, shape)
    assert u is None and np.array_equal(np.asarray(kd), np.asarray(jax.random.key_data(key)))
    raw = jax.random.PRNGKey(7)  # legacy uint32[2] under the default threefry implementation
    u, kd = kquant.sr_uniforms(raw, shape)
    assert u is None and kd is raw
    for k in (jax.random.key(7, impl="rbg"), jax.random.key(7, impl="unsafe_rbg")):
        u, kd = kquant.sr_uniforms(k, shape)
        assert kd is None and u.dtype == jnp.float32 and u.shape == shape
        np.testing.assert_array_equal(np.asarray(u), np.asarray(jax.random.uniform(k, shape, jnp.float32)))
        u, kd = kquant.sr_uniforms(k, shape, philox=True)
        assert u is None and np.array_equal(np.asarray(kd), np.asarray(jax.random.key_data(k)))
    u, kd = kquant.sr_uniforms(raw, shape, philox=True)  # threefry keys are unchanged by the flag
    assert u is None and kd is raw


def _mulhi_model(x, m):
    return ((np.asarray(x, np.uint64) * np.uint64(m)) >> np.uint64(32)).astype(np.uint32)


def test_philox_uniforms_equal_the_rbg_draw():
    """kernels.quantize_kernel.philox_uniforms (what the kernel computes for rbg keys, here the
    interpreter's 16-bit partial products for mul.hi) against jax.random.uniform of rbg and
    unsafe_rbg keys, element 4b + w = word w of block b, including the 128-bit counter's carries:
    key words k2 (and k3) at 2^32 - 1 so that block + k2 wraps into k3, k3 into k0, k0 into k1;
    and the high-product helper against NumPy uint64 at 0, 1 and 2^32 - 1."""
    edge = np.array([0, 1, 0xFFFF, 0x10000, 0xFFFFFFFF, 0x80000000, 0xDEADBEEF], np.uint32)
    for m in kquant.PHILOX_MULTIPLIERS:
        np.testing.assert_array_equal(np.asarray(kquant._mul_hi_u32(jnp.asarray(edge), m, False)), _mulhi_model(edge, m))
    n = 64  # 16 Philox blocks
    datas = [np.array(d, np.uint32) for d in ([3, 5, 0xFFFFFFF8, 9], [3, 5, 0xFFFFFFF8, 0xFFFFFFFF],
                                              [0xFFFFFFFF, 5, 0xFFFFFFF8, 0xFFFFFFFF], [11, 22, 33, 44])]
    for impl in ("rbg", "unsafe_rbg"):
        for d in datas:
            key = jax.random.wrap_key_data(d, impl=impl)
            want = np.asarray(jax.random.uniform(key, (2, n // 2), jnp.float32)).ravel()
            words = kquant.philox_uniforms(tuple(jnp.asarray(d)), jnp.arange(n // 4, dtype=jnp.uint32))
            np.testing.assert_array_equal(np.asarray(kquant.interleave4(*words)), want, err_msg=f"{impl} {d}")
    assert kquant.philox_key_supported(jax.random.key(0, impl="rbg"), 2**34 - 1)
    assert not kquant.philox_key_supported(jax.random.key(0, impl="rbg"), 2**34)
    assert not kquant.philox_key_supported(jax.random.key(0), 16)  # threefry
    assert not kquant.philox_key_supported(jax.random.PRNGKey(0), 16)  # a raw key: no implementation named


def _sr_model(x, u, scale_mode):
    """NumPy float64 model of stochastic rounding with uniforms u (tests/mx_reference.py rules):
    x, u [R, Kq] (quantized axis last) -> (scale bytes [R, Kq/32], values [R, Kq]) for blocks
    without NaN/Inf."""
    x = np.asarray(jnp.asarray(x, jnp.float32))
    x = np.where(np.abs(x) < ref.F32_TINY, np.copysign(0.0, x), x)
    r, kq = x.shape
    blocks = x.reshape(r, kq // 32, 32).astype(np.float64)
    amax = np.where(np.isfinite(blocks), np.abs(blocks), 0.0).max(-1)
    s = np.clip(ref.scale_exponent(amax, scale_mode), -127, 127)
    with np.errstate(all="ignore"):  # NaN/Inf blocks: values not used (flagged rows)
        y = blocks / np.ldexp(1.0, s)[..., None]
        mag = ref.stochastic_magnitude_ref(np.abs(y), np.asarray(u, np.float64).reshape(y.shape))
    return (s + 127).astype(np.uint8), (np.copysign(mag, y) * np.ldexp(1.0, s)[..., None]).reshape(r, kq)


@pytest.mark.sweep(keep=2)
@pytest.mark.parametrize("scale_mode", SCALE_MODES)
def test_kernel_given_uniforms_at_the_rounding_edges(scale_mode, rng):
    """Chosen uniforms: 0, 0.5, the largest float32 below 1, random, and u equal to each
    element's fraction (the rule is u < frac: rounds down) on rows with E2M1 grid values and
    ties. Against the MXFP4 quantizer fed the same uniforms then encode_rows (every row, bit for
    bit) and the NumPy float64 model (rows on the FP8 fast path: codes x 2^row_exp)."""
    rows, kq = 16, 64
    xr = np.asarray(_hard_rows(rng, 10, kq, jnp.float32))
    xr = np.concatenate([xr, xr[[0, 0, 1, 8, 9, 8]]])  # ties and signed zeros under other uniforms
    xr[13] *= np.float32(2.0**-118)  # tiny values (scales near the bottom of E8M0, some flushed)
    x32 = jnp.asarray(xr)
    _, vals_lo = _sr_model(x32, np.zeros((rows, kq)), scale_mode)  # u = 0 keeps no fraction: lo
    s = np.clip(ref.scale_exponent(np.where(np.isfinite(xr), np.abs(np.where(np.abs(xr) < ref.F32_TINY, 0, xr)), 0)
                                   .reshape(rows, -1, 32).max(-1), scale_mode), -127, 127)
    with np.errstate(all="ignore"):  # NaN/Inf/overflowing rows: any uniform (flagged, compared bitwise only)
        a = np.abs(xr.astype(np.float64).reshape(rows, -1, 32) / np.ldexp(1.0, s)[..., None]).reshape(rows, kq)
        step = np.where(a < 2, 0.5, np.where(a < 4, 1.0, 2.0))
        frac = np.nan_to_num((a - np.floor(a / step) * step) / step).astype(np.float32)
    pick = rng.integers(0, 5, (rows, 1))
    u = np.select([pick == 0, pick == 1, pick == 2, pick == 3],
                  [np.zeros_like(frac), np.full_like(frac, 0.5), np.full_like(frac, np.nextafter(np.float32(1), 0)),
                   rng.uniform(0, 1, frac.shape).astype(np.float32)], frac).astype(np.float32)
    u[:2] = frac[:2]  # the ties rows with u == frac exactly
    u = jnp.asarray(u)
    got = fq.quantize_fp8_2d(x32, uniform=u, scale_mode=scale_mode, cfg=fq.Fp8QuantizeConfig(rows=4, num_warps=4),
                             interpret=True)
    data, sbytes = kquant.quantize_2d(x32, u, scale_mode=scale_mode, cfg=kquant.QuantizeConfig(4, 64), interpret=True)
    _assert_same(got, (*encode_rows(data, sbytes), sbytes))
    codes, scales, row_exp, row_flag = (np.asarray(v) for v in got)
    want_bytes, want_vals = _sr_model(x32, u, scale_mode)
    fast = np.asarray(row_flag) == 0
    assert fast.sum() >= 8 and not fast[[2, 3, 4, 5, 7]].any()  # the flagged edge rows of _hard_rows
    np.testing.assert_array_equal(scales.view(np.uint8)[fast], want_bytes[fast])
    vals = codes.astype(np.float64) * np.ldexp(1.0, row_exp)[:, None]
    np.testing.assert_array_equal(vals[fast], want_vals[fast])
    assert np.any(want_vals[fast] != vals_lo[fast])  # some elements rounded up (u < frac)


def test_kernel_uniform_errors_name_the_argument():
    x = jnp.zeros((4, 64), jnp.float32)
    u = jnp.zeros((4, 64), jnp.float32)
    kd = jax.random.key_data(jax.random.key(0))
    with pytest.raises(ValueError, match="key_data.*uniform.*not both"):
        fq.quantize_fp8_2d(x, kd, u, interpret=True)
    with pytest.raises(TypeError, match="uniform must be float32.*bfloat16"):
        fq.quantize_fp8_2d(x, uniform=u.astype(jnp.bfloat16), interpret=True)
    with pytest.raises(TypeError, match="uniform must be float32"):
        fq.quantize_fp8_2d(x, uniform=jnp.zeros((4, 64), jnp.uint32), interpret=True)
    with pytest.raises(ValueError, match=r"uniform must have shape \[\*lead, 64\].*\[64, 4\]"):
        fq.quantize_fp8_2d(x, uniform=u.T, interpret=True)  # the input's layout, not the output rows'
    with pytest.raises(ValueError, match="uniform must have shape"):
        fq.quantize_fp8_2d(x, uniform=jnp.zeros((4, 2, 16, 2), jnp.float32), interpret=True)
    # accepted: [R, Kq], [R, Kq/32, 32] and leading dims whose product is R
    for shape in ((4, 64), (4, 2, 32), (2, 2, 2, 32), (2, 2, 64)):
        fq.quantize_fp8_2d(x, uniform=jnp.zeros(shape, jnp.float32), interpret=True)


@pytest.mark.sweep(keep=2)
@pytest.mark.parametrize("impl", ["threefry2x32", "rbg", "unsafe_rbg"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fused_sr_operand_equals_unfused(impl, dtype, rng):
    """backends.fp8.fused_operand with stochastic rounding, the operand of dgrad (dY along N, the
    rows): codes, scales, row_exp and row_flag equal prepare_fp8(quantize(x, axis, "stochastic",
    key)): uniforms generated in the kernel for threefry and rbg keys. Along the strided token
    axis (wgrad's dY) it declines: the caller's unfused passes read that axis in place
    (kernels/quantize_columns.py, tests/test_quantize_columns.py)."""
    scale_mode = SCALE_MODES[rng.integers(4)]  # one per case, drawn (the kernel tests cover each)
    hard = _hard_rows(rng, 10, 96, dtype)  # rows x quantized length
    x3, axis = hard[None], 2
    key = _key(impl, rng)
    assert fp8_backend.fused_operand(hard.T[None], 1, scale_mode, True, "stochastic", key) is None
    got = fp8_backend.fused_operand(x3, axis, scale_mode, True, "stochastic", key)
    assert got is not None, "the fused kernel must take stochastic rounding along rows"
    want = prepare_fp8(mx.quantize(x3, axis, scale_mode=scale_mode, rounding="stochastic", key=key))
    for name in ("codes", "scales", "row_exp", "row_flag"):
        a, b = (np.asarray(getattr(v, name)) for v in (got, want))
        assert a.shape == b.shape, name
        np.testing.assert_array_equal(a.view(np.uint8) if a.dtype.itemsize == 1 else a,
                                      b.view(np.uint8) if b.dtype.itemsize == 1 else b, err_msg=f"{name} ({scale_mode})")


def _grads(monkeypatch, fused, x, w, recipe, key, kernels=None):
    """Loss and gradients, and the number of fused quantize-to-FP8 kernels in the backward's
    jaxpr (or of the kernels named ``kernels``): ``fused`` the fused passes through the Pallas
    interpreter, and with it every quantization on the GPU's quantizer kernels (the row and the
    strided-axis kernel, interpreted), else the unfused jnp passes (JAX_MXFP4_KERNELS=0)."""
    monkeypatch.setattr(training, "_FUSED_INTERPRET", fused)
    if fused:
        monkeypatch.delenv(KERNELS_ENV, raising=False)
        monkeypatch.setattr(kquant, "fast_path_enabled", lambda platform, size: True)
        monkeypatch.setattr(kquant, "quantize_impl", functools.partial(kquant.quantize_impl, interpret=True))
        monkeypatch.setattr(kcols, "quantize_strided", functools.partial(kcols.quantize_strided, interpret=True))
    else:
        monkeypatch.setenv(KERNELS_ENV, "0")
    f = lambda x, w: jnp.sum(mx.dense(x, w, recipe=recipe, key=key) * jnp.cos(jnp.arange(w.shape[1])))  # noqa: E731
    jaxpr = str(jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(x, w))
    out = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(x, w)
    return out, len(re.findall(kernels or r"let mxfp4_quantize_fp8\w* =", jaxpr))  # one per kernel body


@pytest.mark.slow
@pytest.mark.parametrize("rounding,key_impl,dtype", [("stochastic", "threefry2x32", jnp.float32),
                                                     ("stochastic", None, jnp.bfloat16),
                                                     ("stochastic", "rbg", jnp.bfloat16),
                                                     ("nearest", None, jnp.float32)])
def test_training_fused_equals_unfused(monkeypatch, rounding, key_impl, dtype, rng):
    """Recipe(backend="fp8") on CPU: the fused passes (interpreter) give bit-identical loss and
    gradients to the quantize-then-convert passes, flagged rows included. Stochastic rounding
    with a caller's threefry or rbg key (both generated in the kernels)
    or the data-derived key (None)."""
    t, k, n = 40, 64, 96  # T not a multiple of 32: wgrad pads the token axis
    x = _hard_rows(rng, t, k, jnp.float32)
    x = jnp.where(jnp.isfinite(x), x, 1.0).astype(dtype)  # finite training data (NaN rows: kernel tests above)
    w = jnp.asarray(rng.standard_normal((k, n)) * 0.1, jnp.float32).at[:32, 0].mul(2.0**30).astype(dtype)  # flagged col
    recipe = mx.Recipe(backend="fp8", grad_rounding=rounding)
    key = jax.random.key(int(rng.integers(2**31)), impl=key_impl) if key_impl else None
    (l0, g0), n0 = _grads(monkeypatch, False, x, w, recipe, key)
    (l1, g1), n1 = _grads(monkeypatch, True, x, w, recipe, key)
    _, n_columns = _grads(monkeypatch, True, x, w, recipe, key, kernels=r"let mxfp4_quantize_columns\d* =")
    _, n_rows = _grads(monkeypatch, True, x, w, recipe, key, kernels=r"let mxfp4_quantize\d* =")
    assert n0 == 0
    assert n1 == (1 if rounding == "stochastic" else 0)  # dgrad's stochastically rounded dY only
    # each other quantization reads its operand in place: the kernel [K, N] along K (fprop) and X
    # and dY along the tokens (wgrad) in the strided-axis kernel; X along K (fprop) and the kernel
    # along N (dgrad) in the row kernel, and dY along N too where it is rounded to nearest
    assert (n_columns, n_rows) == (3, 2 if rounding == "stochastic" else 3)
    np.testing.assert_array_equal(np.asarray(l0), np.asarray(l1))
    for a, b in zip(g0, g1):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("kernels,want", [(None, False), ("1", False), ("0", None)])
def test_fused_route_on_cuda(monkeypatch, kernels, want):
    """The CUDA branch of the route (a CPU test cannot run the kernels, but it can take the
    decision): a bf16 GEMM routed to "fp8" takes the fused passes (on the device, not
    interpreted) unless JAX_MXFP4_KERNELS=0. Guards the code path that only CUDA reaches (an
    import lost in a merge broke it)."""
    import importlib

    qmod = importlib.import_module("jax_mxfp4.quantize")  # the module (the package exports the function)
    kq = importlib.import_module("jax_mxfp4.kernels.quantize_kernel")

    if kernels is None:
        monkeypatch.delenv(KERNELS_ENV, raising=False)
    else:
        monkeypatch.setenv(KERNELS_ENV, kernels)
    monkeypatch.setattr(training.dispatch, "current_platform", lambda: "cuda")
    monkeypatch.setattr(qmod, "current_platform", lambda: "cuda")
    monkeypatch.setattr(kq, "fast_path_enabled", lambda platform, size: platform == "cuda")
    x = jax.ShapeDtypeStruct((1, 1024, 512), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((1, 768, 512), jnp.bfloat16)
    canon = (((2,), (2,)), ((0,), (0,)))
    for recipe, expected in ((mx.Recipe(), want), (mx.Recipe(backend="xla"), None)):
        assert training._fused_route(x, w, training._plan(x, w, canon, jnp.bfloat16, recipe)) == expected


@pytest.mark.slow
def test_training_fused_hadamard_and_batch_dims(monkeypatch, rng):
    """A rotated wgrad (it takes the rotate+quantize kernel, quantize_rotated; fprop and dgrad the
    fused FP8 passes) and a leading batch of tokens: still bit-identical."""
    x = jnp.asarray(rng.standard_normal((2, 24, 64)), jnp.float32)  # tokens [2, 24] -> M = 48
    w = jnp.asarray(rng.standard_normal((64, 64)) * 0.1, jnp.float32)
    recipe = mx.Recipe(backend="fp8", hadamard=("wgrad",))
    (l0, g0), _ = _grads(monkeypatch, False, x, w, recipe, None)
    (l1, g1), n1 = _grads(monkeypatch, True, x, w, recipe, None)
    assert n1 == 1  # dgrad's stochastically rounded dY (wgrad's: the rotate+quantize kernel)
    np.testing.assert_array_equal(np.asarray(l0), np.asarray(l1))
    for a, b in zip(g0, g1):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_training_other_backends_unfused(monkeypatch, rng):
    """Only GEMMs routed to "fp8" take the fused passes: backend "xla" stays as it was."""
    x = jnp.asarray(rng.standard_normal((32, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((64, 32)), jnp.float32)
    (_, _), count = _grads(monkeypatch, True, x, w, mx.Recipe(backend="xla"), None)
    assert count == 0


@pytest.mark.parametrize("uniforms", ["threefry", "philox", "input"])
def test_kernel_lowers_for_cuda(uniforms):
    """Triton lowering (no GPU needed), ragged rows and a block count that is not a power of two
    (masked loads and stores), stochastic rounding (in-kernel Threefry or Philox with its PTX
    mul.hi, or uniforms read)."""
    x = jax.ShapeDtypeStruct((33, 96), jnp.bfloat16)  # rows x quantized length
    f = fq.quantize_fp8_2d
    if uniforms != "input":
        traced = jax.jit(f).trace(x, jax.ShapeDtypeStruct((2 if uniforms == "threefry" else 4,), jnp.uint32))
    else:
        traced = jax.jit(lambda x, u: f(x, uniform=u)).trace(x, jax.ShapeDtypeStruct((33, 3, 32), jnp.float32))
    assert "triton" in traced.lower(lowering_platforms=("cuda",)).as_text()


def _tile_parts(x, scale_mode):
    """What encode_tile computes before choosing a path, for a float32 [R, nb*32] array."""
    from jax_mxfp4.mx_format import pow2_from_exponent

    bits = jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), jnp.int32).reshape(x.shape[0], -1, 32)
    a = bits & kquant._ABS
    amax = jnp.max(a, axis=-1)
    bad, byte, s = kquant.block_scale_bits(amax, scale_mode)
    return bits, a, amax, bad, byte, pow2_from_exponent(-s)[..., None]


def _plain_rows(rng, rows, nb):
    """Rows whose blocks are all plain (scale bytes 3..252 or all zeros), with the plain path's
    edge cases: amax near the lowest plain byte with float32 subnormal elements beside it (the
    round-to-nearest path does not flush them), amax near the highest plain byte, E2M1 ties,
    -0.0, all-zero blocks, and rows spanning more than the 15-binade window (flagged)."""
    x = rng.standard_normal((rows, nb, 32)).astype(np.float32)
    x *= np.float32(2.0) ** rng.integers(-20, 20, (rows, nb, 1)).astype(np.float32)
    x[0] = rng.choice([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -2.5, 6.0, -0.0], (nb, 32))
    x[1, :, :] = np.float32(2.0**-122) * rng.uniform(1, 1.4, (nb, 32)).astype(np.float32)  # bytes 3..4
    x[1, :, ::3] = np.float32(1e-39) * rng.choice([-1, 1], (nb, 11)).astype(np.float32)  # subnormals
    x[2, :, :] = np.float32(2.0**126) * rng.uniform(1, 1.4, (nb, 32)).astype(np.float32)  # bytes 251..252
    x[3, ::2] = 0.0  # all-zero blocks
    x[4, 1::2] = -0.0
    x[5, 0] *= np.float32(2.0**60)  # outside the window: the row is flagged
    return x.reshape(rows, nb * 32)


@pytest.mark.sweep(keep=2)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("scale_mode", SCALE_MODES)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_plain_path_equals_general_path(scale_mode, rounding, fmt, rng):
    """The fused kernel's plain path (jax_mxfp4/kernels/fp8_quantize.py, taken when every block
    of a tile is plain) gives the general path's bits on every plain tile: values (codes), row
    exponents and flags; stochastic rounding with random uniforms and with u = 0 everywhere in
    some rows (the case where an unflushed subnormal would round up)."""
    rows, nb = 12, 6
    x = _plain_rows(rng, rows, nb)
    bits, a, amax, bad, byte, inv = _tile_parts(x, scale_mode)
    b = np.asarray(byte)
    assert np.all((np.asarray(amax) == 0) | ((b >= fq.PLAIN_MIN_BYTE) & (b <= fq.PLAIN_MAX_BYTE)))
    assert b[1].min() <= fq.PLAIN_MIN_BYTE + 1 and b[2].max() >= fq.PLAIN_MAX_BYTE - 1  # near both ends
    u = None
    if rounding == "stochastic":
        u = rng.uniform(0, 1, (rows, nb, 32)).astype(np.float32)
        u[1::2] = 0.0
        u = jnp.asarray(u)
    f = format_named(fmt)
    plain = jax.jit(lambda: fq._encode_plain(bits, a, u, inv, amax, byte, f))()
    general = jax.jit(lambda: fq._encode_general(bits, a, u, inv, bad, byte, f))()
    np.testing.assert_array_equal(np.asarray(plain[0]).view(np.uint32), np.asarray(general[0]).view(np.uint32))
    np.testing.assert_array_equal(np.asarray(plain[1]), np.asarray(general[1]))
    np.testing.assert_array_equal(np.asarray(plain[2]), np.asarray(general[2]))
    assert np.asarray(general[2])[5] & FLAG_EXACT  # the window case is in there
    assert np.signbit(np.asarray(general[0])[4, 1]).all()  # -0.0 kept


@pytest.mark.slow  # a sweep over tile thresholds in the interpreter
def test_plain_path_threshold_is_needed():
    """Why the plain path's round to nearest needs no subnormal flush from scale byte
    PLAIN_MIN_BYTE up, and why byte 2 goes to the general path. In NumPy float32 (which keeps
    subnormals, as a GPU's non-FTZ multiply does; XLA on CPU flushes them, so the jnp paths cannot
    show it here): the largest float32 subnormal over the scale of byte 3 is below 0.25 (rounds
    to the flushed zero), over byte 2 above it (would round to 0.5). The kernel on a byte-2 tile
    gives the reference's bits."""
    sub = np.frombuffer(np.uint32(0x007FFFFF).tobytes(), np.float32)[0]  # largest subnormal
    over = lambda byte: sub * np.float32(2.0) ** np.float32(-(byte - 127))  # noqa: E731
    assert over(fq.PLAIN_MIN_BYTE) < np.float32(0.25) < over(fq.PLAIN_MIN_BYTE - 1)
    x = np.zeros((1, 32), np.float32)
    x[0, 0] = np.float32(2.0**-123) * 1.5  # byte 2 in "floor": scale 2^-125
    x[0, 1] = sub
    *_, byte, _ = _tile_parts(x, "floor")
    assert int(byte[0, 0]) == fq.PLAIN_MIN_BYTE - 1
    got = fq.quantize_fp8_2d(jnp.asarray(x), scale_mode="floor", interpret=True)
    _assert_same(got, _reference(jnp.asarray(x), 1, "nearest", None, "floor"))


def test_kernel_plain_and_general_tiles(rng):
    """The kernel on a mix of plain tiles and tiles with edge blocks (_hard_rows), each tile
    taking its own path: the reference's bits."""
    x = jnp.asarray(np.concatenate([np.asarray(_hard_rows(rng, 8, 192, jnp.float32)), _plain_rows(rng, 12, 6)]))
    cfg = fq.Fp8QuantizeConfig(rows=2, num_warps=4)
    for rounding in ("nearest", "stochastic"):
        key = jax.random.key(int(rng.integers(2**31))) if rounding == "stochastic" else None
        kd = None if key is None else jax.random.key_data(key)
        got = fq.quantize_fp8_2d(x, kd, scale_mode="even", cfg=cfg, interpret=True)
        _assert_same(got, _reference(x, 1, rounding, key))


def test_default_config_by_row_length():
    """Default tiles from the H200 sweeps: round to nearest 2 rows x 4 warps at 8192, one row on
    16 warps beyond 8192 (4 warps spilled: 11x slower at 16384); stochastic rounding one row on
    16 warps; short rows share a program."""
    from jax_mxfp4.kernels import fp8_quantize as fq

    dc = fq.default_config
    assert dc(8192) == fq.Fp8QuantizeConfig(rows=2, num_warps=4)
    for kq in (8192 + 32, 12288, 16384):
        assert dc(kq) == fq.Fp8QuantizeConfig(rows=1, num_warps=16)
        assert dc(kq, True) == fq.Fp8QuantizeConfig(rows=1, num_warps=16)
    assert dc(8192, stochastic=True) == fq.Fp8QuantizeConfig(rows=1, num_warps=16)
    assert dc(1024).rows == 16 and dc(64).rows == 16
    for kq in (32, 1024, 4096, 8192, 16384):  # tiles stay within the register budget
        for nearest in (True, False):
            c = dc(kq, not nearest)
            per_thread = c.rows * fq._pow2_at_least(kq) / (32 * c.num_warps)
            assert per_thread <= (128 if nearest else 32), (kq, nearest, c)


def test_default_config_refuses_lengths_it_has_no_tile_for():
    """kq must be an int, a positive multiple of 32, at most MAX_ROW (what quantize_fp8_2d takes):
    before, 0, negative, 33 and 10**9 got a tile and a float or None failed with an unrelated
    AttributeError / TypeError from inside the power-of-two rounding."""
    import numpy as np

    from jax_mxfp4.kernels import fp8_quantize as fq

    for kq in (0, -32, 1, 31, 33, fq.MAX_ROW + 32, 10**9):
        for sr in (False, True):
            with pytest.raises(ValueError, match=r"kq=.* must be a positive multiple of 32 at most MAX_ROW"):
                fq.default_config(kq, sr)
    for kq in (32.0, True, "64", None):
        with pytest.raises(TypeError, match="kq must be an int"):
            fq.default_config(kq)
    assert fq.default_config(np.int64(fq.MAX_ROW)) == fq.default_config(fq.MAX_ROW)


@pytest.mark.parametrize("kernel", ["quantize_fp8_2d", "quantize_2d"])
def test_kernel_key_data_must_be_one_key(kernel):
    """key_data is one key's data: its shape, not just its size, is checked. A batch of two
    threefry keys (uint32[2, 2], 4 elements) used to pass as one rbg key and draw wrong uniforms;
    quantize_2d, which generates Threefry only, used to take an rbg key's uint32[4] into a reshape
    error and float key data through a silent cast."""
    x = jnp.zeros((4, 64), jnp.float32)
    call = ((lambda kd: fq.quantize_fp8_2d(x, kd, interpret=True)) if kernel == "quantize_fp8_2d"
            else (lambda kd: kquant.quantize_2d(x, key_data=kd, interpret=True)))
    two_keys = jax.random.key_data(jax.random.split(jax.random.key(0, impl="threefry2x32"), 2))
    assert two_keys.shape == (2, 2)
    bad = [two_keys, jnp.zeros((2,), jnp.int32), jnp.zeros((2,), jnp.float32), jnp.zeros((3,), jnp.uint32)]
    if kernel == "quantize_2d":
        bad.append(jax.random.key_data(jax.random.key(0, impl="rbg")))
    for kd in bad:
        with pytest.raises(TypeError, match=f"{kernel}: key_data must be uint32\\[2\\]"):
            call(kd)
    call(jax.random.key_data(jax.random.key(0, impl="threefry2x32")))  # accepted: one key
    if kernel == "quantize_fp8_2d":
        call(jax.random.key_data(jax.random.key(0, impl="rbg")))


def test_quantize_2d_uniform_must_be_float32_of_x_size():
    x = jnp.zeros((4, 64), jnp.float32)
    with pytest.raises(TypeError, match="quantize_2d: uniform must be float32.*bfloat16"):
        kquant.quantize_2d(x, jnp.zeros((4, 64), jnp.bfloat16), interpret=True)
    with pytest.raises(ValueError, match=r"quantize_2d: uniform must have as many elements as x \(256\).*\(4, 32\)"):
        kquant.quantize_2d(x, jnp.zeros((4, 32), jnp.float32), interpret=True)
    kquant.quantize_2d(x, jnp.zeros((2, 128), jnp.float32), interpret=True)  # any shape of R * K elements
