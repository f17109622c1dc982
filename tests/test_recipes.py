"""The recipe sweep example (python examples/recipes.py): a quick run writes the JSON, table and
plot, each gap computed from the two eval losses; an --out that names a file is refused before
any training."""

from __future__ import annotations

import json
import math

import pytest

import recipes


def _finite_positive(*xs):
    return all(isinstance(x, (int, float)) and math.isfinite(x) and x > 0 for x in xs)


@pytest.mark.slow  # the recipe sweep application (examples/), not the library
def test_quick_run_writes_json_table_and_plot(tmp_path):
    assert recipes.main(["--quick", "--recipes", "default", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "recipes_small_seed0.json").read_text())
    bf = res["bf16"]
    assert bf["measured"] and set(res["runs"]) == {"default"}
    for r in [bf, *res["runs"].values()]:
        assert _finite_positive(r["eval_loss"], r["train_loss"], r["wall_s"], r["tokens_per_s"])
    for r in res["runs"].values():
        assert r["gap_pct"] == pytest.approx(100 * (r["eval_loss"] - bf["eval_loss"]) / bf["eval_loss"])
    assert "| default |" in (tmp_path / "recipes_small_seed0.md").read_text()
    with open(tmp_path / "recipes_small_seed0.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_out_that_names_a_file_is_refused(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(SystemExit, match="--out must name a folder"):
        recipes.main(["--quick", "--recipes", "default", "--out", str(afile)])
