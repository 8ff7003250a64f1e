"""The durable writer in a process of its own, so publishing never waits on the engine's GIL.

Why: a capturing engine's step thread calls thousands of GIL-releasing torch ops per
step, and each time it releases the GIL a writer thread of the same process can take
it and hold it for its next Python segment (manifest, plan, syscall bookkeeping). On
the H200 that kept the step thread off the CPU for 0.4-0.65 s of a 3.6 s capture batch
(bench/results/h200-2026-11-25-session23.md). Here the engine process keeps only a
thin `ProcessCaptureWriter`: each `write` copies the rows into a shared-memory ring (one
memcpy, GIL released) and sends a short message on a socket; a child process runs
the unchanged `CaptureWriter` (writer threads, digests, fsyncs, manifests, receipts).

Neither side wakes a thread pool for its copies: an OpenMP team spins on its cores
after every parallel copy, and that spinning took CPU the step thread needed. The
parent copies with one memmove (`layouts.copy_rows`); the child runs with one intra-op
thread (bench/results/h100-2026-11-25-session25.md).

Protocol (pickled tuples on one socket pair, in order):
  parent -> child  ("open", CaptureRequest) | ("writes", [(id, hook, layer, positions,
                   dtype, shape, offset, end), ...]) | ("write_bytes", id, hook, layer,
                   positions, dtype, shape, bytes) | ("close", CaptureEnd) |
                   ("abort", id, reason) | ("many", [open, writes, close or abort
                   messages, in order]) | ("flush", n, timeout) | ("shutdown", timeout)
  child -> parent  ("ready", pid) | ("done", [ids]) | ("reply", n, value, error)
A second socket pair carries diagnostics out of band: (n, "stats" | "metrics") answered
by (n, value, error) from a thread of the child, so a scrape never waits behind rows.
The shared memory holds a header and two rings. The copy ring takes rows `write()`
copies in (the sink thread's memmove). The device ring, page-locked for CUDA, takes
rows the engine's GPU copies into it directly (`reserve_rows` on the step thread, then
`write_reserved` on the sink thread once the copy landed): the engine process then does
no bulk copy at all. A "writes" entry names its rows by offset from the start of the
shared memory; its end is the copy ring's logical end, or minus the device ring's. The
header's first two 8-byte words hold how far the child has consumed each ring: the
child copies a write's rows out (CaptureWriter.write always copies) and only then
advances it; the parent reuses ring bytes only below it (x86 store order is enough).
Each ring has one producer thread, so its entries reach the child in reservation order.

If the child dies, the parent notices (socket EOF), writes an error outcome for every
capture the child had not reported done, through an in-process `CaptureWriter`, and
keeps serving on that writer: no capture is left pending and none is silently lost.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import functools
import gc
import json
import logging
import math
import os
import pickle
import queue
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import torch

from capsteer.capture import metrics
from capsteer.capture.layouts import copy_rows
from capsteer.capture.sink import CaptureEnd, CaptureRequest, CaptureSink
from capsteer.capture.writer.budget import (
    DEFAULT_BUDGET_BYTES,
    DEFAULT_RING_BYTES,
    MIN_RING_BYTES,
    check_budget,
)

log = logging.getLogger(__name__)

_HEADER = 4096  # the consumed counters (copy ring at 0, device ring at 8), then the rings
_PAGE = 4096
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14; Python's mmap module does not name it
_ALIGN = 64
_DONE_BATCH_S = 0.02  # the child reports finished captures at most this often
_CALL_TIMEOUT_S = 30.0
_MAX_BATCH = 256  # ring writes per message at most
IDLE_TRIM_S = 30.0  # the child hands freed heap back to the system after this long idle
# Messages the child has read off the link but not handled yet, at most (one larger
# message still enters an empty inbox). Rows travel in the rings; messages carry their
# offsets, so this holds many steps of them.
INBOX_BYTES = 64 << 20


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _place(head: int, n: int, ring_bytes: int) -> tuple[int, int]:
    """(physical offset, logical end) of n ring bytes from logical `head`: a write never
    wraps inside itself, so one that would is placed at the ring's start (the tail is
    skipped)."""
    phys = head % ring_bytes
    if phys + n > ring_bytes:
        head += ring_bytes - phys
        phys = 0
    return phys, head + n


def _dumps(msg: tuple) -> bytes:
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


@dataclass
class DeviceRows:
    """Device-ring space reserved for one write's rows (`ProcessCaptureWriter.reserve_rows`,
    or one write's part of `reserve_span`): `rows` is the page-locked host view the
    engine's GPU copy fills. Handing it over needs only the numbers (no tensor view)."""

    writer: ProcessCaptureWriter
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int  # from the start of the shared memory (what a "writes" entry names)
    end: int  # logical end, for the child's consumed counter

    @property
    def rows(self) -> torch.Tensor:
        start = self.offset - _HEADER - self.writer.ring_bytes
        nbytes = math.prod(self.shape) * self.dtype.itemsize
        return self.writer._dring[start:start + nbytes].view(self.dtype).view(self.shape)


