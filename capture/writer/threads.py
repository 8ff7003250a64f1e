"""The writer's publishing threads: a fixed FIFO pool sized for digesting at disk speed."""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable


def default_workers() -> int:
    """Writer threads: every published byte is hashed (sha256 about 1.8 GB/s a core,
    blake3 about 6; on digest threads that overlap the writes), so the pool needs
    several cores to keep up with a fast disk (bench/README.md)."""
    return max(2, min(8, (os.cpu_count() or 2) // 2))


class WorkerThreads:
    """A fixed set of daemon threads running submitted jobs in FIFO order."""

    def __init__(self, workers: int, name: str = "capsteer-writer") -> None:
        if workers < 1:
            raise ValueError("need at least one writer thread")
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._idle = threading.Condition()
        self._outstanding = 0
        self._threads = [
            threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(workers)
        ]
        for t in self._threads:
            t.start()

    def submit(self, job: Callable[[], None]) -> None:
        with self._idle:
            self._outstanding += 1
        self._queue.put(job)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                job()
            finally:
                with self._idle:
                    self._outstanding -= 1
                    self._idle.notify_all()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every submitted job finished; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._outstanding == 0, timeout)

    def stop(self, timeout: float | None = None) -> None:
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join(timeout)
