"""Publishing one capture: its data files streamed, fsynced and renamed, then its
manifest (or pipeline stage part) last, and the receipt that follows."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

import capsteer.capture.metrics as metrics
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
from capsteer.capture.manifest import outcome_manifest, writer_info
from capsteer.capture.publish import (
    AtomicFile,
    FileSystem,
    ensure_dir,
    fsync_dir,
    write_json_atomic,
)
from capsteer.capture.receipts import Receipt, ReceiptBoard
from capsteer.capture.sink import CaptureEnd
from capsteer.capture.writer.budget import Budget
from capsteer.capture.writer.stages import (
    merge_parts,
    read_parts,
    remove_stage_files,
    take_merge_lock,
)
from capsteer.capture.writer.state import (
    AlreadyPublished,
    CaptureDataError,
    Chunk,
    Key,
    OpenCapture,
    plan_key,
)
from capsteer.capture.writer.unwritten import UnwrittenOutcomes

log = logging.getLogger(__name__)

_PIECE_BYTES = 4 << 20  # bound on one assembled/converted piece (memory outside the budget)


class Publishing:
    """The publishing half of `CaptureWriter` (its writer threads run these)."""

    budget: Budget
    receipts: ReceiptBoard
    fs: FileSystem
    digest: str
    direct_io: bool
    clock: Callable[[], float]
    unwritten: UnwrittenOutcomes

    def _release_sealed(self, cap: OpenCapture, n: int) -> None:
        n = min(n, cap.sealed_left)
        cap.sealed_left -= n
        self.budget.release_sealed(n)

    def _pieces(
        self, cap: OpenCapture, key: Key, runs: list[tuple[Chunk, int, int]], out: torch.dtype
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

    def _finish(self, cap: OpenCapture, end: CaptureEnd) -> None:
        started = self.clock()
        self.unwritten.retry(self.fs)
        try:
            if cap.dropped:
                receipt = self._publish_status(cap, "dropped", f"dropped: {cap.dropped}")
            elif cap.failed:
                receipt = self._publish_status(cap, "error", cap.failed)
            else:
                receipt = self._publish(cap, end, started)
        except AlreadyPublished as exc:
            receipt = Receipt(cap.req.capture_id, "error", cap.rel_dir, error=str(exc))
        except Exception as exc:  # a receipt must always come
            log.warning("capture %s: publish failed: %r", cap.req.capture_id, exc)
            try:
                receipt = self._publish_status(cap, "error", f"{type(exc).__name__}: {exc}")
            except Exception:
                receipt = Receipt(cap.req.capture_id, "error", cap.rel_dir, error=repr(exc))
                self.unwritten.add(receipt)
        finally:
            self._release_sealed(cap, cap.sealed_left)
            cap.chunks.clear()
            cap.close_spill()
        metrics.REQUESTS.labels(status=receipt.status).inc()
        self.receipts.resolve(receipt)

    def _publish_status(self, cap: OpenCapture, status: str, message: str) -> Receipt:
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
            receipt = replace(self._receipt(cap, manifest), manifest=None,
                              error=f"{message} (its {status} manifest could not be written "
                                    f"either: {exc})")
            self.unwritten.add(receipt, cap.path, self._outcome_name(cap), manifest)
            return receipt
        if written and cap.staged:
            self._merge(cap)
        return self._receipt(cap, manifest)

    @staticmethod
    def _outcome_name(cap: OpenCapture) -> str:
        """Where this writer's outcome goes: the manifest, or its stage's part."""
        return cap.part if cap.staged else MANIFEST_FILE

    @staticmethod
    def _published_by(cap: OpenCapture) -> str | None:
        """Why this capture must not be published (again) here, or None."""
        if (cap.path / MANIFEST_FILE).exists():
            return f"{cap.rel_dir} already has a manifest"
        if cap.staged and (cap.path / cap.part).exists():
            return f"{cap.rel_dir} already has stage {cap.req.stage}'s part manifest"
        return None

    @staticmethod
    def _receipt(cap: OpenCapture, manifest: dict[str, Any]) -> Receipt:
        receipt = Receipt.from_manifest(manifest, cap.rel_dir)
        return replace(receipt, manifest=cap.part) if cap.staged else receipt

    def _merge(self, cap: OpenCapture) -> None:
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

    def _manifest_base(self, cap: OpenCapture, status: str, error: str | None, **fields: Any) -> dict[str, Any]:
        """Manifest fields in reading order; `fields` fills in what only a publish knows."""
        req = cap.req
        dtype = fields.pop("dtype", None)
        staged = {"stage": req.stage, "stages": req.num_stages} if cap.staged else {}
        return outcome_manifest(
            req.capture_id, req.request_id, status, error, req.model, req.spec,
            [key_name(*k) for k in cap.key_order],
            timings={"opened_at": cap.opened_at, "closed_at": cap.closed_at}, dtype=dtype,
            model_shape={"model_dtype": DTYPE_NAME.get(req.model_dtype, str(req.model_dtype)),
                         "num_layers": req.num_layers, "hidden_size": req.hidden_size,
                         **({"hook_widths": dict(req.hook_widths)} if req.hook_widths else {})},
            fields={**staged, "prompt_tokens": len(req.prompt_token_ids), **fields})

    def _publish(self, cap: OpenCapture, end: CaptureEnd, started: float) -> Receipt:
        req, spec = cap.req, cap.req.spec
        fed = len(end.token_ids)
        plans_by_key: dict[Key, list[tuple[Chunk, int, int]]] = {}
        positions: np.ndarray | None = None
        for key in cap.key_order:
            runs, kept = plan_key(cap.chunks.get(key, []), spec.positions, cap.prompt_len, fed)
            if positions is None:
                positions = kept
            elif not np.array_equal(positions, kept):
                raise CaptureDataError(
                    f"{key_name(*key)} has positions {kept.tolist()[:8]}..., "
                    f"other keys {positions.tolist()[:8]}..."
                )
            for chunk, _, _ in runs:
                if chunk.hidden != req.width(key[0]):
                    raise CaptureDataError(f"{key_name(*key)}: rows of width {chunk.hidden}, "
                                           f"the hook's {req.width(key[0])}")
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
            raise AlreadyPublished(clash)
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
                            (n, req.width(key[0])),
                            lambda key=key: self._pieces(cap, key, plans_by_key[key], out),
                        )
                    )
                    tensors[name] = {"file": fname, "shape": [n, req.width(key[0])],
                                     "dtype": DTYPE_NAME[out]}
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
