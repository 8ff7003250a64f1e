"""The durable capture sink: accumulates rows per request, publishes at request end.

`CaptureWriter` implements the engine's `CaptureSink`. The engine thread only
appends references to rows it already copied (and, under the block policy when
memory is exhausted, spills them to a temp file); worker threads finalize
positions, stream safetensors files, fsync, rename and write the manifest last.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from capsteer.capture import metrics
from capsteer.capture.layouts import (
    DTYPE_NAME,
    MANIFEST_FILE,
    TORCH_DTYPE,
    TensorPlan,
    as_bytes,
    files_for,
    key_name,
    stream_safetensors,
    tensor_plan,
)
from capsteer.capture.paths import relative_dir, validate_capture_id
from capsteer.capture.pool import POLICIES, Budget, Grant, Overloaded, WorkerThreads
from capsteer.capture.publish import (
    DEFAULT_FS,
    AtomicFile,
    FileSystem,
    ensure_dir,
    fsync_dir,
    sweep_temp_files,
    temp_name,
    write_json_atomic,
)
from capsteer.capture.receipts import Receipt, ReceiptBoard, find_receipt, pending
from capsteer.capture.sink import CaptureEnd, CaptureRequest
from capsteer.capture.spec import CaptureSpec, PositionSpec
from capsteer.hooks import HOOK_SEMANTICS_VERSION

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
_PIECE_BYTES = 4 << 20  # bound on one assembled/converted piece (memory outside the budget)

Key = tuple[str, int]


def estimate_bytes(
    spec: CaptureSpec, hidden_size: int, itemsize: int, prompt_tokens: int, max_new_tokens: int
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
    return spec.row_bytes(hidden_size, itemsize) * n


def default_workers() -> int:
    """Writer threads: every published byte is sha256-hashed (about 1.2 GB/s a thread),
    so the pool needs several cores to keep up with a fast disk (bench/results)."""
    return max(2, min(8, (os.cpu_count() or 2) // 2))


class CaptureDataError(RuntimeError):
    """The rows handed over cannot form a consistent capture (an engine bug)."""


class _AlreadyPublished(RuntimeError):
    pass


@dataclass
class _Chunk:
    positions: np.ndarray
    rows: torch.Tensor | None  # None once spilled
    dtype: torch.dtype
    hidden: int
    nbytes: int
    spill_offset: int = -1


@dataclass
class _Capture:
    req: CaptureRequest
    rel_dir: str
    path: Path
    keys: frozenset[Key]
    opened_at: float
    lock: threading.Lock = field(default_factory=threading.Lock)
    chunks: dict[Key, list[_Chunk]] = field(default_factory=dict)
    mem_bytes: int = 0  # accounted in the budget
    spill_fd: int | None = None
    spill_path: Path | None = None
    spill_size: int = 0
    dropped: str | None = None  # reason, when dropped
    failed: str | None = None  # error met while the request was running (e.g. spill ENOSPC)
    closed: bool = False
    closed_at: float = 0.0
    sealed_left: int = 0

    @property
    def prompt_len(self) -> int:
        return len(self.req.prompt_token_ids)

    def close_spill(self) -> None:
        if self.spill_fd is not None:
            try:
                os.close(self.spill_fd)
            except OSError:
                pass
            self.spill_fd = None
        if self.spill_path is not None:
            try:
                os.unlink(self.spill_path)
            except OSError:
                pass
            self.spill_path = None


def _plan_key(
    chunks: list[_Chunk], pspec: PositionSpec, prompt_len: int, fed_len: int
) -> tuple[list[tuple[_Chunk, int, int]], np.ndarray]:
    """Runs (chunk, row_start, row_stop) giving the kept rows in position order.

    A position written twice (preemption then recompute) takes its last write.
    """
    if not chunks:
        return [], np.zeros(0, np.int64)
    pos = np.concatenate([c.positions for c in chunks])
    cid = np.repeat(np.arange(len(chunks)), [len(c.positions) for c in chunks])
    row = np.concatenate([np.arange(len(c.positions)) for c in chunks])
    uniq, first_in_rev = np.unique(pos[::-1], return_index=True)
    last = len(pos) - 1 - first_in_rev
    kept = pspec.finalize(uniq, prompt_len, fed_len)
    sel = last[np.searchsorted(uniq, kept)]
    if len(sel) == 0:
        return [], kept
    c, r = cid[sel], row[sel]
    breaks = np.flatnonzero((np.diff(c) != 0) | (np.diff(r) != 1)) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(sel)]])
    runs = [(chunks[int(c[s])], int(r[s]), int(r[s]) + int(e - s)) for s, e in zip(starts, ends, strict=True)]
    return runs, kept


class CaptureWriter:
    """Durable `CaptureSink`: writer pool, in-flight budget, atomic publish, receipts.

    root: capture root (api.md §5). budget_bytes: row bytes held in memory at most.
    policy: "block" | "drop" | "reject". fs: syscall wrapper (tests inject latency).
    """

    def __init__(
        self,
        root: str | Path,
        *,
        budget_bytes: int = 1 << 30,
        policy: str = "block",
        workers: int | None = None,
        fs: FileSystem = DEFAULT_FS,
        sweep: bool = True,
        keep_receipts: int = 10_000,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown overload policy {policy!r}; accepted: {', '.join(POLICIES)}")
        self.root = Path(root).resolve()
        self.fs = fs
        self.clock = clock
        ensure_dir(self.root, fs)
        self.swept: list[Path] = sweep_temp_files(self.root) if sweep else []
        if self.swept:
            log.warning("swept %d stale capture temp files under %s", len(self.swept), self.root)
        self.budget = Budget(budget_bytes, policy)
        self.receipts = ReceiptBoard(keep_receipts)
        self._caps: dict[str, _Capture] = {}
        self._caps_lock = threading.Lock()
        self._pool = WorkerThreads(workers or default_workers())
        self._host = socket.gethostname()
        self.spilled_bytes = 0

    # ----------------------------------------------------------------- sink API
    def open(self, request: CaptureRequest) -> None:
        """Register a captured request (cheap: no filesystem access)."""
        validate_capture_id(request.capture_id)
        now = self.clock()
        rel = relative_dir(request.capture_id, request.spec.tag, now)
        cap = _Capture(
            req=request,
            rel_dir=rel,
            path=self.root / rel,  # every component of rel was validated as a slug
            keys=frozenset(request.spec.keys()),
            opened_at=now,
        )
        with self._caps_lock:
            if request.capture_id in self._caps:
                return
            self._caps[request.capture_id] = cap
        self.receipts.reopen(request.capture_id)

    def write(
        self, capture_id: str, hook: str, layer: int, positions: np.ndarray, rows: torch.Tensor
    ) -> None:
        """Take rows for (hook, layer) at absolute positions; returns without disk I/O
        unless the block policy has to spill."""
        with self._caps_lock:
            cap = self._caps.get(capture_id)
        if cap is None or cap.dropped or cap.failed:
            return
        key = (hook, int(layer))
        if key not in cap.keys:
            log.warning("capture %s: ignoring rows for uncaptured key %s", capture_id, key)
            return
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        if rows.dim() == 1:
            rows = rows.reshape(1, -1)
        if rows.dim() != 2 or rows.shape[0] != len(pos):
            raise ValueError(f"rows {tuple(rows.shape)} do not match {len(pos)} positions")
        pspec = cap.req.spec.positions
        mask = pspec.candidate(pos, cap.prompt_len)
        if pspec.kind == "last":
            # Only the highest position can survive: keep one row per key in memory.
            cand = np.flatnonzero(mask)
            if len(cand):
                best = cand[pos[cand] == pos[cand].max()][-1]
                mask = np.zeros_like(mask)
                mask[best] = True
        if not mask.all():
            pos = pos[mask]
            rows = rows[torch.from_numpy(mask)]
        elif rows.untyped_storage().nbytes() > 2 * rows.nbytes or not rows.is_contiguous():
            rows = rows.contiguous().clone()  # do not pin a larger engine buffer
        if len(pos) == 0:
            return
        chunk = _Chunk(pos, rows, rows.dtype, int(rows.shape[1]), int(rows.nbytes))
        grant = self.budget.acquire(chunk.nbytes, self._spill_some)
        if grant is Grant.REFUSED:
            self._drop(cap, "budget")
            return
        with cap.lock:
            if cap.dropped or cap.failed or cap.closed:
                if grant is Grant.TAKEN:
                    self.budget.release_open(chunk.nbytes)
                return
            if grant is Grant.DIRECT:
                try:
                    self._spill_chunk(cap, chunk)
                except OSError as exc:
                    self._fail_locked(cap, f"spill failed: {exc}")
                    return
            else:
                cap.mem_bytes += chunk.nbytes
            lst = cap.chunks.setdefault(key, [])
            if pspec.kind == "last" and lst:
                if int(max(c.positions.max() for c in lst)) > int(pos[0]):
                    freed = chunk.nbytes if chunk.rows is not None else 0  # stale recompute
                    lst_new = lst
                else:
                    freed = sum(c.nbytes for c in lst if c.rows is not None)
                    lst_new = [chunk]
                cap.mem_bytes -= freed
                cap.chunks[key] = lst_new
                self.budget.release_open(freed)
                return
            lst.append(chunk)

    def close(self, end: CaptureEnd) -> None:
        """The request finished: hand publishing to the pool and return."""
        with self._caps_lock:
            cap = self._caps.pop(end.capture_id, None)
        if cap is None:
            return
        with cap.lock:
            cap.closed = True
            cap.closed_at = self.clock()
            cap.sealed_left = cap.mem_bytes
            self.budget.seal(cap.mem_bytes)
            cap.mem_bytes = 0
        self._pool.submit(lambda: self._finish(cap, end))

    def abort(self, capture_id: str, reason: str) -> None:
        """The request ended without finishing: nothing is published; receipt says error."""
        with self._caps_lock:
            cap = self._caps.pop(capture_id, None)
        if cap is None:
            return
        with cap.lock:
            cap.closed = True
            cap.closed_at = self.clock()
            freed, cap.mem_bytes = cap.mem_bytes, 0
            cap.chunks.clear()
            if not cap.failed:
                cap.failed = f"aborted: {reason}"
        self.budget.release_open(freed)
        end = CaptureEnd(capture_id, tuple(cap.req.prompt_token_ids), finish_reason="abort")
        self._pool.submit(lambda: self._finish(cap, end))

    # -------------------------------------------------------- admission, receipts
    def admit(self, estimated_bytes: int) -> bool:
        """Whether to accept a new capture now (False only under the reject policy)."""
        return self.budget.admit(estimated_bytes)

    def admit_or_raise(self, estimated_bytes: int) -> None:
        """Like admit, raising Overloaded (-> HTTP 429 with Retry-After) when refused."""
        if not self.admit(estimated_bytes):
            raise Overloaded(
                f"capture budget exhausted ({self.budget.inflight} of {self.budget.limit} bytes in flight)"
            )

    def future(self, capture_id: str) -> Future[Receipt]:
        """A concurrent.futures.Future resolved with the final receipt."""
        return self.receipts.future(capture_id)

    def add_done_callback(self, capture_id: str, fn: Callable[[Receipt], None]) -> None:
        """Call fn(receipt) from a writer thread once final (at once if it already is)."""
        self.receipts.add_done_callback(capture_id, fn)

    async def wait(self, capture_id: str, timeout: float | None = None) -> Receipt:
        """Await the final receipt (asyncio); a pending receipt on timeout, never a hang."""
        return await self.receipts.wait(capture_id, timeout)

    def receipt(self, capture_id: str) -> Receipt | None:
        """Final receipt if known here, pending if still running here, else from disk."""
        done = self.receipts.get(capture_id)
        if done is not None:
            return done
        with self._caps_lock:
            if capture_id in self._caps:
                return pending(capture_id)
        try:
            return find_receipt(self.root, capture_id)
        except ValueError:
            return None

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every closed capture is published (tests, shutdown)."""
        return self._pool.drain(timeout)

    def shutdown(self, timeout: float | None = None) -> None:
        """Publish what was closed, then stop the threads; open captures are aborted."""
        with self._caps_lock:
            open_ids = list(self._caps)
        for cid in open_ids:
            self.abort(cid, "writer shut down")
        self._pool.drain(timeout)
        self._pool.stop(timeout)

    def __enter__(self) -> CaptureWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def stats(self) -> dict[str, Any]:
        b = self.budget
        with self._caps_lock:
            n_open = len(self._caps)
        return {
            "policy": b.policy,
            "budget_bytes": b.limit,
            "inflight_bytes": b.inflight,
            "open_bytes": b.open_bytes,
            "sealed_bytes": b.sealed_bytes,
            "peak_bytes": b.peak,
            "open_captures": n_open,
            "spilled_bytes": self.spilled_bytes,
        }

    # ------------------------------------------------------------ overload paths
    def _drop(self, cap: _Capture, reason: str) -> None:
        with cap.lock:
            if cap.dropped or cap.closed:
                return
            cap.dropped = reason
            freed, cap.mem_bytes = cap.mem_bytes, 0
            cap.chunks.clear()
            cap.close_spill()
        self.budget.release_open(freed)
        metrics.DROPPED.labels(reason=reason).inc()

    def _fail_locked(self, cap: _Capture, message: str) -> None:
        cap.failed = message
        freed, cap.mem_bytes = cap.mem_bytes, 0
        cap.chunks.clear()
        cap.close_spill()
        self.budget.release_open(freed)

    def _spill_chunk(self, cap: _Capture, chunk: _Chunk) -> None:
        """Append a chunk's rows to the capture's spill file (caller holds cap.lock)."""
        assert chunk.rows is not None
        if cap.spill_fd is None:
            ensure_dir(cap.path, self.fs)
            cap.spill_path = cap.path / temp_name("spill")
            cap.spill_fd = os.open(
                cap.spill_path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600
            )
        data = as_bytes(chunk.rows)
        offset = cap.spill_size
        while len(data):
            n = os.pwrite(cap.spill_fd, data, offset + (chunk.nbytes - len(data)))
            data = data[n:]
        cap.spill_size += chunk.nbytes
        self.spilled_bytes += chunk.nbytes
        chunk.spill_offset = offset
        chunk.rows = None

    def _spill_some(self, need: int) -> int:
        """Move open captures' rows to their spill files, largest first, until `need` freed."""
        with self._caps_lock:
            caps = sorted(self._caps.values(), key=lambda c: c.mem_bytes, reverse=True)
        freed_total = 0
        for cap in caps:
            if freed_total >= need:
                break
            with cap.lock:
                if cap.closed or cap.dropped or cap.failed or cap.mem_bytes == 0:
                    continue
                freed = 0
                try:
                    for lst in cap.chunks.values():
                        for chunk in lst:
                            if chunk.rows is not None:
                                self._spill_chunk(cap, chunk)
                                freed += chunk.nbytes
                except OSError as exc:
                    cap.mem_bytes -= freed
                    self.budget.release_open(freed)
                    freed_total += freed + cap.mem_bytes
                    self._fail_locked(cap, f"spill failed: {exc}")
                    continue
                cap.mem_bytes -= freed
            self.budget.release_open(freed)
            freed_total += freed
        return freed_total

    # --------------------------------------------------------------- publishing
    def _release_sealed(self, cap: _Capture, n: int) -> None:
        n = min(n, cap.sealed_left)
        cap.sealed_left -= n
        self.budget.release_sealed(n)

    def _pieces(
        self, cap: _Capture, key: Key, runs: list[tuple[_Chunk, int, int]], out: torch.dtype
    ) -> Iterator[memoryview | bytes]:
        """The kept rows of one key in position order, converted to `out`."""
        for chunk, start, stop in runs:
            row_bytes = chunk.nbytes // max(1, len(chunk.positions))
            step = max(1, _PIECE_BYTES // max(1, row_bytes))
            for a in range(start, stop, step):
                b = min(stop, a + step)
                if chunk.rows is not None:
                    t = chunk.rows[a:b]
                else:
                    assert cap.spill_fd is not None
                    raw = bytearray((b - a) * row_bytes)
                    got = os.preadv(cap.spill_fd, [raw], chunk.spill_offset + a * row_bytes)
                    if got != len(raw):
                        raise OSError(f"short read from spill file {cap.spill_path}")
                    t = torch.frombuffer(raw, dtype=chunk.dtype).view(b - a, chunk.hidden)
                if t.dtype != out:
                    t = t.to(out)
                yield as_bytes(t)
        held = sum(c.nbytes for c in cap.chunks.get(key, []) if c.rows is not None)
        cap.chunks[key] = []
        runs.clear()  # drop the last references to this key's rows
        self._release_sealed(cap, held)

    def _finish(self, cap: _Capture, end: CaptureEnd) -> None:
        started = self.clock()
        try:
            if cap.dropped:
                receipt = self._publish_status(cap, "dropped", f"dropped: {cap.dropped}")
            elif cap.failed:
                receipt = self._publish_status(cap, "error", cap.failed)
            else:
                receipt = self._publish(cap, end, started)
        except _AlreadyPublished as exc:
            receipt = Receipt(cap.req.capture_id, "error", cap.rel_dir, error=str(exc))
        except Exception as exc:  # a receipt must always come
            log.warning("capture %s: publish failed: %r", cap.req.capture_id, exc)
            try:
                receipt = self._publish_status(cap, "error", f"{type(exc).__name__}: {exc}")
            except Exception:
                receipt = Receipt(cap.req.capture_id, "error", cap.rel_dir, error=repr(exc))
        finally:
            self._release_sealed(cap, cap.sealed_left)
            cap.chunks.clear()
            cap.close_spill()
        metrics.REQUESTS.labels(status=receipt.status).inc()
        self.receipts.resolve(receipt)

    def _publish_status(self, cap: _Capture, status: str, message: str) -> Receipt:
        """A manifest without data files, so other processes learn the outcome too."""
        manifest = self._manifest_base(cap, status, message)
        try:
            if not (cap.path / MANIFEST_FILE).exists():
                ensure_dir(cap.path, self.fs)
                write_json_atomic(cap.path, MANIFEST_FILE, manifest, self.fs)
        except OSError as exc:
            log.warning("capture %s: could not write %s manifest: %s", cap.req.capture_id, status, exc)
        return Receipt.from_manifest(manifest, cap.rel_dir)

    def _manifest_base(self, cap: _Capture, status: str, error: str | None, **fields: Any) -> dict[str, Any]:
        """Manifest fields in reading order; `fields` fills in what only a publish knows."""
        req = cap.req
        manifest: dict[str, Any] = {
            "format": "capsteer.capture",
            "format_version": FORMAT_VERSION,
            "capture_id": req.capture_id,
            "request_id": req.request_id,
            "status": status,
            "error": error,
            "model": req.model,
            "hook_semantics_version": HOOK_SEMANTICS_VERSION,
            "layout": req.spec.layout,
            "dtype": fields.pop("dtype", None),
            "model_dtype": DTYPE_NAME.get(req.model_dtype, str(req.model_dtype)),
            "num_layers": req.num_layers,
            "hidden_size": req.hidden_size,
            "spec": req.spec.to_dict(),
            "keys": [key_name(*k) for k in req.spec.keys()],
            "prompt_tokens": len(req.prompt_token_ids),
        }
        manifest.update(fields)
        manifest.setdefault("positions", [])
        manifest.setdefault("files", [])
        manifest["timings"] = {"opened_at": cap.opened_at, "closed_at": cap.closed_at}
        manifest["writer"] = {"host": self._host, "pid": os.getpid()}
        return manifest

    def _publish(self, cap: _Capture, end: CaptureEnd, started: float) -> Receipt:
        req, spec = cap.req, cap.req.spec
        fed = len(end.token_ids)
        plans_by_key: dict[Key, list[tuple[_Chunk, int, int]]] = {}
        positions: np.ndarray | None = None
        hidden = req.hidden_size
        for key in spec.keys():
            runs, kept = _plan_key(cap.chunks.get(key, []), spec.positions, cap.prompt_len, fed)
            if positions is None:
                positions = kept
            elif not np.array_equal(positions, kept):
                raise CaptureDataError(
                    f"{key_name(*key)} has positions {kept.tolist()[:8]}..., "
                    f"other keys {positions.tolist()[:8]}..."
                )
            for chunk, _, _ in runs:
                if chunk.hidden != hidden:
                    raise CaptureDataError(f"{key_name(*key)}: rows of width {chunk.hidden}, model {hidden}")
            plans_by_key[key] = runs
        assert positions is not None
        token_ids = np.asarray(end.token_ids, dtype=np.int64)[positions]
        out = req.model_dtype if spec.dtype == "auto" else TORCH_DTYPE[spec.dtype]
        n = len(positions)

        files: list[AtomicFile] = []
        committed: list[Path] = []
        fsync_s = ensure_dir(cap.path, self.fs)
        if (cap.path / MANIFEST_FILE).exists():
            raise _AlreadyPublished(f"{cap.rel_dir} already has a manifest")
        t_write = time.perf_counter()
        tensors: dict[str, dict[str, Any]] = {}
        try:
            for fname, keys in files_for(spec.layout, spec.keys()).items():
                plans: list[TensorPlan] = [
                    tensor_plan("positions", torch.from_numpy(positions)),
                    tensor_plan("token_ids", torch.from_numpy(token_ids)),
                ]
                for key in keys:
                    name = key_name(*key)
                    plans.append(
                        TensorPlan(
                            name,
                            out,
                            (n, hidden),
                            lambda key=key: self._pieces(cap, key, plans_by_key[key], out),
                        )
                    )
                    tensors[name] = {"file": fname, "shape": [n, hidden], "dtype": DTYPE_NAME[out]}
                f = AtomicFile(cap.path, fname, self.fs)
                files.append(f)
                meta = {"format": "pt", "capsteer_capture_id": req.capture_id}
                for piece in stream_safetensors(plans, meta):
                    f.write(piece)
                f.commit()
                committed.append(f.final_path)
            fsync_s += sum(f.fsync_s for f in files) + fsync_dir(cap.path, self.fs)
            write_s = time.perf_counter() - t_write
            manifest = self._manifest_base(
                cap,
                "ok",
                None,
                dtype=DTYPE_NAME[out],
                fed_tokens=fed,
                finish_reason=end.finish_reason,
                positions=positions.tolist(),
                token_ids=token_ids.tolist(),
                files=[{"name": f.name, "bytes": f.size, "sha256": f.sha256} for f in files],
                tensors=tensors,
            )
            durable_at = self.clock()
            manifest["timings"].update(
                {
                    "started_at": started,
                    "queued_s": round(started - cap.closed_at, 6),
                    "write_s": round(write_s, 6),
                    "fsync_s": round(fsync_s, 6),
                    # The manifest's own fsync is not included in these two:
                    "publish_s": round(durable_at - cap.closed_at, 6),
                    "published_at": durable_at,
                }
            )
            write_json_atomic(cap.path, MANIFEST_FILE, manifest, self.fs)
        except BaseException:
            for f in files:
                f.discard()
            for p in committed:  # complete, but no manifest will ever list them
                try:
                    p.unlink()
                except OSError:
                    pass
            raise
        publish_s = self.clock() - cap.closed_at
        manifest["timings"]["publish_s"] = round(publish_s, 6)
        metrics.PUBLISH_SECONDS.observe(publish_s)
        data_bytes = sum(f.size for f in files)
        metrics.BYTES.inc(data_bytes)
        metrics.FILES.inc(len(files))
        return Receipt.from_manifest(manifest, cap.rel_dir)
