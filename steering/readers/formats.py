"""Decode linear-probe uploads: safetensors, .npz, .npy, torch .pt and JSON.

A probe is `weight [k, d]` (or `[d]`, one output), an optional `bias [k]` (or a
scalar for one output), optional per-output `names` and an `activation`. The
arrays may also carry scikit-learn's names, `coef_` / `intercept_` (and
`classes_`, which become the names: for a binary classifier the single output is
`classes_[1]`, the class a positive score means, as in `decision_function`).
Every mismatch is a `ReaderFormatError` whose `param` names the field
(`weight`, `bias`, `names`, `activation`), so the route hands it back as a 400.
"""

from __future__ import annotations

import io
import json
import struct
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from capsteer.config import errors
from capsteer.hooks import describe_widths
from capsteer.steering.formats import _st_array  # the vector decoder's safetensors dtypes
from capsteer.steering.readers.kinds import ACTIVATIONS

FORMATS = ("safetensors", "npz", "npy", "pt", "json", "tar", "zip")
PROBE_FORMATS = ("safetensors", "npz", "npy", "pt", "json")
_ALIASES = {"st": "safetensors", "pth": "pt", "torch": "pt", "bin": "pt", "numpy": "npy",
            "tgz": "tar", "tar.gz": "tar", "gz": "tar"}
MAX_PROBE_BYTES = 256 * 1024 * 1024  # as steering vectors: far above any real probe
MAX_OUTPUTS = 1 << 16
MAX_NAME_CHARS = 256
_MAX_ABS = 1e30  # as steering vectors: anything larger overflows float32 math anyway
_WEIGHT_KEYS = ("weight", "coef_")
_BIAS_KEYS = ("bias", "intercept_")


