"""The typed messages between the engine's `ProcessCaptureWriter` and its writer process.

Pickled on one socket pair, in order:
  parent -> child  Open | Writes | WriteBytes | Close | Abort | Many | Flush | Shutdown
  child -> parent  Ready | Done | Reply
A second socket pair carries diagnostics out of band: a `ControlCall` answered by a
`ControlReply` from a thread of the child, so a scrape never waits behind rows.
Rows travel in the shared-memory rings (capsteer.capture.writer.ring); a `Writes`
message names them by offset.
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

import numpy as np
import torch

from capsteer.capture.receipts import Receipt
from capsteer.capture.sink import CaptureEnd, CaptureRequest

log = logging.getLogger(__name__)

# One write's rows in a ring: (capture_id, hook, layer, positions, dtype, shape, offset,
# end). `positions` are int64 bytes (`ring_positions`): a step sends hundreds of writes,
# and pickling an ndarray each cost 14x the rest of the message. `offset` counts from the
# start of the shared memory; `end` is the copy ring's logical end, minus the device
# ring's, or None when the same rows follow under another key. A plain tuple, for the
# same reason.
RingWrite = tuple[str, str, int, bytes, torch.dtype, tuple[int, ...], int, "int | None"]


def ring_positions(data: bytes) -> np.ndarray:
    """A RingWrite's positions as the int64 array they were (read-only)."""
    return np.frombuffer(data, dtype=np.int64)


class Open(NamedTuple):
    """A capture opened (sent before any of its rows)."""

    request: CaptureRequest


class Writes(NamedTuple):
    """A step's rows, in the rings."""

    entries: list[RingWrite]


class WriteBytes(NamedTuple):
    """One write too large for the ring, its rows inline."""

    capture_id: str
    hook: str
    layer: int
    positions: np.ndarray
    dtype: torch.dtype
    shape: tuple[int, ...]
    data: bytes


class Close(NamedTuple):
    end: CaptureEnd


class Abort(NamedTuple):
    capture_id: str
    reason: str


class Many(NamedTuple):
    """Deferred messages sent as one, handled in order (each failing alone)."""

    messages: list[Any]


class Flush(NamedTuple):
    """Answer `Reply(call, ...)` once everything sent before is published."""

    call: int
    timeout: float | None


class Shutdown(NamedTuple):
    timeout: float | None


class Ready(NamedTuple):
    pid: int


class Done(NamedTuple):
    """Captures whose outcome the child published, and the receipts of those whose
    manifest could not be written (the parent keeps them for the server to ask)."""

    capture_ids: list[str]
    unwritten: tuple[Receipt, ...] = ()


class Reply(NamedTuple):
    call: int
    value: Any
    error: str | None


class ControlCall(NamedTuple):
    seq: int
    name: str  # "stats" | "metrics"


class ControlReply(NamedTuple):
    seq: int
    value: Any
    error: str | None


def dumps(msg: Any) -> bytes:
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes) -> Any:
    return pickle.loads(data)


class ControlLink:
    """The parent's end of the diagnostics socket: one call at a time, each numbered."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._lock = threading.Lock()
        self._seq = 0

    def call(self, name: str, timeout: float) -> Any:
        """A diagnostics call on the control socket; None on timeout or a dead child (a
        late answer is recognised by its number and dropped by the next call)."""
        with self._lock:
            self._seq += 1
            seq = self._seq
            deadline = time.monotonic() + timeout
            try:
                self._conn.send_bytes(dumps(ControlCall(seq, name)))
                while self._conn.poll(max(0.0, deadline - time.monotonic())):
                    got_seq, value, error = loads(self._conn.recv_bytes())
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
