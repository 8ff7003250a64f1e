"""The capture package has no import cycle and its read side imports nothing of the
write side (a static check: every import statement, function-local ones included)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "capsteer.capture"
ROOT = Path(__file__).resolve().parents[2] / "capture"
# Modules a reader of published captures loads: none may import a writer module.
READ_SIDE = ("reader", "published", "receipts", "dataset", "sharded", "paths", "digests",
             "layouts", "spec")
WRITE_SIDE = ("writer", "publish")


def _modules() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        mods[".".join([PACKAGE, *parts])] = path
    return mods


def _edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods
                         else node.module for a in node.names]
            edges[mod].update(n for n in names if n in mods and n != mod)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_in_the_capture_package():
    assert _cycles(_edges(_modules())) == []


def test_the_read_side_imports_nothing_of_the_write_side():
    edges = _edges(_modules())
    seen: dict[str, str] = {}
    todo = [f"{PACKAGE}.{m}" for m in READ_SIDE]
    while todo:
        mod = todo.pop()
        for dep in edges.get(mod, ()):
            if dep not in seen:
                seen[dep] = mod
                todo.append(dep)
    writers = sorted(d for d in seen if d.split(".")[2] in WRITE_SIDE)
    assert writers == [], {d: seen[d] for d in writers}
