"""Durable atomic publish: temp name in the final directory, write, fsync, rename, fsync dir.

Everything that lands under a final name went through `AtomicFile.commit`, so a
reader (or a crash) never sees a partial file under a final name. Temp names start
with "." and end with TMP_SUFFIX and carry the writer's pid, so a restarted writer
can sweep what a dead one left behind without touching a live one's files.

Digests: every data file's digest is computed while it is written and recorded in
the manifest under the algorithm's name (`digest_fields`): `{"sha256": hex}` for
sha256 (the default, api.md §5), `{"digest": "blake3", "blake3": hex}` otherwise,
so a manifest that predates the choice reads as sha256. Hashing runs on a helper
thread, overlapping the file's own write and fsync.

Writeback starts as each large piece is written (Linux `sync_file_range`), so the disk
works while the writer hashes and copies the next piece; the final fsync then waits
for the tail only (bench/storage.py).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import json
import logging
import mmap
import os
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import capsteer.capture.metrics as metrics
from capsteer.capture.digests import (
    DEFAULT_DIGEST,
    DigestError,
    Hasher,
    check_digest,
    digest_fields,
    new_hasher,
)

log = logging.getLogger(__name__)

TMP_SUFFIX = ".capsteer-tmp"
_TMP_RE = re.compile(r"^\..*\.(\d+)\.[0-9a-f]{8}" + re.escape(TMP_SUFFIX) + "$")
_WRITE_BUFFER = 1 << 20
# AtomicFile.write_pieces: large pieces go out in batches of about this many bytes, each
# one os.writev and one digest hand-off (memory the caller's pieces already hold).
_BATCH_BYTES = 16 << 20
_IOV_MAX = 1024  # Linux's limit on buffers per writev

IO_MODES = ("buffered", "direct")  # capture_io: how durable capture files reach the disk
# Pieces smaller than this are hashed inline: a thread hand-off costs more than it saves.
_OVERLAP_MIN = 256 << 10
_SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h: start writeback of dirty pages, do not wait
# Direct I/O (AtomicFile(direct=True)): data reaches the disk from a page-aligned staging
# block in writes of this size; offsets and lengths are multiples of _DIRECT_ALIGN.
_DIRECT_STAGE = 8 << 20
_DIRECT_ALIGN = 4096
_DIRECT_REFUSED_LOGGED = False


def libc_function(name: str, argtypes: list[Any]) -> Any:
    """The C library's function `name` (returning int), or None where it has none: for
    calls Python's os module does not expose (sync_file_range; glibc's mallopt)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = getattr(libc, name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = libc_function(
    "sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint])


_POOL_LOCK = threading.Lock()
_POOL: tuple[int, ThreadPoolExecutor] | None = None


def _hash_pool() -> ThreadPoolExecutor:
    """The process's digest threads (made again in a forked child, which has none).

    Sized so every writer thread can have its hash running at once: a file waits for
    its own previous piece only, never for another file's."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL[0] != os.getpid():
            workers = max(4, os.cpu_count() or 1)
            _POOL = (os.getpid(), ThreadPoolExecutor(workers, thread_name_prefix="capsteer-digest"))
        return _POOL[1]


def _update_all(hasher: Hasher, pieces: list[memoryview]) -> None:
    for piece in pieces:
        hasher.update(piece)


class FileSystem:
    """The syscalls whose latency matters; tests subclass it to inject slow storage.
    Data goes through `write` (single pieces, buffered small ones) and `writev` (batches
    of large pieces, AtomicFile.write_pieces): a fault injected in one is not in the other."""

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def write(self, fd: int, data: memoryview) -> int:
        return os.write(fd, data)

    def writev(self, fd: int, buffers: list[memoryview]) -> int:
        return os.writev(fd, buffers)

    def start_writeback(self, fd: int, offset: int, nbytes: int) -> int:
        """Ask the kernel to start writing this range to disk now, without waiting;
        returns 0, or the errno of a refusal (ENOSYS where there is no such call).

        Only a head start for the fsync that follows, which still decides durability
        and reports any I/O error: where the call is missing or refused (another OS,
        a filesystem without it), nothing else changes."""
        if _SYNC_FILE_RANGE is None:
            return errno.ENOSYS
        if _SYNC_FILE_RANGE(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE) == 0:
            return 0
        return ctypes.get_errno()


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


def _set_direct(fd: int) -> bool:
    """Switch an open file to O_DIRECT; False where the filesystem or OS refuses it.
    After the open, not in it: open(O_CREAT | O_DIRECT) on a filesystem without direct
    I/O creates the file before refusing, and the O_EXCL retry would then fail."""
    if not hasattr(os, "O_DIRECT"):
        return False
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
            raise
        global _DIRECT_REFUSED_LOGGED
        if not _DIRECT_REFUSED_LOGGED:  # once a process: the setting has no effect here
            _DIRECT_REFUSED_LOGGED = True
            log.warning("capsteer: capture_io direct: this filesystem refuses O_DIRECT (%s); "
                        "capture files are written buffered", exc.strerror)
        return False
    return True


class AtomicFile:
    """A file written under a temp name and renamed into place only when complete.

    Computes size and digest as it writes (the manifest needs both) and buffers
    small writes (one decode step is a few KiB per key). Each large piece is hashed
    on a digest thread while this thread writes it, so the writer pays about
    max(hash, write) instead of their sum; the piece hashed last overlaps the fsync.
    `digest=None` skips hashing (files whose digest no manifest records).

    `direct=True` writes with O_DIRECT where the filesystem allows it (`self.direct`
    says whether it did): bytes are copied into a page-aligned staging block and go to
    the disk from there in aligned writes, skipping the kernel's copy into the page
    cache (most of a writer process's CPU on the hosts measured) and the cache itself;
    the last block is padded and the file truncated to its size before the fsync.
    """

    def __init__(
        self, directory: Path, name: str, fs: FileSystem = DEFAULT_FS,
        digest: str | None = DEFAULT_DIGEST, direct: bool = False,
    ) -> None:
        self.digest = None if digest is None else check_digest(digest)
        self.directory = directory
        self.name = name
        self.fs = fs
        self.tmp_path = directory / temp_name(name)
        self.final_path = directory / name
        self.size = 0
        self.fsync_s = 0.0
        self._written = 0  # bytes handed to the kernel (size counts buffered ones too)
        self._hasher: Hasher | None = None if digest is None else new_hasher(digest)
        self._hashing: Future[object] | None = None  # the piece being hashed, at most one
        self._buf = bytearray()
        self.direct = False
        self._stage: mmap.mmap | None = None  # direct: the aligned block being filled
        self._staged = 0  # bytes in it
        self._fd: int | None = os.open(
            self.tmp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644
        )
        if direct:
            self.direct = _set_direct(self._fd)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Append `data`; the caller may reuse its buffer once this returns."""
        mv = memoryview(data).cast("B")
        if len(mv) == 0:
            return
        self.size += len(mv)
        if len(mv) >= _WRITE_BUFFER:
            self._flush()
            self._write_piece(mv)
            self._wait_hash()  # the caller's buffer: hashed before it is handed back
            return
        self._buf += mv
        if len(self._buf) >= _WRITE_BUFFER:
            self._flush()

    def write_pieces(self, pieces: Iterable[bytes | bytearray | memoryview]) -> None:
        """Append every piece in order, as `write` each would, in fewer steps: large
        pieces are grouped into batches of about _BATCH_BYTES, each written by one
        `writev` while one digest hand-off hashes it. Why: a capture's file is many 1 MiB
        row blocks, and per block the hand-off, write and wait each cost a GIL round
        trip and a thread wake-up, which bounded the writer below the disk's rate
        (docs/performance.md). Each piece may be reused by the
        caller once its batch is written, and all of them once this returns."""
        batch: list[memoryview] = []
        size = 0
        for piece in pieces:
            mv = memoryview(piece).cast("B")
            if len(mv) < _WRITE_BUFFER:  # small: through the buffer, after the batch
                if batch:
                    self._write_batch(batch)
                    batch, size = [], 0
                self.write(mv)
                continue
            self.size += len(mv)
            batch.append(mv)
            size += len(mv)
            if size >= _BATCH_BYTES or len(batch) >= _IOV_MAX:
                self._write_batch(batch)
                batch, size = [], 0
        if batch:
            self._write_batch(batch)

    def _write_batch(self, batch: list[memoryview]) -> None:
        """Hash (on a digest thread) and write large pieces, then wait for the hash."""
        self._flush()
        self._hash_while(batch, lambda: self._writev_all(batch))
        self._wait_hash()

    def _writev_all(self, batch: list[memoryview]) -> None:
        assert self._fd is not None
        if self.direct:
            for mv in batch:
                self._stage_in(mv)
            return
        start = self._written
        pending = [mv for mv in batch if len(mv)]
        while pending:
            n = self.fs.writev(self._fd, pending)
            if n <= 0:
                raise OSError(errno.EIO, f"short write to {self.tmp_path}")
            self._written += n
            while pending and n >= len(pending[0]):  # drop what went out, keep the rest
                n -= len(pending[0])
                pending.pop(0)
            if n:
                pending[0] = pending[0][n:]
        self.fs.start_writeback(self._fd, start, self._written - start)

    def _flush(self) -> None:
        if self._buf:
            buf, self._buf = self._buf, bytearray()  # ours: may still be hashing after return
            self._write_piece(memoryview(buf))

    def _write_piece(self, mv: memoryview) -> None:
        self._hash_while([mv], lambda: self._write_all(mv))

    def _hash_while(self, pieces: list[memoryview], write: Callable[[], None]) -> None:
        """Hash `pieces` (on a digest thread when large) while `write()` writes them;
        pieces are hashed in order because the previous hash is waited for first."""
        self._wait_hash()
        if self._hasher is not None:
            if sum(len(mv) for mv in pieces) >= _OVERLAP_MIN:
                self._hashing = _hash_pool().submit(_update_all, self._hasher, pieces)
            else:
                _update_all(self._hasher, pieces)
        try:
            write()
        except BaseException:
            self._wait_hash(raise_errors=False)
            raise

    def _wait_hash(self, raise_errors: bool = True) -> None:
        pending, self._hashing = self._hashing, None
        if pending is None:
            return
        try:
            pending.result()
        except Exception:
            if raise_errors:
                raise

    def _stage_in(self, mv: memoryview) -> None:
        """Direct I/O: copy `mv` into the staging block, writing each block as it fills."""
        if self._stage is None:
            self._stage = mmap.mmap(-1, _DIRECT_STAGE)  # page-aligned, as O_DIRECT needs
        while len(mv):
            n = min(len(mv), _DIRECT_STAGE - self._staged)
            self._stage[self._staged:self._staged + n] = mv[:n]
            self._staged += n
            self._written += n
            mv = mv[n:]
            if self._staged == _DIRECT_STAGE:
                self._write_stage(_DIRECT_STAGE)

    def _write_stage(self, nbytes: int) -> None:
        """Write the staging block's first `nbytes` (a multiple of _DIRECT_ALIGN)."""
        assert self._fd is not None and self._stage is not None
        view = memoryview(self._stage)[:nbytes]
        try:
            while len(view):
                n = self.fs.write(self._fd, view)
                if n <= 0 or n % _DIRECT_ALIGN:  # the next write could not be aligned
                    raise OSError(errno.EIO, f"short direct write to {self.tmp_path}: {n} of "
                                  f"{len(view)} bytes (is the disk full?)")
                view = view[n:]
        finally:
            view.release()
        self._staged = 0

    def _finish_direct(self) -> None:
        """The staged tail, padded to the alignment, then the file cut to its size."""
        if self._stage is None:
            return
        assert self._fd is not None
        if self._staged:
            padded = -(-self._staged // _DIRECT_ALIGN) * _DIRECT_ALIGN
            self._stage[self._staged:padded] = bytes(padded - self._staged)
            self._write_stage(padded)
            os.ftruncate(self._fd, self._written)
        self._stage.close()
        self._stage = None

    def _write_all(self, mv: memoryview) -> None:
        assert self._fd is not None
        if self.direct:
            self._stage_in(mv)
            return
        start, nbytes = self._written, len(mv)
        while len(mv):
            n = self.fs.write(self._fd, mv)
            if n <= 0:
                raise OSError(errno.EIO, f"short write to {self.tmp_path}")
            mv = mv[n:]
        self._written += nbytes
        self.fs.start_writeback(self._fd, start, nbytes)

    @property
    def hexdigest(self) -> str:
        """The file's digest (in `self.digest`) over everything written so far."""
        if self._hasher is None:
            raise DigestError(f"{self.name}: written without a digest")
        self._wait_hash()
        return self._hasher.hexdigest()

    @property
    def sha256(self) -> str:
        if self.digest != "sha256":
            raise DigestError(f"{self.name}: digest is {self.digest}, not sha256")
        return self.hexdigest

    def entry(self) -> dict[str, Any]:
        """The file's manifest entry: name, bytes and its digest fields."""
        assert self.digest is not None, "a file written without a digest has no manifest entry"
        return {"name": self.name, "bytes": self.size, **digest_fields(self.digest, self.hexdigest)}

    def commit(self) -> None:
        """Flush, fsync and rename into place (the directory fsync is the caller's).
        The last piece's hash runs during the fsync; the rename waits for it."""
        assert self._fd is not None
        self._flush()
        try:
            if self.direct:
                self._finish_direct()
            self.fsync_s += timed_fsync(self.fs, self._fd)
        except BaseException:
            self._wait_hash(raise_errors=False)  # no thread touches our buffers past here
            raise
        self._wait_hash()
        os.close(self._fd)
        self._fd = None
        os.rename(self.tmp_path, self.final_path)

    def discard(self) -> None:
        """Close and remove the temp file (after an error); never raises."""
        self._wait_hash(raise_errors=False)
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None
        if self._stage is not None:
            self._stage.close()
            self._stage = None
        try:
            os.unlink(self.tmp_path)
        except OSError:
            pass


def dumps_manifest(obj: dict[str, Any]) -> str:
    """JSON with one top-level field per line and compact values (long position lists)."""
    lines = [f" {json.dumps(k)}: {json.dumps(v, separators=(',', ':'))}" for k, v in obj.items()]
    return "{\n" + ",\n".join(lines) + "\n}\n"


def write_json_atomic(directory: Path, name: str, obj: dict[str, Any], fs: FileSystem = DEFAULT_FS) -> AtomicFile:
    """Publish a JSON document durably (file fsync, rename, directory fsync). Not hashed:
    no manifest records a manifest's digest."""
    f = AtomicFile(directory, name, fs, digest=None)
    try:
        f.write(dumps_manifest(obj).encode())
        f.commit()
    except BaseException:
        f.discard()
        raise
    f.fsync_s += fsync_dir(directory, fs)
    return f


def pid_alive(pid: int) -> bool:
    """Whether process `pid` still runs on this host (a zombie does not: it holds nothing)."""
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
            if pid is None or (pid_alive(pid) and not (include_own and pid == os.getpid())):
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
