"""The durable capture sink: accumulates rows per request, publishes at request end.

`CaptureWriter` implements the engine's `CaptureSink`. The engine thread only
appends references to rows it already copied (and, under the block policy when
memory is exhausted, spills them to a temp file); worker threads finalize
positions, stream safetensors files, fsync, rename and write the manifest last.

Pipeline parallelism (`CaptureRequest.num_stages` S > 1): each stage's worker has
its own writer on the same root and holds only its keys (`CaptureRequest.keys`).
A stage writes its data files (per_file: the usual `{hook}.{layer}.safetensors`;
packed: `activations-stage{s}.safetensors`; nothing for a stage without keys),
fsyncs them and the directory, then publishes its part manifest `.stage-{s}.json`
(same fields as a manifest, plus `stage` and `stages`; `keys` are the stage's)
instead of `manifest.json`. It then lists the parts: because every stage writes
its part before listing, the last one to finish sees all S, and whoever creates
`.merge.lock` (O_EXCL) first writes the one `manifest.json` from the parts (see
`merge_parts`). Error and dropped outcomes take the same path, so a failed stage
still ends in exactly one manifest, with status error/dropped naming the stage.
The writer's own receipt, future and metrics stay per stage (that stage's
outcome); the merged outcome is the manifest on disk, which the server reads.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from capsteer.capture import metrics
from capsteer.capture.layouts import (
    DTYPE_NAME,
    MANIFEST_FILE,
    MERGE_LOCK_FILE,
    TORCH_DTYPE,
    TensorPlan,
    as_bytes,
    files_for,
    key_name,
    part_name,
    stream_safetensors,
    tensor_plan,
)
from capsteer.capture.paths import relative_dir, validate_capture_id
from capsteer.capture.pool import (
    DEFAULT_BUDGET_BYTES,
    Budget,
    Grant,
    Overloaded,
    WorkerThreads,
    check_budget,
)
from capsteer.capture.publish import (
    DEFAULT_DIGEST,
    DEFAULT_FS,
    AtomicFile,
    FileSystem,
    check_digest,
    ensure_dir,
    fsync_dir,
    new_hasher,
    sweep_temp_files,
    temp_name,
    write_json_atomic,
)
from capsteer.capture.receipts import Receipt, ReceiptBoard, find_receipt, pending
from capsteer.capture.sink import CaptureEnd, CaptureRequest, CaptureSink
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
    """Writer threads: every published byte is hashed (sha256 about 1.8 GB/s a core,
    blake3 about 6; on digest threads that overlap the writes), so the pool needs
    several cores to keep up with a fast disk (bench/README.md)."""
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
    key_order: list[Key]  # the keys this writer publishes (this stage's), in spec order
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

    @property
    def staged(self) -> bool:
        """One of several pipeline stages: publishes a part, not the manifest."""
        return self.req.num_stages > 1

    @property
    def part(self) -> str:
        return part_name(self.req.stage)

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


def stage_keys(request: CaptureRequest) -> list[Key]:
    """The keys this request's writer publishes, in spec order (all of them unless a
    pipeline stage names its own); rejects stage fields that cannot be merged."""
    spec_keys = request.spec.keys()
    if request.num_stages < 1 or not 0 <= request.stage < request.num_stages:
        raise ValueError(
            f"capture {request.capture_id}: stage {request.stage} of {request.num_stages} stages"
        )
    if request.keys is None:
        return spec_keys
    wanted = {(str(h), int(layer)) for h, layer in request.keys}
    unknown = sorted(wanted - set(spec_keys))
    if unknown:
        names = ", ".join(key_name(*k) for k in unknown)
        raise ValueError(f"capture {request.capture_id}: stage keys {names} are not in the spec")
    if request.num_stages == 1 and len(wanted) != len(spec_keys):
        raise ValueError(f"capture {request.capture_id}: a single stage writes every key")
    return [k for k in spec_keys if k in wanted]


class CaptureWriter(CaptureSink):
    """Durable `CaptureSink`: writer pool, in-flight budget, atomic publish, receipts.

    root: capture root (api.md §5). budget_bytes: row bytes held in memory at most.
    policy: "block" | "drop" | "reject". fs: syscall wrapper (tests inject latency).
    digest: the data files' digest recorded in manifests (publish.DIGESTS).
    """

    def __init__(
        self,
        root: str | Path,
        *,
        budget_bytes: int = DEFAULT_BUDGET_BYTES,
        policy: str = "block",
        workers: int | None = None,
        fs: FileSystem = DEFAULT_FS,
        sweep: bool = True,
        keep_receipts: int = 10_000,
        clock: Callable[[], float] = time.time,
        digest: str = DEFAULT_DIGEST,
        direct_io: bool = False,
    ) -> None:
        check_budget(budget_bytes, policy)
        self.root = Path(root).resolve()
        self.fs = fs
        self.digest = check_digest(digest)
        self.direct_io = direct_io  # data files through O_DIRECT where the filesystem allows
        new_hasher(digest)  # a missing library fails here, not in every publish
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
        self.spilled_bytes = 0

    # ----------------------------------------------------------------- sink API
    def open(self, request: CaptureRequest) -> None:
        """Register a captured request (cheap: no filesystem access)."""
        validate_capture_id(request.capture_id)
        keys = stage_keys(request)
        now = self.clock()
        dated = now if request.dir_time is None else request.dir_time
        rel = relative_dir(request.capture_id, request.spec.tag, dated)
        cap = _Capture(
            req=request,
            rel_dir=rel,
            path=self.root / rel,  # every component of rel was validated as a slug
            keys=frozenset(keys),
            key_order=keys,
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
            "budget_waits": b.waits,
            "budget_wait_s": round(b.wait_s, 6),
        }

    def engine_wait_s(self) -> dict[str, float]:
        """Seconds the callers (the engine's threads: this writer runs in its process) waited
        for the budget, read without a lock (capsteer_capture_engine_wait_seconds_total)."""
        return {"writer_budget": self.budget.wait_s}

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
        """A manifest (or stage part) without data files, so other processes learn the
        outcome too; a failed stage still lets the merge write the one manifest."""
        manifest = self._manifest_base(cap, status, message)
        written = False
        try:
            if self._published_by(cap) is None:
                ensure_dir(cap.path, self.fs)
                write_json_atomic(cap.path, self._outcome_name(cap), manifest, self.fs)
                written = True
        except OSError as exc:
            log.warning("capture %s: could not write %s manifest: %s", cap.req.capture_id, status, exc)
        if written and cap.staged:
            self._merge(cap)
        return self._receipt(cap, manifest)

    @staticmethod
    def _outcome_name(cap: _Capture) -> str:
        """Where this writer's outcome goes: the manifest, or its stage's part."""
        return cap.part if cap.staged else MANIFEST_FILE

    @staticmethod
    def _published_by(cap: _Capture) -> str | None:
        """Why this capture must not be published (again) here, or None."""
        if (cap.path / MANIFEST_FILE).exists():
            return f"{cap.rel_dir} already has a manifest"
        if cap.staged and (cap.path / cap.part).exists():
            return f"{cap.rel_dir} already has stage {cap.req.stage}'s part manifest"
        return None

    @staticmethod
    def _receipt(cap: _Capture, manifest: dict[str, Any]) -> Receipt:
        receipt = Receipt.from_manifest(manifest, cap.rel_dir)
        return replace(receipt, manifest=cap.part) if cap.staged else receipt

    def _merge(self, cap: _Capture) -> None:
        """Write manifest.json from every stage's part if all are there and this writer
        wins the merge lock; never raises (this stage's own outcome is already durable).

        A stage whose part never comes (its process died, or it could not even write
        an error part) leaves no manifest at all, as does a merger that dies or fails
        between taking the lock and writing the manifest: the server's wait for the
        capture times out with a pending receipt. That is accepted: a manifest must
        mean the whole capture, and nothing here can tell a dead stage from a slow one.
        """
        try:
            parts = read_parts(cap.path, cap.req.num_stages)
            if parts is None or not take_merge_lock(cap.path, writer_info()):
                return
            manifest = merge_parts(cap.req.spec.keys(), parts, self.clock(), writer_info())
            write_json_atomic(cap.path, MANIFEST_FILE, manifest, self.fs)
        except Exception as exc:
            log.error("capture %s: merging the stage parts failed: %r", cap.req.capture_id, exc)
            return
        if manifest["status"] != "ok":
            log.warning("capture %s: merged status %s: %s", cap.req.capture_id,
                        manifest["status"], manifest["error"])
            remove_stage_files(cap.path, parts, self.fs)

    def _manifest_base(self, cap: _Capture, status: str, error: str | None, **fields: Any) -> dict[str, Any]:
        """Manifest fields in reading order; `fields` fills in what only a publish knows."""
        req = cap.req
        dtype = fields.pop("dtype", None)
        staged = {"stage": req.stage, "stages": req.num_stages} if cap.staged else {}
        return outcome_manifest(
            req.capture_id, req.request_id, status, error, req.model, req.spec,
            [key_name(*k) for k in cap.key_order],
            timings={"opened_at": cap.opened_at, "closed_at": cap.closed_at}, dtype=dtype,
            model_shape={"model_dtype": DTYPE_NAME.get(req.model_dtype, str(req.model_dtype)),
                         "num_layers": req.num_layers, "hidden_size": req.hidden_size},
            fields={**staged, "prompt_tokens": len(req.prompt_token_ids), **fields})

    def _publish(self, cap: _Capture, end: CaptureEnd, started: float) -> Receipt:
        req, spec = cap.req, cap.req.spec
        fed = len(end.token_ids)
        plans_by_key: dict[Key, list[tuple[_Chunk, int, int]]] = {}
        positions: np.ndarray | None = None
        hidden = req.hidden_size
        for key in cap.key_order:
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
        if positions is None:  # a pipeline stage without keys: a part with no files
            positions = np.zeros(0, np.int64)
        token_ids = np.asarray(end.token_ids, dtype=np.int64)[positions]
        out = req.model_dtype if spec.dtype == "auto" else TORCH_DTYPE[spec.dtype]
        n = len(positions)

        files: list[AtomicFile] = []
        committed: list[Path] = []
        fsync_s = ensure_dir(cap.path, self.fs)
        clash = self._published_by(cap)
        if clash is not None:
            raise _AlreadyPublished(clash)
        t_write = time.perf_counter()
        tensors: dict[str, dict[str, Any]] = {}
        try:
            stage = cap.req.stage if cap.staged else None
            for fname, keys in files_for(spec.layout, cap.key_order, stage).items():
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
                f = AtomicFile(cap.path, fname, self.fs, self.digest, direct=self.direct_io)
                files.append(f)
                meta = {"format": "pt", "capsteer_capture_id": req.capture_id}
                f.write_pieces(stream_safetensors(plans, meta))
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
                files=[f.entry() for f in files],
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
            write_json_atomic(cap.path, self._outcome_name(cap), manifest, self.fs)
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
        if cap.staged:
            self._merge(cap)
        return self._receipt(cap, manifest)


# ------------------------------------------------------- pipeline-stage merging
def read_parts(path: Path, num_stages: int) -> list[dict[str, Any]] | None:
    """Every stage's part manifest in stage order, or None while any is missing."""
    try:
        present = set(os.listdir(path))
    except FileNotFoundError:
        return None
    names = [part_name(s) for s in range(num_stages)]
    if not all(n in present for n in names):
        return None
    return [json.loads((path / n).read_text()) for n in names]


def take_merge_lock(path: Path, owner: dict[str, Any]) -> bool:
    """True for exactly one caller per capture directory: the merge lock is created
    with O_EXCL and never removed, so a late stage cannot merge a second time."""
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        fd = os.open(path / MERGE_LOCK_FILE, flags, 0o644)
    except FileExistsError:
        return False
    try:
        os.write(fd, json.dumps(owner).encode() + b"\n")
    finally:
        os.close(fd)
    return True


def _preview(value: Any) -> str:
    if isinstance(value, list) and len(value) > 8:
        return json.dumps(value[:8])[:-1] + ",...]"
    return json.dumps(value)


def _disagreements(spec_keys: list[Key], parts: list[dict[str, Any]]) -> list[str]:
    """Why ok parts cannot form one capture: keys that are not split exactly once
    across the stages, or stages that kept different rows."""
    problems: list[str] = []
    owner: dict[str, int] = {}
    wanted = [key_name(*k) for k in spec_keys]
    for s, part in enumerate(parts):
        if part.get("stages") != len(parts) or part.get("stage") != s:
            said = f"{part.get('stage')} of {part.get('stages')}"
            problems.append(f"stage {s}: its part says stage {said}")
        for name in part.get("keys", []):
            if name in owner:
                problems.append(f"stage {s}: {name} was also written by stage {owner[name]}")
            elif name not in wanted:
                problems.append(f"stage {s}: {name} is not in the capture spec")
            else:
                owner[name] = s
    missing = [n for n in wanted if n not in owner]
    if missing:
        problems.append(f"no stage wrote {', '.join(missing)}")
    with_rows = [(s, p) for s, p in enumerate(parts) if p.get("keys")]
    for s, part in with_rows[1:]:
        r, ref = with_rows[0]
        for fld in ("positions", "token_ids", "dtype", "spec"):
            if part.get(fld) != ref.get(fld):
                mine, theirs = _preview(part.get(fld)), _preview(ref.get(fld))
                problems.append(f"stage {s}: {fld} {mine} differ from stage {r}'s {theirs}")
    return problems


def _merged_status(spec_keys: list[Key], parts: list[dict[str, Any]]) -> tuple[str, str | None]:
    """ok only if every stage is ok and they agree; a stage error wins over a drop."""
    said = [(p.get("status"), f"stage {s}: {p.get('error')}") for s, p in enumerate(parts)]
    errors = [msg for status, msg in said if status not in ("ok", "dropped")]
    drops = [msg for status, msg in said if status == "dropped"]
    if errors:
        return "error", "; ".join(errors + drops)
    if drops:
        return "dropped", "; ".join(drops)
    problems = _disagreements(spec_keys, parts)
    return ("error", "; ".join(problems)) if problems else ("ok", None)


def _merged_timings(parts: list[dict[str, Any]], merged_at: float) -> dict[str, float]:
    """Stages publish in parallel: the earliest start, the slowest stage's durations,
    and publish_s from the request end to the merge (each stage's own under stage_parts)."""
    per_stage = [p.get("timings", {}) for p in parts]
    out: dict[str, float] = {}
    for name, pick in (("opened_at", min), ("closed_at", min), ("started_at", min),
                       ("queued_s", max), ("write_s", max), ("fsync_s", max)):
        values = [t[name] for t in per_stage if name in t]
        if values:
            out[name] = pick(values)
    if "closed_at" in out:
        out["publish_s"] = round(merged_at - out["closed_at"], 6)
    out["published_at"] = merged_at
    return out


def merge_parts(
    spec_keys: list[Key], parts: list[dict[str, Any]], merged_at: float, writer: dict[str, Any]
) -> dict[str, Any]:
    """The one manifest of a pipeline-parallel capture, from its parts in stage order.

    Same fields as a single writer's manifest (files and tensors of every stage,
    `keys` the whole spec's), plus `stages` (S) and `stage_parts` (each stage's
    status, keys, files, timings and writer). Not ok: no files are listed, as for a
    single writer's error manifest.
    """
    status, error = _merged_status(spec_keys, parts)
    ref = next((p for p in parts if p.get("keys")), parts[0])
    merged = {k: v for k, v in ref.items() if k not in ("stage", "stages", "timings", "writer")}
    merged["status"], merged["error"] = status, error
    merged["keys"] = [key_name(*k) for k in spec_keys]
    if status == "ok":
        merged["files"] = [f for p in parts for f in p.get("files", [])]
        tensors: dict[str, Any] = {}
        for p in parts:
            tensors.update(p.get("tensors", {}))
        merged["tensors"] = {name: tensors[name] for name in merged["keys"]}
    else:
        merged["positions"], merged["files"] = [], []
        merged.pop("token_ids", None)
        merged.pop("tensors", None)
    merged["timings"] = _merged_timings(parts, merged_at)
    merged["writer"] = writer
    merged["stages"] = len(parts)
    merged["stage_parts"] = [
        {
            "stage": s,
            "status": p.get("status"),
            "error": p.get("error"),
            "keys": p.get("keys", []),
            "files": [f["name"] for f in p.get("files", [])],
            "timings": p.get("timings", {}),
            "writer": p.get("writer"),
        }
        for s, p in enumerate(parts)
    ]
    return merged


def remove_stage_files(path: Path, parts: list[dict[str, Any]], fs: FileSystem = DEFAULT_FS) -> None:
    """Remove the stages' data files once the merged manifest says the capture failed
    (it lists none of them); a crash before this leaves unlisted files, never a lie."""
    names = [f["name"] for p in parts for f in p.get("files", [])]
    for name in names:
        try:
            (path / name).unlink()
        except OSError:
            pass
    if names:
        try:
            fsync_dir(path, fs)
        except OSError:
            pass


@functools.cache
def _hostname() -> str:
    return socket.gethostname()


ENGINE_PID_ENV = "CAPSTEER_ENGINE_PID"  # set for a writer process: whose rows it publishes


def writer_info() -> dict[str, Any]:
    """Who wrote a manifest (or took a merge lock): host and pid, and for a writer process
    (capture/writer_process.py) the engine worker whose captures it publishes."""
    info: dict[str, Any] = {"host": _hostname(), "pid": os.getpid()}
    engine_pid = os.environ.get(ENGINE_PID_ENV)
    if engine_pid:
        info["engine_pid"] = int(engine_pid)
    return info


def outcome_manifest(capture_id: str, request_id: str | None, status: str, error: str | None,
                     model: str, spec: CaptureSpec, keys: list[str], *,
                     timings: dict[str, Any], dtype: str | None = None,
                     model_shape: dict[str, Any] | None = None,
                     fields: dict[str, Any] | None = None) -> dict[str, Any]:
    """A manifest's fields in reading order, for a writer's outcome and for the server's
    outcome of a capture no writer opened; `model_shape` and `fields` are what only a
    writer knows."""
    manifest: dict[str, Any] = {
        "format": "capsteer.capture",
        "format_version": FORMAT_VERSION,
        "capture_id": capture_id,
        "request_id": request_id,
        "status": status,
        "error": error,
        "model": model,
        "hook_semantics_version": HOOK_SEMANTICS_VERSION,
        "layout": spec.layout,
        "dtype": dtype,
        **(model_shape or {}),
        "spec": spec.to_dict(),
        "keys": keys,
        **(fields or {}),
    }
    manifest.setdefault("positions", [])
    manifest.setdefault("files", [])
    manifest["timings"] = timings
    manifest["writer"] = writer_info()
    return manifest


def publish_unreached(root: str | Path, capture_id: str, *, spec: CaptureSpec, model: str,
                      reason: str, fs: FileSystem = DEFAULT_FS,
                      dir_time: float | None = None) -> Receipt:
    """The error manifest of a capture whose request was aborted before any engine saw it.

    No writer ever opened it, so none will publish: without this manifest its receipt
    would stay pending. The API server writes it, like a writer's error outcome
    (same fields, no data files). An outcome already on disk wins and is returned.
    `dir_time` dates its directory as the request's payload would have (default: now)."""
    root = Path(root)
    found = find_receipt(root, capture_id)
    if found is not None:
        return found
    now = time.time()
    rel_dir = relative_dir(capture_id, spec.tag, now if dir_time is None else dir_time)
    manifest = outcome_manifest(capture_id, None, "error", reason, model, spec, [],
                                timings={"opened_at": None, "closed_at": now})
    path = root / rel_dir
    ensure_dir(path, fs)
    write_json_atomic(path, MANIFEST_FILE, manifest, fs)
    return Receipt.from_manifest(manifest, rel_dir)
