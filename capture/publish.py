"""Durable atomic publish: temp name in the final directory, write, fsync, rename, fsync dir.

Everything that lands under a final name went through `AtomicFile.commit`, so a
reader (or a crash) never sees a partial file under a final name. Temp names start
with "." and end with TMP_SUFFIX and carry the writer's pid, so a restarted writer
can sweep what a dead one left behind without touching a live one's files.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import secrets
import time
from pathlib import Path
from typing import Any

from capsteer.capture import metrics

TMP_SUFFIX = ".capsteer-tmp"
_TMP_RE = re.compile(r"^\..*\.(\d+)\.[0-9a-f]{8}" + re.escape(TMP_SUFFIX) + "$")
_WRITE_BUFFER = 1 << 20


class FileSystem:
    """The syscalls whose latency matters; tests subclass it to inject slow storage."""

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def write(self, fd: int, data: memoryview) -> int:
        return os.write(fd, data)


DEFAULT_FS = FileSystem()


def timed_fsync(fs: FileSystem, fd: int) -> float:
    """fsync `fd` through `fs`, record it in capsteer_fsync_seconds, return the seconds."""
    t0 = time.perf_counter()
    fs.fsync(fd)
    dt = time.perf_counter() - t0
    metrics.FSYNC_SECONDS.observe(dt)
    return dt


def fsync_dir(path: Path, fs: FileSystem = DEFAULT_FS) -> float:
    """Make renames/creations inside `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return timed_fsync(fs, fd)
    finally:
        os.close(fd)


def temp_name(final_name: str) -> str:
    """A hidden, pid-tagged temp name for `final_name` in the same directory."""
    return f".{final_name}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}"


def temp_owner(name: str) -> int | None:
    """The pid encoded in a temp name, or None when `name` is not one of ours."""
    m = _TMP_RE.match(name)
    return int(m.group(1)) if m else None


def ensure_dir(path: Path, fs: FileSystem = DEFAULT_FS) -> float:
    """mkdir -p that fsyncs each parent whose entries changed; returns fsync seconds."""
    missing: list[Path] = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    spent = 0.0
    for d in reversed(missing):
        try:
            d.mkdir()
        except FileExistsError:
            continue
        spent += fsync_dir(d.parent, fs)
    return spent


class AtomicFile:
    """A file written under a temp name and renamed into place only when complete.

    Computes size and sha256 as it writes (the manifest needs both) and buffers
    small writes (one decode step is a few KiB per key).
    """

    def __init__(self, directory: Path, name: str, fs: FileSystem = DEFAULT_FS) -> None:
        self.directory = directory
        self.name = name
        self.fs = fs
        self.tmp_path = directory / temp_name(name)
        self.final_path = directory / name
        self.size = 0
        self.fsync_s = 0.0
        self._sha = hashlib.sha256()
        self._buf = bytearray()
        self._fd: int | None = os.open(
            self.tmp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644
        )

    def write(self, data: bytes | bytearray | memoryview) -> None:
        mv = memoryview(data).cast("B")
        if len(mv) == 0:
            return
        self._sha.update(mv)
        self.size += len(mv)
        if len(mv) >= _WRITE_BUFFER:
            self._flush()
            self._write_all(mv)
            return
        self._buf += mv
        if len(self._buf) >= _WRITE_BUFFER:
            self._flush()

    def _flush(self) -> None:
        if self._buf:
            self._write_all(memoryview(self._buf))
            self._buf = bytearray()

    def _write_all(self, mv: memoryview) -> None:
        assert self._fd is not None
        while len(mv):
            n = self.fs.write(self._fd, mv)
            if n <= 0:
                raise OSError(errno.EIO, f"short write to {self.tmp_path}")
            mv = mv[n:]

    @property
    def sha256(self) -> str:
        return self._sha.hexdigest()

    def commit(self) -> None:
        """Flush, fsync and rename into place (the directory fsync is the caller's)."""
        assert self._fd is not None
        self._flush()
        self.fsync_s += timed_fsync(self.fs, self._fd)
        os.close(self._fd)
        self._fd = None
        os.rename(self.tmp_path, self.final_path)

    def discard(self) -> None:
        """Close and remove the temp file (after an error); never raises."""
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None
        try:
            os.unlink(self.tmp_path)
        except OSError:
            pass


def dumps_manifest(obj: dict[str, Any]) -> str:
    """JSON with one top-level field per line and compact values (long position lists)."""
    lines = [f" {json.dumps(k)}: {json.dumps(v, separators=(',', ':'))}" for k, v in obj.items()]
    return "{\n" + ",\n".join(lines) + "\n}\n"


def write_json_atomic(directory: Path, name: str, obj: dict[str, Any], fs: FileSystem = DEFAULT_FS) -> AtomicFile:
    """Publish a JSON document durably (file fsync, rename, directory fsync)."""
    f = AtomicFile(directory, name, fs)
    try:
        f.write(dumps_manifest(obj).encode())
        f.commit()
    except BaseException:
        f.discard()
        raise
    f.fsync_s += fsync_dir(directory, fs)
    return f


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            state = fh.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_temp_files(root: Path, *, include_own: bool = False) -> list[Path]:
    """Remove temp files left by dead writers under `root`; returns what was removed.

    Files of live processes (another writer sharing the root) are left alone.
    """
    removed: list[Path] = []
    if not root.is_dir():
        return removed
    touched: set[str] = set()
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            pid = temp_owner(name)
            if pid is None or (_pid_alive(pid) and not (include_own and pid == os.getpid())):
                continue
            path = Path(dirpath) / name
            try:
                path.unlink()
            except FileNotFoundError:
                continue
            removed.append(path)
            touched.add(dirpath)
    for d in touched:
        try:
            fsync_dir(Path(d))
        except OSError:
            pass
    return removed
