"""Readouts in the worker: the rows a request reads at a hook go through its readers (probe
scores, SAE features) instead of to storage, and only the scores leave for the server.

A readout rides the capture path: the plan routes its rows like a capture's
(`RequestHooks.readout_points`), and `ReadoutSink` is the sink they are delivered to. It
computes on the rows' device (the model's GPU in host mode; after the harvester's copy in
device mode) and appends each step's records, all requests' in one write, to the worker's
results stream (steering/readers/results.py), which the server reads while it streams the
response.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch

from capsteer.capture import metrics
from capsteer.capture.sink import CaptureEnd, CaptureRequest, CaptureSink
from capsteer.capture.spec import RANGE_KINDS, range_bounds
from capsteer.steering.readers import results
from capsteer.steering.readers.kinds import (
    LinearProbe,
    Reader,
    probe_scores,
    sae_encode,
    sae_top_k,
)
from capsteer.steering.readers.readout import ReadoutItem, reader_of
from capsteer.steering.readers.registry import ReaderRegistry

logger = logging.getLogger("vllm.capsteer")
_READERS_KEPT = 32  # loaded readers kept on the device (an SAE can be hundreds of MB)


@dataclass
class _Readout:
    """One request's readout: its id, its items by the (hook, layer) they read."""

    readout_id: str
    items: dict[tuple[str, int], list[tuple[ReadoutItem, Reader]]]
    prompt_len: int
    sent_upto: dict[int, int] = field(default_factory=dict)  # item -> past its last position sent
    # A route's keys -> its (item, reader, record head) reads, built on first use: the
    # device path looks them up once per request and step, not key by key.
    reads: dict[tuple[tuple[str, int], ...], tuple[tuple[ReadoutItem, Reader, bytes | None],
                                                   ...]] = field(default_factory=dict)

    def reads_of(self, keys: tuple[tuple[str, int], ...]
                 ) -> tuple[tuple[ReadoutItem, Reader, bytes | None], ...]:
        found = self.reads.get(keys)
        if found is None:
            found = self.reads[keys] = tuple(
                (item, reader, _record_head(self.readout_id, item.index,
                                            not isinstance(reader, LinearProbe)))
                for key in keys for item, reader in self.items.get(key, ()))
        return found


