"""benchmarks/sharded.py --quick runs on CPU (8 simulated devices) and writes its table, JSON and PNG."""

import json
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def test_sharded_benchmark_quick_writes_files(tmp_path):
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "sharded.py"), "--quick", "--out", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "sharded.json").read_text())
    rows = {(r["variant"], r["step"]): r for r in data["rows"]}
    assert set(rows) == {(v, s) for v in ("bf16", "mxfp4") for s in ("fprop", "train")}
    assert all(r["devices"] == 8 and r["single_s"] > 0 and r["tp-row_s"] > 0 for r in rows.values())
    assert "| train | tp-row |" in (tmp_path / "sharded.md").read_text()
    assert (tmp_path / "sharded.png").stat().st_size > 1000
