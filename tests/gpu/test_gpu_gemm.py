"""The compiled Pallas (Triton) MXFP4 GEMM on an NVIDIA GPU against backend "xla": a4w4, w4a16
and a16w4; M and N not multiples of the tile, K a multiple of 32 but not of the K step, batch > 1,
split-K, float32 and bfloat16 out; every transpose through ``dot_general`` with "auto" (which must
pick pallas on a GPU); a NaN scale byte poisons exactly its output row. Tolerance: the float32
accumulation bound of gpu_reference.bound_check."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_mxfp4 as mx
from gpu_reference import assert_within_bound, rand
from jax_mxfp4.kernels.tiled_gemm import TileConfig, default_config, mxfp4_gemm
from jax_mxfp4.mx_format import as_scale_bytes

pytestmark = [pytest.mark.gpu, pytest.mark.cuda]

XLA = mx.Recipe(backend="xla")

GEMM_CASES = [  # batch, m, n, k, variant, cfg or None (default), out dtype
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


def _gemm_id(case):
    batch, m, n, k, variant, cfg, odt = case
    return f"{variant}-B{batch}-{m}x{n}x{k}-{jnp.dtype(odt).name}{'-' + 'tile' if cfg else ''}"


@pytest.mark.parametrize("i", range(len(GEMM_CASES)), ids=[_gemm_id(c) for c in GEMM_CASES])
def test_pallas_gemm_within_float32_bound(i):
    batch, m, n, k, variant, cfg, odt = GEMM_CASES[i]
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
    assert out.shape == (batch, m, n) and out.dtype == jnp.dtype(odt)
    assert_within_bound(out, ref, jnp.abs(da), jnp.abs(db), k, odt == jnp.bfloat16, f"{_gemm_id(GEMM_CASES[i])} {cfg}")


TRANSPOSES = [((((1,), (0,)), ((), ())), (130, 256), (256, 70)),
              ((((0,), (1,)), ((), ())), (256, 130), (70, 256)),
              ((((2,), (1,)), ((0,), (0,))), (3, 40, 192), (3, 192, 24))]


@pytest.mark.parametrize("dims,ls,rs", TRANSPOSES, ids=["lhs-K-last", "lhs-K-first", "batched"])
def test_dot_general_auto_picks_pallas_for_every_transpose(dims, ls, rs):
    lhs, rhs = rand(len(ls) + ls[0], ls), rand(rs[0] + 7, rs)
    d = mx.explain(lhs, rhs, dims)
    assert d.backend == "pallas", d
    out = mx.dot_general(lhs, rhs, dims)
    ref = mx.dot_general(lhs, rhs, dims, recipe=XLA)
    assert out.shape == ref.shape
    rel = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
    assert rel < 1e-5, rel


def test_nan_scale_byte_poisons_exactly_its_row():
    qa, qb = mx.quantize(rand(5, (1, 64, 256)), 2), mx.quantize(rand(6, (1, 64, 256)), 2)
    sa = as_scale_bytes(qa.scales).at[0, 5, 3].set(255)
    f = jax.jit(lambda x, y, z, w: mxfp4_gemm((x, y), (z, w), m=64, n=64, k=256, out_dtype=jnp.float32,
                                              cfg=default_config(64, 64, 256)))
    out = np.asarray(f(qa.data, sa, qb.data, as_scale_bytes(qb.scales)))
    assert np.isnan(out[0, 5]).all()
    assert np.isfinite(np.delete(out[0], 5, 0)).all()