class ReadoutSink(CaptureSink):
    """Computes readers on delivered rows and appends the results (see module docstring)."""

    copies_rows = True  # rows are read before `write` returns

    def __init__(self, root: str | None, readers_dir: str | None, hidden_size: int,
                 device: torch.device | str,
                 hook_widths: Mapping[str, int] | None = None) -> None:
        """`hook_widths`: the model's hooks not hidden_size wide, whose readers the
        registry then serves too (the server checked each against its hook)."""
        self.root = Path(root) if root else None
        self.stream = results.ResultsStream(self.root) if self.root is not None else None
        self._pending: list[bytes] = []  # this step's records, written at its end
        self.registry = ReaderRegistry(readers_dir, hidden_size=hidden_size,
                                       hook_widths=hook_widths) if readers_dir else None
        self.device = torch.device(device)
        self.live: dict[str, _Readout] = {}
        self._readers: OrderedDict[tuple, Reader] = OrderedDict()

    # ---- the worker's calls ----
    def start(self, readout_id: str, items: Sequence[ReadoutItem], prompt_len: int) -> None:
        """Load the items' readers (raises what a client must hear)."""
        if self.stream is None:
            raise RuntimeError("this engine has no readout directory (readouts need "
                               "`capsteer serve`)")
        by_point: dict[tuple[str, int], list[tuple[ReadoutItem, Reader]]] = {}
        for item in items:
            by_point.setdefault((item.hook, item.layer), []).append((item, self._reader(item)))
        self.live[readout_id] = _Readout(readout_id, by_point, prompt_len)

    def fail(self, readout_id: str, reason: str, items: int = 1) -> None:
        """Tell the server this readout will get no results (it answers the reason)."""
        if self.stream is None:
            return
        try:
            self.stream.append(b"".join(results.error_record(readout_id, i, reason)
                                        for i in range(items)))
        except OSError:
            logger.exception("capsteer: readout %s: could not report its failure", readout_id)

    def finish(self, readout_id: str) -> None:
        if self.live.pop(readout_id, None) is not None:
            self.end_step()

    def _reader(self, item: ReadoutItem) -> Reader:
        if item.probe is not None:
            return item.probe.to(self.device)
        key = (item.reader.name, item.reader.sha256)
        found = self._readers.get(key)
        if found is None:
            found = reader_of(item, self.registry).to(self.device)
            self._readers[key] = found
            while len(self._readers) > _READERS_KEPT:
                self._readers.popitem(last=False)
        else:
            self._readers.move_to_end(key)
        return found

    # ---- the sink contract ----
    def open(self, request: CaptureRequest) -> None:
        raise TypeError("readouts start with ReadoutSink.start, not open")

    def write(self, capture_id: str, hook: str, layer: int, positions: np.ndarray,
              rows: torch.Tensor) -> None:
        for state, item, pos, out in self._compute(capture_id, hook, layer, positions, rows):
            self._pending.append(_encode(state.readout_id, item, pos,
                                         [t.cpu().numpy() for t in out]))

    def launch(self, routes: Sequence[tuple[Any, slice]], staging: torch.Tensor,
               site_widths: Sequence[int] | None = None) -> Callable[[], None]:
        """Device mode: run the readers on the step's readout rows where they sit (the
        staging buffer, on the GPU, right after the forward), one computation per point
        and reader for every request reading it, copy only the results to the host, and
        return what writes them once the copy landed (for the harvester's thread).
        `site_widths`: each site's width (staging is as wide as the widest hook)."""
        by_point: dict[tuple[int, int], list[tuple[Any, slice]]] = {}
        for route, span in routes:
            group = by_point.get(route.point)
            if group is None:
                by_point[route.point] = [(route, span)]
            else:
                group.append((route, span))
        live = self.live
        jobs = []
        for group in by_point.values():
            uses: dict[int, list] = {}  # id(reader) -> [reader, top_k, threshold, uses]
            for route, span in group:
                state = live.get(route.capture_id)
                if state is None:
                    continue
                for item, reader, head in state.reads_of(route.keys):
                    use = uses.get(id(reader))
                    if use is None:
                        use = uses[id(reader)] = [reader, 1, math.inf, []]
                    if item.top_k is not None:
                        use[1] = max(use[1], item.top_k)
                        use[2] = min(use[2], float(item.threshold or 0.0))
                    use[3].append((state, item, head, route, span))
            if not uses:
                continue
            first = min(span.start for _, span in group)
            cols = staging.shape[1] if site_widths is None else site_widths[group[0][0].point[1]]
            block = staging[first: max(span.stop for _, span in group), :cols].to(torch.float32)
            for reader, top_k, threshold, items in uses.values():
                out = _run(reader, block, top_k, threshold)
                jobs.append((first, [t.to("cpu", non_blocking=True) for t in out], items))
        # A blocking event: the harvester sleeps until the copies land rather than spin
        # a core for the whole step (as the harvester's own slots do).
        landed = torch.cuda.Event(blocking=True) if self.device.type == "cuda" else None
        if landed is not None:
            landed.record()

        def write_results() -> None:
            if landed is not None:
                landed.synchronize()
            rows_read = 0
            for first, out, items in jobs:
                rows_read += self._write_job(first, [t.numpy() for t in out], items)
            metrics.READOUT_ROWS.inc(rows_read)
            self.end_step()
        return write_results

    def _write_job(self, first: int, host: list[np.ndarray], items: list) -> int:
        """One pass's records (see `launch`), in `items`' order. A request reading one row
        (a decode step) takes it from one gather of all such rows, turned into Python lists
        at once; a run of rows (a prefill chunk) is one slice of its own, as its lists are
        freed right after its record (a whole prefill block's lists alive at once would
        wake Python's cycle collector). Returns the rows read."""
        sae = len(host) == 2
        mid = _SAE_MID if sae else _PROBE_MID
        records: list = []  # bytes, or [head, positions, cut, index into its gathered rows]
        singles: dict[tuple[int, float], list[int]] = {}  # (top_k, threshold) -> rows
        rows_read = 0
        for state, item, head, route, span in items:
            positions = route.positions
            kind = item.positions.kind
            if len(positions) == 1 and kind in RANGE_KINDS:  # a decode step: one position
                p = int(positions[0])
                if p < state.sent_upto.get(item.index, 0) or (
                        kind == "generated" and p < state.prompt_len) or (
                        kind == "prompt" and p >= state.prompt_len):
                    continue
                state.sent_upto[item.index] = p + 1
                at: range | np.ndarray = range(0, 1)
                got_positions = [p]
            else:
                at = self._new_positions(state, item, positions)
                if not len(at):
                    continue
                got_positions = list(range(int(positions[0]) + at.start,
                                           int(positions[0]) + at.stop)) \
                    if isinstance(at, range) else positions[at].tolist()
            rows_read += len(at)
            base = span.start - first
            if head is not None and len(at) == 1:
                cut = (int(item.top_k or 1), float(item.threshold or 0.0)) if sae else (0, 0.0)
                rows = singles.setdefault(cut, [])
                records.append([head, got_positions, cut, len(rows)])
                rows.append(base + at[0])
                continue
            got = [h[base + at.start: base + at.stop] if isinstance(at, range)
                   else h[base + at] for h in host]
            if head is None:  # a record head the format did not allow (see _record_head)
                records.append(_encode(state.readout_id, item, got_positions, got))
                continue
            if sae:
                pairs, bounds = _features(got, int(item.top_k or 1), float(item.threshold or 0.0))
                rows_out = [pairs[bounds[j]: bounds[j + 1]] for j in range(len(at))]
            else:
                rows_out = got[0].tolist()
            records.append(b"".join((head, _ENCODE(got_positions), mid, _ENCODE(rows_out),
                                     _END)))
        values: dict[tuple[int, float], list] = {}
        for cut, rows in singles.items():
            if sae:
                pairs, bounds = _features([h[rows] for h in host], *cut)
                values[cut] = [pairs[bounds[j]: bounds[j + 1]] for j in range(len(rows))]
            else:
                values[cut] = host[0][rows].tolist()
        pending = self._pending
        for record in records:
            if isinstance(record, bytes):
                pending.append(record)
                continue
            head, got_positions, cut, j = record
            pending += (head, _ENCODE(got_positions), mid, _ENCODE([values[cut][j]]), _END)
        return rows_read

    @staticmethod
    def _new_positions(state: _Readout, item: ReadoutItem,
                       positions: np.ndarray) -> range | np.ndarray:
        """Indices into `positions` the item reads and has not sent before, now marked sent
        (a range for a run of consecutive positions, every step's for the range kinds).
        A request's positions are fed in increasing order, and a recompute after preemption
        feeds them again from an earlier one: only positions past the last sent are new."""
        sent = state.sent_upto.get(item.index, 0)
        kind, n = item.positions.kind, len(positions)
        first = int(positions[0]) if n else 0
        if kind in RANGE_KINDS and n and int(positions[-1]) - first == n - 1:
            lo, hi = range_bounds(kind, state.prompt_len, sent, first + n)
            at: range | np.ndarray = range(min(max(lo - first, 0), n), min(max(hi - first, 0), n))
            if len(at):
                state.sent_upto[item.index] = first + at.stop
            return at
        keep = item.positions.candidate(positions, state.prompt_len)
        keep &= positions >= sent
        at = np.flatnonzero(keep)
        if len(at):
            state.sent_upto[item.index] = int(positions[at[-1]]) + 1
        return at

    def _compute(self, capture_id: str, hook: str, layer: int, positions: np.ndarray,
                 rows: torch.Tensor):
        """Host mode: (state, item, positions, result tensors) per item read at (hook,
        layer), for its positions not sent before."""
        state = self.live.get(capture_id)
        if state is None:
            return
        for item, reader in state.items.get((hook, layer), ()):
            at = np.asarray(self._new_positions(state, item, positions), dtype=np.int64)
            if not len(at):
                continue
            metrics.READOUT_ROWS.inc(len(at))
            x = rows if len(at) == len(positions) else rows[torch.from_numpy(at).to(rows.device)]
            out = _run(reader, x.to(self.device, torch.float32), item.top_k or 1,
                       float(item.threshold or 0.0))
            yield state, item, positions[at].tolist(), out

    def end_step(self) -> None:
        """The step's records in one write."""
        if self._pending and self.stream is not None:
            data, self._pending = b"".join(self._pending), []
            self.stream.append(data)

    def close(self, end: CaptureEnd) -> None:
        self.finish(end.capture_id)

    def abort(self, capture_id: str, reason: str) -> None:
        self.finish(capture_id)


