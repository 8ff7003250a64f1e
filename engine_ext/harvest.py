"""Moves captured rows off the GPU without stalling the step loop.

After each forward the step thread only enqueues a device-to-host copy of the
staging rows into a pinned ring slot and records an event; a harvester thread
waits on that event, copies the rows it needs into tensors the sink owns, and
calls the sink in step order (so a request's `close` always follows its rows).
The step thread waits only when every ring slot is still being harvested
(backpressure), never on the GPU itself.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger("vllm.capsteer")


@dataclass
class _Slot:
    rows: torch.Tensor
    tokens: torch.Tensor
    free: threading.Event
    copied: torch.cuda.Event  # recorded after this slot's copies; re-recorded only once free


class Harvester:
    """Pinned ring of staging copies plus one thread that feeds the sink in order."""

    def __init__(self, rows: int, hidden: int, dtype: torch.dtype, ring: int = 2) -> None:
        self.slots = [
            # Flat: a step's copy is [rows, cols] of the columns its routes use (engine_ext
            # .delivery), packed, so no more bytes cross the bus than they need.
            _Slot(torch.empty(rows * hidden, dtype=dtype, pin_memory=True),
                  torch.empty(rows, dtype=torch.int64, pin_memory=True), threading.Event(),
                  # sleep in the driver until the copy lands: a spinning waiter would poll
                  # the driver while the step thread launches work through it
                  torch.cuda.Event(blocking=True))
            for _ in range(ring)
        ]
        for slot in self.slots:
            slot.free.set()
        self.next = 0
        # Diagnostics: seconds the step thread waited for a free ring slot (backpressure),
        # and seconds this thread spent delivering rows to the sink (holding the GIL for
        # much of it), with the number of copies delivered.
        self.wait_s = 0.0
        self.deliver_s = 0.0
        self.copies = 0
        self.rows_copied = 0  # staging rows copied into slots (the rest went device-to-ring)
        self.queue: queue.Queue = queue.Queue()
        self.errors: list[BaseException] = []
        # Called on this thread whenever it runs out of work (before it blocks): a sink
        # that defers its sends flushes them here, once per burst instead of once per call.
        self.on_idle: Callable[[], None] | None = None
        self.thread = threading.Thread(target=self._run, name="capsteer-harvest", daemon=True)
        self.thread.start()

    def submit_copy(
        self, staging: torch.Tensor, spans: list[tuple[int, int]], tokens: torch.Tensor,
        num_tokens: int, deliver: Callable[[torch.Tensor, torch.Tensor], None],
    ) -> None:
        """Enqueue the staging row spans [start, stop) -> one pinned slot, packed in order,
        and tokens[:num_tokens], on the current stream; `deliver(rows, tokens)` gets host
        views it must copy from before returning. Only the spans the sinks still need
        cross the bus: rows already copied into writers' device rings do not."""
        slot = self.slots[self.next]
        self.next = (self.next + 1) % len(self.slots)
        if not slot.free.is_set():
            start = time.perf_counter()
            slot.free.wait()
            self.wait_s += time.perf_counter() - start
        slot.free.clear()
        rows, cols = 0, staging.shape[1]
        packed = slot.rows[: sum(e - b for b, e in spans) * cols].view(-1, cols)
        for begin, end in spans:
            packed[rows: rows + end - begin].copy_(staging[begin:end], non_blocking=True)
            rows += end - begin
        self.rows_copied += rows
        slot.tokens[:num_tokens].copy_(tokens[:num_tokens], non_blocking=True)
        slot.copied.record()
        self.queue.put((slot.copied, slot, (rows, num_tokens, cols), deliver))

    def submit_call(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the harvester thread after everything submitted before it."""
        self.queue.put((None, None, (0, 0, 1), fn))

    def stats(self) -> dict[str, float]:
        return {"wait_s": round(self.wait_s, 6), "deliver_s": round(self.deliver_s, 6),
                "copies": self.copies, "rows_copied": self.rows_copied}

    def drain(self) -> None:
        done = threading.Event()
        self.submit_call(done.set)
        done.wait()

    def _run(self) -> None:
        while True:
            if self.on_idle is not None and self.queue.empty():
                try:
                    self.on_idle()
                except BaseException as exc:  # keep harvesting; surface it to the worker
                    log.exception("capsteer: the sink's idle flush failed")
                    self.errors.append(exc)
            event, slot, (rows, num_tokens, cols), fn = self.queue.get()
            try:
                if event is None:
                    fn()
                    continue
                try:
                    event.synchronize()
                    start = time.perf_counter()
                    fn(slot.rows[: rows * cols].view(rows, cols), slot.tokens[:num_tokens])
                    self.deliver_s += time.perf_counter() - start
                    self.copies += 1
                finally:
                    slot.free.set()
            except BaseException as exc:  # keep harvesting; surface the error to the worker
                log.exception("capsteer: harvesting captured rows failed")
                self.errors.append(exc)
