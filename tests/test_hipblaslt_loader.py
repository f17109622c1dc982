"""The dlopen loader (xla_ffi/src/hipblaslt_loader.cc): search order, JAX_MXFP4_ROCM_LIB_DIR,
missing libraries and symbols reported (never a crash), and a full load of stand-in libraries
built here with the declared sonames and C symbols, through which hipblaslt_status() reads the
gfx arch from the hipDeviceProp_tR0600 buffer at offset 1160 and the hipBLASLt version.

Each case runs in a subprocess: the libraries are loaded once per process. The TheRock cases lay
the stand-ins out as pip-installed ROCm does (site-packages/_rocm_sdk_core/lib/libamdhip64.so.7,
site-packages/_rocm_sdk_libraries_<family>/lib/libhipblaslt.so.1, each with its dist-info)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

PROBE = """
import json, sys
from jax_mxfp4 import _native
from jax_mxfp4.ffi import registration
st = registration.hipblaslt_status()
st["wheel_dirs"] = registration.rocm_wheel_library_dirs()
if st["loaded"]:
    st["find"] = list(_native.hipblaslt_find_algorithm(0, 32, 32, 256, "bfloat16", "plain"))
    st["find_swizzled"] = list(_native.hipblaslt_find_algorithm(0, 32, 32, 256, "bfloat16", "swizzled"))
print(json.dumps(st))
"""

HIP_SRC = r"""
#include <cstring>
extern "C" {
unsigned hipGetDevice(int* d) { *d = 0; return 0; }
unsigned hipSetDevice(int d) { return d == 0 ? 0 : 101; }
unsigned hipGetDeviceCount(int* c) { *c = 1; return 0; }
unsigned hipGetDevicePropertiesR0600(void* p, int d) {
  char* b = static_cast<char*>(p);
  int major = 9, minor = 5;
  std::memcpy(b + 360, &major, 4);
  std::memcpy(b + 364, &minor, 4);
  std::strcpy(b + 1160, ARCH);
  return 0;
}
unsigned hipDeviceGetAttribute(int* v, unsigned a, int d) { *v = a == 23 ? 9 : 5; return 0; }
unsigned hipRuntimeGetVersion(int* v) { *v = 70100000; return 0; }
unsigned hipMemsetAsync(void* p, int v, size_t n, void*) { std::memset(p, v, n); return 0; }
const char* hipGetErrorString(unsigned e) { return "stand-in"; }
}
"""

BLAS_SRC = r"""
#include <cstring>
#include <cstdint>
#include <cstddef>
struct Algo { uint8_t data[16]; size_t max_ws; };
struct Result { Algo algo; size_t ws; unsigned state; float waves; int reserved[4]; };
static uint64_t objects[64];
static int next_object = 0;
extern "C" {
unsigned hipblasLtCreate(void** h) { *h = &objects[next_object++ % 64]; return 0; }
unsigned hipblasLtDestroy(void*) { return 0; }
unsigned hipblasLtGetVersion(void*, int* v) { *v = VERSION; return 0; }
unsigned hipblasLtMatmulDescCreate(void** d, unsigned, unsigned) { *d = &objects[next_object++ % 64]; return 0; }
unsigned hipblasLtMatmulDescDestroy(void*) { return 0; }
unsigned hipblasLtMatmulDescSetAttribute(void*, unsigned, const void*, size_t) { return 0; }
unsigned hipblasLtMatrixLayoutCreate(void** l, unsigned, uint64_t, uint64_t, int64_t) { *l = &objects[next_object++ % 64]; return 0; }
unsigned hipblasLtMatrixLayoutDestroy(void*) { return 0; }
unsigned hipblasLtMatmulPreferenceCreate(void** p) { *p = &objects[next_object++ % 64]; return 0; }
unsigned hipblasLtMatmulPreferenceDestroy(void*) { return 0; }
unsigned hipblasLtMatmulPreferenceSetAttribute(void*, unsigned, const void*, size_t) { return 0; }
unsigned hipblasLtMatmulAlgoGetHeuristic(void*, void*, void*, void*, void*, void*, void*, int n, Result* r, int* got) {
  std::memset(r, 0, sizeof(Result)); r[0].ws = 0; *got = 1; return 0; }
#ifndef OMIT_MATMUL
unsigned hipblasLtMatmul(void*, void*, const void*, const void*, void*, const void*, void*, const void*,
                         const void*, void*, void*, void*, const void*, void*, size_t, void*) { return 0; }
#endif
}
"""


def probe(env_updates, preload=()):
    """hipblaslt_status() in a fresh process; ``preload``: libraries loaded first (RTLD_GLOBAL), as
    another library of the process (a JAX plugin) would have loaded them."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_MXFP4_ROCM_LIB_DIR", "ROCM_PATH")}
    env.update(env_updates)
    # The package as the tests import it (installed, or the source tree via PYTHONPATH).
    import jax_mxfp4

    pkg_parent = os.path.dirname(os.path.dirname(jax_mxfp4.__file__))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), pkg_parent) if p)
    code = "".join(f"import ctypes; ctypes.CDLL({str(p)!r}, mode=ctypes.RTLD_GLOBAL)\n" for p in preload) + PROBE
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         cwd="/")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def build(tmp_path, arch="gfx950:sramecc+:xnack-", version=100300, omit_matmul=False, hip_dir=None, blas_dir=None):
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler to build the stand-in libraries")
    hip_dir, blas_dir = hip_dir or tmp_path, blas_dir or tmp_path
    for d in (hip_dir, blas_dir):
        d.mkdir(parents=True, exist_ok=True)
    (tmp_path / "hip.cc").write_text(HIP_SRC)
    (tmp_path / "blas.cc").write_text(BLAS_SRC)
    common = [cxx, "-shared", "-fPIC", "-O0"]
    subprocess.run(common + [f'-DARCH="{arch}"', "-o", str(hip_dir / "libamdhip64.so.7"), str(tmp_path / "hip.cc")], check=True)
    extra = ["-DOMIT_MATMUL"] if omit_matmul else []
    subprocess.run(common + extra + [f"-DVERSION={version}", "-o", str(blas_dir / "libhipblaslt.so.1"), str(tmp_path / "blas.cc")], check=True)
    return tmp_path


