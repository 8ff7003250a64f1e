"""engine_ext's modules import each other without a cycle (function-local imports
included), and only engine_ext/vllm/ imports vLLM at module level."""

from __future__ import annotations

import ast
from pathlib import Path

import capsteer.engine_ext

ROOT = Path(capsteer.engine_ext.__file__).parent
PACKAGE = "capsteer.engine_ext"


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = [p for p in path.relative_to(ROOT).with_suffix("").parts if p != "__init__"]
        out[".".join([PACKAGE, *parts])] = path
    return out


def _imports(path: Path, known: dict[str, Path]) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in known else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found & set(known)


def test_no_import_cycle_in_engine_ext() -> None:
    modules = _modules()
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(name: str, stack: list[str]) -> None:
        state[name] = 1
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:
                cycles.append([*stack[stack.index(dep):], dep])
            elif dep not in state:
                visit(dep, [*stack, dep])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert cycles == []


def test_vllm_is_imported_at_module_level_only_in_engine_ext_vllm() -> None:
    for name, path in _modules().items():
        if name.startswith(f"{PACKAGE}.vllm"):
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("vllm"), (name, node.module)
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("vllm") for a in node.names), name
