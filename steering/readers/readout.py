"""Parse the request's `readout` field (api.md §7) into checked items.

```json
"readout": [
  {"reader": {"name": "deception"}, "hook": "resid_post", "layer": 12, "positions": "generated"},
  {"reader": {"name": "sae-12-16k"}, "layer": 12, "top_k": 8, "threshold": 0.5},
  {"reader": {"weight": [[...]], "bias": [...], "activation": "sigmoid"}, "layer": -1}
]
```

Each item names a registered reader (`{"name": ...}`) or carries an inline probe
(the JSON probe body of `PUT /v1/readers/{name}`). `hook` defaults to the hook an
SAE records (SAELens's `hook_name`, `blocks.L.hook_X`), else `resid_post`; `layer`
defaults to that hook name's layer and is otherwise required. `positions` is `all`
(default), `prompt`, `generated` or explicit ints (as capture's: the whole sequence,
negatives back from the prompt's end). `top_k` (default min(16, d_sae)) and
`threshold` (default 0: active features only) are for SAEs. Every error is a
`ReadoutSpecError` whose `param` is the field path, e.g. `readout[0].top_k`.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from capsteer.capture.spec import PositionSpec, SpecError, parse_positions
from capsteer.config import errors
from capsteer.hooks import (
    READOUT,
    HookNameError,
    canonical_hook,
    hook_use,
    hook_width_text,
    parse_tl_hook_name,
    resolve_layer,
)
from capsteer.steering.readers.formats import ReaderFormatError, check_probe
from capsteer.steering.readers.kinds import LinearProbe, Reader
from capsteer.steering.readers.registry import ReaderRegistry, ReaderShape

POSITIONS = ("all", "prompt", "generated")
ITEM_KEYS = ("reader", "hook", "layer", "positions", "top_k", "threshold")
MAX_ITEMS = 64
DEFAULT_TOP_K = 16
_INLINE_KEYS = {"weight", "coef_", "bias", "intercept_", "names", "activation", "classes_"}

# name -> the reader's shape; KeyError for an unknown name (ReaderRegistry.lookup).
ReaderLookup = Callable[[str], ReaderShape]


class ReadoutSpecError(errors.InvalidInput, ValueError):
    """Invalid `readout` input; `param` is the field path (`readout[0].top_k`)."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = self.param = field
        self.reason = reason


@dataclass(frozen=True, eq=False)
class ReadoutItem:
    """One checked readout item: which reader, where, on which tokens."""

    index: int  # position in the request's list (results come back in this order)
    reader: ReaderShape
    probe: LinearProbe | None  # an inline probe's tensors; None: load `reader.name`
    hook: str
    layer: int
    positions: PositionSpec
    top_k: int | None  # SAE only
    threshold: float | None  # SAE only

    def to_dict(self) -> dict:
        """Plain-JSON wire form (an inline probe's tensors as base64 float32)."""
        out: dict = {"index": self.index, "hook": self.hook, "layer": self.layer,
                     "positions": self.positions.to_json(), "top_k": self.top_k,
                     "threshold": self.threshold,
                     "reader": {"name": self.reader.name, "kind": self.reader.kind,
                                "d_in": self.reader.d_in, "outputs": self.reader.outputs,
                                "sha256": self.reader.sha256,
                                "hook_name": self.reader.hook_name}}
        if self.probe is not None:
            out["probe"] = {"weight": _b64(self.probe.weight), "bias": _b64(self.probe.bias),
                            "activation": self.probe.activation,
                            "names": list(self.probe.names) if self.probe.names else None}
        return out

    @classmethod
    def from_dict(cls, d: Mapping) -> ReadoutItem:
        r = d["reader"]
        shape = ReaderShape(r["name"], r["kind"], int(r["d_in"]), int(r["outputs"]),
                            r["sha256"], r.get("hook_name"))
        probe = None
        if d.get("probe") is not None:
            p = d["probe"]
            weight = _unb64(p["weight"]).reshape(shape.outputs, shape.d_in)
            names = tuple(p["names"]) if p.get("names") else None
            probe = LinearProbe(weight, _unb64(p["bias"]), p["activation"], names)
        return cls(int(d["index"]), shape, probe, d["hook"], int(d["layer"]),
                   parse_positions(d["positions"]), d.get("top_k"), d.get("threshold"))


