"""``jax.export`` on the CPU, as JAX users write it (no context manager): for platform "rocm" a
jitted GEMM emits a StableHLO custom_call to the hipBLASLt FFI target with the packed operand
shapes, both with ``Recipe(backend="hipblaslt")`` and with the default "auto"; a multi-platform
export (cpu + rocm) lowers each platform's own path and runs here; mismatched backend/platform
pairs refuse to lower; and every export example in README.md and the docstrings runs as written."""

from __future__ import annotations

import pathlib
import re
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_mxfp4 as mx
import jax_mxfp4.ffi
from jax_mxfp4 import Recipe
from jax_mxfp4.ffi import export_safety_checks

M, N, K = 64, 32, 256
DN = (((1,), (1,)), ((), ()))


def gemm(backend="auto", layout="plain", out=jnp.bfloat16):
    def f(x, w):
        return mx.dot_general(x, w, DN, preferred_element_type=out, recipe=Recipe(backend=backend, scale_layout=layout))

    return jax.jit(f)


def args(m=M, n=N, k=K):
    return (jax.ShapeDtypeStruct((m, k), jnp.float32), jax.ShapeDtypeStruct((n, k), jnp.float32))


def export(fn, *platforms):
    """jax.export; our targets are not on JAX's stable custom-call list, so say so explicitly."""
    return jax.export.export(fn, platforms=list(platforms), disabled_checks=export_safety_checks())


def custom_calls(text):
    return [line for line in text.splitlines() if "stablehlo.custom_call @jax_mxfp4_gemm" in line]


@pytest.fixture(autouse=True)
def _validated_envelope(monkeypatch):
    monkeypatch.delenv("JAX_MXFP4_HIPBLASLT_ENVELOPE", raising=False)
    monkeypatch.delenv("JAX_MXFP4_BACKEND", raising=False)


@pytest.mark.parametrize("backend", ["hipblaslt", "auto"])
@pytest.mark.parametrize("layout", ["plain", "swizzled"])
def test_rocm_export_emits_the_hipblaslt_custom_call(backend, layout):
    exp = export(gemm(backend, layout), "rocm")(*args())
    (call,) = custom_calls(exp.mlir_module())
    assert "@jax_mxfp4_gemm_hipblaslt" in call
    operands = re.findall(r"tensor<([0-9x]+)x(ui8|f8E8M0FNU)>", call.split("->")[0])
    # Packed data [B, rows, K/2]; scales [B, rows, K/32] (already multiples of 32 x 8 here).
    assert operands == [("1x64x128", "ui8"), ("1x64x8", "f8E8M0FNU"), ("1x32x128", "ui8"), ("1x32x8", "f8E8M0FNU")]
    assert "tensor<1x64x32xbf16>" in call.split("->")[1]
    assert f'scale_layout = "{layout}"' in call
    assert exp.platforms == ("rocm",)


def test_rocm_export_swizzled_pads_scale_rows_and_blocks(monkeypatch):
    monkeypatch.setenv("JAX_MXFP4_HIPBLASLT_ENVELOPE", "documented")  # M=48, K=384: the wider envelope
    exp = export(gemm("hipblaslt", "swizzled", jnp.float32), "rocm")(*args(48, 16, 384))
    (call,) = custom_calls(exp.mlir_module())
    # K/32 = 12 -> padded to 16; rows 48 -> 64, 16 -> 32.
    assert re.findall(r"tensor<([0-9x]+)xf8E8M0FNU>", call.split("->")[0]) == ["1x64x16", "1x32x16"]
    assert "tensor<1x48x16xf32>" in call.split("->")[1]


def test_multi_platform_export_lowers_each_platforms_path_and_runs_here():
    exp = export(gemm("auto", out=jnp.float32), "cpu", "rocm")(*args())
    assert exp.platforms == ("cpu", "rocm")
    (call,) = custom_calls(exp.mlir_module())  # one hipBLASLt call, in the rocm branch only
    assert "@jax_mxfp4_gemm_hipblaslt" in call
    x = jax.random.normal(jax.random.key(0), (M, K))
    w = jax.random.normal(jax.random.key(1), (N, K))
    # On the CPU the exported program runs the cpu branch ("xla"), equal to the direct call.
    np.testing.assert_array_equal(np.asarray(exp.call(x, w)), np.asarray(gemm("xla", out=jnp.float32)(x, w)))
    pytest.importorskip("flatbuffers")  # jax.export serialization (in the test extra)
    round_trip = jax.export.deserialize(exp.serialize())
    np.testing.assert_array_equal(np.asarray(round_trip.call(x, w)), np.asarray(exp.call(x, w)))


