"""Every GPU backend and route against the float64 reference for every pair of E8M0 scale bytes
(0x00..0xFE and the NaN byte 0xFF on both operands), each held to its own contract
(Backend.numerics): tests/scale_pairs.check_scale_pairs, the check tests/test_scale_range.py runs
on the CPU. The bottom of the range is where GPUs and CPUs differ: the scale 2^-127 of byte 0x00
is a float32/bfloat16 subnormal, which a GPU keeps and XLA on CPU treats as zero, while the
documented decoding keeps 6 x 2^-127 (normal) and flushes elements below 2^-126.

Routes: backend "pallas" a4w4 with both sides large (two-pass: both operands decoded, K = 32 by the
jnp dequantization), decode-size a4w4 and w4a16
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

# The PTX decodes of the Hopper w4a16/decode-size kernels (Triton e2m1_asm, Mosaic GPU) keep an
# element below 2^-126 (0.5, 1 or 1.5 under scale byte 0x00, 0.5 under 0x01) as the subnormal it
# is, where the documented decoding flushes it to a signed zero. quantize() never writes such
# elements (tests/test_scale_range.py); MXFP4 bytes from elsewhere can. Measured on an NVIDIA H200
# (jax 0.11.2, 2026-12-03): "mixed" differs on these routes, "six" agrees.
KEEPS_SUBNORMAL_ELEMENTS = pytest.mark.xfail(
    strict=True, reason="PTX decode keeps elements below 2^-126 (docs/numerics.md, scale byte 0x00)")


def _known_deviation(request, pattern):
    if pattern == "mixed":
        request.applymarker(KEEPS_SUBNORMAL_ELEMENTS)


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
def test_gpu_scale_pairs_pallas_a4w4_two_pass(pattern):
    check_scale_pairs("pallas", pattern)


@pytest.mark.cuda
@pytest.mark.parametrize("mosaic", [True, False], indirect=True, ids=["mosaic", "triton"])
@pytest.mark.parametrize("float_lhs", [False, True], ids=["a4w4", "w4a16"])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_gpu_scale_pairs_pallas_decode_size(pattern, float_lhs, mosaic, request):
    _known_deviation(request, pattern)
    check_scale_pairs("pallas", pattern, jnp.bfloat16, k=512, batch_rows=16, float_lhs=float_lhs)


@pytest.mark.cuda
@pytest.mark.parametrize("form", ["plain", "decode"])
@pytest.mark.parametrize("mosaic", [True, False], indirect=True, ids=["tiles", "two-pass"])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_gpu_scale_pairs_pallas_w4a16_many_rows(pattern, mosaic, form, request):
    _known_deviation(request, pattern)
    check_scale_pairs("pallas", pattern, jnp.bfloat16, k=512, float_lhs=True, form=form)


@pytest.mark.cuda
@pytest.mark.parametrize("pattern", PATTERNS)
def test_gpu_scale_pairs_pallas_decode_prepared_weight(pattern, request):
    _known_deviation(request, pattern)
    check_scale_pairs("pallas", pattern, jnp.bfloat16, k=512, batch_rows=16, float_lhs=True, form="decode")
