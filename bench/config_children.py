"""Run a benchmark's configurations each in a process of its own (an engine per process).

The parent runs the same script again with `--config NAME` per configuration; the child
prints progress lines and, last, `RESULT <json>`. Progress is echoed as it comes, so a
long run shows where it is; a failed child's log tail is printed and the run stops.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

RESULT = "RESULT "


def add_config_args(ap: argparse.ArgumentParser, work: str) -> None:
    """`--configs` (which, in order), the child's hidden `--config`, `--work` (models, logs)
    and `--out` (the results; $OUT on the lent GPU machine)."""
    ap.add_argument("--configs", default="vanilla,capsteer")
    ap.add_argument("--config", default=None, help=argparse.SUPPRESS)  # a child's one
    ap.add_argument("--work", type=Path, default=Path(work))
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "bench/results"))


def result_line(result: dict[str, Any]) -> str:
    """What a child prints last: its result for the parent."""
    return RESULT + json.dumps(result)


def run_configs(script: str, argv: list[str], configs: list[str], logs: Path,
                name: str) -> list[dict[str, Any]]:
    """Each configuration's result, in order: `script argv --config C` in a child process,
    its stderr in `logs/<name>-<C>.log` (`-<C>-<k>` for a configuration's k-th run where
    `configs` repeats it, as interleaved rounds do)."""
    results = []
    repeated = {c for c in configs if configs.count(c) > 1}
    runs: dict[str, int] = {}
    for config in configs:
        runs[config] = runs.get(config, 0) + 1
        log = logs / (f"{name}-{config}-{runs[config]}.log" if config in repeated
                      else f"{name}-{config}.log")
        with open(log, "w") as fh:
            proc = subprocess.Popen([sys.executable, script, *argv, "--config", config],
                                    stdout=subprocess.PIPE, stderr=fh, text=True)
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.startswith(RESULT):
                    results.append(json.loads(line[len(RESULT):]))
                else:
                    print(line, end="", flush=True)
        if proc.wait() != 0:
            print(log.read_text(errors="replace")[-3000:], file=sys.stderr)
            raise SystemExit(f"{config}: the process failed (log {log})")
    return results
