"""What the local writer holds per open capture: row chunks in memory or spilled, and
which of them publishing keeps (each position once, last write wins)."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from capsteer.capture.layouts import part_name
from capsteer.capture.sink import CaptureRequest
from capsteer.capture.spec import PositionSpec

Key = tuple[str, int]


class CaptureDataError(RuntimeError):
    """The rows handed over cannot form a consistent capture (an engine bug)."""


class AlreadyPublished(RuntimeError):
    pass


@dataclass
class Chunk:
    positions: np.ndarray
    rows: torch.Tensor | None  # None once spilled
    dtype: torch.dtype
    hidden: int
    nbytes: int
    spill_offset: int = -1


@dataclass
class OpenCapture:
    req: CaptureRequest
    rel_dir: str
    path: Path
    keys: frozenset[Key]
    key_order: list[Key]  # the keys this writer publishes (this stage's), in spec order
    opened_at: float
    lock: threading.Lock = field(default_factory=threading.Lock)
    chunks: dict[Key, list[Chunk]] = field(default_factory=dict)
    mem_bytes: int = 0  # accounted in the budget
    spill_fd: int | None = None
    spill_path: Path | None = None
    spill_size: int = 0
    dropped: str | None = None  # reason, when dropped
    failed: str | None = None  # error met while the request was running (e.g. spill ENOSPC)
    closed: bool = False
    closed_at: float = 0.0
    sealed_left: int = 0

    @property
    def prompt_len(self) -> int:
        return len(self.req.prompt_token_ids)

    @property
    def staged(self) -> bool:
        """One of several pipeline stages: publishes a part, not the manifest."""
        return self.req.num_stages > 1

    @property
    def part(self) -> str:
        return part_name(self.req.stage)

    def close_spill(self) -> None:
        if self.spill_fd is not None:
            try:
                os.close(self.spill_fd)
            except OSError:
                pass
            self.spill_fd = None
        if self.spill_path is not None:
            try:
                os.unlink(self.spill_path)
            except OSError:
                pass
            self.spill_path = None


def plan_key(
    chunks: list[Chunk], pspec: PositionSpec, prompt_len: int, fed_len: int
) -> tuple[list[tuple[Chunk, int, int]], np.ndarray]:
    """Runs (chunk, row_start, row_stop) giving the kept rows in position order.

    A position written twice (preemption then recompute) takes its last write.
    """
    if not chunks:
        return [], np.zeros(0, np.int64)
    pos = np.concatenate([c.positions for c in chunks])
    cid = np.repeat(np.arange(len(chunks)), [len(c.positions) for c in chunks])
    row = np.concatenate([np.arange(len(c.positions)) for c in chunks])
    uniq, first_in_rev = np.unique(pos[::-1], return_index=True)
    last = len(pos) - 1 - first_in_rev
    kept = pspec.finalize(uniq, prompt_len, fed_len)
    sel = last[np.searchsorted(uniq, kept)]
    if len(sel) == 0:
        return [], kept
    c, r = cid[sel], row[sel]
    breaks = np.flatnonzero((np.diff(c) != 0) | (np.diff(r) != 1)) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(sel)]])
    runs = [(chunks[int(c[s])], int(r[s]), int(r[s]) + int(e - s)) for s, e in zip(starts, ends, strict=True)]
    return runs, kept
