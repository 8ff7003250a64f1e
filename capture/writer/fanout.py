"""Several capture writer processes behind one sink, so publishing is not bound by one
child's main thread and GIL.

Why: one writer process (its ring, its child's main thread taking rows out, its writer
threads sharing one GIL) published P3-all's load (every layer x every prompt position,
29 MB captures) at 0.92 GB/s to an H100 host's disk and 1.07 GB/s to tmpfs. Two
independent ones on the same host published 1.35 GB/s to the disk, whose own
`dd conv=fsync` rate was 1.2-1.3 GB/s there, and four 2.27 GB/s to tmpfs
(docs/performance.md).

Each capture lives in one child from `open` to its receipt: its rows, `close` and
`abort` follow it there, so its files, manifest and receipt are those a single writer
publishes. A new capture goes to the live child with the fewest captures in flight.

The in-flight budget is split evenly, so the row bytes held stay within the budget.
Under the block policy a capture larger than its child's share spills rows to disk, as
one larger than the whole budget does with one process; drop and reject would drop or
refuse it instead, so they run one process (`check_processes`).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

import capsteer.capture.metrics as metrics
from capsteer.capture.receipts import Receipt
from capsteer.capture.sink import CaptureEnd, CaptureRequest, CaptureSink
from capsteer.capture.writer.budget import DEFAULT_BUDGET_BYTES, DEFAULT_RING_BYTES, check_processes
from capsteer.capture.writer.process import ProcessCaptureWriter
from capsteer.capture.writer.ring import DeviceRows

# Writer processes the default configuration starts where the host has the cores: two
# reached the disk's rate on the lent H100 hosts (16 cores); one is the bound below that.
AUTO_PROCESSES = 2
AUTO_MIN_CPUS = 8


def auto_processes(policy: str) -> int:
    """The default: AUTO_PROCESSES under the block policy on a host with the cores, else 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return AUTO_PROCESSES if policy == "block" and cpus >= AUTO_MIN_CPUS else 1


class _AllReady:
    """`ready.wait(timeout)` over every child, as `ProcessCaptureWriter.ready` answers."""

    def __init__(self, writers: list[ProcessCaptureWriter]) -> None:
        self._writers = writers

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        for w in self._writers:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not w.ready.wait(left):
                return False
        return True


# Stats fields that add up across children (the rest are per child, under "processes").
_SUMMED = ("budget_bytes", "inflight_bytes", "open_bytes", "sealed_bytes", "peak_bytes",
           "open_captures", "spilled_bytes", "ring_bytes", "ring_waits", "ring_wait_s",
           "inline_writes", "copy_s", "send_s", "sends", "device_writes",
           "device_full", "budget_waits", "budget_wait_s", "intake_messages", "intake_s",
           "intake_cpu_s", "inbox_peak_bytes")


