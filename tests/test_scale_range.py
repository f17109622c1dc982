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
from mx_reference import (PAIR_PATTERNS, pack_ref, scale_pair_failures, scale_pair_operands,
                          scale_pair_reference)

import jax_mxfp4 as mx
from jax_mxfp4 import dispatch
from jax_mxfp4.backends.base import GemmProblem
from jax_mxfp4.mx_format import as_e8m0, normal_range_blocks

DN = (((1,), (1,)), ((), ()))
ROWS = 256


def _mx(codes, sb):
    return mx.MXFP4Array(jnp.asarray(pack_ref(codes, 1)), as_e8m0(jnp.asarray(sb)), 1, codes.shape, jnp.float32)


def check_scale_pairs(backend, pattern, out_dtype=jnp.float32, k=32, form="plain", batch_rows=None):
    """Run ``backend`` on the all-pairs GEMM; assert every output is within its contract.
    ``form``: "plain" MXFP4Arrays, "fp8" (rhs through prepare_fp8) or "decode" (rhs through
    prepare_decode). ``batch_rows``: split the lhs into batches of this many rows (decode-size
    routes), each against the whole rhs."""
    cl, bl, cr, br = scale_pair_operands(pattern, k)
    a, b = _mx(cl, bl), _mx(cr, br)
    recipe = mx.Recipe(backend=backend)
    pet = jnp.dtype(out_dtype)
    if form == "fp8":
        b = mx.prepare_fp8(b)
    elif form == "decode":
        b = mx.prepare_decode(b)
    if batch_rows:
        nb = ROWS // batch_rows
        a3 = mx.MXFP4Array(a.data.reshape(nb, batch_rows, -1), a.scales.reshape(nb, batch_rows, -1), 2,
                           (nb, batch_rows, k), jnp.float32)
        rep = lambda v: jnp.broadcast_to(v, (nb, *v.shape))  # noqa: E731
        b3 = mx.MXFP4Array(rep(b.data), rep(b.scales), 2, (nb, ROWS, k), jnp.float32)
        dn = (((2,), (2,)), ((0,), (0,)))
        fn = jax.jit(lambda x, y: mx.dot_general(x, y, dn, preferred_element_type=pet, recipe=recipe))
        got = np.asarray(fn(a3, b3).astype(jnp.float32)).reshape(ROWS, ROWS)
    else:
        fn = jax.jit(lambda x, y: mx.dot_general(x, y, DN, preferred_element_type=pet, recipe=recipe))
        got = np.asarray(fn(a, b).astype(jnp.float32))
    exact, abs_dot, nan_byte, overflow = scale_pair_reference(cl, bl, cr, br)
    problem = GemmProblem(1, ROWS, ROWS, k, np.dtype(pet), "plain", dispatch.current_platform())
    bound = dispatch.get_backend(backend).numerics(problem).bound(exact, abs_dot, k, pet)
    bad = scale_pair_failures(got, exact, abs_dot, nan_byte, overflow, bound)
    where = [(f"0x{i:02X}", f"0x{j:02X}", float(got[i, j]), float(exact[i, j])) for i, j in np.argwhere(bad)[:6]]
    assert not bad.any(), f"{backend} {pattern} {form}: {int(bad.sum())} pairs off, (lhs byte, rhs byte, got, exact): {where}"
    assert np.isnan(got[255]).all() and np.isnan(got[:, 255]).all()
    # the pair the faults were about: 6 x 2^-127 against 6 x 2^125 (bytes 0x00, 0xFC) is ordinary
    if pattern == "six":
        assert exact[0, 0xFC] == 32 * 36 * 2.0**-2 and got[0, 0xFC] == exact[0, 0xFC]


CPU_BACKENDS = ["xla", "ffi-cpu", "scaled_dot", "fp8"]


@pytest.mark.parametrize("pattern", list(PAIR_PATTERNS))
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_every_scale_byte_pair_within_contract(backend, pattern):
    check_scale_pairs(backend, pattern)


@pytest.mark.parametrize("backend", ["xla", "scaled_dot", "fp8"])
def test_every_scale_byte_pair_bfloat16_out(backend):
    check_scale_pairs(backend, "mixed", jnp.bfloat16)


def test_every_scale_byte_pair_fp8_prepared_weight():
    check_scale_pairs("fp8", "mixed", form="fp8")


def test_every_scale_byte_pair_decode_prepared_weight():
    check_scale_pairs("xla", "mixed", form="decode")


@pytest.mark.parametrize("pattern", list(PAIR_PATTERNS))
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
    d2, s2 = normal_range_blocks(data, jnp.asarray(sb))
    assert int(jnp.min(jnp.where(jnp.asarray(s2) == 255, 1, s2))) >= 1
    from mx_reference import dequantize_ref, unpack_ref

    want = dequantize_ref(codes, sb, 1)
    got = dequantize_ref(unpack_ref(np.asarray(d2), 1), np.asarray(s2), 1)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))
    assert np.all((got == 0) | np.isnan(got) | (np.abs(got) >= 2.0**-126))
    np.testing.assert_array_equal(np.asarray(d2)[2:], np.asarray(data)[2:])  # other bytes untouched
