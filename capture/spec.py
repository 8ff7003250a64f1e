"""Capture specs: what a request asks to capture, parsed and validated once.

The server parses the request's `capture` object with `parse_capture_spec` (errors
become HTTP 400 naming the field); the engine asks `PositionSpec.candidate` which
rows to copy each step; the writer applies `PositionSpec.finalize` when the request
ends, because only then is it known which position was the last one fed.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from capsteer.config import errors
from capsteer.hooks import HookNameError, canonical_hook
from capsteer.hooks import parse_layers as hooks_parse_layers

POSITION_KINDS: tuple[str, ...] = ("all", "prompt", "generated", "last_prompt", "last", "explicit")
RANGE_KINDS: tuple[str, ...] = ("all", "prompt", "generated")  # kinds keeping a run of positions


def range_bounds(kind: str, prompt_len: int, start: int, limit: int) -> tuple[int, int]:
    """[lo, hi) of the positions in [start, limit) a range kind keeps (none: hi <= lo)."""
    lo = max(start, prompt_len) if kind == "generated" else start
    hi = min(limit, prompt_len) if kind == "prompt" else limit
    return lo, hi
LAYOUTS: tuple[str, ...] = ("packed", "per_file")
DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16")
_DTYPE_ALIASES: dict[str, str] = {
    "fp32": "float32",
    "float": "float32",
    "f32": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "f16": "float16",
}
SPEC_KEYS: tuple[str, ...] = ("hooks", "layers", "positions", "layout", "dtype", "tag")
DEFAULT_SPEC: dict[str, Any] = {"hooks": ["resid_post"], "layers": "all", "positions": "all"}
# Slugs become path components; this pattern cannot express a separator or "..".
_SLUG_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")
_RANGE_RE = re.compile(r"\s*(-?\d+)\s*-\s*(-?\d+)\s*")
_SLICE_RE = re.compile(r"\s*(-?\d+)?\s*:\s*(-?\d+)?\s*")
_INT_RE = re.compile(r"\s*-?\d+\s*")
MAX_EXPLICIT_POSITIONS = 1 << 20
# Explicit positions are int64 on the engine's path; no context is near 2**31 tokens.
MAX_POSITION = (1 << 31) - 1


class SpecError(errors.InvalidInput, ValueError):
    """A capture spec field is invalid; `field` names it for the client's 400 error."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = self.param = field
        self.reason = reason


def validate_slug(value: object, field: str) -> str:
    """Return `value` if it is a safe single path component ([A-Za-z0-9._-]{1,64})."""
    if not isinstance(value, str):
        raise SpecError(field, f"must be a string, got {type(value).__name__}")
    if not _SLUG_RE.fullmatch(value):
        raise SpecError(field, f"{value!r} must match [A-Za-z0-9._-]{{1,64}}")
    if value in (".", ".."):
        raise SpecError(field, f"{value!r} is not allowed")
    return value


