"""Mosaic GPU w4a16 kernel (jax_mxfp4/kernels/wgemm_mgpu.py) on a CPU machine.

The kernel runs only on an NVIDIA Hopper GPU (tests/gpu/test_gpu_wgemm_mgpu.py checks it there
against backend "xla"). Here: it LOWERS for CUDA (Mosaic GPU's lowering runs without a GPU; this
catches layout, transform and shared-memory errors), the decodes' data flow is modelled in NumPy,
and bad input is refused. The "ptx" decode runs the inline PTX of
jax_mxfp4/kernels/e2m1_asm.py with the call convention that tests/test_wgemm.py's PTX model
checks on every byte and E8M0 edge (4 bytes in one register, the block scale duplicated in both
bfloat16 lanes of $5 and $6); here its column order against the two register layouts.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jax_mxfp4.kernels import wgemm_mgpu as wm

# independent reference: ml_dtypes' float4_e2m1fn for the codes
E2M1_VALUES = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)


def _mgpu_available():
    try:
        from jax.experimental.pallas import mosaic_gpu  # noqa: F401
    except Exception:  # noqa: BLE001 - jaxlib built without Mosaic GPU
        return False
    return True


@pytest.mark.sweep(keep=4)
@pytest.mark.skipif(not _mgpu_available(), reason="Mosaic GPU lowering unavailable in this jaxlib")
@pytest.mark.parametrize("m,n,k,cfg", [
    (16, 8192, 8192, wm.MgpuConfig()),
    (1, 8192, 8192, wm.MgpuConfig(bk=512, split_k=2, stages=3)),
    (128, 8192, 8192, wm.MgpuConfig(bk=128, split_k=4)),
    (16, 256, 256, wm.MgpuConfig(bk=64, split_k=2)),
    (40, 1024, 4096, wm.MgpuConfig(bk=512, split_k=1)),
    (16, 8192, 8192, wm.MgpuConfig(split_k=4, decode="lanes")),
    (1, 1024, 2048, wm.MgpuConfig(bk=512, split_k=2, stages=3, decode="lanes")),
    (40, 1024, 4096, wm.MgpuConfig(bk=64, split_k=1, decode="lanes")),
    (16, 8192, 8192, wm.MgpuConfig(split_k=2, decode="lanes")),
])
def test_lowers_for_cuda(m, n, k, cfg):
    """The split-K tiling (k_split_wgs 1) lowers with both scale forms, with each decode's byte
    order."""
    orders = ("lanes",) if cfg.decode == "lanes" else ("natural",)
    for form, order in ((f, o) for f in wm.SCALE_FORMS for o in orders):
        f = jax.jit(lambda x, d, s: wm.mgpu_w4a16(x, d, s, jnp.bfloat16, cfg, scales_form=form, w_order=order))
        sshape = (n, k // 32) if form == "rows" else (k // 32, n)
        args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((n, k // 2), jnp.uint8),
                jax.ShapeDtypeStruct(sshape, jnp.uint8))
        txt = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in txt, form


@pytest.mark.parametrize("form,sshape,sdt,msg", [
    ("kmajor", (64, 8), jnp.uint8, r"w_scales \('kmajor'\) must be uint8 \(8, 64\)"),
    ("kmajor", (8, 64), jnp.bfloat16, "must be uint8"),
    ("rows", (8, 64), jnp.uint8, r"must be uint8 \(64, 8\)"),
    ("plain", (64, 8), jnp.uint8, "scales_form must be one of"),
    ("bf16", (8, 64), jnp.bfloat16, "scales_form must be one of"),
])
def test_scale_forms_refused_when_they_do_not_match(form, sshape, sdt, msg):
    with pytest.raises(ValueError, match=msg):
        wm.mgpu_w4a16(jnp.zeros((16, 256), jnp.bfloat16), jnp.zeros((64, 128), jnp.uint8),
                      jnp.zeros(sshape, sdt), scales_form=form)


@pytest.mark.parametrize("shapes,msg", [
    (((16, 256), jnp.float32, (64, 128), (64, 8)), "x must be bfloat16"),
    (((16, 256), jnp.bfloat16, (64, 100), (64, 8)), "w_data"),
    (((16, 256), jnp.bfloat16, (64, 128), (64, 4)), "w_scales"),
    (((16, 256), jnp.bfloat16, (48, 128), (48, 8)), "multiple of 64"),
    (((300, 256), jnp.bfloat16, (64, 128), (64, 8)), "M=300"),
    (((16, 288), jnp.bfloat16, (64, 144), (64, 9)), "not a multiple of bk"),
])
def test_bad_input_refused(shapes, msg):
    xs, xd, ds, ss = shapes
    with pytest.raises(ValueError, match=msg):
        wm.mgpu_w4a16(jnp.zeros(xs, xd), jnp.zeros(ds, jnp.uint8), jnp.zeros(ss, jnp.uint8))


def test_byte_order_refused_where_the_decode_cannot_read_it():
    args = (jnp.zeros((16, 256), jnp.bfloat16), jnp.zeros((64, 128), jnp.uint8), jnp.zeros((64, 8), jnp.uint8))
    with pytest.raises(ValueError, match="w_order must be one of"):
        wm.mgpu_w4a16(*args, w_order="interleaved")
    with pytest.raises(ValueError, match="w_order must be one of"):  # the removed "pairs" order
        wm.mgpu_w4a16(*args, cfg=wm.MgpuConfig(bk=64), w_order="pairs")


def test_config_validation():
    """Each rule named: the decodes that remain, bk, and the one-kernel tiling's needs."""
    for decode in ("asm", "mul", "select"):
        with pytest.raises(ValueError, match="decode must be one of"):
            wm.MgpuConfig(decode=decode)
    with pytest.raises(ValueError, match="bk"):
        wm.MgpuConfig(bk=48)
    with pytest.raises(ValueError, match="split_k and stages must be >= 1"):
        wm.MgpuConfig(split_k=0)


