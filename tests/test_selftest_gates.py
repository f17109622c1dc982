"""``python -m jax_mxfp4.selftest``'s hipBLASLt gate table (jax_mxfp4.selftest.hipblaslt_gates): on
the CPU every gate case is judged for a ROCm lowering by the envelope's shape rules; each must land
on the side of its rule, and a broken rule must show up as FAIL (so the table can catch one)."""

from __future__ import annotations

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