@dataclass(frozen=True)
class PositionSpec:
    """Which absolute positions (prompt then generated tokens) to keep."""

    kind: str
    explicit: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in POSITION_KINDS:
            raise SpecError("capture.positions", f"unknown kind {self.kind!r}")
        if (self.kind == "explicit") != bool(self.explicit):
            raise SpecError("capture.positions", "explicit positions need a non-empty list")

    def resolved(self, prompt_len: int) -> np.ndarray:
        """Explicit positions as absolute indices (negatives count back from the prompt end)."""
        arr = np.asarray(self.explicit, dtype=np.int64)
        arr = np.where(arr < 0, arr + prompt_len, arr)
        return np.unique(arr[arr >= 0])

    def reaches_past_prompt(self, prompt_len: int | None) -> bool:
        """Whether kept positions can lie past the prompt, so they depend on the output
        length; with the prompt length unknown, explicit positions count as possibly
        generated."""
        if self.kind != "explicit":
            return self.kind in ("all", "generated", "last")
        if prompt_len is None:
            return True
        resolved = self.resolved(prompt_len)
        return bool(len(resolved)) and int(resolved.max()) >= prompt_len

    def candidate(self, positions: np.ndarray, prompt_len: int) -> np.ndarray:
        """Bool mask over `positions`: rows the engine should copy when they are fed."""
        p = np.asarray(positions, dtype=np.int64)
        if self.kind == "all":
            return np.ones(p.shape, dtype=bool)
        if self.kind == "prompt":
            return p < prompt_len
        if self.kind == "generated":
            return p >= prompt_len
        if self.kind == "last_prompt":
            return p == prompt_len - 1
        if self.kind == "last":
            return p >= prompt_len - 1
        return np.isin(p, self.resolved(prompt_len))

    def finalize(self, positions: np.ndarray, prompt_len: int, fed_len: int) -> np.ndarray:
        """Of the sorted unique captured positions, those to keep (sorted int64).

        "last" keeps the highest fed position (fed_len - 1 when it was captured; the
        highest captured one otherwise, e.g. when the request was cut short).
        """
        p = np.unique(np.asarray(positions, dtype=np.int64))
        p = p[(p >= 0) & (p < fed_len)]
        p = p[self.candidate(p, prompt_len)]
        if self.kind == "last":
            return p[-1:].copy()
        return p

    def to_json(self) -> str | list[int]:
        """The normalized request form: a kind name or the list of explicit ints."""
        return list(self.explicit) if self.kind == "explicit" else self.kind


