"""The `sharded` layout (api.md §5): many requests per file, for extraction jobs.

`shard-00000.safetensors`, ... hold "{hook}.{layer}" tensors [rows, hidden] plus
`positions` and `token_ids` (one per row) for the requests in that shard, in
order. `index.jsonl` gets one line per request, appended (and fsynced) only
after the shard holding it is durable; the job `manifest.json` (shards with size
and sha256) is rewritten atomically after that. `index.jsonl` is the truth for
resuming: shards it does not reference (a crash before the append) are deleted
on open, a torn last line is cut, and the manifest is rebuilt when it lags.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from capsteer.capture.layouts import (
    DTYPE_NAME,
    MANIFEST_FILE,
    TensorPlan,
    as_bytes,
    key_name,
    parse_key_name,
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
from capsteer.capture.reader import (
    CaptureReadError,
    CorruptCapture,
    load_manifest,
    sha256_file,
    verify_files,
)
from capsteer.capture.sink import CaptureEnd, CaptureRequest, RowsByPosition
from capsteer.capture.spec import CaptureSpec
from capsteer.hooks import HOOK_SEMANTICS_VERSION, canonical_hook

INDEX_FILE = "index.jsonl"
SHARDED_FORMAT = "capsteer.sharded"
Key = tuple[str, int]


def shard_name(n: int) -> str:
    return f"shard-{n:05d}.safetensors"


@dataclass
class _Buffered:
    request_id: str
    positions: np.ndarray
    token_ids: np.ndarray
    tensors: dict[Key, torch.Tensor]
    prompt_tokens: int


def _read_index(path: Path) -> list[dict[str, Any]]:
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


class ShardedWriter:
    """Appends finished requests to shards of about `shard_bytes`; resumable.

    Not a hot-path object: `add` is called once per finished request (by an
    extraction job or `ShardedSink.close`) and flushes synchronously when a shard
    is full, so the caller is paced by the disk.
    """

    def __init__(
        self,
        out_dir: str | Path,
        *,
        keys: Iterable[Key],
        hidden_size: int,
        dtype: torch.dtype,
        shard_bytes: int = 1 << 30,
        model: str | None = None,
        spec: CaptureSpec | None = None,
        job_id: str | None = None,
        fs: FileSystem = DEFAULT_FS,
    ) -> None:
        self.dir = Path(out_dir)
        self.keys = sorted((canonical_hook(h), int(layer)) for h, layer in keys)
        self.hidden = int(hidden_size)
        self.dtype = dtype
        self.shard_bytes = int(shard_bytes)
        self.model = model
        self.spec = spec
        self.job_id = job_id or self.dir.name
        self.fs = fs
        self._lock = threading.Lock()
        self._buf: list[_Buffered] = []
        self._buf_bytes = 0
        self._callbacks: list[Callable[[list[str]], None]] = []
        ensure_dir(self.dir, fs)
        sweep_temp_files(self.dir)
        self._recover()

    # ----------------------------------------------------------------- resume
    def _recover(self) -> None:
        self.index = _read_index(self.dir / INDEX_FILE)
        self.done_ids: set[str] = {str(e["id"]) for e in self.index}
        referenced = {e["shard"] for e in self.index}
        removed = False
        for p in self.dir.glob("shard-*.safetensors"):
            if p.name not in referenced:  # published, but the index never said so
                p.unlink()
                removed = True
        if removed:
            fsync_dir(self.dir, self.fs)
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
                    "sha256": sha256_file(path),
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
        """Buffer one finished request ([n, hidden] per key); flush when the shard is full."""
        rid = str(request_id)
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        tok = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        if len(tok) != len(pos):
            raise ValueError(f"{rid}: {len(tok)} token ids for {len(pos)} positions")
        norm: dict[Key, torch.Tensor] = {}
        for key in self.keys:
            t = tensors.get(key)
            if t is None or tuple(t.shape) != (len(pos), self.hidden):
                got = None if t is None else tuple(t.shape)
                raise ValueError(f"{rid}: {key_name(*key)} must be [{len(pos)}, {self.hidden}], got {got}")
            norm[key] = t.to(self.dtype).contiguous()
        with self._lock:
            if rid in self.done_ids or any(b.request_id == rid for b in self._buf):
                return  # resumed job: already there
            self._buf.append(_Buffered(rid, pos, tok, norm, int(prompt_tokens)))
            self._buf_bytes += sum(t.nbytes for t in norm.values())
            if self._buf_bytes >= self.shard_bytes:
                self._flush_locked()

    def flush(self) -> None:
        """Publish the partly filled shard now (end of job, or to bound latency)."""
        with self._lock:
            self._flush_locked()

    def close(self) -> None:
        self.flush()

    def __enter__(self) -> ShardedWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _flush_locked(self) -> None:
        if not self._buf:
            return
        batch, self._buf, self._buf_bytes = self._buf, [], 0
        name = shard_name(self.next_shard)
        rows = sum(len(b.positions) for b in batch)
        plans: list[TensorPlan] = [
            tensor_plan("positions", torch.from_numpy(np.concatenate([b.positions for b in batch]))),
            tensor_plan("token_ids", torch.from_numpy(np.concatenate([b.token_ids for b in batch]))),
        ]
        for key in self.keys:
            plans.append(
                TensorPlan(
                    key_name(*key),
                    self.dtype,
                    (rows, self.hidden),
                    lambda key=key: (as_bytes(b.tensors[key]) for b in batch),
                )
            )
        f = AtomicFile(self.dir, name, self.fs)
        try:
            for piece in stream_safetensors(plans, {"format": "pt", "capsteer_job": self.job_id}):
                f.write(piece)
            f.commit()
        except BaseException:
            f.discard()
            self._buf = batch + self._buf  # nothing was indexed: retry on the next flush
            self._buf_bytes = sum(t.nbytes for b in self._buf for t in b.tensors.values())
            raise
        fsync_dir(self.dir, self.fs)
        self.next_shard += 1
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
        fd = os.open(self.dir / INDEX_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            data = ("\n".join(lines) + "\n").encode()
            while data:
                data = data[os.write(fd, data) :]
            timed_fsync(self.fs, fd)
        finally:
            os.close(fd)
        fsync_dir(self.dir, self.fs)  # the index may have just been created
        self.index.extend(entries)
        self.done_ids.update(b.request_id for b in batch)
        self.shards.append(
            {"name": name, "bytes": f.size, "sha256": f.sha256, "rows": rows, "requests": len(batch)}
        )
        self._write_manifest()
        for fn in self._callbacks:
            fn([b.request_id for b in batch])

    def _write_manifest(self) -> None:
        manifest: dict[str, Any] = {
            "format": SHARDED_FORMAT,
            "format_version": 1,
            "job_id": self.job_id,
            "model": self.model,
            "hook_semantics_version": HOOK_SEMANTICS_VERSION,
            "dtype": DTYPE_NAME.get(self.dtype, str(self.dtype)),
            "hidden_size": self.hidden,
            "keys": [key_name(*k) for k in self.keys],
            "spec": None if self.spec is None else self.spec.to_dict(),
            "requests": len(self.index),
            "rows": sum(s["rows"] for s in self.shards),
            "index": INDEX_FILE,
            "shards": self.shards,
            "files": [{"name": s["name"], "bytes": s["bytes"], "sha256": s["sha256"]} for s in self.shards],
            "updated_at": time.time(),
        }
        write_json_atomic(self.dir, MANIFEST_FILE, manifest, self.fs)


class ShardedSink:
    """A `CaptureSink` that appends each finished request to a ShardedWriter.

    For dedicated capture servers and in-process extraction: rows are kept in
    memory per request (positions de-duplicated, last write wins) until close.
    """

    def __init__(self, writer: ShardedWriter) -> None:
        self.writer = writer
        self._lock = threading.Lock()
        self._open: dict[str, tuple[CaptureRequest, RowsByPosition]] = {}

    def open(self, request: CaptureRequest) -> None:
        with self._lock:
            self._open.setdefault(request.capture_id, (request, RowsByPosition()))

    def write(
        self, capture_id: str, hook: str, layer: int, positions: np.ndarray, rows: torch.Tensor
    ) -> None:
        with self._lock:
            entry = self._open.get(capture_id)
            if entry is None:
                return
            entry[1].add((hook, int(layer)), positions, rows)

    def close(self, end: CaptureEnd) -> None:
        with self._lock:
            entry = self._open.pop(end.capture_id, None)
        if entry is None:
            return
        req, rows = entry
        prompt_len = len(req.prompt_token_ids)
        try:
            kept, tensors = rows.assemble(
                self.writer.keys,
                lambda seen: req.spec.positions.finalize(seen, prompt_len, len(end.token_ids)),
                self.writer.hidden, self.writer.dtype)
        except ValueError as exc:
            raise ValueError(f"{end.capture_id}: {exc}") from None
        token_ids = np.asarray(end.token_ids, np.int64)[kept]
        self.writer.add(req.request_id or end.capture_id, kept, token_ids, tensors, prompt_len)

    def abort(self, capture_id: str, reason: str) -> None:
        with self._lock:
            self._open.pop(capture_id, None)


class ShardedCapture:
    """A sharded job directory read back: per-request rows, index, verification."""

    def __init__(self, path: Path, manifest: dict[str, Any]) -> None:
        self.path = path
        self.manifest = manifest
        self.index = read_index(path / INDEX_FILE)
        self._by_id = {str(e["id"]): e for e in self.index}

    def ids(self) -> list[str]:
        return [str(e["id"]) for e in self.index]

    def keys(self) -> list[Key]:
        return [parse_key_name(k) for k in self.manifest.get("keys", [])]

    def request(self, request_id: str) -> dict[str, Any]:
        """{"positions", "token_ids", (hook, layer): tensor} for one request."""
        from safetensors import safe_open

        e = self._by_id[str(request_id)]
        lo, hi = e["row_start"], e["row_start"] + e["row_count"]
        out: dict[Any, Any] = {}
        with safe_open(self.path / e["shard"], framework="pt") as fh:
            out["positions"] = fh.get_slice("positions")[lo:hi].numpy()
            out["token_ids"] = fh.get_slice("token_ids")[lo:hi].numpy()
            for key in self.keys():
                out[key] = fh.get_slice(key_name(*key))[lo:hi]
        return out

    def verify(self) -> list[str]:
        problems = verify_files(self.path, self.manifest)
        listed = {s["name"] for s in self.manifest.get("shards", [])}
        for e in self.index:
            if e["shard"] not in listed:
                problems.append(f"index entry {e['id']} points to unlisted {e['shard']}")
        return problems


def read_index(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    raw = path.read_bytes()
    raw = raw[: raw.rfind(b"\n") + 1]
    return [json.loads(line) for line in raw.splitlines() if line.strip()]


def read_sharded(path: str | Path, *, verify: bool = True) -> ShardedCapture:
    directory, manifest = load_manifest(path)
    if manifest.get("format") != SHARDED_FORMAT:
        raise CaptureReadError(f"{directory}: not a sharded job directory")
    job = ShardedCapture(directory, manifest)
    if verify:
        problems = job.verify()
        if problems:
            raise CorruptCapture(f"{directory}: " + "; ".join(problems))
    return job


def indexed_ids(out_dir: str | Path) -> set[str]:
    """Request ids already durable in a job directory (what a resumed job skips)."""
    return {str(e["id"]) for e in read_index(Path(out_dir) / INDEX_FILE)}
