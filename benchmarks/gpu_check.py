"""Correctness of the compiled Pallas kernels on a GPU (run before the benchmarks).

GEMM: backend "pallas" (compiled, not interpreted) against backend "xla" on fresh random data
(mixed block magnitudes), for a4w4 and w4a16, M and N not multiples of the tile, K a multiple of
32 but not of the K step, batch > 1, split-K, every transpose through ``dot_general``, float32
and bfloat16 out. Pass: elementwise |pallas - xla| <= 2 K 2^-24 (|A|.|B|) (+ one bf16 ulp, 2^-7 |xla|, for bf16
out), the bound for two float32 summation orders (tests/test_pallas_gemm.py); outputs must be finite.
Quantizer: the fused kernel against the reference ``_quantize_impl``, bit for bit, every scale
mode and rounding, on random data with special values planted (both roundings run on GPUs).

FP8 path (backend "fp8", ``--fp8-only`` runs just these): XLA must compile its GEMM to cuBLASLt's
FP8 kernel (``__cublas$lt$matmul$f8`` in the HLO); the error against the exact float64 result,
max |out - exact| / sum_k |a_k b_k|, measured at precision DEFAULT and HIGH on random and on
adversarial data (a large first block then small products, cancelling block pairs, equal-sign
ramps; K = 1024 and 8192), must stay within ``jax_mxfp4.backends.fp8.ERROR_BOUNDS`` (the README
bound); rows and columns outside the FP8 window must meet the float32 bound of the exact path;
NaN scale bytes poison their row/column; a prepared weight gives the same bits as the MXFP4Array.

Usage: python benchmarks/gpu_check.py [--out DIR] [--gemm-only | --fp8-only]; exits 1 if any
check fails.
"""

from __future__ import annotations

import argparse
import itertools
import re
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_mxfp4 as mx  # noqa: E402
from benchmarks.common import device_info, out_dir, write_json  # noqa: E402
from jax_mxfp4.kernels.gemm import TileConfig, default_config, mxfp4_gemm  # noqa: E402
from jax_mxfp4.kernels.quantize import quantize_impl  # noqa: E402
from jax_mxfp4.mx_format import as_e8m0, as_scale_bytes  # noqa: E402
from jax_mxfp4.quantize import _quantize_impl  # noqa: E402

XLA = mx.Recipe(backend="xla")


def rand(seed, shape, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    size = int(np.prod(shape))
    mags = np.exp2(rng.integers(-8, 9, size=-(-size // 32))).repeat(32)[:size].reshape(shape)
    return jnp.asarray(rng.standard_normal(shape) * mags, dtype)


def bound_check(out, ref, a_abs, b_abs, k, bf16_out):
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    ref = np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
    # sum_k |a||b| per output ([..., M, K] x [..., N, K]), on the device in float32: it only sets the tolerance
    mag = np.asarray(jnp.einsum("...mk,...nk->...mn", jnp.asarray(a_abs, jnp.float32), jnp.asarray(b_abs, jnp.float32),
                                precision="highest"), np.float64)
    tol = 2 * k * 2.0**-24 * mag + (2.0**-7 * np.abs(ref) if bf16_out else 0) + 1e-30
    err = np.abs(out - ref)
    finite = bool(np.all(np.isfinite(out)))
    ratio = float(np.max(err / tol)) if finite else float("inf")
    rel = float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))
    return {"finite": finite, "max_err_over_bound": ratio, "rel_fro": rel, "ok": finite and ratio <= 1.0}


E2M1_VALUES = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])  # OCP MX v1.0 §5.3.3


def byte_reference(x, data, scale_bytes):
    """float64 (x · Wᵀ, |x| · |W|ᵀ) for a weight given as packed E2M1 bytes ``data`` [..., N, K/2]
    (low nibble = element 2j) and E8M0 bytes ``scale_bytes`` [..., N, K/32] (0xFF NaN), decoded
    independently of the project (NumPy tables; each element rounded to float32 as a float32
    dequantization would: 2^128 -> inf), against ``x`` [..., M, K]. The every-byte checks' reference."""
    data, sb = np.asarray(data), np.asarray(scale_bytes)
    codes = np.stack([data & 15, data >> 4], -1).reshape(*data.shape[:-1], 2 * data.shape[-1])
    sc = np.where(sb == 255, np.nan, 2.0 ** (sb.astype(np.float64) - 127))
    xf = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        w = (E2M1_VALUES[codes] * np.repeat(sc, 32, axis=-1)).astype(np.float32).astype(np.float64)
        return xf @ np.swapaxes(w, -1, -2), np.abs(xf) @ np.abs(np.swapaxes(w, -1, -2))