def therock_site(tmp_path, family="gfx950"):
    """A site-packages with TheRock's layout: two packages, their dist-info, the libraries in lib/."""
    site = tmp_path / "site-packages"
    packages = {"rocm_sdk_core": "_rocm_sdk_core", f"rocm_sdk_libraries_{family}": f"_rocm_sdk_libraries_{family}"}
    for dist, top in packages.items():
        (site / top).mkdir(parents=True)
        (site / top / "__init__.py").write_text("")
        info = site / f"{dist}-7.10.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist.replace('_', '-')}\nVersion: 7.10.0\n")
        (info / "top_level.txt").write_text(top + "\n")
        (info / "RECORD").write_text(f"{top}/__init__.py,,\n")
    core, libs = site / "_rocm_sdk_core" / "lib", site / f"_rocm_sdk_libraries_{family}" / "lib"
    build(tmp_path, hip_dir=core, blas_dir=libs)
    return site, core, libs


def test_missing_libraries_are_reported_with_the_search_order(tmp_path):
    st = probe({"ROCM_PATH": str(tmp_path / "rocm")})
    assert st["loaded"] is False and st["devices"] == []
    searched = st["searched"].split("; ")
    assert searched[0] == "libamdhip64.so.7 (already loaded?)"
    assert searched[1:3] == ["libamdhip64.so.7", "libamdhip64.so"]
    assert searched[3:] == [f"{tmp_path}/rocm/lib/libamdhip64.so.7", f"{tmp_path}/rocm/lib/libamdhip64.so",
                            "/opt/rocm/lib/libamdhip64.so.7", "/opt/rocm/lib/libamdhip64.so"]
    assert "JAX_MXFP4_ROCM_LIB_DIR" in st["error"]


def test_env_dir_is_the_only_location_tried(tmp_path):
    st = probe({"JAX_MXFP4_ROCM_LIB_DIR": str(tmp_path)})
    assert st["loaded"] is False
    assert st["searched"] == f"{tmp_path}/libamdhip64.so.7; {tmp_path}/libamdhip64.so"