_ROWS_PER_PASS = 4096  # an SAE's [rows, d_sae] pre-activations stay ~256 MiB at 16k


def _run(reader: Reader, x: torch.Tensor, top_k: int, threshold: float) -> list[torch.Tensor]:
    """Results for rows `x` ([n, d], float32, on the reader's device): a probe's scores
    [n, k], or an SAE's `top_k` largest features above `threshold` as ids and values
    [n, top_k] (largest first; id -1 where none is left)."""
    if isinstance(reader, LinearProbe):
        return [probe_scores(x, reader.weight, reader.bias, reader.activation)]
    parts = [sae_top_k(sae_encode(x[i: i + _ROWS_PER_PASS], reader), top_k, threshold)
             for i in range(0, x.shape[0], _ROWS_PER_PASS)]
    if len(parts) == 1:
        return list(parts[0])
    return [torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])]


_ENCODE = msgspec.json.Encoder().encode
_PROBE_MID, _SAE_MID, _END = b',"s":', b',"f":', b"}\n"


def _record_head(readout_id: str, index: int, sae: bool) -> bytes | None:
    """The bytes a request's records of one item start with, up to its positions: cut
    from the record results.py writes (the device path writes the rest piece by piece,
    the same bytes); None if that record does not end as expected."""
    record = (results.sae_record if sae else results.probe_record)(readout_id, index, [], [])
    tail = b'"p":[]' + (_SAE_MID if sae else _PROBE_MID) + b"[]" + _END
    return record[:-len(tail)] + b'"p":' if record.endswith(tail) else None


