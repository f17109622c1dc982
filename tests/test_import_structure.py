"""Import structure of the package: platform detection lives in one module that imports nothing
from jax_mxfp4, no import cycle (counting imports inside functions too) runs through
``array``, ``checks``, ``quantize``, ``dispatch`` or the ``backends``, and the applications in
examples/ stay outside the package."""

from __future__ import annotations

import ast
import pathlib

import jax_mxfp4

PKG = pathlib.Path(jax_mxfp4.__file__).resolve().parent
CORE = ("jax_mxfp4.array", "jax_mxfp4.checks", "jax_mxfp4.quantize", "jax_mxfp4.dispatch", "jax_mxfp4.backends")


def _module_name(path: pathlib.Path) -> str:
    parts = ("jax_mxfp4",) + path.relative_to(PKG).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph():
    modules = {_module_name(p): p for p in PKG.rglob("*.py")}
    edges = {m: set() for m in modules}
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):  # every import, also inside functions
            targets = []
            if isinstance(node, ast.ImportFrom):
                base = name if is_pkg else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                mod = (f"{base}.{node.module}" if node.module else base) if node.level else (node.module or "")
                targets.append(mod)
                targets += [f"{mod}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets += [a.name for a in node.names]
            for t in targets:
                # The root package is always initialised before its submodules: not an edge.
                if t in modules and t != "jax_mxfp4" and t != name:
                    edges[name].add(t)
    return edges


def _cycles_through(edges, start):
    """A path start -> ... -> start, or None."""
    stack, seen = [(start, [start])], set()
    while stack:
        node, path = stack.pop()
        for nxt in edges[node]:
            if nxt == start:
                return path + [start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, path + [nxt]))
    return None


def test_no_import_cycle_through_the_core_modules():
    edges = _graph()
    core = [m for m in edges if m.startswith(CORE)]
    assert len(core) >= 10
    cycles = {m: _cycles_through(edges, m) for m in core}
    assert {m: c for m, c in cycles.items() if c} == {}


def test_no_import_cycle_anywhere_in_the_package():
    edges = _graph()
    cycles = {m: _cycles_through(edges, m) for m in edges}
    assert {m: c for m, c in cycles.items() if c} == {}


# The layers of docs/design.md, lowest first: a module imports only from its own layer or below.
LAYERS = [
    ("format", ("platform", "errors", "mx_format", "fp8_format", "layout", "checks", "pytree", "array", "hadamard")),
    ("kernels", ("kernels",)),
    ("quantize", ("quantize", "differentiation", "recipe", "dims", "sharding")),
    ("serving forms", ("prepared", "decode_prepared", "fp8_prepared", "weight_record", "serialization")),
    ("backends", ("ffi", "backends", "dispatch", "partitioning")),
    ("gemm", ("gemm",)),
    ("differentiable", ("training", "einsum", "group_blocks", "ragged", "experts")),
    ("integrations", ("flax", "qwix", "checkpoint", "selftest")),
]


def _layer(module: str) -> int:
    short = module.removeprefix("jax_mxfp4.")
    for i, (_, names) in enumerate(LAYERS):
        if any(short == n or short.startswith(n + ".") for n in names):
            return i
    raise AssertionError(f"{module} is in no layer of LAYERS")


def test_imports_run_down_the_layers():
    """Kernels import only the format rules beneath them; the backends never the differentiable
    layer; nothing below the integrations imports them."""
    edges = _graph()
    upward = sorted(f"{m} -> {t}" for m, ts in edges.items() if m != "jax_mxfp4"
                    for t in ts if _layer(t) > _layer(m))
    assert upward == []


def test_platform_detection_is_one_module_importing_nothing_of_the_package():
    edges = _graph()
    assert edges["jax_mxfp4.platform"] == set()
    users = {m for m, e in edges.items() if "jax_mxfp4.platform" in e}
    assert {"jax_mxfp4.dispatch", "jax_mxfp4.quantize", "jax_mxfp4.backends.ffi_cpu",
            "jax_mxfp4.backends.hipblaslt"} <= users
    # Nobody else asks jax.default_backend() which GPU it is.
    for path in PKG.rglob("*.py"):
        if path.name != "platform.py":
            assert "platform_version" not in path.read_text(), path


EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def _absolute_imports(path: pathlib.Path) -> set[str]:
    """Top-level names of the absolute imports of a file (inside functions too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.partition(".")[0])
        elif isinstance(node, ast.Import):
            names.update(a.name.partition(".")[0] for a in node.names)
    return names


def test_the_applications_live_outside_the_package_and_import_one_way():
    """examples/ (the LM training, serving, recipe sweep and quickstart scripts) is not part of the
    wheel: no module of jax_mxfp4 imports one, and among them the imports run one way
    (generate and recipes use train_lm; train_lm and quickstart import no other example)."""
    apps = {p.stem for p in EXAMPLES.glob("*.py")}
    assert {"train_lm", "generate", "recipes", "quickstart"} <= apps
    assert not (PKG / "demo.py").exists() and not (PKG / "examples").exists() and not (PKG / "example.py").exists()
    for path in PKG.rglob("*.py"):
        assert not (_absolute_imports(path) & apps), path
    uses = {app: _absolute_imports(EXAMPLES / f"{app}.py") & apps for app in apps}
    assert uses == {"train_lm": set(), "quickstart": set(), "generate": {"train_lm"}, "recipes": {"train_lm"}}
    for app in apps:  # each uses the library through its public names
        assert "jax_mxfp4" in _absolute_imports(EXAMPLES / f"{app}.py"), app
