"""Python-side routing of backend "hipblaslt" (jax_mxfp4/backends/hipblaslt.py) with the platform,
the library status and the heuristic answer substituted, so the ROCm decisions run on the CPU:
"auto" picks hipblaslt on gfx950 for supported shapes and routes everything else with a reason."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jax_mxfp4 import dispatch
from jax_mxfp4.backends import hipblaslt as hb
from jax_mxfp4.backends.base import GemmProblem
from jax_mxfp4.ffi import registration

GFX950 = {"loaded": True, "error": "", "devices": [
    {"ordinal": 0, "arch": "gfx950", "hipblaslt_version": 100300, "hip_runtime_version": 70100000, "error": ""}]}


REAL = registration.native()


class FakeNative:
    """Stands in for the heuristic only; the envelope's shape rules are the real C++ ones."""

    def __init__(self, ok=True, why=""):
        self.calls = []
        self.ok, self.why = ok, why

    def hipblaslt_check_shape(self, m, n, k, out_dtype, envelope):
        return REAL.hipblaslt_check_shape(m, n, k, out_dtype, envelope)

    def hipblaslt_find_algorithm(self, device, m, n, k, out_dtype, scale_layout):
        self.calls.append((device, m, n, k, out_dtype, scale_layout))
        return self.ok, self.why


@pytest.fixture
def rocm(monkeypatch):
    def setup(status=GFX950, native=None):
        native = native or FakeNative()
        monkeypatch.setattr(hb, "current_platform", lambda: "rocm")
        monkeypatch.setattr(dispatch, "current_platform", lambda: "rocm")
        monkeypatch.setattr(registration, "hipblaslt_status", lambda: status)
        monkeypatch.setattr(registration, "native", lambda: native)
        return native
    return setup


@pytest.fixture(autouse=True)
def _validated_envelope(monkeypatch):
    monkeypatch.delenv(hb.ENVELOPE_ENV, raising=False)


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
        ({"m": 48}, "M % 32 == 0"),
        ({"n": 16}, "N % 32 == 0"),
        ({"k": 384}, "K % 256 == 0"),
        ({"out": np.float16}, "float32 or bfloat16, not float16"),
        ({"lhs_kind": "float"}, "two MXFP4 operands"),
    ],
)
def test_outside_the_validated_envelope_is_routed_with_the_rule(rocm, kw, match):
    native = rocm()
    d = dispatch.decide(problem(**kw), "auto")
    assert d.backend != "hipblaslt" and match in d.reasons["hipblaslt"]
    assert native.calls == []  # no heuristic for shapes the rules already exclude
    with pytest.raises(dispatch.BackendUnavailableError, match=match):
        dispatch.decide(problem(**kw), "hipblaslt")


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"m": 24}, "M % 16 == 0"),
        ({"n": 8}, "N % 16 == 0"),
        ({"k": 96}, "K % 128 == 0"),
    ],
)
def test_documented_envelope_is_opt_in(rocm, monkeypatch, kw, match):
    monkeypatch.setenv(hb.ENVELOPE_ENV, "documented")
    native = rocm()
    wider = problem(m=48, n=16, k=384, out=np.float16)  # refused by default, taken when opted in
    assert dispatch.decide(wider, "auto").backend == "hipblaslt"
    assert native.calls == [(0, 48, 16, 384, "float16", "plain")]
    d = dispatch.decide(problem(**kw), "auto")
    assert d.backend != "hipblaslt" and match in d.reasons["hipblaslt"]


def test_bad_envelope_value_routes_away_with_the_reason(rocm, monkeypatch):
    monkeypatch.setenv(hb.ENVELOPE_ENV, "everything")
    rocm()
    d = dispatch.decide(problem(), "auto")
    assert d.backend != "hipblaslt" and "JAX_MXFP4_HIPBLASLT_ENVELOPE must be" in d.reasons["hipblaslt"]


def test_empty_heuristic_routes_away(rocm):
    rocm(native=FakeNative(False, "hipblasLtMatmulAlgoGetHeuristic returned no usable algorithm"))
    d = dispatch.decide(problem(out=jnp.bfloat16), "auto")
    assert d.backend != "hipblaslt" and "no usable algorithm" in d.reasons["hipblaslt"]


def test_version_and_route_gates_come_from_the_handler(rocm):
    # The C++ gates (hipBLASLt version per envelope and layout, TensileLite route) answer through
    # hipblaslt_find_algorithm; their cases run against the recording double in
    # test_hipblaslt_double.py. Here: their reason reaches explain() unchanged.
    why = "swizzled scales (BLK32_UE8M0_32_8_EXT) need hipBLASLt >= 1.3.0, found 1.2.2"
    rocm(native=FakeNative(False, why))
    d = dispatch.decide(problem(layout="swizzled"), "auto")
    assert d.backend != "hipblaslt" and d.reasons["hipblaslt"] == why


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


def test_on_cpu_rocm_gets_its_own_choice_without_loading_rocm(monkeypatch):
    # Judged for a platform this process does not run: shape rules only, no dlopen, no heuristic.
    def boom():
        raise AssertionError("ROCm libraries must not be loaded to decide for another platform")

    monkeypatch.setattr(registration, "hipblaslt_status", boom)
    cpu = GemmProblem(1, 64, 32, 256, np.dtype(np.float32), "plain", "cpu")
    d = dispatch.plan(cpu, "auto")
    assert d.backend == "xla" and d.per_platform["cpu"] == "xla" and d.per_platform["rocm"] == "hipblaslt"
    odd = dispatch.plan(GemmProblem(1, 64, 32, 384, np.dtype(np.float32), "plain", "cpu"), "auto")
    assert odd.per_platform["rocm"] != "hipblaslt"
    explicit = dispatch.plan(cpu, "hipblaslt")  # runs nowhere here, but lowers for rocm
    assert explicit.backend == "hipblaslt" and explicit.per_platform == {"default": "hipblaslt"}


@pytest.mark.parametrize(
    "m,n,k,envelope,expected",
    [
        (65, 64, 256, "", "got M=65 N=64 K=256 (JAX_MXFP4_HIPBLASLT_ENVELOPE=documented"),
        (-33, 2**40 + 1, 512, "validated", "got M=-33 N=1099511627777 K=512"),
        (24, 16, 128, "documented", "documented envelope); got M=24 N=16 K=128"),
    ],
)
def test_envelope_message_states_the_numbers_it_was_given(m, n, k, envelope, expected):
    # The native messages format integers without iostreams (xla_ffi/include/jax_mxfp4/str_cat.h);
    # this checks the numbers survive, negative and beyond 32 bits included.
    ok, why = REAL.hipblaslt_check_shape(m, n, k, "float32", envelope)
    assert not ok and expected in why


def test_native_sources_build_messages_without_iostreams():
    # An ostream's number formatting crashed in a module with a statically linked libstdc++ once
    # another library in the process had registered locale facets (NVIDIA H200, after Triton).
    import pathlib
    root = pathlib.Path(__file__).resolve().parents[1] / "xla_ffi"
    offenders = [str(p.relative_to(root)) for p in sorted(root.rglob("*")) if p.suffix in (".cc", ".h")
                 and p.name != "str_cat.h" and any(w in p.read_text() for w in ("<sstream>", "<iostream>", "ostringstream"))]
    assert offenders == []
