"""The large-tile Mosaic GPU w4a16 kernel (jax_mxfp4/kernels/wgemm_tiles_mgpu.py) and its route.

It runs only on an NVIDIA Hopper GPU (tests/gpu/test_gpu_wgemm.py checks its values there
against float64 references and backend "xla"). Here, on a
CPU: its tiling rules and errors, that every tiling LOWERS for CUDA (Mosaic GPU's lowering runs
without a GPU) to one kernel with the output shape and dtype asked for, that its setmaxnreg
requests fit the CTA's register pool (a request past it waits forever on the GPU), and that
dispatch routes many-row w4a16 (a prepared or a plain weight) to it on a compute-capability-9.0
device and nothing else.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_mxfp4 as mx
from jax_mxfp4.kernels import wgemm_mgpu as wm
from jax_mxfp4.kernels import wgemm_tiles_mgpu as wt

from test_wgemm_mgpu import _mgpu_available, _mosaic_module, _register_demand_ok, _register_requests

needs_mgpu = pytest.mark.skipif(not _mgpu_available(), reason="Mosaic GPU lowering unavailable in this jaxlib")


def _lowered(m, n, k, cfg, out_dtype=jnp.bfloat16, w_order="lanes"):
    f = jax.jit(lambda x, d, s: wt.mgpu_w4a16_tiles(x, d, s, out_dtype, cfg, w_order=w_order))
    args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((n, k // 2), jnp.uint8),
            jax.ShapeDtypeStruct((k // 32, n), jnp.uint8))
    out = jax.eval_shape(f, *args)
    assert out.shape == (m, n) and out.dtype == out_dtype
    return f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


# ---- configuration

@pytest.mark.parametrize("kw,msg", [
    (dict(mt=96), r"TilesConfig.mt must be one of \(64, 128, 256\)"),
    (dict(mt=512), r"TilesConfig.mt must be one of \(64, 128, 256\)"),
    (dict(decode=np.array(["natural"])), r"TilesConfig.decode must be one of"),
    (dict(bk=96), r"bk must be a positive multiple of 64"),
    (dict(bk=0), r"bk must be a positive multiple of 64"),
    (dict(stages=1), r"stages must be >= 2"),
    (dict(bk=64, chunks=2), r"chunks=2 must split bk=64 into parts of a multiple of 64"),
    (dict(chunks=0), r"chunks=0 must split"),
    (dict(decode="ptx"), r"decode must be one of \('lanes', 'natural'\), got 'ptx'"),
    (dict(decode="pairs"), r"decode must be one of \('lanes', 'natural'\), got 'pairs'"),
])
def test_config_refused_with_the_rule(kw, msg):
    with pytest.raises(ValueError, match=msg):
        wt.TilesConfig(**kw)


@pytest.mark.parametrize("field,value", [("mt", 128.0), ("bk", True), ("stages", "3"), ("chunks", None)])
def test_config_field_types_refused(field, value):
    with pytest.raises(TypeError, match=f"TilesConfig.{field} must be"):
        wt.TilesConfig(**{field: value})


def test_config_takes_numpy_ints_as_python_ints():
    """Pallas grids and Mosaic GPU shapes take Python ints only (a numpy int passed the checks and
    then failed inside jax: an AssertionError on the grid, a memref.subview error; a uint8 field
    wrapped to 0 in the shared-memory model): the fields are stored as ints."""
    cfg = wt.TilesConfig(mt=np.int64(128), bk=np.uint8(128), stages=np.int16(3), chunks=np.int64(2),
                         decode="natural")
    assert all(type(getattr(cfg, f)) is int for f in ("mt", "bk", "stages", "chunks"))
    assert cfg.cta_rows == 128
    assert wt.smem_bytes(cfg, 2) == (128 * 128 * 2 + 128 * 64 + 4 * 128, 2 * 128 * 64 * 2)


@pytest.mark.parametrize("cfg,osize", [(wt.TilesConfig(), 2), (wt.TilesConfig(mt=256, bk=64, chunks=1), 4)])
def test_shared_memory_model(cfg, osize):
    """Per stage: x [mt, bk] bf16 + weight bytes [128, bk/2] + scale bytes [bk/32, 128]; fixed:
    2 output tiles [mt, 64]. Stages: min(asked, K steps, what fits under 227 KiB)."""
    rows = 128
    per, fixed = wt.smem_bytes(cfg, osize)
    assert per == cfg.mt * cfg.bk * 2 + rows * cfg.bk // 2 + cfg.bk // 32 * rows
    assert fixed == 2 * cfg.mt * 64 * osize
    fit = (227 * 1024 - 2048 - fixed) // per
    assert wt.fitted_stages(cfg, osize, 100) == min(cfg.stages, fit)
    assert wt.fitted_stages(cfg, osize, 2) == 2


def test_fitted_stages_refuses_what_cannot_pipeline():
    with pytest.raises(ValueError, match=r"needs two pipeline stages of 74240 bytes .*\(\+131072 fixed\)"):
        wt.fitted_stages(wt.TilesConfig(mt=256, bk=128, stages=2), 4, 64)
    with pytest.raises(ValueError, match=r"two K steps \(1 here\)"):
        wt.fitted_stages(wt.TilesConfig(), 2, 1)


def test_default_config_by_shape_dtype_and_order():
    big = wt.default_tiles_config(1024, 8192, 8192)
    assert (big.mt, big.bk, big.chunks, big.decode) == (256, 64, 1, "lanes")
    # 256-row tiles would leave fewer than 128 CTAs: 128-row tiles
    assert wt.default_tiles_config(256, 8192, 8192).mt == 128
    assert wt.default_tiles_config(512, 8192, 8192).mt == 256
    # a float32 output: 128-row tiles (more pipeline stages fit)
    assert wt.default_tiles_config(1024, 8192, 8192, jnp.float32).mt == 128
    # K that is not a multiple of 128: bk 64
    assert wt.default_tiles_config(256, 1024, 192).bk == 64
    # "natural": bk 128 in two chunks, bk 64 where K needs it
    c = wt.default_tiles_config(1024, 8192, 8192, w_order="natural")
    assert (c.decode, c.mt, c.bk, c.stages, c.chunks) == ("natural", 256, 128, 2, 2)
    assert wt.default_tiles_config(1024, 8192, 192, w_order="natural").bk == 64
    for m, n, k in ((1020, 1024, 1024), (1024, 1000, 1024), (1024, 1024, 64), (1024, 1024, 96)):
        assert wt.default_tiles_config(m, n, k) is None, (m, n, k)
    with pytest.raises(ValueError, match="w_order must be one of"):
        wt.default_tiles_config(1024, 1024, 1024, w_order="lane")


def test_unsupported_reasons_named():
    assert "M=1020 is not a multiple of 8" in wt.unsupported_reason(1020, 1024, 1024)
    assert "N=1000 is not a multiple of 128" in wt.unsupported_reason(1024, 1000, 1024)
    assert "K=64 is not a multiple of bk=128 or 64 with at least two K steps" in wt.unsupported_reason(1024, 1024, 64)
    assert "K=2050 is not a multiple of" in wt.unsupported_reason(1024, 1024, 2050)
    for m, n, k in ((0, 128, 256), (-8, 128, 256), (8, 0, 256), (8, -128, 256), (8, 128, 0)):
        assert "M, N and K must be >= 1" in wt.unsupported_reason(m, n, k), (m, n, k)
        assert wt.default_tiles_config(m, n, k) is None
    assert wt.unsupported_reason(8, 128, 128) is None and wt.unsupported_reason(np.int64(8), 128, 128) is None


@pytest.mark.parametrize("bad", [dict(m="1024"), dict(m=None), dict(m=True), dict(k=1024.0)])
def test_sizes_of_the_wrong_type_refused(bad):
    args = {**dict(m=1024, n=1024, k=1024), **bad}
    for fn in (wt.unsupported_reason, wt.default_tiles_config):
        with pytest.raises(TypeError, match=f"{fn.__name__}: {next(iter(bad))} must be an int"):
            fn(**args)


def test_other_arguments_of_the_choosers_refused():
    with pytest.raises(TypeError, match="unsupported_reason: cfg must be a TilesConfig or None, got str"):
        wt.unsupported_reason(1024, 1024, 1024, "x")
    for odt in (jnp.int8, jnp.float64, "foo"):
        with pytest.raises(ValueError, match="default_tiles_config: out_dtype must be float32, bfloat16 or float16"):
            wt.default_tiles_config(1024, 1024, 1024, odt)
    assert wt.default_tiles_config(1024, 8192, 8192, None).mt == 128  # None: float32


# ---- lowering

TILINGS = {
    "default": wt.TilesConfig(),
    "mt256 bk64": wt.TilesConfig(mt=256, bk=64, chunks=1),
    "mt256 bk128 s2": wt.TilesConfig(mt=256, bk=128, stages=2),
    "numpy ints": wt.TilesConfig(mt=np.int64(128), bk=np.int64(128), stages=np.int64(3)),
    "mt64": wt.TilesConfig(mt=64),
    "natural": wt.TilesConfig(decode="natural"),
    "natural mt256 bk64": wt.TilesConfig(mt=256, bk=64, chunks=1, decode="natural"),
}


@pytest.mark.sweep(keep=4)
@needs_mgpu
@pytest.mark.parametrize("name", list(TILINGS))
@pytest.mark.parametrize("m,n,k", [(1024, 512, 2048), (1000, 256, 384)])
def test_tilings_lower_for_cuda(name, m, n, k):
    cfg = TILINGS[name]
    if k % cfg.bk or k // cfg.bk < 2:
        pytest.skip("K not a multiple of this bk")
    txt = _lowered(m, n, k, cfg, jnp.bfloat16, cfg.decode)  # each byte order has the decode of its name
    assert txt.count("mosaic_gpu") >= 1


@needs_mgpu
@pytest.mark.parametrize("odt", [jnp.float32, jnp.float16])
def test_default_tiling_lowers_for_every_output_width(odt):
    assert "mosaic_gpu" in _lowered(1024, 8192, 8192, wt.default_tiles_config(1024, 8192, 8192, odt), odt)


@needs_mgpu
@pytest.mark.parametrize("order", wt.W_ORDERS)
def test_every_byte_order_is_the_kernel_alone(order):
    """No operand is rearranged outside the kernel for any byte order (permuting x per call costs
    a 0.159 ms XLA transpose at 1024x8192 on the H200); only the "natural" decode runs
    the quad byte transpose (two warp shuffles per weight word) inside it."""
    cfg = wt.default_tiles_config(1024, 512, 2048, w_order=order)
    txt = _lowered(1024, 512, 2048, cfg, jnp.bfloat16, order)
    assert "stablehlo.transpose" not in txt and txt.count("stablehlo.custom_call") == 1
    module = str(_mosaic_module(txt))
    assert ("shfl.sync.bfly.b32" in module) == (order == "natural")


@needs_mgpu
def test_register_requests_fit_the_cta_pool():
    """The TMA warpgroup drops to 40 registers and the two compute warpgroups ask 232 each
    (128 (40 + 2 x 232) = the 384 x 168 a CTA of 384 threads is launched with)."""
    cfg = wt.TilesConfig(mt=256, bk=64, chunks=1)
    threads, inc, dec = _register_requests(_mosaic_module(_lowered(512, 256, 512, cfg)))
    assert threads == 384
    assert (inc, dec) == ([232], [40])
    assert _register_demand_ok(threads, inc, dec)


def test_own_pipeline_refuses_registers_past_the_pool():
    with pytest.raises(ValueError, match=r"registers=\(40, 240\) ask 66560 of the 64512 .*384 threads"):
        wm._k_split_own_pipeline(0, 2, 4, 2, fetch=None, step=None, ready=None, consumed=None,
                                 compute_context=None, registers=(40, 240))


# ---- bad input

def _args(m=1024, n=512, k=2048):
    return (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((n, k // 2), jnp.uint8),
            jax.ShapeDtypeStruct((k // 32, n), jnp.uint8))


@pytest.mark.parametrize("change,exc,msg", [
    (lambda a: (jax.ShapeDtypeStruct(a[0].shape, jnp.float32),) + a[1:], ValueError, "x must be bfloat16"),
    (lambda a: (a[0], jax.ShapeDtypeStruct((512, 512), jnp.uint8), a[2]), ValueError,
     r"w_data must be uint8 \[N, K/2\] with K=2048"),
    (lambda a: a[:2] + (jax.ShapeDtypeStruct((512, 64), jnp.uint8),), ValueError,
     r"w_scales must be the E8M0 bytes K-major, uint8 or float8_e8m0fnu \[64, 512\], got uint8 \(512, 64\)"),
    (lambda a: (np.zeros((4,)),) + a[1:], ValueError, r"x must be 2-D"),
    (lambda a: ([1, 2],) + a[1:], TypeError, r"x must be an array"),
    (lambda a: (jax.ShapeDtypeStruct((1020, 2048), jnp.bfloat16),) + a[1:], ValueError,
     "M=1020 is not a multiple of 8"),
])
def test_bad_arguments_named(change, exc, msg):
    with pytest.raises(exc, match=msg):
        jax.eval_shape(lambda *a: wt.mgpu_w4a16_tiles(*a), *change(_args()))


def test_order_decode_mismatch_and_unknown_order_named():
    with pytest.raises(ValueError, match=r"w_order='natural' bytes need TilesConfig\(decode='natural'\), got decode='lanes'"):
        jax.eval_shape(lambda *a: wt.mgpu_w4a16_tiles(*a, cfg=wt.TilesConfig(), w_order="natural"), *_args())
    with pytest.raises(ValueError, match=r"w_order must be one of \('lanes', 'natural'\), got 'raw'"):
        jax.eval_shape(lambda *a: wt.mgpu_w4a16_tiles(*a, w_order="raw"), *_args())
    with pytest.raises(TypeError, match="cfg must be a TilesConfig or None"):
        jax.eval_shape(lambda *a: wt.mgpu_w4a16_tiles(*a, cfg=wm.MgpuConfig()), *_args())
    with pytest.raises(ValueError, match=r"no tiling for M=1024, N=500"):
        jax.eval_shape(lambda *a: wt.mgpu_w4a16_tiles(*a), *_args(n=500))


def test_output_that_cannot_fit_named():
    with pytest.raises(ValueError, match="needs two pipeline stages"):
        jax.eval_shape(lambda *a: wt.mgpu_w4a16_tiles(*a, out_dtype=jnp.float32,
                                                      cfg=wt.TilesConfig(mt=256, bk=128, stages=2)), *_args())


@pytest.mark.parametrize("xp", [jnp, np], ids=["jax", "numpy"])
def test_eager_call_off_gpu_is_a_clear_error(xp):
    """jax or NumPy arrays (a NumPy array runs on the default device) get the kernel's own message,
    not Pallas's "Only interpret mode ..." one."""
    x = xp.zeros((256, 256), jnp.bfloat16)
    with pytest.raises(RuntimeError, match="mgpu_w4a16_tiles runs only on an NVIDIA Hopper GPU"):
        wt.mgpu_w4a16_tiles(x, xp.zeros((128, 128), np.uint8), xp.zeros((8, 128), np.uint8),
                            cfg=wt.TilesConfig(decode="natural"), w_order="natural")


