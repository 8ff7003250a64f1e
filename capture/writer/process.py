"""The durable writer in a process of its own, so publishing never waits on the engine's GIL.

Why: a capturing engine's step thread releases the GIL thousands of times a step, and
a writer thread of the same process can take it each time for its next Python segment
(docs/performance.md measured the cost). Here the engine process keeps a thin
`ProcessCaptureWriter`: each `write` copies the rows into a shared-memory ring (one
memcpy, GIL released) and sends a short message on a socket; a child process
(capsteer.capture.writer.child) runs the unchanged `CaptureWriter` (writer threads,
digests, fsyncs, manifests, receipts). The rings are capsteer.capture.writer.ring's,
the messages capsteer.capture.writer.protocol's.

Neither side wakes a thread pool for its copies (an OpenMP team spins on cores the
step thread needs): the parent copies with one memmove (`layouts.copy_rows`), the
child runs with one intra-op thread (docs/performance.md).

If the child dies, the parent notices (socket EOF), writes an error outcome for every
capture the child had not reported done, through an in-process `CaptureWriter`, and
keeps serving on that writer: no capture is left pending and none is silently lost.
"""

from __future__ import annotations

import collections
import logging
import math
import mmap
import os
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from capsteer.capture.layouts import copy_rows
from capsteer.capture.publish import check_digest
from capsteer.capture.receipts import Receipt
from capsteer.capture.sink import CaptureEnd, CaptureRequest, CaptureSink
from capsteer.capture.writer.budget import (
    DEFAULT_BUDGET_BYTES,
    DEFAULT_RING_BYTES,
    MIN_RING_BYTES,
    check_budget,
)
from capsteer.capture.writer.local import CaptureWriter
from capsteer.capture.writer.protocol import (
    Abort,
    Close,
    Done,
    Flush,
    Many,
    Open,
    Ready,
    Reply,
    RingWrite,
    Shutdown,
    WriteBytes,
    Writes,
    dumps,
    loads,
)
from capsteer.capture.writer.ring import HEADER, PAGE, DeviceRows, align, place
from capsteer.capture.writer.spawn import spawn_child
from capsteer.capture.writer.unwritten import UnwrittenOutcomes

log = logging.getLogger(__name__)

