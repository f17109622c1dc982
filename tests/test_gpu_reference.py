"""The references of the device tests (tests/gpu/gpu_reference.py) on the CPU: the FP8-GEMM
detector, the float64 byte decoder against ``dequantize`` and the accumulation-bound check."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_mxfp4 as mx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu"))

from gpu_reference import bound_check, byte_reference, fp8_dot_in_hlo, rand  # noqa: E402


def test_fp8_dot_detector_reads_operand_definitions(rng):
    """The FP8-GEMM detector reads operand types from each computation's definitions (XLA prints
    dot operands by name): an f8 x f8 dot in a fusion is found; the CPU compile of the FP8 path
    (codes converted to float32 before the dot) and a name reused with another type in another
    computation are not."""
    from jax_mxfp4.backends import fp8 as fb

    gpu_like = ("%gemm_fusion_dot (p0: f8e4m3fn[64,256], p1: f8e4m3fn[64,256]) -> bf16[64,64] {\n"
                "  %p0 = f8e4m3fn[64,256]{1,0} parameter(0)\n  %p1 = f8e4m3fn[64,256]{1,0} parameter(1)\n"
                "  ROOT %dot.1 = bf16[64,64]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}\n}\n")
    other = ("%fused (p0: f32[64,256], p1: f32[64,256]) -> f32[64,64] {\n"
             "  %p0 = f32[64,256]{1,0} parameter(0)\n  %p1 = f32[64,256]{1,0} parameter(1)\n"
             "  ROOT %dot.2 = f32[64,64]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}\n}\n")
    defs_only = "%c (p0: f8e4m3fn[64]) -> f8e4m3fn[64] {\n  %p0 = f8e4m3fn[64]{0} parameter(0)\n}\n"
    assert fp8_dot_in_hlo(gpu_like) and fp8_dot_in_hlo(other + "\n" + gpu_like)
    assert not fp8_dot_in_hlo(defs_only + "\n" + other)
    x = mx.quantize(jnp.asarray(rng.standard_normal((1, 64, 256)), jnp.float32), 2)
    hlo = jax.jit(lambda a, b: fb.fp8_gemm(a, b, jnp.float32, "default", "cpu")).lower(x, x).compile().as_text()
    assert " dot(" in hlo and "f8e4m3fn" in hlo and not fp8_dot_in_hlo(hlo)


def test_byte_reference_decodes_as_dequantize(rng):
    """The NumPy decoder of the every-byte tests gives dequantize's values, NaN blocks included."""
    from jax_mxfp4.mx_format import as_e8m0

    n, k = 8, 64
    data = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    sb = rng.integers(100, 150, (n, k // 32)).astype(np.uint8)
    sb[3, 1] = 255
    w = mx.MXFP4Array(jnp.asarray(data), as_e8m0(jnp.asarray(sb)), 1, (n, k), jnp.float32, "floor", "plain")
    eye = np.eye(k, dtype=np.float32)
    prod, mag = byte_reference(eye, data, sb)  # I @ W^T = W^T; the NaN block poisons its whole column
    want = np.asarray(mx.dequantize(w), np.float64).T
    assert np.isnan(want[32:, 3]).all() and np.isnan(prod[:, 3]).all()
    keep = np.arange(n) != 3
    np.testing.assert_array_equal(prod[:, keep], want[:, keep])
    np.testing.assert_array_equal(mag[:, keep], np.abs(want[:, keep]))


def test_bound_check_passes_float32_reassociation_and_fails_a_wrong_block():
    a, b = rand(1, (1, 16, 256)), rand(2, (1, 24, 256))
    ref = jnp.einsum("bmk,bnk->bmn", a, b, precision="highest")
    reordered = jnp.einsum("bmk,bnk->bmn", a[..., ::-1], b[..., ::-1], precision="highest")
    assert bound_check(reordered, ref, jnp.abs(a), jnp.abs(b), 256, False)["ok"]
    wrong = jnp.einsum("bmk,bnk->bmn", a.at[..., :32].set(0), b, precision="highest")
    r = bound_check(wrong, ref, jnp.abs(a), jnp.abs(b), 256, False)
    assert not r["ok"] and r["max_err_over_bound"] > 1
    assert not bound_check(ref.at[0, 0, 0].set(jnp.nan), ref, jnp.abs(a), jnp.abs(b), 256, False)["ok"]