class ProcessCaptureWriter(CaptureSink):
    """A `CaptureSink` whose `CaptureWriter` runs in a child process (see module doc).

    Same constructor arguments as `CaptureWriter` (forwarded to the child), plus
    `ring_bytes`: the shared-memory ring rows cross in (a larger write is sent inline).
    A step's writes go out as one message at `end_step` (or before any other message,
    or when the ring must wait), so the engine's sink thread wakes the child once a step.
    """

    copies_rows = True  # write() copies the rows before it returns: callers pass views
    supports_spans = True  # reserve_span takes a step's rows of one point at once

    def __init__(self, root: str | Path, *, budget_bytes: int = DEFAULT_BUDGET_BYTES,
                 policy: str = "block",
                 workers: int | None = None, digest: str = "sha256",
                 ring_bytes: int = DEFAULT_RING_BYTES, direct_io: bool = False,
                 idle_trim_s: float = IDLE_TRIM_S) -> None:
        from capsteer.capture.publish import check_digest

        check_budget(budget_bytes, policy)  # here, not as a failover when the child starts
        check_digest(digest)
        if not 0 < idle_trim_s < 86400:
            raise ValueError(f"idle_trim_s must be above 0 and below a day, not {idle_trim_s}")
        self.root = Path(root).resolve()
        self._writer_kwargs: dict[str, Any] = {"budget_bytes": budget_bytes, "policy": policy,
                                               "workers": workers, "digest": digest,
                                               "direct_io": direct_io}
        self.ring_bytes = -(-max(ring_bytes, MIN_RING_BYTES) // _PAGE) * _PAGE
        # Two rings after the header: the copy ring (write() copies rows in) and the device
        # ring (the engine's GPU copies rows straight into it, see reserve_rows).
        self._fd = os.memfd_create("capsteer-capture-ring", os.MFD_CLOEXEC)
        os.ftruncate(self._fd, _HEADER + 2 * self.ring_bytes)
        import mmap

        self._mm = mmap.mmap(self._fd, _HEADER + 2 * self.ring_bytes)
        self._ring = torch.frombuffer(self._mm, dtype=torch.uint8, offset=_HEADER,
                                      count=self.ring_bytes)
        self._dring = torch.frombuffer(self._mm, dtype=torch.uint8,
                                       offset=_HEADER + self.ring_bytes, count=self.ring_bytes)
        self._head = 0  # logical bytes handed to the child (monotonic)
        self._dhead = 0  # the device ring's: reserved by the engine's step thread only
        self._device_rows = False  # the device ring is page-locked for the GPU's copies
        self._pending: list[tuple] = []  # this step's ring writes, not sent yet
        # Deferred sends (defer_sends): closes, aborts and whole steps' writes wait here,
        # in order, for flush_sends, which sends them with the queued opens as one message.
        self._deferred = False
        self._outbox: list[tuple] = []
        self._opens: collections.deque[tuple] = collections.deque()  # queued without a lock
        ours, theirs = socket.socketpair()
        self._conn = Connection(ours.detach())
        child_fd = theirs.detach()
        # Diagnostics (stats, metrics) on a socket of their own, answered by a thread of the
        # child: a scrape never waits behind queued rows or for the sink thread's lock.
        ctl_ours, ctl_theirs = socket.socketpair()
        self._ctl = Connection(ctl_ours.detach())
        ctl_fd = ctl_theirs.detach()
        self._ctl_lock = threading.Lock()
        self._ctl_seq = 0
        config = {"root": str(self.root), "ring_bytes": self.ring_bytes,
                  "idle_trim_s": idle_trim_s, **self._writer_kwargs}
        from capsteer.capture.manifest import ENGINE_PID_ENV

        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", ENGINE_PID_ENV: str(os.getpid()),
               **_ONE_THREAD_ENV}
        # The child imports capsteer from this process's sys.path, in its order: `-m` would
        # put the working directory first, where a source checkout's capsteer/ folder can
        # shadow the package this process runs.
        boot = (f"import sys; sys.path[:0] = {[p for p in sys.path if p]!r}; "
                "from capsteer.capture.writer_process import main; main()")
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", boot,
                 "--sock-fd", str(child_fd), "--ctl-fd", str(ctl_fd), "--ring-fd", str(self._fd),
                 "--config", json.dumps(config)],
                pass_fds=(child_fd, ctl_fd, self._fd), env=env, stdin=subprocess.DEVNULL)
        finally:
            os.close(child_fd)
            os.close(ctl_fd)
        self._send_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._inflight: dict[str, CaptureRequest] = {}  # opened, not reported done by the child
        self._calls: dict[int, Future[Any]] = {}
        self._next_call = 0
        self._fallback: Any = None  # the in-process CaptureWriter after the child died
        self.failure: str | None = None
        self._closing = False
        self._last_metrics: dict[str, Any] = {}
        self.ready = threading.Event()
        self.child_pid: int | None = None
        self.ring_waits = 0  # writes that waited for the child to free ring space
        self.ring_wait_s = 0.0  # and the seconds they waited
        self.inline_writes = 0  # writes too large for the ring, sent on the socket
        self.copy_s = 0.0  # seconds copying rows into the ring (the sink thread's bulk work)
        self.device_writes = 0  # writes whose rows the GPU copied into the device ring
        self.device_full = 0  # reservations refused for want of device ring space
        self.send_s = 0.0  # seconds serializing and sending messages to the child
        self.sends = 0  # messages sent to the child
        self._reader = threading.Thread(target=self._read_loop, name="capsteer-writer-link", daemon=True)
        self._reader.start()

    @property
    def inflight(self) -> int:
        """Captures opened and not yet reported done by the child (ProcessWriterPool
        routes a new capture to the child with the fewest)."""
        return len(self._inflight)

    # ----------------------------------------------------------------- sink API
    def open(self, request: CaptureRequest) -> None:
        if request.dir_time is None:  # the parent dates it, so a failover finds the same dir
            from dataclasses import replace

            request = replace(request, dir_time=time.time())
        with self._state_lock:
            fallback = self._fallback
            if fallback is None:  # before the send: a failover from here on aborts it
                self._inflight[request.capture_id] = request
        if fallback is not None:
            fallback.open(request)
            return
        # The engine's step thread opens captures: it must never wait for the send lock,
        # which the sink thread holds while it copies rows. Every send drains these first,
        # and a capture's rows and close are sent after its open was queued, so the child
        # still sees the open first.
        self._opens.append(("open", request))

    def write(self, capture_id: str, hook: str, layer: int, positions: np.ndarray,
              rows: torch.Tensor) -> None:
        if self._fallback is not None:
            self._fallback.write(capture_id, hook, layer, positions, rows)
            return
        pos = np.ascontiguousarray(positions, dtype=np.int64).reshape(-1)
        nbytes = rows.numel() * rows.element_size()
        shape, dtype = tuple(rows.shape), rows.dtype
        if 2 * _align(nbytes) > self.ring_bytes:  # the child's copy-out needs this (see _serve)
            self.inline_writes += 1
            data = rows.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
            self._send(("write_bytes", capture_id, hook, int(layer), pos, dtype, shape, data))
            return
        with self._send_lock:  # one producer at a time owns the ring's head
            offset, end = self._reserve(_align(nbytes))
            if offset < 0:
                return  # the child died while we waited; the fallback took over
            if nbytes:
                started = time.perf_counter()
                copy_rows(self._ring[offset:offset + nbytes].view(dtype).view(shape), rows)
                self.copy_s += time.perf_counter() - started
            self._queue_locked((capture_id, hook, int(layer), pos, dtype, shape,
                                _HEADER + offset, end))

    def end_step(self) -> None:
        """The step's rows are all written: send them to the child as one message (with
        deferred sends, at the next flush_sends)."""
        if self._deferred:
            return
        with self._send_lock:
            self._send_pending_locked()

    def defer_sends(self) -> bool:
        """Hold closes, aborts and step ends until `flush_sends`, which sends everything
        queued as one message. For a caller that runs many of them back to back on one
        thread (the engine's harvester: a prefill step's writes and its 16 closes) and
        flushes when it runs out of work: one pickle and one send instead of one each, on
        a thread that holds the GIL the engine's step thread needs. Anything that must
        reach the child now (flush, shutdown, a full ring) still sends what is queued."""
        self._deferred = True
        return True

    def flush_sends(self) -> None:
        """Send every queued open, write, close and abort now (one message)."""
        with self._send_lock:
            self._send_pending_locked()

    def touch_copy_ring(self) -> bool:
        """Fault in every page of the header and copy ring now, keeping their contents.
        Otherwise the sink thread faults them in over the first `ring_bytes` of copied
        rows, once in the writer's life (on an H100 host about 0.5-0.7 s of CPU a GiB); a
        benchmark that starts a fresh writer calls this so its timed window sees the
        writer as a server has it after that. False where the kernel refuses
        MADV_POPULATE_WRITE (before Linux 5.14). Holds the GIL while the kernel works."""
        try:
            self._mm.madvise(_MADV_POPULATE_WRITE, 0, _HEADER + self.ring_bytes)
        except OSError:
            return False
        return True

    # ------------------------------------------------- rows copied by the GPU
    def pin_device_ring(self) -> bool:
        """Page-lock the device ring for CUDA, so the engine's asynchronous device-to-host
        copies land in it directly (no host copy in the engine process, whose GIL the
        step thread needs). False (the copy path stays) where that cannot be done."""
        if self._device_rows:
            return True
        try:
            cudart = torch.cuda.cudart()
            err = cudart.cudaHostRegister(self._dring.data_ptr(), self.ring_bytes, 0)
            if int(getattr(err, "value", err)) != 0:
                log.warning("capsteer: cudaHostRegister of the capture ring failed (%s); "
                            "captured rows take the host copy", err)
                return False
        except Exception as exc:  # no CUDA here: the copy path
            log.warning("capsteer: capture ring not page-locked (%r); captured rows take the "
                        "host copy", exc)
            return False
        self._device_rows = True
        return True

    def reserve_rows(self, capture_id: str, shape: tuple[int, ...],
                     dtype: torch.dtype) -> DeviceRows | None:
        """Device-ring space for one write's rows, for the engine's step thread to copy
        the rows into (asynchronously) before `write_reserved` hands them to the child
        once the copy landed. Never waits: None when the ring is not page-locked, the
        write is too large, or the ring is full (the caller takes the copy path)."""
        if not self._device_rows or self._fallback is not None:
            return None
        nbytes = math.prod(shape) * dtype.itemsize  # per route: np.prod costs ~4 us
        size = _align(nbytes)
        if 2 * size > self.ring_bytes or not nbytes:
            return None
        taken = self._take_device(size)
        if taken is None:
            self.device_full += 1
            return None
        phys, end = taken
        return DeviceRows(self, tuple(shape), dtype, _HEADER + self.ring_bytes + phys, end)

    def _take_device(self, size: int) -> tuple[int, int] | None:
        """(physical offset, logical end) of `size` device-ring bytes, taken; None while
        the child has not yet freed that much."""
        phys, end = _place(self._dhead, size, self.ring_bytes)
        if end - struct.unpack_from("<Q", self._mm, 8)[0] > self.ring_bytes:
            return None
        self._dhead = end
        return phys, end

    def group_of(self, capture_id: str) -> int:
        """One child: every capture's rows go to this ring (as `ProcessWriterPool.group_of`)."""
        return 0

    def reserve_span(self, capture_ids: Sequence[str], shapes: Sequence[tuple[int, ...]],
                     dtype: torch.dtype) -> tuple[torch.Tensor, list[DeviceRows]] | None:
        """One device-ring reservation for several writes in a row (a step's rows of
        several captures at one point, which the plan lays out next to each other): one
        GPU copy fills the returned (rows, hidden) view, and each DeviceRows hands one
        write's part over. Each part ends where its rows end, so the child frees the span
        write by write, as it frees separate reservations. Never waits: None as
        `reserve_rows` (the caller reserves write by write then). Per write this costs a
        few integer sums instead of a tensor view each and a merge of the copies."""
        if not self._device_rows or self._fallback is not None or not shapes:
            return None
        item = dtype.itemsize
        sizes = [math.prod(shape) * item for shape in shapes]
        total = sum(sizes)
        size = _align(total)
        if 2 * size > self.ring_bytes or not total:
            return None
        taken = self._take_device(size)
        if taken is None:
            return None  # device_full counts the per-write tries the caller makes next
        phys, end = taken
        base, start = _HEADER + self.ring_bytes + phys, end - size
        parts, at = [], 0
        for shape, nbytes in zip(shapes, sizes, strict=True):
            parts.append(DeviceRows(self, tuple(shape), dtype, base + at, start + at + nbytes))
            at += nbytes
        parts[-1].end = end  # the alignment padding goes with the last write
        rows = sum(shape[0] for shape in shapes)
        return self._dring[phys:phys + total].view(dtype).view(rows, *shapes[0][1:]), parts

    def write_reserved(self, reserved: DeviceRows, capture_id: str, hook: str, layer: int,
                       positions: np.ndarray, *, frees: bool = True) -> None:
        """`write` of reserved rows the GPU copy has filled (the caller waited for it).
        Every reservation is handed over, in reservation order: the child advances the
        device ring past it once it took the rows. Rows written under several (hook,
        layer) keys are handed over once a key, and only the last (`frees`) may advance
        the ring: else the engine could copy new rows over them before the child took
        them for the next key."""
        pos = np.ascontiguousarray(positions, dtype=np.int64).reshape(-1)
        with self._send_lock:
            if self._fallback is not None:
                self._fallback.write(capture_id, hook, layer, pos, reserved.rows)
                return
            self.device_writes += 1
            self._queue_locked((capture_id, hook, int(layer), pos, reserved.dtype,
                                reserved.shape, reserved.offset,
                                -reserved.end if frees else None))

    def close(self, end: CaptureEnd) -> None:
        if self._fallback is not None:
            self._fallback.close(end)
            return
        self._send_or_defer(("close", end))

    def abort(self, capture_id: str, reason: str) -> None:
        if self._fallback is not None:
            self._fallback.abort(capture_id, reason)
            return
        self._send_or_defer(("abort", capture_id, reason))

    # ------------------------------------------------------------ diagnostics
    def stats(self) -> dict[str, Any] | None:
        """The child writer's stats (CaptureWriter.stats) plus this link's counters."""
        own = {"process": self.child_pid, "failure": self.failure, "ring_bytes": self.ring_bytes,
               "ring_waits": self.ring_waits, "ring_wait_s": round(self.ring_wait_s, 6),
               "inline_writes": self.inline_writes, "copy_s": round(self.copy_s, 6),
               "send_s": round(self.send_s, 6), "sends": self.sends,
               "device_writes": self.device_writes,
               "device_full": self.device_full}
        if self._fallback is not None:
            return {**self._fallback.stats(), **own}
        got = self._control("stats", _CALL_TIMEOUT_S)
        return None if got is None else {**got, **own}

    def engine_wait_s(self) -> dict[str, float]:
        """Seconds the engine's threads waited for the child to free ring space (and for
        the in-process writer's budget after the child died), read in this process only:
        no call to the child (capsteer_capture_engine_wait_seconds_total)."""
        fallback = self._fallback.engine_wait_s() if self._fallback is not None else {}
        return {"writer_ring": self.ring_wait_s, **fallback}

    def metrics_snapshot(self) -> dict[str, Any]:
        """The child's capture metrics (metrics.snapshot shape); the last good one if it
        does not answer, so counters never go backwards on a slow scrape."""
        if self._fallback is None:
            got = self._control("metrics", 5.0)
            if got is not None:
                self._last_metrics = got
        return self._last_metrics

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every capture closed so far is published."""
        if self._fallback is not None:
            return bool(self._fallback.flush(timeout))
        got = self._call("flush", timeout, timeout=None if timeout is None else timeout + 5.0)
        return bool(got)

    def shutdown(self, timeout: float | None = None) -> None:
        """Publish what was closed, abort what is open, and let the child exit."""
        self._closing = True
        if self._fallback is None:
            try:
                self._send(("shutdown", timeout))
            except OSError:
                pass
            try:
                self.proc.wait(None if timeout is None else timeout + 10.0)
            except subprocess.TimeoutExpired:
                log.error("capsteer: capture writer process %d did not exit; killing it", self.proc.pid)
                self.proc.kill()
        else:
            self._fallback.shutdown(timeout)
        self._reader.join(5.0)

    # -------------------------------------------------------------- internals
    def _consumed(self) -> int:
        return struct.unpack_from("<Q", self._mm, 0)[0]

    def _reserve(self, n: int) -> tuple[int, int]:
        """(physical offset, logical end) of n free ring bytes (caller holds the send
        lock); waits for the child to consume older writes. (-1, -1) if the child died."""
        phys, end = _place(self._head, n, self.ring_bytes)
        if end - self._consumed() > self.ring_bytes:
            self.ring_waits += 1
            started = time.perf_counter()
            self._send_pending_locked()  # the child can only free what it was sent
            try:
                while end - self._consumed() > self.ring_bytes:
                    if self._fallback is not None or self.failure is not None:
                        return -1, -1
                    time.sleep(0.0002)
            finally:
                self.ring_wait_s += time.perf_counter() - started
        self._head = end
        return phys, end

    def _queue_locked(self, entry: tuple) -> None:
        """A "writes" entry for this step's message (caller holds the send lock)."""
        self._pending.append(entry)
        if len(self._pending) >= _MAX_BATCH:
            self._send_pending_locked()

    def _send(self, msg: tuple) -> None:
        with self._send_lock:
            self._send_locked(msg)

    def _send_or_defer(self, msg: tuple) -> None:
        with self._send_lock:
            if not self._deferred:
                self._send_locked(msg)
                return
            if self._pending:  # the rows written before it go first
                self._outbox.append(("writes", self._pending))
                self._pending = []
            self._outbox.append(msg)
            if len(self._outbox) >= _MAX_BATCH:  # a caller that never runs out of work
                self._send_pending_locked()

    def _send_pending_locked(self) -> None:
        """Send the queued opens (first: every later message concerns an opened capture),
        then the deferred messages and this step's writes, in order: as one message when
        there are several."""
        msgs = []
        while self._opens:
            msgs.append(self._opens.popleft())
        msgs += self._outbox
        self._outbox = []
        if self._pending:
            msgs.append(("writes", self._pending))
            self._pending = []
        if len(msgs) == 1:
            self._send_raw_locked(msgs[0])
        elif msgs:
            self._send_raw_locked(("many", msgs))

    def _send_locked(self, msg: tuple) -> None:
        """Send `msg` after this step's pending writes (a close follows its rows)."""
        self._send_pending_locked()
        self._send_raw_locked(msg)

    def _send_raw_locked(self, msg: tuple) -> None:
        if self._fallback is not None:
            return  # the failover already gave every capture of this message its outcome
        started = time.perf_counter()
        self.sends += 1
        try:
            self._conn.send_bytes(_dumps(msg))
        except OSError as exc:
            # Every capture this message concerns was opened before it, so it is in
            # _inflight and the failover gives it its error outcome; nothing to replay.
            self._fail(f"capture writer process unreachable: {exc!r}")
        finally:
            self.send_s += time.perf_counter() - started

    def _call(self, name: str, *args: Any, timeout: float | None = _CALL_TIMEOUT_S) -> Any:
        fut: Future[Any] = Future()
        with self._state_lock:
            n = self._next_call = self._next_call + 1
            self._calls[n] = fut
        try:
            self._send((name, n, *args))
            if self._fallback is not None and not fut.done():  # sent to no one
                raise RuntimeError(self.failure or "capture writer process gone")
            return fut.result(timeout)
        except Exception as exc:
            log.warning("capsteer: capture writer process call %s failed: %r", name, exc)
            return None
        finally:
            with self._state_lock:
                self._calls.pop(n, None)

    def _control(self, name: str, timeout: float) -> Any:
        """A diagnostics call on the control socket; None on timeout or a dead child (a
        late answer is recognised by its number and dropped by the next call)."""
        with self._ctl_lock:
            self._ctl_seq += 1
            seq = self._ctl_seq
            deadline = time.monotonic() + timeout
            try:
                self._ctl.send_bytes(_dumps((seq, name)))
                while self._ctl.poll(max(0.0, deadline - time.monotonic())):
                    got_seq, value, error = pickle.loads(self._ctl.recv_bytes())
                    if got_seq != seq:
                        continue  # the answer to a call that timed out
                    if error is not None:
                        raise RuntimeError(error)
                    return value
                log.warning("capsteer: capture writer process did not answer %s in %.0f s",
                            name, timeout)
            except (OSError, EOFError, RuntimeError) as exc:
                log.warning("capsteer: capture writer process call %s failed: %r", name, exc)
            return None

    def _read_loop(self) -> None:
        try:
            while True:
                msg = pickle.loads(self._conn.recv_bytes())
                kind = msg[0]
                if kind == "done":
                    with self._state_lock:
                        for cid in msg[1]:
                            self._inflight.pop(cid, None)
                elif kind == "reply":
                    _, n, value, error = msg
                    with self._state_lock:
                        fut = self._calls.get(n)
                    if fut is not None and not fut.done():
                        if error is None:
                            fut.set_result(value)
                        else:
                            fut.set_exception(RuntimeError(error))
                elif kind == "ready":
                    self.child_pid = int(msg[1])
                    self.ready.set()
        except (EOFError, OSError) as exc:
            if not self._closing:
                try:
                    code = self.proc.wait(1.0)  # a broken link is most often a dead child
                except subprocess.TimeoutExpired:
                    code = None
                self._fail(f"capture writer process exited (code {code}): {exc!r}"
                           if code is not None else f"capture writer process link broke: {exc!r}")

    def _fail(self, reason: str) -> None:
        """Switch to an in-process writer; every capture the child had not finished
        gets an error outcome there (an outcome already on disk is kept)."""
        from capsteer.capture.writer.local import CaptureWriter

        with self._state_lock:
            if self._fallback is not None:
                return
            self.failure = reason
            log.error("capsteer: %s; captures it held end with an error, new captures are "
                      "published by threads of the engine process", reason)
            # No sweep here: the engine's step thread may be waiting on this lock, and a
            # large root takes long to walk; the dead child's temp files (hidden, named by
            # its pid) are swept when a writer next starts on the root.
            fallback = CaptureWriter(self.root, sweep=False, **self._writer_kwargs)
            for request in self._inflight.values():
                fallback.open(request)
                fallback.abort(request.capture_id, reason)
            self._inflight.clear()
            calls, self._calls = self._calls, {}
            self._fallback = fallback
        for fut in calls.values():
            if not fut.done():
                fut.set_exception(RuntimeError(reason))
        try:
            self.proc.kill()
        except OSError:
            pass


