"""The writer process: runs a `CaptureWriter` on rows the engine's `ProcessCaptureWriter`
sends through the shared-memory rings (capsteer.capture.writer.ring) and the messages of
capsteer.capture.writer.protocol. Started as `python -m capsteer.capture.writer.child`.

If the engine process goes away, the child publishes what was closed, aborts the rest
and exits.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import logging
import math
import mmap
import os
import queue
import signal
import struct
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch

import capsteer.capture.metrics as metrics
from capsteer.capture.writer.glibc import HEAP, keep_freed_heap, trim_heap
from capsteer.capture.writer.local import CaptureWriter
from capsteer.capture.writer.protocol import (
    Abort,
    Close,
    ControlCall,
    ControlReply,
    Done,
    Flush,
    Many,
    Open,
    Ready,
    Reply,
    Shutdown,
    WriteBytes,
    Writes,
    dumps,
    loads,
    ring_positions,
)
from capsteer.capture.writer.ring import HEADER

log = logging.getLogger(__name__)

_DONE_BATCH_S = 0.02  # the child reports finished captures at most this often
# Messages the child has read off the link but not handled yet, at most (one larger
# message still enters an empty inbox). Rows travel in the rings; messages carry their
# offsets, so this holds many steps of them.
INBOX_BYTES = 64 << 20

# The child keeps no finished receipts: the engine reads outcomes from the manifests and
# from the Done messages, never from the child's board. CaptureWriter's default (10,000,
# about 1 KB each) held ~0.5 MB more after every 500 captures until it was full.
KEEP_RECEIPTS = 0

_FULL_COLLECTIONS_AT_FREEZE = [0]  # full collections before the freeze (imports) are not the writer's


def _freeze_imports() -> None:
    """Collect once, then freeze what survives (torch, numpy: ~170k objects that live as long
    as the process) out of the collector's walks: a full collection then walks only what
    the writer allocates, instead of stalling all its threads on the GIL for tens of ms."""
    gc.collect()
    gc.freeze()
    _FULL_COLLECTIONS_AT_FREEZE[0] = gc.get_stats()[2]["collections"]


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
            **HEAP}


def _kind(msg: Any) -> str:
    """A message's name for the log ("writes", "close", ...)."""
    return type(msg).__name__.lower()


def _answer_control(ctl: Connection, writer: Any) -> None:
    """The child's diagnostics thread: stats and metrics while the main loop moves rows."""
    while True:
        try:
            call: ControlCall = loads(ctl.recv_bytes())
            seq, name = call
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
            ctl.send_bytes(dumps(ControlReply(seq, value, error)))
        except OSError:
            return


class Inbox:
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
    conn = Connection(sock_fd)
    ring_bytes = int(config.pop("ring_bytes"))
    idle_trim_s = float(config.pop("idle_trim_s"))
    if not keep_freed_heap():
        log.info("capsteer writer process: the C library's malloc could not be set to keep "
                 "freed memory (not glibc's mallopt, or it refused); its own policy decides "
                 "whether rows reuse freed memory")
    mm = mmap.mmap(ring_fd, HEADER + 2 * ring_bytes)
    rings = torch.frombuffer(mm, dtype=torch.uint8)  # both rings, addressed from the header
    writer = CaptureWriter(config.pop("root"), keep_receipts=KEEP_RECEIPTS, **config)
    send_lock = threading.Lock()
    finished: queue.SimpleQueue[str | None] = queue.SimpleQueue()

    def send(msg: Done | Ready | Reply) -> None:
        with send_lock:
            conn.send_bytes(dumps(msg))

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
                    send(Done(ids, tuple(writer.unwritten.get(ids).values())))
                except OSError:
                    return
            if stop:
                return

    reporter = threading.Thread(target=report_done, name="capsteer-writer-done", daemon=True)
    reporter.start()
    threading.Thread(target=_answer_control, args=(Connection(ctl_fd), writer),
                     name="capsteer-writer-control", daemon=True).start()
    _freeze_imports()
    send(Ready(os.getpid()))

    def on_writes(msg: Writes) -> None:
        for cid, hook, layer, pos, dtype, shape, offset, end in msg.entries:
            nbytes = math.prod(shape) * dtype.itemsize
            rows = rings[offset:offset + nbytes].view(dtype).view(shape)
            if 2 * nbytes >= ring_bytes:  # CaptureWriter.write copies rows of a larger
                rows = rows.clone()       # storage; the parent keeps writes below half
            try:
                writer.write(cid, hook, layer, ring_positions(pos), rows)  # copies the rows out
            except Exception as exc:  # the capture ends with an error, the step goes on
                log.exception("capsteer writer process: write for %s failed", cid)
                writer.abort(cid, f"rows could not be taken: {type(exc).__name__}: {exc}")
            finally:  # a negative end is the device ring's (its counter at 8); None:
                if end is not None:  # the same rows follow under another key
                    struct.pack_into("<Q", mm, 8 if end < 0 else 0, abs(end))

    def on_many(msg: Many) -> None:  # deferred sends: each in order, one failing alone
        for one in msg.messages:
            try:
                handle(one)
            except Exception:
                log.exception("capsteer writer process: handling %s failed", _kind(one))

    def on_write_bytes(msg: WriteBytes) -> None:
        rows = torch.frombuffer(bytearray(msg.data), dtype=msg.dtype).view(msg.shape)
        writer.write(msg.capture_id, msg.hook, msg.layer, msg.positions, rows)

    def on_open(msg: Open) -> None:
        writer.open(msg.request)
        writer.add_done_callback(msg.request.capture_id, lambda r: finished.put(r.capture_id))

    def on_flush(msg: Flush) -> None:  # in order: after every row and close sent before it
        try:
            send(Reply(msg.call, writer.flush(msg.timeout), None))
        except Exception as exc:
            send(Reply(msg.call, None, f"{type(exc).__name__}: {exc}"))

    handlers: dict[type, Callable[[Any], None]] = {
        Writes: on_writes,
        Many: on_many,
        WriteBytes: on_write_bytes,
        Open: on_open,
        Close: lambda msg: writer.close(msg.end),
        Abort: lambda msg: writer.abort(msg.capture_id, msg.reason),
        Flush: on_flush,
    }

    def handle(msg: Any) -> None:
        handler = handlers.get(type(msg))
        if handler is not None:
            handler(msg)

    inbox = Inbox(INBOX_BYTES)
    threading.Thread(target=inbox.read_from, args=(conn,), name="capsteer-writer-inbox",
                     daemon=True).start()
    shutdown_timeout: float | None = None
    trim_due = False  # a message came in since the last trim, or rows were held at it
    while True:
        data = inbox.get(idle_trim_s if trim_due else None)
        if data is Inbox.IDLE:
            trim_heap()
            # rows still held free their memory when published: trim again then
            trim_due = writer.budget.inflight > 0
            continue
        if data is Inbox.EOF:
            break  # the engine process is gone: publish what was closed, abort the rest
        _INTAKE["inbox_peak_bytes"] = inbox.peak
        msg = loads(data)
        if isinstance(msg, Shutdown):
            shutdown_timeout = msg.timeout
            break
        started, started_cpu = time.perf_counter(), time.thread_time()
        try:
            handle(msg)
        except OSError:
            raise
        except Exception:  # one bad message must not take every other capture down
            log.exception("capsteer writer process: handling %s failed", _kind(msg))
        finally:
            trim_due = True
            if not isinstance(msg, Flush):  # a flush waits for publishing by design
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