def test_stand_in_libraries_load_and_report_arch_and_version(tmp_path):
    d = build(tmp_path)
    st = probe({"JAX_MXFP4_ROCM_LIB_DIR": str(d)})
    assert st["loaded"] is True, st["error"]
    assert st["hip_path"] == f"{d}/libamdhip64.so.7" and st["hipblaslt_path"] == f"{d}/libhipblaslt.so.1"
    (dev,) = st["devices"]
    assert (dev["arch"], dev["hipblaslt_version"], dev["hip_runtime_version"], dev["error"]) == ("gfx950", 100300, 70100000, "")
    # The stand-in hipBLASLt links no librocroller: TensileLite route, where plain scales are refused.
    assert st["find"][0] is False and "refused on hipBLASLt's TensileLite" in st["find"][1]
    assert st["find_swizzled"] == [True, ""]


def test_stand_in_with_another_arch_and_old_version_is_gated(tmp_path):
    d = build(tmp_path, arch="gfx942:sramecc+:xnack-", version=100202)
    st = probe({"JAX_MXFP4_ROCM_LIB_DIR": str(d)})
    assert st["loaded"] is True
    assert st["devices"][0]["arch"] == "gfx942"
    assert st["find"][0] is False and "needs a gfx950 GPU" in st["find"][1]


def test_missing_symbol_is_named(tmp_path):
    d = build(tmp_path, omit_matmul=True)
    st = probe({"JAX_MXFP4_ROCM_LIB_DIR": str(d)})
    assert st["loaded"] is False
    assert "lack the symbols: hipblasLtMatmul" in st["error"]


def test_therock_wheels_are_found_after_the_env_dir_and_before_system_paths(tmp_path):
    site, core, libs = therock_site(tmp_path)
    st = probe({"PYTHONPATH": str(site), "ROCM_PATH": str(tmp_path / "rocm")})
    assert st["wheel_dirs"] == [str(core), str(libs)]
    assert st["loaded"] is True, st["error"]
    assert st["hip_path"] == f"{core}/libamdhip64.so.7" and st["hipblaslt_path"] == f"{libs}/libhipblaslt.so.1"
    hip_searched = st["searched"].split(" | ")[0].split("; ")
    # already loaded?, then the wheels (core first), and no system path was needed.
    assert hip_searched == ["libamdhip64.so.7 (already loaded?)", f"{core}/libamdhip64.so.7"]
    blas_searched = st["searched"].split(" | ")[1].split("; ")
    assert blas_searched[:4] == ["libhipblaslt.so.1 (already loaded?)", f"{core}/libhipblaslt.so.1",
                                 f"{core}/libhipblaslt.so", f"{libs}/libhipblaslt.so.1"]
    assert st["find_swizzled"] == [True, ""]
    # The stand-in hipBLASLt links no librocroller: the route is reported, and assumed TensileLite.
    assert st["rocroller_path"] == "" and "TensileLite" in st["devices"][0]["route"]


def test_env_dir_still_wins_over_therock_wheels(tmp_path):
    site, core, libs = therock_site(tmp_path)
    other = build(tmp_path / "env")
    st = probe({"PYTHONPATH": str(site), "JAX_MXFP4_ROCM_LIB_DIR": str(other)})
    assert st["loaded"] is True and st["hip_path"] == f"{other}/libamdhip64.so.7"
    assert str(core) not in st["searched"]


def test_no_wheels_no_wheel_dirs(tmp_path):
    st = probe({"ROCM_PATH": str(tmp_path / "rocm")})
    assert st["wheel_dirs"] == [] and "_rocm_sdk" not in st["searched"]