@pytest.mark.parametrize("field,value", [
    ("bk", 256.0), ("bk", "256"), ("bk", None), ("split_k", 1.5), ("stages", None), ("k_split_wgs", True),
    ("k_split_wgs", 4.0), ("chunks", 2.0),
])
def test_config_field_types_refused(field, value):
    """A float, string, None or bool where an int belongs is a TypeError
    naming the field: bk=256.0 or k_split_wgs=True passed the value checks before and failed only
    deep inside the kernel's BlockSpecs."""
    with pytest.raises(TypeError, match=f"MgpuConfig.{field} must be an int, got"):
        wm.MgpuConfig(**{field: value})
    assert wm.MgpuConfig(bk=np.int64(256)).bk == 256  # NumPy ints stay fine


def test_defaults_are_the_natural_bytes_dispatch_tiling():
    """MgpuConfig() is what default_mgpu_config picks for natural bytes at K a multiple of 1024."""
    assert wm.MgpuConfig() == wm.default_mgpu_config(16, 8192, 8192, "natural")
    assert wm.MgpuConfig() == wm.default_mgpu_config(1, 1024, 1024, "natural")


def test_one_kernel_config_needs_two_stages():
    with pytest.raises(ValueError, match="k_split_wgs > 1 needs stages >= 2"):
        wm.MgpuConfig(bk=512, split_k=1, decode="lanes", k_split_wgs=4, stages=1)
    assert wm.MgpuConfig(bk=512, split_k=1, decode="lanes", k_split_wgs=4, stages=2).stages == 2


