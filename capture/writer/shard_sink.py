"""`ShardedSink`: the sink that hands each finished request of an extraction job to a
`ShardedWriter` (dedicated capture servers and in-process extraction)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import torch

from capsteer.capture.sharded import Key
from capsteer.capture.sink import CaptureEnd, CaptureRequest, CaptureSink
from capsteer.capture.writer.sharded import ShardedWriter

# More row runs than this per request and key are gathered into one tensor at close
# (bounds per-piece Python work on the flush threads, which share the GIL).
_MAX_PIECES = 16


def _row_pieces(chunks: list[torch.Tensor], idx: np.ndarray) -> list[torch.Tensor]:
    """Rows `idx` of the concatenated chunks as few pieces: views of the delivered
    tensors where a run covers at least half of its chunk (so a view never pins much
    more memory than it holds), small copies otherwise."""
    if len(idx) == 0:
        return []
    starts = np.cumsum([0, *(len(c) for c in chunks)])
    which = np.searchsorted(starts, idx, side="right") - 1
    cuts = np.flatnonzero((np.diff(idx) != 1) | (np.diff(which) != 0)) + 1
    if len(cuts) >= _MAX_PIECES:  # scattered rows (e.g. one per decode step): one gather
        whole = torch.cat(chunks) if len(chunks) > 1 else chunks[0]
        return [whole.index_select(0, torch.from_numpy(idx))]
    pieces = []
    for lo, hi in zip([0, *cuts.tolist()], [*cuts.tolist(), len(idx)], strict=True):
        c = int(which[lo])
        a = int(idx[lo] - starts[c])
        rows = chunks[c]
        piece = rows[a: a + hi - lo]
        if 2 * len(piece) < len(rows) or not piece.is_contiguous():
            piece = piece.clone(memory_format=torch.contiguous_format)
        pieces.append(piece)
    return pieces


class _RequestRows:
    """One open request's rows as delivered: per key, (positions, rows) chunks.

    Nothing is done per row on the caller's thread; `assemble` resolves repeated
    positions (preemption then recompute: the last write wins) with numpy and hands
    the writer views of the delivered tensors."""

    def __init__(self, request: CaptureRequest) -> None:
        self.request = request
        self.chunks: dict[Key, list[tuple[np.ndarray, torch.Tensor]]] = {}

    def add(self, key: Key, positions: np.ndarray, rows: torch.Tensor) -> None:
        pos = np.array(positions, dtype=np.int64).reshape(-1)
        if rows.dim() != 2 or rows.shape[0] < len(pos):
            raise ValueError(f"{tuple(rows.shape)} rows for {len(pos)} positions")
        self.chunks.setdefault(key, []).append((pos, rows[: len(pos)]))

    def assemble(
        self, keys: list[Key], select: Callable[[np.ndarray], np.ndarray]
    ) -> tuple[np.ndarray, dict[Key, list[torch.Tensor]]]:
        """Per key, the rows `select(sorted unique positions)` keeps, in position order.
        Every key must keep the same positions (they were captured from the same rows).

        Keys usually arrive with equal positions, so the position work is done once per
        distinct positions (memo on their bytes); when every delivered row is kept in
        order, the pieces are the delivered tensors themselves. Few numpy/torch calls
        on purpose: each one may hand the GIL to a flush thread."""
        kept: np.ndarray | None = None
        out: dict[Key, list[torch.Tensor]] = {}
        memo: dict[bytes, tuple[np.ndarray, np.ndarray | None]] = {}
        for key in keys:
            chunks = self.chunks.get(key, [])
            pos = chunks[0][0] if len(chunks) == 1 else \
                np.concatenate([p for p, _ in chunks]) if chunks else np.zeros(0, np.int64)
            sig = pos.tobytes()
            if sig in memo:
                k, idx = memo[sig]
            else:
                if len(pos) < 2 or bool((pos[1:] > pos[:-1]).all()):
                    seen, last = pos, None
                else:
                    seen, first = np.unique(pos[::-1], return_index=True)
                    last = len(pos) - 1 - first  # the last write of each position
                k = np.asarray(select(seen), dtype=np.int64)
                if last is None and len(k) == len(pos):
                    idx = None  # every delivered row, in delivery order
                else:
                    j = np.searchsorted(seen, k)
                    if len(k) and (j[-1] >= len(seen) or not np.array_equal(seen[j], k)):
                        raise ValueError(f"selected positions that were not captured ({key})")
                    idx = j if last is None else last[j]
                memo[sig] = (k, idx)
            if kept is not None and k is not kept and not np.array_equal(k, kept):
                raise ValueError(f"keys captured different positions ({key})")
            kept = k
            rows = [r for _, r in chunks]
            out[key] = _row_pieces(rows, idx) if idx is not None else \
                [r if r.is_contiguous() else r.contiguous() for r in rows]
        return (kept if kept is not None else np.zeros(0, np.int64)), out


class ShardedSink(CaptureSink):
    """A `CaptureSink` that appends each finished request to a ShardedWriter.

    For dedicated capture servers and in-process extraction: each request's row
    tensors are kept as delivered (positions de-duplicated at close, last write
    wins); close resolves positions and hands the writer views, so the caller's
    thread does no per-row work and no copy in the usual case.
    """

    def __init__(self, writer: ShardedWriter) -> None:
        self.writer = writer
        self._lock = threading.Lock()
        self._open: dict[str, _RequestRows] = {}

    def open(self, request: CaptureRequest) -> None:
        with self._lock:
            self._open.setdefault(request.capture_id, _RequestRows(request))

    def write(
        self, capture_id: str, hook: str, layer: int, positions: np.ndarray, rows: torch.Tensor
    ) -> None:
        with self._lock:
            entry = self._open.get(capture_id)
            if entry is not None:
                entry.add((hook, int(layer)), positions, rows)

    def close(self, end: CaptureEnd) -> None:
        with self._lock:
            entry = self._open.pop(end.capture_id, None)
        if entry is None:
            return
        req = entry.request
        prompt_len = len(req.prompt_token_ids)
        fed = len(end.token_ids)
        try:
            kept, pieces = entry.assemble(
                self.writer.keys, lambda seen: req.spec.positions.finalize(seen, prompt_len, fed))
        except ValueError as exc:
            raise ValueError(f"{end.capture_id}: {exc}") from None
        token_ids = np.asarray(end.token_ids, np.int64)[kept]
        self.writer._add(req.request_id or end.capture_id, kept, token_ids, pieces, prompt_len)

    def abort(self, capture_id: str, reason: str) -> None:
        with self._lock:
            self._open.pop(capture_id, None)


