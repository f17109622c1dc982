"""E5M2 codes on the FP8 path (jax_mxfp4/fp8_format.py): the training passes encode their
gradient operand as float8_e5m2 codes x a power of two per row, whose 29-binade window takes the
gradient rows that spread past E4M3's 15 binades without the exact-row recompute.

Oracles: ml_dtypes' float8 types for the windows, tests/mx_reference.py (NumPy float64) for
values and products. Edge cases named: spans 0, 14, 15, 28 and 29 binades; the window's ends
d = -15 and d = 13; the smallest and largest scale bytes a row can hold; NaN scale bytes; both
operands E5M2 (refused).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_mxfp4 as mx
from jax_mxfp4 import training
from jax_mxfp4.backends import fp8 as fp8_backend
from jax_mxfp4.fp8_format import E4M3, E5M2, FLAG_EXACT, FLAG_NAN, format_named, format_of
from jax_mxfp4.fp8_prepared import FP8Prepared, decode_rows, encode_rows, prepare_fp8, to_fp8
from jax_mxfp4.kernels import fp8_fix
from jax_mxfp4.kernels import fp8_quantize as fq
from mx_reference import dequantize_ref, pack_ref

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
ML = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}
DN = (((2,), (2,)), ((0,), (0,)))


def _exact_in(dtype, v: np.ndarray) -> bool:
    return bool(np.all(v.astype(dtype).astype(np.float64) == v))


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_window_is_exactly_where_every_e2m1_value_fits(fmt):
    """Every E2M1 value x 2^d is a value of the format for d in [d_min, d_max] and not for
    d_min - 1 (0.5 x 2^d or 1.5 x 2^d below the smallest subnormal step) or d_max + 1 (6 x 2^d
    above the largest finite value): ml_dtypes decides."""
    dt = ML[fmt.name]
    for d in range(fmt.d_min, fmt.d_max + 1):
        assert _exact_in(dt, E2M1 * 2.0**d), d
    assert not _exact_in(dt, E2M1 * 2.0 ** (fmt.d_min - 1))
    assert not _exact_in(dt, E2M1 * 2.0 ** (fmt.d_max + 1))
    assert (fmt.window_span, fmt.row_exp_offset) == {"e4m3": (14, 133), "e5m2": (28, 140)}[fmt.name]
    assert format_of(fmt.dtype) is fmt and format_named(fmt.name) is fmt


def test_format_names_and_dtypes_are_checked():
    with pytest.raises(ValueError, match="fmt must be one of"):
        format_named("e3m4")
    with pytest.raises(TypeError, match="float8_e4m3fn or float8_e5m2"):
        format_of(jnp.float16)
    data, sb = jnp.zeros((2, 16), jnp.uint8), jnp.full((2, 1), 127, jnp.uint8)
    with pytest.raises(ValueError, match="fmt must be one of"):
        encode_rows(data, sb, "E5M2")
    with pytest.raises(ValueError, match="fmt must be one of"):
        fq.quantize_fp8_2d(jnp.ones((2, 32)), fmt="fp8", interpret=True)


def _rows_with_spans(rng, spans, nb=8, top=140):
    """Codes [R, nb*32] (nonzero in every block) and scale bytes [R, nb]: row i's bytes run from
    top down to top - spans[i] (both ends present)."""
    r = len(spans)
    codes = rng.integers(1, 16, (r, nb * 32)).astype(np.uint8)
    codes[:, ::32] = rng.choice([1, 7, 9, 15], (r, nb))  # 0.5 and 6 at both ends of the window
    sb = np.empty((r, nb), np.int64)
    for i, s in enumerate(spans):
        sb[i] = rng.integers(top - s, top + 1, nb)
        sb[i, 0], sb[i, -1] = top, top - s
    return codes, sb.astype(np.uint8)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_encode_rows_flags_values_and_round_trip(fmt, rng):
    """Rows spanning 0..40 binades: a row is flagged exactly when its span exceeds the format's
    window; an unflagged row's codes x 2^row_exp equal the reference's dequantized values; a
    flagged row holds the E2M1 values (d = 0); decode_rows gives the packed data back bit for
    bit. Also rows at large (250) and small (2..12) scale bytes, and one with a NaN scale byte."""
    f = format_named(fmt)
    spans = [0, 7, 14, 15, 21, 27, 28, 29, 40]
    codes, sb = _rows_with_spans(rng, spans)
    extra_c, extra_s = _rows_with_spans(rng, [0, 10, 3], top=250)
    extra_s[1] = rng.integers(2, 13, extra_s.shape[1])
    extra_s[2, 3] = 0xFF  # NaN block
    codes, sb = np.concatenate([codes, extra_c]), np.concatenate([sb, extra_s])
    data = pack_ref(codes, 1)
    got_c, got_e, got_f = encode_rows(jnp.asarray(data), jnp.asarray(sb), fmt)
    assert got_c.dtype == f.dtype
    c64 = np.asarray(got_c).astype(np.float64)
    e, flags = np.asarray(got_e), np.asarray(got_f)
    want_flag = np.array([s > f.window_span for s in spans] + [False, False, False])
    np.testing.assert_array_equal((flags & FLAG_EXACT) != 0, want_flag)
    np.testing.assert_array_equal((flags & FLAG_NAN) != 0, np.arange(len(flags)) == len(flags) - 1)
    ref = dequantize_ref(codes, sb, 1)
    plain = ~want_flag
    plain[-1] = False  # the NaN row: every output NaN, whatever its codes
    np.testing.assert_array_equal(c64[plain] * 2.0 ** e[plain, None], ref[plain])
    signed = E2M1[codes & 7] * np.where(codes & 8, -1.0, 1.0)
    np.testing.assert_array_equal(c64[want_flag], signed[want_flag])
    np.testing.assert_array_equal(np.asarray(decode_rows(got_c, jnp.asarray(sb), got_e, got_f)), data)


def _operand(rng, shape, spans):
    """A canonical MXFP4Array [1, R, K] whose row i spans spans[i % len] binades, and its codes/bytes."""
    r, k = shape
    codes, sb = _rows_with_spans(rng, [spans[i % len(spans)] for i in range(r)], nb=k // 32, top=135)
    x = mx.MXFP4Array(jnp.asarray(pack_ref(codes, 1))[None], jnp.asarray(sb).view(jnp.float8_e8m0fnu)[None],
                      2, (1, r, k), jnp.float32)
    return x, codes[None], sb[None]


@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_fp8_gemm_with_an_e5m2_operand_equals_xla_and_reference(out_dtype, rng):
    """fp8_gemm with lhs E5M2 (rows spanning 0-28 binades: none flagged; 29 and 35: flagged)
    and rhs E4M3 (spans up to 14), and the reverse order: on CPU (float32 accumulation of exact
    products) the result equals backend "xla" bit for bit and the float64 reference to float32
    accumulation error."""
    spans = [0, 14, 15, 22, 28, 29, 35]
    a, ca, sa = _operand(rng, (24, 256), spans)
    b, cb, sbb = _operand(rng, (20, 256), [0, 5, 14])
    ea = to_fp8(a, "e5m2")
    row_span = np.array([spans[i % len(spans)] for i in range(24)])
    np.testing.assert_array_equal((np.asarray(ea.row_flag)[0] & FLAG_EXACT) != 0, row_span > 28)
    np.testing.assert_array_equal((np.asarray(prepare_fp8(a).row_flag)[0] & FLAG_EXACT) != 0, row_span > 14)
    xla = mx.Recipe(backend="xla")
    ref = np.einsum("bmk,bnk->bmn", dequantize_ref(ca, sa, 2), dequantize_ref(cb, sbb, 2))
    mag = np.einsum("bmk,bnk->bmn", np.abs(dequantize_ref(ca, sa, 2)), np.abs(dequantize_ref(cb, sbb, 2)))
    for lhs, rhs, want_t in ((ea, b, False), (b, ea, True)):
        got = np.asarray(fp8_backend.fp8_gemm(lhs, rhs, out_dtype, "default", "cpu"), np.float64)
        plain = np.asarray(mx.dot_general(*((b, a) if want_t else (a, b)), DN, preferred_element_type=out_dtype,
                                          recipe=xla), np.float64)
        np.testing.assert_array_equal(got, plain)
        r = np.swapaxes(ref, 1, 2) if want_t else ref
        m = np.swapaxes(mag, 1, 2) if want_t else mag
        tol = 2.0**-8 if out_dtype == jnp.bfloat16 else 2.0**-20
        assert np.all(np.abs(got - r) <= tol * m + 1e-300)


def test_two_e5m2_operands_take_the_fp8_path_with_an_e4m3_rhs(rng):
    """FP8 tensor cores multiply E4M3 x E5M2 at most: two E5M2 operands (hand-made; training never
    makes them) are planned on "fp8" like any pair, which re-encodes the rhs as E4M3 (its rows past
    14 binades then flagged for the exact path): equal to backend "xla" bit for bit on CPU."""
    a, _, _ = _operand(rng, (24, 128), [0, 20, 28])
    b, _, _ = _operand(rng, (16, 128), [3, 22])
    ea, eb = to_fp8(a, "e5m2"), to_fp8(b, "e5m2")
    assert mx.explain(ea, eb, DN, recipe=mx.Recipe(backend="fp8")).backend == "fp8"
    got = mx.dot_general(ea, eb, DN, recipe=mx.Recipe(backend="fp8"))
    want = mx.dot_general(a, b, DN, recipe=mx.Recipe(backend="xla"))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_to_fp8_and_fp8prepared_name_bad_input(rng):
    a, _, _ = _operand(rng, (4, 64), [0])
    with pytest.raises(TypeError, match="to_fp8 takes an MXFP4Array, got ArrayImpl"):
        to_fp8(jnp.ones((4, 64)), "e5m2")
    with pytest.raises(TypeError, match="to_fp8 takes an MXFP4Array, got FP8Prepared"):
        to_fp8(prepare_fp8(a), "e5m2")
    for fmt in (["e5m2"], None, 3, "E5M2"):
        with pytest.raises(ValueError, match="fmt must be one of"):
            to_fp8(a, fmt)
    p = to_fp8(a, "e5m2")
    assert "fmt='e5m2'" in repr(p) and "fmt='e4m3'" in repr(prepare_fp8(a))
    with pytest.raises(ValueError, match="codes must be float8_e4m3fn .*or float8_e5m2 for a gradient"):
        FP8Prepared(p.codes.astype(jnp.float16), p.scales, p.row_exp, p.row_flag, 2, p.shape, p.dtype)


def test_fp8_operand_in_a_deferred_branch_exports(rng):
    """A program lowered for several platforms defers the other platforms' GEMM branches to the
    partitioned primitive, which carries MXFP4Arrays: an FP8Prepared operand (E4M3 or E5M2) reaches
    it as its exact MXFP4Array, and the program exports for CPU and CUDA (lowered on this host)."""
    from jax_mxfp4.ffi import export_safety_checks

    a, _, _ = _operand(rng, (256, 256), [0, 20])
    b, _, _ = _operand(rng, (256, 256), [3])
    f = jax.jit(lambda x, y: mx.dot_general(x, y, DN))
    for pa in (prepare_fp8(a), to_fp8(a, "e5m2")):
        exp = jax.export.export(f, platforms=["cpu", "cuda"], disabled_checks=export_safety_checks())(pa, b)
        got = exp.call(pa, b)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(f(a, b)))


@pytest.mark.sweep(keep=1)
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_fix_flagged_kernel_reads_e5m2_codes(out_dtype, rng):
    """The CUDA fix kernel (Pallas interpreter) recomputes the rows that even E5M2 leaves
    flagged (span 29, 40) from E5M2 codes, and columns from E4M3 codes: the flagged entries equal
    the exact path's (backend "xla"), the others keep the FP8 result."""
    a, ca, sa = _operand(rng, (40, 128), [0, 20, 29, 40, 28])
    b, cb, sbb = _operand(rng, (24, 128), [3, 14, 15])  # span 15: flagged columns
    pa, pb = to_fp8(a, "e5m2"), prepare_fp8(b)
    out = jnp.asarray(rng.standard_normal((1, 40, 24)), out_dtype)  # stands for the FP8 result
    sb = lambda p: jnp.asarray(p.scales).view(jnp.uint8)  # noqa: E731
    got = fp8_fix.fix_flagged(out, pa.codes, sb(pa), pa.row_exp, pa.row_flag, pb.codes, sb(pb), pb.row_exp,
                              pb.row_flag, interpret=True)
    exact = mx.dot_general(a, b, DN, preferred_element_type=out_dtype, recipe=mx.Recipe(backend="xla"))
    fl = (np.asarray(pa.row_flag)[0] & FLAG_EXACT) != 0
    fr = (np.asarray(pb.row_flag)[0] & FLAG_EXACT) != 0
    assert fl.sum() == 16 and fr.sum() == 8
    mask = fl[:, None] | fr[None, :]
    g, x, o = (np.asarray(v, np.float64)[0] for v in (got, exact, out))
    mag = np.einsum("mk,nk->mn", np.abs(dequantize_ref(ca, sa, 2))[0], np.abs(dequantize_ref(cb, sbb, 2))[0])
    # exact products, float32 accumulation in another order (then one rounding to out_dtype)
    rel = 2.0**-16 if out_dtype == jnp.float32 else 2.0**-7
    assert np.all(np.abs(g[mask] - x[mask]) <= rel * mag[mask])
    np.testing.assert_array_equal(g[~mask], o[~mask])


