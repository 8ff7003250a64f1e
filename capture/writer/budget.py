"""The in-flight byte budget of the capture writers and its overload policy.

The budget counts row bytes the capture writer holds in memory: rows of open
requests ("open") and rows of finished requests waiting to be published
("sealed"). Policies when a new chunk does not fit:
- block: wait while publishing will free enough; otherwise ask the writer to spill
  open requests to disk (waiting on them would deadlock: only the blocked engine
  thread could finish them). Never loses data; memory stays under the budget.
- drop: the request's capture is dropped (counted; its receipt says dropped).
- reject: like drop, and `admit` refuses new captures up front (HTTP 429).
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Mapping

import capsteer.capture.metrics as metrics
from capsteer.capture.spec import CaptureSpec
from capsteer.config import errors

POLICIES = ("block", "drop", "reject")
# Capture rows in flight per engine (--capture-budget): 4 GiB lets a P6 burst (3.9 GB of
# rows of an 8B model) leave the engine without waiting for publishing, and memory is held
# only while rows wait (figures: docs/performance.md).
DEFAULT_BUDGET_BYTES = 4 << 30

# Each writer process's shared-memory ring (on a GPU a second, page-locked one takes the
# engine's device copies): 1 GiB lets a P6 burst over two writer processes never wait for
# ring space. Pages become resident as rows first reach them, up to the ring's size, and
# go back when the writer is idle (docs/operations.md; figures: docs/performance.md).
DEFAULT_RING_BYTES = 1 << 30
MIN_RING_BYTES = 1 << 20  # the settings refuse less; a direct caller is rounded up


class Overloaded(errors.AtCapacity, RuntimeError):
    """The budget cannot take a new capture now (reject policy); retry later."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Grant(enum.Enum):
    TAKEN = "taken"  # bytes accounted; keep the rows in memory
    REFUSED = "refused"  # drop/reject policy and no room
    DIRECT = "direct"  # block policy, chunk alone exceeds what memory may hold: spill it


def check_budget(limit_bytes: int, policy: str) -> None:
    """ValueError unless `policy` is an overload policy and the budget is positive."""
    if policy not in POLICIES:
        raise ValueError(f"unknown overload policy {policy!r}; accepted: {', '.join(POLICIES)}")
    if limit_bytes <= 0:
        raise ValueError("budget must be positive")


def check_ring_bytes(ring_bytes: int, name: str = "a capture writer ring") -> None:
    """ValueError, naming the setting, for a writer ring below MIN_RING_BYTES."""
    if ring_bytes < MIN_RING_BYTES:
        raise ValueError(f"{name} must be at least 1MiB ({MIN_RING_BYTES} bytes); "
                         f"got {ring_bytes}")


def check_processes(processes: int, policy: str) -> None:
    """ValueError unless `processes` writer processes can serve the overload policy: they
    split the budget (capsteer.capture.writer.fanout), so under drop or reject a capture larger
    than one share would be dropped or refused where one process would keep it."""
    if processes < 1:
        raise ValueError(f"capture writer processes must be at least 1; got {processes}")
    if processes > 1 and policy != "block":
        raise ValueError(f"{processes} capture writer processes split the budget, so under "
                         f"the {policy!r} policy a capture larger than one share would be "
                         "dropped or refused; use one process or the block policy")


class Budget:
    """Thread-safe byte accounting with block / drop / reject semantics."""

    def __init__(self, limit_bytes: int, policy: str = "block") -> None:
        check_budget(limit_bytes, policy)
        self.limit = int(limit_bytes)
        self.policy = policy
        self._cond = threading.Condition()
        self.open_bytes = 0
        self.sealed_bytes = 0
        self.peak = 0
        # Rows that waited for publishing to free room (block): the disk, not the engine,
        # was the writer's limit while they did.
        self.waits = 0
        self.wait_s = 0.0

    @property
    def inflight(self) -> int:
        return self.open_bytes + self.sealed_bytes

    def _take(self, n: int) -> None:
        self.open_bytes += n
        self.peak = max(self.peak, self.inflight)
        metrics.INFLIGHT_BYTES.set(self.inflight)

    def admit(self, estimated_bytes: int) -> bool:
        """Whether a new capture of about `estimated_bytes` should be accepted now.

        Only the reject policy refuses (and counts capsteer_capture_rejected_total);
        block and drop accept and deal with overload as rows arrive.
        """
        if self.policy != "reject":
            return True
        with self._cond:
            ok = self.inflight + max(0, int(estimated_bytes)) <= self.limit
        if not ok:
            metrics.REJECTED.inc()
            metrics.REQUESTS.labels(status="rejected").inc()
        return ok

    def acquire(self, n: int, spill: Callable[[int], int]) -> Grant:
        """Account `n` more open bytes, applying the policy when they do not fit.

        `spill(k)` must move at least k bytes of open rows to disk if it can and
        return how many it freed (already released through `release_open`).
        """
        with self._cond:
            if self.inflight + n <= self.limit:
                self._take(n)
                return Grant.TAKEN
            if self.policy != "block":
                return Grant.REFUSED
            if n > self.limit:
                return Grant.DIRECT
        started: float | None = None  # when it first waited for publishing
        try:
            while True:
                with self._cond:
                    if self.inflight + n <= self.limit:
                        self._take(n)
                        return Grant.TAKEN
                    must_spill = self.open_bytes + n - self.limit
                    if must_spill <= 0:
                        # Publishing (sealed bytes) will free enough: wait for it.
                        if started is None:
                            started = time.perf_counter()
                        self._cond.wait(timeout=1.0)
                        continue
                if spill(must_spill) <= 0:
                    return Grant.DIRECT
        finally:
            if started is not None:
                with self._cond:
                    self.waits += 1
                    self.wait_s += time.perf_counter() - started

    def release_open(self, n: int) -> None:
        """Open bytes left memory (spilled, dropped, aborted)."""
        if n:
            with self._cond:
                self.open_bytes -= n
                metrics.INFLIGHT_BYTES.set(self.inflight)
                self._cond.notify_all()

    def seal(self, n: int) -> None:
        """Open bytes of a finished request now wait for publishing."""
        with self._cond:
            self.open_bytes -= n
            self.sealed_bytes += n

    def release_sealed(self, n: int) -> None:
        """Sealed bytes were written out (or abandoned)."""
        if n:
            with self._cond:
                self.sealed_bytes -= n
                metrics.INFLIGHT_BYTES.set(self.inflight)
                self._cond.notify_all()


def estimate_bytes(
    spec: CaptureSpec, hidden_size: int, itemsize: int, prompt_tokens: int, max_new_tokens: int,
    hook_widths: Mapping[str, int] | None = None,
) -> int:
    """Upper bound of the row bytes a request will hold, for `admit` and size limits."""
    kind = spec.positions.kind
    fed = prompt_tokens + max(0, max_new_tokens - 1)
    n = {
        "all": fed,
        "prompt": prompt_tokens,
        "generated": max(0, max_new_tokens - 1),
        "last_prompt": 1,
        "last": 1,
        "explicit": len(spec.positions.explicit),
    }[kind]
    return spec.row_bytes(hidden_size, itemsize, hook_widths) * n
