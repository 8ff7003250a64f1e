"""The product's modules, read from the tree (pyproject's package-dir), for the house
checks (test_house.py, test_errors.py)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Folder -> installed package name (pyproject's package-dir).
PACKAGES = {"capsteer": "capsteer", "server": "capsteer.server", "capture": "capsteer.capture",
            "steering": "capsteer.steering", "engine_ext": "capsteer.engine_ext",
            "config": "capsteer.config"}
MAX_LINES = 600


def product_modules() -> dict[str, Path]:
    modules = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


def imports_of(name: str, path: Path,
               modules: dict[str, Path]) -> Iterator[tuple[str, int, bool]]:
    """(target module, line, inside a function?) for each import of a capsteer module."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    local = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            local.update(id(n) for n in ast.walk(node) if n is not node)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            candidates = [[alias.name] for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([node.module] if node.module else []))
            candidates = [[f"{base}.{alias.name}", base] for alias in node.names]
        else:
            continue
        for options in candidates:
            target = next((m for m in options if m in modules), None)
            if target is not None and target != name:
                yield target, node.lineno, id(node) in local
