"""Decode uploaded steering-vector files (safetensors, .pt, .npy, JSON, GGUF).

Everything a user can upload ends up as one float32 vector of the model's hidden
size, or one such vector per layer (0-based layer index, capsteer's convention).
Any mismatch is a `VectorFormatError` saying what was expected and what was found,
so the HTTP layer can hand the message straight back as a 400.

GGUF control vectors (llama.cpp `--control-vector`, repeng `export_gguf`)
------------------------------------------------------------------------------
Tensors are named `direction.N`. `direction.N` is added to the OUTPUT of the
0-based transformer block N, which is capsteer's `resid_post` of layer N; this
module therefore maps `direction.N` -> `per_layer[N]`, meant for hook
`resid_post` (the request's default hook). What was read to establish this:

- ggml-org/llama.cpp `common/common.cpp`, `common_control_vector_load_one`: the
  index is `stoi` of the text after `direction.`; a negative index and index 0
  make the loader reject the whole file ("invalid (zero) direction tensor layer
  index"); tensors must be F32 and 1-D; `direction.N` is written to buffer offset
  `n_embd * (N - 1)` ("layer 1 at [0]"), and a repeated index is summed.
- ggml-org/llama.cpp `src/llama-adapter.cpp`, `llama_adapter_cvec::apply` fills
  `tensors[il]` from offset `n_embd * (il - 1)` for `il = 1 .. n_layer-1`
  (`tensors[0]` is always null: "there's never a tensor for layer 0"), and
  `tensor_for(il)` / `apply_to` add `tensors[il]` to `cur`. The two `- 1`s cancel:
  `direction.N` lands in `tensors[N]`. `include/llama.h` says the same: the
  buffer is "n_embd x n_layers ... starting from layer 1".
- ggml-org/llama.cpp `src/models/llama.cpp` (and every other model graph): inside
  `for (il = 0; il < n_layer; ++il)`, after the FFN residual add,
  `cur = build_cvec(cur, il); cb(cur, "l_out", il);` -- the block's output, before
  it feeds block il+1 (`src/llama-graph.cpp`: `build_cvec` = `cvec->apply_to`).
- vgel/repeng `repeng/extract.py`: `batched_get_hiddens` reads
  `out.hidden_states[layer + 1]` for key `layer` (HF `hidden_states[i+1]` is the
  output of `layers[i]`); the default `hidden_layers` are
  `range(-1, -num_hidden_layers, -1)`, normalised to `n_layers-1 .. 1`, so layer 0
  is never trained; `export_gguf` writes `direction.{layer}` with those keys,
  `general.architecture = "controlvector"`, `controlvector.model_hint` and
  `controlvector.layer_count`. `repeng/control.py` `ControlModule.forward` adds
  `directions[layer_id]` to the output of `layers[layer_id]`.

So `direction.0` cannot be produced by repeng's defaults and is refused by
llama.cpp; here it is accepted (repeng's meaning, resid_post of layer 0) and
`encode_gguf_control_vector` refuses it unless asked, so files it writes load in
llama.cpp. Byte layout follows ggml-org/ggml `docs/gguf.md` (v2/v3: u64 counts
and string lengths, `general.alignment` default 32, tensor offsets relative to
the aligned start of the data section).
"""

from __future__ import annotations

import io
import json
import math
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from capsteer.config import errors
from capsteer.hooks import describe_widths

FORMATS = ("safetensors", "pt", "npy", "json", "gguf")
_ALIASES = {"pth": "pt", "torch": "pt", "bin": "pt", "numpy": "npy", "st": "safetensors"}
MAX_VECTOR_BYTES = 256 * 1024 * 1024  # one upload; far above any real per-layer set
_MAX_ABS = 1e30  # same bound as steering.spec: larger values overflow the stream anyway

# Tensor / dict-key names that carry a layer number: "3", "layer.3", "layers.3",
# "direction.3", "blocks.3" (also with "_" or "-").
_LAYER_KEY_RE = re.compile(r"(?:(?:layers?|directions?|blocks?)[._-]?)?(\d{1,6})")


