"""The quickstart example (python examples/quickstart.py) runs as a script against the installed
package, outside the source tree, and reports the product it computed: the MXFP4 GEMM equals the
float64 product of the dequantized operands (backend "xla" on CPU: exact block products, float32
accumulation of small integers times powers of two)."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "examples" / "quickstart.py"


def test_quickstart_runs_as_a_script_and_reports_an_exact_product(tmp_path):
    r = subprocess.run([sys.executable, str(SCRIPT), "--m", "64", "--n", "64", "--k", "256"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "backend 'xla'" in r.stdout
    exact = re.search(r"vs float64 product of MXFP4:\s+([0-9.e+-]+)", r.stdout)
    vs_f32 = re.search(r"vs float32 product:\s+([0-9.e+-]+)", r.stdout)
    assert exact and float(exact.group(1)) < 1e-6, r.stdout
    assert vs_f32 and 0.01 < float(vs_f32.group(1)) < 0.5, r.stdout  # MXFP4's own error: there, and bounded
