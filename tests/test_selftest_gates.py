"""``python -m jax_mxfp4.selftest``'s hipBLASLt gate table (jax_mxfp4.selftest.hipblaslt_gates): on
the CPU every gate case is judged for a ROCm lowering by the envelope's shape rules; each must land
on the side of its rule, and a broken rule must show up as FAIL (so the table can catch one)."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

from jax_mxfp4 import selftest
from jax_mxfp4.backends import hipblaslt as hb


@pytest.fixture(autouse=True)
def _default_envelope(monkeypatch):
    monkeypatch.delenv(selftest.ENVELOPE_ENV, raising=False)


def test_every_gate_case_lands_on_its_side():
    rows = selftest.hipblaslt_gates("cpu")
    assert len(rows) == len(selftest.GATE_CASES)
    assert [r[3] for r in rows] == ["PASS"] * len(rows), rows
    routed = [r for r in rows if r[1] == "route"]
    assert routed and all(r[2].startswith("routed: ") for r in routed)


def test_a_broken_gate_is_reported_as_fail(monkeypatch):
    monkeypatch.setattr(hb, "shape_reason", lambda *a, **k: None)  # a gate that lets everything in
    rows = selftest.hipblaslt_gates("cpu")
    assert {r[0] for r in rows if r[3] == "FAIL"} == {
        f"{m}x{n}x{k} {layout} {out} [{env}]" for m, n, k, layout, out, env, expect, _ in selftest.GATE_CASES
        if expect == "route"
    }


def test_the_envelope_variable_is_restored(monkeypatch):
    monkeypatch.setenv(selftest.ENVELOPE_ENV, "validated")
    selftest.hipblaslt_gates("cpu")
    import os

    assert os.environ[selftest.ENVELOPE_ENV] == "validated"


# ---- repeats and the TensileLite route (hipBLASLt < 1.5.0 has an upstream fix for intermittent
# non-finite output on gfx950; the route is fixed per process, so it is checked in a subprocess)

def test_repeat_case_runs_every_repeat_and_passes_for_an_exact_backend(monkeypatch):
    calls = []
    real = selftest._gemm_fn

    def counting(recipe, out):
        fn = real(recipe, out)
        return lambda a, b: calls.append(1) or fn(a, b)

    monkeypatch.setattr(selftest, "_gemm_fn", counting)
    status, detail = selftest.repeat_case("xla", 32, 32, 256, "swizzled", "float32")
    assert (status, len(calls)) == ("PASS", selftest.REPEATS) and selftest.REPEATS >= 20
    assert detail.startswith(f"{selftest.REPEATS} runs, every output finite")


@pytest.mark.parametrize("bad,match", [(np.nan, "run 7 of 20: 1 non-finite output"), (1e6, "run 7 of 20: max err/bound")])
def test_repeat_case_fails_naming_the_first_bad_run(monkeypatch, bad, match):
    real = selftest._gemm_fn

    def intermittent(recipe, out):
        fn, count = real(recipe, out), [0]

        def run(a, b):
            count[0] += 1
            got = np.array(fn(a, b))
            if count[0] == 7:  # one element of one run, as an intermittent fault gives
                got[3, 5] = bad
            return got
        return run

    monkeypatch.setattr(selftest, "_gemm_fn", intermittent)
    status, detail = selftest.repeat_case("xla", 32, 32, 256, "swizzled", "float32", runs=20)
    assert status == "FAIL" and detail.startswith(match), detail


def test_the_route_check_runs_in_a_subprocess_with_rocroller_off(monkeypatch):
    seen = {}

    def fake_run(cmd, env, **kw):
        seen.update(cmd=cmd, env=env)
        return subprocess.CompletedProcess(cmd, 0, "64x32x512 swizzled float32 PASS\n", "")

    monkeypatch.setattr(selftest.subprocess, "run", fake_run)
    rc, out = selftest.tensilelite_route_check()
    assert rc == 0 and "PASS" in out
    assert seen["env"]["HIPBLASLT_USE_ROCROLLER"] == "0"
    assert seen["env"]["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"  # the parent holds the GPU's share
    assert seen["cmd"][1:] == ["-m", "jax_mxfp4.selftest", "--route-check"]


TENSILELITE_REFUSAL = "plain scales (VEC32_UE8M0) are refused on hipBLASLt's TensileLite (HIPBLASLT_USE_ROCROLLER=\"0\")"


@pytest.mark.parametrize(
    "plain,swizzled,want",
    [
        (("SKIP", "refused"), ("PASS", "ok"), {"plain": "PASS", "swizzled": "PASS"}),  # refused naming TensileLite
        (("PASS", "ok"), ("PASS", "ok"), {"plain": "PASS", "swizzled": "PASS"}),  # ran, within the bound
        (("FAIL", "max err/bound = 9"), ("PASS", "ok"), {"plain": "FAIL", "swizzled": "PASS"}),  # ran, wrong
        (("SKIP", "refused"), ("FAIL", "max err/bound = 9"), {"plain": "PASS", "swizzled": "FAIL"}),
    ],
)
def test_route_check_rows_judge_plain_and_swizzled(monkeypatch, plain, swizzled, want):
    monkeypatch.setattr(selftest, "check_case", lambda b, m, n, k, layout, out: plain if layout == "plain" else swizzled)

    class Decision:
        reasons = {"hipblaslt": TENSILELITE_REFUSAL}

    monkeypatch.setattr(selftest.dispatch, "decide", lambda problem, backend: Decision)
    rows = selftest.route_check_rows()
    assert len(rows) == 4
    assert {r[0].split()[1]: r[1] for r in rows} == want, rows


def test_route_check_rows_skip_where_hipblaslt_is_unavailable():
    rows = selftest.route_check_rows()  # this CPU machine: no ROCm device
    assert {r[1] for r in rows} == {"SKIP"}, rows
