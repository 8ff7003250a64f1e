"""Readout results on their way from the workers to the server (or the in-process engine).

Each worker process appends to one stream file of its own under the server's readout
directory (`ResultsStream`); each API server process tails every stream file there with one
`ResultsHub` (the in-process engine: one `ResultsReader`, its synchronous core), which
hands each record to the response waiting for that readout id. One
write per step on the worker's side and one read per poll on the server's, whatever the
number of readouts in flight. A line is a record:
`{"r": readout_id, "i": item, "p": [positions], "s": [[score, ...], ...]}` for a probe,
`{"r": ..., "i": ..., "p": [...], "f": [[[feature, value], ...], ...]}` for an SAE,
`{"r": ..., "i": ..., "error": "why"}` when the worker could not read (nothing else
follows for that item), or `{"next": name}`, the last line of a file its writer replaced
(rotation). Only complete lines are read, so a reader never sees half a record.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import msgspec

SUFFIX = ".jsonl"
_PREFIX = "w-"
ROTATE_BYTES = 64 << 20  # a stream file is replaced past this; the server deletes the old one
_ENCODE = msgspec.json.Encoder().encode  # a worker writes one per request and step


class Record(msgspec.Struct, gc=False):
    """A record as the server reads it. Each position's scores or features stay the JSON
    the worker wrote (`msgspec.Raw`): the server only forwards them into responses, so it
    never parses or re-encodes them. Not tracked by the cycle collector (`gc=False`: a
    record refers to no record), as 256 of them a step would wake it often."""

    r: str = ""
    i: int = -1
    p: list[int] = msgspec.field(default_factory=list)
    s: list[msgspec.Raw] | None = None
    f: list[msgspec.Raw] | None = None
    error: str | None = None
    next: str | None = None

    @property
    def values(self) -> list[msgspec.Raw]:
        return self.s if self.s is not None else self.f or []


_DECODE_LINES = msgspec.json.Decoder(Record).decode_lines  # every record of every readout
_DECODE_ONE = msgspec.json.Decoder(Record).decode
logger = logging.getLogger("vllm.capsteer")


def _decode(lines: bytes, stream: str) -> list[Record]:
    """A read's records in one call (a step's records of every readout); a line that is
    not a record (a torn or foreign write) is skipped alone, logged, never the others."""
    try:
        return _DECODE_LINES(lines)
    except msgspec.DecodeError:
        pass
    out = []
    for line in filter(None, lines.splitlines()):
        try:
            out.append(_DECODE_ONE(line))
        except msgspec.DecodeError as exc:
            logger.error("capsteer: skipped a malformed readout record in %s (%s): %.80r",
                         stream, exc, line)
    return out


def probe_record(readout_id: str, item: int, positions: list[int],
                 scores: list[list[float]]) -> bytes:
    return _line({"r": readout_id, "i": item, "p": positions, "s": scores})


def sae_record(readout_id: str, item: int, positions: list[int],
               features: list[list[tuple[int, float]]]) -> bytes:
    return _line({"r": readout_id, "i": item, "p": positions, "f": features})


def error_record(readout_id: str, item: int, reason: str) -> bytes:
    return _line({"r": readout_id, "i": item, "error": reason})


def _line(record: dict[str, Any]) -> bytes:
    return _ENCODE(record) + b"\n"


def _stream_of(name: str) -> str:
    """The writer's part of a stream file's name (`w-<pid>-<token>-<seq>.jsonl`)."""
    return name.rsplit("-", 1)[0]


def _writer_pid(name: str) -> int | None:
    parts = name.split("-")
    return int(parts[1]) if len(parts) > 2 and parts[0] == "w" and parts[1].isdigit() else None


class ResultsStream:
    """A worker's stream file: whole records appended in one write each, from any thread."""

    def __init__(self, root: str | Path, rotate_bytes: int = ROTATE_BYTES) -> None:
        self.root = Path(root)
        self.rotate_bytes = rotate_bytes
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._size = 0
        self._name = f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"  # files: _name-<seq>
        self._seq = 0

    def append(self, data: bytes) -> None:
        if not data:
            return
        with self._lock:
            if self._fd is None:
                self._fd, _ = self._open()
            elif self._size >= self.rotate_bytes:
                fd, name = self._open()
                os.write(self._fd, _line({"next": name}))
                os.close(self._fd)
                self._fd = fd
            os.write(self._fd, data)
            self._size += len(data)

    def _open(self) -> tuple[int, str]:
        self.root.mkdir(parents=True, exist_ok=True)
        name = f"{self._name}-{self._seq:06d}{SUFFIX}"
        self._seq += 1
        self._size = 0
        return os.open(self.root / name, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL,
                       0o600), name


@dataclass
class Inbox:
    """One readout's records as the hub delivers them; a waiting response's future is
    resolved on the next delivery or at its deadline (by the hub's task: no timer, no
    task per wait, as a stream waits for most of its chunks)."""

    records: list[Record] = field(default_factory=list)
    waiter: asyncio.Future | None = None
    deadline: float = 0.0

    def take(self) -> list[Record]:
        out, self.records = self.records, []
        return out

    def wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


class _Tail:
    def __init__(self, path: Path, file: BinaryIO) -> None:
        self.path = path
        self.file = file
        self.partial = b""