_MADV_POPULATE_WRITE = 23  # Linux >= 5.14; Python's mmap module does not name it
_CALL_TIMEOUT_S = 30.0
_MAX_BATCH = 256  # ring writes per message at most
IDLE_TRIM_S = 30.0  # the child hands freed heap back to the system after this long idle


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
        check_budget(budget_bytes, policy)  # here, not as a failover when the child starts
        check_digest(digest)
        if not 0 < idle_trim_s < 86400:
            raise ValueError(f"idle_trim_s must be above 0 and below a day, not {idle_trim_s}")
        self.root = Path(root).resolve()
        self._writer_kwargs: dict[str, Any] = {"budget_bytes": budget_bytes, "policy": policy,
                                               "workers": workers, "digest": digest,
                                               "direct_io": direct_io}
        self.ring_bytes = -(-max(ring_bytes, MIN_RING_BYTES) // PAGE) * PAGE
        # Two rings after the header: the copy ring (write() copies rows in) and the device
        # ring (the engine's GPU copies rows straight into it, see reserve_rows).
        self._fd = os.memfd_create("capsteer-capture-ring", os.MFD_CLOEXEC)
        os.ftruncate(self._fd, HEADER + 2 * self.ring_bytes)
        self._mm = mmap.mmap(self._fd, HEADER + 2 * self.ring_bytes)
        self._ring = torch.frombuffer(self._mm, dtype=torch.uint8, offset=HEADER,
                                      count=self.ring_bytes)
        self.device_ring = torch.frombuffer(self._mm, dtype=torch.uint8,
                                           offset=HEADER + self.ring_bytes, count=self.ring_bytes)
        self._head = 0  # logical bytes handed to the child (monotonic)
        self._dhead = 0  # the device ring's: reserved by the engine's step thread only
        self._device_rows = False  # the device ring is page-locked for the GPU's copies
        self._pending: list[RingWrite] = []  # this step's ring writes, not sent yet
        # Deferred sends (defer_sends): closes, aborts and whole steps' writes wait here,
        # in order, for flush_sends, which sends them with the queued opens as one message.
        self._deferred = False
        self._outbox: list[Any] = []
        self._opens: collections.deque[Open] = collections.deque()  # queued without a lock
        config = {"root": str(self.root), "ring_bytes": self.ring_bytes,
                  "idle_trim_s": idle_trim_s, **self._writer_kwargs}
        self.proc, self._conn, self._ctl = spawn_child(config, self._fd)
        self._send_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._inflight: dict[str, CaptureRequest] = {}  # opened, not reported done by the child
        self._unwritten = UnwrittenOutcomes()  # the child's outcomes not on disk
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
        self.ring_releases = 0  # times the idle copy ring's pages went back to the system
        self._idle_trim_s = idle_trim_s
        self._last_send = time.monotonic()
        self._released = False  # the copy ring holds no pages since the last send
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
        self._opens.append(Open(request))

    def write(self, capture_id: str, hook: str, layer: int, positions: np.ndarray,
              rows: torch.Tensor) -> None:
        if self._fallback is not None:
            self._fallback.write(capture_id, hook, layer, positions, rows)
            return
        pos = np.ascontiguousarray(positions, dtype=np.int64).reshape(-1)
        nbytes = rows.numel() * rows.element_size()
        shape, dtype = tuple(rows.shape), rows.dtype
        if 2 * align(nbytes) > self.ring_bytes:  # the child's copy-out needs this (see _serve)
            self.inline_writes += 1
            data = rows.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
            self._send(WriteBytes(capture_id, hook, int(layer), pos, dtype, shape, data))
            return
        with self._send_lock:  # one producer at a time owns the ring's head
            offset, end = self._reserve(align(nbytes))
            if offset < 0:
                return  # the child died while we waited; the fallback took over
            if nbytes:
                started = time.perf_counter()
                copy_rows(self._ring[offset:offset + nbytes].view(dtype).view(shape), rows)
                self.copy_s += time.perf_counter() - started
            self._queue_locked((capture_id, hook, int(layer), pos.tobytes(), dtype, shape,
                                HEADER + offset, end))

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
            self._mm.madvise(_MADV_POPULATE_WRITE, 0, HEADER + self.ring_bytes)
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
            err = cudart.cudaHostRegister(self.device_ring.data_ptr(), self.ring_bytes, 0)
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
        size = align(nbytes)
        if 2 * size > self.ring_bytes or not nbytes:
            return None
        taken = self._take_device(size)
        if taken is None:
            self.device_full += 1
            return None
        phys, end = taken
        return DeviceRows(self, tuple(shape), dtype, HEADER + self.ring_bytes + phys, end)

    def _take_device(self, size: int) -> tuple[int, int] | None:
        """(physical offset, logical end) of `size` device-ring bytes, taken; None while
        the child has not yet freed that much."""
        phys, end = place(self._dhead, size, self.ring_bytes)
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
        size = align(total)
        if 2 * size > self.ring_bytes or not total:
            return None
        taken = self._take_device(size)
        if taken is None:
            return None  # device_full counts the per-write tries the caller makes next
        phys, end = taken
        base, start = HEADER + self.ring_bytes + phys, end - size
        parts, at = [], 0
        for shape, nbytes in zip(shapes, sizes, strict=True):
            parts.append(DeviceRows(self, tuple(shape), dtype, base + at, start + at + nbytes))
            at += nbytes
        parts[-1].end = end  # the alignment padding goes with the last write
        rows = sum(shape[0] for shape in shapes)
        return self.device_ring[phys:phys + total].view(dtype).view(rows, *shapes[0][1:]), parts

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
            self._queue_locked((capture_id, hook, int(layer), pos.tobytes(), reserved.dtype,
                                reserved.shape, reserved.offset,
                                -reserved.end if frees else None))

    def close(self, end: CaptureEnd) -> None:
        if self._fallback is not None:
            self._fallback.close(end)
            return
        self._send_or_defer(Close(end))

    def abort(self, capture_id: str, reason: str) -> None:
        if self._fallback is not None:
            self._fallback.abort(capture_id, reason)
            return
        self._send_or_defer(Abort(capture_id, reason))

    def release_idle_ring(self) -> bool:
        """Punch the copy ring's pages out of the shared memory (both processes' RSS) once
        the child took out every row written into it: rows leave the pages they crossed
        resident, where the child's heap trim does not reach. False while rows are in
        flight. The device ring stays: page-locked for the GPU."""
        with self._send_lock:
            if (self._fallback is not None or self._pending or self._outbox
                    or self._consumed() != self._head):
                return False
            self._mm.madvise(mmap.MADV_REMOVE, HEADER, self.ring_bytes)
            self.ring_releases += 1
            self._released = True
            return True

    # ------------------------------------------------------------ diagnostics
    def stats(self) -> dict[str, Any] | None:
        """The child writer's stats (CaptureWriter.stats) plus this link's counters."""
        own = {"process": self.child_pid, "failure": self.failure, "ring_bytes": self.ring_bytes,
               "ring_waits": self.ring_waits, "ring_wait_s": round(self.ring_wait_s, 6),
               "inline_writes": self.inline_writes, "copy_s": round(self.copy_s, 6),
               "send_s": round(self.send_s, 6), "sends": self.sends,
               "device_writes": self.device_writes, "ring_releases": self.ring_releases,
               "device_full": self.device_full}
        if self._fallback is not None:
            return {**self._fallback.stats(), **own}
        got = self._ctl.call("stats", _CALL_TIMEOUT_S)
        return None if got is None else {**got, **own}

    def engine_wait_s(self) -> dict[str, float]:
        """Seconds the engine's threads waited for the child to free ring space (and for
        the in-process writer's budget after the child died), read in this process only:
        no call to the child (capsteer_capture_engine_wait_seconds_total)."""
        fallback = self._fallback.engine_wait_s() if self._fallback is not None else {}
        return {"writer_ring": self.ring_wait_s, **fallback}

    def unwritten_receipts(self, capture_ids: Sequence[str]) -> dict[str, Receipt]:
        got, fallback = self._unwritten.get(capture_ids), self._fallback
        return got if fallback is None else {**got, **fallback.unwritten_receipts(capture_ids)}

    def metrics_snapshot(self) -> dict[str, Any]:
        """The child's capture metrics (metrics.snapshot shape); the last good one if it
        does not answer, so counters never go backwards on a slow scrape."""
        if self._fallback is None:
            got = self._ctl.call("metrics", 5.0)
            if got is not None:
                self._last_metrics = got
        return self._last_metrics

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every capture closed so far is published."""
        if self._fallback is not None:
            return bool(self._fallback.flush(timeout))
        got = self._call(lambda n: Flush(n, timeout),
                         timeout=None if timeout is None else timeout + 5.0)
        return bool(got)

    def shutdown(self, timeout: float | None = None) -> None:
        """Publish what was closed, abort what is open, and let the child exit."""
        self._closing = True
        if self._fallback is None:
            try:
                self._send(Shutdown(timeout))
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
        phys, end = place(self._head, n, self.ring_bytes)
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

    def _queue_locked(self, entry: RingWrite) -> None:
        """A ring write for this step's `Writes` (caller holds the send lock)."""
        self._pending.append(entry)
        if len(self._pending) >= _MAX_BATCH:
            self._send_pending_locked()

    def _send(self, msg: Any) -> None:
        with self._send_lock:
            self._send_locked(msg)

    def _send_or_defer(self, msg: Any) -> None:
        with self._send_lock:
            if not self._deferred:
                self._send_locked(msg)
                return
            if self._pending:  # the rows written before it go first
                self._outbox.append(Writes(self._pending))
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
            msgs.append(Writes(self._pending))
            self._pending = []
        if len(msgs) == 1:
            self._send_raw_locked(msgs[0])
        elif msgs:
            self._send_raw_locked(Many(msgs))

    def _send_locked(self, msg: Any) -> None:
        """Send `msg` after this step's pending writes (a close follows its rows)."""
        self._send_pending_locked()
        self._send_raw_locked(msg)

    def _send_raw_locked(self, msg: Any) -> None:
        if self._fallback is not None:
            return  # the failover already gave every capture of this message its outcome
        started = time.perf_counter()
        self.sends += 1
        self._last_send, self._released = time.monotonic(), False
        try:
            self._conn.send_bytes(dumps(msg))
        except OSError as exc:
            # Every capture this message concerns was opened before it, so it is in
            # _inflight and the failover gives it its error outcome; nothing to replay.
            self._fail(f"capture writer process unreachable: {exc!r}")
        finally:
            self.send_s += time.perf_counter() - started

    def _call(self, message: Callable[[int], Flush],
              timeout: float | None = _CALL_TIMEOUT_S) -> Any:
        """Send `message(n)` and wait for the child's `Reply` numbered n."""
        fut: Future[Any] = Future()
        with self._state_lock:
            n = self._next_call = self._next_call + 1
            self._calls[n] = fut
        msg = message(n)
        name = type(msg).__name__.lower()
        try:
            self._send(msg)
            if self._fallback is not None and not fut.done():  # sent to no one
                raise RuntimeError(self.failure or "capture writer process gone")
            return fut.result(timeout)
        except Exception as exc:
            log.warning("capsteer: capture writer process call %s failed: %r", name, exc)
            return None
        finally:
            with self._state_lock:
                self._calls.pop(n, None)

    def _on_done(self, msg: Done) -> None:
        self._unwritten.merge(msg.unwritten)
        with self._state_lock:
            for cid in msg.capture_ids:
                self._inflight.pop(cid, None)

    def _on_reply(self, msg: Reply) -> None:
        with self._state_lock:
            fut = self._calls.get(msg.call)
        if fut is not None and not fut.done():
            if msg.error is None:
                fut.set_result(msg.value)
            else:
                fut.set_exception(RuntimeError(msg.error))

    def _on_ready(self, msg: Ready) -> None:
        self.child_pid = int(msg.pid)
        self.ready.set()

    def _read_loop(self) -> None:
        handlers: dict[type, Callable[[Any], None]] = {
            Done: self._on_done, Reply: self._on_reply, Ready: self._on_ready}
        try:
            while True:
                # idle_trim_s after the last send (when the child trims its heap): the ring
                wait = self._idle_trim_s - (time.monotonic() - self._last_send)
                if not self._conn.poll(self._idle_trim_s if self._released else max(0.05, wait)):
                    if not self._released and wait <= 0.05:
                        self.release_idle_ring()
                    continue
                msg = loads(self._conn.recv_bytes())
                handler = handlers.get(type(msg))
                if handler is not None:
                    handler(msg)
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
