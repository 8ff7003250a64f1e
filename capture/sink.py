"""The sink contract between the engine (which copies rows off the model) and storage.

The engine extension calls a sink from the worker process, once per request and
step, with rows it already copied (they never alias engine buffers) unless the sink
says it copies them itself. A sink may be in-memory (tests, the in-process engine
API), the durable writer (in-process, a child process or a pool of them) or an
extraction job's shard writer. Like vLLM's `KVConnectorBase_V1`, `CaptureSink` is
one abstract base: four methods every sink implements, the rest optional with
defaults that keep a sink without them on the plain path.

Lifecycle of one capture (engine calls, in order):
  1. `open(request)` when the request is first scheduled; `group_of(capture_id)`
     then names the writer it goes to (the plan lays a step's rows out by it).
  2. Each step with rows for it, either
     - host path: `write(capture_id, hook, layer, positions, rows)` per key, with a
       clone of the rows unless `copies_rows`; or
     - device-ring path (the durable writer's `pin_device_ring()` returned True at
       start-up): on the step thread `reserve_span(...)` (when `supports_spans`) or
       `reserve_rows(...)` for ring space the GPU copies into, then on the sink thread
       `write_reserved(...)` once that copy landed. A reservation of None (the
       default) sends the rows the host path.
     After a step's rows are all handed over, `end_step()` on every sink that got any.
  3. `close(end)` when no more rows can come (the sink applies the final position
     rules and publishes), or `abort(capture_id, reason)` when the request was dropped.
Once, at start-up, the engine may call `defer_sends()` (True: hold messages until
`flush_sends()`, which the harvester calls when it runs out of work). Diagnostics,
called whenever metrics are collected: `engine_wait_s`, `metrics_snapshot`, `stats`.
When a capture's outcome could not even be written to disk, `unwritten_receipts` is
where the server learns it.
"""

from __future__ import annotations

import io
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from capsteer.capture.receipts import Receipt
from capsteer.capture.spec import CaptureSpec


@dataclass(frozen=True)
class CaptureRequest:
    """What a sink learns when a captured request is first scheduled.

    Under pipeline parallelism each stage's worker opens the same capture with its
    own `stage` (0-based), the shared `num_stages`, and `keys`: the (hook, layer)
    pairs whose values live on that stage (None = every key of the spec). The stages'
    writers each publish their own files and one of them merges the manifest.
    `dir_time`, when set, dates the capture directory instead of the open time:
    stages that open across midnight UTC must still agree on one directory.
    """

    capture_id: str
    request_id: str
    model: str
    spec: CaptureSpec
    prompt_token_ids: tuple[int, ...]
    model_dtype: torch.dtype
    hidden_size: int
    num_layers: int
    stage: int = 0
    num_stages: int = 1
    keys: tuple[tuple[str, int], ...] | None = None
    dir_time: float | None = None
    # Widths of the hooks not hidden_size wide (mlp_post: d_mlp), as (hook, width) pairs.
    hook_widths: tuple[tuple[str, int], ...] = ()

    def width(self, hook: str) -> int:
        """The width of a hook's rows: hidden_size unless hook_widths says otherwise."""
        return dict(self.hook_widths).get(hook, self.hidden_size)


@dataclass(frozen=True)
class CaptureEnd:
    """What a sink learns when the request finishes.

    `token_ids` is the whole sequence that was fed through the model (prompt, then
    generated tokens except the last sampled one), so `token_ids[p]` is the input
    token at absolute position p.
    """

    capture_id: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None


class Reserved(Protocol):
    """Device-ring space one write's rows are copied into (what `reserve_rows` returns)."""

    @property
    def writer(self) -> object:
        """The ring's owner: copies into one owner's ring may merge into one."""
        ...

    @property
    def rows(self) -> torch.Tensor:
        """The reserved rows, shaped as the write's rows."""
        ...