def reader_of(item: ReadoutItem, registry: ReaderRegistry | None) -> Reader:
    """The tensors an item reads with: its inline probe, or the registered reader it was
    checked against (a reader replaced since then is a ReaderRegistryError, not a
    silent switch)."""
    if item.probe is not None:
        return item.probe
    if registry is None or item.reader.name is None:
        raise ReadoutSpecError(f"readout[{item.index}].reader.name",
                               "no reader registry to load it from")
    return registry.get(item.reader.name, sha256=item.reader.sha256)


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.detach().to("cpu", torch.float32).numpy().astype("<f4")
                            .tobytes()).decode()


def _unb64(text: str) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(base64.b64decode(text), dtype="<f4").copy())


def parse_readout(value: object, *, num_layers: int, hidden_size: int,
                  lookup: ReaderLookup | None = None,
                  widths: Mapping[str, int] | None = None) -> list[ReadoutItem]:
    """Check a request's `readout` list against this model and the reader registry.
    `widths`: the hooks not hidden_size wide (mlp_post: d_mlp); a reader reads its hook's."""
    if not isinstance(value, list):
        raise ReadoutSpecError("readout", "expected a list of readout items")
    if not value:
        raise ReadoutSpecError("readout", "empty list; leave `readout` out to read nothing")
    if len(value) > MAX_ITEMS:
        raise ReadoutSpecError("readout", f"at most {MAX_ITEMS} items, got {len(value)}")
    return [_item(i, item, num_layers, hidden_size, lookup, widths or {})
            for i, item in enumerate(value)]


def _item(i: int, item: object, num_layers: int, hidden_size: int,
          lookup: ReaderLookup | None, widths: Mapping[str, int]) -> ReadoutItem:
    at = f"readout[{i}]"
    if not isinstance(item, dict):
        raise ReadoutSpecError(at, "expected an object")
    unknown = sorted(set(item) - set(ITEM_KEYS))
    if unknown:
        raise ReadoutSpecError(f"{at}.{unknown[0]}",
                               f"unknown field; accepted: {', '.join(ITEM_KEYS)}")
    if "reader" not in item:
        raise ReadoutSpecError(f"{at}.reader", 'required: {"name": ...} or an inline probe')
    asked = _hook(item["hook"], f"{at}.hook") if "hook" in item else None
    inline_hook = asked or "resid_post"  # an inline probe records no hook
    shape, probe = _reader(item["reader"], f"{at}.reader", hidden_size, lookup,
                           {inline_hook: widths.get(inline_hook, hidden_size)})
    default_hook, default_layer = _recorded_site(shape.hook_name)
    hook = asked or _hook(default_hook, f"{at}.hook")
    width = widths.get(hook, hidden_size)
    if shape.d_in != width:
        named = isinstance(item["reader"], dict) and "name" in item["reader"]
        what = f"reader {shape.name!r}" if shape.name else "the reader"
        raise ReadoutSpecError(f"{at}.reader" + (".name" if named else ""),
                               f"{what} reads width {shape.d_in}; "
                               + hook_width_text(hook, width, hidden_size))
    if "layer" in item:
        layer = _layer(item["layer"], num_layers, f"{at}.layer")
    elif default_layer is not None and hook == default_hook:
        layer = _layer(default_layer, num_layers, f"{at}.layer")
    else:
        raise ReadoutSpecError(f"{at}.layer", "required (an integer; negative counts from "
                                              "the end)")
    positions = _positions(item.get("positions", "all"), f"{at}.positions")
    top_k = threshold = None
    if shape.kind == "sae":
        top_k = _top_k(item.get("top_k", min(DEFAULT_TOP_K, shape.outputs)), shape.outputs,
                       f"{at}.top_k")
        threshold = _threshold(item.get("threshold", 0.0), f"{at}.threshold")
    else:
        for key in ("top_k", "threshold"):
            if key in item:
                raise ReadoutSpecError(f"{at}.{key}", "applies to SAE readers only; this "
                                                      "reader is a linear probe")
    return ReadoutItem(i, shape, probe, hook, layer, positions, top_k, threshold)


def _reader(value: object, at: str, hidden_size: int, lookup: ReaderLookup | None,
            inline: Mapping[str, int]) -> tuple[ReaderShape, LinearProbe | None]:
    """The item's reader: a registered one's shape, or an inline probe checked against
    `inline` (its hook with that hook's width)."""
    if not isinstance(value, dict) or not value:
        raise ReadoutSpecError(at, 'expected {"name": ...} or an inline probe '
                                   '{"weight": [[...]], "bias": [...]}')
    if "name" in value:
        if len(value) != 1:
            raise ReadoutSpecError(at, 'a named reader is {"name": ...} alone')
        name = value["name"]
        if not isinstance(name, str):
            raise ReadoutSpecError(f"{at}.name", "expected a string")
        if lookup is None:
            raise ReadoutSpecError(f"{at}.name", f"unknown reader {name!r} (this server has "
                                                 "no reader registry)")
        try:
            shape = lookup(name)
        except KeyError:
            raise ReadoutSpecError(f"{at}.name", f"unknown reader {name!r}") from None
        except errors.InvalidInput as exc:
            raise ReadoutSpecError(f"{at}.name", str(exc)) from None
        return shape, None  # its width is checked against its hook's (_item)
    return _inline_probe(value, at, hidden_size, inline)


