"""Metric names used by the Grafana dashboard under deploy/ (helper for tests/unit/test_deploy.py).

`dashboard_metric_names(path)` reads a dashboard JSON file, walks every panel (rows
included, collapsed rows hold their panels inside) and returns the base names of the
capsteer and vLLM metrics its PromQL expressions use: `capsteer_*` and `vllm:*`, with the
histogram series suffixes `_bucket`, `_count` and `_sum` stripped.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

METRIC_PREFIXES = ("capsteer_", "vllm:")
HISTOGRAM_SUFFIXES = ("_bucket", "_count", "_sum")

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
# PromQL string literals (label values, label_replace arguments): never metric names.
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
# Range and subquery selectors such as [1m] or [5m:30s]: durations, not names.
_RANGE = re.compile(r"\[[^\]]*\]")


def iter_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, including those nested inside (collapsed) rows."""
    for panel in panels:
        yield panel
        yield from iter_panels(panel.get("panels") or [])


def panel_exprs(panel: dict[str, Any]) -> list[str]:
    """The PromQL expressions of one panel's targets (empty strings left out)."""
    return [t["expr"] for t in panel.get("targets") or [] if t.get("expr")]


def metric_names_in_expr(expr: str) -> set[str]:
    """Base names of the capsteer_/vllm: metrics one PromQL expression selects."""
    text = _RANGE.sub(" ", _STRING.sub(" ", expr))
    names = set()
    for match in _NAME.finditer(text):
        start = match.start()
        # A name glued to a preceding identifier character or `$` is part of something
        # else (a Grafana variable such as $__rate_interval, a number like 1e3).
        if start and (text[start - 1].isalnum() or text[start - 1] in "_$"):
            continue
        name = match.group()
        if not name.startswith(METRIC_PREFIXES):
            continue
        for suffix in HISTOGRAM_SUFFIXES:
            if name.endswith(suffix):
                name = name[: -len(suffix)]
                break
        names.add(name)
    return names


def dashboard_metric_names(dashboard_json_path: str | Path) -> set[str]:
    """Base names of every capsteer_/vllm: metric used by the dashboard's PromQL targets."""
    dashboard = json.loads(Path(dashboard_json_path).read_text())
    names: set[str] = set()
    for panel in iter_panels(dashboard.get("panels") or []):
        for expr in panel_exprs(panel):
            names |= metric_names_in_expr(expr)
    return names
