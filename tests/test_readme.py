"""README.md stays runnable: every ```python block runs (each on its own, on CPU, in seconds),
the file stays at most 350 lines, its relative links point to existing files, every
``python -m jax_mxfp4.X`` it names is an importable module and every ``python examples/X.py`` or
``python benchmarks/X.py`` an existing script."""

from __future__ import annotations

import importlib.util
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
TEXT = README.read_text(encoding="utf-8")

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def blocks(lang: str) -> list[str]:
    return [body for tag, body in FENCE.findall(TEXT) if tag == lang]


PYTHON_BLOCKS = blocks("python")


def test_readme_is_short():
    assert len(TEXT.splitlines()) <= 350


def test_readme_has_python_blocks():
    assert len(PYTHON_BLOCKS) >= 5


@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)))
def test_python_block_runs(index):
    code = PYTHON_BLOCKS[index]
    exec(compile(code, f"README.md python block {index}", "exec"), {"__name__": f"readme_block_{index}"})


def test_relative_links_exist():
    links = re.findall(r"\]\(([^)\s]+)\)", TEXT)
    missing = []
    for link in links:
        if re.match(r"^[a-z][a-z0-9+.-]*:", link) or link.startswith("#"):
            continue  # URL or in-page anchor
        path = link.split("#", 1)[0]
        if not (ROOT / path).exists():
            missing.append(link)
    assert not missing, f"README.md links to missing files: {missing}"


def test_named_modules_and_scripts_exist():
    shell = "\n".join(blocks("bash")) + "\n" + TEXT
    modules = set(re.findall(r"python3? (?:-\w+ )*-m (jax_mxfp4[\w.]*)", shell))
    missing = [m for m in sorted(modules) if importlib.util.find_spec(m) is None]
    assert not missing, f"README.md names modules that do not exist: {missing}"
    scripts = set(re.findall(r"python3? (?:-\w+ )*((?:examples|benchmarks)/[\w/]+\.py)", shell))
    assert "examples/train_lm.py" in scripts  # the main job
    missing = [p for p in sorted(scripts) if not (ROOT / p).is_file()]
    assert not missing, f"README.md names scripts that do not exist: {missing}"
