"""Every GPU backend and route against the float64 reference for every pair of E8M0 scale bytes
(0x00..0xFE and the NaN byte 0xFF on both operands), each held to its own contract
(Backend.numerics): tests/scale_pairs.check_scale_pairs, the check tests/test_scale_range.py runs
on the CPU. The bottom of the range is where GPUs and CPUs differ: the scale 2^-127 of byte 0x00
is a float32/bfloat16 subnormal, which a GPU keeps and XLA on CPU treats as zero, while the
documented decoding keeps 6 x 2^-127 (normal) and flushes elements below 2^-126.

Routes: backend "pallas" a4w4 with both sides large (tiled kernel), decode-size a4w4 and w4a16
(16-row batches: the Mosaic GPU kernel on Hopper, the Triton weight-stationary kernel with Mosaic
off), w4a16 with 256 rows (the large-tile Mosaic GPU kernel on Hopper, two-pass with Mosaic off);
the FP8 path at DEFAULT and HIGH, with a plain and a prepare_fp8 weight; "scaled_dot"; "xla"."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from scale_pairs import check_scale_pairs

from jax_mxfp4.backends import pallas as pallas_backend

pytestmark = [pytest.mark.gpu]

PATTERNS = ["six", "mixed"]


@pytest.fixture
def mosaic(request, monkeypatch):
    """Mosaic GPU routes of backend "pallas" on (True) or off (False: Triton and two-pass)."""
    monkeypatch.setattr(pallas_backend, "W4A16_MOSAIC_GPU", request.param)
    jax.clear_caches()  # routes are decided when a program is lowered
    yield request.param
    jax.clear_caches()


@pytest.mark.parametrize("out", ["float32", "bfloat16"])
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("backend", ["xla", "scaled_dot"])
def test_gpu_scale_pairs_exact_backends(backend, pattern, out):
    check_scale_pairs(backend, pattern, getattr(jnp, out))


@pytest.mark.cuda
@pytest.mark.parametrize("form", ["plain", "fp8"])
@pytest.mark.parametrize("precision", ["default", "high"])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_gpu_scale_pairs_fp8(pattern, precision, form):
    check_scale_pairs("fp8", pattern, jnp.bfloat16, form=form, precision=precision)


@pytest.mark.cuda
@pytest.mark.parametrize("pattern", PATTERNS)
def test_gpu_scale_pairs_pallas_tiled(pattern):
    check_scale_pairs("pallas", pattern)


@pytest.mark.cuda
@pytest.mark.parametrize("mosaic", [True, False], indirect=True, ids=["mosaic", "triton"])
@pytest.mark.parametrize("float_lhs", [False, True], ids=["a4w4", "w4a16"])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_gpu_scale_pairs_pallas_decode_size(pattern, float_lhs, mosaic):
    check_scale_pairs("pallas", pattern, jnp.bfloat16, k=512, batch_rows=16, float_lhs=float_lhs)


@pytest.mark.cuda
@pytest.mark.parametrize("form", ["plain", "decode"])
@pytest.mark.parametrize("mosaic", [True, False], indirect=True, ids=["tiles", "two-pass"])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_gpu_scale_pairs_pallas_w4a16_many_rows(pattern, mosaic, form):
    check_scale_pairs("pallas", pattern, jnp.bfloat16, k=512, float_lhs=True, form=form)


@pytest.mark.cuda
@pytest.mark.parametrize("pattern", PATTERNS)
def test_gpu_scale_pairs_pallas_decode_prepared_weight(pattern):
    check_scale_pairs("pallas", pattern, jnp.bfloat16, k=512, batch_rows=16, float_lhs=True, form="decode")