def gemm_checks():
    res = []
    cases = [  # batch, m, n, k, variant, cfg or None (default), out dtype
        (2, 100, 72, 96, "a4w4", TileConfig(64, 64, 64), jnp.float32),
        (1, 300, 260, 1056, "a4w4", None, jnp.bfloat16),
        (1, 16, 8192, 8192, "a4w4", None, jnp.bfloat16),
        (1, 1, 4096, 4096, "a4w4", None, jnp.float32),
        (1, 1024, 1024, 2048, "a4w4", None, jnp.bfloat16),
        (1, 7, 520, 4160, "w4a16", None, jnp.bfloat16),
        (1, 16, 8192, 8192, "w4a16", None, jnp.bfloat16),
        (1, 1024, 1024, 2048, "w4a16", None, jnp.float32),
        (1, 200, 136, 320, "a16w4", TileConfig(64, 64, 64, split_k=5), jnp.float32),
    ]
    for i, (batch, m, n, k, variant, cfg, odt) in enumerate(cases):
        t0 = time.time()
        a = rand(10 * i + 1, (batch, m, k))
        b = rand(10 * i + 2, (batch, n, k))
        qa, qb = mx.quantize(a, 2), mx.quantize(b, 2)
        cfg = cfg or default_config(m, n, k, batch, a4w4=variant == "a4w4")
        if variant == "a4w4":
            lhs, rhs = (qa.data, as_scale_bytes(qa.scales)), (qb.data, as_scale_bytes(qb.scales))
            da, db = mx.dequantize(qa), mx.dequantize(qb)
        elif variant == "w4a16":
            lhs, rhs = a.astype(jnp.bfloat16), (qb.data, as_scale_bytes(qb.scales))
            da, db = lhs.astype(jnp.float32), mx.dequantize(qb)
        else:
            lhs, rhs = (qa.data, as_scale_bytes(qa.scales)), b.astype(jnp.bfloat16)
            da, db = mx.dequantize(qa), rhs.astype(jnp.float32)
        ref = jnp.einsum("bmk,bnk->bmn", da, db, precision="highest").astype(odt)
        out = jax.jit(lambda x, y: mxfp4_gemm(x, y, m=m, n=n, k=k, out_dtype=odt, cfg=cfg))(lhs, rhs)
        r = bound_check(out, ref, jnp.abs(da), jnp.abs(db), k, odt == jnp.bfloat16)
        r.update(case=f"{variant} B={batch} {m}x{n}x{k} {jnp.dtype(odt).name} {cfg}", seconds=time.time() - t0)
        res.append(r)
        print(("PASS" if r["ok"] else "FAIL"), r["case"], f"err/bound={r['max_err_over_bound']:.3g} rel={r['rel_fro']:.2e}", flush=True)
    # every transpose, through dot_general + dispatch ("auto" must pick pallas on a GPU)
    for dims, ls, rs in [((((1,), (0,)), ((), ())), (130, 256), (256, 70)),
                         ((((0,), (1,)), ((), ())), (256, 130), (70, 256)),
                         ((((2,), (1,)), ((0,), (0,))), (3, 40, 192), (3, 192, 24))]:
        lhs, rhs = rand(len(ls) + ls[0], ls), rand(rs[0] + 7, rs)
        d = mx.explain(lhs, rhs, dims)
        out = mx.dot_general(lhs, rhs, dims)
        ref = mx.dot_general(lhs, rhs, dims, recipe=XLA)
        rel = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
        ok = d.backend == "pallas" and rel < 1e-5 and out.shape == ref.shape
        res.append({"case": f"dot_general auto {dims} {ls}x{rs}", "backend": d.backend, "rel_fro": rel, "ok": ok})
        print(("PASS" if ok else "FAIL"), "dot_general", dims, "auto ->", d.backend, f"rel={rel:.2e}", flush=True)
    # NaN scale byte: the whole row is NaN, nothing else
    qa, qb = mx.quantize(rand(5, (1, 64, 256)), 2), mx.quantize(rand(6, (1, 64, 256)), 2)
    sa = as_scale_bytes(qa.scales).at[0, 5, 3].set(255)
    out = np.asarray(jax.jit(lambda x, y, z, w: mxfp4_gemm((x, y), (z, w), m=64, n=64, k=256, out_dtype=jnp.float32,
                                                           cfg=default_config(64, 64, 256)))(qa.data, sa, qb.data, as_scale_bytes(qb.scales)))
    ok = bool(np.isnan(out[0, 5]).all() and np.isfinite(np.delete(out[0], 5, 0)).all())
    res.append({"case": "NaN scale byte -> NaN row", "ok": ok})
    print(("PASS" if ok else "FAIL"), "NaN scale row", flush=True)
    return res