# ---- dispatch

def _problem(**kw):
    from jax_mxfp4.backends.base import GemmProblem

    base = dict(batch=1, m=1024, n=1024, k=2048, out_dtype=np.dtype(jnp.bfloat16), scale_layout="plain",
                platform="cuda", lhs_kind="float", rhs_kind="mxfp4", lhs_dtype=np.dtype(jnp.bfloat16),
                rhs_decode_prepared="lanes")
    return GemmProblem(**{**base, **kw})


@needs_mgpu
def test_dispatch_routes_prepared_many_row_w4a16_to_the_kernel(monkeypatch):
    from jax_mxfp4.backends import fp8, pallas

    monkeypatch.setattr(fp8, "_compute_capability", lambda: (9, 0))
    monkeypatch.setattr(pallas, "W4A16_MOSAIC_GPU", True)
    be = pallas.PallasBackend()
    r = be.route(_problem(rhs_decode_prepared="lanes"))
    assert "large-tile kernel" in r and "decode='lanes'" in r, r
    r = be.route(_problem(m=4096))  # at W4A16_TILES_MAX_ROWS: two-pass
    assert r.startswith("two-pass") and "large-tile" not in r
    # a plain weight (natural bytes) only below W4A16_TILES_PLAIN_MAX_ROWS; a prepared one up to 4096
    assert pallas.W4A16_TILES_PLAIN_MAX_ROWS == 2048
    for order in (False, "natural"):
        assert be.route(_problem(m=2048, rhs_decode_prepared=order)).startswith("two-pass"), order
        assert "< 2048 activation rows" in be.route(_problem(m=2040, rhs_decode_prepared=order)), order
    assert "< 4096 activation rows" in be.route(_problem(m=2048))
    plain = be.route(_problem(rhs_decode_prepared=False))  # a plain MXFP4Array weight: the "natural" decode
    assert "large-tile kernel" in plain and "decode='natural'" in plain and "scales transposed" in plain, plain
    assert "large-tile kernel" in be.route(_problem(rhs_decode_prepared="natural"))
    weight_left = be.route(_problem(lhs_kind="mxfp4", rhs_kind="float", lhs_dtype=np.dtype(np.float32),
                                    rhs_dtype=np.dtype(jnp.bfloat16), rhs_decode_prepared=False,
                                    lhs_decode_prepared="lanes", m=1024, n=1024))
    assert "large-tile kernel" in weight_left
    for other in (dict(m=1020), dict(n=1000), dict(platform="rocm"), dict(m=128), dict(m=4096)):
        for order in ("lanes", False):
            assert "large-tile" not in be.route(_problem(rhs_decode_prepared=order, **other)), (other, order)
    assert tuple(map(bool, be.takes_decode_prepared(_problem()))) == (False, True)
    monkeypatch.setattr(pallas, "W4A16_MOSAIC_GPU", False)
    assert be.route(_problem()).startswith("two-pass")
    monkeypatch.setattr(pallas, "W4A16_MOSAIC_GPU", True)
    monkeypatch.setattr(fp8, "_compute_capability", lambda: (8, 0))
    assert be.route(_problem()).startswith("two-pass")


