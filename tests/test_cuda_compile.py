"""Every Triton kernel the library emits for an NVIDIA GPU compiles there, checked without a GPU.

The programs a Hopper user runs (a training step of ``dense``, ``quantize`` in every scale mode
and rounding along the last and a strided axis, the FP8 a4w4 GEMM, the MoE grouped GEMM) are
traced with the library's platform queries answering "cuda" and compute capability 9.0 (8.9 for
the Ada route), lowered for CUDA, and each Triton module in them is compiled to PTX by XLA's own
Triton pipeline, the compiler the CUDA plugin registers (``jax._src.lib.triton.compile``; no
GPU, driver or CUDA runtime is used), and the PTX is assembled for the GPU by ``ptxas`` (the one on
PATH, else the ``nvidia-cuda-nvcc-cu12`` wheel's): ptxas, not Triton, refuses an instruction the
GPU lacks. The register spills are checked: the streaming kernels (quantizers, FP8 encode,
rescale, decode) must spill nothing. The GEMM and exact-recompute kernels are not held to that: their
tiles were sized on the H200, and on other GPUs some spill (the Triton w4a16 kernel at 16 rows:
980 bytes on sm_80, 256 on sm_100a; the exact-row recompute 440 on sm_90a, jaxlib 0.10.2 and
CUDA 13.0's ptxas).

What this does not check: values (the interpreter tests and tests/gpu do) and the Mosaic GPU
kernels (decode-size w4a16), which XLA compiles only on a device.

Runs where the CUDA plugin of the installed jaxlib and ptxas are installed and JAX is on the
CPU, as CI's last step does (.ci/run): ``pip install --no-deps jax-cuda12-plugin==V
jax-cuda12-pjrt==V nvidia-cuda-nvcc-cu12`` (V = ``jaxlib.__version__``), then
``JAX_PLATFORMS=cpu pytest -q tests/test_cuda_compile.py``. Skipped elsewhere, with the reason.
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax._src.lib import triton
from jax._src.lib.mlir import ir

import jax_mxfp4 as mx

def _ptxas() -> str | None:
    """ptxas on PATH, else the one of the nvidia-cuda-nvcc-cu12 wheel, else None."""
    found = shutil.which("ptxas")
    if found is None and importlib.util.find_spec("nvidia") is not None:
        for root in importlib.util.find_spec("nvidia").submodule_search_locations or ():
            path = os.path.join(root, "cuda_nvcc", "bin", "ptxas")
            found = found or (path if os.access(path, os.X_OK) else None)
    return found


def _missing() -> str | None:
    if os.environ.get("JAX_PLATFORMS") != "cpu":
        return "runs with JAX_PLATFORMS=cpu (the CUDA plugin registers its Triton compiler only then, without a GPU)"
    jax.devices()  # plugins register their Triton compiler when the backends initialize
    if not triton.has_compilation_handler("cuda"):
        return ("needs XLA's Triton compiler from the CUDA plugin: pip install --no-deps jax-cuda12-plugin==V "
                "jax-cuda12-pjrt==V, V the installed jaxlib's version (.ci/run installs them)")
    if PTXAS is None:
        return "needs ptxas (on PATH, or pip install --no-deps nvidia-cuda-nvcc-cu12)"
    return None


PTXAS = _ptxas()
MISSING = _missing()
pytestmark = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")

S = jax.ShapeDtypeStruct
STREAMING_KERNELS = {"mxfp4_quantize", "mxfp4_quantize_columns", "mxfp4_quantize_fp8", "mxfp4_encode_fp8_rows_swar",
                     "mxfp4_fp8_rescale", "mxfp4_decode_bf16"}
"""Kernels that stream their operands at memory bandwidth: a register spill there is a defect."""
TRAINING_KERNELS = {"mxfp4_quantize", "mxfp4_quantize_columns", "mxfp4_quantize_fp8", "mxfp4_encode_fp8_rows_swar",
                    "mxfp4_fp8_rescale", "mxfp4_fp8_exact_rows_index", "mxfp4_fp8_fix_flagged"}
"""The kernels of a CUDA training step of ``dense`` (X and W along K for fprop, dY fused to FP8
and W along N for dgrad, X and dY along the tokens for wgrad, then encode, rescale, fix)."""


@contextlib.contextmanager
def platform_answers(monkeypatch, platform="cuda", capability=(9, 0)):
    """The library's platform queries answer ``platform`` / ``capability`` while tracing; JAX's
    caches are cleared on both sides, so no traced program leaks into other tests."""
    jax.clear_caches()
    with monkeypatch.context() as m:
        for name, module in list(sys.modules.items()):
            if name == "jax_mxfp4" or name.startswith("jax_mxfp4."):
                if hasattr(module, "current_platform"):
                    m.setattr(module, "current_platform", lambda: platform)
                if hasattr(module, "compute_capability"):
                    m.setattr(module, "compute_capability", lambda: capability)
        try:
            yield
        finally:
            jax.clear_caches()


def triton_modules(fn, *args) -> list[dict]:
    """The Triton custom calls of ``jit(fn)`` lowered for CUDA: name, module bytes, launch."""
    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    found = []

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    if child.operation.name == "stablehlo.custom_call":
                        target = ir.StringAttr(child.attributes["call_target_name"]).value
                        if "triton" in target:
                            key = "mhlo.backend_config" if "mhlo.backend_config" in child.attributes else "backend_config"
                            cfg = ir.DictAttr(child.attributes[key])
                            found.append(dict(name=ir.StringAttr(cfg["name"]).value, ir=ir.StringAttr(cfg["ir"]).value_bytes,
                                              num_warps=ir.IntegerAttr(cfg["num_warps"]).value,
                                              num_stages=ir.IntegerAttr(cfg["num_stages"]).value))
                    walk(child.operation)

    walk(lowered.compiler_ir("stablehlo").operation)
    return found


def compile_all(modules, tmp_path, capability=(9, 0)) -> collections.Counter:
    """Compile each distinct module to PTX (XLA's Triton) for ``capability`` and assemble it with
    ptxas; returns how many of each kernel name were compiled. Fails on a compile error or a
    spill in a streaming kernel."""
    arch = f"{capability[0]}.{capability[1]}"
    sm = f"sm_{capability[0]}{capability[1]}" + ("a" if capability >= (9, 0) else "")  # Triton's target
    done, names = set(), collections.Counter()
    for i, mod in enumerate(modules):
        if mod["ir"] in done:
            continue
        done.add(mod["ir"])
        result = triton.compile("cuda", mod["ir"], arch, num_warps=mod["num_warps"], num_ctas=1,
                                num_stages=mod["num_stages"])
        assert ".entry" in result.asm, f"{mod['name']}: no kernel entry in the PTX"
        names[mod["name"]] += 1
        path = tmp_path / f"{mod['name']}_{sm}_{i}.ptx"
        path.write_text(result.asm)
        run = subprocess.run([PTXAS, f"-arch={sm}", "-v", str(path), "-o", str(path.with_suffix(".cubin"))],
                             capture_output=True, text=True)
        assert run.returncode == 0, f"{mod['name']}: ptxas for {sm} failed:\n{run.stderr[-3000:]}"
        spills = sum(int(b) for b in re.findall(r"(\d+) bytes spill stores", run.stderr))
        assert spills == 0 or mod["name"] not in STREAMING_KERNELS, (
            f"{mod['name']} (num_warps={mod['num_warps']}) spills {spills} bytes on {sm}:\n{run.stderr}")
    return names


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_training_step_kernels_compile(monkeypatch, tmp_path, dtype, impl):
    """Value and gradients of ``dense`` with the default recipe: every kernel of the CUDA program
    compiles, and the program holds each training kernel (so a route that stops taking its kernel
    is noticed here too)."""
    key = jax.random.key(0, impl=impl)

    def loss(x, w):
        return jnp.sum(mx.dense(x, w, recipe=mx.Recipe(), key=key).astype(jnp.float32))

    with platform_answers(monkeypatch):
        modules = triton_modules(jax.value_and_grad(loss, argnums=(0, 1)), S((2048, 1024), dtype), S((1024, 1536), dtype))
    names = compile_all(modules, tmp_path)
    assert TRAINING_KERNELS <= set(names), f"missing: {TRAINING_KERNELS - set(names)}"
    assert collections.Counter(m["name"] for m in modules)["mxfp4_quantize_columns"] == 3  # W (fprop), X and dY (wgrad)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_quantize_kernels_compile(monkeypatch, tmp_path, dtype):
    """``quantize`` in every scale mode, round to nearest and stochastic (threefry and rbg keys),
    along the last axis (row kernel) and axis 0 (strided-axis kernel)."""
    keys = [jax.random.key(1), jax.random.key(1, impl="rbg")]

    def all_modes(x):
        outs = []
        for mode in ("floor", "ceil", "even", "rceil"):
            for axis in (-1, 0):
                outs.append(mx.quantize(x, axis=axis, scale_mode=mode))
                outs += [mx.quantize(x, axis=axis, scale_mode=mode, rounding="stochastic", key=k) for k in keys]
        return outs

    with platform_answers(monkeypatch):
        modules = triton_modules(all_modes, S((512, 1024), dtype))
    names = compile_all(modules, tmp_path)
    assert names["mxfp4_quantize"] >= 4 and names["mxfp4_quantize_columns"] >= 4, names


@pytest.mark.parametrize("capability", [(7, 5), (8, 0), (8, 9), (9, 0), (10, 0)],
                         ids=["turing", "ampere", "ada", "hopper", "blackwell"])
def test_gemm_kernels_compile_for_each_gpu(monkeypatch, tmp_path, capability):
    """The GEMM programs on each NVIDIA generation, routed as there: w4a16 (plain and
    ``prepare_decode``d weight) and a4w4 at 16 rows, w4a16 at 1024 rows, the FP8 a4w4 GEMM with a
    ``prepare_fp8`` weight (Ada and later), the MoE grouped GEMM, and a training step of ``dense``.
    Where the inline-PTX decode was emitted for GPUs before Hopper (``mul.rn.bf16x2`` needs sm_90),
    ptxas refused every w4a16 and MoE kernel there."""
    w = mx.quantize(jax.random.normal(jax.random.key(0), (1024, 2048), jnp.float32), axis=0)
    experts = mx.quantize(jax.random.normal(jax.random.key(1), (8, 1024, 512), jnp.float32), axis=1)
    decode_w, fp8_w = mx.prepare_decode(w), mx.prepare_fp8(w)
    groups = jnp.array([4, 0, 4, 0, 4, 0, 4, 0], jnp.int32)
    dims = (((1,), (0,)), ((), ()))
    w4a16 = mx.Recipe(quantize_activations=False)
    x16, x1024 = S((16, 1024), jnp.bfloat16), S((1024, 1024), jnp.bfloat16)
    key = jax.random.key(0, impl="rbg")

    def train(x, w_):
        return jnp.sum(mx.dense(x, w_, recipe=mx.Recipe(), key=key))

    programs = [(lambda x: mx.dot_general(x, w, dims, recipe=w4a16), x16),
                (lambda x: mx.dot_general(x, decode_w, dims, recipe=w4a16), x16),
                (lambda x: mx.dot_general(x, w, dims, recipe=mx.Recipe()), x16),
                (lambda x: mx.dot_general(x, w, dims, recipe=w4a16), x1024),
                (lambda x: mx.dot_general(x, fp8_w, dims, recipe=mx.Recipe()), x1024),
                (lambda x: mx.ragged_dot(x, experts, groups, recipe=w4a16), x16),
                (lambda x: mx.ragged_dot(x, experts, groups, recipe=mx.Recipe()), x16)]
    with platform_answers(monkeypatch, capability=capability):
        modules = [m for f, x in programs for m in triton_modules(f, x)]
        modules += triton_modules(jax.value_and_grad(train, argnums=(0, 1)), S((2048, 1024), jnp.float32),
                                  S((1024, 1536), jnp.float32))
    names = compile_all(modules, tmp_path, capability)
    assert "mxfp4_quantize" in names, names
    if capability < (8, 0):  # no bfloat16 tensor cores: the GEMMs take XLA's exact path
        assert not {"mxfp4_wgemm", "mxfp4_grouped_wgemm", "mxfp4_decode_bf16"} & set(names), names
        return
    assert "mxfp4_grouped_wgemm" in names, names
    if capability != (9, 0):  # Hopper runs these on Mosaic GPU kernels, which XLA compiles on a device only
        assert "mxfp4_wgemm" in names, names
    if capability >= (8, 9):  # FP8 tensor cores
        assert {"mxfp4_encode_fp8_rows_swar", "mxfp4_fp8_rescale"} <= set(names), names