class VectorFormatError(errors.InvalidInput, ValueError):
    """An upload that cannot become steering vectors; the message says why."""


class VectorTooLargeError(VectorFormatError):
    """An upload above MAX_VECTOR_BYTES (a 400: api.md §4 calls too many bytes bad input)."""


@dataclass(frozen=True, eq=False)
class DecodedVectors:
    """One vector, or one vector per 0-based layer; arrays are read-only float32."""

    single: np.ndarray | None
    per_layer: Mapping[int, np.ndarray] | None
    source_format: str

    def __post_init__(self) -> None:
        if (self.single is None) == (self.per_layer is None):
            raise ValueError("DecodedVectors needs exactly one of single / per_layer")

    @property
    def kind(self) -> str:
        return "single" if self.single is not None else "per_layer"

    @property
    def width(self) -> int:
        if self.single is not None:
            return int(self.single.shape[0])
        assert self.per_layer is not None
        return int(next(iter(self.per_layer.values())).shape[0])

    def value(self) -> np.ndarray | Mapping[int, np.ndarray]:
        """What a `VectorLookup` returns: the vector, or {layer: vector}."""
        if self.single is not None:
            return self.single
        assert self.per_layer is not None
        return self.per_layer


def normalize_format(fmt: str | None) -> str | None:
    """Canonical format name, or None for "sniff it"; unknown names raise."""
    if fmt is None or fmt == "":
        return None
    key = fmt.strip().lower().lstrip(".")
    key = _ALIASES.get(key, key)
    if key not in FORMATS:
        raise VectorFormatError(f"unknown vector format {fmt!r}; accepted: {', '.join(FORMATS)}")
    return key


def sniff_format(data: bytes) -> str | None:
    """Guess the format from the leading bytes; None when nothing matches."""
    head = bytes(data[:16])
    if head.startswith(b"GGUF"):
        return "gguf"
    if head.startswith(b"\x93NUMPY"):
        return "npy"
    if head.startswith(b"PK\x03\x04") or (len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5):
        return "pt"
    if len(data) >= 10:
        (n,) = struct.unpack_from("<Q", data, 0)
        if 2 <= n <= len(data) - 8 and data[8:9] == b"{":
            return "safetensors"
    stripped = bytes(data[:4096]).lstrip(b" \t\r\n")
    if stripped.startswith(b"\xef\xbb\xbf"):
        stripped = stripped[3:].lstrip(b" \t\r\n")
    if stripped[:1] in (b"[", b"{"):
        return "json"
    return None


def decode_vectors(
    data: bytes, *, hidden_size: int, num_layers: int, fmt: str | None = None,
    widths: Mapping[str, int] | None = None,
) -> DecodedVectors:
    """Decode one upload into validated float32 vectors for a model of this geometry.
    `widths`: the width of each hook the vectors may steer (hooks.width_table; default:
    the hidden size alone); every vector of one upload has one of them, the same one."""
    if len(data) > MAX_VECTOR_BYTES:
        raise VectorTooLargeError(
            f"upload is {len(data)} bytes; the limit is {MAX_VECTOR_BYTES} bytes")
    if not data:
        raise VectorFormatError("upload is empty")
    chosen = normalize_format(fmt) or sniff_format(data)
    if chosen is None:
        raise VectorFormatError(
            "unrecognised vector file: expected safetensors, a torch .pt file, .npy, JSON "
            f"or GGUF (first bytes {bytes(data[:8])!r}); pass the format explicitly if it is one")
    ctx = _Ctx(hidden_size, num_layers, chosen, widths)
    single, per_layer = _DECODERS[chosen](data, ctx)
    return ctx.finish(single, per_layer)


