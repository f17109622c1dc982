"""The FP8 path's flagged-row recompute kernel (jax_mxfp4/kernels/fp8_fix.py) in the Pallas
interpreter: exact operand values from the FP8 form against the float64 reference dequantization
(every E8M0 byte, flushed/overflowing/NaN blocks), and the in-place fix of flagged rows and
columns against a float64 GEMM, unflagged entries untouched bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_fp8 import exact64, mk, rand_operand

from jax_mxfp4.fp8_format import FLAG_EXACT, FLAG_NAN
from jax_mxfp4.fp8_prepared import prepare_fp8
from jax_mxfp4.kernels import fp8_fix
from jax_mxfp4.mx_format import as_scale_bytes
from mx_reference import dequantize_ref


def _fields(x):
    p = prepare_fp8(x)
    return p.codes, as_scale_bytes(p.scales), p.row_exp, p.row_flag


def test_exact_values_every_byte_and_flag(rng):
    """Rows in the FP8 window (codes x 2^row_exp), flagged rows (E2M1 values x block scale: every
    byte 0..254 incl. the flushed 0x00/0x01 and overflowing 0xFD/0xFE blocks) and NaN rows."""
    k = 256
    ca, sa = rand_operand(rng, (1, 40, k), span=12, base=140)  # in the window
    codes = np.tile(np.arange(16, dtype=np.uint8), 2 * k // 16 * 32)[: 32 * k].reshape(32, k)
    sb = np.arange(256, dtype=np.uint8)[:255]
    sb = np.concatenate([sb, sb[:1]])  # 256 bytes over 32 rows x 8 blocks, 0xFF left out here
    ca = np.concatenate([ca, codes[None]], axis=1)
    sa = np.concatenate([sa, sb.reshape(1, 32, 8)], axis=1)
    sa[0, 5, 3] = 255  # a NaN block in an otherwise in-window row
    x = mk(ca, sa)
    c, s, e, f = _fields(x)
    f = np.asarray(f)[0]
    assert (f[40:] & FLAG_EXACT).any() and f[5] & FLAG_NAN and not (f[:40][np.arange(40) != 5] & 3).any()
    got = np.asarray(fp8_fix.exact_values(c[0].reshape(72, 8, 32), s[0], e[0], f)).reshape(72, k)
    with np.errstate(over="ignore"):  # float32: the 0xFD/0xFE blocks overflow to Inf
        want = dequantize_ref(ca[0], sa[0], 1).astype(np.float32)
    assert np.isinf(want).any() and (want == 0).any()
    assert np.isnan(got[5]).all()  # a NaN row: every product of its dots is NaN
    keep = np.arange(72) != 5
    np.testing.assert_array_equal(got[keep], want[keep])
    np.testing.assert_array_equal(np.signbit(got[keep]), np.signbit(want[keep]))  # signed zeros


@pytest.mark.sweep(keep=6)
@pytest.mark.parametrize("n_flagged", [0, 1, 5, 20])  # 20: two groups of 16 listed rows and of columns
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("max_programs,group", [(512, 16), (4, 16), (4, 64)])  # several units per program; the default group
def test_fix_flagged_rows_and_columns(n_flagged, out_dtype, max_programs, group, rng):
    """Ragged M and N (not multiples of the tile), flagged lhs rows and rhs columns anywhere (rows
    and columns crossing): those entries equal the float64 GEMM within the float32 accumulation
    bound, every other entry is the input bit for bit; no flag: the output is the input."""
    b, m, n, k = 2, 40, 24, 128
    ca, sa = rand_operand(rng, (b, m, k), span=10, base=140)
    cb, sb = rand_operand(rng, (b, n, k), span=10)
    rows = rng.choice(m, size=n_flagged, replace=False)
    cols = rng.choice(n, size=n_flagged, replace=False)
    for r in rows:  # a nonzero block far below the row's largest: FLAG_EXACT
        sa[:, r, 1] = 130 - int(rng.integers(15, 100))
        ca[:, r, 32] = 2
    for c in cols:
        sb[:, c, 0] = 117 - int(rng.integers(15, 60))
        cb[:, c, 0] = 3
    a_, b_ = mk(ca, sa), mk(cb, sb)
    fa, fb = _fields(a_), _fields(b_)
    assert set(np.flatnonzero(np.asarray(fa[3])[0] & FLAG_EXACT)) == set(rows.tolist())
    base = jnp.asarray(rng.standard_normal((b, m, n)), out_dtype)  # stands for the FP8 result
    cfg = fp8_fix.FixConfig(bm=16, bn=16, bk=64, num_warps=4, max_programs=max_programs, group=group)
    got = np.asarray(fp8_fix.fix_flagged(base, *fa, *fb, cfg=cfg, interpret=True).astype(jnp.float32), np.float64)
    fix = np.zeros((b, m, n), bool)
    fix[:, rows, :] = True
    fix[:, :, cols] = True
    before = np.asarray(base.astype(jnp.float32), np.float64)
    np.testing.assert_array_equal(got[~fix], before[~fix])
    e, mag = exact64(ca, sa, cb, sb)
    if out_dtype == jnp.float32:
        assert (np.abs(got[fix] - e[fix]) <= k * 2.0**-24 * mag[fix]).all()
    else:  # one bfloat16 rounding of the float32 result
        assert (np.abs(got[fix] - e[fix]) <= 2.0**-8 * np.abs(e[fix]) + k * 2.0**-24 * mag[fix]).all()


@pytest.mark.sweep(keep=2)
@pytest.mark.parametrize("bsz,r,group,p", [(1, 5, 1, 0.5), (2, 100, 16, 0.1), (3, 1024, 64, 0.01),
                                          (1, 5000, 64, 0.3), (2, 8192, 64, 0.0), (1, 9000, 64, 1.0), (1, 70, 64, 1.0)])
def test_exact_rows_index_kernel_against_numpy(bsz, r, group, p, rng):
    """The listing kernel: FLAG_EXACT rows (the NaN bit alone does not list a row) in increasing
    order, then -1 up to a multiple of ``group`` slots; counts. Shapes: one row, a list across
    several 4096-flag chunks (5000, 9000), none flagged, all flagged, R below the group."""
    f = rng.random((bsz, r)) < p
    flag = (f * 1 | (rng.random((bsz, r)) < 0.3) * 2).astype(np.uint8)
    other = (rng.random((bsz, 37)) < 0.5).astype(np.uint8)  # a second operand in the same launch
    (idx, cnt), (idx2, cnt2) = fp8_fix.exact_rows_index(jnp.asarray(flag), jnp.asarray(other), group=group,
                                                        interpret=True)
    idx, cnt = np.asarray(idx), np.asarray(cnt)
    assert idx.shape == (bsz, -(-r // group) * group) and cnt.shape == (bsz,)
    for b in range(bsz):
        want = np.flatnonzero(f[b])
        assert cnt[b] == len(want)
        np.testing.assert_array_equal(idx[b, :len(want)], want)
        assert (idx[b, len(want):] == -1).all()
        want2 = np.flatnonzero(other[b] & 1)
        assert np.asarray(cnt2)[b] == len(want2)
        np.testing.assert_array_equal(np.asarray(idx2)[b, :len(want2)], want2)
        assert (np.asarray(idx2)[b, len(want2):] == -1).all() and np.asarray(idx2).shape[1] == -(-37 // group) * group


def test_exact_rows_index_lowers_for_cuda_and_checks_input():
    f = jax.jit(lambda a, b: fp8_fix.exact_rows_index(a, b, group=64))
    txt = f.trace(jax.ShapeDtypeStruct((2, 8192), jnp.uint8), jax.ShapeDtypeStruct((2, 1024), jnp.uint8)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mxfp4_fp8_exact_rows_index" in txt
    with pytest.raises(TypeError, match=r"row_flags\[0\] must be uint8"):
        fp8_fix.exact_rows_index(jnp.zeros((1, 4), bool))
    with pytest.raises(ValueError, match=r"row_flags\[0\] must be \[B, R\]"):
        fp8_fix.exact_rows_index(jnp.zeros((4,), jnp.uint8))
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="group must be a positive int"):
            fp8_fix.exact_rows_index(jnp.zeros((1, 4), jnp.uint8), group=bad)
    with pytest.raises(ValueError, match="must share B"):
        fp8_fix.exact_rows_index(jnp.zeros((1, 4), jnp.uint8), jnp.zeros((2, 4), jnp.uint8))
    with pytest.raises(ValueError, match="at least one"):
        fp8_fix.exact_rows_index()


def test_exact_rows_index_empty_shapes():
    """No row or no batch element: nothing to launch; the lists are -1 (or empty) and counts 0."""
    for shape in ((0, 4), (2, 0), (0, 0)):
        (idx, cnt), = fp8_fix.exact_rows_index(jnp.ones(shape, jnp.uint8), group=4, interpret=True)
        assert idx.shape == (shape[0], -(-shape[1] // 4) * 4) and cnt.shape == (shape[0],)
        assert (np.asarray(idx) == -1).all() and (np.asarray(cnt) == 0).all()

def test_fix_flagged_default_tile_and_nan_column(rng):
    """The default 128 x 128 tile over a 1 x 130 x 70 output (ragged, one program row of two) with
    a flagged rhs column next to a NaN lhs row: the NaN row stays NaN in the fixed column."""
    m, n, k = 130, 70, 96
    ca, sa = rand_operand(rng, (1, m, k), span=8, base=130)
    cb, sb = rand_operand(rng, (1, n, k), span=8)
    sa[0, 7, 2] = 255
    sb[0, 3, 0] = 20
    cb[0, 3, 0] = 5
    fa, fb = _fields(mk(ca, sa)), _fields(mk(cb, sb))
    assert np.asarray(fb[3])[0, 3] & FLAG_EXACT
    base = jnp.zeros((1, m, n), jnp.float32)
    got = np.asarray(fp8_fix.fix_flagged(base, *fa, *fb, interpret=True), np.float64)
    e, mag = exact64(ca, sa, cb, sb)
    assert np.isnan(got[0, 7, 3]) and np.isnan(e[0, 7, 3])
    ok = ~np.isnan(e[0, :, 3])
    assert (np.abs(got[0, ok, 3] - e[0, ok, 3]) <= k * 2.0**-24 * mag[0, ok, 3]).all()
    others = np.ones((m, n), bool)
    others[:, 3] = False
    assert (got[0][others] == 0).all()


def test_fix_flagged_errors_and_config():
    with pytest.raises(ValueError, match="power of two"):
        fp8_fix.FixConfig(bm=48)
    with pytest.raises(ValueError, match="max_programs"):
        fp8_fix.FixConfig(max_programs=0)
    with pytest.raises(ValueError, match="bk"):
        fp8_fix.FixConfig(bk=16)
    for bad in (8, 24, True, 16.0, np.int64(16)):
        with pytest.raises(ValueError, match="FixConfig.group must be an int power of two >= 16"):
            fp8_fix.FixConfig(group=bad)
    c = jnp.zeros((1, 4, 64), jnp.float8_e4m3fn)
    s, e, f = jnp.zeros((1, 4, 2), jnp.uint8), jnp.zeros((1, 4), jnp.int32), jnp.zeros((1, 4), jnp.uint8)
    with pytest.raises(ValueError, match="pair up"):
        fp8_fix.fix_flagged(jnp.zeros((1, 4, 5)), c, s, e, f, c, s, e, f, interpret=True)


@pytest.mark.parametrize("lhs_codes", [jnp.float8_e4m3fn, jnp.float8_e5m2])  # E5M2: a gradient lhs
def test_fix_flagged_lowers_for_cuda(lhs_codes):
    """The kernel lowers for CUDA (Triton) from this CPU host, at a training-step shape."""
    sds = jax.ShapeDtypeStruct
    b, m, n, k = 1, 8192, 8192, 8192
    args = (sds((b, m, n), jnp.bfloat16), sds((b, m, k), lhs_codes), sds((b, m, k // 32), jnp.uint8),
            sds((b, m), jnp.int32), sds((b, m), jnp.uint8), sds((b, n, k), jnp.float8_e4m3fn),
            sds((b, n, k // 32), jnp.uint8), sds((b, n), jnp.int32), sds((b, n), jnp.uint8))
    text = jax.jit(fp8_fix.fix_flagged).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mxfp4_fp8_fix_flagged" in text


def test_fp8_gemm_routes_the_fix_kernel_on_cuda_only(monkeypatch, rng):
    """fp8_gemm's CUDA branch (traced, not run) holds the flagged-row kernel and no while loop;
    with JAX_MXFP4_KERNELS=0, on CPU, and under a mesh (a pallas_call is opaque to SPMD
    partitioning) it keeps the lax.while_loop. A typo in the switch is refused."""
    import jax_mxfp4 as mx
    from jax_mxfp4.backends import fp8 as fb
    from jax_mxfp4.platform import KERNELS_ENV

    a = mx.quantize(jnp.asarray(rng.standard_normal((1, 64, 64)), jnp.float32), 2)
    b = mx.quantize(jnp.asarray(rng.standard_normal((1, 32, 64)), jnp.float32), 2)

    def jaxpr(platform):
        fb.fp8_gemm.clear_cache()
        return str(jax.make_jaxpr(lambda a, b: fb.fp8_gemm(a, b, jnp.bfloat16, "default", platform))(a, b))

    cuda = jaxpr("cuda")
    assert cuda.count("name=mxfp4_fp8_fix_flagged") == 1 and "top_k" not in cuda  # top_k: the while body
    cpu = jaxpr("cpu")
    assert "mxfp4_fp8_fix_flagged" not in cpu and "top_k" in cpu
    mesh = jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    with jax.set_mesh(mesh):
        meshed = jaxpr("cuda")
    assert "mxfp4_fp8_fix_flagged" not in meshed  # (the loop's body is the full exact GEMM there)
    monkeypatch.setenv(KERNELS_ENV, "0")
    off = jaxpr("cuda")
    assert "mxfp4_fp8_fix_flagged" not in off and "top_k" in off
    monkeypatch.setenv(KERNELS_ENV, "of")
    with pytest.raises(ValueError, match=KERNELS_ENV):
        jaxpr("cuda")
    fb.fp8_gemm.clear_cache()


@pytest.mark.parametrize("b,m,n,k", [(1, 0, 8, 64), (1, 8, 0, 64), (0, 8, 8, 64), (1, 8, 8, 0)])
def test_fix_flagged_empty_shapes(b, m, n, k, rng):
    """Zero-size batch, M, N (the result comes back as it is) and K = 0 (flagged entries are empty
    sums, 0; others untouched): no ZeroDivisionError from a zero-size grid or block. The FP8 path
    reaches this kernel on CUDA with such shapes (fp8_gemm's rescale already skipped them)."""

    def fields(r):
        flag = np.zeros((b, r), np.uint8)
        flag[:, : r // 2] = FLAG_EXACT  # hand-set flags: K = 0 rows have no block to flag them
        return (jnp.zeros((b, r, k), jnp.float8_e4m3fn), jnp.zeros((b, r, k // 32), jnp.uint8),
                jnp.zeros((b, r), jnp.int32), jnp.asarray(flag))

    base = rng.standard_normal((b, m, n)).astype(np.float32)
    got = np.asarray(fp8_fix.fix_flagged(jnp.asarray(base), *fields(m), *fields(n), interpret=True))
    assert got.shape == (b, m, n)
    want = base.copy()
    want[:, : m // 2, :] = 0
    want[:, :, : n // 2] = 0
    np.testing.assert_array_equal(got, want if k == 0 else base)


def test_fix_flagged_rejects_dtypes():
    """Each operand's dtype is checked by name (a float32 codes array used to fail in a reshape,
    an int32 ``out`` or float ``row_exp`` went through silently)."""
    c = jnp.zeros((1, 4, 64), jnp.float8_e4m3fn)
    s, e, f = jnp.zeros((1, 4, 2), jnp.uint8), jnp.zeros((1, 4), jnp.int32), jnp.zeros((1, 4), jnp.uint8)
    out = jnp.zeros((1, 4, 4))
    ok = (out, c, s, e, f, c, s, e, f)
    bad = {0: out.astype(jnp.int32), 1: c.astype(jnp.float32), 2: s.astype(jnp.float32), 3: e.astype(jnp.float32),
           4: f.astype(jnp.bool_), 5: c.astype(jnp.float16), 7: e.astype(jnp.uint8), 8: f.astype(jnp.int32)}
    names = ["out", "a_codes", "a_scales", "a_exp", "a_flag", "b_codes", "b_scales", "b_exp", "b_flag"]
    for i, v in bad.items():
        args = list(ok)
        args[i] = v
        with pytest.raises(TypeError, match=f"fix_flagged: {names[i]} must be"):
            fp8_fix.fix_flagged(*args, interpret=True)
    with pytest.raises(ValueError, match=r"out must be a \[B, M, N\]"):
        fp8_fix.fix_flagged(out[0], *ok[1:], interpret=True)
    with pytest.raises(TypeError, match="cfg must be a FixConfig"):  # was AttributeError: no 'bk'
        fp8_fix.fix_flagged(*ok, cfg=(16, 16, 32), interpret=True)



def test_fix_flagged_float16_out(rng):
    """A float16 result (the FP8 path's preferred_element_type=float16 on CUDA) is fixed as the
    float32 one rounded once to float16 (the dtype check must not refuse it)."""
    m, n, k = 24, 20, 64
    ca, sa = rand_operand(rng, (1, m, k), span=6)
    cb, sb = rand_operand(rng, (1, n, k), span=6)
    sa[0, 3, 0] = 100  # far below the row's largest block: FLAG_EXACT
    ca[0, 3, :32] = 5
    fa, fb = _fields(mk(ca, sa)), _fields(mk(cb, sb))
    assert np.asarray(fa[3])[0, 3] & FLAG_EXACT
    base = rng.standard_normal((1, m, n)).astype(np.float16)
    got = np.asarray(fp8_fix.fix_flagged(jnp.asarray(base), *fa, *fb, interpret=True))
    f32 = np.asarray(fp8_fix.fix_flagged(jnp.asarray(base, jnp.float32), *fa, *fb, interpret=True))
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got[0, 3], f32[0, 3].astype(np.float16))
    keep = np.ones(m, bool)
    keep[3] = False
    np.testing.assert_array_equal(got[0, keep], base[0, keep])


@pytest.mark.slow
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_fp8_gemm_cuda_route_in_the_interpreter(monkeypatch, out_dtype, rng):
    """fp8_gemm's CUDA route (encode kernel, FP8 dot, rescale kernel, this fix kernel) with every
    Pallas kernel in the interpreter equals the CPU route (jnp encode, XLA rescale, while_loop
    fix) bit for bit outside the flagged rows and columns, and both equal the float64 GEMM
    within the float32 accumulation bound on them (the two sum in different orders: 1 ulp
    apart at times); a NaN row stays NaN; and takes the empty shapes (B, M, N or K = 0: a
    zero-size grid raised ZeroDivisionError there)."""
    import functools

    from jax_mxfp4.backends import fp8 as fp8_backend
    from jax_mxfp4.kernels import fp8_encode
    from jax_mxfp4.kernels import rescale as rescale_mod

    for mod, name in ((fp8_fix, "fix_flagged"), (rescale_mod, "rescale_kernel"), (fp8_encode, "encode_rows_kernel")):
        monkeypatch.setattr(mod, name, functools.partial(getattr(mod, name), interpret=True))
    gemm = fp8_backend.fp8_gemm.__wrapped__  # traced afresh: no cached non-interpreted trace
    b, m, n, k = 2, 40, 24, 128
    ca, sa = rand_operand(rng, (b, m, k), span=10, base=140)
    cb, sb = rand_operand(rng, (b, n, k), span=10)
    sa[0, 3, 0] = 100  # flagged lhs row
    ca[0, 3, :32] = 6
    sb[1, 5, 2] = 60  # flagged rhs column
    cb[1, 5, 64:96] = 3
    sa[1, 7, 1] = 255  # NaN row
    a, bb = mk(ca, sa), mk(cb, sb)
    od = np.dtype(out_dtype)
    got = np.asarray(gemm(a, bb, od, "default", "cuda").astype(jnp.float32), np.float64)
    want = np.asarray(gemm(a, bb, od, "default", "cpu").astype(jnp.float32), np.float64)
    fixed = np.zeros((b, m, n), bool)  # recomputed exactly: equal up to the float32 summation order
    fixed[0, 3, :] = fixed[1, :, 5] = True
    np.testing.assert_array_equal(got[~fixed], want[~fixed])
    assert np.isnan(got[1, 7]).all() and np.isnan(got).sum() == n
    e, mag = exact64(ca, sa, cb, sb)
    ok = fixed & ~np.isnan(e)
    # one rounding to the output dtype: relative half ulp, or its subnormal spacing (float32: the
    # CPU flush below 2^-126)
    eps, tiny = {np.dtype(jnp.float32): (0.0, 2.0**-126), np.dtype(jnp.bfloat16): (2.0**-8, 2.0**-133),
                 np.dtype(jnp.float16): (2.0**-11, 2.0**-24)}[od]
    with np.errstate(over="ignore"):
        e_od = e.astype(od).astype(np.float64)
    over = ok & np.isinf(e_od)  # float16: beyond 65504, rounds to +-Inf
    fin = ok & ~over
    for v in (got, want):
        assert (np.abs(v[fin] - e[fin]) <= eps * np.abs(e[fin]) + tiny + k * 2.0**-24 * mag[fin]).all()
        np.testing.assert_array_equal(v[over], e_od[over])
    for shape in ((1, 0, 8, 64), (1, 8, 0, 64), (0, 8, 8, 64), (1, 8, 8, 0)):
        bs, mm, nn, kk = shape
        z = lambda r: mk(np.zeros((bs, r, kk), np.uint8), np.full((bs, r, kk // 32), 127, np.uint8))  # noqa: E731
        out = gemm(z(mm), z(nn), od, "default", "cuda")
        assert out.shape == (bs, mm, nn) and not np.asarray(out.astype(jnp.float32)).any()