# ---------------------------------------------------------------------- child
_FULL_COLLECTIONS_AT_FREEZE = [0]  # full collections before the freeze (imports) are not the writer's


def _freeze_imports() -> None:
    """Collect once, then freeze what survives (torch, numpy: ~170k objects that live as long
    as the process) out of the collector's walks: a full collection then walks only what
    the writer allocates, instead of stalling all its threads on the GIL for tens of ms."""
    gc.collect()
    gc.freeze()
    _FULL_COLLECTIONS_AT_FREEZE[0] = gc.get_stats()[2]["collections"]


# glibc malloc's mallopt parameters (malloc.h) and its ceiling on the mmap threshold
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_MAX = 32 << 20
_HEAP = {"heap_kept": False, "heap_trims": 0}


@functools.cache
def _malloc_calls() -> tuple[Any, Any]:
    """glibc's mallopt and malloc_trim (each None where the C library has none)."""
    from capsteer.capture.publish import libc_function

    return (libc_function("mallopt", [ctypes.c_int, ctypes.c_int]),
            libc_function("malloc_trim", [ctypes.c_size_t]))


def _keep_freed_heap() -> bool:
    """Keep freed memory in the heap, to be reused, instead of giving it back to the
    system at each free. The main thread copies every write's rows out of the ring into a
    fresh tensor; with glibc's defaults those copies often land in newly faulted pages,
    zeroed by the kernel: 550-1,300 us a 1 MiB copy against 93-160 us into reused pages
    (bench/heap_reuse.py, 2-core CPU machine). Rows up to 32 MiB (glibc's ceiling) then come
    from the heap; the heap is trimmed when the child goes idle (`_trim_heap`). False
    where the C library has no mallopt (not glibc) or refuses these values: its defaults
    stay."""
    mallopt = _malloc_calls()[0]
    if mallopt is None:
        return False
    kept = (mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) == 1
            and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1)
    _HEAP["heap_kept"] = kept
    return kept


