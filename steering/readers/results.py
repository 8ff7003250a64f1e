"""Readout results on their way from the workers to the server.

One file per request under the server's readout directory: the worker that computed a
step's scores appends one JSON line per item, the server reads the lines as they come
(`ResultsTail`), attaches them to the response (`readout_results`) or to the SSE
chunks, and deletes the file. A line is a record:
`{"i": item, "p": [positions], "s": [[score, ...], ...]}` for a probe,
`{"i": item, "p": [positions], "f": [[[feature, value], ...], ...]}` for an SAE, or
`{"i": item, "error": "why"}` when the worker could not read (nothing else follows).
Only complete lines are read, so a reader never sees half a record.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, BinaryIO

SUFFIX = ".jsonl"


def results_path(root: str | Path, readout_id: str) -> Path:
    """Where one request's results go (`readout_id` is the server's `ro-<hex>` id)."""
    return Path(root) / f"{readout_id}{SUFFIX}"


def probe_record(item: int, positions: list[int], scores: list[list[float]]) -> bytes:
    return _line({"i": item, "p": positions, "s": scores})


def sae_record(item: int, positions: list[int],
               features: list[list[tuple[int, float]]]) -> bytes:
    return _line({"i": item, "p": positions, "f": features})


def error_record(item: int, reason: str) -> bytes:
    return _line({"i": item, "error": reason})


def _line(record: dict[str, Any]) -> bytes:
    return json.dumps(record, separators=(",", ":")).encode() + b"\n"


def append(path: Path, data: bytes) -> None:
    """Append whole records in one write (O_APPEND: writers of one file never interleave
    inside a write)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


class ResultsTail:
    """Reads a results file's new complete records each `poll` (the file may not exist yet)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: BinaryIO | None = None  # open once it exists: a poll is then one read
        self._partial = b""

    def poll(self) -> list[dict[str, Any]]:
        if self._file is None:
            try:
                self._file = open(self.path, "rb")  # kept open across polls
            except FileNotFoundError:
                return []
        data = self._partial + self._file.read()
        lines = data.split(b"\n")
        self._partial = lines.pop()
        return [json.loads(line) for line in lines if line]

    def remove(self) -> None:
        if self._file is not None:
            self._file.close()
        self.path.unlink(missing_ok=True)
