"""The rooms of the house and which way their doors open: no module depends on itself.

Dependence points one way: the engine (drt-core) knows nothing of Python or Polars, the
bindings (drt-python) and the plugins (drt-polars) call into it, and the Python package sits
on the bindings. Within each, the modules form no cycle, so each can be read and changed
knowing only what lies below it. These tests read the sources; they need no build.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "dataset_rt"
CRATES = {
    "drt-core": REPO / "crates" / "drt-core",
    "drt-python": REPO / "crates" / "drt-python",
    "drt-polars": REPO / "polars_plugin",
}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path that ends where it starts, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_cycle_finder_finds_cycles() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def _python_imports() -> dict[str, set[str]]:
    """Module -> the package's modules it imports, at any depth (functions and type checks
    included: a deferred import is still a dependency)."""
    modules = {path.stem for path in PACKAGE.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.glob("*.py"):
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                base = node.module
                names = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[0] == "dataset_rt" and len(parts) > 1 and parts[1] in modules:
                    deps.add(parts[1])
        deps.discard(path.stem)
        graph[path.stem] = deps
    return graph


def test_the_python_package_has_no_import_cycle() -> None:
    graph = _python_imports()
    assert {"caches", "loader", "workers", "registry", "verify"} <= set(graph)
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


# The Python layers of docs/design.md, floor first: a module may import from its own layer
# (without a cycle) and from the layers below, never from one above.
PYTHON_LAYERS = [
    {"__init__", "_version_check"},
    {
        "errors",
        "roots",
        "progress",
        "serialize",
        "metadata",
        "plugins",
        "processes",
        "objects",
        "scratch",
    },
    {
        "registry",
        "verify",
        "transfers",
        "fetch",
        "versions",
        "caches",
        "records",
        "build",
        "appends",
        "remote",
    },
    {
        "options",
        "pipeline",
        "ring",
        "collate",
        "workers",
        "program",
        "reweights",
        "snapshot",
        "loader",
        "packing",
        "streams",
        "summary",
        "namespace",
        "ray",
    },
    {"bench", "cli", "demo"},
]


def test_every_python_module_imports_only_from_its_layer_or_below() -> None:
    graph = _python_imports()
    layer_of = {module: i for i, layer in enumerate(PYTHON_LAYERS) for module in layer}
    assert set(graph) == set(layer_of), "place new modules in PYTHON_LAYERS and docs/design.md"
    upward = [
        f"{module} -> {dep}"
        for module, deps in graph.items()
        if module != "__init__"  # the facade re-exports from every layer
        for dep in deps
        if layer_of[dep] > layer_of[module]
    ]
    assert not upward, upward


_USE_GROUP = re.compile(r"\buse\s+crate::\{([^;]*)\};", re.DOTALL)
_CRATE_PATH = re.compile(r"\bcrate::([a-z_][a-z0-9_]*)\b(?!\s*!)")


def _rust_modules(crate: Path) -> dict[str, set[str]]:
    """Module of one crate's src/ -> the modules of the same crate it refers to."""
    files = {path.stem: path for path in (crate / "src").glob("*.rs")}
    graph: dict[str, set[str]] = {}
    for stem, path in files.items():
        text = re.sub(r"//[^\n]*", "", path.read_text())  # comments and doc links
        found = set(_CRATE_PATH.findall(text))
        for group in _USE_GROUP.findall(text):
            # `use crate::{a::X, b, c::{Y, Z}}`: the first segment of each top-level item.
            depth, item = 0, ""
            for char in group + ",":
                if char == "{":
                    depth += 1
                elif char == "}":
                    depth -= 1
                elif char == "," and depth == 0:
                    found.add(item.strip().split("::")[0])
                    item = ""
                    continue
                item += char
        graph[stem] = {name for name in found if name in files and name not in (stem, "lib")}
    return graph


@pytest.mark.parametrize("crate", sorted(CRATES))
def test_no_rust_crate_has_a_module_cycle(crate: str) -> None:
    graph = _rust_modules(CRATES[crate])
    assert graph, f"no modules found in {crate}"
    assert _cycle(graph) is None, f"{crate}: " + " -> ".join(_cycle(graph) or [])


def _dependencies(crate: str) -> set[str]:
    """The names in a crate's ``[dependencies]`` table."""
    text = (CRATES[crate] / "Cargo.toml").read_text()
    table = re.search(r"^\[dependencies\]\n(.*?)(?=^\[|\Z)", text, re.DOTALL | re.MULTILINE)
    assert table, f"{crate} has no [dependencies]"
    return set(re.findall(r"^([A-Za-z0-9_-]+)\s*[.=]", table.group(1), re.MULTILINE))


def test_the_crates_depend_one_way() -> None:
    # The engine knows nothing of Python or Polars; the plugins build on the engine alone;
    # the bindings sit above both.
    core = _dependencies("drt-core")
    assert not {dep for dep in core if dep.startswith(("pyo3", "polars", "drt-"))}, core
    assert "drt-core" in _dependencies("drt-polars")
    assert "drt-python" not in _dependencies("drt-polars")
    assert {"drt-core", "drt-polars"} <= _dependencies("drt-python")