def _inline_probe(value: dict, at: str, hidden_size: int,
                  widths: Mapping[str, int]) -> tuple[ReaderShape, LinearProbe]:
    unknown = sorted(set(value) - _INLINE_KEYS)
    if unknown:
        raise ReadoutSpecError(f"{at}.{unknown[0]}", "unknown field of an inline probe; "
                                                    f"accepted: name, {', '.join(sorted(_INLINE_KEYS))}")
    arrays: dict[str, object] = {}
    for key in ("weight", "coef_", "bias", "intercept_", "classes_"):
        if key in value:
            arrays[key] = _numbers(value[key], f"{at}.{key}", allow_strings=key == "classes_")
    meta = {key: value[key] for key in ("names", "activation") if key in value}
    try:
        probe = check_probe(arrays, meta, hidden_size=hidden_size, source_format="inline",
                            widths=widths)
    except ReaderFormatError as exc:
        raise ReadoutSpecError(f"{at}.{exc.param or 'weight'}", str(exc)) from None
    reader = LinearProbe(torch.from_numpy(probe.weight.copy()),
                         torch.from_numpy(probe.bias.copy()), probe.activation, probe.names)
    return ReaderShape(None, "probe", reader.d_in, reader.outputs, None), reader


def _numbers(value: object, field: str, *, allow_strings: bool = False) -> np.ndarray:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = [value]
    try:
        return np.asarray(value) if allow_strings else np.asarray(value, dtype=np.float64)
    except (ValueError, TypeError, OverflowError):
        raise ReadoutSpecError(field, "expected a list (of lists) of numbers") from None


def _recorded_site(hook_name: str | None) -> tuple[str, int | None]:
    """The (hook, layer) an SAE records as SAELens's `blocks.L.hook_X` (or TL's
    `blocks.L.ln2.hook_normalized`), if it is ours."""
    found = parse_tl_hook_name(hook_name)
    return found if found is not None else ("resid_post", None)


def _hook(value: object, field: str) -> str:
    try:
        return canonical_hook(value)
    except HookNameError as exc:
        raise ReadoutSpecError(field, str(exc)) from None


def _layer(value: object, num_layers: int, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ReadoutSpecError(field, f"expected an integer, got {value!r}")
    try:
        return resolve_layer(value, num_layers)
    except ValueError as exc:
        raise ReadoutSpecError(field, str(exc)) from None


def _positions(value: object, field: str) -> PositionSpec:
    if isinstance(value, str) and value.strip().lower() not in POSITIONS \
            and not value.strip().lstrip("-").isdigit():
        raise ReadoutSpecError(field, f"unknown positions {value!r}; accepted: "
                                      f"{', '.join(POSITIONS)} or a list of ints")
    try:
        return parse_positions(value)
    except SpecError as exc:
        raise ReadoutSpecError(field, exc.reason) from None


def _top_k(value: object, d_sae: int, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ReadoutSpecError(field, f"expected an integer, got {value!r}")
    if not 1 <= value <= d_sae:
        raise ReadoutSpecError(field, f"top_k must be in 1..{d_sae} (the SAE's d_sae), "
                                      f"got {value}")
    return value


def _threshold(value: object, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value):
        raise ReadoutSpecError(field, f"expected a finite number, got {value!r}")
    return float(value)


def check_readout_request(items: list[ReadoutItem], unavailable: Mapping[str, str], *,
                          captures: bool, one_sequence: bool) -> None:
    """What a readout needs of the rest of its request, checked alike by the server and
    the in-process Engine (ReadoutSpecError naming the field): hooks this model offers for
    reading, no capture beside it, one sequence."""
    for item in items:
        for key in (item.hook, hook_use(item.hook, READOUT)):
            if key in unavailable:
                raise ReadoutSpecError(f"readout[{item.index}].hook", unavailable[key])
    if captures:
        raise ReadoutSpecError("readout", "a request reads out or captures, not both yet: send "
                                          "the capture as a request of its own")
    if not one_sequence:
        raise ReadoutSpecError("n", "readout needs n=1 (one sequence per request)")
