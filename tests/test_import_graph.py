"""Imports flow one way: no module-level cycle inside any package, and the sandbox runtime never imports the layers
built on it (the SDK facade, the server, the RL environments, the CLIs).

The graph is read from the source with `ast` (no import runs): every ``import``/``from ... import`` anywhere in
a module, function bodies and ``if TYPE_CHECKING:`` blocks included (a type-only cycle is still two modules that
each need the other).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = [(ROOT / "src", "flashkda"), (ROOT / "src", "moonep"), (ROOT / "src", "agentenv"),
            (ROOT / "src", "k3infra"), (ROOT, "benchmarks")]
ABOVE_RUNTIME = ("agentenv.sandbox", "agentenv.client", "agentenv.server", "agentenv.rl", "agentenv.cli",
                 "agentenv.posttrain", "agentenv._aio")


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(tree: ast.AST, name: str, is_package: bool, modules: set[str]) -> set[str]:
    """Modules `name` imports: ``from a.b import c`` counts as ``a.b.c`` when that is a module, else ``a.b``."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            visit_one(child)

    def visit_one(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                full = f"{source}.{alias.name}"
                found.add(full if full in modules else source)
        visit(node)

    visit(tree)
    return found


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports, for every ``.py`` under ``root/package``."""
    files = {_module_name(root, f): f for f in sorted((root / package).rglob("*.py"))}
    names = set(files)
    graph = {}
    for name, path in files.items():
        deps = _imported(ast.parse(path.read_text(), str(path)), name, path.name == "__init__.py", names)
        graph[name] = {d for d in deps if d in names and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (each is an import cycle)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan; recursion depth is bounded by the module count
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_graph_reads_function_level_relative_and_type_checking_imports(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg import b\n")
    (pkg / "b.py").write_text("from . import c\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.c"} and graph["pkg.c"] == {"pkg.a"}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]


@pytest.mark.parametrize("root,package", PACKAGES, ids=[p for _, p in PACKAGES])
def test_no_import_cycle_inside_package(root, package):
    assert cycles(import_graph(root, package)) == []


def test_runtime_imports_nothing_built_on_it():
    graph = import_graph(ROOT / "src", "agentenv")
    bad = {m: sorted(d for d in deps if d.startswith(ABOVE_RUNTIME))
           for m, deps in graph.items() if m.startswith("agentenv.runtime")}
    assert {m: d for m, d in bad.items() if d} == {}
