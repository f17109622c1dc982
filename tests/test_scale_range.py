"""Every backend against the float64 reference for every pair of E8M0 scale bytes (0x00..0xFE and
the NaN byte 0xFF on both operands), held to its own contract (Backend.numerics).

One GEMM covers all 256 x 256 pairs (tests/mx_reference.scale_pair_operands: lhs row i has scale
byte i, rhs row j byte j). At the bottom of the range a block with byte 0x00 (2^-127) and max
E2M1 elements (6 x 2^-127, a normal float32) times a block near 2^127 has an ordinary product;
elements below 2^-126 (byte 0x00 with |E2M1| < 2, byte 0x01 with 0.5) are zeros by the
documented decoding, whatever the hardware does with subnormals."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mx_reference import PAIR_PATTERNS, dequantize_ref, pack_ref, unpack_ref
from scale_pairs import check_scale_pairs

from jax_mxfp4.mx_format import normal_range_blocks

CPU_BACKENDS = ["xla", "ffi-cpu", "scaled_dot", "fp8"]
SLOW = pytest.mark.slow


@pytest.mark.parametrize("backend,pattern", [
    pytest.param(b, p, marks=SLOW if (b, p) == ("fp8", "six") else ()) for b in CPU_BACKENDS for p in PAIR_PATTERNS])
def test_every_scale_byte_pair_within_contract(backend, pattern):
    check_scale_pairs(backend, pattern)


@pytest.mark.parametrize("backend", ["xla", "scaled_dot", pytest.param("fp8", marks=SLOW)])
def test_every_scale_byte_pair_bfloat16_out(backend):
    check_scale_pairs(backend, "mixed", jnp.bfloat16)


@SLOW
def test_every_scale_byte_pair_fp8_prepared_weight():
    check_scale_pairs("fp8", "mixed", form="fp8")


@SLOW
def test_every_scale_byte_pair_decode_prepared_weight():
    check_scale_pairs("xla", "mixed", form="decode")


@pytest.mark.parametrize("pattern", ["mixed", pytest.param("six", marks=SLOW)])
def test_every_scale_byte_pair_pallas_tiled_interpreted(pattern):
    check_scale_pairs("pallas", pattern)


@pytest.mark.slow
def test_every_scale_byte_pair_pallas_weight_stationary_interpreted():
    check_scale_pairs("pallas", "mixed", batch_rows=16)


def test_normal_range_blocks_keeps_every_value():
    """normal_range_blocks re-encodes blocks with bytes 0x00/0x01 so that no scale and no element
    is a float32 subnormal; the decoded values (signed zeros included) are those of the original."""
    codes = np.tile(np.arange(16, dtype=np.uint8), (256, 2))  # every code under every byte
    sb = np.arange(256, dtype=np.uint8)[:, None]
    data = jnp.asarray(pack_ref(codes, 1))
    d2, s2 = jax.jit(normal_range_blocks)(data, jnp.asarray(sb))
    assert int(jnp.min(jnp.where(jnp.asarray(s2) == 255, 1, s2))) >= 1
    want = dequantize_ref(codes, sb, 1)
    got = dequantize_ref(unpack_ref(np.asarray(d2), 1), np.asarray(s2), 1)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))
    assert np.all((got == 0) | np.isnan(got) | (np.abs(got) >= 2.0**-126))
    np.testing.assert_array_equal(np.asarray(d2)[2:], np.asarray(data)[2:])  # other bytes untouched


def test_flush_below_normal_keeps_sign_nan_inf_and_normals():
    from jax_mxfp4.mx_format import flush_below_normal

    tiny = np.float32(2.0**-126)
    v = np.array([tiny, -tiny, tiny * np.float32(0.5), -tiny * np.float32(0.75), 0.0, -0.0, 1.5,
                  np.inf, -np.inf, np.nan, 6 * 2.0**-127], np.float32)
    got = np.asarray(flush_below_normal(jnp.asarray(v)))
    want = np.array([tiny, -tiny, 0.0, -0.0, 0.0, -0.0, 1.5, np.inf, -np.inf, np.nan, 6 * 2.0**-127], np.float32)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


def test_kernel_decode_every_byte_and_code_equals_dequantize():
    """The Pallas kernels' portable decode (kernels.wgemm._dequant_halves: the weight-stationary
    kernel and its decode pass on ROCm and in the interpreter) gives dequantize's bfloat16 values for every scale byte
    and code, flushed elements (bytes 0x00/0x01) as signed zeros."""
    from jax_mxfp4.kernels.wgemm import _dequant_halves

    codes = np.tile(np.arange(16, dtype=np.uint8), (256, 2))
    sb = np.arange(256, dtype=np.uint8)[:, None]
    lo, hi = jax.jit(_dequant_halves)(jnp.asarray(pack_ref(codes, 1)), jnp.asarray(sb))
    got = np.stack([np.asarray(lo.astype(jnp.float32)), np.asarray(hi.astype(jnp.float32))], -1).reshape(256, 32)
    with np.errstate(over="ignore"):  # bytes 0xFD/0xFE: elements past float32's range are +-Inf
        want = dequantize_ref(codes, sb, 1).astype(np.float32).astype(jnp.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(got.view(np.uint32)[:255], want.view(np.uint32)[:255])
    assert np.isnan(got[255]).all()
