"""Backend "fp8" (MXFP4 rows as E4M3 codes x a power of two) and FP8Prepared, on CPU.

XLA on CPU converts FP8 codes to float32 before its dot, so here the path must equal backend
"xla" bit for bit wherever both sum the same float32 products (power-of-two row/column factors
do not change float32 rounding of normal values), and equal the float64 reference where the
partial sums are exact. Operands are built from explicit E2M1 codes and E8M0 bytes so that each
window case (d = -8, d = 6, span 15, ...) is hit on purpose; the oracle is tests/mx_reference.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_mxfp4 as mx
from jax_mxfp4 import checks, dispatch
from jax_mxfp4.backends import fp8 as fp8_backend
from jax_mxfp4.backends.base import GemmProblem
from jax_mxfp4.fp8_prepared import FP8Prepared, prepare_fp8
from mx_reference import dequantize_ref, pack_ref

FP8 = mx.Recipe(backend="fp8")
XLA = mx.Recipe(backend="xla")
DN = (((2,), (2,)), ((0,), (0,)))  # canonical [B, M, K] x [B, N, K]


def mk(codes, sbytes, axis=-1):
    """MXFP4Array from 4-bit codes [..., K] and scale bytes [..., K/32] (quantized along axis)."""
    codes = np.asarray(codes, np.uint8)
    axis = axis % codes.ndim
    data = pack_ref(codes, axis)
    scales = jnp.asarray(np.asarray(sbytes, np.uint8)).view(jnp.float8_e8m0fnu)
    return mx.MXFP4Array(jnp.asarray(data), scales, axis, codes.shape, jnp.float32)


def rand_operand(rng, shape, span, base=127):
    """Random codes; per-block bytes in [base - span, base] (K last)."""
    codes = rng.integers(0, 16, size=shape, dtype=np.uint8)
    sb = rng.integers(base - span, base + 1, size=shape[:-1] + (shape[-1] // 32,)).astype(np.uint8)
    return codes, sb


def exact64(ca, sa, cb, sb):
    a = dequantize_ref(ca, sa, ca.ndim - 1)
    b = dequantize_ref(cb, sb, cb.ndim - 1)
    return np.einsum("bmk,bnk->bmn", a, b), np.einsum("bmk,bnk->bmn", np.abs(a), np.abs(b))


def run(a, b, recipe=FP8, out=jnp.float32, **kw):
    return np.asarray(mx.dot_general(a, b, DN, preferred_element_type=out, recipe=recipe, **kw), np.float64)


# ------------------------------------------------------------------ equality with backend "xla"
@pytest.mark.parametrize("out", [jnp.float32, jnp.bfloat16])
def test_random_in_window_equals_xla_and_reference_bound(out, rng):
    ca, sa = rand_operand(rng, (2, 37, 256), span=14)
    cb, sb = rand_operand(rng, (2, 19, 256), span=14, base=120)
    a, b = mk(ca, sa), mk(cb, sb)
    assert not np.asarray(prepare_fp8(a).exact_rows()).any()
    got, ref = run(a, b, out=out), run(a, b, XLA, out=out)
    np.testing.assert_array_equal(got, ref)
    if out == jnp.float32:  # independent oracle: float64, within the float32 accumulation bound
        e, mag = exact64(ca, sa, cb, sb)
        assert (np.abs(got - e) <= 256 * 2.0**-24 * mag).all()


def test_window_edges_exact(rng):
    """One nonzero element at d = 6 (b = b_max) and one at d = -8 (b = b_max - 14): exact."""
    k = 128
    ca = np.zeros((1, 8, k), np.uint8)
    sa = np.full((1, 8, k // 32), 127, np.uint8)
    for r in range(8):
        bmax = int(rng.integers(40, 200))
        sa[0, r] = [bmax, bmax - 14, bmax - 3, 0]
        ca[0, r, int(rng.integers(0, 32))] = rng.integers(1, 16)  # block 0: d = 6
        ca[0, r, 32 + int(rng.integers(0, 32))] = rng.choice([1, 9])  # block 1: 0.5 at d = -8 -> 2^-9
        ca[0, r, 64 + int(rng.integers(0, 32))] = rng.integers(1, 16)
    cb = rng.integers(0, 16, size=(1, 5, k), dtype=np.uint8)
    sb = np.full((1, 5, k // 32), 127, np.uint8)
    a, b = mk(ca, sa), mk(cb, sb)
    p = prepare_fp8(a)
    assert not np.asarray(p.exact_rows()).any()
    codes = np.asarray(p.codes.astype(jnp.float32))
    assert np.min(np.abs(codes[codes != 0])) == 2.0**-9  # the smallest E4M3 subnormal is used
    assert np.max(np.abs(codes)) <= 448
    e, _ = exact64(ca, sa, cb, sb)
    np.testing.assert_array_equal(run(a, b), e)  # 3 products per output: exact in float32


@pytest.mark.parametrize("n_flagged", [1, 3, 40])  # strips (capacity 16) and the full exact GEMM
def test_rows_outside_window_are_exact(n_flagged, rng):
    m, n, k = 48, 24, 256
    ca, sa = rand_operand(rng, (1, m, k), span=10, base=140)
    cb, sb = rand_operand(rng, (1, n, k), span=10)
    rows = rng.choice(m, size=min(n_flagged, m), replace=False)
    for r in rows:  # one nonzero block 15..100 binades below the row's largest (>= 130)
        blk = int(rng.integers(0, k // 32))
        sa[0, r, blk] = 130 - int(rng.integers(15, 101))
        ca[0, r, blk * 32] = 2  # 1.0: nonzero block
    cols = rng.choice(n, size=min(n_flagged, n), replace=False)
    for c in cols:
        sb[0, c, 0] = 117 - int(rng.integers(15, 60))
        cb[0, c, 0] = 3
    a, b = mk(ca, sa), mk(cb, sb)
    flags = np.asarray(prepare_fp8(a).exact_rows())[0]
    assert set(np.flatnonzero(flags)) == set(rows.tolist())
    got, ref = run(a, b), run(a, b, XLA)
    e, mag = exact64(ca, sa, cb, sb)
    assert (np.abs(got - e) <= k * 2.0**-24 * mag).all()
    # Entries of no flagged row or column: the FP8 GEMM's exact products in a dot of the same
    # shape as backend "xla": bit for bit. Flagged ones: recomputed by the exact path as another
    # GEMM (gathered strips, or the full exact GEMM), whose float32 summation order XLA:CPU picks
    # by shape and by CPU: equal up to that order (the contract; 1-ulp differences occur on some
    # CPUs and not on others).
    fixed = np.zeros(got.shape, bool)
    fixed[0, rows, :] = True
    fixed[0, :, cols] = True
    np.testing.assert_array_equal(got[~fixed], ref[~fixed])
    assert (np.abs(got[fixed] - ref[fixed]) <= 2 * k * 2.0**-24 * mag[fixed]).all()
    # such a row in E4M3 would have rounded: the test data really needs the fallback
    v = dequantize_ref(ca, sa, 2)[0, rows[0]]
    scaled = v * 2.0 ** -(int(sa[0, rows[0]].max()) - 133)
    assert not np.array_equal(scaled.astype(jnp.float8_e4m3fn).astype(np.float64), scaled)


def test_exact_path_in_bfloat16_is_lossless_and_within_the_float32_bound(rng):
    """The exact-row path's bfloat16 operands (CUDA: tensor cores): every dequantized MXFP4 value
    (every code x every E8M0 byte, the flushed 0x00/0x01 blocks, the 0xFD/0xFE overflows to Inf,
    NaN for 0xFF) survives float32 -> bfloat16 bit for bit, and the bfloat16 GEMM matches the
    float64 reference within the float32-accumulation bound (finite entries) and backend "xla"'s
    NaN/Inf pattern."""
    codes = np.tile(np.arange(16, dtype=np.uint8), 256 * 2).reshape(256, 32)  # one block per byte
    sb = np.arange(256, dtype=np.uint8).reshape(256, 1)
    f32 = np.asarray(fp8_backend._as_float32(mk(codes, sb)))
    back = np.asarray(jnp.asarray(f32).astype(jnp.bfloat16).astype(jnp.float32))
    assert np.array_equal(np.isnan(back), np.isnan(f32))
    ok = ~np.isnan(f32)
    assert np.array_equal(back[ok].view(np.uint32), f32[ok].view(np.uint32))  # signs of zeros too
    m, n, k = 24, 16, 256
    ca, sa = rand_operand(rng, (1, m, k), span=60, base=150)  # spans > 14 binades: flagged rows
    cb, sb2 = rand_operand(rng, (1, n, k), span=60, base=150)
    a, b = mk(ca, sa), mk(cb, sb2)
    got = np.asarray(fp8_backend._exact(a, b, jnp.float32, jnp.bfloat16), np.float64)
    e, mag = exact64(ca, sa, cb, sb2)
    fin = np.isfinite(e) & (np.abs(e) < 3e38)
    assert (np.abs(got[fin] - e[fin]) <= k * 2.0**-24 * mag[fin]).all()
    ref = run(a, b, XLA)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(ref))
    assert fp8_backend.exact_operand_dtype("cuda") == jnp.bfloat16
    assert fp8_backend.exact_operand_dtype("cpu") == jnp.float32


def test_zero_rows_and_all_zero_operands(rng):
    ca, sa = rand_operand(rng, (1, 6, 64), span=5)
    cb, sb = rand_operand(rng, (1, 4, 64), span=5)
    ca[0, 2] = 0
    ca[0, 3] = 8  # negative zeros
    sa[0, 2] = 0  # byte 0x00 on zero codes
    cb[0, 1] = 0
    got = run(mk(ca, sa), mk(cb, sb))
    assert (got[0, 2] == 0).all() and (got[0, 3] == 0).all() and (got[0, :, 1] == 0).all()
    e, _ = exact64(ca, sa, cb, sb)
    np.testing.assert_array_equal(got, e.astype(np.float32))
    z = run(mk(np.zeros((1, 3, 32)), np.zeros((1, 3, 1))), mk(np.zeros((1, 2, 32)), np.full((1, 2, 1), 254)))
    assert (z == 0).all()


def test_k0_operands_prepare_and_multiply():
    """K = 0 (no block): prepare_fp8 gives an empty FP8Prepared (row exponent 0, no flag; it used
    to fail with "zero-size array to reduction operation max"), and the FP8 GEMM of K = 0
    operands, prepared or not, is all zeros (empty sums), as backend "xla"."""
    x = mx.quantize(jnp.ones((5, 0)), axis=1)
    w = mx.quantize(jnp.ones((0, 3)), axis=0)
    p = prepare_fp8(w)
    assert p.codes.shape == (3, 0) and p.codes.dtype == jnp.float8_e4m3fn
    assert (np.asarray(p.row_exp) == 0).all() and (np.asarray(p.row_flag) == 0).all()
    dn = (((1,), (0,)), ((), ()))
    for rhs in (w, p):
        got = np.asarray(mx.dot_general(x, rhs, dn, recipe=FP8))
        assert got.shape == (5, 3) and (got == 0).all()
    want = np.asarray(mx.dot_general(x, w, dn, recipe=XLA))
    assert (want == 0).all()


def test_nan_scale_byte_poisons_row_and_column(rng):
    ca, sa = rand_operand(rng, (2, 8, 96), span=6)
    cb, sb = rand_operand(rng, (2, 5, 96), span=6)
    sa[0, 3, 1] = 255
    ca[0, 3, 32:64] = 0  # a NaN block with zero codes still poisons (0 x NaN)
    sa[1, 6, 0] = 255
    sa[1, 6, 2] = 2  # ... also in a row that needs the exact path
    ca[1, 6, 64] = 1
    sb[1, 2, 2] = 255
    got = run(mk(ca, sa), mk(cb, sb))
    ref = run(mk(ca, sa), mk(cb, sb), XLA)
    np.testing.assert_array_equal(got, ref)  # NaN positions equal too
    nan = np.isnan(got)
    want = np.zeros_like(nan)
    want[0, 3, :] = want[1, 6, :] = want[1, :, 2] = True
    np.testing.assert_array_equal(nan, want)


def test_e8m0_extremes_flush_overflow_and_wide_output_exponents(rng):
    k = 64
    ca, sa = rand_operand(rng, (1, 8, k), span=3, base=130)
    cb, sb = rand_operand(rng, (1, 6, k), span=3, base=125)
    sa[0, 0] = [0, 0]  # 0.5, 1, 1.5 x 2^-127 flush to zero in the reference
    sa[0, 1] = [1, 1]
    sa[0, 2] = [254, 254]  # 2..6 x 2^127 overflow to Inf in the reference
    ca[0, 2, 0] = 5
    sa[0, 3] = [253, 250]  # 4 x 2^126 = Inf, in a row spanning 3 binades
    ca[0, 3, :32] = 6
    sa[0, 4] = [254, 254]  # only 0.5 and 1 codes: largest finite, no flag
    # non-negative codes with one nonzero first element: the exact sums below cannot cancel to 0
    # (with mixed signs they sometimes did, and the test flaked)
    ca[0, 4] = rng.choice([0, 1, 2], size=k)
    ca[0, 4, 0] = 2
    sb[0, 0] = [2, 2]  # tiny x huge: output exponents far outside float32, split rescale
    cb[0, 0] = rng.choice([4, 5], size=k)
    sb[0, 1] = [254, 254]
    cb[0, 1] = rng.choice([0, 1], size=k)
    cb[0, 1, 0] = 1
    a, b = mk(ca, sa), mk(cb, sb)
    flags = np.asarray(prepare_fp8(a).exact_rows())[0]
    assert flags[:4].all() and not flags[4]
    got, ref = run(a, b), run(a, b, XLA)
    # Products beyond float32 (row 4 x column 1: 2^126 x 2^126; row 4 x others: up to 1.5 x
    # 2^128): the reference overflows per product (+-Inf, NaN if both signs occur), the FP8 path
    # sums exactly and overflows at most once, at the rescale. Finite reference outputs are equal.
    finite = np.isfinite(ref)
    np.testing.assert_array_equal(got[finite], ref[finite])
    assert not np.isfinite(got[0, 4, 1]) and not finite[0, 4, 1] and finite[0, 4, 0]
    np.testing.assert_array_equal(np.isnan(got[:, :4]), np.isnan(ref[:, :4]))  # flagged rows: exact path
    assert got[0, 4, 0] != 0 and np.isfinite(got[0, 4, 0])  # 2^127 x 2^-125: exponent sum -> ~2^2


def test_special_blocks_matches_the_reference_decoding_for_every_byte_and_code():
    from jax_mxfp4.fp8_format import special_blocks
    from jax_mxfp4.mx_format import dequantize_blocks

    b = np.repeat(np.arange(256), 16)  # one block per (byte, code): the code, then zeros
    c = np.tile(np.arange(16), 256)
    blocks = np.zeros((b.size, 32), np.uint8)
    blocks[:, 0] = c
    ref = np.asarray(dequantize_blocks(jnp.asarray(blocks), jnp.asarray(b, jnp.uint8)))[:, 0]
    want = ((c & 7) != 0) & ((ref == 0) | np.isinf(ref))
    mag = c & 7
    got = np.asarray(special_blocks(jnp.asarray(b), jnp.asarray(mag), jnp.asarray(np.where(mag != 0, mag, 8))))
    np.testing.assert_array_equal(got, want)
    assert want.sum() == 2 * 3 + 2 * 1 + 2 * 4 + 2 * 2  # bytes 0, 1, 254, 253 with both signs


def test_batch_dims_and_transposes_through_dot_general(rng):
    x = jnp.asarray(rng.standard_normal((3, 20, 2, 64)), jnp.float32)  # [B, M, X, K]
    w = jnp.asarray(rng.standard_normal((3, 64, 12)), jnp.float32)  # [B, K, N]
    dims = (((3,), (1,)), ((0,), (0,)))
    qx, qw = mx.quantize(x, 3), mx.quantize(w, 1)
    got = mx.dot_general(qx, qw, dims, recipe=FP8)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(mx.dot_general(qx, qw, dims, recipe=XLA)))
    assert got.shape == (3, 20, 2, 12)
    pw = prepare_fp8(qw)
    assert pw.codes.shape == (3, 12, 64)
    for recipe in (FP8, XLA):
        np.testing.assert_array_equal(np.asarray(mx.dot_general(qx, pw, dims, recipe=recipe)), np.asarray(got))
    # float operands quantized on the fly, and the differentiable dot_general's forward
    np.testing.assert_array_equal(np.asarray(mx.dot_general(x, w, dims, recipe=FP8)),
                                  np.asarray(mx.dot_general(x, w, dims, recipe=XLA)))


def test_rescale_is_one_rounding_over_the_whole_exponent_range(rng):
    acc = jnp.asarray(rng.integers(1, 2**20, size=(1, 64, 1)) * 2.0**-18 * rng.choice([-1, 1], (1, 64, 1)), jnp.float32)
    el = jnp.asarray(rng.integers(-133, 122, size=(1, 64)), jnp.int32)
    er = jnp.asarray([[-133, 0, 121]], jnp.int32)
    acc3 = jnp.broadcast_to(acc, (1, 64, 3))
    f = jnp.zeros((1, 64), bool)
    got = np.asarray(fp8_backend.rescale(acc3, el, er, f, jnp.zeros((1, 3), bool), np.float32), np.float64)
    exact = np.asarray(acc3, np.float64) * np.exp2(np.asarray(el, np.float64)[:, :, None] + np.asarray(er, np.float64)[:, None, :])
    with np.errstate(over="ignore"):
        want = exact.astype(np.float32).astype(np.float64)
    normal = (np.abs(want) >= 2.0**-126) | np.isinf(want)
    np.testing.assert_array_equal(got[normal], want[normal])
    assert (np.abs(got[~normal] - exact[~normal]) < 2.0**-126).all()  # subnormal range (CPU flushes)


@pytest.mark.sweep(keep=1)
# ------------------------------------------------------------------ prepared weights
@pytest.mark.parametrize("axis,layout", [(0, "plain"), (1, "swizzled"), (2, "plain")])
def test_prepared_round_trip_is_bit_exact(axis, layout, rng):
    shape = [3, 5, 7]
    shape[axis] = 96
    codes = rng.integers(0, 16, size=shape, dtype=np.uint8)
    sshape = list(shape)
    sshape[axis] = 3
    sb = rng.integers(0, 256, size=sshape).astype(np.uint8)  # every byte: NaN, extremes, wide spans
    q = mk(codes, sb, axis).with_scale_layout(layout)
    p = prepare_fp8(q)
    assert isinstance(p, FP8Prepared) and p.shape == tuple(shape) and p.axis == axis
    back = p.to_mxfp4()
    np.testing.assert_array_equal(np.asarray(back.data), np.asarray(q.data))
    np.testing.assert_array_equal(np.asarray(back.scales).view(np.uint8), np.asarray(q.plain_scales()).view(np.uint8))
    assert (back.shape, back.axis, back.dtype) == (q.shape, q.axis, q.dtype)
    np.testing.assert_array_equal(np.asarray(p.dequantize()), np.asarray(mx.dequantize(q)))


def test_prepared_is_a_pytree_for_jit_sharding_and_orbax(tmp_path, rng):
    import orbax.checkpoint as ocp
    from jax.sharding import NamedSharding, PartitionSpec as P

    w = jnp.asarray(rng.standard_normal((128, 64)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((16, 128)), jnp.float32)
    p = prepare_fp8(mx.quantize(w, 0))
    leaves, tree = jax.tree_util.tree_flatten(p)
    assert len(leaves) == 4 and isinstance(jax.tree_util.tree_unflatten(tree, leaves), FP8Prepared)
    dims = (((1,), (0,)), ((), ()))
    f = jax.jit(lambda x, p: mx.dot_general(x, p, dims, recipe=FP8))
    want = np.asarray(mx.dot_general(x, mx.quantize(w, 0), dims, recipe=XLA))
    np.testing.assert_array_equal(np.asarray(f(x, p)), want)
    # sharding: N (rows of the prepared weight) over 8 devices
    mesh = jax.make_mesh((8,), ("model",), axis_types=(jax.sharding.AxisType.Auto,))
    ps = jax.device_put(p, jax.tree.map(lambda v: NamedSharding(mesh, P("model", *([None] * (v.ndim - 1)))), p))
    assert ps.codes.sharding.spec[0] == "model"
    np.testing.assert_array_equal(np.asarray(f(x, ps)), want)
    # orbax
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "p", {"w": p})
    ckpt.wait_until_finished()
    r = ckpt.restore(tmp_path / "p", {"w": jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), p)})["w"]
    assert isinstance(r, FP8Prepared) and r.shape == p.shape
    for a_, b_ in zip(jax.tree_util.tree_leaves(r), leaves):
        np.testing.assert_array_equal(np.asarray(a_).view(np.uint8) if a_.dtype.itemsize == 1 else np.asarray(a_),
                                      np.asarray(b_).view(np.uint8) if b_.dtype.itemsize == 1 else np.asarray(b_))


def test_dense_takes_a_prepared_kernel(rng):
    x = jnp.asarray(rng.standard_normal((5, 70)), jnp.bfloat16)  # K = 70: padded to 96
    q = mx.quantize(jnp.pad(jnp.asarray(rng.standard_normal((70, 24)), jnp.float32), ((0, 26), (0, 0))), 0)
    want = np.asarray(mx.dense(x, q, recipe=XLA), np.float32)
    got = mx.dense(x, prepare_fp8(q), recipe=FP8)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), want)


def test_prepared_operand_errors():
    with pytest.raises(TypeError, match="prepare_fp8 takes an MXFP4Array"):
        prepare_fp8(jnp.ones((32, 4)))
    p = prepare_fp8(mx.quantize(jnp.ones((64, 64)), 0))
    with pytest.raises(ValueError, match="FP8Prepared.codes must be float8_e4m3fn of shape"):
        FP8Prepared(p.codes.astype(jnp.float32), p.scales, p.row_exp, p.row_flag, 0, (64, 64), jnp.float32)
    with pytest.raises(ValueError, match="contracted along its single quantized axis"):
        mx.dot_general(jnp.ones((4, 64)), p, (((1,), (1,)), ((), ())), recipe=FP8)
    stacked = jax.vmap(prepare_fp8)(mx.quantize(jnp.ones((3, 64, 8)), 1))  # children batched, static shape not
    with pytest.raises(ValueError, match="batching an FP8Prepared with vmap/scan is not supported"):
        stacked.to_mxfp4()
    x = jnp.ones((2, 64))
    with pytest.raises(ValueError, match="gradient with respect to rhs"):
        jax.grad(lambda p_: mx.dot_general(x, p_, (((1,), (0,)), ((), ()))).sum(), allow_int=True)(p)
    g = jax.grad(lambda x_: mx.dot_general(x_, p, (((1,), (0,)), ((), ())), recipe=FP8).sum())(x)
    assert g.shape == x.shape and np.isfinite(np.asarray(g)).all()


# ------------------------------------------------------------------ precision contract, routing
def test_canonical_precision():
    cp = checks.canonical_precision
    assert cp(None) == "default" and cp(lax.Precision.DEFAULT) == "default"
    assert cp(lax.Precision.HIGH) == "high" and cp("tensorfloat32") == "high"
    assert cp("highest") == "highest" and cp(lax.Precision.HIGHEST) == "highest"
    assert cp((lax.Precision.DEFAULT, lax.Precision.HIGHEST)) == "highest"
    with pytest.raises(ValueError, match="precision must be None, a jax.lax.Precision"):
        cp(lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32)
    with pytest.raises(ValueError, match="Recipe.precision must be None, a jax.lax.Precision"):
        mx.Recipe(precision="fast")


def test_precision_routes_and_explain_states_the_contract():
    q = mx.quantize(jnp.ones((1, 8, 64)), 2)
    d = mx.explain(q, q, DN, recipe=FP8)
    assert d.backend == "fp8" and "numerics (precision 'default')" in str(d) and "FP8 codes" in d.contract
    with pytest.raises(mx.BackendUnavailableError, match="precision HIGHEST asks for float32 accumulation"):
        mx.dot_general(q, q, DN, precision=lax.Precision.HIGHEST, recipe=FP8)
    with pytest.raises(mx.BackendUnavailableError, match="precision HIGHEST"):
        mx.dot_general(q, q, DN, recipe=FP8.replace(precision="highest"))
    # the stricter of call and recipe; HIGH keeps the FP8 path
    assert mx.explain(q, q, DN, precision="high", recipe=FP8).problem.precision == "high"
    assert mx.explain(q, q, DN, recipe=FP8.replace(precision="high")).problem.precision == "high"
    np.testing.assert_array_equal(run(q, q, precision=lax.Precision.HIGH), run(q, q, XLA))
    # the differentiable dot_general carries the precision into its GEMMs
    x = jnp.ones((8, 64))
    with pytest.raises(mx.BackendUnavailableError, match="precision HIGHEST"):
        mx.dot_general(x, x, (((1,), (1,)), ((), ())), precision="highest", recipe=FP8)


def _cuda_problem(m, n, k, precision="default", float_lhs=False):
    return GemmProblem(batch=1, m=m, n=n, k=k, out_dtype=np.dtype(jnp.bfloat16), scale_layout="plain",
                       platform="cuda", lhs_kind="float" if float_lhs else "mxfp4",
                       lhs_dtype=np.dtype(jnp.bfloat16), precision=precision)


def test_auto_routing_rules_on_cuda():
    """dispatch.decide for CUDA problems (the device query falls back to 'unknown' on CPU)."""
    big = dispatch.decide(_cuda_problem(8192, 8192, 8192), "auto")
    assert big.backend == "fp8", str(big)
    assert "numerics (precision 'default')" in str(big) and "fast accumulation" in big.contract
    decode = dispatch.decide(_cuda_problem(16, 8192, 8192), "auto")
    assert decode.backend == "pallas" and "min(M, N) = 16 < 256" in decode.reasons["fp8"]
    highest = dispatch.decide(_cuda_problem(8192, 8192, 8192, "highest"), "auto")
    assert highest.backend == "scaled_dot" and "precision HIGHEST" in highest.reasons["fp8"]
    assert "float32 accumulation" in highest.contract
    w4a16 = dispatch.decide(_cuda_problem(8192, 8192, 8192, float_lhs=True), "auto")
    assert w4a16.backend == "pallas" and "a4w4" in w4a16.reasons["fp8"]
    assert dispatch.decide(_cuda_problem(8192, 8192, 8192, "high"), "auto").backend == "fp8"
    rocm = GemmProblem(1, 512, 512, 512, np.dtype(jnp.float32), "plain", "rocm")
    assert "runs on CUDA GPUs" in dispatch.get_backend("fp8").rejects(rocm)


def test_auto_on_cpu_keeps_xla_and_fp8_declines_with_reason():
    q = mx.quantize(jnp.ones((1, 512, 64)), 2)
    d = mx.explain(q, q, DN)
    assert d.backend == "xla" and "'auto' picks it only on cuda" in d.reasons["fp8"]


def test_error_bound_constants_are_defined_for_the_gpu_check():
    for prec in ("default", "high"):
        for kind in ("random", "adversarial"):
            assert 0 < fp8_backend.ERROR_BOUNDS[(prec, kind)] <= 0.5


@pytest.mark.sweep(keep=2)
@pytest.mark.parametrize("style", ["auto", "explicit"])
@pytest.mark.parametrize("layout", ["data-parallel", "tp-column", "tp-row"])
def test_sharded_forward_matches_single_device(style, layout, rng):
    """Backend "fp8" is plain XLA ops, partitioned by XLA (explicit meshes: shard-local FP8 dot,
    the flagged-row fix as one masked exact GEMM). One flagged row exercises the fallback."""
    from jax.sharding import NamedSharding
    import test_sharding as ts

    x, w = ts.operands(rng)
    x = x.at[1, 3, :32].set(1e-9)  # a block 2^-30 below the others: row flagged
    xs, ws, _ = ts.LAYOUTS[layout]
    fwd = lambda a, b, r: mx.dot_general(a, b, ts.DIMS, recipe=r)  # noqa: E731
    single = np.asarray(jax.jit(fwd, static_argnums=2)(x, w, XLA))
    mesh = ts.make_mesh(style)
    with jax.set_mesh(mesh):
        xx = jax.device_put(x, NamedSharding(mesh, xs))
        ww = jax.device_put(w, NamedSharding(mesh, ws))
        got = np.asarray(jax.jit(fwd, static_argnums=2)(xx, ww, FP8))
    if layout == "tp-row":  # partial sums over K shards: another float32 order
        assert (np.abs(got - single) <= ts.rounding_bound(x, w, 256)).all()
    else:
        np.testing.assert_array_equal(got, single)


def test_fp8_prepared_is_not_a_dense_array_and_recipe_takes_lax_precisions(tmp_path):
    from jax_mxfp4 import checkpoint

    q = mx.quantize(jnp.asarray(np.random.default_rng(3).standard_normal((64, 32)), jnp.float32), 0)
    p = mx.prepare_fp8(q)
    for f in (np.asarray, jnp.asarray):
        with pytest.raises(TypeError, match="to_mxfp4"):
            f(p)
    with pytest.raises(TypeError, match="to_mxfp4"):
        mx.dequantize(p)
    with pytest.raises(TypeError, match="FP8Prepared"):
        checkpoint.save_mxfp4(tmp_path / "p.safetensors", {"w": p})
    assert mx.Recipe(precision=jax.lax.Precision.HIGH).precision == "high"
    assert mx.Recipe(precision="HIGHEST") == mx.Recipe(precision="highest")
    assert mx.Recipe(hadamard="none").hadamard_passes == ()