@needs_mgpu
@pytest.mark.parametrize("batch", [1, 2])
def test_dispatch_lowers_the_prepared_weight_as_stored(monkeypatch, batch):
    """Through the backend: one Mosaic GPU kernel per batch element, the DecodePrepared's bytes
    and K-major scales read as stored (no transpose of them in the lowered program)."""
    from jax_mxfp4.backends import fp8, pallas

    monkeypatch.setattr(fp8, "_compute_capability", lambda: (9, 0))
    monkeypatch.setattr(pallas, "W4A16_MOSAIC_GPU", True)
    prob = _problem(batch=batch)
    w = mx.prepare_decode(mx.quantize(jnp.ones((batch, 1024, 2048), jnp.float32), 2))
    f = jax.jit(lambda a, w: pallas._weight_stationary(a, w, prob))
    x = jax.ShapeDtypeStruct((batch, 1024, 2048), jnp.bfloat16)
    assert jax.eval_shape(f, x, w).shape == (batch, 1024, 1024)
    txt = f.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    assert txt.count("mosaic_gpu") >= batch
    assert "stablehlo.transpose" not in txt


@needs_mgpu
def test_dispatch_lowers_a_plain_weight_with_only_its_scales_transposed(monkeypatch):
    """A plain MXFP4Array weight [N, K] along axis 1: the kernel reads its bytes as they are; the
    one transpose in the lowered program is of the E8M0 scale bytes [N, K/32] -> [K/32, N]."""
    import re

    from jax_mxfp4.backends import fp8, pallas

    monkeypatch.setattr(fp8, "_compute_capability", lambda: (9, 0))
    monkeypatch.setattr(pallas, "W4A16_MOSAIC_GPU", True)
    prob = _problem(rhs_decode_prepared=False)
    w = mx.quantize(jnp.ones((1, 1024, 2048), jnp.float32), 2)
    f = jax.jit(lambda a, w: pallas._weight_stationary(a, w, prob))
    x = jax.ShapeDtypeStruct((1, 1024, 2048), jnp.bfloat16)
    assert jax.eval_shape(f, x, w).shape == (1, 1024, 1024)
    txt = f.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    transposes = [ln for ln in txt.splitlines() if "stablehlo.transpose" in ln]
    assert len(transposes) == 1 and re.search(r"tensor<1x1024x64x(ui8|f8E8M0FNU)>", transposes[0]), transposes
    assert "shfl.sync.bfly.b32" in str(_mosaic_module(txt))