def _trim_heap() -> None:
    """Give the heap's free pages back to the system: an idle writer holds no more
    memory than its open captures need."""
    trim = _malloc_calls()[1]
    if trim is not None:
        trim(0)
        _HEAP["heap_trims"] += 1


# The main thread's handling of the engine's messages (taking rows out of the ring among
# them): wall and thread CPU seconds. Wall well above CPU is time it waited for the GIL
# or a capture's lock while the engine side may be waiting for ring space.
# inbox_peak_bytes: the most message bytes the inbox held at once, read off the link but
# not yet handled (how far ahead of the child the engine's sends got without waiting).
_INTAKE = {"intake_messages": 0, "intake_s": 0.0, "intake_cpu_s": 0.0, "inbox_peak_bytes": 0}


def _child_stats() -> dict[str, float]:
    """What only the child knows: its collector (what it froze at start, how often it
    walked the rest in full since: each a pause of every writer thread on the GIL) and
    its main thread's intake."""
    return {"gc_frozen_objects": gc.get_freeze_count(),
            "gc_full_collections": gc.get_stats()[2]["collections"] - _FULL_COLLECTIONS_AT_FREEZE[0],
            "intake_messages": _INTAKE["intake_messages"],
            "intake_s": round(_INTAKE["intake_s"], 6),
            "intake_cpu_s": round(_INTAKE["intake_cpu_s"], 6),
            "inbox_peak_bytes": _INTAKE["inbox_peak_bytes"],
            **_HEAP}


