"""Lowering checks that run on the CPU: ``jax.export`` for platform "rocm" of a jitted GEMM with
backend "hipblaslt" emits a StableHLO custom_call to the hipBLASLt FFI target with the packed
operand shapes; "ffi-cpu" likewise for "cpu"; mismatched backend/platform pairs refuse to lower."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_mxfp4 as mx
from jax_mxfp4 import Recipe
from jax_mxfp4.ffi import target_platforms

M, N, K = 64, 32, 256


def gemm(backend, layout="plain", out=jnp.bfloat16):
    def f(x, w):
        return mx.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=out,
                              recipe=Recipe(backend=backend, scale_layout=layout))

    return jax.jit(f)


def args():
    return (jax.ShapeDtypeStruct((M, K), jnp.float32), jax.ShapeDtypeStruct((N, K), jnp.float32))


def export(fn, platform):
    """jax.export; our targets are not on JAX's stable custom-call list, so say so explicitly."""
    checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in ("jax_mxfp4_gemm_cpu", "jax_mxfp4_gemm_hipblaslt")]
    return jax.export.export(fn, platforms=[platform], disabled_checks=checks)


def custom_calls(text):
    return [line for line in text.splitlines() if "stablehlo.custom_call" in line]


@pytest.mark.parametrize("layout", ["plain", "swizzled"])
def test_rocm_export_emits_the_hipblaslt_custom_call(layout):
    with target_platforms("rocm"):
        exp = export(gemm("hipblaslt", layout), "rocm")(*args())
    text = exp.mlir_module()
    (call,) = [c for c in custom_calls(text) if "jax_mxfp4" in c]
    assert "@jax_mxfp4_gemm_hipblaslt" in call
    operands = re.findall(r"tensor<([0-9x]+)x(ui8|f8E8M0FNU)>", call.split("->")[0])
    # Packed data [B, rows, K/2]; scales [B, rows, K/32] (already multiples of 32 x 8 here).
    assert operands == [("1x64x128", "ui8"), ("1x64x8", "f8E8M0FNU"), ("1x32x128", "ui8"), ("1x32x8", "f8E8M0FNU")]
    assert "tensor<1x64x32xbf16>" in call.split("->")[1]
    assert f'scale_layout = "{layout}"' in call
    assert exp.platforms == ("rocm",)


def test_rocm_export_swizzled_pads_scale_rows_and_blocks(monkeypatch):
    monkeypatch.setenv("JAX_MXFP4_HIPBLASLT_ENVELOPE", "documented")  # M=48, K=384: the wider envelope
    with target_platforms("rocm"):
        exp = export(gemm("hipblaslt", "swizzled", jnp.float32), "rocm")(
            jax.ShapeDtypeStruct((48, 384), jnp.float32), jax.ShapeDtypeStruct((16, 384), jnp.float32))
    (call,) = [c for c in custom_calls(exp.mlir_module()) if "jax_mxfp4" in c]
    # K/32 = 12 -> padded to 16; rows 48 -> 64, 16 -> 32.
    assert re.findall(r"tensor<([0-9x]+)xf8E8M0FNU>", call.split("->")[0]) == ["1x64x16", "1x32x16"]
    assert "tensor<1x48x16xf32>" in call.split("->")[1]


def test_cpu_export_emits_the_cpu_custom_call():
    exp = export(gemm("ffi-cpu"), "cpu")(*args())
    (call,) = [c for c in custom_calls(exp.mlir_module()) if "jax_mxfp4" in c]
    assert "@jax_mxfp4_gemm_cpu" in call
    assert re.findall(r"tensor<([0-9x]+)xui8>", call.split("->")[0]) == ["1x64x128", "1x32x128"]
    # And the exported artifact runs here, equal to the same call made directly.
    x = jax.random.normal(jax.random.key(0), (M, K))
    w = jax.random.normal(jax.random.key(1), (N, K))
    np.testing.assert_array_equal(np.asarray(exp.call(x, w)), np.asarray(gemm("ffi-cpu")(x, w)))


def test_mismatched_backend_and_platform_refuse_to_lower():
    with target_platforms("rocm"):
        with pytest.raises(NotImplementedError, match="'hipblaslt' has no handler for platform 'cpu'"):
            export(gemm("hipblaslt"), "cpu")(*args())
    with pytest.raises(NotImplementedError, match="'ffi-cpu' has no handler for platform 'rocm'"):
        export(gemm("ffi-cpu"), "rocm")(*args())


def test_without_target_platforms_hipblaslt_is_unavailable_on_cpu():
    with pytest.raises(mx.BackendUnavailableError, match="hipblaslt"):
        export(gemm("hipblaslt"), "rocm")(*args())
    with target_platforms("rocm"):  # shape rules still route: K % 256 (validated envelope)
        with pytest.raises(mx.BackendUnavailableError, match="K % 256"):
            export(gemm("hipblaslt"), "rocm")(
                jax.ShapeDtypeStruct((M, 96), jnp.float32), jax.ShapeDtypeStruct((N, 96), jnp.float32))
    with pytest.raises(ValueError, match="platform must be one of"):
        with target_platforms("ROCM"):
            pass
