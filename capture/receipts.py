"""Receipts: the outcome of one capture, as the server reports it in `capture_results`.

In-process consumers get receipts from callbacks or awaitables (`ReceiptBoard`);
any process can rebuild one from the manifest on disk, which is the source of truth
(`find_receipt`, `wait_for_receipt`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from capsteer.capture.layouts import MANIFEST_FILE
from capsteer.capture.paths import find_capture_dirs

STATUSES = ("ok", "pending", "error", "dropped", "rejected")


@dataclass(frozen=True)
class Receipt:
    """Status of one capture; `dir` is relative to the capture root."""

    capture_id: str
    status: str
    dir: str | None = None
    layout: str | None = None
    files: tuple[str, ...] = ()
    manifest: str | None = None
    bytes: int = 0
    positions: int = 0
    error: str | None = None
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return self.status != "pending"

    def to_dict(self) -> dict[str, Any]:
        """The api.md §3 `capture_results` object (plus `timings`)."""
        d = asdict(self)
        d["files"] = list(self.files)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Receipt:
        """The inverse of `to_dict` (receipts sent between processes as JSON)."""
        return cls(**{**d, "files": tuple(d.get("files", ()))})

    @classmethod
    def from_manifest(cls, manifest: dict[str, Any], rel_dir: str) -> Receipt:
        return cls(
            capture_id=manifest["capture_id"],
            status=manifest.get("status", "ok"),
            dir=rel_dir,
            layout=manifest.get("layout"),
            files=tuple(f["name"] for f in manifest.get("files", [])),
            manifest=MANIFEST_FILE,
            bytes=sum(int(f["bytes"]) for f in manifest.get("files", [])),
            positions=len(manifest.get("positions", [])),
            error=manifest.get("error"),
            timings=dict(manifest.get("timings", {})),
        )


def pending(capture_id: str, message: str | None = None) -> Receipt:
    return Receipt(capture_id, "pending", error=message)


def receipt_at(root: str | Path, rel_dir: str) -> Receipt | None:
    """The receipt of the capture published at `root/rel_dir`, or None while no manifest is
    visible there: one file read, for callers that know the directory (the in-process
    engine dates it itself), instead of a search of the root per capture."""
    try:
        manifest = json.loads((Path(root) / rel_dir / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return None
    return Receipt.from_manifest(manifest, rel_dir)


def find_receipt(root: str | Path, capture_id: str) -> Receipt | None:
    """The receipt of a published capture read from its manifest, or None if none is visible."""
    root = Path(root)
    for d in find_capture_dirs(root, capture_id):
        try:
            manifest = json.loads((d / MANIFEST_FILE).read_text())
        except (OSError, ValueError):
            continue
        return Receipt.from_manifest(manifest, d.relative_to(root).as_posix())
    return None


async def wait_for_receipt(
    root: str | Path, capture_id: str, timeout: float, poll_s: float = 0.05
) -> Receipt:
    """Poll the disk until the manifest appears (any process); pending receipt on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        found = await asyncio.to_thread(find_receipt, root, capture_id)
        if found is not None:
            return found
        if time.monotonic() >= deadline:
            return pending(capture_id, f"capture not durable after {timeout:g}s")
        await asyncio.sleep(poll_s)


class ReceiptBoard:
    """Thread-safe delivery of receipts to callbacks, futures and asyncio awaiters.

    Futures can be requested before the capture is known (the server may ask first);
    finished receipts are kept for `keep` lookups (older ones come from disk).
    """

    def __init__(self, keep: int = 10_000) -> None:
        self._lock = threading.Lock()
        self._futures: dict[str, concurrent.futures.Future[Receipt]] = {}
        self._done: OrderedDict[str, Receipt] = OrderedDict()
        self._keep = keep

    def future(self, capture_id: str) -> concurrent.futures.Future[Receipt]:
        with self._lock:
            fut = self._futures.get(capture_id)
            if fut is None:
                fut = concurrent.futures.Future()
                done = self._done.get(capture_id)
                if done is not None:
                    fut.set_result(done)
                else:
                    self._futures[capture_id] = fut
            return fut

    def add_done_callback(self, capture_id: str, fn: Callable[[Receipt], None]) -> None:
        """Call fn(receipt) once the capture is final (at once if it already is)."""
        self.future(capture_id).add_done_callback(lambda f: fn(f.result()))

    async def wait(self, capture_id: str, timeout: float | None = None) -> Receipt:
        """Await the final receipt; a pending receipt (never an exception) on timeout."""
        fut = asyncio.wrap_future(self.future(capture_id))
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except asyncio.TimeoutError:
            return pending(capture_id, f"capture not durable after {timeout:g}s")

    def reopen(self, capture_id: str) -> None:
        """A capture with this id starts (again): later waiters get the new outcome."""
        with self._lock:
            self._done.pop(capture_id, None)

    def get(self, capture_id: str) -> Receipt | None:
        with self._lock:
            return self._done.get(capture_id)

    def resolve(self, receipt: Receipt) -> None:
        with self._lock:
            self._done[receipt.capture_id] = receipt
            self._done.move_to_end(receipt.capture_id)
            while len(self._done) > self._keep:
                self._done.popitem(last=False)
            fut = self._futures.pop(receipt.capture_id, None)
        if fut is not None and not fut.done():
            fut.set_result(receipt)