def _pairs_fragment(stored, e2m1_values):
    """NumPy model of the "pairs" decode's data flow: thread g of a row holds stored bytes
    16b + 4g .. 16b + 4g + 3 of block b (WGMMA_LAYOUT_8BIT) and writes byte t's two elements to
    its bfloat16 WGMMA A slots, K columns 32b + 8t + 2g (low nibble) and +1 (high nibble)."""
    rows, kh = stored.shape
    frag = np.empty((rows, 2 * kh))
    for b in range(kh // 16):
        for g in range(4):
            for t in range(4):
                byte = stored[:, 16 * b + 4 * g + t]
                col = 32 * b + 8 * t + 2 * g
                frag[:, col], frag[:, col + 1] = e2m1_values[byte & 15], e2m1_values[byte >> 4]
    return frag


def test_pairs_fragment_meets_x_in_the_right_order(rng):
    """pair_order_bytes bytes through the one-fragment decode's data flow (what the "lanes" decode
    and the "natural" decode's quad transpose leave in registers) against x as it is: the natural
    product exactly (small integers, float64)."""
    from jax_mxfp4.decode_prepared import pair_order_bytes

    n, k = 5, 96
    codes = rng.integers(0, 16, (n, k)).astype(np.uint8)
    natural = codes[:, 0::2] | (codes[:, 1::2] << 4)
    x = rng.integers(-8, 9, (3, k)).astype(np.float32)
    stored = pair_order_bytes(natural)
    got = x.astype(np.float64) @ _pairs_fragment(stored, E2M1_VALUES).T
    np.testing.assert_array_equal(got, x.astype(np.float64) @ E2M1_VALUES[codes].T)
    # a 4x4 transpose per block: an involution, and only a permutation
    np.testing.assert_array_equal(pair_order_bytes(stored), natural)
    np.testing.assert_array_equal(np.sort(stored, axis=1), np.sort(natural, axis=1))


def test_pairs_order_refuses_a_partial_block():
    from jax_mxfp4.decode_prepared import pair_order_bytes

    with pytest.raises(ValueError, match="16-byte"):
        pair_order_bytes(np.zeros((2, 24), np.uint8))


def test_ptx_fragment_order_is_a_permutation_matching_the_layouts():
    """The "ptx" decode's column order: a permutation of each block's 16 bytes, and x's split
    gathers exactly the elements the decoded fragments hold (low nibble of byte j = element 2j)."""
    order = wm._ptx_fragment_order()
    assert sorted(order.tolist()) == list(range(16))
    # thread g of a row holds bytes 4g..4g+3 (WGMMA_LAYOUT_8BIT) and fragment columns
    # 2g, 2g+1 | 8+2g, 8+2g+1 (bfloat16 WGMMA layout): those columns must map to its own bytes
    for g in range(4):
        cols = [2 * g, 2 * g + 1, 8 + 2 * g, 9 + 2 * g]
        assert order[cols].tolist() == [4 * g, 4 * g + 1, 4 * g + 2, 4 * g + 3]
    x = jnp.arange(2 * 64, dtype=jnp.float32).reshape(2, 64).astype(jnp.bfloat16)
    lo, hi = wm.split_x(x)
    want_lo = np.concatenate([32 * b + 2 * order for b in range(2)])
    np.testing.assert_array_equal(np.asarray(lo[0], np.float32), want_lo)
    np.testing.assert_array_equal(np.asarray(hi[0], np.float32), want_lo + 1)
    # the permuted contraction equals the natural one
    w = np.random.default_rng(1).standard_normal((3, 64))
    byte_cols = np.concatenate([16 * b + order for b in range(2)])
    got = np.asarray(lo, np.float64) @ w[:, 2 * byte_cols].T + np.asarray(hi, np.float64) @ w[:, 2 * byte_cols + 1].T
    np.testing.assert_allclose(got, np.asarray(x, np.float64) @ w.T, rtol=1e-12)


@pytest.mark.skipif(not _mgpu_available(), reason="Mosaic GPU lowering unavailable in this jaxlib")
def test_dispatch_switch_routes_hopper_w4a16_to_the_kernel(monkeypatch):
    """Behind backends.pallas.W4A16_MOSAIC_GPU (on by default): a decode-size w4a16 problem on a
    compute-capability-9.0 CUDA device routes to the Mosaic GPU kernel and lowers for CUDA."""
    import jax_mxfp4 as mx
    from jax_mxfp4.backends import fp8, pallas
    from jax_mxfp4.backends.base import GemmProblem

    prob = GemmProblem(batch=1, m=16, n=1024, k=2048, out_dtype=np.dtype(jnp.bfloat16), scale_layout="plain",
                       platform="cuda", lhs_kind="float", rhs_kind="mxfp4", lhs_dtype=np.dtype(jnp.bfloat16))
    monkeypatch.setattr(pallas, "W4A16_MOSAIC_GPU", False)
    monkeypatch.setattr(fp8, "_compute_capability", lambda: (9, 0))
    assert "Mosaic" not in pallas.PallasBackend().route(prob)
    monkeypatch.setattr(pallas, "W4A16_MOSAIC_GPU", True)
    monkeypatch.setattr(fp8, "_compute_capability", lambda: (9, 0))
    assert "Mosaic GPU kernel" in pallas.PallasBackend().route(prob)
    assert "w4a16" in pallas.PallasBackend().route(prob)
    a4w4 = dataclasses.replace(prob, lhs_kind="mxfp4", lhs_dtype=np.dtype(np.float32))
    assert "Mosaic GPU kernel" in pallas.PallasBackend().route(a4w4)  # small side dequantized
    assert "a4w4" in pallas.PallasBackend().route(a4w4)
    for other in (dict(m=100), dict(platform="rocm"), dict(m=100, lhs_kind="mxfp4", lhs_dtype=np.dtype(np.float32))):
        assert "Mosaic" not in pallas.PallasBackend().route(dataclasses.replace(prob, **other))
    x = jax.ShapeDtypeStruct((1, 16, 2048), jnp.bfloat16)
    w = mx.quantize(jnp.ones((1, 1024, 2048), jnp.float32), 2)
    f = jax.jit(lambda a, wd, ws: pallas._weight_stationary(
        a, mx.MXFP4Array(wd, ws, 2, w.shape, w.dtype, w.scale_mode, "plain"), prob))
    txt = f.trace(x, w.data, w.scales).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in txt
    xq = mx.quantize(jnp.ones((1, 16, 2048), jnp.float32), 2)
    g = jax.jit(lambda xd, xs, wd, ws: pallas._weight_stationary(
        mx.MXFP4Array(xd, xs, 2, xq.shape, xq.dtype, xq.scale_mode, "plain"),
        mx.MXFP4Array(wd, ws, 2, w.shape, w.dtype, w.scale_mode, "plain"), a4w4))
    assert "mosaic_gpu" in g.trace(xq.data, xq.scales, w.data, w.scales).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.sweep(keep=4)
@pytest.mark.skipif(not _mgpu_available(), reason="Mosaic GPU lowering unavailable in this jaxlib")
@pytest.mark.parametrize("m,n,k", [(1, 8192, 8192), (16, 4096, 14336), (40, 1024, 4096), (64, 320, 640),
                                   (16, 192, 96 * 64), (64, 1024, 2048), (64, 8192, 8192), (33, 128, 1024)])
@pytest.mark.parametrize("order", ["natural", "lanes"])
def test_default_config_lowers(m, n, k, order):
    """Every dispatch default lowers, float32 output included (the largest output tile): e.g.
    "lanes" at 64 rows x K 2048 must not pick a bk whose two pipeline stages do not fit in shared
    memory (a trace-time error inside dot_general)."""
    assert wm.unsupported_reason(m, n, k) is None
    cfg = wm.default_mgpu_config(m, n, k, order)
    for odt in (jnp.bfloat16, jnp.float32):
        assert "mosaic_gpu" in _lowered_text(m, n, k, cfg, odt, order), (odt, cfg)


def test_unsupported_shapes_named():
    assert "M=300" in wm.unsupported_reason(300, 1024, 1024)
    assert "N=100" in wm.unsupported_reason(16, 100, 1024)
    assert "K=1056" in wm.unsupported_reason(16, 1024, 1056)


def test_argument_errors_are_named_before_the_kernel():
    """Ranks, non-arrays, the cfg type, out_dtype and K = 0 are refused with the argument's name
    (they were unpacking errors, AttributeErrors, a silently accepted int8 output or an empty
    kernel); scale bytes given as float8_e8m0fnu (DecodePrepared.scales) are the same bytes."""
    x, wd = jnp.zeros((16, 1024), jnp.bfloat16), jnp.zeros((64, 512), jnp.uint8)  # K = bk * split_k
    srows, skm = jnp.zeros((64, 32), jnp.uint8), jnp.zeros((32, 64), jnp.uint8)
    for args, kw, err, msg in (
        ((x[0], wd, srows), {}, ValueError, r"x must be 2-D \(bfloat16 \[M, K\]\), got shape \(1024,\)"),
        ((x[None], wd, srows), {}, ValueError, "x must be 2-D"),
        ((x, wd[None], srows), {}, ValueError, "w_data must be 2-D"),
        ((x, wd, skm[None]), {"scales_form": "kmajor"}, ValueError, "w_scales must be 2-D"),
        (([[1.0]], wd, srows), {}, TypeError, "x must be an array"),
        ((x, wd, srows), {"cfg": {"bk": 256}}, TypeError, "cfg must be an MgpuConfig or None, got dict"),
        ((x, wd, srows), {"out_dtype": jnp.int8}, ValueError, "out_dtype must be float32, bfloat16 or float16"),
        ((x, wd, srows), {"out_dtype": "float64"}, ValueError, "out_dtype must be float32, bfloat16 or float16"),
        ((x[:, :0], wd[:, :0], srows[:, :0]), {}, ValueError, "K must be > 0"),
        ((x, wd, skm.view(jnp.float8_e8m0fnu)), {"scales_form": "bf16"}, ValueError,
         "scales_form must be one of"),
    ):
        with pytest.raises(err, match=msg):
            wm.mgpu_w4a16(*args, **kw)
    if jax.default_backend() == "cpu":  # an eager call on CPU: named, not Pallas' "only interpret mode"
        with pytest.raises(RuntimeError, match="mgpu_w4a16 runs only on an NVIDIA Hopper GPU .*; x is on cpu"):
            wm.mgpu_w4a16(x, wd, srows)
    for form, s in (("kmajor", skm), ("rows", srows)):  # accepted: shapes and dtype as the uint8 form
        out = jax.eval_shape(lambda a, b, c: wm.mgpu_w4a16(a, b, c, jnp.float32, scales_form=form),
                             x, wd, s.view(jnp.float8_e8m0fnu))
        assert out.shape == (16, 64) and out.dtype == jnp.float32


# ---- k_split_wgs: one kernel per call, the final [M, N] output written by the kernel

KS_CFGS = {
    "ks4 lanes bk512": wm.MgpuConfig(bk=512, split_k=1, stages=5, decode="lanes", k_split_wgs=4),
    "ks4 lanes bk256": wm.MgpuConfig(bk=256, split_k=1, stages=6, decode="lanes",
                                     k_split_wgs=4),  # 64-element slices: 32-byte swizzle on the bytes
}


def _lowered_text(m, n, k, cfg, out_dtype, order, form="kmajor"):
    f = jax.jit(lambda x, d, s: wm.mgpu_w4a16(x, d, s, out_dtype, cfg, scales_form=form, w_order=order))
    sshape = (n, k // 32) if form == "rows" else (k // 32, n)
    args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((n, k // 2), jnp.uint8),
            jax.ShapeDtypeStruct(sshape, jnp.uint8))
    out = jax.eval_shape(f, *args)
    assert out.shape == (m, n) and out.dtype == out_dtype
    return f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _hlo_ops(txt):
    """The StableHLO operations of the lowered main function (the Mosaic GPU kernel is one
    custom_call; anything else is a separate XLA kernel or a free reshape)."""
    import re

    return re.findall(r"= (stablehlo\.[a-z_]+)", txt)


@pytest.mark.sweep(keep=3)
@pytest.mark.skipif(not _mgpu_available(), reason="Mosaic GPU lowering unavailable in this jaxlib")
@pytest.mark.parametrize("m,n,k", [(16, 8192, 8192), (1, 8192, 8192), (40, 1024, 4096)])
def test_k_split_wgs_lowers_for_cuda(m, n, k):
    """Every output dtype; with "kmajor" scales and M below 8 or a multiple of 8 the call is ONE
    kernel (no pad, split-K sum, transpose, cast or slice around it); other M: padded x rows in,
    the first m rows out."""
    cfg = KS_CFGS["ks4 lanes bk512"]
    for odt in (jnp.bfloat16, jnp.float32):
        ops = _hlo_ops(_lowered_text(m, n, k, cfg, odt, "lanes"))
        assert ops.count("stablehlo.custom_call") == 1, ops
        as_is = m < 8 or m % 8 == 0
        if as_is:
            assert ops == ["stablehlo.custom_call"], (odt, ops)
        else:
            assert "stablehlo.pad" in ops and "stablehlo.slice" in ops, ops


@pytest.mark.skipif(not _mgpu_available(), reason="Mosaic GPU lowering unavailable in this jaxlib")
@pytest.mark.parametrize("m,n,k,name,odt,form", [
    (16, 8192, 8192, "ks4 lanes bk256", jnp.bfloat16, "kmajor"),
    (1, 8192, 8192, "ks4 lanes bk256", jnp.float32, "kmajor"),
    (16, 1024, 2048, "ks4 lanes bk512", jnp.float16, "rows"),
    (64, 1024, 2048, "ks4 lanes bk256", jnp.bfloat16, "kmajor"),
])
def test_k_split_wgs_other_tilings_lower(m, n, k, name, odt, form):
    assert "mosaic_gpu" in _lowered_text(m, n, k, KS_CFGS[name], odt, "lanes", form)


@pytest.mark.skipif(not _mgpu_available(), reason="Mosaic GPU lowering unavailable in this jaxlib")
@pytest.mark.parametrize("m", [1, 5, 8, 9, 16, 24, 33])
def test_one_kernel_tiling_pads_few_rows_to_8(m):
    """Token-generation sizes (M <= 8) run 8 x rows (WGMMA N = 8) with the one-kernel tiling, half
    the x tiles of the 16-row padding; the split-K tiling and larger M keep multiples of 16. Lowers
    as one kernel with a pad and a slice around it where M is not the padded size."""
    ks, split = KS_CFGS["ks4 lanes bk512"], wm.MgpuConfig(bk=256, split_k=4, decode="lanes")
    assert wm.padded_rows(m, ks) == (8 if m <= 8 else -(-m // 16) * 16)
    assert wm.padded_rows(m, split) == -(-m // 16) * 16 == wm.padded_rows(m)
    for bad, err in ((0, ValueError), (-1, ValueError), (2.5, TypeError), (True, TypeError)):
        with pytest.raises(err, match="padded_rows: m must be"):
            wm.padded_rows(bad, ks)
    with pytest.raises(TypeError, match="cfg must be an MgpuConfig"):
        wm.padded_rows(m, "ks4")
    ops = _hlo_ops(_lowered_text(m, 8192, 8192, ks, jnp.bfloat16, "lanes"))
    assert ops.count("stablehlo.custom_call") == 1
    # rows fewer than 8 or a multiple of 8 go in and out as they are (TMA zero-fills the box past
    # M and stores no row past it): no pad, no slice; others are padded and sliced
    as_is = m < 8 or m % 8 == 0
    assert ("stablehlo.pad" in ops) == (not as_is and wm.padded_rows(m, ks) != m), ops
    assert ("stablehlo.slice" in ops) == ("stablehlo.pad" in ops), ops


def test_k_split_wgs_config_refused_with_the_rule():
    base = dict(bk=512, split_k=1, decode="lanes")
    for kw in (3, 0, 2):
        with pytest.raises(ValueError, match=rf"k_split_wgs must be one of \(1, 4\), got {kw}"):
            wm.MgpuConfig(**base, k_split_wgs=kw)
    for over, msg in (
        (dict(split_k=2), r"k_split_wgs > 1 needs split_k=1 .*got split_k=2"),
        (dict(bk=192), r"k_split_wgs=4 needs bk to be a multiple of 256 .*got bk=192"),
        (dict(bk=128), r"k_split_wgs=4 needs bk to be a multiple of 256 .*got bk=128"),
        (dict(decode="ptx"), r'k_split_wgs > 1 \(the one-kernel tiling\) needs decode="lanes", got decode=.ptx.'),
    ):
        with pytest.raises(ValueError, match=msg):
            wm.MgpuConfig(**{**base, **over}, k_split_wgs=4)
    assert wm.MgpuConfig(**base, k_split_wgs=4).k_split_wgs == 4
    assert wm.MgpuConfig().k_split_wgs == 1  # default unchanged: off


@pytest.mark.skipif(not _mgpu_available(), reason="Mosaic GPU lowering unavailable in this jaxlib")
def test_k_split_wgs_refuses_what_does_not_fit():
    cfg = KS_CFGS["ks4 lanes bk512"]
    f = lambda m, k: wm.mgpu_w4a16(jnp.zeros((m, k), jnp.bfloat16), jnp.zeros((64, k // 2), jnp.uint8),
                                   jnp.zeros((k // 32, 64), jnp.uint8), jnp.bfloat16, cfg, scales_form="kmajor",
                                   w_order="lanes")
    with pytest.raises(ValueError, match=r"k_split_wgs=4 with bk=512, K=512 .* needs two pipeline stages \(1 K steps"):
        f(16, 512)  # one K step
    with pytest.raises(ValueError, match=r"k_split_wgs=4 with bk=512, K=4096 and 256 padded rows needs two"):
        f(256, 4096)  # x tiles of 256 rows: 2 stages do not fit in shared memory
    with pytest.raises(ValueError, match=r"not a multiple of bk\*split_k=512"):
        f(16, 768)


def _pairs_fragment_np(stored_bytes, scales, e2m1_values):
    """Decoded [rows, 2 * bytes] fragment of the "pairs" decode (_pairs_fragment) times its block scales."""
    frag = _pairs_fragment(stored_bytes, e2m1_values)
    return frag * np.repeat(scales, 32, axis=1)


@pytest.mark.parametrize("bk", [512, 256])
def test_k_split_index_model_gives_the_product(bk, rng):
    """NumPy model of the k_split_wgs kernel's data flow, with the kernel's own slice arithmetic
    (_wg_k_slice) and the fragment order modelled above: per 64-row tile, per K step, warpgroup
    w decodes ITS bytes with ITS scale blocks and multiplies ITS x columns (natural x for "lanes"
    bytes); the partial sums are added in warpgroup order and the tile is stored transposed into
    out[:, 64 tile : 64 tile + 64]. Exact in float64 (small integers, power-of-two scales)
    against x @ W^T."""
    from jax_mxfp4.decode_prepared import pair_order_bytes

    kw = wm.K_SPLIT_WGS[-1]
    m, n, k = 5, 128, 2 * bk
    mp = 16
    codes = rng.integers(0, 16, (n, k)).astype(np.uint8)
    natural = codes[:, 0::2] | (codes[:, 1::2] << 4)
    sexp = rng.integers(-3, 4, (n, k // 32))
    scales = 2.0 ** sexp
    x = np.zeros((mp, k))
    x[:m] = rng.integers(-8, 9, (m, k))
    stored = pair_order_bytes(natural)  # the "lanes" registers: the pairs PTX's outputs on these (test_wgemm.py)
    hb, nb = bk // 2, bk // 32
    out = np.full((mp, n), np.nan)
    for tile in range(n // 64):
        rows = slice(64 * tile, 64 * tile + 64)
        partial = np.zeros((kw, 64, mp))
        for t in range(k // bk):
            for w in range(kw):
                (b0, bn), (s0, sn), (x0, xn) = wm._wg_k_slice(w, bk, kw)
                assert bn == 16 * sn and xn == 2 * bn  # whole blocks: bytes, scales, x columns agree
                byt = stored[rows, t * hb + b0: t * hb + b0 + bn]
                sc = scales[rows, t * nb + s0: t * nb + s0 + sn]
                partial[w] += _pairs_fragment_np(byt, sc, E2M1_VALUES) @ x[:, t * bk + x0: t * bk + x0 + xn].T
        total = partial[0]
        for w in range(1, kw):
            total = total + partial[w]
        out[:, 64 * tile: 64 * tile + 64] = total.T
    want = x[:m] @ (E2M1_VALUES[codes] * np.repeat(scales, 32, axis=1)).T
    np.testing.assert_array_equal(out[:m], want)
    # each warpgroup's slices tile each step exactly once
    cover = np.zeros(bk, int)
    for w in range(kw):
        _, _, (x0, xn) = wm._wg_k_slice(w, bk, kw)
        cover[x0:x0 + xn] += 1
    assert (cover == 1).all()


@pytest.mark.slow
@pytest.mark.skipif(not _mgpu_available(), reason="Mosaic GPU lowering unavailable in this jaxlib")
def test_k_split_variants_lower_at_their_device_test_shapes():
    """The k_split_wgs variants of tests/gpu/mgpu_variants.py (those tests/gpu/test_gpu_wgemm_mgpu.py
    runs on the GPU) lower at the shapes it checks them at: the small case 16x256x1024 with the
    variant's tiling and with its every-byte tiling (float32 out), 16x8192x8192 (bfloat16),
    1x8192x8192 and 40x1024x4096 (float32), the pipeline shapes, with the byte order each
    variant's name says."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu"))
    import mgpu_variants as mv

    ks = {nm: c for nm, c in mv.VARIANTS.items() if c.k_split_wgs > 1}
    smoke_structs = {mv.struct(mv.VARIANTS[nm]) for nm in mv.SMOKE}
    assert ks and all(mv.struct(c) in smoke_structs for c in ks.values())  # every structure smoke-checked
    for name, cfg in ks.items():
        for m, n, k, odt, c in ((*mv.small_case(cfg), jnp.float32, cfg),
                                (*mv.small_case(cfg), jnp.float32, mv.edge_config(cfg)),
                                (16, 8192, 8192, jnp.bfloat16, cfg), (1, 8192, 8192, jnp.float32, cfg),
                                (40, 1024, 4096, jnp.float32, cfg)):
            assert "mosaic_gpu" in _lowered_text(m, n, k, c, odt, mv.w_order(name), "rows"), (name, m)
        bisect = mv.bisect_ks(cfg)  # K steps = stages, stages + 1, 2 stages + 1
        assert [k // cfg.bk for _, _, k in bisect] == [cfg.stages, cfg.stages + 1, 2 * cfg.stages + 1]
        for m, n, k in bisect:
            assert "mosaic_gpu" in _lowered_text(m, n, k, cfg, jnp.float32, mv.w_order(name), "rows"), (name, k)


@pytest.mark.sweep(keep=2)
@pytest.mark.skipif(not _mgpu_available(), reason="Mosaic GPU lowering unavailable in this jaxlib")
@pytest.mark.parametrize("m,n,k", [(1, 8192, 8192), (16, 4096, 14336), (40, 1024, 4096), (64, 320, 640),
                                   (16, 192, 96 * 64)])
def test_k_split_config_lowers_where_the_default_does(m, n, k):
    """The one-kernel tiling lowers at every shape the dispatch default is tested at (64 padded
    rows included)."""
    cfg = wm.k_split_config(m, n, k)
    if not any(k % bk == 0 and k // bk >= 2 for bk in (512, 256)):
        assert cfg is None  # K=640: no bk of four 64-element slices divides it twice
    else:
        assert cfg is not None and cfg.k_split_wgs == 4 and cfg.decode == "lanes" and k // cfg.bk >= 2
        assert "mosaic_gpu" in _lowered_text(m, n, k, cfg, jnp.bfloat16, "lanes")
    assert wm.k_split_config(16, 8192, 8192).bk == 512
    assert wm.k_split_config(16, 1024, 128) is None  # one K step at most
    assert wm.k_split_config(16, 1024, 192) is None  # no bk of whole 64-element slices divides K
    assert wm.k_split_config(16, 1024, 256) is None  # 4 slices of 64: bk 256, one step


def test_default_config_refuses_what_it_cannot_tile():
    with pytest.raises(ValueError, match="w_order must be one of"):
        wm.default_mgpu_config(16, 128, 256, "bogus")
    with pytest.raises(ValueError, match="multiple of 64"):
        wm.default_mgpu_config(4, 128, 100)
    assert wm.default_mgpu_config(16, 128, 64).bk == 64


@pytest.mark.parametrize("fn", ["default_mgpu_config", "k_split_config"])
def test_tiling_choosers_refuse_bad_arguments(fn):
    """Both choosers name the argument and the rule: before, they took m = 0, negative or bool
    m / n and non-int shapes, returning a tiling; default_mgpu_config also refuses an unknown
    w_order (a typo such as "pair" would pick the "ptx" decode)."""
    chooser = getattr(wm, fn)
    f = (lambda *a: chooser(*a, "lanes")) if fn == "default_mgpu_config" else chooser
    if fn == "default_mgpu_config":
        for order in ("pairs", "pair", "Lanes", "", None):
            with pytest.raises(ValueError, match="w_order must be one of"):
                chooser(16, 1024, 1024, order)
    for m, n in ((0, 1024), (-5, 1024), (16, 0), (16, -64)):
        with pytest.raises(ValueError, match="M and N must be >= 1"):
            f(m, n, 1024)
    for args in ((True, 1024, 1024), (16.0, 1024, 1024), ("16", 1024, 1024), (16, None, 1024),
                 (16, 1024, 1024.0), (16, 1024, True)):
        with pytest.raises(TypeError, match=r"\b[mnk] must be an int"):
            f(*args)
    for k in (0, -1024, 100, 96):
        with pytest.raises(ValueError, match="multiple of 64"):
            f(16, 1024, k)
    assert f(np.int64(16), np.int64(1024), np.int64(8192)) == f(16, 1024, 8192)


@pytest.mark.parametrize("m,n,k", [(1, 8192, 8192), (16, 4096, 14336), (40, 1024, 4096), (64, 320, 640),
                                   (16, 192, 96 * 64), (16, 1024, 256)])
def test_default_config_by_byte_order(m, n, k):
    """"lanes" bytes take the one-kernel tiling with 4 compute warpgroups where k_split_config
    gives one (timed faster on the H200), else the split-K kernel; natural bytes always the
    split-K kernel with the "ptx" decode."""
    lanes, natural = wm.default_mgpu_config(m, n, k, "lanes"), wm.default_mgpu_config(m, n, k, "natural")
    one = wm.k_split_config(m, n, k)
    if one is not None:
        assert lanes == one and lanes.k_split_wgs == 4 and lanes.split_k == 1
    else:
        assert lanes.k_split_wgs == 1 and lanes.decode == "lanes" and k % (lanes.bk * lanes.split_k) == 0
    assert natural.k_split_wgs == 1 and natural.decode == "ptx" and k % (natural.bk * natural.split_k) == 0
    assert (one is None) == (k in (640, 256))


# ---- k_split_wgs hangs: the 2026-12-01 H200 run hung in "ks4" (4 compute warpgroups) at every K.
# Two bug classes a CPU machine can catch: a register request the CTA cannot satisfy
# (setmaxnreg.inc blocks forever), read from the lowered Mosaic GPU module; and a barrier
# schedule that deadlocks or races (slot reuse when K steps > stages, arrival counts), run in
# jax's Mosaic GPU interpreter.

def _mosaic_module(lowered_txt):
    """The Mosaic GPU module inside a lowered custom call (MLIR bytecode in its backend config),
    printed in generic form."""
    import re

    from jax._src.interpreters import mlir as jax_mlir
    from jax.experimental.mosaic.gpu import dialect as mgpu_dialect
    from jaxlib.mlir import ir

    found = re.search(r'module = "((?:[^"\\]|\\.)*)"', lowered_txt)
    if found is None:
        pytest.skip("this jax does not store the Mosaic GPU module as bytecode in the custom call")
    esc, raw, i = found.group(1), bytearray(), 0
    while i < len(esc):  # MLIR string attribute escapes: \XX hex, \\ and \"
        if esc[i] == "\\":
            if esc[i + 1] in '\\"':
                raw.append(ord(esc[i + 1]))
                i += 2
            else:
                raw.append(int(esc[i + 1:i + 3], 16))
                i += 3
        else:
            raw += esc[i].encode()
            i += 1
    with jax_mlir.make_ir_context() as ctx, ir.Location.unknown():
        mgpu_dialect.register_dialect(ctx)
        ctx.allow_unregistered_dialects = True
        return str(ir.Module.parse(bytes(raw)))


def _register_requests(module_txt):
    """(threads per CTA, setmaxnreg increase values, decrease values) of a Mosaic GPU module."""
    import re

    launch = re.search(r'gpu\.launch"\(([^)]*)\)', module_txt).group(1).split(", ")
    consts = dict(re.findall(r'(%\d+) = "[a-z_.]*arith\.constant"\(\) \{value = (\d+) : index\}', module_txt))
    threads = int(np.prod([int(consts[v]) for v in launch[4:7]]))
    reqs = re.findall(r'setmaxregister"\(\) \{action = #nvvm<action (increase|decrease)>, regCount = (\d+)', module_txt)
    return (threads, [int(r) for a, r in reqs if a == "increase"], [int(r) for a, r in reqs if a == "decrease"])


def _register_demand_ok(threads, inc, dec):
    """setmaxnreg requests of a warp-specialized kernel (one TMA warpgroup decreases, the others
    increase) against the CTA's pool: threads x floor8(65536 / threads) (<= 255 per thread)."""
    assert len(inc) <= 1 and len(dec) <= 1, (inc, dec)
    if not inc and not dec:
        return True
    wgs = threads // 128
    demand = 128 * (dec[0] + (wgs - 1) * inc[0])
    return demand <= threads * (min(255, 65536 // threads) // 8 * 8)


@pytest.mark.skipif(not _mgpu_available(), reason="Mosaic GPU lowering unavailable in this jaxlib")
def test_register_requests_fit_the_cta_pool():
    """The one-kernel tiling's own pipeline asks for no registers its CTA is not launched with
    (none at all: 4 compute warpgroups = 640 threads, ptxas gives <= 96 per thread). The check
    flags jax's own ``emit_pipeline_warp_specialized`` with 4 compute warpgroups (the 2026-12-01
    "ks4" hang: 112 per compute thread, 62464 > 61440), with the numbers ``_ws_register_demand``
    models; with 2 compute warpgroups it asks exactly the pool (40 + 2 x 232 = 3 x 168)."""
    cfg = wm.MgpuConfig(bk=512, split_k=1, stages=5, decode="lanes", k_split_wgs=4)
    threads, inc, dec = _register_requests(_mosaic_module(_lowered_text(16, 256, 3072, cfg, jnp.float32, "lanes")))
    assert (threads, inc, dec) == (640, [], [])
    assert wm._ws_register_demand(2, 40) == (64512, 64512)

    # jax's pipeline itself with 4 compute warpgroups: flagged
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def body(x_g, o_g):
        def step(_, x_s):
            del x_s

        plgpu.emit_pipeline_warp_specialized(
            step, grid=(4,), memory_registers=40, wg_axis="wg", num_compute_wgs=4, max_concurrent_steps=2,
            in_specs=[plgpu.BlockSpec((64, 64), lambda t: (0, t))])(x_g)

    f = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((8,), jnp.float32), num_threads=5, thread_name="wg")
    txt = jax.jit(f).trace(jax.ShapeDtypeStruct((64, 256), jnp.float32)).lower(lowering_platforms=("cuda",)).as_text()
    threads, inc, dec = _register_requests(_mosaic_module(txt))
    assert (threads, inc, dec) == (640, [112], [40])
    assert not _register_demand_ok(threads, inc, dec)
    assert wm._ws_register_demand(4, 40) == (128 * (40 + 4 * 112), 640 * 96)


def _interpreter_available():
    try:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # noqa: F401
    except Exception:  # noqa: BLE001 - a jax without the Mosaic GPU interpreter
        return False
    return _mgpu_available()


def _run_toy(cases, timeout):
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    return subprocess.run([sys.executable, os.path.join(here, "mgpu_pipeline_toy.py"), *cases],
                          capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))


@pytest.mark.slow
@pytest.mark.skipif(not _interpreter_available(), reason="jax's Mosaic GPU interpreter unavailable")
def test_k_split_own_pipeline_schedule_runs_in_the_interpreter():
    """The "own" pipeline's schedule (the real ``_k_split_own_pipeline``) in jax's Mosaic GPU
    interpreter (tests/mgpu_pipeline_toy.py): 2 and 4 compute warpgroups, K steps = 2 with 2
    stages (the smoke case), = stages, stages + 1 and 2 stages + 1 (slots reused once, twice);
    every result exact, no deadlock (a child process with a time limit)."""
    cases = ["2:2:2", "4:2:2", "2:5:5", "4:6:5", "2:11:5", "4:11:5"]
    r = _run_toy(cases, timeout=600)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith(("OK", "MISMATCH"))]
    assert r.returncode == 0, r.stderr[-3000:]
    assert lines == [f"OK {c.replace(':', ' ')}" for c in cases], (lines, r.stderr[-2000:])


@pytest.mark.slow
@pytest.mark.skipif(not _interpreter_available(), reason="jax's Mosaic GPU interpreter unavailable")
def test_interpreter_run_catches_a_deadlocking_barrier_count():
    """The same harness with the consumed barriers expecting one arrival too many (kw + 1, the
    bug class of counting the releasing warpgroups wrong): the TMA warpgroup waits forever,
    the child is killed at its time limit instead of passing."""
    import subprocess

    with pytest.raises(subprocess.TimeoutExpired):
        _run_toy(["4:6:5:5"], timeout=20)


# ---- the one-kernel tiling's decode in parts (chunks) and folded scale multiply
KS4 = dict(bk=512, split_k=1, stages=5, decode="lanes", k_split_wgs=4)


def test_chunks_config_rules():
    """chunks: the one-kernel tiling with the "lanes" decode, and parts of whole 64-element slices."""
    assert wm.MgpuConfig(**KS4, chunks=2).chunks == 2
    with pytest.raises(ValueError, match="chunks=4 must divide"):
        wm.MgpuConfig(**KS4, chunks=4)  # 128 K columns per warpgroup: 2 parts at most
    with pytest.raises(ValueError, match="chunks > 1 needs the one-kernel tiling"):
        wm.MgpuConfig(bk=256, split_k=4, decode="lanes", chunks=2)
    with pytest.raises(ValueError, match="chunks=3 must divide"):
        wm.MgpuConfig(**KS4, chunks=3)
    with pytest.raises(TypeError, match="MgpuConfig.chunks must be an int"):
        wm.MgpuConfig(**KS4, chunks=2.0)


@pytest.mark.skipif(not _mgpu_available(), reason="Mosaic GPU lowering unavailable in this jaxlib")
@pytest.mark.parametrize("m", [16, 1])
@pytest.mark.parametrize("chunks", [2, 1])
def test_chunks_lower_for_cuda(m, chunks):
    cfg = wm.MgpuConfig(**KS4, chunks=chunks)
    ops = _hlo_ops(_lowered_text(m, 8192, 8192, cfg, jnp.bfloat16, "lanes"))
    assert ops == ["stablehlo.custom_call"], ops


@pytest.mark.skipif(not _mgpu_available(), reason="Mosaic GPU lowering unavailable in this jaxlib")
@pytest.mark.parametrize("m", [16, 1, 40])
def test_lanes_decode_lowers_and_pairs_with_lanes_bytes_only(m):
    """default_mgpu_config for "lanes" bytes: the one-kernel tiling with the "lanes" decode, one
    kernel per call at M = 1 and 16; the "lanes" decode refuses other byte orders and "lanes"
    bytes refuse other decodes (a wrong pairing would be a silently wrong product)."""
    cfg = wm.default_mgpu_config(m, 8192, 8192, "lanes")
    assert cfg.decode == "lanes" and cfg.k_split_wgs == 4  # the fastest on the H200
    ops = _hlo_ops(_lowered_text(m, 8192, 8192, cfg, jnp.bfloat16, "lanes"))
    assert ops.count("stablehlo.custom_call") == 1, ops
    if m in (1, 16):
        assert ops == ["stablehlo.custom_call"], ops
    with pytest.raises(ValueError, match='"lanes" decode reads w_order="lanes" bytes only'):
        _lowered_text(m, 8192, 8192, cfg, jnp.bfloat16, "natural")
    with pytest.raises(ValueError, match='"lanes" decode reads w_order="lanes" bytes only'):
        _lowered_text(m, 8192, 8192, wm.default_mgpu_config(m, 8192, 8192, "natural"), jnp.bfloat16, "lanes")


@pytest.mark.skipif(not _mgpu_available(), reason="Mosaic GPU lowering unavailable in this jaxlib")
@pytest.mark.parametrize("m", [16, 1])
def test_fold_lowers_for_cuda(m):
    """One kernel per call with the folded multiply (always on in the one-kernel tiling), both
    scale forms."""
    cfg = wm.MgpuConfig(**KS4, chunks=2)
    for form in ("kmajor", "rows") if m == 16 else ("kmajor",):
        ops = _hlo_ops(_lowered_text(m, 8192, 8192, cfg, jnp.bfloat16, "lanes", form=form))
        assert ops.count("stablehlo.custom_call") == 1, ops
