"""Backend "pallas" on an NVIDIA GPU against backend "xla": a4w4 with both sides large (the
two-pass route: both operands decoded to bfloat16, XLA's bfloat16 GEMM), M and N not multiples
of the decode tile, K a multiple of 32 but not of 64, batch > 1, float32 and bfloat16 out; a NaN
scale byte poisons exactly its output row; every transpose through ``dot_general`` with "auto"
(which must pick pallas on a GPU). Tolerance: the float32 accumulation bound of
gpu_reference.bound_check."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_mxfp4 as mx
from gpu_reference import assert_within_bound, rand
from jax_mxfp4.mx_format import as_e8m0, as_scale_bytes

pytestmark = [pytest.mark.gpu, pytest.mark.cuda]

XLA = mx.Recipe(backend="xla")

PALLAS = mx.Recipe(backend="pallas")
CANON = (((2,), (2,)), ((0,), (0,)))

GEMM_CASES = [  # batch, m, n, k, out dtype (a4w4, both sides > 128 rows)
    (2, 200, 136, 96, jnp.float32),
    (1, 300, 260, 1056, jnp.bfloat16),
    (1, 1024, 1024, 2048, jnp.bfloat16),
    (1, 1024, 1024, 2048, jnp.float32),
]


@pytest.mark.parametrize("i", range(len(GEMM_CASES)), ids=[
    f"a4w4-B{b}-{m}x{n}x{k}-{jnp.dtype(o).name}" for b, m, n, k, o in GEMM_CASES])
def test_a4w4_two_pass_within_float32_bound(i):
    batch, m, n, k, odt = GEMM_CASES[i]
    qa, qb = mx.quantize(rand(10 * i + 1, (batch, m, k)), 2), mx.quantize(rand(10 * i + 2, (batch, n, k)), 2)
    assert mx.explain(qa, qb, CANON, recipe=PALLAS).route.startswith("two-pass a4w4")
    out = jax.jit(lambda x, y: mx.dot_general(x, y, CANON, preferred_element_type=odt, recipe=PALLAS))(qa, qb)
    assert out.shape == (batch, m, n) and out.dtype == jnp.dtype(odt)
    da, db = mx.dequantize(qa), mx.dequantize(qb)
    ref = jnp.einsum("bmk,bnk->bmn", da, db, precision="highest").astype(odt)
    assert_within_bound(out, ref, jnp.abs(da), jnp.abs(db), k, odt == jnp.bfloat16, f"a4w4 {m}x{n}x{k}")


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
    qa, qb = mx.quantize(rand(5, (1, 256, 256)), 2), mx.quantize(rand(6, (1, 192, 256)), 2)
    sa = as_scale_bytes(qa.scales).at[0, 5, 3].set(255)
    qa = mx.MXFP4Array(qa.data, as_e8m0(sa), 2, qa.shape, qa.dtype, qa.scale_mode, "plain")
    out = np.asarray(jax.jit(lambda x, y: mx.dot_general(x, y, CANON, preferred_element_type=jnp.float32,
                                                         recipe=PALLAS))(qa, qb))
    assert np.isnan(out[0, 5]).all()
    assert np.isfinite(np.delete(out[0], 5, 0)).all()