class ReaderFormatError(errors.InvalidInput, ValueError):
    """An upload that cannot become a reader; `param` names the field at fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ReaderTooLargeError(ReaderFormatError):
    """An upload (or an archive member) over the size limits (a 400, as for vectors)."""


@dataclass(frozen=True, eq=False)
class DecodedProbe:
    """A checked probe as float32 numpy arrays (read-only)."""

    weight: np.ndarray  # [k, d]
    bias: np.ndarray  # [k]
    activation: str
    names: tuple[str, ...] | None
    source_format: str


def normalize_format(fmt: str | None) -> str | None:
    """Canonical format name, or None for "sniff it"; unknown names raise."""
    if not fmt:
        return None
    key = fmt.strip().lower().lstrip(".")
    key = _ALIASES.get(key, key)
    if key not in FORMATS:
        raise ReaderFormatError(f"unknown reader format {fmt!r}; accepted: {', '.join(FORMATS)}",
                                "format")
    return key


def sniff_format(head: bytes, zip_names: list[str] | None = None) -> str | None:
    """Guess the format from the leading bytes (and a zip's member names)."""
    if head.startswith(b"\x93NUMPY"):
        return "npy"
    if head.startswith(b"\x1f\x8b") or head[257:262] == b"ustar":
        return "tar"
    if head.startswith(b"PK\x03\x04") or head.startswith(b"PK\x05\x06"):
        names = zip_names or []
        if any(n.rsplit("/", 1)[-1] == "cfg.json" for n in names):
            return "zip"
        if any(n.endswith("data.pkl") for n in names):
            return "pt"
        if names and all(n.endswith(".npy") for n in names):
            return "npz"
        return "zip"
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return "pt"
    if len(head) >= 10:
        (n,) = struct.unpack_from("<Q", head, 0)
        if 2 <= n and head[8:9] == b"{":
            return "safetensors"
    stripped = head.lstrip(b" \t\r\n").removeprefix(b"\xef\xbb\xbf").lstrip(b" \t\r\n")
    if stripped[:1] == b"{":
        return "json"
    return None


def zip_member_names(source: bytes | Path) -> list[str]:
    """Member names of a zip upload, bytes or a file ([] when it is not a readable zip)."""
    try:
        with zipfile.ZipFile(io.BytesIO(source) if isinstance(source, bytes) else source) as zf:
            return zf.namelist()[:10_000]
    except (zipfile.BadZipFile, OSError, ValueError):
        return []


def decode_probe(data: bytes, *, hidden_size: int, fmt: str,
                 activation: str | None = None,
                 widths: Mapping[str, int] | None = None) -> DecodedProbe:
    """Decode one probe upload (format already chosen) for a model of this width.

    `activation` (the request's `?activation=`) wins over one the file names; `widths`
    (hooks.width_table) are the widths it may read (default: the hidden size alone).
    """
    if len(data) > MAX_PROBE_BYTES:
        raise ReaderTooLargeError(
            f"probe upload is {len(data)} bytes; the limit is {MAX_PROBE_BYTES}", "body")
    if fmt not in PROBE_FORMATS:
        raise ReaderFormatError(f"{fmt} is not a probe format", "format")
    arrays, meta = _DECODERS[fmt](data)
    return check_probe(arrays, meta, hidden_size=hidden_size, source_format=fmt,
                       activation=activation, widths=widths)


def check_probe(arrays: Mapping[str, object], meta: Mapping[str, object], *, hidden_size: int,
                source_format: str, activation: str | None = None,
                widths: Mapping[str, int] | None = None) -> DecodedProbe:
    """Validate `weight`/`coef_`, `bias`/`intercept_`, names and activation. `widths`:
    each hook the probe may read with its width (hooks.width_table); its `d` is one of
    them (default: the hidden size)."""
    weight_raw = _pick(arrays, _WEIGHT_KEYS, "weight")
    if weight_raw is None:
        raise ReaderFormatError(
            f"{source_format}: no probe weight found; expected `weight` (or scikit-learn's "
            f"`coef_`), found {sorted(arrays)[:8]}", "weight")
    weight = _finite(weight_raw, "weight")
    if weight.ndim == 1:
        weight = weight[None, :]
    allowed = set(widths.values()) if widths else {hidden_size}
    if weight.ndim != 2 or weight.shape[1] not in allowed:
        shape = list(np.shape(weight_raw))
        if allowed == {hidden_size}:
            raise ReaderFormatError(
                f"weight has shape {shape}; expected [k, {hidden_size}] or [{hidden_size}] "
                f"({hidden_size} is the model's hidden size)", "weight")
        assert widths is not None
        raise ReaderFormatError(
            f"weight has shape {shape}; expected [k, d] or [d] with d the width of a hook it "
            f"reads: {describe_widths(widths, hidden_size)}", "weight")
    k = weight.shape[0]
    if not 1 <= k <= MAX_OUTPUTS:
        raise ReaderFormatError(f"weight has {k} outputs; 1..{MAX_OUTPUTS} allowed", "weight")
    bias_raw = _pick(arrays, _BIAS_KEYS, "bias")
    if bias_raw is None:
        bias = np.zeros(k, np.float32)
    else:
        bias = _finite(bias_raw, "bias").reshape(-1)
        if bias.shape != (k,):
            raise ReaderFormatError(
                f"bias has shape {list(np.shape(bias_raw))}; expected [{k}] (one per output)",
                "bias")
    chosen = activation if activation is not None else meta.get("activation", "none")
    if chosen is None:
        chosen = "none"
    if chosen not in ACTIVATIONS:
        raise ReaderFormatError(
            f"activation {chosen!r} is not one of {', '.join(ACTIVATIONS)}", "activation")
    names = _names(meta.get("names"), arrays.get("classes_"), k)
    weight.setflags(write=False)
    bias.setflags(write=False)
    return DecodedProbe(weight, bias, str(chosen), names, source_format)


def _pick(arrays: Mapping[str, object], keys: tuple[str, ...], field: str) -> object | None:
    found = [key for key in keys if key in arrays]
    if len(found) > 1:
        raise ReaderFormatError(f"both {found[0]!r} and {found[1]!r} given; send one", field)
    return arrays[found[0]] if found else None


def _finite(value: object, field: str) -> np.ndarray:
    """A float32 copy of `value`; non-numbers and non-finite values are a 400 on `field`."""
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError):
        raise ReaderFormatError(f"{field}: expected an array of numbers", field) from None
    if arr.dtype.kind not in "fiu":
        raise ReaderFormatError(f"{field}: expected numbers, found dtype {arr.dtype}", field)
    with np.errstate(over="ignore", invalid="ignore"):
        out = np.array(arr, dtype=np.float32, copy=True)
    if not np.isfinite(out).all():
        raise ReaderFormatError(
            f"{field}: holds NaN, infinite or beyond-float32 values; all must be finite", field)
    if out.size and float(np.abs(out).max()) > _MAX_ABS:
        raise ReaderFormatError(f"{field}: holds values beyond {_MAX_ABS:g} in magnitude", field)
    return out


def _names(names: object, classes: object, k: int) -> tuple[str, ...] | None:
    """Per-output names: explicit `names`, else scikit-learn's `classes_`, else none."""
    if names is None and classes is not None:
        labels = [str(c) for c in np.asarray(classes).reshape(-1).tolist()]
        if k == 1 and len(labels) == 2:  # binary: the one score is for classes_[1]
            return (labels[1],)
        return tuple(labels) if len(labels) == k else None
    if names is None:
        return None
    if isinstance(names, np.ndarray):
        names = names.reshape(-1).tolist()
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise ReaderFormatError("names: expected a list of strings", "names")
    if len(names) != k:
        raise ReaderFormatError(f"names has {len(names)} entries for {k} outputs", "names")
    if any(len(n) > MAX_NAME_CHARS for n in names):
        raise ReaderFormatError(f"names: each at most {MAX_NAME_CHARS} characters", "names")
    return tuple(names)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:200]