class ProcessWriterPool(CaptureSink):
    """A `CaptureSink` over `processes` `ProcessCaptureWriter`s (see module doc).

    Same arguments as `ProcessCaptureWriter`; `budget_bytes` is the total, split evenly,
    and `workers` is per process."""

    copies_rows = True  # every child copies rows into its ring before write returns
    supports_spans = True  # each child's ring reserves spans

    def __init__(self, root: str | Path, *, processes: int,
                 budget_bytes: int = DEFAULT_BUDGET_BYTES,
                 policy: str = "block", workers: int | None = None, digest: str = "sha256",
                 ring_bytes: int = DEFAULT_RING_BYTES, direct_io: bool = False) -> None:
        check_processes(processes, policy)
        share = max(1, budget_bytes // processes)
        self.writers: list[ProcessCaptureWriter] = []
        try:
            for _ in range(processes):
                self.writers.append(ProcessCaptureWriter(
                    root, budget_bytes=share, policy=policy, workers=workers, digest=digest,
                    ring_bytes=ring_bytes, direct_io=direct_io))
        except BaseException:
            for w in self.writers:
                w.shutdown(10.0)
            raise
        self.root = self.writers[0].root
        self.ready = _AllReady(self.writers)
        self._route: dict[str, ProcessCaptureWriter] = {}  # open captures -> their child
        self._next = 0

    @property
    def child_pids(self) -> list[int | None]:
        return [w.child_pid for w in self.writers]

    @property
    def failure(self) -> str | None:
        return next((w.failure for w in self.writers if w.failure is not None), None)

    # ----------------------------------------------------------------- sink API
    def open(self, request: CaptureRequest) -> None:
        writer = self._route.get(request.capture_id)
        if writer is None:
            # The fewest captures in flight, ties taken in turn from the last choice on; a
            # child that died (its captures now go to threads of this process) only when
            # every child did.
            n = len(self.writers)
            order = [self.writers[(self._next + i) % n] for i in range(n)]
            alive = [w for w in order if w.failure is None] or order
            writer = min(alive, key=lambda w: w.inflight)
            self._next = (self.writers.index(writer) + 1) % n
            self._route[request.capture_id] = writer
        writer.open(request)

    def group_of(self, capture_id: str) -> int:
        """The index of the child holding an open capture (0 when none does): the engine
        lays a step's captured rows out child by child, so each child's rows of a step
        reach its ring in one GPU copy (`merge_row_copies`)."""
        writer = self._route.get(capture_id)
        return 0 if writer is None else self.writers.index(writer)

    def write(self, capture_id: str, hook: str, layer: int, positions: np.ndarray,
              rows: torch.Tensor) -> None:
        writer = self._route.get(capture_id)
        if writer is not None:  # a writer ignores rows of captures it does not hold too
            writer.write(capture_id, hook, layer, positions, rows)

    def end_step(self) -> None:
        for w in self.writers:
            w.end_step()

    def defer_sends(self) -> bool:
        """Every child's link defers its sends (ProcessCaptureWriter.defer_sends)."""
        for w in self.writers:
            w.defer_sends()
        return True

    def flush_sends(self) -> None:
        for w in self.writers:
            w.flush_sends()

    def touch_copy_ring(self) -> bool:
        """Every child's copy ring faulted in (see ProcessCaptureWriter)."""
        return all([w.touch_copy_ring() for w in self.writers])

    def pin_device_ring(self) -> bool:
        """Every child's device ring page-locked (see ProcessCaptureWriter)."""
        return all([w.pin_device_ring() for w in self.writers])

    def reserve_rows(self, capture_id: str, shape: tuple[int, ...],
                     dtype: torch.dtype) -> DeviceRows | None:
        writer = self._route.get(capture_id)
        return None if writer is None else writer.reserve_rows(capture_id, shape, dtype)

    def reserve_span(self, capture_ids: Sequence[str], shapes: Sequence[tuple[int, ...]],
                     dtype: torch.dtype) -> tuple[torch.Tensor, list[DeviceRows]] | None:
        """`ProcessCaptureWriter.reserve_span` in the child holding these captures (the
        caller groups them by `group_of`); None unless one child holds them all."""
        writer = self._route.get(capture_ids[0]) if capture_ids else None
        if writer is None or any(self._route.get(c) is not writer for c in capture_ids[1:]):
            return None
        return writer.reserve_span(capture_ids, shapes, dtype)

    def write_reserved(self, reserved: DeviceRows, capture_id: str, hook: str, layer: int,
                       positions: np.ndarray, *, frees: bool = True) -> None:
        reserved.writer.write_reserved(reserved, capture_id, hook, layer, positions,
                                       frees=frees)

    def close(self, end: CaptureEnd) -> None:
        writer = self._route.pop(end.capture_id, None)
        if writer is not None:
            writer.close(end)

    def abort(self, capture_id: str, reason: str) -> None:
        writer = self._route.pop(capture_id, None)
        if writer is not None:
            writer.abort(capture_id, reason)

    # ------------------------------------------------------------ diagnostics
    def stats(self) -> dict[str, Any] | None:
        """The children's summed counters plus each child's own stats under "processes"."""
        each = [w.stats() for w in self.writers]
        got = [s for s in each if s is not None]
        out: dict[str, Any] = {k: sum(s.get(k) or 0 for s in got) for k in _SUMMED}
        for k in _SUMMED:
            if k.endswith("_s"):  # seconds
                out[k] = round(out[k], 6)
        out.update({"policy": got[0].get("policy") if got else None, "failure": self.failure,
                    "process": None, "processes": each})
        return out

    def engine_wait_s(self) -> dict[str, float]:
        """The children's links' engine_wait_s, summed by what was waited for."""
        out: dict[str, float] = {}
        for w in self.writers:
            for wait, seconds in w.engine_wait_s().items():
                out[wait] = out.get(wait, 0.0) + seconds
        return out

    def unwritten_receipts(self, capture_ids: Sequence[str]) -> dict[str, Receipt]:
        out: dict[str, Receipt] = {}
        for w in self.writers:
            out.update(w.unwritten_receipts(capture_ids))
        return out

    def metrics_snapshot(self) -> dict[str, Any]:
        return metrics.merge_snapshots([w.metrics_snapshot() for w in self.writers])

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every capture closed so far is published, in every child."""
        deadline = None if timeout is None else time.monotonic() + timeout
        ok = True
        for w in self.writers:  # the children publish meanwhile: the wait is the slowest's
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ok = w.flush(left) and ok
        return ok

    def shutdown(self, timeout: float | None = None) -> None:
        """Every child at once: publish what was closed, abort what is open, exit."""
        threads = [threading.Thread(target=w.shutdown, args=(timeout,), daemon=True)
                   for w in self.writers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