class _Ctx:
    """Model geometry plus the shared checks every format goes through."""

    def __init__(self, hidden: int, layers: int, fmt: str,
                 widths: Mapping[str, int] | None = None) -> None:
        self.hidden, self.layers, self.fmt = hidden, layers, fmt
        self.widths = dict(widths) if widths else {"the hidden size": hidden}
        self.width: int | None = None  # the first vector's: the upload's others match it

    def _expected(self) -> str:
        if self.width is not None:
            return f"width {self.width} (as the upload's other vectors)"
        if set(self.widths.values()) == {self.hidden}:
            return f"width {self.hidden} (the model's hidden size)"
        return ("the width of one of this model's hooks: "
                f"{describe_widths(self.widths, self.hidden)}")

    def vector(self, arr: np.ndarray, where: str) -> np.ndarray:
        arr = np.asarray(arr)
        if arr.dtype.kind not in "fiu":
            raise VectorFormatError(f"{where}: expected numbers, found dtype {arr.dtype}")
        fits = arr.ndim == 1 and (arr.shape[0] == self.width if self.width is not None
                                  else arr.shape[0] in self.widths.values())
        if not fits:
            raise VectorFormatError(
                f"{where}: expected a vector of {self._expected()}, found shape "
                f"{list(arr.shape)}")
        self.width = int(arr.shape[0])
        with np.errstate(over="ignore", invalid="ignore"):
            out = np.array(arr, dtype=np.float32, copy=True)  # own memory, never the upload's
        if not np.isfinite(out).all():
            raise VectorFormatError(
                f"{where}: holds NaN, infinite, or beyond-float32 values; all must be finite")
        if out.size and float(np.abs(out).max()) > _MAX_ABS:
            raise VectorFormatError(f"{where}: holds values beyond {_MAX_ABS:g} in magnitude")
        out.setflags(write=False)
        return out

    def layer(self, index: int, where: str) -> int:
        if not 0 <= index < self.layers:
            raise VectorFormatError(
                f"{where}: layer {index} is out of range; the model has {self.layers} layers "
                f"(0-based, 0..{self.layers - 1})")
        return index

    def array(self, arr: np.ndarray, where: str) -> tuple[np.ndarray | None, dict | None]:
        """A 1-D array is one vector; a 2-D array is one row per layer."""
        arr = np.asarray(arr)
        if arr.ndim == 1:
            return self.vector(arr, where), None
        if arr.ndim == 2:
            if arr.shape[0] != self.layers:
                raise VectorFormatError(
                    f"{where}: a 2-D array needs one row per layer, shape [{self.layers}, "
                    f"width]; found shape {list(arr.shape)}")
            return None, {i: self.vector(arr[i], f"{where}[{i}]") for i in range(self.layers)}
        raise VectorFormatError(
            f"{where}: expected shape [width] or [{self.layers}, width] (width: "
            f"{self._expected()}), "
            f"found shape {list(arr.shape)}")

    def named(self, tensors: Mapping[str, np.ndarray], where: str) -> tuple:
        """Tensors named by layer are per-layer; a lone tensor is a vector or a 2-D stack."""
        if not tensors:
            raise VectorFormatError(f"{where}: holds no tensors")
        keys = {name: _layer_key(name) for name in tensors}
        if all(k is not None for k in keys.values()):
            out: dict[int, np.ndarray] = {}
            for name, arr in tensors.items():
                layer = self.layer(keys[name], f"{where} tensor {name!r}")  # type: ignore[arg-type]
                if layer in out:
                    raise VectorFormatError(f"{where}: layer {layer} appears more than once")
                out[layer] = self.vector(arr, f"{where} tensor {name!r}")
            return None, out
        if len(tensors) == 1:
            ((name, arr),) = tensors.items()
            return self.array(arr, f"{where} tensor {name!r}")
        raise VectorFormatError(
            f"{where}: expected one tensor, or tensors named by layer ('layer.3', 'layers.3', "
            f"'direction.3' or '3'); found names {sorted(tensors)[:8]}")

    def finish(self, single: np.ndarray | None, per_layer: dict | None) -> DecodedVectors:
        if per_layer is not None:
            if not per_layer:
                raise VectorFormatError(f"{self.fmt}: no layer vectors found")
            return DecodedVectors(None, MappingProxyType(dict(sorted(per_layer.items()))),
                                  self.fmt)
        return DecodedVectors(single, None, self.fmt)