@pytest.mark.parametrize("env,route", [({}, "rocRoller"), ({"HIPBLASLT_USE_ROCROLLER": "0"}, "TensileLite")])
def test_a_librocroller_loaded_with_hipblaslt_is_seen(tmp_path, env, route):
    # A stand-in hipBLASLt that links a stand-in librocroller (as rocRoller builds link it): the
    # loader sees it in the process, so the route is rocRoller unless HIPBLASLT_USE_ROCROLLER
    # (read as hipBLASLt reads it) turns rocRoller off.
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler to build the stand-in libraries")
    (tmp_path / "rr.cc").write_text('extern "C" int rocroller_stand_in() { return 1; }\n')
    subprocess.run([cxx, "-shared", "-fPIC", "-o", str(tmp_path / "librocroller.so.1"), str(tmp_path / "rr.cc")], check=True)
    (tmp_path / "hip.cc").write_text(HIP_SRC)
    (tmp_path / "blas.cc").write_text(BLAS_SRC)
    common = [cxx, "-shared", "-fPIC", "-O0"]
    subprocess.run(common + ['-DARCH="gfx950:sramecc+:xnack-"', "-o", str(tmp_path / "libamdhip64.so.7"),
                             str(tmp_path / "hip.cc")], check=True)
    subprocess.run(common + ["-DVERSION=100300", "-o", str(tmp_path / "libhipblaslt.so.1"), str(tmp_path / "blas.cc"),
                             "-Wl,--no-as-needed", f"-L{tmp_path}", "-l:librocroller.so.1", "-Wl,-rpath,$ORIGIN"],
                   check=True)
    st = probe({"JAX_MXFP4_ROCM_LIB_DIR": str(tmp_path), **env})
    assert st["loaded"] is True, st["error"]
    assert st["rocroller_path"] == f"{tmp_path}/librocroller.so.1"
    assert st["devices"][0]["route"].startswith(route), st["devices"][0]["route"]


def _shared(cxx, src, out, *extra):
    subprocess.run([cxx, "-shared", "-fPIC", "-O0", *extra, "-o", str(out), str(src)], check=True)


def test_hipblaslt_comes_from_the_directory_hip_came_from_when_hip_is_not_a_wheel(tmp_path):
    # HIP already loaded from a system install (as a JAX ROCm plugin may load it), a TheRock wheel
    # installed too: hipBLASLt must come from HIP's own installation, not from the wheel, or the
    # process mixes two ROCm installations.
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler to build the stand-in libraries")
    site, core, libs = therock_site(tmp_path)
    system = tmp_path / "system" / "lib"
    system.mkdir(parents=True)
    _shared(cxx, tmp_path / "hip.cc", system / "libamdhip64.so.7", '-DARCH="gfx950:sramecc+:xnack-"',
            "-Wl,-soname,libamdhip64.so.7")
    _shared(cxx, tmp_path / "blas.cc", system / "libhipblaslt.so.1", "-DVERSION=100300")
    st = probe({"PYTHONPATH": str(site), "ROCM_PATH": str(tmp_path / "rocm")}, preload=[system / "libamdhip64.so.7"])
    assert st["loaded"] is True, st["error"]
    assert st["hip_path"] == f"{system}/libamdhip64.so.7"
    assert st["hipblaslt_path"] == f"{system}/libhipblaslt.so.1", st["searched"]


def test_hip_from_a_wheel_still_takes_hipblaslt_from_the_wheels(tmp_path):
    site, core, libs = therock_site(tmp_path)
    st = probe({"PYTHONPATH": str(site), "ROCM_PATH": str(tmp_path / "rocm")})
    assert st["hip_path"] == f"{core}/libamdhip64.so.7" and st["hipblaslt_path"] == f"{libs}/libhipblaslt.so.1"


def test_a_librocroller_loaded_by_something_else_does_not_make_the_route_rocroller(tmp_path):
    # hipBLASLt built without rocRoller (no librocroller among its own dependencies) in a process
    # where another library pulled in a librocroller: the route is TensileLite.
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler to build the stand-in libraries")
    d = build(tmp_path)
    (tmp_path / "rr.cc").write_text('extern "C" int rocroller_stand_in() { return 1; }\n')
    (tmp_path / "other").mkdir()
    _shared(cxx, tmp_path / "rr.cc", tmp_path / "other" / "librocroller.so.1")
    st = probe({"JAX_MXFP4_ROCM_LIB_DIR": str(d)}, preload=[tmp_path / "other" / "librocroller.so.1"])
    assert st["loaded"] is True, st["error"]
    assert st["rocroller_path"] == ""
    assert st["devices"][0]["route"].startswith("TensileLite"), st["devices"][0]["route"]