def _answer_control(ctl: Connection, writer: Any) -> None:
    """The child's diagnostics thread: stats and metrics while the main loop moves rows."""
    while True:
        try:
            seq, name = pickle.loads(ctl.recv_bytes())
        except (EOFError, OSError):
            return
        try:
            if name == "stats":
                value, error = {**writer.stats(), **_child_stats()}, None
            elif name == "metrics":
                value, error = metrics.snapshot(), None
            else:
                value, error = None, f"unknown control call {name!r}"
        except Exception as exc:  # the caller gets the error
            value, error = None, f"{type(exc).__name__}: {exc}"
        try:
            ctl.send_bytes(_dumps((seq, value, error)))
        except OSError:
            return


# The child's copies run on its calling threads: no OpenMP or BLAS team that would spin
# on other cores after each parallel region.
_ONE_THREAD_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


class _Inbox:
    """The child's messages read off the link, in order, bounded by INBOX_BYTES.

    A thread of the child reads the link into it as fast as the engine sends, so the
    engine's send returns once its bytes are in, not once the child has handled every
    earlier message (its harvester and step thread waited behind that before). What
    holds the engine back is then the rings' space, counted where it waits (ring_wait_s),
    or a full inbox, which blocks the reader and so the engine's send as before."""

    IDLE = object()  # get: nothing came within the timeout
    EOF = object()  # get: the link is closed

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.items: collections.deque[Any] = collections.deque()
        self.bytes = 0
        self.peak = 0  # the most bytes held at once
        self.cond = threading.Condition()

    def put(self, data: Any, size: int = 0) -> None:
        with self.cond:
            while self.items and self.bytes + size > self.limit:
                self.cond.wait()
            self.items.append((data, size))
            self.bytes += size
            self.peak = max(self.peak, self.bytes)
            self.cond.notify_all()

    def get(self, timeout: float | None = None) -> Any:
        with self.cond:
            if not self.cond.wait_for(lambda: self.items, timeout):
                return self.IDLE
            data, size = self.items.popleft()
            self.bytes -= size
            self.cond.notify_all()
            return data

    def read_from(self, conn: Connection) -> None:
        """Reader thread: every message off `conn`, then EOF (closed or broken link)."""
        try:
            while True:
                data = conn.recv_bytes()
                self.put(data, len(data))
        except (EOFError, OSError):
            self.put(self.EOF)


