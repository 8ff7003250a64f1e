"""A request's readout results assembled from the workers' records: which positions each
item reads, and the entry it gets in `readout_results` (api.md §7). The server's responder
(server/readouts.py) and the in-process engine (`ReadoutCollector`) both build entries
here, so a user sees one format whichever way the scores came.

A step's forward reads positions up to the last token it was fed: once the output is
known, positions below prompt + len(output) - 1 have scores, and the last sampled token,
never fed, has none (`fed_limit`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from capsteer.capture.spec import RANGE_KINDS, range_bounds
from capsteer.steering.readers.readout import ReadoutItem
from capsteer.steering.readers.results import Record, ResultsReader

_DECODE_RAW = msgspec.json.decode  # a position's scores as Python lists (the engine's)


def fed_limit(prompt_len: int, output_len: int) -> int:
    """Positions below this have been fed (see module docstring)."""
    return prompt_len + max(output_len - 1, 0)


def expected_positions(item: ReadoutItem, prompt_len: int, start: int,
                       limit: int) -> Sequence[int]:
    """The positions in [start, limit) the item reads, in order (a range for the range
    kinds)."""
    kind = item.positions.kind
    if kind in RANGE_KINDS:
        return range(*range_bounds(kind, prompt_len, start, limit))
    span = np.arange(start, limit, dtype=np.int64)
    return span[item.positions.candidate(span, prompt_len)].tolist()


def entry_head(item: ReadoutItem) -> dict[str, Any]:
    """The fields that open an item's `readout_results` entry."""
    return {"item": item.index, "reader": item.reader.name, "hook": item.hook,
            "layer": item.layer}


class ReadoutValues:
    """One readout's values as its records arrive: item -> position -> the worker's JSON
    of its scores or [feature, value] pairs; item -> why it failed."""

    def __init__(self, items: Sequence[ReadoutItem]) -> None:
        self.items = list(items)
        self.values: dict[int, dict[int, msgspec.Raw]] = {item.index: {} for item in items}
        self.errors: dict[int, str] = {}

    def add(self, records: Sequence[Record]) -> None:
        for record in records:
            have = self.values.get(record.i)
            if have is None:
                continue
            if record.error is not None:
                self.errors.setdefault(record.i, record.error)
                continue
            positions, values = record.p, record.values
            if len(positions) == 1 and len(values) == 1:  # a decode step's record
                have.setdefault(positions[0], values[0])
                continue
            for p, value in zip(positions, values, strict=True):
                have.setdefault(p, value)

    def complete_upto(self, item: ReadoutItem, prompt_len: int, start: int, limit: int) -> int:
        """The first position in [start, limit) the item reads and has no value for yet,
        else `limit` (every one arrived, or the item failed). Callers keep it as the next
        `start`, so a stream's positions are each looked at once."""
        if item.index in self.errors:
            return limit
        have = self.values[item.index]
        for p in expected_positions(item, prompt_len, start, limit):
            if p not in have:
                return p
        return limit

    def entry(self, item: ReadoutItem, prompt: Sequence[int], output: Sequence[int],
              start: int, limit: int,
              decode: Callable[[msgspec.Raw], Any] | None = None) -> dict[str, Any]:
        """The item's `readout_results` entry for positions [start, limit): the values as
        the worker wrote them, or `decode`d."""
        entry = entry_head(item)
        if item.index in self.errors:
            entry["error"] = self.errors[item.index]
            return entry
        have = self.values[item.index]
        positions = [p for p in expected_positions(item, len(prompt), start, limit)
                     if p in have]
        entry["positions"] = positions
        entry["token_ids"] = [prompt[p] if p < len(prompt) else output[p - len(prompt)]
                              for p in positions]
        key = "scores" if item.reader.kind == "probe" else "features"
        entry[key] = [have[p] if decode is None else decode(have[p]) for p in positions]
        return entry


@dataclass
class Finished:
    """A request whose generation returned: its readout and the tokens it fed."""

    readout_id: str
    items: list[ReadoutItem]
    prompt: list[int]
    output: list[int]


class ReadoutCollector:
    """The in-process engine's reader of its workers' result streams (synchronous): after
    `LLM.generate` returns, the records of a batch's last steps may still be on their way
    (the harvester's thread writes them), so `collect` reads until every request has every
    position it reads below its fed limit, or a worker said it failed."""

    def __init__(self, root: str | Path, *, poll_s: float = 0.001) -> None:
        self.reader = ResultsReader(root)
        self.poll_s = poll_s
        self._values: dict[str, ReadoutValues] = {}

    def open(self, readout_id: str, items: Sequence[ReadoutItem]) -> None:
        """Before the request is sent: its records are kept from then on."""
        self.reader.open(readout_id)
        self._values[readout_id] = ReadoutValues(items)

    def discard(self, readout_ids: Sequence[str]) -> None:
        for readout_id in readout_ids:
            self.reader.close(readout_id)
            self._values.pop(readout_id, None)

    def collect(self, done: Sequence[Finished], timeout: float) -> list[list[dict[str, Any]]]:
        """Each request's `readout_results` (scores as Python lists), once complete;
        TimeoutError naming what is missing after `timeout` seconds (never a partial
        result). The requests' records are dropped either way."""
        try:
            return self._collect(done, timeout)
        finally:
            self.discard([d.readout_id for d in done])

    def _collect(self, done: Sequence[Finished], timeout: float) -> list[list[dict[str, Any]]]:
        deadline = time.monotonic() + timeout
        # (request, item) -> all positions below this have arrived: each checked once
        complete = {(n, item.index): 0 for n, d in enumerate(done) for item in d.items}
        while True:
            self.reader.pump()
            lacking: list[tuple[str, int, int]] = []  # readout id, item, first missing
            for n, d in enumerate(done):
                values = self._values[d.readout_id]
                values.add(self.reader.inboxes[d.readout_id].take())
                limit = fed_limit(len(d.prompt), len(d.output))
                for item in d.items:
                    start = complete[(n, item.index)]
                    if start >= limit:
                        continue
                    upto = values.complete_upto(item, len(d.prompt), start, limit)
                    complete[(n, item.index)] = upto
                    if upto < limit:
                        lacking.append((d.readout_id, item.index, upto))
            if not lacking:
                break
            if time.monotonic() >= deadline:
                shown = ", ".join(f"{rid} item {i} from position {p}"
                                  for rid, i, p in lacking[:4])
                raise TimeoutError(f"capsteer: readout results did not arrive within "
                                   f"{timeout:g} s ({len(lacking)} items lacking: {shown})")
            time.sleep(self.poll_s)
        return [[self._values[d.readout_id].entry(
                    item, d.prompt, d.output, 0, fed_limit(len(d.prompt), len(d.output)),
                    _DECODE_RAW) for item in d.items] for d in done]

    def close(self) -> None:
        self.reader.stop()