def _as_int(value: object, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        if isinstance(value, str) and _INT_RE.fullmatch(value):
            return int(value)
        raise SpecError(field, f"expected an integer, got {value!r}")
    return int(value)


def _position(value: object, field: str) -> int:
    position = _as_int(value, field)
    if not -MAX_POSITION <= position <= MAX_POSITION:
        raise SpecError(field, f"position {position} is out of range (|position| <= {MAX_POSITION})")
    return position


def parse_positions(value: object) -> PositionSpec:
    """Parse `capture.positions`: a kind name, an int, or a list of ints."""
    field = "capture.positions"
    if isinstance(value, str):
        kind = value.strip().lower()
        if kind in POSITION_KINDS and kind != "explicit":
            return PositionSpec(kind)
        if _INT_RE.fullmatch(kind):
            return PositionSpec("explicit", (_position(kind, field),))
        accepted = ", ".join(k for k in POSITION_KINDS if k != "explicit")
        raise SpecError(field, f"unknown positions {value!r}; accepted: {accepted} or a list of ints")
    if isinstance(value, (list, tuple)):
        if not value:
            raise SpecError(field, "empty list")
        if len(value) > MAX_EXPLICIT_POSITIONS:
            raise SpecError(field, f"more than {MAX_EXPLICIT_POSITIONS} positions")
        ints = sorted({_position(v, field) for v in value})
        return PositionSpec("explicit", tuple(ints))
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return PositionSpec("explicit", (_position(value, field),))
    raise SpecError(field, f"expected a string or a list of ints, got {type(value).__name__}")


def parse_layers(value: object, num_layers: int, field: str = "capture.layers") -> tuple[int, ...]:
    """Parse "all", an int, a list (ints or range strings), "a-b" (inclusive) or "a:b"."""
    try:
        return hooks_parse_layers(value, num_layers)
    except ValueError as exc:
        raise SpecError(field, str(exc)) from None


def _hook_name(name: object, field: str) -> str:
    if isinstance(name, str) and name.strip() == "post_mlp":
        raise SpecError(field, "'post_mlp' is not accepted; use 'mlp_out' or 'resid_post'")
    try:
        return canonical_hook(name)
    except HookNameError as exc:
        raise SpecError(field, str(exc)) from None


def parse_dtype(value: object) -> str:
    """Parse `capture.dtype` (accepts short aliases like bf16, fp32)."""
    if not isinstance(value, str):
        raise SpecError("capture.dtype", f"expected a string, got {value!r}")
    key = value.strip().lower()
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPES:
        raise SpecError("capture.dtype", f"unknown dtype {value!r}; accepted: {', '.join(DTYPES)}")
    return key


def parse_layout(value: object, field: str = "capture.layout") -> str:
    """Parse `capture.layout` ("packed" or "per_file")."""
    if not isinstance(value, str) or value.strip().lower() not in LAYOUTS:
        raise SpecError(field, f"unknown layout {value!r}; accepted: {', '.join(LAYOUTS)}")
    return value.strip().lower()


def _freeze(hooks: Mapping[str, Iterable[int]]) -> dict[str, tuple[int, ...]]:
    return {h: tuple(sorted(set(int(x) for x in layers))) for h, layers in sorted(hooks.items())}


@dataclass(frozen=True)
class CaptureSpec:
    """A validated capture request; `hooks` maps canonical hook -> sorted layer indices."""

    hooks: dict[str, tuple[int, ...]]
    positions: PositionSpec
    layout: str = "packed"
    dtype: str = "auto"
    tag: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "hooks", _freeze(self.hooks))
        if not self.hooks or not all(self.hooks.values()):
            raise SpecError("capture.hooks", "no (hook, layer) pairs selected")
        if self.layout not in LAYOUTS:
            raise SpecError("capture.layout", f"unknown layout {self.layout!r}")
        if self.dtype not in DTYPES:
            raise SpecError("capture.dtype", f"unknown dtype {self.dtype!r}")
        if self.tag is not None:
            validate_slug(self.tag, "capture.tag")

    def __hash__(self) -> int:
        return hash(self.to_json())

    def keys(self) -> list[tuple[str, int]]:
        """Sorted (hook, layer) pairs to capture."""
        return sorted((h, layer) for h, layers in self.hooks.items() for layer in layers)

    def row_bytes(self, hidden_size: int, itemsize: int,
                  hook_widths: Mapping[str, int] | None = None) -> int:
        """Bytes captured per position (all keys), for budget estimates; `hook_widths`:
        the hooks not hidden_size wide (mlp_post: d_mlp)."""
        widths = hook_widths or {}
        return sum(widths.get(h, hidden_size) for h, _ in self.keys()) * itemsize

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe normalized form (hooks as a dict of explicit layer lists)."""
        return {
            "hooks": {h: list(layers) for h, layers in self.hooks.items()},
            "positions": self.positions.to_json(),
            "layout": self.layout,
            "dtype": self.dtype,
            "tag": self.tag,
        }

    def to_json(self) -> str:
        """Canonical JSON, stable across processes (usable as a cache key); computed once
        (every request of a batch sends it, and it is the spec's hash)."""
        text = self.__dict__.get("_json")
        if text is None:
            text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
            self.__dict__["_json"] = text  # frozen: not a field, so eq and repr ignore it
        return text

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any] | str) -> CaptureSpec:
        """From either wire form: `to_json()`'s text (what requests carry: one parse per
        distinct text, shared by the requests that send it) or `to_dict()`'s mapping."""
        return _spec_from_text(wire) if isinstance(wire, str) else cls.from_dict(wire)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CaptureSpec:
        """Inverse of to_dict; trusts resolved layer indices (no num_layers needed)."""
        hooks = {_hook_name(h, "capture.hooks"): tuple(int(x) for x in v) for h, v in d["hooks"].items()}
        tag = d.get("tag")
        return cls(
            hooks=hooks,
            positions=parse_positions(d.get("positions", "all")),
            layout=parse_layout(d.get("layout", "packed")),
            dtype=parse_dtype(d.get("dtype", "auto")),
            tag=None if tag is None else validate_slug(tag, "capture.tag"),
        )


@functools.lru_cache(maxsize=256)
def _spec_from_text(text: str) -> CaptureSpec:
    return CaptureSpec.from_dict(json.loads(text))


