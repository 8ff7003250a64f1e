"""Activation patching in the worker (steering/patches.py has the request side): a
request's patches, by the point they act at, and what the tap op does with them.

A patch replaces the value at one (kind, site) at some absolute positions. The plan finds
this step's rows at those positions (`step_rows`), and the tap op overwrites them after
the point's steering and before its copies (`apply`), so a capture at the same point
records the patched value. At a stream site in vLLM's deferred layout the op mutates
`x` and the stream is `x + residual`: `x = v - residual` makes the stream `v`.

Host mode only (the CPU engine, eager): rows are indexed directly. Device mode (CUDA
graphs) would need the values in a fixed table and a per-row index written each step;
until then a patch payload there is refused by the worker (`decode`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import torch

from capsteer.engine_ext.families import STREAM
from capsteer.steering.patches import DEVICE_REFUSAL
from capsteer.steering.spec import SteeringSpec

# (kind, site) -> (patched positions, sorted int64 [P]; their values, float32 [P, hidden])
Patches = dict[tuple[int, int], tuple[np.ndarray, torch.Tensor]]


def decode(wire: Mapping | str, point_of: Callable[[str, int], tuple[int, int]],
           device: torch.device, device_driven: bool, resolve=None) -> Patches:
    """The patches a payload's steering carries, by point (`point_of`: hook, layer ->
    kind, site); {} when it carries none (cheap: no decode of the spec then)."""
    text = wire if isinstance(wire, str) else None
    if text is not None and '"patches":' not in text:
        return {}
    if text is None and not wire.get("patches"):
        return {}
    if device_driven:
        raise ValueError(DEVICE_REFUSAL)
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