def _layer_key(name: object) -> int | None:
    if isinstance(name, int) and not isinstance(name, bool):
        return name
    if isinstance(name, str):
        m = _LAYER_KEY_RE.fullmatch(name.strip())
        if m:
            return int(m.group(1))
    return None


def _first_line(exc: BaseException, limit: int = 200) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:limit]


# --- safetensors -------------------------------------------------------------------

_ST_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4",
              "I16": "<i2", "I8": "i1", "U8": "u1"}


def _st_array(info: Mapping) -> np.ndarray:
    dtype, shape, raw = info["dtype"], list(info["shape"]), bytes(info["data"])
    if dtype == "BF16":
        arr = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    elif dtype in _ST_DTYPES:
        arr = np.frombuffer(raw, dtype=_ST_DTYPES[dtype])
    else:
        raise VectorFormatError(f"safetensors: unsupported dtype {dtype} (use F32, F16 or BF16)")
    return arr.reshape(shape)


def _decode_safetensors(data: bytes, ctx: _Ctx) -> tuple:
    import safetensors

    try:
        items = safetensors.deserialize(bytes(data))
    except Exception as exc:
        raise VectorFormatError(f"not a readable safetensors file: {_first_line(exc)}") from None
    return ctx.named({name: _st_array(info) for name, info in items}, "safetensors")


# --- torch .pt ---------------------------------------------------------------------

def _decode_pt(data: bytes, ctx: _Ctx) -> tuple:
    import pickle

    import torch

    try:
        obj = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except pickle.UnpicklingError:
        raise VectorFormatError(
            ".pt: the file holds Python objects other than tensors; only a tensor, or a "
            "dict/list of tensors, is accepted (objects are never unpickled)") from None
    except Exception as exc:
        raise VectorFormatError(f".pt: torch.load failed: {_first_line(exc)}") from None

    def arr(value: object, where: str) -> np.ndarray:
        if not isinstance(value, torch.Tensor):
            raise VectorFormatError(f"{where}: expected a tensor, found {type(value).__name__}")
        if value.is_complex() or value.dtype == torch.bool:
            raise VectorFormatError(f"{where}: expected real numbers, found {value.dtype}")
        return value.detach().to("cpu", torch.float64 if value.dtype == torch.float64
                                 else torch.float32).numpy()

    if isinstance(obj, torch.Tensor):
        return ctx.array(arr(obj, ".pt"), ".pt")
    if isinstance(obj, Mapping):
        return ctx.named({str(k): arr(v, f".pt key {k!r}") for k, v in obj.items()}, ".pt")
    if isinstance(obj, (list, tuple)):
        return _rows(obj, ctx, ".pt", lambda v, w: ctx.vector(arr(v, w), w))
    raise VectorFormatError(f".pt: expected a tensor or a dict of tensors, found {type(obj).__name__}")


# --- numpy .npy --------------------------------------------------------------------

def _decode_npy(data: bytes, ctx: _Ctx) -> tuple:
    try:
        arr = np.load(io.BytesIO(data), allow_pickle=False)
    except Exception as exc:
        raise VectorFormatError(f".npy: could not load: {_first_line(exc)}") from None
    if not isinstance(arr, np.ndarray):
        raise VectorFormatError(".npy: expected a single array (.npz archives are not accepted)")
    return ctx.array(arr, ".npy")


# --- JSON --------------------------------------------------------------------------

