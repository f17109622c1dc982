"""The fused Pallas quantizer (GPU fast path of jax_mxfp4.quantize) is bit-identical to the
reference ``_quantize_impl`` in every scale mode, rounding and input dtype, special values
included; its integer building blocks equal the rules they replace.

Runs the kernel in the Pallas interpreter on CPU. Oracles: the reference ``_quantize_impl`` (same
bits required) and, for round-to-nearest and stochastic rounding with given uniforms, the
independent NumPy float64 + ml_dtypes model in tests/mx_reference.py.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import mx_reference as ref
from jax_mxfp4.kernels.quantize_kernel import (
    QuantizeConfig,
    fast_path_enabled,
    kernel_rng_supported,
    quantize_2d,
    quantize_impl,
    threefry_uniform,
)
from jax_mxfp4.mx_format import (
    e2m1_code_nearest,
    e2m1_magnitude_code,
    e2m1_stochastic_magnitude,
    e8m0_from_amax,
)
from jax_mxfp4.quantize import _quantize_impl

MODES = ["floor", "ceil", "even", "rceil"]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
TIES = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])  # E2M1 midpoints (round-half-even)
GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _bits(a):
    return np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8))


def _same(got, want):
    np.testing.assert_array_equal(_bits(got[0]), _bits(want[0]))
    np.testing.assert_array_equal(_bits(got[1]), _bits(want[1]))


def _neighbours(values, n=3):
    """float32 values and their n float32 neighbours on each side (>= 0)."""
    b = np.asarray(values, np.float32).view(np.int32).astype(np.int64)
    out = (b[:, None] + np.arange(-n, n + 1)[None]).ravel()
    return np.unique(out[out >= 0].astype(np.int32).view(np.float32))


# ------------------------------------------------------------------------ building blocks


def test_magnitude_code_equals_threshold_ladder():
    rng = np.random.default_rng(0)
    pts = np.concatenate([
        _neighbours(np.concatenate([TIES, GRID[1:], [7.0, 8.0, 12.0, 1e30]]), 40),
        rng.uniform(0, 9, 200_000).astype(np.float32),
        np.exp2(rng.uniform(-126, 4, 100_000)).astype(np.float32),
        [0.0],
    ]).astype(np.float32)
    got = np.asarray(e2m1_magnitude_code(jnp.asarray(pts)))
    want = np.asarray(e2m1_code_nearest(jnp.asarray(pts)))
    np.testing.assert_array_equal(got, want)
    # and the independent model: E2M1 RNE of min(a, 6) by ml_dtypes
    oracle = np.minimum(pts.astype(np.float64), 6.0).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 7
    np.testing.assert_array_equal(got, oracle)


def test_rceil_byte_without_division_matches_float32_division():
    # Mantissas of one binade around 1.5 (the formula depends on the mantissa only) plus random amax.
    rng = np.random.default_rng(1)
    # mantissas 0x3C0000..0x43FFFF (around the power-of-two case 0x400000) of one binade
    one_binade = (np.uint32(130 << 23) + np.arange(0x3C0000, 0x440000, dtype=np.uint32)).view(np.float32)
    rand = np.exp2(rng.uniform(-127, 128, 200_000)).astype(np.float32)
    amax = np.concatenate([one_binade, rand[np.isfinite(rand)], _neighbours([6 * 2.0**-126, 6.0, 1.5 * 2**127], 5)])
    amax = amax[np.isfinite(amax) & (amax >= np.float32(2.0**-126))].astype(np.float32)
    got = np.asarray(e8m0_from_amax(jnp.asarray(amax), "rceil")).astype(np.int64)
    s = ref.scale_exponent(amax, "rceil")
    np.testing.assert_array_equal(got, np.clip(s, -127, 127) + 127)


def test_subnormal_flush_threshold_of_the_nearest_kernel():
    # The kernel skips the per-element flush of float32 subnormals in tiles whose block scales
    # are all >= 2^-124 (round to nearest): there the largest subnormal lands below 0.25, code 0
    # like the flushed zero; at 2^-125 it would round to 0.5. (CPU flushes subnormals itself, so
    # this threshold is checked here in float64 and on the GPU by benchmarks/quantize.py.)
    largest_subnormal = 2.0**-126 - 2.0**-149
    assert largest_subnormal * 2.0**124 < 0.25 <= largest_subnormal * 2.0**125
    # what an unflushed subnormal in a 2^-125-scaled block would give: code 1 (0.5)
    assert np.array(largest_subnormal * 2.0**125).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) == 1


_stochastic_oracle = ref.stochastic_magnitude_ref


def test_stochastic_magnitude_matches_float64_model():
    rng = np.random.default_rng(2)
    a = np.concatenate([_neighbours(np.concatenate([GRID, TIES, [7.0, 7.99]]), 4), rng.uniform(0, 8, 50_000)]).astype(np.float32)
    a = a[(a == 0) | (a >= 2.0**-126)]  # float32 subnormals: CPU flushes them (kernels never see them)
    a = np.concatenate([a, a, a])
    u = np.concatenate([rng.uniform(0, 1, a.size // 3), np.zeros(a.size // 3), np.full(a.size // 3, 0.5)]).astype(np.float32)
    # u equal to the fraction itself (rounds down: the rule is u < frac)
    frac = ((a.astype(np.float64) - _stochastic_oracle(a, np.ones_like(a))) /
            np.where(a < 2, 0.5, np.where(a < 4, 1.0, 2.0))).astype(np.float32)
    a, u = np.concatenate([a, a]), np.concatenate([u, frac])
    got = np.asarray(e2m1_stochastic_magnitude(jnp.asarray(a), jnp.asarray(u)))
    np.testing.assert_array_equal(got, _stochastic_oracle(a, u))


# ------------------------------------------------------------------------ kernel inputs


def _random_blocks(rng, rows, nblocks):
    """Normal data with one random power-of-two magnitude per block, 2^-140 .. 2^127."""
    x = rng.standard_normal((rows, nblocks, 32)) * np.exp2(rng.integers(-140, 126, (rows, nblocks, 1)))
    return x.reshape(rows, nblocks * 32)


def _tie_blocks(scale_mode, dtype):
    """Blocks whose scaled values hit every E2M1 midpoint, both signs, and the grid points.

    For each block max in `maxima`, the reference gives the scale 2^s; the other 31 elements are
    +-(midpoint or grid point) x 2^s that do not exceed the max, so y = x / 2^s lands exactly on
    them (exact in bf16/f16 too: one or two significant bits).
    """
    maxima = [4.0, 5.0, 6.0, 7.0, 3.5, 2.0, 7.5]
    rows = []
    for p in (0, -3, 5):
        for m in maxima:
            m = m * 2.0**p
            s = ref.scale_exponent(np.array([m], np.float32), scale_mode)[0]
            vals = [v for v in np.concatenate([TIES, GRID]) if v * 2.0**s <= m]
            pad = (vals + [-v for v in vals] + [-0.0] * 31)[:31]
            rows.append(np.array([m] + pad) * np.where(np.arange(32) > 0, 2.0**s, 1.0))
            rows[-1][0] = m
    return np.stack(rows).reshape(-1, 96)  # 21 blocks


def _special_rows(dtype):
    """[8, 96]: zero, -0.0, NaN, +-Inf, subnormal, tiny-scale, huge blocks; dtype-aware values."""
    fi = ml_dtypes.finfo(jnp.dtype(dtype))
    big = float(fi.max)
    tiny = float(fi.smallest_subnormal) if dtype != jnp.bfloat16 else 2.0**-133
    x = np.zeros((8, 96))
    x[0, 32:64] = -0.0
    x[0, 64:] = np.linspace(-1, 1, 32) * 1e-3
    x[1, 3], x[1, 40], x[1, 70] = np.nan, np.inf, -np.inf
    x[1, 71:] = 1.5
    x[2, :32] = tiny * np.arange(-16, 16)  # subnormals (of float32 for float32, of bf16 for bf16)
    x[2, 32:64] = np.linspace(-1, 1, 32) * 1.5 * 2.0**-125  # block max 1.5 x 2^-125: scale 2^-127
    # the largest subnormal, flushed before the 2^127 multiply (else code 2; float16 subnormals are
    # normal float32 and kept)
    x[2, 40] = (2.0**-14 if dtype == jnp.float16 else 2.0**-126) - tiny
    x[2, 64:] = -tiny
    x[3, :32] = big * np.linspace(-1, 1, 32)
    x[3, 32:64] = -big
    x[3, 64:] = np.array([big, -0.0] * 16)
    x[4] = np.array([6.0, -6.0, 0.25, -0.25, 0.75, -0.75] * 16)
    x[5] = -np.abs(np.linspace(-1e-5, 1e-5, 96))  # negatives that round to zero keep the sign
    x[5, 0] = 1.0
    x[6] = np.arange(96) - 48.0
    x[7, :32] = 1e-30
    x[7, 32:] = -7.0
    if dtype == jnp.float32:
        x[3, 0] = 1.75 * 2.0**127
        x[3, 1] = 1.74 * 2.0**127
    return x


def _input(seed, dtype, scale_mode):
    rng = np.random.default_rng(seed)
    x = np.concatenate([_random_blocks(rng, 5, 3), _special_rows(dtype), _tie_blocks(scale_mode, dtype)])
    with np.errstate(over="ignore"):
        return jnp.asarray(x.astype(np.float32)).astype(dtype)


CFG = QuantizeConfig(rows=4, cols=64, num_warps=4)  # 4 x 2 blocks: rows and blocks both overhang


@pytest.mark.sweep(keep=2)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("scale_mode", MODES)
def test_nearest_bit_identical(scale_mode, dtype):
    x = _input(MODES.index(scale_mode), dtype, scale_mode)
    got = quantize_impl(x, None, axis=1, scale_mode=scale_mode, rounding="nearest", interpret=True, cfg=CFG)
    _same(got, _quantize_impl(x, None, axis=1, scale_mode=scale_mode, rounding="nearest"))
    codes, byte = ref.quantize_ref(np.asarray(x.astype(jnp.float32)), 1, scale_mode)
    np.testing.assert_array_equal(_bits(got[0]), ref.pack_ref(codes, 1))
    np.testing.assert_array_equal(_bits(got[1]), byte)


@pytest.mark.sweep(keep=2)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("scale_mode", MODES)
def test_stochastic_bit_identical(scale_mode, dtype):
    x = _input(10 + MODES.index(scale_mode), dtype, scale_mode)
    key = jax.random.key(MODES.index(scale_mode) + 7)
    got = quantize_impl(x, key, axis=1, scale_mode=scale_mode, rounding="stochastic", interpret=True, cfg=CFG)
    want = _quantize_impl(x, key, axis=1, scale_mode=scale_mode, rounding="stochastic")
    _same(got, want)
    # sign survives: a negative element rounded to magnitude 0 has code 0x8
    codes = ref.unpack_ref(_bits(got[0]), 1)
    xf = np.asarray(x.astype(jnp.float32))
    neg_zero = (np.signbit(xf) & ((codes & 7) == 0) & (np.repeat(_bits(got[1]), 32, 1) != 255))
    assert neg_zero.any() and (codes[neg_zero] == 8).all()


@pytest.mark.parametrize("key", [jax.random.key(3), jax.random.PRNGKey(77), jax.random.fold_in(jax.random.key(5), 9)],
                         ids=["typed", "raw", "folded"])
def test_threefry_uniform_equals_jax_random_uniform(key):
    kd = jax.random.key_data(key) if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) else key
    for shape in [(7, 3, 32), (1000, 32), (2, 2, 2, 32)]:
        want = np.asarray(jax.random.uniform(key, shape, jnp.float32)).ravel()
        got = np.asarray(jax.jit(threefry_uniform)(kd[0], kd[1], jnp.arange(want.size, dtype=jnp.uint32)))
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    assert kernel_rng_supported(key, 10) and not kernel_rng_supported(key, 2**32)
    assert not kernel_rng_supported(jax.random.key(0, impl="rbg"), 10)


@pytest.mark.sweep(keep=1)
@pytest.mark.parametrize("scale_mode,dtype", [("floor", jnp.float32), ("rceil", jnp.bfloat16), ("ceil", jnp.float16)],
                         ids=["floor-f32", "rceil-bf16", "ceil-f16"])
def test_stochastic_uniforms_in_kernel_bit_identical(scale_mode, dtype):
    x = _input(20 + MODES.index(scale_mode), dtype, scale_mode)
    for key in (jax.random.key(31), jax.random.PRNGKey(32)):
        got = quantize_impl(x, key, axis=1, scale_mode=scale_mode, rounding="stochastic", interpret=True, cfg=CFG)
        _same(got, _quantize_impl(x, key, axis=1, scale_mode=scale_mode, rounding="stochastic"))


def test_stochastic_with_given_uniforms_matches_float64_model():
    # quantize_2d with chosen uniforms (random, 0, 0.5, u == frac exactly) against the NumPy model.
    rng = np.random.default_rng(3)
    pattern = np.resize(np.concatenate([TIES, -TIES, GRID, -GRID, [5.5, -5.5, 0.1, -0.1]]), 128) * 0.5
    base = np.concatenate([rng.standard_normal((2, 128)), pattern[None], -pattern[None]]).astype(np.float32)
    x = np.tile(base, (4, 1))  # [16, 128]
    s = np.clip(ref.scale_exponent(np.abs(x).reshape(16, 4, 32).max(-1), "even"), -127, 127)
    y = x.reshape(16, 4, 32) / np.exp2(s)[..., None]
    a = np.abs(y)
    step = np.where(a < 2, 0.5, np.where(a < 4, 1.0, 2.0))
    frac = ((a - np.floor(a / step) * step) / step).reshape(16, 128)
    u = np.concatenate([rng.uniform(0, 1, (4, 128)), np.zeros((4, 128)), np.full((4, 128), 0.5), frac[12:]]).astype(np.float32)
    data, byte = quantize_2d(jnp.asarray(x), jnp.asarray(u), scale_mode="even", cfg=QuantizeConfig(2, 64), interpret=True)
    np.testing.assert_array_equal(np.asarray(byte), s + 127)
    mag = _stochastic_oracle(a, u.reshape(16, 4, 32))
    codes = (mag.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 7) | (np.signbit(y).astype(np.uint8) << 3)
    np.testing.assert_array_equal(np.asarray(data), ref.pack_ref(codes.reshape(16, 128).astype(np.uint8), 1))


@pytest.mark.sweep(keep=3)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize(
    "shape,axis,cfg",
    [
        ((1, 32), 1, None),  # one block, tile shrunk to the array
        ((13, 224), 1, QuantizeConfig(rows=4, cols=128)),  # 7 blocks per row: both edges masked
        ((3, 64, 5), 1, QuantizeConfig(rows=2, cols=32, num_warps=1)),  # middle axis (moveaxis)
        ((96, 6), 0, QuantizeConfig(rows=8, cols=256)),  # leading axis, tile wider than K
        ((2, 3, 160), -1, None),  # batch dims, default tile
    ],
)
def test_ragged_shapes_axes_and_tiles(shape, axis, cfg, rounding):
    rng = np.random.default_rng(sum(shape))
    x = jnp.asarray(rng.standard_normal(shape) * np.exp2(rng.integers(-20, 20, shape)), jnp.bfloat16)
    # stochastic: a threefry key (uniforms generated in the kernel) and an rbg key (uniforms read)
    keys = (jax.random.key(5), jax.random.key(5, impl="rbg")) if rounding == "stochastic" else (None,)
    for key in keys:
        want = _quantize_impl(x, key, axis=axis % x.ndim, scale_mode="even", rounding=rounding)
        got = quantize_impl(x, key, axis=axis % x.ndim, scale_mode="even", rounding=rounding, interpret=True, cfg=cfg)
        _same(got, want)


def test_quantize_2d_and_impl_refuse_bad_arguments():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_2d(jnp.zeros((4, 48)), interpret=True)
    with pytest.raises(ValueError, match="2-D"):
        quantize_2d(jnp.zeros((4, 2, 32)), interpret=True)
    with pytest.raises(ValueError, match="not both"):
        quantize_2d(jnp.zeros((4, 32)), jnp.zeros((4, 32)), key_data=jnp.zeros(2, jnp.uint32), interpret=True)


def test_inputs_too_large_for_int32_offsets_take_the_reference(monkeypatch):
    """quantize() routes inputs the kernel's int32 offsets cannot address to the reference; the
    kernel itself refuses them with a clear error."""
    import jax_mxfp4.kernels.quantize_kernel as fused

    monkeypatch.setattr(fused, "MAX_KERNEL_ELEMENTS", 64 * 96)
    assert fused.fast_path_enabled("cuda", 64 * 96 - 1)
    assert not fused.fast_path_enabled("cuda", 64 * 96)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((64, 96)), jnp.float32)
    with pytest.raises(ValueError, match="int32"):
        fused.quantize_impl(x, None, axis=1, scale_mode="ceil", rounding="nearest", interpret=True)


def test_fast_path_on_gpus_for_both_roundings(monkeypatch):
    assert not fast_path_enabled("cpu")
    assert fast_path_enabled("cuda") and fast_path_enabled("rocm")
    monkeypatch.setenv("JAX_MXFP4_KERNELS", "0")
    assert not fast_path_enabled("cuda")


def test_config_validation():
    for bad in (dict(cols=96), dict(cols=16), dict(rows=3), dict(num_warps=3), dict(swar=1)):
        with pytest.raises(ValueError, match="QuantizeConfig"):
            QuantizeConfig(**bad)
    assert QuantizeConfig() == QuantizeConfig(rows=8, cols=512, num_warps=4, swar=False)


# ------------------------------------------------------------------------ the Hopper bfloat16 form (swar)

VARIANTS = {
    "swar": QuantizeConfig(rows=4, cols=64, swar=True),
}


def test_swar_word_program_on_every_bfloat16_pair():
    """The SWAR word program (the instructions of the inline PTX, emulated) equals the float32
    magic-add code of the plain kernel for every finite bfloat16 magnitude in both lanes, for
    every block scale exponent s that can hold it (y = |x| 2^-s <= 8), with signs and the subnormal
    flush; NaN/Inf blocks give byte 0."""
    from jax_mxfp4.kernels import quantize_kernel as fq

    u32 = jnp.uint32
    mags = np.arange(0, 0x7F80, dtype=np.uint32)  # every finite bfloat16 magnitude
    rng = np.random.default_rng(21)
    lo_lane = mags | (rng.integers(0, 2, mags.size, dtype=np.uint32) << 15)
    hi_lane = rng.permutation(mags) | (rng.integers(0, 2, mags.size, dtype=np.uint32) << 15)
    w = jnp.asarray(lo_lane | (hi_lane << 16))

    @jax.jit
    def check(s):
        lo, hi, p, c, sg = fq.swar_block_operands(jnp.full(w.shape, s, jnp.int32), jnp.zeros(w.shape, bool))
        got = fq.swar_word_emulated(w, lo, hi, p, c, sg) & u32(0xFF)
        inv = fq.pow2_from_exponent(-jnp.full(w.shape, s, jnp.int32))
        want = jnp.zeros_like(w)
        ok = jnp.ones(w.shape, bool)
        for shift, nib in ((0, 0), (16, 4)):
            lane = (w >> u32(shift)) & u32(0xFFFF)
            a_bits = lax_bitcast((lane & u32(0x7FFF)) << u32(16))
            code = fq.magnitude_code_bits(a_bits, inv, flush=True).astype(u32) | ((lane >> u32(12)) & u32(8))
            want = want | (code << u32(nib))
            y = jax.lax.bitcast_convert_type(jnp.where(a_bits < 0x00800000, 0, a_bits), jnp.float32) * inv
            ok = ok & (y <= 8.0)
        return jnp.sum(jnp.where(ok, got != want, False)), jnp.sum(ok)

    def lax_bitcast(v):
        return jax.lax.bitcast_convert_type(v, jnp.int32)

    covered = 0
    for s in list(range(-127, -118)) + list(range(-40, 41, 3)) + list(range(118, 127)):
        bad, n = check(s)
        assert int(bad) == 0, f"s={s}: {int(bad)} mismatched bytes"
        covered += int(n)
    assert covered > 10 * mags.size
    # NaN/Inf blocks: byte 0 whatever the word
    lo, hi, p, c, sg = fq.swar_block_operands(jnp.full(w.shape, 126, jnp.int32), jnp.ones(w.shape, bool))
    nan_words = w | u32(0x7F807F80)
    assert not np.asarray(fq.swar_word_emulated(nan_words, lo, hi, p, c, sg) & u32(0xFF)).any()


def test_swar_ptx_text_matches_the_emulated_program():
    from jax_mxfp4.kernels import quantize_kernel as fq

    ptx = fq._SWAR_PTX
    assert ptx.count("fma.rn.bf16x2") == 4 and ptx.count("min.u16x2") == 8 and ptx.count("max.u16x2") == 4
    # operands: $0 the 4 result bytes, $1..$24 the 6 inputs x 4 words; every one is referenced
    for i in range(25):
        assert f"${i}," in ptx or f"${i};" in ptx or f"${i} " in ptx, i
    assert "$25" not in ptx


def test_swar_ptx_assembles_for_sm90():
    """The SWAR asm body, its $N operands as registers, in a one-thread kernel: ptxas accepts it
    for sm_90 (skipped without ptxas)."""
    import shutil
    import subprocess
    import tempfile

    from jax_mxfp4.kernels import quantize_kernel as fq

    ptxas = shutil.which("ptxas")
    if ptxas is None:
        pytest.skip("no ptxas")
    body = re.sub(r"\$(\d+)", lambda m: f"%p{m.group(1)}", fq._SWAR_PTX)
    moves = "\n".join(f"mov.b32 %p{i}, {i * 77};" for i in range(1, 25))
    ptx = (".version 8.0\n.target sm_90\n.address_size 64\n.visible .entry k(.param .u64 out)\n{\n"
           f".reg .b32 {', '.join(f'%p{i}' for i in range(25))};\n.reg .b64 %a;\n{moves}\n{body}\n"
           "ld.param.u64 %a, [out];\nst.global.u32 [%a], %p0;\nret;\n}\n")
    with tempfile.TemporaryDirectory() as d:
        src = f"{d}/swar.ptx"
        with open(src, "w") as f:
            f.write(ptx)
        r = subprocess.run([ptxas, "-arch=sm_90", src, "-o", f"{d}/swar.cubin"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def _fresh_input(seed, dtype, rows=8, k=128):
    """Random blocks over the dtype's whole exponent range, plus -0.0, NaN/Inf and subnormal
    blocks and E2M1 ties at random places."""
    import ml_dtypes as mld

    rng = np.random.default_rng(seed)
    fi = mld.finfo(jnp.dtype(dtype))
    lo_e, hi_e = (-24, 15) if dtype == jnp.float16 else (-140, 127)
    x = rng.standard_normal((rows, k // 32, 32)) * np.exp2(rng.integers(lo_e, hi_e, (rows, k // 32, 1)))
    x = x.reshape(rows, k)
    x[0, :32] = -0.0
    x[0, 32:64] = float(fi.smallest_subnormal) * rng.integers(-40, 40, 32)
    x[1, rng.integers(0, k)] = np.nan
    x[2, rng.integers(0, k)] = -np.inf
    x[3, rng.integers(0, k, 8)] = rng.choice(TIES, 8) * rng.choice([-1, 1], 8)
    x[4, :32] = rng.choice(np.concatenate([TIES, GRID, -TIES, -GRID]), 32) * 2.0**-126  # subnormal-ish scale
    with np.errstate(over="ignore"):
        return jnp.asarray(x.astype(np.float32)).astype(dtype)


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_variants_nearest_bit_identical(variant, dtype):
    cfg = VARIANTS[variant]
    for scale_mode in MODES:
        x = jnp.concatenate([_input(30 + MODES.index(scale_mode), dtype, scale_mode),
                             _fresh_input(40 + MODES.index(scale_mode), dtype, k=96)])
        got = quantize_impl(x, None, axis=1, scale_mode=scale_mode, rounding="nearest", interpret=True, cfg=cfg)
        _same(got, _quantize_impl(x, None, axis=1, scale_mode=scale_mode, rounding="nearest"))


def _triton_modules(monkeypatch):
    """Record the Triton module (text) of every Pallas kernel lowered from now on, each verified:
    a module that would not parse on the GPU (e.g. an op result of unsigned type ``ui8``, which
    ``tt.elementwise_inline_asm`` refuses) fails here."""
    from jax._src.pallas.triton import pallas_call_registration as reg

    texts = []
    lower = reg.lowering.lower_jaxpr_to_triton_module

    def recording(*args, **kwargs):
        res = lower(*args, **kwargs)
        op = res.module.operation
        assert op.verify()
        texts.append(op.get_asm())
        return res

    monkeypatch.setattr(reg.lowering, "lower_jaxpr_to_triton_module", recording)
    return texts


LOWER_VARIANTS = {**VARIANTS, "portable": QuantizeConfig(rows=4, cols=64)}


@pytest.mark.parametrize("variant", list(LOWER_VARIANTS))
def test_variants_lower_to_triton(variant, monkeypatch):
    """Each formulation lowers to Triton IR for CUDA (no GPU needed: cross-platform lowering); the
    module verifies and holds no unsigned integer type (Triton types are signless); swar's inline
    asm returns signless i8."""
    cfg = LOWER_VARIANTS[variant]
    texts = _triton_modules(monkeypatch)
    for dtype in (jnp.bfloat16, jnp.float32):
        x = jax.ShapeDtypeStruct((40 + len(texts), 224), dtype)  # ragged: masked loads and stores; fresh shape
        jax.jit(lambda x: quantize_2d(x, scale_mode="rceil", cfg=cfg)).trace(x).lower(lowering_platforms=("cuda",))
    assert len(texts) == 2
    for text in texts:
        assert not re.search(r"\bui(8|16|32|64)\b|xui\d", text), [ln for ln in text.splitlines() if "ui" in ln][:3]
    asm = [ln for ln in texts[0].splitlines() if "tt.elementwise_inline_asm" in ln]
    if cfg.swar:  # bf16 (texts[0]) takes the asm; float32 ignores swar
        assert len(asm) == 1 and re.search(r"-> tensor<[0-9x]+xi8>", asm[0]), asm
    else:
        assert not asm


def test_default_config_takes_swar_for_bfloat16_on_hopper_only(monkeypatch):
    """The SWAR word program is the bfloat16 default only where the default device is an NVIDIA
    GPU of compute capability >= 9.0; elsewhere, and for other dtypes, not."""
    from jax_mxfp4 import platform
    from jax_mxfp4.kernels import quantize_kernel as fq

    assert not fq.default_config(jnp.bfloat16).swar  # this CPU machine
    for cc, want in (((9, 0), True), ((10, 0), True), ((8, 9), False), ((8, 0), False), (None, False)):
        monkeypatch.setattr(platform, "compute_capability", lambda cc=cc: cc)
        assert fq.default_config(jnp.bfloat16).swar is want, cc
        assert not fq.default_config(jnp.float32).swar and not fq.default_config(jnp.float16).swar
        base = fq.DEFAULT_CONFIGS["bfloat16"]
        got = fq.default_config(jnp.bfloat16)
        assert (got.rows, got.cols, got.num_warps) == (base.rows, base.cols, base.num_warps)


@pytest.mark.parametrize("kw", [dict(rows=2.0), dict(cols="128"), dict(rows=True), dict(num_warps=64),
                                dict(num_warps=np.array([4])), dict(swar="yes")])
def test_config_fields_of_the_wrong_kind_named(kw):
    """QuantizeConfig names the field and the rule for every field of the wrong type or value
    (floats, one-element arrays, out-of-range values such as num_warps=64)."""
    name = next(iter(kw))
    with pytest.raises(ValueError, match=f"QuantizeConfig.{name} must be"):
        QuantizeConfig(**kw)
    c = QuantizeConfig(rows=np.int64(8), swar=np.bool_(True))
    assert type(c.rows) is int and c.swar is True


def test_direct_kernel_calls_refuse_what_quantize_refuses():
    """quantize_impl / default_config called directly name the argument and the rule: integer
    inputs, an unknown rounding, an unsupported dtype, an empty input."""
    from jax_mxfp4.kernels import quantize_kernel as fq

    x = jnp.ones((4, 64), jnp.bfloat16)
    # (a float64 NumPy input reaches quantize_impl, a jitted function, as float32 with x64 off)
    with pytest.raises(TypeError, match="quantize_impl: x must be a float32, bfloat16 or float16 array"):
        quantize_impl(np.ones((4, 64), np.int8), None, axis=1, scale_mode="even", rounding="nearest", interpret=True)
    with pytest.raises(ValueError, match="quantize_impl: rounding must be one of"):
        quantize_impl(x, None, axis=1, scale_mode="even", rounding="bogus", interpret=True)
    with pytest.raises(ValueError, match="quantize_impl: scale_mode must be one of"):
        quantize_impl(x, None, axis=1, scale_mode="up", rounding="nearest", interpret=True)
    with pytest.raises(ValueError, match="quantize_impl: x of shape \\(0, 64\\) is empty"):
        quantize_impl(jnp.zeros((0, 64), jnp.bfloat16), None, axis=1, scale_mode="even", rounding="nearest",
                      interpret=True)
    for bad in (jnp.int8, jnp.float64, jnp.complex64, None, "<U3"):
        with pytest.raises(TypeError, match="default_config: dtype must be one of"):
            fq.default_config(bad)


@pytest.mark.parametrize("shape,axis", [((4, 0), 1), ((0, 64), 1), ((0, 64), 0)])
def test_empty_input_takes_the_reference_path_on_a_gpu(monkeypatch, shape, axis):
    """mx.quantize of an empty array on a GPU platform: the reference path (the kernel has no grid;
    no ZeroDivisionError), same result as on CPU."""
    import importlib

    import jax_mxfp4 as mx

    qmod = importlib.import_module("jax_mxfp4.quantize")  # the module (the package exports a function of that name)

    x = jnp.zeros(shape, jnp.bfloat16)
    want = mx.quantize(x, axis)
    monkeypatch.setattr(qmod, "current_platform", lambda: "cuda")
    assert not qmod.fused_path(x)
    got = jax.eval_shape(lambda a: mx.quantize(a, axis), x)
    assert got.data.shape == want.data.shape and got.scales.shape == want.scales.shape