# --- decoders: bytes -> ({array name: array}, {"names": ..., "activation": ...}) ------

def _decode_safetensors(data: bytes) -> tuple[dict, dict]:
    import safetensors

    try:
        items = safetensors.deserialize(bytes(data))
        (n,) = struct.unpack_from("<Q", data, 0)
        header = json.loads(bytes(data[8:8 + n]))
    except Exception as exc:
        raise ReaderFormatError(f"not a readable safetensors file: {_first_line(exc)}",
                                "body") from None
    arrays = {name: _st_array(info) for name, info in items}
    meta = dict(header.get("__metadata__") or {}) if isinstance(header, dict) else {}
    out_meta: dict[str, object] = {}
    if "activation" in meta:
        out_meta["activation"] = meta["activation"]
    if "names" in meta:
        try:
            out_meta["names"] = json.loads(meta["names"])
        except ValueError:
            raise ReaderFormatError("names: the safetensors metadata `names` is not a JSON "
                                    "list of strings", "names") from None
    return arrays, out_meta


def _decode_npz(data: bytes) -> tuple[dict, dict]:
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            arrays = {key: npz[key] for key in npz.files}
    except Exception as exc:
        raise ReaderFormatError(f".npz: could not load (object arrays are refused): "
                                f"{_first_line(exc)}", "body") from None
    meta: dict[str, object] = {}
    for key in ("names", "activation"):
        if key in arrays:
            value = arrays.pop(key)
            meta[key] = value.item() if value.ndim == 0 else value
    return arrays, meta


def _decode_npy(data: bytes) -> tuple[dict, dict]:
    try:
        arr = np.load(io.BytesIO(data), allow_pickle=False)
    except Exception as exc:
        raise ReaderFormatError(f".npy: could not load: {_first_line(exc)}", "body") from None
    return {"weight": arr}, {}


def _decode_pt(data: bytes) -> tuple[dict, dict]:
    import pickle

    import torch  # a torch file needs torch to read; everything else here is numpy

    try:
        obj = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except pickle.UnpicklingError:
        raise ReaderFormatError(".pt: the file holds Python objects other than tensors; only a "
                                "tensor or a dict of tensors is accepted", "body") from None
    except Exception as exc:
        raise ReaderFormatError(f".pt: torch.load failed: {_first_line(exc)}", "body") from None
    if isinstance(obj, torch.Tensor):
        obj = {"weight": obj}
    if not isinstance(obj, Mapping):
        raise ReaderFormatError(f".pt: expected a dict of tensors, found {type(obj).__name__}",
                                "body")
    arrays: dict[str, object] = {}
    for key, value in obj.items():
        if not isinstance(value, torch.Tensor) or value.is_complex():
            raise ReaderFormatError(f".pt: {key!r} is not a real tensor", "weight")
        arrays[str(key)] = value.detach().to("cpu", torch.float64).numpy()
    return arrays, {}


def _decode_json(data: bytes) -> tuple[dict, dict]:
    try:
        obj = json.loads(bytes(data).decode("utf-8-sig"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ReaderFormatError(f"JSON: not valid JSON: {_first_line(exc)}", "body") from None
    if not isinstance(obj, dict):
        raise ReaderFormatError('JSON: expected an object {"weight": [[...]], "bias": [...]}',
                                "body")
    allowed = {*_WEIGHT_KEYS, *_BIAS_KEYS, "names", "activation", "classes_"}
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise ReaderFormatError(f"JSON: unknown keys {unknown}; accepted: {sorted(allowed)}",
                                unknown[0])
    arrays: dict[str, object] = {}
    for key in (*_WEIGHT_KEYS, *_BIAS_KEYS, "classes_"):
        if key in obj:
            arrays[key] = _json_numbers(obj[key], key)
    meta = {key: obj[key] for key in ("names", "activation") if key in obj}
    return arrays, meta


def _json_numbers(value: object, key: str) -> object:
    if key == "classes_":
        return np.asarray(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return np.asarray([value], dtype=np.float64)
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (ValueError, TypeError, OverflowError):
        raise ReaderFormatError(f"{key}: expected a list (of lists) of numbers", key) from None
    return arr


_DECODERS = {"safetensors": _decode_safetensors, "npz": _decode_npz, "npy": _decode_npy,
             "pt": _decode_pt, "json": _decode_json}