def _serve(sock_fd: int, ctl_fd: int, ring_fd: int, config: dict[str, Any]) -> None:
    import mmap

    from capsteer.capture.writer.local import CaptureWriter

    conn = Connection(sock_fd)
    ring_bytes = int(config.pop("ring_bytes"))
    idle_trim_s = float(config.pop("idle_trim_s"))
    if not _keep_freed_heap():
        log.info("capsteer writer process: the C library's malloc could not be set to keep "
                 "freed memory (not glibc's mallopt, or it refused); its own policy decides "
                 "whether rows reuse freed memory")
    mm = mmap.mmap(ring_fd, _HEADER + 2 * ring_bytes)
    rings = torch.frombuffer(mm, dtype=torch.uint8)  # both rings, addressed from the header
    writer = CaptureWriter(config.pop("root"), **config)
    send_lock = threading.Lock()
    finished: queue.SimpleQueue[str | None] = queue.SimpleQueue()

    def send(msg: tuple) -> None:
        with send_lock:
            conn.send_bytes(_dumps(msg))

    def report_done() -> None:
        """Finished ids in batches, so the engine's link thread wakes rarely."""
        while True:
            cid = finished.get()
            ids = [] if cid is None else [cid]
            time.sleep(_DONE_BATCH_S)
            stop = cid is None
            while True:
                try:
                    more = finished.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                else:
                    ids.append(more)
            if ids:
                try:
                    send(("done", ids))
                except OSError:
                    return
            if stop:
                return

    reporter = threading.Thread(target=report_done, name="capsteer-writer-done", daemon=True)
    reporter.start()
    threading.Thread(target=_answer_control, args=(Connection(ctl_fd), writer),
                     name="capsteer-writer-control", daemon=True).start()
    _freeze_imports()
    send(("ready", os.getpid()))

    def handle(msg: tuple) -> None:
        kind = msg[0]
        if kind == "writes":
            for cid, hook, layer, pos, dtype, shape, offset, end in msg[1]:
                nbytes = math.prod(shape) * dtype.itemsize
                rows = rings[offset:offset + nbytes].view(dtype).view(shape)
                if 2 * nbytes >= ring_bytes:  # CaptureWriter.write copies rows of a larger
                    rows = rows.clone()       # storage; the parent keeps writes below half
                try:
                    writer.write(cid, hook, layer, pos, rows)  # copies the rows out
                except Exception as exc:  # the capture ends with an error, the step goes on
                    log.exception("capsteer writer process: write for %s failed", cid)
                    writer.abort(cid, f"rows could not be taken: {type(exc).__name__}: {exc}")
                finally:  # a negative end is the device ring's (its counter at 8); None:
                    if end is not None:  # the same rows follow under another key
                        struct.pack_into("<Q", mm, 8 if end < 0 else 0, abs(end))
        elif kind == "many":  # deferred sends: each in order, one failing alone
            for one in msg[1]:
                try:
                    handle(one)
                except Exception:
                    log.exception("capsteer writer process: handling %s failed", one[0])
        elif kind == "write_bytes":
            _, cid, hook, layer, pos, dtype, shape, data = msg
            rows = torch.frombuffer(bytearray(data), dtype=dtype).view(shape)
            writer.write(cid, hook, layer, pos, rows)
        elif kind == "open":
            request = msg[1]
            writer.open(request)
            writer.add_done_callback(request.capture_id, lambda r: finished.put(r.capture_id))
        elif kind == "close":
            writer.close(msg[1])
        elif kind == "abort":
            writer.abort(msg[1], msg[2])
        elif kind == "flush":  # in order: after every row and close sent before it
            _, n, timeout = msg
            try:
                send(("reply", n, writer.flush(timeout), None))
            except Exception as exc:
                send(("reply", n, None, f"{type(exc).__name__}: {exc}"))

    inbox = _Inbox(INBOX_BYTES)
    threading.Thread(target=inbox.read_from, args=(conn,), name="capsteer-writer-inbox",
                     daemon=True).start()
    shutdown_timeout: float | None = None
    trim_due = False  # a message came in since the last trim, or rows were held at it
    while True:
        data = inbox.get(idle_trim_s if trim_due else None)
        if data is _Inbox.IDLE:
            _trim_heap()
            # rows still held free their memory when published: trim again then
            trim_due = writer.budget.inflight > 0
            continue
        if data is _Inbox.EOF:
            break  # the engine process is gone: publish what was closed, abort the rest
        _INTAKE["inbox_peak_bytes"] = inbox.peak
        msg = pickle.loads(data)
        if msg[0] == "shutdown":
            shutdown_timeout = msg[1]
            break
        started, started_cpu = time.perf_counter(), time.thread_time()
        try:
            handle(msg)
        except OSError:
            raise
        except Exception:  # one bad message must not take every other capture down
            log.exception("capsteer writer process: handling %s failed", msg[0])
        finally:
            trim_due = True
            if msg[0] != "flush":  # a flush waits for publishing by design
                _INTAKE["intake_messages"] += 1
                _INTAKE["intake_s"] += time.perf_counter() - started
                _INTAKE["intake_cpu_s"] += time.thread_time() - started_cpu
    writer.shutdown(shutdown_timeout)
    finished.put(None)
    reporter.join(5.0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="capsteer capture writer process (internal)")
    parser.add_argument("--sock-fd", type=int, required=True)
    parser.add_argument("--ctl-fd", type=int, required=True)
    parser.add_argument("--ring-fd", type=int, required=True)
    parser.add_argument("--config", required=True)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the engine; it tells us
    logging.basicConfig(level=logging.INFO, format="%(asctime)s capsteer-writer %(levelname)s %(message)s")
    torch.set_num_threads(1)  # its copies are small and serial; no team to spin
    _serve(args.sock_fd, args.ctl_fd, args.ring_fd, json.loads(args.config))


if __name__ == "__main__":
    main()