class CaptureSink(ABC):
    """Receives copied activation rows; every method must be cheap for the caller.

    Subclasses implement `open`, `write`, `close` and `abort`; the device-ring and
    diagnostic methods default to "not supported" (see the module docstring)."""

    # True: `write` copies the rows before it returns, so callers may pass views of
    # buffers they reuse; False: the engine hands over a clone of its own.
    copies_rows: bool = False
    # True: `reserve_span` may reserve several writes' rows at once (one GPU copy).
    supports_spans: bool = False

    @abstractmethod
    def open(self, request: CaptureRequest) -> None:
        """A captured request was scheduled for the first time."""

    @abstractmethod
    def write(
        self, capture_id: str, hook: str, layer: int, positions: np.ndarray, rows: torch.Tensor
    ) -> None:
        """Rows for (hook, layer) at absolute `positions` (int64, same length as rows).

        Positions can repeat across calls (preemption then recompute); the sink keeps
        each position once. `rows` is a CPU tensor the sink now owns.
        """

    @abstractmethod
    def close(self, end: CaptureEnd) -> None:
        """The request finished; the sink applies final position rules and publishes."""

    @abstractmethod
    def abort(self, capture_id: str, reason: str) -> None:
        """The request was dropped before finishing (client gone, engine error)."""

    def end_step(self) -> None:  # noqa: B027 - optional hook, no-op by default
        """A step's rows are all handed over (a sink that batches them sends now)."""

    def group_of(self, capture_id: str) -> int:
        """The writer (ring) a capture's rows go to; one group unless overridden."""
        return 0

    # ------------------------------------------------- the device-ring half
    def pin_device_ring(self) -> bool:
        """Page-lock a ring for the GPU's copies; False: rows take the host path."""
        return False

    def reserve_rows(self, capture_id: str, shape: tuple[int, ...],
                     dtype: torch.dtype) -> Reserved | None:
        """Ring space for one write's rows; None: no space, the rows take the host path."""
        return None

    def reserve_span(self, capture_ids: Sequence[str], shapes: Sequence[tuple[int, ...]],
                     dtype: torch.dtype) -> tuple[torch.Tensor, list[Any]] | None:
        """One reservation for several writes (only asked when `supports_spans`); None:
        the caller reserves write by write."""
        return None

    def write_reserved(self, reserved: Any, capture_id: str, hook: str, layer: int,
                       positions: np.ndarray, *, frees: bool = True) -> None:
        """`write` of reserved rows the GPU copy filled; only a sink that reserves gets it."""
        raise NotImplementedError(f"{type(self).__name__} reserves no ring space")

    # ------------------------------------------------- batching and diagnostics
    def defer_sends(self) -> bool:
        """Hold messages until `flush_sends`; False: this sink has nothing to hold."""
        return False

    def flush_sends(self) -> None:  # noqa: B027 - optional hook, no-op by default
        """Send what `defer_sends` held."""

    def engine_wait_s(self) -> dict[str, float]:
        """Seconds the engine's threads waited on this sink, by what they waited for."""
        return {}

    def metrics_snapshot(self) -> dict[str, Any] | None:
        """Capture metrics kept in another process (None: they are this process's)."""
        return None

    def stats(self) -> dict[str, Any] | None:
        """Writer statistics for capsteer_stats (None: this sink keeps none)."""
        return None

    def unwritten_receipts(self, capture_ids: Sequence[str]) -> dict[str, Receipt]:
        """Final receipts of these captures whose manifest could not be written (a full
        disk): the server's only way to learn those outcomes. Empty by default."""
        return {}


@dataclass
class CapturedActivations:
    """A finished in-memory capture: one [n_positions, hidden] tensor per (hook, layer)."""

    capture_id: str
    positions: np.ndarray
    token_ids: np.ndarray
    tensors: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)
    error: str | None = None  # set when the capture failed; tensors are then empty

    def select(self, positions: np.ndarray) -> CapturedActivations:
        """The same capture restricted to `positions` (a subset of self.positions)."""
        mask = np.isin(self.positions, positions)
        index = torch.from_numpy(np.flatnonzero(mask))
        return CapturedActivations(
            self.capture_id, self.positions[mask], self.token_ids[mask],
            {k: t[index] for k, t in self.tensors.items()}, self.error)

    def to_wire(self) -> bytes:
        """One opaque blob: collective_rpc results cross a msgpack boundary that
        does not keep tensors (bf16 included) intact."""
        buf = io.BytesIO()
        torch.save({"capture_id": self.capture_id, "positions": self.positions,
                    "token_ids": self.token_ids, "tensors": self.tensors,
                    "error": self.error}, buf)
        return buf.getvalue()

    @classmethod
    def from_wire(cls, blob: bytes) -> CapturedActivations:
        d = torch.load(io.BytesIO(blob), weights_only=False)
        return cls(d["capture_id"], d["positions"], d["token_ids"], d["tensors"], d.get("error"))


