"""Finds, or builds, the test-only extension ``_hipblaslt_double``: the hipBLASLt call path of
``xla_ffi/src/hipblaslt_gemm.cc`` linked against the recording double of hipBLASLt + HIP
(``xla_ffi/src/fake_hipblaslt.cc``). The shipped ``jax_mxfp4._native`` never contains the double.

How it gets built: the same CMake project builds it next to ``_native`` (option
``JAX_MXFP4_BUILD_TEST_DOUBLE``, default ON) but never installs it, so ``pip install ".[test]"``
leaves it in the project's scikit-build directory ``build/<wheel tag>/`` (pyproject.toml
``build-dir``), where CI then runs ``pytest -q tests``. Search order:

1. ``$JAX_MXFP4_TEST_DOUBLE_DIR`` (a directory holding the module), if set;
2. ``build/*/`` under the repository root, the most recently built copy;
3. otherwise it is built here with CMake into ``build/test-double/`` (needs cmake, a C++17
   compiler, jax and nanobind importable); if that is impossible the tests fail with the reason.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig

ROOT = pathlib.Path(__file__).resolve().parent.parent
NAME = "_hipblaslt_double"
SUFFIX = sysconfig.get_config_var("EXT_SUFFIX") or ".so"


def _candidates():
    env = os.environ.get("JAX_MXFP4_TEST_DOUBLE_DIR")
    if env:
        return [pathlib.Path(env) / (NAME + SUFFIX)]
    found = [pathlib.Path(p) for p in glob.glob(str(ROOT / "build" / "*" / (NAME + SUFFIX)))]
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def _build() -> pathlib.Path:
    cmake = shutil.which("cmake")
    if cmake is None:
        raise RuntimeError("cmake is not on PATH")
    out = ROOT / "build" / "test-double"
    nb_dir = subprocess.run([sys.executable, "-m", "nanobind", "--cmake_dir"], capture_output=True, text=True)
    if nb_dir.returncode != 0:
        raise RuntimeError(f"nanobind is not importable ({nb_dir.stderr.strip().splitlines()[-1:]})")
    cfg = [cmake, "-S", str(ROOT / "xla_ffi"), "-B", str(out), f"-DPython_EXECUTABLE={sys.executable}",
           f"-Dnanobind_DIR={nb_dir.stdout.strip()}", "-DCMAKE_BUILD_TYPE=Release"]
    for cmd in (cfg, [cmake, "--build", str(out), "--target", NAME, "-j2"]):
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return out / (NAME + SUFFIX)


def load():
    """The ``_hipblaslt_double`` module; raises RuntimeError saying why it cannot be had."""
    if NAME in sys.modules:
        return sys.modules[NAME]
    paths = [p for p in _candidates() if p.exists()]
    if not paths:
        try:
            paths = [_build()]
        except (RuntimeError, OSError) as e:
            raise RuntimeError(
                f"the test-only module {NAME} was not found under {ROOT / 'build'} and could not be "
                f"built ({e}); run `pip install .` from the repository root (it builds it into "
                f"build/<wheel tag>/) or set JAX_MXFP4_TEST_DOUBLE_DIR"
            ) from e
    spec = importlib.util.spec_from_file_location(NAME, paths[0])
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.modules[NAME] = mod
    return mod