def _features(host: list[np.ndarray], k: int, threshold: float) -> tuple[list, list[int]]:
    """An SAE pass's (id, value) pairs an item with `k` and `threshold` keeps, every row's
    in one list, and where each row's start (row r: pairs[bounds[r]: bounds[r + 1]]):
    `_encode`'s rule, applied to all rows at once."""
    ids, values = host[0][:, :k], host[1][:, :k]
    # Compared as float64, as _encode compares each value (a float32 array against a
    # Python float would compare in float32).
    keep = (ids >= 0) & (values.astype(np.float64) > threshold)
    bounds = np.zeros(len(ids) + 1, np.int64)
    np.cumsum(keep.sum(axis=1), out=bounds[1:])
    return list(zip(ids[keep].tolist(), values[keep].tolist(), strict=True)), bounds.tolist()


def _encode(readout_id: str, item: ReadoutItem, positions: list[int],
            out: list[np.ndarray]) -> bytes:
    """One item's record; SAE results computed for a larger top_k or lower threshold
    (items sharing one pass) are cut to the item's own."""
    if len(out) == 1:
        return results.probe_record(readout_id, item.index, positions, out[0].tolist())
    k, threshold = int(item.top_k or 1), float(item.threshold or 0.0)
    features = [[(f, v) for f, v in zip(row_ids, row_values, strict=True)
                 if f >= 0 and v > threshold]
                for row_ids, row_values in zip(out[0][:, :k].tolist(), out[1][:, :k].tolist(),
                                               strict=True)]
    return results.sae_record(readout_id, item.index, positions, features)
