"""Outcomes a writer reached but could not write to disk (the disk is full).

The manifest on disk is the outcome every process reads. When even a capture's error
manifest cannot be written, the writer keeps the outcome here: the server asks the
engine's workers for it (`CaptureSink.unwritten_receipts`), so the receipt still becomes final
and its reserved bytes are freed, and each later publish tries to write the kept
manifests again, so the disk catches up once space is back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from capsteer.capture.publish import FileSystem, ensure_dir, write_json_atomic
from capsteer.capture.receipts import Receipt

log = logging.getLogger(__name__)

KEEP = 10_000  # outcomes remembered (and manifests retried); the oldest go first
RETRY_EVERY_S = 1.0


@dataclass(frozen=True)
class _Manifest:
    path: Path
    name: str
    body: dict[str, Any]


class UnwrittenOutcomes:
    """Thread-safe table of receipts whose manifest is not on disk, with the manifests."""

    def __init__(self, keep: int = KEEP) -> None:
        self._lock = threading.Lock()
        self._receipts: OrderedDict[str, Receipt] = OrderedDict()
        self._manifests: OrderedDict[str, _Manifest] = OrderedDict()
        self._keep = keep
        self._retried_at = 0.0

    def add(self, receipt: Receipt, path: Path | None = None, name: str = "",
            manifest: dict[str, Any] | None = None) -> None:
        """Keep `receipt`; with `manifest`, write it to `path/name` on a later retry."""
        with self._lock:
            self._receipts[receipt.capture_id] = receipt
            self._receipts.move_to_end(receipt.capture_id)
            if manifest is not None and path is not None:
                self._manifests[receipt.capture_id] = _Manifest(path, name, manifest)
            for table in (self._receipts, self._manifests):
                while len(table) > self._keep:
                    table.popitem(last=False)

    def merge(self, receipts: Iterable[Receipt]) -> None:
        """Outcomes another process kept (a writer child's, reported to its parent)."""
        for receipt in receipts:
            self.add(receipt)

    def get(self, capture_ids: Iterable[str]) -> dict[str, Receipt]:
        with self._lock:
            return {c: self._receipts[c] for c in capture_ids if c in self._receipts}

    def retry(self, fs: FileSystem, *, now: float | None = None) -> int:
        """Write kept manifests (at most once per RETRY_EVERY_S); returns how many landed."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if not self._manifests or now - self._retried_at < RETRY_EVERY_S:
                return 0
            self._retried_at = now
            todo = list(self._manifests.items())
        written = 0
        for capture_id, m in todo:
            try:
                if not (m.path / m.name).exists():
                    ensure_dir(m.path, fs)
                    write_json_atomic(m.path, m.name, m.body, fs)
            except OSError:
                break  # still no space: the rest would fail too
            written += 1
            with self._lock:
                self._manifests.pop(capture_id, None)
        if written:
            log.info("capsteer: wrote %d capture manifests that had failed for want of space",
                     written)
        return written
