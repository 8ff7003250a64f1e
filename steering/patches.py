"""Activation patching from a capture (api.md §7): a steering item
`{"op": "patch", "hook": ..., "layer": ..., "source": {"capture_id": "cap-…",
"positions": [..]}}` replaces the value at that hook and layer, at those absolute
positions of the request, by what an earlier capture recorded at the same positions.

The front end resolves the capture (published, ok, same model), reads the rows and
checks them here; the rows then travel inside the steering spec's wire form as float32
base64 (bounded by `MAX_PATCH_FLOATS` a request), so a worker needs no access to the
capture's files. A position the request never feeds (past its prompt and output, or
served from the prefix cache by an identical earlier request) is not patched: nothing
is refused at run time.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from capsteer.config import errors
from capsteer.hooks import (
    CAPTURE_ONLY,
    WIDE_HOOKS,
    hook_width_text,
    parse_item_hook,
    parse_layers,
)

PATCH_FIELDS = frozenset({"hook", "layer", "layers", "op", "source"})
SOURCE_FIELDS = frozenset({"capture_id", "positions"})
# Floats a request's patches may carry in all (4 MiB of float32): they ride the request
# to every worker.
MAX_PATCH_FLOATS = 1 << 20
_MAX_POSITION = 1 << 40  # far past any context, far inside int64


class PatchSourceError(errors.InvalidInput, ValueError):
    """A capture a patch cannot read (pending, failed, another model); the parser names
    the field."""


@dataclass(frozen=True)
class PatchSource:
    """One published capture as a patch reads it: its model, the (hook, layer) keys it
    holds, its absolute positions, and its rows per key (float32 [positions, width])."""

    capture_id: str
    model: str
    keys: frozenset[tuple[str, int]]
    positions: np.ndarray
    rows: Callable[[str, int], np.ndarray] = field(compare=False)


    @classmethod
    def of_tensors(cls, capture_id: str, model: str, positions: object,
                   tensors: Mapping[tuple[str, int], object]) -> PatchSource:
        """From rows in memory (an in-process engine's capture: CapturedActivations's
        `positions` and `tensors`), torch or numpy."""
        def rows(hook: str, layer: int) -> np.ndarray:
            t = tensors[(hook, layer)]
            if hasattr(t, "detach"):
                t = t.detach().to("cpu").float().numpy()
            return np.asarray(t, dtype=np.float32)
        return cls(capture_id, model, frozenset(tensors), np.asarray(positions, np.int64), rows)


# capture id -> its PatchSource; KeyError when no such capture exists, PatchSourceError
# when it exists but cannot be read (pending, failed, captured from another model).
PatchGetter = Callable[[str], PatchSource]


class PatchSpecError(errors.InvalidInput, ValueError):
    """Bad patch input; `field` names the request field."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


@dataclass(frozen=True, eq=False)
class PatchOp:
    """Replace the value at (hook, layer) at absolute `positions` (sorted, unique) by
    `values` (float32 [len(positions), hidden], one row per position)."""

    hook: str
    layer: int
    positions: np.ndarray
    values: np.ndarray

    def to_dict(self) -> dict:
        return {"hook": self.hook, "layer": self.layer,
                "positions": [int(p) for p in self.positions],
                "b64": base64.b64encode(self.values.astype("<f4").tobytes()).decode()}

    @classmethod
    def from_dict(cls, d: Mapping) -> PatchOp:
        positions = np.asarray(d["positions"], dtype=np.int64)
        values = np.frombuffer(base64.b64decode(d["b64"]), dtype="<f4").astype(np.float32)
        return cls(str(d["hook"]), int(d["layer"]), positions,
                   values.reshape(len(positions), -1))

    def digest(self) -> str:
        """The patch's content identity (a spec's sharing key and salt include it)."""
        h = hashlib.sha256(f"{self.hook}.{self.layer}:".encode())
        h.update(self.positions.astype("<i8").tobytes())
        h.update(self.values.astype("<f4").tobytes())
        return h.hexdigest()


def _positions(raw: object, field: str) -> np.ndarray:
    if not isinstance(raw, list) or not raw:
        raise PatchSpecError(field, "must be a non-empty list of positions")
    if not all(isinstance(p, int) and not isinstance(p, bool) for p in raw):
        raise PatchSpecError(field, "must hold integers (absolute positions)")
    if any(p < 0 for p in raw):
        raise PatchSpecError(field, "positions are absolute (prompt then generated), "
                                    "from 0; negative positions are not accepted")
    if any(p >= _MAX_POSITION for p in raw):
        raise PatchSpecError(field, f"positions lie beyond any context (>= {_MAX_POSITION})")
    if len(set(raw)) != len(raw):
        raise PatchSpecError(field, "holds a position twice")
    return np.asarray(sorted(raw), dtype=np.int64)


