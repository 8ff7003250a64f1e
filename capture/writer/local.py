"""The local durable capture sink: accumulates rows per request, publishes at request end.

`CaptureWriter` implements the engine's `CaptureSink`. The engine thread only
appends references to rows it already copied (and, under the block policy when
memory is exhausted, spills them to a temp file); worker threads finalize
positions, stream safetensors files, fsync, rename and write the manifest last.

Pipeline parallelism (`CaptureRequest.num_stages` S > 1): each stage's worker has
its own writer on the same root and holds only its keys (`CaptureRequest.keys`).
A stage writes its data files (per_file: the usual `{hook}.{layer}.safetensors`;
packed: `activations-stage{s}.safetensors`; nothing for a stage without keys),
fsyncs them and the directory, then publishes its part manifest `.stage-{s}.json`
(same fields as a manifest, plus `stage` and `stages`; `keys` are the stage's)
instead of `manifest.json`. It then lists the parts: because every stage writes
its part before listing, the last one to finish sees all S, and whoever creates
`.merge.lock` (O_EXCL) first writes the one `manifest.json` from the parts (see
`merge_parts`). Error and dropped outcomes take the same path, so a failed stage
still ends in exactly one manifest, with status error/dropped naming the stage.
The writer's own receipt, future and metrics stay per stage (that stage's
outcome); the merged outcome is the manifest on disk, which the server reads.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import torch

import capsteer.capture.metrics as metrics
from capsteer.capture.layouts import as_bytes
from capsteer.capture.paths import relative_dir, validate_capture_id
from capsteer.capture.publish import (
    DEFAULT_DIGEST,
    DEFAULT_FS,
    FileSystem,
    check_digest,
    ensure_dir,
    new_hasher,
    sweep_temp_files,
    temp_name,
)
from capsteer.capture.receipts import Receipt, ReceiptBoard, find_receipt, pending
from capsteer.capture.sink import CaptureEnd, CaptureRequest, CaptureSink
from capsteer.capture.writer.budget import (
    DEFAULT_BUDGET_BYTES,
    Budget,
    Grant,
    Overloaded,
    check_budget,
)
from capsteer.capture.writer.publishing import Publishing
from capsteer.capture.writer.stages import stage_keys
from capsteer.capture.writer.state import Chunk, OpenCapture
from capsteer.capture.writer.threads import WorkerThreads, default_workers
from capsteer.capture.writer.unwritten import UnwrittenOutcomes

log = logging.getLogger(__name__)


class CaptureWriter(Publishing, CaptureSink):
    """Durable `CaptureSink`: writer pool, in-flight budget, atomic publish, receipts.

    root: capture root (api.md §5). budget_bytes: row bytes held in memory at most.
    policy: "block" | "drop" | "reject". fs: syscall wrapper (tests inject latency).
    digest: the data files' digest recorded in manifests (publish.DIGESTS).
    """

    def __init__(
        self,
        root: str | Path,
        *,
        budget_bytes: int = DEFAULT_BUDGET_BYTES,
        policy: str = "block",
        workers: int | None = None,
        fs: FileSystem = DEFAULT_FS,
        sweep: bool = True,
        keep_receipts: int = 10_000,
        clock: Callable[[], float] = time.time,
        digest: str = DEFAULT_DIGEST,
        direct_io: bool = False,
    ) -> None:
        check_budget(budget_bytes, policy)
        self.root = Path(root).resolve()
        self.fs = fs
        self.digest = check_digest(digest)
        self.direct_io = direct_io  # data files through O_DIRECT where the filesystem allows
        new_hasher(digest)  # a missing library fails here, not in every publish
        self.clock = clock
        ensure_dir(self.root, fs)
        self.swept: list[Path] = sweep_temp_files(self.root) if sweep else []
        if self.swept:
            log.warning("swept %d stale capture temp files under %s", len(self.swept), self.root)
        self.budget = Budget(budget_bytes, policy)
        self.receipts = ReceiptBoard(keep_receipts)
        self.unwritten = UnwrittenOutcomes()  # kept even where receipts are not
        self._caps: dict[str, OpenCapture] = {}
        self._caps_lock = threading.Lock()
        self._pool = WorkerThreads(workers or default_workers())
        self.spilled_bytes = 0

    # ----------------------------------------------------------------- sink API
    def open(self, request: CaptureRequest) -> None:
        """Register a captured request (cheap: no filesystem access)."""
        validate_capture_id(request.capture_id)
        keys = stage_keys(request)
        now = self.clock()
        dated = now if request.dir_time is None else request.dir_time
        rel = relative_dir(request.capture_id, request.spec.tag, dated)
        cap = OpenCapture(
            req=request,
            rel_dir=rel,
            path=self.root / rel,  # every component of rel was validated as a slug
            keys=frozenset(keys),
            key_order=keys,
            opened_at=now,
        )
        with self._caps_lock:
            if request.capture_id in self._caps:
                return
            self._caps[request.capture_id] = cap
        self.receipts.reopen(request.capture_id)

    def write(
        self, capture_id: str, hook: str, layer: int, positions: np.ndarray, rows: torch.Tensor
    ) -> None:
        """Take rows for (hook, layer) at absolute positions; returns without disk I/O
        unless the block policy has to spill."""
        with self._caps_lock:
            cap = self._caps.get(capture_id)
        if cap is None or cap.dropped or cap.failed:
            return
        key = (hook, int(layer))
        if key not in cap.keys:
            log.warning("capture %s: ignoring rows for uncaptured key %s", capture_id, key)
            return
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        if rows.dim() == 1:
            rows = rows.reshape(1, -1)
        if rows.dim() != 2 or rows.shape[0] != len(pos):
            raise ValueError(f"rows {tuple(rows.shape)} do not match {len(pos)} positions")
        pspec = cap.req.spec.positions
        mask = pspec.candidate(pos, cap.prompt_len)
        if pspec.kind == "last":
            # Only the highest position can survive: keep one row per key in memory.
            cand = np.flatnonzero(mask)
            if len(cand):
                best = cand[pos[cand] == pos[cand].max()][-1]
                mask = np.zeros_like(mask)
                mask[best] = True
        if not mask.all():
            pos = pos[mask]
            rows = rows[torch.from_numpy(mask)]
        elif rows.untyped_storage().nbytes() > 2 * rows.nbytes or not rows.is_contiguous():
            rows = rows.contiguous().clone()  # do not pin a larger engine buffer
        if len(pos) == 0:
            return
        chunk = Chunk(pos, rows, rows.dtype, int(rows.shape[1]), int(rows.nbytes))
        grant = self.budget.acquire(chunk.nbytes, self._spill_some)
        if grant is Grant.REFUSED:
            self._drop(cap, "budget")
            return
        with cap.lock:
            if cap.dropped or cap.failed or cap.closed:
                if grant is Grant.TAKEN:
                    self.budget.release_open(chunk.nbytes)
                return
            if grant is Grant.DIRECT:
                try:
                    self._spill_chunk(cap, chunk)
                except OSError as exc:
                    self._fail_locked(cap, f"spill failed: {exc}")
                    return
            else:
                cap.mem_bytes += chunk.nbytes
            lst = cap.chunks.setdefault(key, [])
            if pspec.kind == "last" and lst:
                if int(max(c.positions.max() for c in lst)) > int(pos[0]):
                    freed = chunk.nbytes if chunk.rows is not None else 0  # stale recompute
                    lst_new = lst
                else:
                    freed = sum(c.nbytes for c in lst if c.rows is not None)
                    lst_new = [chunk]
                cap.mem_bytes -= freed
                cap.chunks[key] = lst_new
                self.budget.release_open(freed)
                return
            lst.append(chunk)

    def close(self, end: CaptureEnd) -> None:
        """The request finished: hand publishing to the pool and return."""
        with self._caps_lock:
            cap = self._caps.pop(end.capture_id, None)
        if cap is None:
            return
        with cap.lock:
            cap.closed = True
            cap.closed_at = self.clock()
            cap.sealed_left = cap.mem_bytes
            self.budget.seal(cap.mem_bytes)
            cap.mem_bytes = 0
        self._pool.submit(lambda: self._finish(cap, end))

    def abort(self, capture_id: str, reason: str) -> None:
        """The request ended without finishing: nothing is published; receipt says error."""
        with self._caps_lock:
            cap = self._caps.pop(capture_id, None)
        if cap is None:
            return
        with cap.lock:
            cap.closed = True
            cap.closed_at = self.clock()
            freed, cap.mem_bytes = cap.mem_bytes, 0
            cap.chunks.clear()
            if not cap.failed:
                cap.failed = f"aborted: {reason}"
        self.budget.release_open(freed)
        end = CaptureEnd(capture_id, tuple(cap.req.prompt_token_ids), finish_reason="abort")
        self._pool.submit(lambda: self._finish(cap, end))

    # -------------------------------------------------------- admission, receipts
    def admit(self, estimated_bytes: int) -> bool:
        """Whether to accept a new capture now (False only under the reject policy)."""
        return self.budget.admit(estimated_bytes)

    def admit_or_raise(self, estimated_bytes: int) -> None:
        """Like admit, raising Overloaded (-> HTTP 429 with Retry-After) when refused."""
        if not self.admit(estimated_bytes):
            raise Overloaded(
                f"capture budget exhausted ({self.budget.inflight} of {self.budget.limit} bytes in flight)"
            )

    def future(self, capture_id: str) -> Future[Receipt]:
        """A concurrent.futures.Future resolved with the final receipt."""
        return self.receipts.future(capture_id)

    def add_done_callback(self, capture_id: str, fn: Callable[[Receipt], None]) -> None:
        """Call fn(receipt) from a writer thread once final (at once if it already is)."""
        self.receipts.add_done_callback(capture_id, fn)

    async def wait(self, capture_id: str, timeout: float | None = None) -> Receipt:
        """Await the final receipt (asyncio); a pending receipt on timeout, never a hang."""
        return await self.receipts.wait(capture_id, timeout)

    def receipt(self, capture_id: str) -> Receipt | None:
        """Final receipt if known here, pending if still running here, else from disk."""
        done = self.receipts.get(capture_id)
        if done is not None:
            return done
        with self._caps_lock:
            if capture_id in self._caps:
                return pending(capture_id)
        try:
            return find_receipt(self.root, capture_id)
        except ValueError:
            return None

    def unwritten_receipts(self, capture_ids: Sequence[str]) -> dict[str, Receipt]:
        return self.unwritten.get(capture_ids)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every closed capture is published (tests, shutdown)."""
        return self._pool.drain(timeout)

    def shutdown(self, timeout: float | None = None) -> None:
        """Publish what was closed, then stop the threads; open captures are aborted."""
        with self._caps_lock:
            open_ids = list(self._caps)
        for cid in open_ids:
            self.abort(cid, "writer shut down")
        self._pool.drain(timeout)
        self._pool.stop(timeout)

    def __enter__(self) -> CaptureWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def stats(self) -> dict[str, Any]:
        b = self.budget
        with self._caps_lock:
            n_open = len(self._caps)
        return {
            "policy": b.policy,
            "budget_bytes": b.limit,
            "inflight_bytes": b.inflight,
            "open_bytes": b.open_bytes,
            "sealed_bytes": b.sealed_bytes,
            "peak_bytes": b.peak,
            "open_captures": n_open,
            "spilled_bytes": self.spilled_bytes,
            "budget_waits": b.waits,
            "budget_wait_s": round(b.wait_s, 6),
        }

    def engine_wait_s(self) -> dict[str, float]:
        """Seconds the callers (the engine's threads: this writer runs in its process) waited
        for the budget, read without a lock (capsteer_capture_engine_wait_seconds_total)."""
        return {"writer_budget": self.budget.wait_s}

    # ------------------------------------------------------------ overload paths
    def _drop(self, cap: OpenCapture, reason: str) -> None:
        with cap.lock:
            if cap.dropped or cap.closed:
                return
            cap.dropped = reason
            freed, cap.mem_bytes = cap.mem_bytes, 0
            cap.chunks.clear()
            cap.close_spill()
        self.budget.release_open(freed)
        metrics.DROPPED.labels(reason=reason).inc()

    def _fail_locked(self, cap: OpenCapture, message: str) -> None:
        cap.failed = message
        freed, cap.mem_bytes = cap.mem_bytes, 0
        cap.chunks.clear()
        cap.close_spill()
        self.budget.release_open(freed)

    def _spill_chunk(self, cap: OpenCapture, chunk: Chunk) -> None:
        """Append a chunk's rows to the capture's spill file (caller holds cap.lock)."""
        assert chunk.rows is not None
        if cap.spill_fd is None:
            ensure_dir(cap.path, self.fs)
            cap.spill_path = cap.path / temp_name("spill")
            cap.spill_fd = os.open(
                cap.spill_path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600
            )
        data = as_bytes(chunk.rows)
        offset = cap.spill_size
        while len(data):
            n = os.pwrite(cap.spill_fd, data, offset + (chunk.nbytes - len(data)))
            data = data[n:]
        cap.spill_size += chunk.nbytes
        self.spilled_bytes += chunk.nbytes
        chunk.spill_offset = offset
        chunk.rows = None

    def _spill_some(self, need: int) -> int:
        """Move open captures' rows to their spill files, largest first, until `need` freed."""
        with self._caps_lock:
            caps = sorted(self._caps.values(), key=lambda c: c.mem_bytes, reverse=True)
        freed_total = 0
        for cap in caps:
            if freed_total >= need:
                break
            with cap.lock:
                if cap.closed or cap.dropped or cap.failed or cap.mem_bytes == 0:
                    continue
                freed = 0
                try:
                    for lst in cap.chunks.values():
                        for chunk in lst:
                            if chunk.rows is not None:
                                self._spill_chunk(cap, chunk)
                                freed += chunk.nbytes
                except OSError as exc:
                    cap.mem_bytes -= freed
                    self.budget.release_open(freed)
                    freed_total += freed + cap.mem_bytes
                    self._fail_locked(cap, f"spill failed: {exc}")
                    continue
                cap.mem_bytes -= freed
            self.budget.release_open(freed)
            freed_total += freed
        return freed_total