def test_auto_outside_the_hipblaslt_envelope_exports_another_path_for_rocm():
    # K = 384: outside the validated envelope; "auto" stages the Pallas kernel for rocm instead.
    assert "rocm -> pallas" in str(mx.explain(*args(64, 32, 384), DN))
    exp = export(gemm("auto"), "rocm")(*args(64, 32, 384))
    assert custom_calls(exp.mlir_module()) == []
    assert "__gpu$xla.gpu.triton" in exp.mlir_module()


def test_cpu_export_emits_the_cpu_custom_call():
    exp = export(gemm("ffi-cpu"), "cpu")(*args())
    (call,) = custom_calls(exp.mlir_module())
    assert "@jax_mxfp4_gemm_cpu" in call
    assert re.findall(r"tensor<([0-9x]+)xui8>", call.split("->")[0]) == ["1x64x128", "1x32x128"]
    # And the exported artifact runs here, equal to the same call made directly.
    x = jax.random.normal(jax.random.key(0), (M, K))
    w = jax.random.normal(jax.random.key(1), (N, K))
    np.testing.assert_array_equal(np.asarray(exp.call(x, w)), np.asarray(gemm("ffi-cpu")(x, w)))


def test_mismatched_backend_and_platform_refuse_to_lower():
    no_handler = "'hipblaslt' has no handler for platform 'cpu'"
    with pytest.raises(mx.BackendUnavailableError, match=no_handler):
        export(gemm("hipblaslt"), "cpu")(*args())
    with pytest.raises(mx.BackendUnavailableError, match=no_handler):
        export(gemm("hipblaslt"), "cpu", "rocm")(*args())  # an explicit backend is not swapped
    with pytest.raises(mx.BackendUnavailableError, match="'ffi-cpu' has no handler for platform 'rocm'"):
        export(gemm("ffi-cpu"), "rocm")(*args())
    # Run here (not exported): the explicit request fails, never falls back to another backend.
    with pytest.raises(mx.BackendUnavailableError, match=no_handler):
        gemm("hipblaslt")(*[jnp.ones(a.shape) for a in args()])


def test_explicit_hipblaslt_keeps_its_shape_rules_on_cpu():
    with pytest.raises(mx.BackendUnavailableError, match="K % 256"):
        export(gemm("hipblaslt"), "rocm")(*args(64, 32, 384))
    with pytest.raises(mx.BackendUnavailableError, match="hipblaslt"):
        gemm("hipblaslt")(*[jnp.ones(a.shape) for a in args(64, 32, 384)])


# ---- Every export example in the documentation runs as written.

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _readme_examples():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    return [b for b in blocks if "jax.export" in b]


def _docstring_examples():
    out = []
    for obj in (jax_mxfp4.ffi,):
        doc = obj.__doc__ or ""
        for block in re.findall(r"::\n\n((?:    .*\n|\n)+)", doc):
            block = textwrap.dedent(block)
            if "jax.export" in block:
                out.append(block)
    return out


def test_the_documentation_has_export_examples():
    assert _readme_examples(), "README.md lost its export example"
    assert _docstring_examples(), "jax_mxfp4.ffi lost its export example"


@pytest.mark.parametrize("source", ["readme", "docstring"])
def test_export_examples_run_as_written(source):
    blocks = _readme_examples() if source == "readme" else _docstring_examples()
    for code in blocks:
        exec(compile(code, f"<{source} export example>", "exec"), {})


def test_rocm_export_through_xla_scaled_dot_forward_and_vjp():
    # Backend "scaled_dot" (JAX's lax.scaled_dot) for a ROCm lowering: the forward GEMM and both
    # GEMMs of the VJP (dgrad, wgrad) are XLA's block-scaled-dot composite, no FFI custom call.
    # The exported module stops there: which kernel serves the composite (on ROCm, XLA's hipBLASLt
    # block-scaled call) is chosen later, by XLA's GPU compiler on the device.
    def loss(x, w):
        out = mx.dot_general(x, w, DN, preferred_element_type=jnp.float32, recipe=Recipe(backend="scaled_dot"))
        return out.sum()

    forward = export(jax.jit(loss), "rocm")(*args()).mlir_module()
    backward = export(jax.jit(jax.grad(loss, argnums=(0, 1))), "rocm")(*args()).mlir_module()
    composite = 'stablehlo.composite "xla.scaled_dot"'
    assert forward.count(composite) == 1 and backward.count(composite) == 2
    assert not custom_calls(forward) and not custom_calls(backward)