def wgemm_checks():
    """Weight-stationary kernel (inline-PTX decode on CUDA) against the float32 reference."""
    from jax_mxfp4.backends.pallas import decode_for
    from jax_mxfp4.dispatch import current_platform
    from jax_mxfp4.kernels.wgemm import WTileConfig, default_wconfig, weight_stationary_gemm

    res = []
    decode = decode_for(current_platform())
    cases = [  # batch, m, n, k, cfg overrides, out dtype
        (1, 16, 8192, 8192, {}, jnp.bfloat16),
        (1, 1, 4096, 4096, {}, jnp.float32),
        (2, 7, 520, 4160, {}, jnp.float32),
        (1, 100, 300, 1024, {}, jnp.float32),
        (1, 16, 1024, 2048, {"layout3d": True}, jnp.float32),
        (1, 1024, 1024, 2048, {}, jnp.float32),
    ]
    for i, (batch, m, n, k, over, odt) in enumerate(cases):
        t0 = time.time()
        x = rand(100 + i, (batch, m, k)).astype(jnp.bfloat16)
        q = mx.quantize(rand(200 + i, (batch, n, k)), 2)
        cfg = default_wconfig(m, n, k, batch, decode=decode)
        cfg = WTileConfig(**{**cfg.__dict__, **over})
        out = jax.jit(lambda a, d, s_: weight_stationary_gemm(a, d, s_, out_dtype=odt, cfg=cfg))(
            x, q.data, as_scale_bytes(q.scales))
        da, db = x.astype(jnp.float32), mx.dequantize(q)
        ref = jnp.einsum("bmk,bnk->bmn", da, db, precision="highest").astype(odt)
        r = bound_check(out, ref, jnp.abs(da), jnp.abs(db), k, odt == jnp.bfloat16)
        r.update(case=f"wgemm B={batch} {m}x{n}x{k} {jnp.dtype(odt).name} {cfg}", seconds=time.time() - t0)
        res.append(r)
        print(("PASS" if r["ok"] else "FAIL"), r["case"], f"err/bound={r['max_err_over_bound']:.3g}", flush=True)
    # every E8M0 byte on the weight side (0x00..0xFE) and one NaN byte: products that are finite
    # in float32 agree within the bound, the NaN block poisons exactly its output row
    rng = np.random.default_rng(5)
    m, n, k = 16, 256, 64
    data = jnp.asarray(rng.integers(0, 256, (1, n, k // 2), dtype=np.uint8))
    sb = np.arange(2 * n, dtype=np.int64).reshape(1, n, 2) % 255
    sb[0, 17, 1] = 255
    sb = jnp.asarray(sb.astype(np.uint8))
    x = jnp.asarray(rng.standard_normal((1, m, k)) * 2.0**-10, jnp.bfloat16)
    cfg = WTileConfig(bn=64, bm=16, bk=64, decode=decode)
    out = np.asarray(jax.jit(lambda a, d, s_: weight_stationary_gemm(a, d, s_, out_dtype=jnp.float32, cfg=cfg))(x, data, sb), np.float64)
    ref, mag = byte_reference(x, data, sb)
    fin = np.isfinite(ref) & (np.abs(ref) < 3e38)
    ok_vals = bool(np.all(np.abs(out[fin] - ref[fin]) <= 2 * k * 2.0**-24 * mag[fin] + 2.0**-126))
    ok_nan = bool(np.isnan(out[0, :, 17]).all())
    res.append({"case": "wgemm every E8M0 byte + NaN byte", "ok": ok_vals and ok_nan})
    print(("PASS" if ok_vals and ok_nan else "FAIL"), "wgemm every E8M0 byte, NaN block", ok_vals, ok_nan, flush=True)
    # decode pass of the two-pass route: bit-identical to dequantize(bfloat16), NaN blocks included
    from jax_mxfp4.kernels.wgemm import decode_to_bf16

    q = mx.quantize(rand(300, (1024, 4096)), 1)
    sb = as_scale_bytes(q.scales).at[3, 5].set(255)
    q = mx.MXFP4Array(q.data, as_e8m0(sb), 1, q.shape, q.dtype, q.scale_mode, "plain")
    got = np.asarray(jax.jit(lambda d, s_: decode_to_bf16(d, s_, decode=decode))(q.data, sb))
    want = np.asarray(mx.dequantize(q, jnp.bfloat16))
    nan_g, nan_w = np.isnan(got.astype(np.float32)), np.isnan(want.astype(np.float32))
    ok = bool(np.array_equal(nan_g, nan_w) and np.array_equal(got.view(np.uint16)[~nan_w], want.view(np.uint16)[~nan_w]))
    res.append({"case": f"decode_to_bf16 ({decode}) bit-exact", "ok": ok})
    print(("PASS" if ok else "FAIL"), "decode_to_bf16 bit-exact", flush=True)
    # w4a16 through dot_general at a two-pass size ("auto" on a GPU)
    x = rand(301, (512, 1024)).astype(jnp.bfloat16)
    w = mx.quantize(rand(302, (768, 1024)), 1)
    dims = (((1,), (1,)), ((), ()))
    rec = mx.Recipe(quantize_activations=False)
    ref = mx.dot_general(x, w, dims, recipe=mx.Recipe(backend="xla", quantize_activations=False),
                         preferred_element_type=jnp.float32)
    for odt in (jnp.float32, jnp.bfloat16):  # bfloat16: XLA's GEMM writes it itself (session 11)
        out = mx.dot_general(x, w, dims, recipe=rec, preferred_element_type=odt)
        r = bound_check(out[None].astype(jnp.float32), ref[None], jnp.abs(x.astype(jnp.float32))[None],
                        jnp.abs(mx.dequantize(w))[None], 1024, odt == jnp.bfloat16)
        r["case"] = (f"w4a16 512x768x1024 {jnp.dtype(odt).name} via auto "
                     f"({mx.explain(x, w, dims, recipe=rec).backend})")
        res.append(r)
        print(("PASS" if r["ok"] else "FAIL"), r["case"], flush=True)
    res += decode_dispatch_checks()
    res += tiles_checks()
    return res


def _auto_route_checks(cases, seed):
    """Each case (activation rows, weight rows, K, batch, a4w4, weight transposed ([K, N] rhs),
    output dtype) through ``mx.dot_general`` ("auto") against backend "xla" within the float32
    accumulation bound, the weight as stored and arranged once by :func:`jax_mxfp4.prepare_decode`;
    fresh random operands per case (seeds from ``seed``); the route taken is recorded."""
    res = []
    for i, (m, n, k, batch, a4w4, w_t, odt) in enumerate(cases):
        bs = (batch,) if batch else ()
        x = rand(seed + i, bs + (m, k)).astype(jnp.bfloat16)
        w = mx.quantize(rand(seed + 100 + i, bs + ((k, n) if w_t else (n, k))), len(bs) + (0 if w_t else 1))
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
        for tag, wx in (("", w), (" prepared", mx.prepare_decode(w))):
            d = mx.explain(xs, wx, dims, recipe=rec)
            out = mx.dot_general(xs, wx, dims, recipe=rec, preferred_element_type=odt)
            r = bound_check(out if batch else out[None], ref, jnp.abs(da), jnp.abs(db), k, odt == jnp.bfloat16)
            r["case"] = (f"{'a4w4' if a4w4 else 'w4a16'} B={batch or 1} {m}x{n}x{k}{' rhs [K,N]' if w_t else ''} "
                         f"{jnp.dtype(odt).name}{tag} via auto -> {d.backend}: {d.route}")
            r["route"] = d.route
            res.append(r)
            print(("PASS" if r["ok"] else "FAIL"), r["case"][:240], f"err/bound={r['max_err_over_bound']:.3g}",
                  flush=True)
    return res


def tiles_checks():
    """Many-row w4a16 (the large-tile Mosaic GPU kernel on Hopper, the weight plain ("natural"
    decode) or prepared; the two-pass route elsewhere and at >= W4A16_TILES_MAX_ROWS rows) through
    ``mx.dot_general`` ("auto") against backend "xla": partial tiles, batch, a [K, N] weight, both
    output widths, and the rows that fall back; then the kernel itself on every E8M0 byte (0x00
    .. 0xFE) and a NaN byte, against a float64 reference."""
    from jax_mxfp4.backends.pallas import W4A16_TILES_MAX_ROWS

    bf, f32 = jnp.bfloat16, jnp.float32
    cases = [  # act rows, weight rows, K, batch, a4w4, weight transposed ([K, N] rhs), out dtype
        (1024, 2048, 4096, 0, False, False, bf), (1024, 2048, 4096, 0, False, False, f32),
        (1000, 768, 1024, 0, False, False, f32), (520, 1024, 2048, 2, False, True, bf),
        (256, 8192, 1024, 0, False, False, bf), (1028, 512, 1024, 0, False, False, f32),
        (W4A16_TILES_MAX_ROWS, 512, 1024, 0, False, False, bf)]
    return _auto_route_checks(cases, 600) + tiles_every_byte_check()


def tiles_every_byte_check():
    """The large-tile kernel on every E8M0 byte (0x00..0xFE over the weight's blocks) and one NaN
    byte: finite products agree with float64 within the float32 accumulation bound, the NaN block
    poisons exactly its output column."""
    from jax_mxfp4.decode_prepared import kmajor_from_plain, lanes_order_bytes, pair_order_bytes
    from jax_mxfp4.kernels.wgemm_tiles_mgpu import TilesConfig, default_tiles_config, mgpu_w4a16_tiles

    rng = np.random.default_rng(6)
    m, n, k = 512, 256, 256  # 2 x 8 = 16 blocks per weight row: bytes 0..254 over 16 rows
    data = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    sb = (np.arange(n * k // 32, dtype=np.int64).reshape(n, k // 32) % 255).astype(np.uint8)
    sb[37, 3] = 255
    x = jnp.asarray(rng.standard_normal((m, k)) * 2.0**-10, jnp.bfloat16)
    wd = lanes_order_bytes(pair_order_bytes(jnp.asarray(data)))
    ref, mag = byte_reference(x, data, sb)
    fin = np.isfinite(ref) & (np.abs(ref) < 3e38)
    res = []
    # the default for this shape (mt 128) and the one for large grids (mt 256, bk 64, setmaxnreg),
    # and the "natural" decode of natural bytes (a plain MXFP4Array's: the quad byte transpose by
    # warp shuffles) in this shape's default (mt 128, bk 128 in two chunks) and the large-grid
    # tiling (its own large-grid default, mt 256 with bk 128, cannot take this float32 output:
    # the probe checks it with a bfloat16 output)
    big = dict(mt=256, bk=64, stages=4, chunks=1, registers=True)
    for cfg, order in ((default_tiles_config(m, n, k), "lanes"), (TilesConfig(**big), "lanes"),
                       (default_tiles_config(m, n, k, w_order="natural"), "natural"),
                       (TilesConfig(**big, decode="natural"), "natural")):
        out = np.asarray(jax.jit(lambda a, d, s_: mgpu_w4a16_tiles(a, d, s_, jnp.float32, cfg, w_order=order))(
            x, wd if order == "lanes" else jnp.asarray(data), kmajor_from_plain(jnp.asarray(sb))), np.float64)
        ok_vals = bool(np.all(np.abs(out[fin] - ref[fin]) <= 2 * k * 2.0**-24 * mag[fin] + 2.0**-126))
        ok_nan = bool(np.isnan(out[:, 37]).all()
                      and not np.isnan(np.delete(out, 37, axis=1)[np.delete(fin, 37, axis=1)]).any())
        print(("PASS" if ok_vals and ok_nan else "FAIL"), f"tiles every E8M0 byte, NaN block ({order} bytes, {cfg})",
              ok_vals, ok_nan, flush=True)
        res.append({"case": f"tiles every E8M0 byte + NaN byte ({order} bytes, {cfg})", "ok": ok_vals and ok_nan})
    return res


def decode_dispatch_checks():
    """Decode-size w4a16 and a4w4 through ``mx.dot_general`` ("auto"), against backend "xla":
    on a Hopper GPU these take the Mosaic GPU kernel (the route is recorded), elsewhere the Triton
    kernel; batched and transposed operands included, per-call scale conversion included; each
    case also with the weight arranged once by :func:`jax_mxfp4.prepare_decode`."""
    f32 = jnp.float32
    cases = [  # act rows, weight rows, K, batch, a4w4, weight transposed ([K, N] rhs), out dtype
        (16, 8192, 8192, 0, False, False, f32), (1, 4096, 4096, 0, False, False, f32),
        (40, 1024, 4096, 0, False, True, f32), (16, 4096, 4096, 0, True, False, f32),
        (1, 2048, 8192, 0, True, True, f32), (16, 1024, 2048, 2, False, False, f32),
        (64, 1024, 2048, 2, True, False, f32)]
    return _auto_route_checks(cases, 400)


def quantize_checks():
    res = []
    rng = np.random.default_rng(3)
    x = rng.standard_normal((333, 4160)) * np.exp2(rng.integers(-40, 40, size=(333, 130, 1))).repeat(32, -1).reshape(333, 4160)
    x = x.astype(np.float32)
    x[0, :32] = 0
    x[1, 7] = np.nan
    x[2, 100] = -np.inf
    x[3, :64] = 1e-40
    x[4, 32:64] = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4)
    x[5, :32] = 3e38
    xs = {"float32": jnp.asarray(x), "bfloat16": jnp.asarray(x).astype(jnp.bfloat16)}
    key = jax.random.key(7)
    for dname, xx in xs.items():
        for mode in ["floor", "ceil", "even", "rceil"]:
            for rounding in ["nearest", "stochastic"]:
                for axis in ([1, 0] if (mode == "even" and rounding == "nearest") else [1]):
                    xa = xx if axis == 1 else xx[:, :4160 // 32 * 32][:320].T  # axis 0 needs a multiple of 32
                    k = key if rounding == "stochastic" else None
                    got = quantize_impl(xa, k, axis=axis, scale_mode=mode, rounding=rounding)
                    ref = _quantize_impl(xa, k, axis=axis, scale_mode=mode, rounding=rounding)
                    gb = [np.asarray(jax.lax.bitcast_convert_type(g, jnp.uint8)) for g in got]
                    rb = [np.asarray(jax.lax.bitcast_convert_type(r, jnp.uint8)) for r in ref]
                    ok = all(np.array_equal(g, r) for g, r in zip(gb, rb))
                    entry = {"case": f"quantize {dname} {mode}/{rounding} axis={axis}", "ok": ok,
                             "data_bytes_differing": int(np.sum(gb[0] != rb[0])), "data_bytes": int(gb[0].size),
                             "scale_bytes_differing": int(np.sum(gb[1] != rb[1]))}
                    if not ok and axis == 1:
                        i, j = map(int, np.argwhere(gb[0] != rb[0])[0])
                        entry["first_diff"] = {"row": i, "byte": j, "got": int(gb[0][i, j]), "ref": int(rb[0][i, j]),
                                               "x": [float(v) for v in np.asarray(xa[i, 2 * j:2 * j + 2], np.float32)],
                                               "scale_byte": int(rb[1][i, 2 * j // 32])}
                    res.append(entry)
                    if not ok:
                        print("   ", {k: v for k, v in entry.items() if k != "case"})
                    print(("PASS" if ok else "FAIL"), res[-1]["case"], flush=True)
    # the public quantize() takes the fused path on a GPU
    from jax_mxfp4.kernels.quantize import fast_path_enabled
    from jax_mxfp4.dispatch import current_platform

    res.append({"case": f"quantize() fast path (both roundings) enabled on {current_platform()}",
                "ok": fast_path_enabled(current_platform()) and fast_path_enabled(current_platform(), "stochastic")})
    return res


def _mx(codes, sbytes):
    """Canonical MXFP4Array [1, rows, K] from E2M1 codes and scale bytes (numpy uint8)."""
    from jax_mxfp4.mx_format import as_e8m0, pack_nibbles

    return mx.MXFP4Array(pack_nibbles(jnp.asarray(codes, jnp.uint8)), as_e8m0(jnp.asarray(sbytes, jnp.uint8)),
                         2, codes.shape, jnp.float32)


def fp8_operands(kind, k, seed, m=256, n=256):
    """(lhs codes, lhs bytes, rhs codes, rhs bytes) [1, rows, K] / [1, rows, K/32], all within
    the FP8 window (no row flagged), for the error measurement."""
    rng = np.random.default_rng(seed)
    nb = k // 32
    ca = rng.integers(0, 16, (1, m, k), dtype=np.uint8)
    cb = rng.integers(0, 16, (1, n, k), dtype=np.uint8)
    sa = rng.integers(120, 135, (1, m, nb)).astype(np.uint8)
    sb = rng.integers(120, 135, (1, n, nb)).astype(np.uint8)
    if kind.startswith("head_tail"):  # one large block, then K - 32 products 2^-drop smaller
        drop = int(kind.split("_")[-1])
        ca = rng.integers(1, 8, (1, m, k), dtype=np.uint8)  # positive: no cancellation
        cb = rng.integers(1, 8, (1, n, k), dtype=np.uint8)
        ca[:, :, :32] = 7
        sa[:] = 134 - drop
        sa[:, :, 0] = 134
        sb[:] = 127
    elif kind == "cancel":  # block pairs that cancel exactly, plus one small last block
        sb[:, :, 1::2] = sb[:, :, 0::2]
        cb.reshape(1, n, nb // 2, 2, 32)[:, :, :, 1] = cb.reshape(1, n, nb // 2, 2, 32)[:, :, :, 0]
        sa[:, :, 1::2] = sa[:, :, 0::2]
        ca.reshape(1, m, nb // 2, 2, 32)[:, :, :, 1] = ca.reshape(1, m, nb // 2, 2, 32)[:, :, :, 0] ^ 8
        sa[:, :, -1] = 121
        sa[:, :, 0] = 134
    elif kind == "ramp":  # every product the same positive value
        ca[:] = 7
        cb[:] = 7
        sa[:] = 130
        sb[:] = 130
    return ca, sa, cb, sb


def fp8_dot_in_hlo(hlo: str) -> bool:
    """Whether compiled HLO text holds a ``dot`` whose two operands are float8_e4m3fn. XLA prints
    dot operands by name only (``dot(%param_0, %param_1)``), so each computation's definitions
    are read first (names repeat across fused computations)."""
    for comp in re.split(r"\n(?=\S)", hlo):  # a computation starts at an unindented line
        types = dict(re.findall(r"%([\w.\-]+) = ([a-z0-9]+)\[", comp))
        for a, b in re.findall(r" dot\(%([\w.\-]+), %([\w.\-]+)\)", comp):
            if types.get(a) == types.get(b) == "f8e4m3fn":
                return True
    return False


def fp8_checks():
    from jax_mxfp4.backends import fp8 as fb
    from jax_mxfp4.dispatch import current_platform
    from jax_mxfp4.fp8 import prepare_fp8

    res = []
    platform = current_platform()

    def add(case, ok, **kw):
        res.append({"case": case, "ok": bool(ok), **kw})
        print(("PASS" if ok else "FAIL"), case, {k: v for k, v in kw.items() if k != "detail"}, flush=True)

    run = {p: jax.jit(lambda a, b, p=p: fb.fp8_gemm(a, b, jnp.float32, p, platform)) for p in ("default", "high")}
    # 1. XLA really uses the FP8 GEMM (not an upcast) for both precisions and bf16 output
    qa = _mx(*fp8_operands("random", 1024, 1)[:2])
    for p in ("default", "high"):
        for odt in (jnp.float32, jnp.bfloat16):
            hlo = jax.jit(lambda a, b: fb.fp8_gemm(a, b, odt, p, platform)).lower(qa, qa).compile().as_text()
            # cuBLASLt's FP8 GEMM, or a GEMM fusion (Triton) whose dot reads f8 operands: on the H200
            # at DEFAULT XLA picked such a fusion (2026-11-30; 2026-12-01: named gemm_fusion_dot*,
            # which the former test for the string "__triton_gemm" missed), not an upcast
            cublas = "__cublas$lt$matmul$f8" in hlo
            f8_dot = fp8_dot_in_hlo(hlo)
            add(f"fp8 {p} {jnp.dtype(odt).name}: an FP8 GEMM in the HLO (cuBLASLt or a fused f8 dot)",
                cublas or f8_dot, cublas=cublas, f8_dot=f8_dot,
                custom_calls=sorted(set(re.findall(r'custom_call_target="([^"]+)"', hlo))))
    # 2. error against the exact result: random and adversarial data
    xla = jax.jit(lambda a, b: mx.dot_general(a, b, (((2,), (2,)), ((0,), (0,))), recipe=XLA))
    for k in (1024, 8192):
        for kind in ("random", "head_tail_6", "head_tail_10", "head_tail_14", "cancel", "ramp"):
            ca, sa, cb, sb = fp8_operands(kind, k, seed=k + len(kind))
            a, b = _mx(ca, sa), _mx(cb, sb)
            assert not bool(jnp.any(prepare_fp8(a).exact_rows())), kind
            da = np.asarray(mx.dequantize(a), np.float64)[0]
            db = np.asarray(mx.dequantize(b), np.float64)[0]
            exact = da @ db.T
            mag = np.abs(da) @ np.abs(db).T
            ref32 = np.asarray(xla(a, b), np.float64)[0]
            entry = {"k": k, "xla_float32_err": float(np.max(np.abs(ref32 - exact) / mag))}
            for p in ("default", "high"):
                out = np.asarray(run[p](a, b), np.float64)[0]
                ratio = float(np.max(np.abs(out - exact) / mag))
                nz = np.abs(exact) > 0
                rel = float(np.max(np.abs(out - exact)[nz] / np.abs(exact[nz]))) if nz.any() else 0.0
                bound = fb.ERROR_BOUNDS[(p, "random" if kind == "random" else "adversarial")]
                add(f"fp8 {p} error {kind} K={k}", np.isfinite(out).all() and ratio <= bound,
                    err_over_abs_dot=ratio, max_rel_err=rel, bound=bound, **entry)
    # 3. rows/columns outside the window: exact path (float32 bound), the others FP8
    ca, sa, cb, sb = fp8_operands("random", 2048, 7, m=512, n=384)
    for r in (3, 100, 511):
        sa[0, r, 5] = 60
        ca[0, r, 5 * 32] = 2
    for c in range(0, 384, 9):  # 43 flagged columns: more than the strip capacity (16)
        sb[0, c, 0] = 20
        cb[0, c, 0] = 3
    a, b = _mx(ca, sa), _mx(cb, sb)
    da = np.asarray(mx.dequantize(a), np.float64)[0]
    db = np.asarray(mx.dequantize(b), np.float64)[0]
    exact, mag = da @ db.T, np.abs(da) @ np.abs(db).T
    out = np.asarray(run["default"](a, b), np.float64)[0]
    fl = np.zeros(exact.shape, bool)
    fl[[3, 100, 511], :] = True
    fl[:, 0::9] = True
    err = np.abs(out - exact) / mag
    add("fp8 flagged rows/cols exact (float32 bound)", (np.abs(out - exact)[fl] <= 2 * 2048 * 2.0**-24 * mag[fl]).all(),
        flagged_err_over_abs_dot=float(err[fl].max()), other_err_over_abs_dot=float(err[~fl].max()))
    # 4. NaN scale bytes; 5. prepared weight = same bits
    sa2 = sa.copy()
    sa2[0, 7, 2] = 255
    sb2 = sb.copy()
    sb2[0, 5, 1] = 255
    out = np.asarray(run["default"](_mx(ca, sa2), _mx(cb, sb2)))[0]
    want = np.zeros(out.shape, bool)
    want[7, :] = want[:, 5] = True
    add("fp8 NaN scale byte -> NaN row/column only", np.array_equal(np.isnan(out), want))
    ca, sa, cb, sb = fp8_operands("random", 4096, 9, m=1024, n=1024)
    a, b = _mx(ca, sa), _mx(cb, sb)
    same = np.array_equal(np.asarray(run["default"](a, b)), np.asarray(run["default"](a, prepare_fp8(b))))
    add("fp8 prepared weight gives the same bits", same)
    # 5b. the Pallas encode kernel (used on CUDA) equals the jnp encode_rows bit for bit, edge rows included
    from jax_mxfp4.fp8 import encode_rows
    from jax_mxfp4.kernels.fp8_encode import DISPATCH_TILE, encode_rows_kernel

    rng = np.random.default_rng(11)
    tiles = {"default tile": {}, "dispatch tile": DISPATCH_TILE}
    # scale bands: (100, 150) flags most rows; (120, 135) keeps most inside the window, with blocks
    # at shifts -8..-6 (subnormal E4M3 results)
    for (r_, k_), band in itertools.product(((4096, 8192), (1000, 96), (37, 1056)), ((100, 150), (120, 135))):
        data = rng.integers(0, 256, (r_, k_ // 2), dtype=np.uint8)
        sbytes = rng.integers(*band, (r_, k_ // 32)).astype(np.uint8)
        sbytes[0, 0], sbytes[1, 0], sbytes[2, 0], sbytes[3, 0], sbytes[4, 0] = 80, 255, 0, 254, 1
        data[5, :] = 0
        want = jax.jit(encode_rows)(jnp.asarray(data), jnp.asarray(sbytes))
        for tile_name, tile in tiles.items():
            got = encode_rows_kernel(jnp.asarray(data), jnp.asarray(sbytes), **tile)
            same = all(np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
                       for x, y in zip(want, got))
            add(f"fp8 encode kernel ({tile_name}) == jnp encode_rows, {r_}x{k_}, scale bytes {band}", same,
                flagged_rows=int(np.sum(np.asarray(want[2]) != 0)))
    # 6. "auto" picks fp8 for a large a4w4 GEMM at DEFAULT and leaves it at HIGHEST
    big = jax.ShapeDtypeStruct((8192, 8192), jnp.float32)
    dn = (((1,), (1,)), ((), ()))
    d = mx.explain(big, big, dn)
    dh = mx.explain(big, big, dn, precision=jax.lax.Precision.HIGHEST)
    add("auto: fp8 at DEFAULT, another backend at HIGHEST (8192^3)", d.backend == "fp8" and dh.backend != "fp8",
        default=d.backend, highest=dh.backend)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gemm-only", action="store_true", help="skip the quantizer checks")
    ap.add_argument("--wgemm-only", action="store_true", help="only the weight-stationary kernel checks")
    ap.add_argument("--fp8-only", action="store_true", help="only the FP8-path checks")
    ap.add_argument("--decode-only", action="store_true", help="only the decode-size dot_general checks")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "gpu_check"))
    args = ap.parse_args(argv)
    out = out_dir(args.out)
    if args.decode_only:
        res = {"info": device_info(), "gemm": decode_dispatch_checks()}
        n_fail = sum(not r["ok"] for r in res["gemm"])
        res["failures"] = n_fail
        write_json(os.path.join(out, "gpu_check.json"), res)
        print(f"{len(res['gemm']) - n_fail} passed, {n_fail} failed")
        return 1 if n_fail else 0
    only = args.wgemm_only or args.fp8_only
    res = {"info": device_info(),
           "gemm": ([] if only else gemm_checks()) + ([] if args.fp8_only else wgemm_checks()),
           "quantize": [] if (args.gemm_only or only) else quantize_checks(),
           "fp8": [] if args.wgemm_only else fp8_checks()}
    checks = res["gemm"] + res["quantize"] + res["fp8"]
    n_fail = sum(not r["ok"] for r in checks)
    res["failures"] = n_fail
    write_json(os.path.join(out, "gpu_check.json"), res)
    print(f"{len(checks) - n_fail} passed, {n_fail} failed")
    return 1 if n_fail else 0


if __name__ == "__main__":
    sys.exit(main())