def _source(raw: object, field: str, getter: PatchGetter | None) -> tuple[PatchSource, np.ndarray]:
    if not isinstance(raw, Mapping):
        raise PatchSpecError(field, "must be an object {'capture_id': ..., 'positions': [...]}")
    unknown = set(raw) - SOURCE_FIELDS
    if unknown:
        raise PatchSpecError(field, f"unknown field(s) {sorted(unknown)}")
    capture_id = raw.get("capture_id")
    if not isinstance(capture_id, str) or not capture_id:
        raise PatchSpecError(field + ".capture_id", "must be a capture id (a string)")
    if "positions" not in raw:
        raise PatchSpecError(field + ".positions", "is required")
    positions = _positions(raw["positions"], field + ".positions")
    if getter is None:
        raise PatchSpecError(field + ".capture_id", "patching needs the server's captures; "
                             "none are readable here")
    try:
        source = getter(capture_id)
    except KeyError:
        raise PatchSpecError(field + ".capture_id",
                             f"no capture {capture_id!r} on this server") from None
    except PatchSourceError as exc:
        raise PatchSpecError(field + ".capture_id", str(exc)) from None
    return source, positions


def _patch_refusal(hook: str) -> str | None:
    """The patch table is as wide as the stream: wide and capture-only hooks are refused."""
    if hook in WIDE_HOOKS or hook in CAPTURE_ONLY:
        return f"op patch acts on hooks of the model's hidden size for now, not on {hook}"
    return None


def parse_patch_item(item: Mapping, field: str, *, num_layers: int, hidden_size: int,
                     getter: PatchGetter | None,
                     unavailable: Mapping[str, str] | None = None) -> list[PatchOp]:
    """One `op: patch` steering item -> one PatchOp per layer it names (checked against
    the capture: the key captured, the positions captured, the width the model's)."""
    unknown = set(item) - PATCH_FIELDS
    if unknown:
        raise PatchSpecError(field, f"unknown field(s) {sorted(unknown)} (a patch takes "
                                    f"{', '.join(sorted(PATCH_FIELDS))})")
    hook = parse_item_hook(item, field, unavailable, PatchSpecError, _patch_refusal)
    if "layer" in item and "layers" in item:
        raise PatchSpecError(field, "give either 'layer' or 'layers', not both")
    key = "layer" if "layer" in item else "layers"
    if key not in item:
        raise PatchSpecError(field + ".layer", "is required (or 'layers')")
    if key == "layer" and (isinstance(item[key], bool) or not isinstance(item[key], int)):
        raise PatchSpecError(field + ".layer", "must be an integer")
    try:
        layers = parse_layers(item[key], num_layers)
    except ValueError as exc:
        raise PatchSpecError(f"{field}.{key}", str(exc)) from None
    if "source" not in item:
        raise PatchSpecError(field + ".source", "is required for op 'patch'")
    source, positions = _source(item["source"], field + ".source", getter)
    captured = {int(p): i for i, p in enumerate(source.positions.tolist())}
    missing = [int(p) for p in positions if int(p) not in captured]
    if missing:
        raise PatchSpecError(field + ".source.positions",
                             f"position(s) {missing[:8]} were not captured by "
                             f"{source.capture_id} (it holds {len(captured)} positions)")
    at = np.fromiter((captured[int(p)] for p in positions), np.int64, len(positions))
    ops = []
    for layer in layers:
        if (hook, layer) not in source.keys:
            held = ", ".join(f"{h}.{la}" for h, la in sorted(source.keys)) or "nothing"
            where = f"{field}.{key}" if any(h == hook for h, _ in source.keys) else \
                f"{field}.hook"
            raise PatchSpecError(where, f"{source.capture_id} did not capture {hook} at "
                                 f"layer {layer} (it holds {held})")
        try:
            rows = np.asarray(source.rows(hook, layer))
        except PatchSourceError as exc:
            raise PatchSpecError(field + ".source.capture_id", str(exc)) from None
        if rows.ndim != 2 or rows.shape[1] != hidden_size:
            raise PatchSpecError(field + ".source.capture_id",
                                 f"{source.capture_id} holds rows of width "
                                 f"{rows.shape[-1] if rows.ndim else 0} at {hook}.{layer}; "
                                 + hook_width_text(hook, hidden_size, hidden_size))
        values = np.ascontiguousarray(rows[at], dtype=np.float32)
        if not np.isfinite(values).all():
            raise PatchSpecError(field + ".source.capture_id",
                                 f"{source.capture_id} holds non-finite values at "
                                 f"{hook}.{layer} at these positions")
        ops.append(PatchOp(hook, layer, positions, values))
    return ops


def check_patches(ops: list[PatchOp] | tuple[PatchOp, ...], num_layers: int) -> None:
    """A position is patched once per point (resid_post L is resid_pre L+1), and a
    request's patches ride it to every worker: at most MAX_PATCH_FLOATS floats."""
    seen: dict[tuple[str, int], set[int]] = {}
    for op in ops:
        point = ("resid_pre", op.layer + 1) if op.hook == "resid_post" and \
            op.layer + 1 < num_layers else (op.hook, op.layer)
        held = seen.setdefault(point, set())
        twice = held.intersection(op.positions.tolist())
        if twice:
            raise PatchSpecError("steering.vectors", f"position(s) {sorted(twice)[:8]} are "
                                 f"patched twice at {op.hook} layer {op.layer}")
        held.update(op.positions.tolist())
    total = sum(op.values.size for op in ops)
    if total > MAX_PATCH_FLOATS:
        raise PatchSpecError("steering.vectors", f"patches carry {total} floats in all, more "
                             f"than {MAX_PATCH_FLOATS}: patch fewer positions or layers")

