"""w4a16 on an NVIDIA GPU: the Triton weight-stationary kernel (inline-PTX decode on CUDA) and
its decode pass, and every w4a16/a4w4 route "auto" takes through ``mx.dot_general``, against
backend "xla" within the float32 accumulation bound (gpu_reference.bound_check) and on every
E8M0 byte against a float64 NumPy reference. Routes: decode sizes (on Hopper the Mosaic GPU
kernel, elsewhere Triton), many rows (on Hopper the large-tile Mosaic GPU kernel, the two-pass
route elsewhere and from W4A16_TILES_MAX_ROWS rows), each with the weight as stored and arranged
once by :func:`jax_mxfp4.prepare_decode`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_mxfp4 as mx
from gpu_reference import assert_within_bound, byte_reference, every_byte_operands, finite_within_bound, rand
from jax_mxfp4.backends.pallas import W4A16_TILES_MAX_ROWS
from jax_mxfp4.mx_format import as_e8m0, as_scale_bytes

pytestmark = [pytest.mark.gpu, pytest.mark.cuda]


def _decode():
    from jax_mxfp4.backends.pallas import decode_for
    from jax_mxfp4.platform import current_platform

    return decode_for(current_platform())


WGEMM_CASES = [  # batch, m, n, k, cfg overrides, out dtype
    (1, 16, 8192, 8192, {}, jnp.bfloat16),
    (1, 1, 4096, 4096, {}, jnp.float32),
    (2, 7, 520, 4160, {}, jnp.float32),
    (1, 100, 300, 1024, {}, jnp.float32),
    (1, 16, 1024, 2048, {"layout3d": True}, jnp.float32),
    (1, 1024, 1024, 2048, {}, jnp.float32),
]


@pytest.mark.parametrize("i", range(len(WGEMM_CASES)), ids=[
    f"B{b}-{m}x{n}x{k}-{jnp.dtype(o).name}{'-layout3d' if ov else ''}" for b, m, n, k, ov, o in WGEMM_CASES])
def test_weight_stationary_gemm_within_float32_bound(i):
    from jax_mxfp4.kernels.wgemm import WTileConfig, default_wconfig, weight_stationary_gemm

    batch, m, n, k, over, odt = WGEMM_CASES[i]
    x = rand(100 + i, (batch, m, k)).astype(jnp.bfloat16)
    q = mx.quantize(rand(200 + i, (batch, n, k)), 2)
    cfg = default_wconfig(m, n, k, batch, decode=_decode())
    cfg = WTileConfig(**{**cfg.__dict__, **over})
    out = jax.jit(lambda a, d, s_: weight_stationary_gemm(a, d, s_, out_dtype=odt, cfg=cfg))(
        x, q.data, as_scale_bytes(q.scales))
    da, db = x.astype(jnp.float32), mx.dequantize(q)
    ref = jnp.einsum("bmk,bnk->bmn", da, db, precision="highest").astype(odt)
    assert_within_bound(out, ref, jnp.abs(da), jnp.abs(db), k, odt == jnp.bfloat16, str(cfg))


def test_weight_stationary_every_e8m0_byte_and_nan_block():
    """Every E8M0 byte (0x00..0xFE) on the weight side and one NaN byte: products that are finite
    in float32 agree within the bound, the NaN block poisons exactly its output column."""
    from jax_mxfp4.kernels.wgemm import WTileConfig, weight_stationary_gemm

    m, n, k = 16, 256, 64
    x, data, sb = every_byte_operands(5, m, n, k, nan_at=(17, 1), batch=(1,))
    cfg = WTileConfig(bn=64, bm=16, bk=64, decode=_decode())
    out = np.asarray(jax.jit(lambda a, d, s_: weight_stationary_gemm(a, d, s_, out_dtype=jnp.float32, cfg=cfg))(
        x, jnp.asarray(data), jnp.asarray(sb)), np.float64)
    ref, mag = byte_reference(x, data, sb)
    ok_vals, _ = finite_within_bound(out, ref, mag, k)
    assert ok_vals, cfg
    assert np.isnan(out[0, :, 17]).all(), cfg


def test_decode_to_bf16_bit_identical_to_dequantize():
    """The decode pass of the two-pass route equals dequantize(bfloat16) bit for bit, NaN blocks
    included."""
    from jax_mxfp4.kernels.wgemm import decode_to_bf16

    decode = _decode()
    q = mx.quantize(rand(300, (1024, 4096)), 1)
    sb = as_scale_bytes(q.scales).at[3, 5].set(255)
    q = mx.MXFP4Array(q.data, as_e8m0(sb), 1, q.shape, q.dtype, q.scale_mode, "plain")
    got = np.asarray(jax.jit(lambda d, s_: decode_to_bf16(d, s_, decode=decode))(q.data, sb))
    want = np.asarray(mx.dequantize(q, jnp.bfloat16))
    nan_g, nan_w = np.isnan(got.astype(np.float32)), np.isnan(want.astype(np.float32))
    assert nan_w.any()
    np.testing.assert_array_equal(nan_g, nan_w)
    np.testing.assert_array_equal(got.view(np.uint16)[~nan_w], want.view(np.uint16)[~nan_w])


@pytest.mark.parametrize("odt", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_w4a16_at_a_two_pass_size_via_auto(odt):
    x = rand(301, (512, 1024)).astype(jnp.bfloat16)
    w = mx.quantize(rand(302, (768, 1024)), 1)
    dims = (((1,), (1,)), ((), ()))
    rec = mx.Recipe(quantize_activations=False)
    ref = mx.dot_general(x, w, dims, recipe=mx.Recipe(backend="xla", quantize_activations=False),
                         preferred_element_type=jnp.float32)
    out = mx.dot_general(x, w, dims, recipe=rec, preferred_element_type=odt)
    assert out.dtype == jnp.dtype(odt)
    d = mx.explain(x, w, dims, recipe=rec)
    assert_within_bound(out[None].astype(jnp.float32), ref[None], jnp.abs(x.astype(jnp.float32))[None],
                        jnp.abs(mx.dequantize(w))[None], 1024, odt == jnp.bfloat16, f"{d.backend}: {d.route}")


def _auto_route(case, seed, prepared):
    """One case (activation rows, weight rows, K, batch, a4w4, weight transposed ([K, N] rhs),
    output dtype) through ``mx.dot_general`` ("auto") against backend "xla" within the float32
    accumulation bound, the weight as stored or arranged once by :func:`jax_mxfp4.prepare_decode`;
    operands from ``seed`` and ``seed + 100``."""
    m, n, k, batch, a4w4, w_t, odt = case
    bs = (batch,) if batch else ()
    x = rand(seed, bs + (m, k)).astype(jnp.bfloat16)
    w = mx.quantize(rand(seed + 100, bs + ((k, n) if w_t else (n, k))), len(bs) + (0 if w_t else 1))
    xs = mx.quantize(x.astype(jnp.float32), len(bs) + 1) if a4w4 else x
    bd = ((0,), (0,)) if batch else ((), ())
    dims = (((len(bs) + 1,), (len(bs) + (0 if w_t else 1),)), bd)
    rec = mx.Recipe(quantize_activations=False)
    ref = mx.dot_general(xs, w, dims, recipe=mx.Recipe(backend="xla", quantize_activations=False),
                         preferred_element_type=jnp.float32)
    da = mx.dequantize(xs) if a4w4 else x.astype(jnp.float32)
    db = mx.dequantize(w)
    db = jnp.swapaxes(db, -1, -2) if w_t else db
    if not batch:
        ref, da, db = ref[None], da[None], db[None]
    wx = mx.prepare_decode(w) if prepared else w
    d = mx.explain(xs, wx, dims, recipe=rec)
    out = mx.dot_general(xs, wx, dims, recipe=rec, preferred_element_type=odt)
    assert out.dtype == jnp.dtype(odt)
    assert_within_bound(out if batch else out[None], ref, jnp.abs(da), jnp.abs(db), k, odt == jnp.bfloat16,
                        f"auto -> {d.backend}: {d.route}")


def _route_id(c):
    m, n, k, batch, a4w4, w_t, odt = c
    return (f"{'a4w4' if a4w4 else 'w4a16'}-B{batch or 1}-{m}x{n}x{k}{'-rhsKN' if w_t else ''}-"
            f"{jnp.dtype(odt).name}")


_f32, _bf = jnp.float32, jnp.bfloat16
DECODE_CASES = [  # act rows, weight rows, K, batch, a4w4, weight transposed ([K, N] rhs), out dtype
    (16, 8192, 8192, 0, False, False, _f32), (1, 4096, 4096, 0, False, False, _f32),
    (40, 1024, 4096, 0, False, True, _f32), (16, 4096, 4096, 0, True, False, _f32),
    (1, 2048, 8192, 0, True, True, _f32), (16, 1024, 2048, 2, False, False, _f32),
    (64, 1024, 2048, 2, True, False, _f32)]

TILES_CASES = [  # same fields; the last one's rows fall back to the two-pass route
    (1024, 2048, 4096, 0, False, False, _bf), (1024, 2048, 4096, 0, False, False, _f32),
    (1000, 768, 1024, 0, False, False, _f32), (520, 1024, 2048, 2, False, True, _bf),
    (256, 8192, 1024, 0, False, False, _bf), (1028, 512, 1024, 0, False, False, _f32),
    (W4A16_TILES_MAX_ROWS, 512, 1024, 0, False, False, _bf)]


@pytest.mark.parametrize("prepared", [False, True], ids=["plain", "prepared"])
@pytest.mark.parametrize("i", range(len(DECODE_CASES)), ids=[_route_id(c) for c in DECODE_CASES])
def test_decode_size_routes_via_auto(i, prepared):
    """Decode-size w4a16 and a4w4 (on Hopper the Mosaic GPU kernel, elsewhere Triton), batched and
    transposed operands and per-call scale conversion included."""
    _auto_route(DECODE_CASES[i], 400 + i, prepared)


@pytest.mark.parametrize("prepared", [False, True], ids=["plain", "prepared"])
@pytest.mark.parametrize("i", range(len(TILES_CASES)), ids=[_route_id(c) for c in TILES_CASES])
def test_many_row_routes_via_auto(i, prepared):
    """Many-row w4a16 (on Hopper the large-tile Mosaic GPU kernel, the weight plain ("natural"
    decode) or prepared; the two-pass route elsewhere and at >= W4A16_TILES_MAX_ROWS rows):
    partial tiles, batch, a [K, N] weight, both output widths."""
    _auto_route(TILES_CASES[i], 600 + i, prepared)


TILES_CONFIGS = ["default-lanes", "large-grid-lanes", "default-natural", "large-grid-natural"]


@pytest.mark.hopper
@pytest.mark.parametrize("which", TILES_CONFIGS)
def test_tiles_kernel_every_e8m0_byte_and_nan_block(which):
    """The large-tile kernel on every E8M0 byte (0x00..0xFE over the weight's blocks) and one NaN
    byte: finite products agree with float64 within the float32 accumulation bound, the NaN block
    poisons exactly its output column. Tilings: this shape's default (mt 128) and the large-grid
    one (mt 256, bk 64, setmaxnreg), each for "lanes" bytes (prepared) and the "natural" decode of
    a plain MXFP4Array's bytes (the quad byte transpose by warp shuffles)."""
    from jax_mxfp4.decode_prepared import kmajor_from_plain, lanes_order_bytes, pair_order_bytes
    from jax_mxfp4.kernels.wgemm_tiles_mgpu import TilesConfig, default_tiles_config, mgpu_w4a16_tiles

    m, n, k = 512, 256, 256  # 2 x 8 = 16 blocks per weight row: bytes 0..254 over 16 rows
    x, data, sb = every_byte_operands(6, m, n, k, nan_at=(37, 3))
    order = which.split("-")[-1]
    big = dict(mt=256, bk=64, stages=4, chunks=1)
    if which.startswith("default"):
        cfg = default_tiles_config(m, n, k) if order == "lanes" else default_tiles_config(m, n, k, w_order="natural")
    else:
        cfg = TilesConfig(**big) if order == "lanes" else TilesConfig(**big, decode="natural")
    wd = lanes_order_bytes(pair_order_bytes(jnp.asarray(data))) if order == "lanes" else jnp.asarray(data)
    out = np.asarray(jax.jit(lambda a, d, s_: mgpu_w4a16_tiles(a, d, s_, jnp.float32, cfg, w_order=order))(
        x, wd, kmajor_from_plain(jnp.asarray(sb))), np.float64)
    ref, mag = byte_reference(x, data, sb)
    ok_vals, fin = finite_within_bound(out, ref, mag, k)
    assert ok_vals, cfg
    assert np.isnan(out[:, 37]).all(), cfg
    assert not np.isnan(np.delete(out, 37, axis=1)[np.delete(fin, 37, axis=1)]).any(), cfg