@pytest.mark.sweep(keep=1)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_fused_kernel_e5m2_equals_quantize_then_encode(rounding, rng):
    """quantize_fp8_2d(fmt="e5m2") in the interpreter: codes, scales, row_exp and row_flag equal
    encode_rows(quantize(x), "e5m2"), on rows of float data spanning 0-40 binades (plain tiles and
    the general path: a row of float32 subnormals and a NaN)."""
    r, k = 12, 128
    x = rng.standard_normal((r, k)).astype(np.float32)
    x *= np.float32(2.0) ** rng.integers(-12, 13, (r, k // 32)).repeat(32, 1).astype(np.float32)
    x[3, :32] *= np.float32(2.0**-20)  # span about 30
    x[4, 96:] *= np.float32(2.0**20)
    x[5] = np.float32(1e-39)
    x[6, 7] = np.nan
    key = jax.random.key(int(rng.integers(2**31))) if rounding == "stochastic" else None
    kd = jax.random.key_data(key) if key is not None else None
    got = fq.quantize_fp8_2d(jnp.asarray(x), kd, scale_mode="even", interpret=True, fmt="e5m2")
    q = mx.quantize(jnp.asarray(x.reshape(r, k // 32, 32)).reshape(r, k), 1, rounding=rounding, key=key)
    want_c, want_e, want_f = encode_rows(q.data, q.plain_scales(), "e5m2")
    assert got[0].dtype == jnp.float8_e5m2
    np.testing.assert_array_equal(np.asarray(got[0]).view(np.uint8), np.asarray(want_c).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(got[1]).view(np.uint8), np.asarray(q.plain_scales()).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(want_e))
    np.testing.assert_array_equal(np.asarray(got[3]), np.asarray(want_f))


def _wide_gradient_case(rng, t=64, k=64, n=96):
    """x [T, K], w [K, N] and a cotangent whose rows (tokens) span about 20 binades along N and
    whose columns span about 20 binades along the tokens: every gradient row is flagged as E4M3
    and fits E5M2."""
    x = jnp.asarray(rng.standard_normal((t, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((k, n)) * 0.1, jnp.float32)
    ct = rng.standard_normal((t, n)) * 2.0 ** rng.integers(-10, 11, (t // 32 + 1, n // 32 + 1)).repeat(32, 0).repeat(32, 1)[:t, :n]
    ct[:, :32] *= 2.0**-9
    ct[:32] *= 2.0**9
    return x, w, jnp.asarray(ct, jnp.float32)


@pytest.mark.sweep(keep=1)
@pytest.mark.parametrize("fused", [False, True])
def test_training_gradient_rows_take_the_fp8_gemm_as_e5m2(monkeypatch, fused, rng):
    """Recipe(backend="fp8") on CPU with gradient rows spanning ~20 binades: dgrad and wgrad
    hand the fp8 GEMM an E5M2 gradient operand (unfused passes and the fused kernel in the
    interpreter), no row of it is flagged for the exact recompute, and the gradients equal
    backend "xla"'s bit for bit (the same quantized values; float32 accumulation of exact
    products on CPU)."""
    monkeypatch.setattr(training, "_FUSED_INTERPRET", fused)
    x, w, ct = _wide_gradient_case(rng)
    seen, counts = [], []
    orig = fp8_backend._fix_flagged

    def spy(out, lhs, rhs, fl, fr, platform="cpu"):  # formats at trace time, flag counts at run time
        fmts = tuple(v.fmt if isinstance(v, FP8Prepared) else "e4m3" for v in (lhs, rhs))
        seen.append(fmts)
        jax.debug.callback(lambda a, b, fmts=fmts: counts.append((fmts, int(a), int(b))), fl.sum(), fr.sum())
        return orig(out, lhs, rhs, fl, fr, platform)

    jax.clear_caches()  # fp8_gemm traced afresh, through the spy
    monkeypatch.setattr(fp8_backend, "_fix_flagged", spy)
    key = jax.random.key(int(rng.integers(2**31)))

    def grads(recipe):
        f = lambda x, w: jnp.vdot(mx.dense(x, w, recipe=recipe, key=key), ct)  # noqa: E731
        return jax.grad(f, argnums=(0, 1))(x, w)

    g8 = grads(mx.Recipe(backend="fp8"))
    jax.effects_barrier()
    # fprop: E4M3 x E4M3; dgrad dY x W and wgrad X x dY: one E5M2 operand each
    assert sorted(seen) == [("e4m3", "e4m3"), ("e4m3", "e5m2"), ("e5m2", "e4m3")], seen
    assert len(counts) == 3
    for fmts, n_l, n_r in counts:
        for fmt, n in zip(fmts, (n_l, n_r)):
            if fmt == "e5m2":
                assert n == 0, "a gradient row inside E5M2's window was flagged"
    gx = grads(mx.Recipe(backend="xla"))
    for a, b in zip(g8, gx):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # the same gradient as E4M3 codes would have flagged rows: the case exercises the window
    gq = mx.quantize(ct[None], 2)
    assert ((np.asarray(fp8_backend.as_fp8(gq, "cpu").row_flag) & FLAG_EXACT) != 0).any()


def test_fused_route_hands_an_e5m2_operand_to_the_gemm(monkeypatch):
    """With the fused passes (interpreter), the backward's quantize-to-FP8 kernels emit E5M2
    codes for dY and no E4M3 kernel runs for it (jaxpr of the gradient)."""
    monkeypatch.setattr(training, "_FUSED_INTERPRET", True)
    x, w = jnp.ones((32, 64), jnp.float32), jnp.ones((64, 96), jnp.float32)
    key = jax.random.key(0)
    f = lambda x, w: jnp.sum(mx.dense(x, w, recipe=mx.Recipe(backend="fp8"), key=key))  # noqa: E731
    jaxpr = str(jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(x, w))
    outs = re.findall(r"f8_e5m2\[\d+,\d+,32\]", jaxpr)
    assert len(outs) >= 2, "dgrad and wgrad each quantize dY to E5M2"


def test_e5m2_quantizer_lowers_for_cuda():
    """Triton lowering from this CPU host (no GPU needed) of the fused quantizer writing E5M2
    codes (round to nearest and in-kernel Philox); the fix kernel reading them: tests/test_fp8_fix.py."""
    sds = jax.ShapeDtypeStruct
    x = sds((33, 96), jnp.bfloat16)
    for args in ((x,), (x, sds((4,), jnp.uint32))):
        traced = jax.jit(lambda *a: fq.quantize_fp8_2d(*a, fmt="e5m2")).trace(*args)
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
        assert "triton" in text and "f8E5M2" in text
