"""Activation patching in the worker (steering/patches.py has the request side): a
request's patches, by the point they act at, and what the tap op does with them.

A patch replaces the value at one (kind, site) at some absolute positions, after the
point's steering and before its copies (a capture at the same point records the patched
value). At a stream site in vLLM's deferred layout the op mutates `x` and the stream is
`x + residual`: `x = v - residual` makes the stream `v`; a sublayer tensor is set.

Host mode (CPU, eager): the plan lists this step's rows at patched positions and their
values (`step_rows`); the op indexes them (`apply`).

Device mode (CUDA graphs): `DeviceTable`, fixed buffers the graph reads. A request's
patched positions (the union over its points, sorted) get one block of table rows per
point, written when the request arrives; `base[slot, kind, site]` is that block's first
row (-1: none) and `keep` marks the rows patched at that point. Each step the host
uploads one index per token row, its position's rank in its request's union (-1: none),
only for steps with patched rows (-1 again after them). The op replaces row r where
`base[slot[r], kind, site] >= 0`, `rank[r] >= 0` and `keep[base + rank]`; nothing in the
graph depends on a host value, and other requests' rows read only the rank (-1).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import torch

from capsteer.engine_ext.families import STREAM
from capsteer.steering.spec import SteeringSpec

# (kind, site) -> (patched positions, sorted int64 [P]; their values, float32 [P, hidden])
Patches = dict[tuple[int, int], tuple[np.ndarray, torch.Tensor]]


def decode(wire: Mapping | str, point_of: Callable[[str, int], tuple[int, int]],
           device: torch.device, resolve=None) -> Patches:
    """The patches a payload's steering carries, by point (`point_of`: hook, layer ->
    kind, site); {} when it carries none (cheap: no decode of the spec then)."""
    text = wire if isinstance(wire, str) else None
    if text is not None and '"patches":' not in text:
        return {}
    if text is None and not wire.get("patches"):
        return {}
    spec = SteeringSpec.from_wire(wire, resolve)
    out: Patches = {}
    for op in spec.patches:
        point = point_of(op.hook, op.layer)
        values = torch.from_numpy(op.values).to(device)
        if point in out:  # resid_post L and resid_pre L+1: one point, disjoint positions
            pos = np.concatenate([out[point][0], op.positions])
            values = torch.cat([out[point][1], values])
            order = np.argsort(pos, kind="stable")
            out[point] = (pos[order], values[torch.from_numpy(order).to(device)])
        else:
            out[point] = (op.positions, values)
    return out


def step_rows(patches: Patches, rows: np.ndarray, pos: np.ndarray,
              into: dict[tuple[int, int], list]) -> None:
    """Append (batch rows, values) for this step's rows of one request whose positions
    are patched, per point, to `into`."""
    for point, (patched, values) in patches.items():
        at = np.searchsorted(patched, pos)
        hit = at < len(patched)
        hit[hit] = patched[at[hit]] == pos[hit]
        if hit.any():
            into.setdefault(point, []).append(
                (rows[hit], values[torch.from_numpy(at[hit]).to(values.device)]))


def finish(into: dict[tuple[int, int], list]) -> dict[tuple[int, int], tuple]:
    """The plan's patch table: point -> (rows int64 [k], values float32 [k, hidden])."""
    return {point: (torch.from_numpy(np.concatenate([r for r, _ in parts])),
                    torch.cat([v for _, v in parts]))
            for point, parts in into.items()}


def apply(x: torch.Tensor, residual: torch.Tensor | None, kind: int, rows: torch.Tensor,
          values: torch.Tensor) -> None:
    """Set the value at `rows` to `values` (host mode): the sublayer output itself, or the
    stream `x + residual` through `x`."""
    rows = rows.to(x.device)
    if kind == STREAM and residual is not None:
        x[rows] = (values - residual[rows].float()).to(x.dtype)
    else:
        x[rows] = values.to(x.dtype)


def union(patches: Patches) -> np.ndarray:
    """A request's patched positions over all its points, sorted (device mode ranks rows
    by it)."""
    return np.unique(np.concatenate([pos for pos, _ in patches.values()])) if patches \
        else np.zeros(0, np.int64)


