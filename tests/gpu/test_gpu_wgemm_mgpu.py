"""The Mosaic GPU w4a16 kernel (jax_mxfp4/kernels/wgemm_mgpu.py) on an NVIDIA Hopper GPU, every
tiling of mgpu_variants.VARIANTS, against backend "xla" (``dot_general`` with
``Recipe(backend="xla", quantize_activations=False)``) on random data with mixed block
magnitudes: elementwise |mgpu - xla| <= 2 K 2^-24 (|x|.|W|) (+ 2^-7 |xla| for bfloat16 out),
finite. In order: one small case per structure (16x256x1024), for the
one-kernel (k_split_wgs) structures the pipeline cases 16x256xK with K steps = stages, stages + 1, 2 stages + 1; every
E8M0 byte 0x00..0xFE on the weight side and one NaN block against a float64 NumPy reference and
backend "xla"; 16x8192x8192 for every tiling; 1 and 40 rows (padded) for the first three and
the one-kernel tilings. A tiling whose structure failed its small case is skipped after it.
Tests marked ``slow`` (the pipeline cases and the tilings that share a structure) make the run
about twice as long; -m "not slow" leaves one tiling per structure."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_mxfp4 as mx
from gpu_reference import bound_check, byte_reference, every_byte_operands, finite_within_bound, rand
from jax_mxfp4.mx_format import as_e8m0, as_scale_bytes
from mgpu_variants import (STRUCTURES, VARIANTS, bisect_ks, call_args, edge_config, k_split_diagnosis, small_case,
                           smoke_of, w_order)

pytestmark = [pytest.mark.gpu, pytest.mark.hopper]

DIMS2 = (((1,), (1,)), ((), ()))
XLA_W4A16 = mx.Recipe(backend="xla", quantize_activations=False)
F32, BF16 = jnp.float32, jnp.bfloat16

_SMOKE_FAILED: set[str] = set()


@functools.lru_cache(maxsize=4)
def _operands(m, n, k):
    """x bfloat16 [m, k] and the weight MXFP4Array [n, k] (blocks along K), drawn once per shape."""
    return rand(100 + m + k, (m, k)).astype(jnp.bfloat16), mx.quantize(rand(200 + m + k, (n, k)), 1)


@functools.lru_cache(maxsize=4)
def _reference(m, n, k, odt):
    x, q = _operands(m, n, k)
    return mx.dot_general(x, q, DIMS2, recipe=XLA_W4A16, preferred_element_type=odt)


def _check(m, n, k, name, odt):
    """The variant ``name`` at [m, k] x [n, k] against backend "xla" within the bound."""
    from jax_mxfp4.kernels.wgemm_mgpu import mgpu_w4a16

    cfg = VARIANTS[name]
    x, q = _operands(m, n, k)
    d, s, form = call_args(name, cfg, q.data, as_scale_bytes(q.scales))
    got = jax.jit(lambda a, d_, s_: mgpu_w4a16(a, d_, s_, odt, cfg, scales_form=form, w_order=w_order(name)))(x, d, s)
    assert got.shape == (m, n) and got.dtype == jnp.dtype(odt)
    r = bound_check(got, _reference(m, n, k, odt), jnp.abs(x.astype(jnp.float32)), jnp.abs(mx.dequantize(q)), k,
                    odt == jnp.bfloat16)
    if not r["ok"]:
        diag = k_split_diagnosis(got, x, q, cfg, odt) if cfg.k_split_wgs > 1 else {}
        pytest.fail(f"{m}x{n}x{k} {jnp.dtype(odt).name} {name} {cfg}: finite={r['finite']} "
                    f"max err/bound={r['max_err_over_bound']:.4g} rel_fro={r['rel_fro']:.3g} {diag}")


def _require_smoke(name):
    sm = smoke_of(name)
    if sm in _SMOKE_FAILED:
        pytest.skip(f"the small case of its structure ({sm!r}) failed")


@pytest.mark.parametrize("name", STRUCTURES)
def test_small_case_per_structure(name):
    try:
        _check(*small_case(VARIANTS[name]), name, F32)
    except BaseException:
        _SMOKE_FAILED.add(name)
        raise


@pytest.mark.slow
@pytest.mark.parametrize("name", [nm for nm in STRUCTURES if VARIANTS[nm].k_split_wgs > 1])
def test_one_kernel_pipeline_reuses_its_slots(name):
    """K steps = stages, stages + 1 and 2 stages + 1: the pipeline's slots reused none, once, twice."""
    _require_smoke(name)
    cfg = VARIANTS[name]
    cases = bisect_ks(cfg)
    assert [k // cfg.bk for _, _, k in cases] == sorted({cfg.stages, cfg.stages + 1, 2 * cfg.stages + 1})
    for m, n, k in cases:
        _check(m, n, k, name, F32)


@pytest.mark.parametrize("name", STRUCTURES)
def test_every_e8m0_byte_and_nan_block(name):
    """Every E8M0 byte on the weight side and one NaN block: finite products within the bound of
    float64, the NaN block poisons its whole output column; other columns may hold Inf/NaN
    legitimately (scale bytes near 254 overflow float32), so their pattern is compared with
    backend "xla", and the values with it within twice the bound."""
    from jax_mxfp4.kernels.wgemm_mgpu import mgpu_w4a16

    _require_smoke(name)
    m, n, k = 16, 256, 1024
    x, data, sb = every_byte_operands(5, m, n, k, nan_at=(17, 3))
    cfg = edge_config(VARIANTS[name])
    d, s, form = call_args(name, cfg, jnp.asarray(data), jnp.asarray(sb))
    got = np.asarray(jax.jit(lambda a, d_, s_: mgpu_w4a16(a, d_, s_, jnp.float32, cfg, scales_form=form,
                                                          w_order=w_order(name)))(x, d, s), np.float64)
    ref, mag = byte_reference(x, data, sb)
    ok_vals, fin = finite_within_bound(got, ref, mag, k)
    assert ok_vals, f"{name} {cfg}: values against float64"
    assert np.isnan(got[:, 17]).all(), f"{name} {cfg}: NaN block"
    w_arr = mx.MXFP4Array(jnp.asarray(data), as_e8m0(jnp.asarray(sb)), 1, (n, k), jnp.float32, "floor", "plain")
    xla = np.asarray(mx.dot_general(x, w_arr, DIMS2, recipe=XLA_W4A16, preferred_element_type=jnp.float32),
                     np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(xla), err_msg=f"{name} {cfg}: NaN pattern as xla")
    assert np.all(np.abs(got[fin] - xla[fin]) <= 4 * k * 2.0**-24 * mag[fin] + 2.0**-126), f"{name} {cfg}: vs xla"


def _slow_unless_smoke(names):
    return [nm if nm in STRUCTURES else pytest.param(nm, marks=pytest.mark.slow) for nm in names]


@pytest.mark.parametrize("name", _slow_unless_smoke(VARIANTS))
def test_full_size(name):
    _require_smoke(name)
    _check(16, 8192, 8192, name, BF16)


PADDED = list(VARIANTS)[:3] + [nm for nm in list(VARIANTS)[3:] if VARIANTS[nm].k_split_wgs > 1]


@pytest.mark.parametrize("m,n,k", [(1, 8192, 8192), (40, 1024, 4096)], ids=["1x8192x8192", "40x1024x4096"])
@pytest.mark.parametrize("name", _slow_unless_smoke(PADDED))
def test_padded_rows(name, m, n, k):
    _require_smoke(name)
    _check(m, n, k, name, F32)