Key = tuple[str, int]


class RowsByPosition:
    """One request's rows per (hook, layer), one per absolute position: a position
    recomputed after preemption is kept once (last write wins)."""

    def __init__(self) -> None:
        self.by_key: dict[Key, dict[int, torch.Tensor]] = {}

    def add(self, key: Key, positions: np.ndarray, rows: torch.Tensor) -> None:
        by_pos = self.by_key.setdefault(key, {})
        for i, pos in enumerate(np.asarray(positions).reshape(-1).tolist()):
            by_pos[pos] = rows[i]

    def assemble(
        self, keys, select, width, dtype: torch.dtype
    ) -> tuple[np.ndarray, dict[Key, torch.Tensor]]:
        """Stack the rows `select(seen_positions)` keeps, in position order, for each key.
        Every key must keep the same positions (they were captured from the same rows)."""
        kept: np.ndarray | None = None
        tensors: dict[Key, torch.Tensor] = {}
        for key in keys:
            by_pos = self.by_key.get(key, {})
            k = select(np.array(sorted(by_pos), np.int64))
            if kept is not None and not np.array_equal(k, kept):
                raise ValueError(f"keys captured different positions ({key})")
            kept = k
            tensors[key] = (torch.stack([by_pos[p] for p in k.tolist()]) if len(k)
                            else torch.zeros(0, width(key[0]), dtype=dtype))
        return (kept if kept is not None else np.zeros(0, np.int64)), tensors


class _Pending:
    def __init__(self, request: CaptureRequest) -> None:
        self.request = request
        self.rows = RowsByPosition()


class MemorySink(CaptureSink):
    """Keeps finished captures in memory until taken; for tests and the in-process API."""

    def __init__(self, final_positions: bool = True) -> None:
        """final_positions=False keeps every captured candidate row: the in-process engine
        then applies the position rules with the output length its front end saw (a stop
        string or async scheduling can make the engine feed tokens past the output)."""
        self.final_positions = final_positions
        self._lock = threading.Lock()
        self._pending: dict[str, _Pending] = {}
        self._done: dict[str, CapturedActivations] = {}

    def open(self, request: CaptureRequest) -> None:
        with self._lock:
            self._pending.setdefault(request.capture_id, _Pending(request))

    def write(
        self, capture_id: str, hook: str, layer: int, positions: np.ndarray, rows: torch.Tensor
    ) -> None:
        with self._lock:
            self._pending[capture_id].rows.add((hook, layer), positions, rows)

    def close(self, end: CaptureEnd) -> None:
        with self._lock:
            pending = self._pending.pop(end.capture_id, None)
        if pending is None:
            return
        req = pending.request
        prompt_len = len(req.prompt_token_ids)
        fed = len(end.token_ids)

        def select(seen: np.ndarray) -> np.ndarray:
            return req.spec.positions.finalize(seen, prompt_len, fed) if self.final_positions \
                else seen

        positions, tensors = pending.rows.assemble(
            sorted(pending.rows.by_key), select, req.width, req.model_dtype)
        token_ids = np.asarray([end.token_ids[p] if p < fed else -1 for p in positions], np.int64)
        result = CapturedActivations(end.capture_id, positions, token_ids, tensors)
        with self._lock:
            self._done[end.capture_id] = result

    def abort(self, capture_id: str, reason: str) -> None:
        """The capture failed: whoever takes it gets the reason instead of waiting."""
        empty = np.zeros(0, np.int64)
        with self._lock:
            self._pending.pop(capture_id, None)
            self._done[capture_id] = CapturedActivations(capture_id, empty, empty, error=reason)

    def take(self, capture_ids: list[str]) -> dict[str, CapturedActivations]:
        """Remove and return the finished captures among `capture_ids`."""
        with self._lock:
            return {cid: self._done.pop(cid) for cid in capture_ids if cid in self._done}