def _json_vector(value: object, ctx: _Ctx, where: str) -> np.ndarray:
    if not isinstance(value, list) or not all(type(v) in (int, float) for v in value):
        raise VectorFormatError(f"{where}: expected a list of numbers")
    try:
        return ctx.vector(np.asarray(value, dtype=np.float64), where)
    except OverflowError:
        raise VectorFormatError(f"{where}: holds a number too large for float64") from None


def _rows(rows: list | tuple, ctx: _Ctx, where: str, conv) -> tuple:
    """A list indexed by layer; null entries skip a layer."""
    if len(rows) != ctx.layers:
        raise VectorFormatError(
            f"{where}: a list of per-layer vectors needs exactly {ctx.layers} entries (one per "
            f"layer, null to skip one); found {len(rows)}")
    out = {i: conv(row, f"{where}[{i}]") for i, row in enumerate(rows) if row is not None}
    return None, out


def _decode_json(data: bytes, ctx: _Ctx) -> tuple:
    try:
        obj = json.loads(bytes(data).decode("utf-8-sig"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise VectorFormatError(f"JSON: not valid JSON: {_first_line(exc)}") from None

    def conv(value: object, where: str) -> np.ndarray:
        return _json_vector(value, ctx, where)

    if isinstance(obj, list):
        if obj and all(v is None or isinstance(v, list) for v in obj):
            return _rows(obj, ctx, "JSON", conv)
        return conv(obj, "JSON"), None
    if isinstance(obj, dict):
        unknown = set(obj) - {"vector", "layers"}
        if unknown or len(obj) != 1:
            raise VectorFormatError(
                'JSON: expected a list of numbers, a list of per-layer lists, {"vector": [...]} '
                f'or {{"layers": {{"3": [...]}}}}; found keys {sorted(obj)}')
        if "vector" in obj:
            return conv(obj["vector"], "JSON.vector"), None
        layers = obj["layers"]
        if isinstance(layers, list):
            return _rows(layers, ctx, "JSON.layers", conv)
        if not isinstance(layers, dict) or not layers:
            raise VectorFormatError('JSON.layers: expected an object {"<layer>": [numbers], ...}')
        out: dict[int, np.ndarray] = {}
        for key, value in layers.items():
            layer = _layer_key(key)
            if layer is None:
                raise VectorFormatError(
                    f"JSON.layers: key {key!r} is not a layer number (0-based, e.g. \"3\")")
            layer = ctx.layer(layer, f"JSON.layers[{key!r}]")
            if layer in out:
                raise VectorFormatError(f"JSON.layers: layer {layer} appears more than once")
            out[layer] = conv(value, f"JSON.layers[{key!r}]")
        return None, out
    raise VectorFormatError(f"JSON: expected a list or an object, found {type(obj).__name__}")


# --- GGUF --------------------------------------------------------------------------

_GGUF_MAGIC = b"GGUF"
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B",
                 10: "<Q", 11: "<q", 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_GGML_F32, _GGML_F16 = 0, 1
_GGUF_DEFAULT_ALIGNMENT = 32
_DIRECTION_RE = re.compile(r"direction\.(\d{1,6})")


class _Reader:
    """Bounds-checked little-endian reads; running off the end is a clear error."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = memoryview(data), 0

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or self.pos + n > len(self.data):
            raise VectorFormatError(
                f"GGUF: truncated or corrupt file (needed {n} bytes for {what} at offset "
                f"{self.pos}, file has {len(self.data)})")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str, what: str) -> int | float:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        n = int(self.unpack("<Q", what + " length"))
        return bytes(self.take(n, what)).decode("utf-8", errors="replace")

    def value(self, vtype: int, what: str, depth: int = 0) -> object:
        """Read one metadata value; arrays are skipped and returned as None."""
        if vtype in _GGUF_SCALARS:
            return self.unpack(_GGUF_SCALARS[vtype], what)
        if vtype == _GGUF_STRING:
            return self.string(what)
        if vtype == _GGUF_ARRAY:
            if depth > 8:
                raise VectorFormatError(f"GGUF: {what}: arrays nested too deeply")
            etype = int(self.unpack("<I", what + " element type"))
            count = int(self.unpack("<Q", what + " element count"))
            if etype in _GGUF_SCALARS:
                self.take(count * struct.calcsize(_GGUF_SCALARS[etype]), what)
            elif etype in (_GGUF_STRING, _GGUF_ARRAY):
                if count > len(self.data):  # every element takes at least one byte
                    raise VectorFormatError(f"GGUF: {what}: array count {count} exceeds the file")
                for _ in range(count):
                    self.value(etype, what, depth + 1)
            else:
                raise VectorFormatError(f"GGUF: {what}: unknown array element type {etype}")
            return None
        raise VectorFormatError(f"GGUF: {what}: unknown metadata value type {vtype}")


def read_gguf(data: bytes) -> tuple[dict[str, object], dict[str, np.ndarray]]:
    """Parse a GGUF v2/v3 file: (scalar/string metadata, {tensor name: float32 array}).

    Only F32 and F16 tensors are decoded (control vectors are F32); arrays in the
    metadata are skipped. Shapes are returned in GGUF order (ne[0] first).
    """
    r = _Reader(data)
    if bytes(r.take(4, "magic")) != _GGUF_MAGIC:
        raise VectorFormatError("GGUF: bad magic (file does not start with b'GGUF')")
    version = int(r.unpack("<I", "version"))
    if version not in (2, 3):
        if version & 0xFFFF == 0 and (version >> 24) in (2, 3):
            raise VectorFormatError("GGUF: big-endian files are not supported")
        raise VectorFormatError(f"GGUF: version {version} is not supported (expected 2 or 3)")
    n_tensors = int(r.unpack("<Q", "tensor count"))
    n_kv = int(r.unpack("<Q", "metadata count"))
    if n_tensors > len(data) or n_kv > len(data):
        raise VectorFormatError("GGUF: corrupt header (counts exceed the file size)")
    meta: dict[str, object] = {}
    for i in range(n_kv):
        key = r.string(f"metadata key {i}")
        vtype = int(r.unpack("<I", f"type of {key!r}"))
        value = r.value(vtype, f"value of {key!r}")
        if value is not None:
            meta[key] = value
    infos = []
    for i in range(n_tensors):
        name = r.string(f"tensor {i} name")
        n_dims = int(r.unpack("<I", f"n_dims of {name!r}"))
        if not 1 <= n_dims <= 8:
            raise VectorFormatError(f"GGUF: tensor {name!r} has {n_dims} dimensions")
        dims = [int(r.unpack("<Q", f"dims of {name!r}")) for _ in range(n_dims)]
        ttype = int(r.unpack("<I", f"type of {name!r}"))
        offset = int(r.unpack("<Q", f"offset of {name!r}"))
        infos.append((name, dims, ttype, offset))
    alignment = meta.get("general.alignment", _GGUF_DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise VectorFormatError(f"GGUF: general.alignment {alignment!r} is not a power of two")
    base = -(-r.pos // alignment) * alignment
    tensors: dict[str, np.ndarray] = {}
    for name, dims, ttype, offset in infos:
        if ttype not in (_GGML_F32, _GGML_F16):
            raise VectorFormatError(
                f"GGUF: tensor {name!r} has ggml type {ttype}; only F32 (0) and F16 (1) are "
                "supported (re-export the control vector as F32)")
        if offset % alignment:
            raise VectorFormatError(f"GGUF: tensor {name!r} offset {offset} is not aligned")
        count = math.prod(dims)
        itemsize = 4 if ttype == _GGML_F32 else 2
        start, end = base + offset, base + offset + count * itemsize
        if end > len(data):
            raise VectorFormatError(
                f"GGUF: truncated file (tensor {name!r} needs bytes {start}..{end}, "
                f"file has {len(data)})")
        raw = np.frombuffer(data, dtype="<f4" if ttype == _GGML_F32 else "<f2",
                            count=count, offset=start)
        tensors[name] = raw.astype(np.float32).reshape(dims[::-1])
    return meta, tensors


def _decode_gguf(data: bytes, ctx: _Ctx) -> tuple:
    _meta, tensors = read_gguf(data)
    if not tensors:
        raise VectorFormatError("GGUF: the file holds no direction tensors")
    out: dict[int, np.ndarray] = {}
    for name, arr in tensors.items():
        m = _DIRECTION_RE.fullmatch(name)
        if m is None:
            raise VectorFormatError(
                f"GGUF: tensor {name!r} is not a control-vector direction (expected 'direction.N')")
        layer = ctx.layer(int(m.group(1)), f"GGUF tensor {name!r}")
        if sum(d > 1 for d in arr.shape) > 1:
            raise VectorFormatError(
                f"GGUF: tensor {name!r} has shape {list(arr.shape)}; a direction is 1-D")
        vec = ctx.vector(arr.reshape(-1), f"GGUF tensor {name!r}")
        # llama.cpp sums repeated indices ("direction.3" and "direction.03"); so do we.
        out[layer] = ctx.vector(out[layer] + vec, f"GGUF tensor {name!r}") if layer in out else vec
    return None, out


def encode_gguf_control_vector(
    per_layer: Mapping[int, np.ndarray], arch: str = "llama", *, allow_layer_zero: bool = False
) -> bytes:
    """Write a GGUF v3 control vector that llama.cpp `--control-vector` and repeng load.

    `per_layer` uses capsteer's 0-based resid_post layers, written as `direction.N`
    (see the module docstring). Metadata mirrors repeng's exporter:
    `general.architecture = "controlvector"`, `controlvector.model_hint = arch`
    (the model family, e.g. "llama"), `controlvector.layer_count` (u32).
    Layer 0 is refused unless `allow_layer_zero`, because llama.cpp rejects it.
    """
    if not per_layer:
        raise ValueError("no layers to write")
    layers = sorted(int(k) for k in per_layer)
    if layers[0] < 0 or (layers[0] == 0 and not allow_layer_zero):
        raise ValueError("layer indices must be >= 1 for llama.cpp (it rejects direction.0); "
                         "pass allow_layer_zero=True to write it anyway")
    vecs = [np.ascontiguousarray(per_layer[k], dtype="<f4") for k in layers]
    width = vecs[0].shape
    if any(v.ndim != 1 or v.shape != width for v in vecs) or not width[0]:
        raise ValueError("every direction must be a non-empty 1-D vector of the same width")
    if not all(np.isfinite(v).all() for v in vecs):
        raise ValueError("directions must be finite")

    def gstr(text: str) -> bytes:
        raw = text.encode("utf-8")
        return struct.pack("<Q", len(raw)) + raw

    align = _GGUF_DEFAULT_ALIGNMENT
    kv = [gstr("general.architecture") + struct.pack("<I", _GGUF_STRING) + gstr("controlvector"),
          gstr("controlvector.model_hint") + struct.pack("<I", _GGUF_STRING) + gstr(arch),
          gstr("controlvector.layer_count") + struct.pack("<II", 4, len(layers))]
    nbytes = vecs[0].nbytes
    padded = -(-nbytes // align) * align
    infos = [gstr(f"direction.{k}") + struct.pack("<IQIQ", 1, width[0], _GGML_F32, i * padded)
             for i, k in enumerate(layers)]
    out = bytearray(_GGUF_MAGIC + struct.pack("<IQQ", 3, len(layers), len(kv)))
    for part in (*kv, *infos):
        out += part
    out += b"\x00" * (-len(out) % align)
    for v in vecs:
        out += v.tobytes() + b"\x00" * (padded - nbytes)
    return bytes(out)


_DECODERS = {
    "safetensors": _decode_safetensors,
    "pt": _decode_pt,
    "npy": _decode_npy,
    "json": _decode_json,
    "gguf": _decode_gguf,
}