class ResultsReader:
    """A reader of every worker stream under `root` (see module docstring), synchronous:
    `pump` reads what is new and hands each record to its readout's inbox. The server's
    `ResultsHub` pumps it from its event loop; the in-process engine pumps it after
    `LLM.generate` (steering/readers/collect.py)."""

    def __init__(self, root: str | Path, *, scan_s: float = 0.1,
                 scan_waiting_s: float = 0.005) -> None:
        self.root = Path(root)
        # New stream files (a worker's first readout) are looked for every scan_s, or
        # every scan_waiting_s while someone waits.
        self.scan_s, self.scan_waiting_s = scan_s, scan_waiting_s
        self.inboxes: dict[str, Inbox] = {}
        self._tails: dict[str, _Tail] = {}
        self._done: set[str] = set()  # files replaced by their writer and read to the end
        self._scanned = 0.0
        self.root.mkdir(parents=True, exist_ok=True)
        self._sweep_dead_writers()

    def open(self, readout_id: str) -> Inbox:
        self.inboxes[readout_id] = inbox = Inbox()
        return inbox

    def close(self, readout_id: str) -> None:
        self.inboxes.pop(readout_id, None)

    def pump(self, waiting: bool = True) -> None:
        """Read every stream's new complete lines and deliver their records."""
        now = time.monotonic()
        if now - self._scanned >= (self.scan_waiting_s if waiting else self.scan_s):
            self._scan()
            self._scanned = now
        read: set[str] = set()
        while unread := [name for name in self._tails if name not in read]:
            name = unread[0]  # a file that ends opens its successor, read in this pump too
            read.add(name)
            tail = self._tails[name]
            data = tail.file.read()
            if not data:
                continue
            end = data.rfind(b"\n") + 1
            if not end:
                tail.partial += data
                continue
            whole = tail.partial + data[:end] if tail.partial else data[:end]
            tail.partial = data[end:]
            for record in _decode(whole, name):
                self._deliver(name, record)

    def _deliver(self, name: str, record: Record) -> None:
        if record.next is not None:  # the writer moved on: this file is read to its end
            tail = self._tails.pop(name)
            tail.file.close()
            tail.path.unlink(missing_ok=True)
            self._done.add(name)
            self._scan()
            return
        inbox = self.inboxes.get(record.r)
        if inbox is not None:
            inbox.records.append(record)
            inbox.wake()

    def _scan(self) -> None:
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return
        # A writer's files in order: its next one is read once the one before has ended.
        reading = {_stream_of(name) for name in self._tails}
        for name in sorted(names):
            stream = _stream_of(name)
            if not (name.startswith(_PREFIX) and name.endswith(SUFFIX)) or stream in reading \
                    or name in self._done:
                continue
            try:
                self._tails[name] = _Tail(self.root / name, open(self.root / name, "rb"))
                reading.add(stream)
            except FileNotFoundError:  # replaced and deleted by another server process
                self._done.add(name)

    def _sweep_dead_writers(self) -> None:
        """Stream files of worker processes that no longer run (a stopped server's)."""
        for path in self.root.glob(f"{_PREFIX}*{SUFFIX}"):
            pid = _writer_pid(path.name)
            if pid is None or pid == os.getpid():
                continue
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                path.unlink(missing_ok=True)
            except PermissionError:  # alive, someone else's
                pass

    def stop(self) -> None:
        for tail in self._tails.values():
            tail.file.close()
        self._tails.clear()


class ResultsHub(ResultsReader):
    """An API server process's reader of every worker's stream, pumped by a task of its
    event loop every `poll_s` while a response waits for records, every `idle_s`
    otherwise."""

    def __init__(self, root: str | Path, *, poll_s: float = 0.001, idle_s: float = 0.02,
                 scan_s: float = 0.1, scan_waiting_s: float = 0.005) -> None:
        super().__init__(root, scan_s=scan_s, scan_waiting_s=scan_waiting_s)
        self.poll_s, self.idle_s = poll_s, idle_s
        self._task: asyncio.Task | None = None
        self._waiting: dict[int, Inbox] = {}  # id -> an inbox whose response waits

    def open(self, readout_id: str) -> Inbox:
        inbox = super().open(readout_id)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())
        return inbox

    async def wait(self, inbox: Inbox, timeout_s: float) -> None:
        """Until the hub delivers something to `inbox` or `timeout_s` passes."""
        if inbox.records:
            return
        inbox.waiter = asyncio.get_running_loop().create_future()
        inbox.deadline = time.monotonic() + timeout_s
        self._waiting[id(inbox)] = inbox
        try:
            await inbox.waiter
        finally:
            inbox.waiter = None
            self._waiting.pop(id(inbox), None)

    async def _run(self) -> None:
        while self.inboxes:
            # the waiting inboxes, not a walk over every open one each poll
            waiting = list(self._waiting.values())
            try:
                self.pump(bool(waiting))
            except Exception:  # e.g. a stream file unreadable: the waits still time out
                logger.exception("capsteer: reading the readout streams failed")
            now = time.monotonic()
            for inbox in waiting:
                if inbox.records or now >= inbox.deadline:
                    inbox.wake()
            await asyncio.sleep(self.poll_s if waiting else self.idle_s)

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        super().stop()