def parse_capture_spec(
    obj: object,
    *,
    num_layers: int,
    default_layout: str = "packed",
    default: Mapping[str, Any] | None = None,
    unavailable: Mapping[str, str] | None = None,
) -> CaptureSpec:
    """Validate a request's `capture` value (True or an object per api.md §2).

    `True` means the server default spec. Fields a request leaves out come from
    `default` (then DEFAULT_SPEC); `layers` is inherited only when `hooks` is a list.
    `unavailable`: hooks the served model does not have (a parallel block's resid_mid),
    each with the reason its 400 gives.
    """
    base: Mapping[str, Any] = DEFAULT_SPEC if default is None else default
    if obj is True:
        obj = dict(base)
    if not isinstance(obj, Mapping):
        raise SpecError("capture", f"expected true or an object, got {obj!r}")
    for key in obj:
        if key not in SPEC_KEYS:
            raise SpecError(f"capture.{key}", f"unknown field; accepted: {', '.join(SPEC_KEYS)}")

    hooks_value = obj["hooks"] if "hooks" in obj else base.get("hooks", DEFAULT_SPEC["hooks"])
    hooks: dict[str, set[int]] = {}
    if isinstance(hooks_value, str):
        hooks_value = [hooks_value]
    if isinstance(hooks_value, Mapping):
        if "layers" in obj:
            raise SpecError(
                "capture.layers", "not allowed when hooks is an object (give layers per hook)"
            )
        if not hooks_value:
            raise SpecError("capture.hooks", "empty object")
        for name, layers_value in hooks_value.items():
            hook = _hook_name(name, "capture.hooks")
            layers = parse_layers(layers_value, num_layers, f"capture.hooks.{name}")
            hooks.setdefault(hook, set()).update(layers)
    elif isinstance(hooks_value, (list, tuple)):
        if not hooks_value:
            raise SpecError("capture.hooks", "empty list")
        layers_value = obj["layers"] if "layers" in obj else base.get("layers", "all")
        layers = parse_layers(layers_value, num_layers)
        for name in hooks_value:
            hooks.setdefault(_hook_name(name, "capture.hooks"), set()).update(layers)
    else:
        raise SpecError("capture.hooks", f"expected a list or an object, got {hooks_value!r}")
    missing = sorted(set(hooks) & set(unavailable or {}))
    if unavailable and missing:
        raise SpecError(f"capture.hooks.{missing[0]}", unavailable[missing[0]])

    positions = parse_positions(obj["positions"] if "positions" in obj else base.get("positions", "all"))
    layout = parse_layout(obj["layout"] if "layout" in obj else base.get("layout", default_layout))
    dtype = parse_dtype(obj["dtype"] if "dtype" in obj else base.get("dtype", "auto"))
    tag_value = obj["tag"] if "tag" in obj else base.get("tag")
    tag = None if tag_value is None else validate_slug(tag_value, "capture.tag")
    return CaptureSpec(
        hooks={h: tuple(sorted(v)) for h, v in hooks.items()},
        positions=positions,
        layout=layout,
        dtype=dtype,
        tag=tag,
    )


def parse_capture_shorthand(text: str) -> dict[str, Any]:
    """A capture object from the one-line form used by flags and config files.

    `HOOK[:LAYERS][+HOOK[:LAYERS]...][@POSITIONS]`, e.g. `resid_post:all@prompt`,
    `resid_post:0-3+mlp_out:-1@last`; LAYERS as in requests ("all", "a-b", "a:b", an
    int, or ints joined by commas); a JSON object is accepted as is. The result is
    validated by `parse_capture_spec` like a request's field.
    """
    field = "global_capture"
    if not isinstance(text, str) or not text.strip():
        raise SpecError(field, "empty capture shorthand")
    text = text.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except ValueError as exc:
            raise SpecError(field, f"not valid JSON: {exc}") from None
        if not isinstance(obj, dict):
            raise SpecError(field, "JSON form must be an object")
        return obj
    hooks_part, _, positions = text.partition("@")
    hooks: dict[str, Any] = {}
    for item in hooks_part.split("+"):
        name, _, layers = item.strip().partition(":")
        if not name:
            raise SpecError(field, f"missing hook name in {text!r}")
        layers = layers.strip() or "all"
        value: Any = [s.strip() for s in layers.split(",")] if "," in layers else layers
        hooks[name.strip()] = value
    out: dict[str, Any] = {"hooks": hooks}
    if positions.strip():
        pos = positions.strip()
        out["positions"] = [int(p) for p in pos.split(",")] if _INT_RE.fullmatch(
            pos.split(",")[0]) else pos
    return out