def step_ranks(positions: np.ndarray, rows: np.ndarray, pos: np.ndarray,
               into: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """Device mode: (batch rows, rank of their position in `positions`) for this step's
    rows of one request at patched positions, appended to `into`."""
    at = np.searchsorted(positions, pos)
    hit = at < len(positions)
    hit[hit] = positions[at[hit]] == pos[hit]
    if hit.any():
        into.append((rows[hit], at[hit]))


class DeviceTable:
    """Device mode's patch values and indices, at fixed addresses (module docstring)."""

    def __init__(self, rows: int, hidden: int, num_sites: int, max_requests: int,
                 max_tokens: int, device: torch.device) -> None:
        self.rows = rows  # table row `rows` is never patched (keep 0): the padding's index
        self.values = torch.zeros(rows + 1, hidden, dtype=torch.float32, device=device)
        self.keep = torch.zeros(rows + 1, dtype=torch.int32, device=device)
        self.base = torch.full((max_requests + 1, 2, num_sites), -1, dtype=torch.int64,
                               device=device)
        self.rank = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)
        self.rank_set = False
        self.free: list[tuple[int, int]] = [(0, rows)] if rows else []  # [start, stop)
        self.held: dict[int, list[tuple[int, int]]] = {}  # slot -> its blocks

    def _take(self, n: int) -> int:
        for i, (start, stop) in enumerate(self.free):
            if stop - start >= n:
                self.free[i] = (start + n, stop)
                if start + n == stop:
                    del self.free[i]
                return start
        raise RuntimeError(f"capsteer: patch table full ({self.rows} rows; raise the worker "
                           "config's patch_rows)")

    def attach(self, slot: int, patches: Patches, upload) -> None:
        """Write a request's blocks (`upload(dst, host)` copies without a host sync)."""
        positions = union(patches)
        blocks: list[tuple[int, int]] = []
        self.held[slot] = blocks
        try:
            for (kind, site), (pos, values) in patches.items():
                start = self._take(len(positions))
                blocks.append((start, len(positions)))
                at = np.searchsorted(positions, pos)
                host = torch.zeros(len(positions), values.shape[1])
                host[torch.from_numpy(at)] = values.cpu().float()
                keep = np.zeros(len(positions), np.int32)
                keep[at] = 1
                upload(self.values[start: start + len(positions)], host.numpy())
                upload(self.keep[start: start + len(positions)], keep)
                self.base[slot, kind, site] = start
        except Exception:
            self.detach(slot)
            raise

    def detach(self, slot: int) -> None:
        """Give a request's blocks back; its slot's row is -1 again."""
        blocks = self.held.pop(slot, None)
        if blocks is None:
            return
        self.base[slot].fill_(-1)
        for start, n in blocks:
            self.keep[start: start + n].zero_()
            self.free.append((start, start + n))
        merged: list[tuple[int, int]] = []
        for start, stop in sorted(self.free):  # adjacent ranges become one again
            if merged and merged[-1][1] == start:
                merged[-1] = (merged[-1][0], stop)
            else:
                merged.append((start, stop))
        self.free = merged

    def write_ranks(self, ranks: list[tuple[np.ndarray, np.ndarray]] | None, n: int,
                    upload) -> None:
        """This step's per-row ranks (`ranks` None: no patched rows this step)."""
        if ranks:
            host = np.full(n, -1, np.int64)
            for rows, at in ranks:
                host[rows] = at
            upload(self.rank[:n], host)
            self.rank_set = True
        elif self.rank_set:
            self.rank.fill_(-1)
            self.rank_set = False

    def apply_dense(self, x: torch.Tensor, residual: torch.Tensor | None, slot: torch.Tensor,
                    kind: int, site: int) -> None:
        """The torch reference of the kernel's patch (every row; graph-safe)."""
        if x.shape[-1] != self.values.shape[1]:  # a hook wider than the stream: never patched
            return
        n = x.shape[0]
        base, rank = self.base[slot, kind, site], self.rank[:n]
        idx = torch.where((base >= 0) & (rank >= 0), base + rank,
                          torch.full_like(base, self.rows))
        value = self.values[idx]
        if kind == STREAM and residual is not None:
            value = value - residual.float()
        x.copy_(torch.where((self.keep[idx] != 0).unsqueeze(1), value.to(x.dtype), x))
