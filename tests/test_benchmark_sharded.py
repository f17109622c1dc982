"""benchmarks/sharded.py --quick on CPU (the simulated devices of tests/conftest.py) writes its
table, JSON and PNG; every timing finite and positive."""

import json
import math
import os
import sys

import jax
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks import sharded  # noqa: E402


@pytest.mark.slow  # a whole benchmark program on 8 simulated devices
def test_sharded_quick(tmp_path):
    assert sharded.main(["--quick", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "sharded.json").read_text())
    rows = {(r["variant"], r["step"]): r for r in data["rows"]}
    assert set(rows) == {(v, s) for v in ("bf16", "mxfp4") for s in ("fprop", "train")}
    ndev = min(len(jax.devices()), sharded.QUICK_DEVICES)
    for r in rows.values():
        assert r["devices"] == ndev and (r["t"], r["k"], r["n"]) == sharded.QUICK_SHAPE
        times = [r["single_s"]] + [r[f"{name}_s"] for name in sharded.LAYOUTS]
        assert all(math.isfinite(t) and t > 0 for t in times), r
    assert "| train | tp-row |" in (tmp_path / "sharded.md").read_text()
    with open(tmp_path / "sharded.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
