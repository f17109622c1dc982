"""Python-side routing of backend "hipblaslt" (jax_mxfp4/backends/hipblaslt.py) with the platform,
the library status and the heuristic answer substituted, so the ROCm decisions run on the CPU:
"auto" picks hipblaslt on gfx950 for supported shapes and routes everything else with a reason."""

from __future__ import annotations

import numpy as np
import pytest

from jax_mxfp4 import dispatch
from jax_mxfp4.backends import hipblaslt as hb
from jax_mxfp4.backends.base import GemmProblem
from jax_mxfp4.ffi import registration

GFX950 = {"loaded": True, "error": "", "devices": [
    {"ordinal": 0, "arch": "gfx950", "hipblaslt_version": 100300, "hip_runtime_version": 70100000, "error": ""}]}


class FakeNative:
    def __init__(self, ok=True, why=""):
        self.calls = []
        self.ok, self.why = ok, why

    def hipblaslt_find_algorithm(self, device, m, n, k, out_dtype, scale_layout):
        self.calls.append((device, m, n, k, out_dtype, scale_layout))
        return self.ok, self.why


@pytest.fixture
def rocm(monkeypatch):
    def setup(status=GFX950, native=None):
        native = native or FakeNative()
        monkeypatch.setattr(hb, "current_platform", lambda: "rocm")
        monkeypatch.setattr(registration, "hipblaslt_status", lambda: status)
        monkeypatch.setattr(registration, "native", lambda: native)
        return native
    return setup


def problem(m=64, n=32, k=256, out=np.float32, layout="plain", **kw):
    return GemmProblem(1, m, n, k, np.dtype(out), layout, "rocm", **kw)


def test_auto_picks_hipblaslt_on_gfx950(rocm):
    native = rocm()
    d = dispatch.decide(problem(), "auto")
    assert d.backend == "hipblaslt"
    assert native.calls == [(0, 64, 32, 256, "float32", "plain")]


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"m": 24}, "M % 16 == 0"),
        ({"n": 8}, "N % 16 == 0"),
        ({"k": 96}, "K % 128 == 0"),
        ({"lhs_kind": "float"}, "two MXFP4 operands"),
    ],
)
def test_unsupported_shapes_are_routed_with_the_rule(rocm, kw, match):
    native = rocm()
    d = dispatch.decide(problem(**kw), "auto")
    assert d.backend != "hipblaslt" and match in d.reasons["hipblaslt"]
    assert native.calls == []  # no heuristic for shapes the rules already exclude
    with pytest.raises(dispatch.BackendUnavailableError, match=match):
        dispatch.decide(problem(**kw), "hipblaslt")


def test_empty_heuristic_routes_float16(rocm):
    rocm(native=FakeNative(False, "hipblasLtMatmulAlgoGetHeuristic returned no usable algorithm"))
    d = dispatch.decide(problem(out=np.float16), "auto")
    assert d.backend != "hipblaslt" and "no usable algorithm" in d.reasons["hipblaslt"]


def test_swizzled_needs_hipblaslt_1_3(rocm):
    old = {**GFX950, "devices": [{**GFX950["devices"][0], "hipblaslt_version": 100202}]}
    rocm(status=old)
    assert dispatch.decide(problem(layout="plain"), "auto").backend == "hipblaslt"
    d = dispatch.decide(problem(layout="swizzled"), "auto")
    assert d.backend != "hipblaslt" and "need hipBLASLt >= 1.3" in d.reasons["hipblaslt"] and "1.2.2" in d.reasons["hipblaslt"]


@pytest.mark.parametrize(
    "status,match",
    [
        ({**GFX950, "devices": [{**GFX950["devices"][0], "arch": "gfx942"}]}, "needs gfx950.*gfx942"),
        ({**GFX950, "devices": [{**GFX950["devices"][0], "hipblaslt_version": 1100}]}, "no FP4 support"),
        ({"loaded": False, "error": "could not dlopen the HIP runtime", "devices": []}, "ROCm libraries unavailable"),
        ({"loaded": True, "error": "", "devices": []}, "no HIP device"),
    ],
)
def test_unavailable_reasons(rocm, status, match):
    rocm(status=status)
    d = dispatch.decide(problem(), "auto")
    assert d.backend != "hipblaslt"
    assert pytest.importorskip("re").search(match, d.reasons["hipblaslt"]), d.reasons["hipblaslt"]
