"""The shape of the house, checked so that it stays as docs/architecture.md describes:
no import cycle between capsteer's modules, no product module over 600 lines, every
import inside a function says why it is not at the top of its module, and bench/ stays a
small harness (at most 10 Python files and 3,000 lines)."""

from __future__ import annotations

import ast

from .house import MAX_LINES, ROOT, imports_of, product_modules


def test_no_import_cycle_between_modules():
    modules = product_modules()
    graph = {name: {t for t, _, _ in imports_of(name, path, modules)}
             for name, path in modules.items()}
    cycles = []
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
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
                cycles.append(sorted(component))

    for name in graph:
        if name not in index:
            visit(name)
    assert not cycles, f"import cycles (function-local imports count too): {cycles}"


def test_no_product_module_over_600_lines():
    long = {str(p.relative_to(ROOT)): n for p in product_modules().values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"over {MAX_LINES} lines: {long}"


def test_bench_stays_a_small_harness():
    """bench/ answers a user's questions with one harness each; an investigation's script
    goes once its conclusion is recorded (docs/performance.md), so the harness stays small."""
    files = sorted((ROOT / "bench").glob("*.py"))
    lines = sum(len(p.read_text().splitlines()) for p in files)
    assert len(files) <= 10 and lines <= 3000, (
        f"bench/ holds {len(files)} Python files and {lines} lines (at most 10 and 3,000)")


def _block_has_reason(lines: list[str], lineno: int) -> bool:
    """Whether a comment opens the run of import lines (and blank lines) holding `lineno`."""
    at = lineno - 2
    while at >= 0 and (not lines[at].strip() or lines[at].split()[0] in ("from", "import")
                       or lines[at].strip().startswith(("(", ")")) or (lines[at].startswith(" " * 8)
                       and lines[at].strip().endswith(","))):
        at -= 1
    return at >= 0 and lines[at].strip().startswith("#")


def test_every_function_local_import_says_why():
    """A capsteer import inside a function needs a comment on its line or opening its block
    of imports (an optional dependency, start-up cost, ...); otherwise it belongs at the
    top of the module."""
    modules = product_modules()
    silent = []
    for name, path in modules.items():
        lines = path.read_text().splitlines()
        for _, lineno, inside in imports_of(name, path, modules):
            if inside and "#" not in lines[lineno - 1] and not _block_has_reason(lines, lineno):
                silent.append(f"{path.relative_to(ROOT)}:{lineno}")
    assert not silent, f"function-local imports without a reason: {silent}"


# Modules a reader of published captures loads: none may reach a writer module.
READ_SIDE = ("reader", "published", "receipts", "dataset", "sharded", "paths", "digests",
             "layouts", "spec")
WRITE_SIDE = ("writer", "publish")


def test_the_capture_read_side_reaches_nothing_of_the_write_side():
    modules = product_modules()
    graph = {name: {t for t, _, _ in imports_of(name, path, modules)}
             for name, path in modules.items()}
    reached: dict[str, str] = {}
    todo = [f"capsteer.capture.{m}" for m in READ_SIDE]
    while todo:
        module = todo.pop()
        for dep in graph[module]:
            if dep not in reached:
                reached[dep] = module
                todo.append(dep)
    writers = sorted(d for d in reached if d.startswith("capsteer.capture.")
                     and d.split(".")[2] in WRITE_SIDE)
    assert not writers, {d: reached[d] for d in writers}


def test_vllm_is_imported_at_module_level_only_in_engine_ext_vllm():
    """Every touch of vLLM internals sits behind engine_ext/vllm/'s version check."""
    for name, path in product_modules().items():
        if name.startswith("capsteer.engine_ext.vllm") or not name.startswith(
                "capsteer.engine_ext"):
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("vllm"), (name, node.module)
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("vllm") for a in node.names), name
