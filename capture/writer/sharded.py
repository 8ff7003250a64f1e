"""Writing the `sharded` layout (api.md §5): many requests per file, for extraction jobs.

`shard-00000.safetensors`, ... hold "{hook}.{layer}" tensors [rows, hidden] plus
`positions` and `token_ids` (one per row) for the requests in that shard, in
order. `index.jsonl` gets one line per request, appended (and fsynced) only
after the shard holding it is durable; the job `manifest.json` (shards with size
and digest: sha256, or the writer's `digest`) is rewritten atomically after that. `index.jsonl` is the truth for
resuming: shards it does not reference (a crash before the append) are deleted
on open, a torn last line is cut, and the manifest is rebuilt when it lags.

Full shards are written on background threads: the caller (the engine's
harvester thread) must not wait for a 1 GiB write + digest + fsync, or the
engine's pinned ring fills and the GPU step loop stalls. Shards are numbered
when handed off and indexed in hand-off order; the caller blocks only when
`max_pending` shards are already being written (bounded memory).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from capsteer.capture.digests import (
    DEFAULT_DIGEST,
    check_digest,
    digest_fields,
    entry_digest,
    new_hasher,
)
from capsteer.capture.layouts import (
    DTYPE_NAME,
    MANIFEST_FILE,
    TensorPlan,
    as_bytes,
    key_name,
    stream_safetensors,
    tensor_plan,
)
from capsteer.capture.publish import (
    DEFAULT_FS,
    AtomicFile,
    FileSystem,
    ensure_dir,
    fsync_dir,
    sweep_temp_files,
    timed_fsync,
    write_json_atomic,
)
from capsteer.capture.published import (
    file_digest,
    load_manifest,
)
from capsteer.capture.sharded import INDEX_FILE, SHARDED_FORMAT, Key, shard_name
from capsteer.capture.spec import CaptureSpec
from capsteer.hooks import HOOK_SEMANTICS_VERSION, canonical_hook


@dataclass
class _Buffered:
    """One finished request: per key, row pieces whose concatenation is [n, hidden]
    (views of the delivered tensors, cast to the shard dtype only when written)."""

    request_id: str
    positions: np.ndarray
    token_ids: np.ndarray
    pieces: dict[Key, list[torch.Tensor]]
    prompt_tokens: int


@dataclass
class _Shard:
    """A batch handed off to a flush thread; `number` stays across retries."""

    number: int
    batch: list[_Buffered]
    seq: int = 0  # hand-off order; indexing follows it


class _IndexAppendError(Exception):
    """The index append failed after the shard was published (the shard is retried)."""


def read_index_repaired(path: Path) -> list[dict[str, Any]]:
    """Index entries; a torn final line (crash mid-append) is cut off the file."""
    if not path.exists():
        return []
    raw = path.read_bytes()
    cut = raw.rfind(b"\n") + 1
    if cut != len(raw):
        with open(path, "r+b") as fh:
            fh.truncate(cut)
            os.fsync(fh.fileno())
    return [json.loads(line) for line in raw[:cut].splitlines() if line.strip()]


def recover_index(directory: Path, fs: FileSystem) -> tuple[list[dict[str, Any]], int, set[str]]:
    """A job's index as a crash left it: (entries, the index file's size, the shard names
    they reference). A torn last line is cut, and shards the index never named (published
    or linked just before the crash) are removed, so the directory holds what it lists."""
    index_path = directory / INDEX_FILE
    index = read_index_repaired(index_path)
    size = index_path.stat().st_size if index_path.exists() else 0
    referenced = {e["shard"] for e in index}
    removed = False
    for p in directory.glob("shard-*.safetensors"):
        if p.name not in referenced:
            p.unlink()
            removed = True
    if removed:
        fsync_dir(directory, fs)
    return index, size, referenced


class ShardedWriter:
    """Appends finished requests to shards of about `shard_bytes`; resumable.

    `add` is called once per finished request (by an extraction job or
    `ShardedSink.close`) and returns at once: a full shard is written, fsynced,
    indexed and listed in the manifest on one of `flush_threads` threads. `add`
    blocks only while `max_pending` shards are handed off and not yet indexed, so
    memory stays near (max_pending + 1) x shard_bytes. The writer keeps the tensors
    given to `add` (no copy) until their shard is written.

    A failed background write (ENOSPC, EIO) keeps its batch for a retry (with the
    next hand-off or `flush`) and is raised from the next `add`/`flush`/`close`
    on the caller's thread; `flush` raises when anything failed. While writes keep
    failing, kept batches add up in memory (as the synchronous writer's buffer did).
    Done-callbacks run on a flush thread, in hand-off order, and must not call back
    into the writer. `digest` names the shards' digest in the manifest (publish.DIGESTS;
    a manifest rebuilt on resume hashes the shards it lacks with it).
    """

    def __init__(
        self,
        out_dir: str | Path,
        *,
        keys: Iterable[Key],
        hidden_size: int,
        dtype: torch.dtype,
        hook_widths: Mapping[str, int] | None = None,
        shard_bytes: int = 1 << 30,
        model: str | None = None,
        spec: CaptureSpec | None = None,
        job_id: str | None = None,
        fs: FileSystem = DEFAULT_FS,
        flush_threads: int = 2,
        max_pending: int = 2,
        digest: str = DEFAULT_DIGEST,
    ) -> None:
        if flush_threads < 1 or max_pending < 1:
            raise ValueError("flush_threads and max_pending must be >= 1")
        self.dir = Path(out_dir)
        self.keys = sorted((canonical_hook(h), int(layer)) for h, layer in keys)
        self.hidden = int(hidden_size)
        # Each key's row width: hidden_size, or its hook's own (mlp_post: d_mlp).
        self.hook_widths = {h: int(w) for h, w in (hook_widths or {}).items()
                            if any(h.split(".")[0] == k for k, _ in self.keys)}
        self.widths = {key: self.hook_widths.get(key[0], self.hidden) for key in self.keys}
        self.dtype = dtype
        self.shard_bytes = int(shard_bytes)
        self.model = model
        self.spec = spec
        self.job_id = job_id or self.dir.name
        self.fs = fs
        self.digest = check_digest(digest)
        new_hasher(digest)  # a missing library fails here, not on a flush thread
        self.flush_threads = int(flush_threads)
        self.max_pending = int(max_pending)
        self._row_bytes = sum(self.widths.values()) * torch.empty(0, dtype=dtype).element_size()
        # _cond guards the buffer, the shards being written, retries and errors;
        # _commit_lock serializes index appends and manifest writes.
        self._cond = threading.Condition()
        self._commit_lock = threading.Lock()
        self._buf: list[_Buffered] = []
        self._buf_bytes = 0
        self._unindexed: set[str] = set()  # ids buffered, being written or awaiting a retry
        self._writing: set[int] = set()  # seqs of shards handed off and not finished
        self._seq = 0
        self._retry: list[_Shard] = []
        self._errors: list[BaseException] = []
        self._pool: ThreadPoolExecutor | None = None
        self._manifest_stale = False
        self._callbacks: list[Callable[[list[str]], None]] = []
        ensure_dir(self.dir, fs)
        sweep_temp_files(self.dir)
        self._recover()

    # ----------------------------------------------------------------- resume
    def _recover(self) -> None:
        self.index, self._index_size, referenced = recover_index(self.dir, self.fs)
        self.done_ids: set[str] = {str(e["id"]) for e in self.index}
        manifest: dict[str, Any] = {}
        if (self.dir / MANIFEST_FILE).exists():
            manifest = load_manifest(self.dir)[1]
        listed = {s["name"]: s for s in manifest.get("shards", [])}
        self.shards: list[dict[str, Any]] = []
        for name in sorted(referenced):
            entry = listed.get(name)
            if entry is None:  # crash between the index append and the manifest rewrite
                path = self.dir / name
                rows = sum(e["row_count"] for e in self.index if e["shard"] == name)
                entry = {
                    "name": name,
                    "bytes": path.stat().st_size,
                    **digest_fields(self.digest, file_digest(path, self.digest)),
                    "rows": rows,
                    "requests": sum(1 for e in self.index if e["shard"] == name),
                }
            self.shards.append(entry)
        self.next_shard = 1 + max((int(s["name"][6:11]) for s in self.shards), default=-1)
        if self.shards and len(listed) != len(self.shards):
            self._write_manifest()

    # ---------------------------------------------------------------- writing
    def add_done_callback(self, fn: Callable[[list[str]], None]) -> None:
        """fn(request_ids) after each shard holding them is durable and indexed."""
        self._callbacks.append(fn)

    def add(
        self,
        request_id: str,
        positions: np.ndarray,
        token_ids: np.ndarray,
        tensors: dict[Key, torch.Tensor],
        prompt_tokens: int,
    ) -> None:
        """Buffer one finished request ([n, hidden] per key); hand off a full shard.

        Raises a previous background flush's error (after taking this request)."""
        pieces: dict[Key, list[torch.Tensor]] = {}
        for key in self.keys:
            t = tensors.get(key)
            if t is None:
                raise ValueError(f"{request_id}: no tensor for {key_name(*key)}")
            pieces[key] = [t if t.is_contiguous() else t.contiguous()]
        self._add(str(request_id), positions, token_ids, pieces, prompt_tokens)

    def _add(
        self,
        rid: str,
        positions: np.ndarray,
        token_ids: np.ndarray,
        pieces: dict[Key, list[torch.Tensor]],
        prompt_tokens: int,
    ) -> None:
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        tok = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        if len(tok) != len(pos):
            raise ValueError(f"{rid}: {len(tok)} token ids for {len(pos)} positions")
        for key in self.keys:
            got = pieces.get(key)
            if got is None or any(p.dim() != 2 or p.shape[1] != self.widths[key] for p in got) \
                    or sum(p.shape[0] for p in got) != len(pos):
                shape = None if got is None else tuple(got[0].shape) if len(got) == 1 \
                    else [tuple(p.shape) for p in got]
                raise ValueError(f"{rid}: {key_name(*key)} must be [{len(pos)}, {self.widths[key]}], "
                                 f"got {shape}")
        with self._cond:
            if rid not in self.done_ids and rid not in self._unindexed:  # else: resumed, already there
                self._buf.append(_Buffered(rid, pos, tok, pieces, int(prompt_tokens)))
                self._unindexed.add(rid)
                self._buf_bytes += len(pos) * self._row_bytes
                if self._buf_bytes >= self.shard_bytes:
                    self._hand_off_locked()
            error = self._take_error_locked()
        if error is not None:
            raise error

    def flush(self) -> None:
        """Publish the partly filled shard now (end of job, or to bound latency) and wait
        until every shard handed off so far is durable and indexed; raises if any failed."""
        with self._cond:
            self._hand_off_locked()
            target = self._seq
            while any(s <= target for s in self._writing):
                self._cond.wait()
            error = self._take_error_locked()
            stale = self._manifest_stale and not self._writing
        if error is not None:
            raise error
        if stale:
            with self._commit_lock:
                self._write_manifest()
                self._manifest_stale = False

    def close(self) -> None:
        """flush(), then stop the flush threads (a later add starts them again)."""
        try:
            self.flush()
        finally:
            with self._cond:
                pool, self._pool = self._pool, None
            if pool is not None:
                pool.shutdown(wait=True)

    def __enter__(self) -> ShardedWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _take_error_locked(self) -> BaseException | None:
        if not self._errors:
            return None
        error, self._errors = self._errors[0], []
        return error

    def _hand_off_locked(self) -> None:
        """Start shards awaiting a retry and the buffer (numbered now) on the flush threads,
        waiting while `max_pending` are being written. Holds self._cond (released in wait)."""
        jobs, self._retry = self._retry, []
        if self._buf:
            jobs.append(_Shard(self.next_shard, self._buf))
            self.next_shard += 1
            self._buf, self._buf_bytes = [], 0
        try:
            while jobs:
                while len(self._writing) >= self.max_pending:
                    self._cond.wait()
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self.flush_threads,
                                                    thread_name_prefix="capsteer-shard")
                self._seq += 1
                jobs[0].seq = self._seq
                self._writing.add(self._seq)
                try:
                    self._pool.submit(self._write_shard, jobs[0])
                except BaseException:
                    self._writing.discard(self._seq)
                    raise
                jobs.pop(0)
        finally:
            self._retry = jobs + self._retry  # not started (interrupted): keep for a retry

    def _write_shard(self, job: _Shard) -> None:
        """Flush thread: write and publish the shard, then index it in hand-off order."""
        failed: BaseException | None = None
        retry = True
        try:
            f = self._publish(job)
            with self._cond:
                while any(s < job.seq for s in self._writing):
                    self._cond.wait()
            with self._commit_lock:
                retry = False
                self._commit(job, f)
        except _IndexAppendError as exc:
            failed, retry = exc.__cause__ or exc, True
        except BaseException as exc:
            failed = exc
        with self._cond:
            self._writing.discard(job.seq)
            if failed is not None:
                self._errors.append(failed)
                if retry:
                    self._retry.append(job)
            self._cond.notify_all()

    def _publish(self, job: _Shard) -> AtomicFile:
        """Temp name, write + digest, fsync, rename, fsync dir (no lock held)."""
        batch = job.batch
        rows = sum(len(b.positions) for b in batch)
        plans: list[TensorPlan] = [
            tensor_plan("positions", torch.from_numpy(np.concatenate([b.positions for b in batch]))),
            tensor_plan("token_ids", torch.from_numpy(np.concatenate([b.token_ids for b in batch]))),
        ]
        for key in self.keys:
            plans.append(TensorPlan(key_name(*key), self.dtype, (rows, self.widths[key]),
                                    lambda key=key: self._row_bytes_of(batch, key)))
        f = AtomicFile(self.dir, shard_name(job.number), self.fs, self.digest)
        try:
            f.write_pieces(stream_safetensors(plans, {"format": "pt", "capsteer_job": self.job_id}))
            f.commit()
        except BaseException:
            f.discard()
            raise
        fsync_dir(self.dir, self.fs)
        return f

    def _row_bytes_of(self, batch: list[_Buffered], key: Key) -> Iterator[memoryview]:
        for b in batch:
            for p in b.pieces[key]:
                yield as_bytes(p if p.dtype == self.dtype else p.to(self.dtype))

    def _commit(self, job: _Shard, f: AtomicFile) -> None:
        """Append the shard's index lines, then list it in the manifest; under _commit_lock."""
        batch, name = job.batch, f.name
        lines, start, entries = [], 0, []
        for b in batch:
            entry = {
                "id": b.request_id,
                "shard": name,
                "row_start": start,
                "row_count": len(b.positions),
                "prompt_tokens": b.prompt_tokens,
            }
            entries.append(entry)
            lines.append(json.dumps(entry, separators=(",", ":")))
            start += len(b.positions)
        try:
            self._append_index(("\n".join(lines) + "\n").encode())
        except BaseException as exc:
            raise _IndexAppendError(str(exc)) from exc
        ids = [b.request_id for b in batch]
        self.index.extend(entries)
        with self._cond:
            self.done_ids.update(ids)
            self._unindexed.difference_update(ids)
        entry = {**f.entry(), "rows": start,
                 "requests": len(batch)}
        self.shards = sorted([*(s for s in self.shards if s["name"] != name), entry],
                             key=lambda s: s["name"])
        try:
            self._write_manifest()
            self._manifest_stale = False
        except BaseException:
            self._manifest_stale = True  # the index is the truth; flush() rewrites it
            raise
        finally:
            for fn in self._callbacks:
                fn(ids)

    def _append_index(self, data: bytes) -> None:
        """Append + fsync the index lines (and the directory: the index may be new). On
        failure cut the file back to its last good size, so a retry (or a resume) never
        sees a half-written or repeated line."""
        good = self._index_size
        fd = os.open(self.dir / INDEX_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC,
                     0o644)
        try:
            if os.fstat(fd).st_size != good:
                os.ftruncate(fd, good)  # left by an earlier failed append
            try:
                while data:
                    data = data[os.write(fd, data):]
                timed_fsync(self.fs, fd)
                fsync_dir(self.dir, self.fs)
            except BaseException:
                try:
                    os.ftruncate(fd, good)
                except OSError:
                    pass  # the next append cuts it
                raise
            self._index_size = os.fstat(fd).st_size
        finally:
            os.close(fd)

    def _write_manifest(self) -> None:
        manifest: dict[str, Any] = {
            "format": SHARDED_FORMAT,
            "format_version": 1,
            "job_id": self.job_id,
            "model": self.model,
            "hook_semantics_version": HOOK_SEMANTICS_VERSION,
            "dtype": DTYPE_NAME.get(self.dtype, str(self.dtype)),
            "hidden_size": self.hidden,
            **({"hook_widths": self.hook_widths} if self.hook_widths else {}),
            "keys": [key_name(*k) for k in self.keys],
            "spec": None if self.spec is None else self.spec.to_dict(),
            "requests": len(self.index),
            "rows": sum(s["rows"] for s in self.shards),
            "index": INDEX_FILE,
            "shards": self.shards,
            "files": [_file_entry(s) for s in self.shards],
            "updated_at": time.time(),
        }
        write_json_atomic(self.dir, MANIFEST_FILE, manifest, self.fs)


def _file_entry(shard: dict[str, Any]) -> dict[str, Any]:
    """A shard's `files` entry: name, bytes and the digest fields it was listed with
    (each shard keeps its own digest, so a job resumed with another one mixes them)."""
    name, _ = entry_digest(shard)
    return {k: shard[k] for k in ("name", "bytes", "digest", name) if isinstance(k, str) and k in shard}
