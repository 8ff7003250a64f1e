"""Steering specs: parse and validate the request's `steering` field, normalize it
for `SamplingParams.extra_args`, and derive the prefix-cache salt.

A normalized spec is plain JSON (vectors as base64 float32, or a registry entry's name
and content sha256 that the workers read themselves) so it survives the trip through
`vllm_xargs` and into every worker unchanged.
"""

from __future__ import annotations

import base64
import hashlib
import json
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from capsteer.hooks import (
    HEADS_KEY,
    PROJECTION,
    hook_use,
    hook_width_text,
    parse_item_hook,
    parse_layers,
    resolve_layer,
)
from capsteer.steering.conditions import (
    ConditionError,
    ReaderGetter,
    feature_vector,
    parse_when,
)
from capsteer.steering.patches import (
    PatchGetter,
    PatchOp,
    PatchSpecError,
    check_patches,
    parse_patch_item,
)
from capsteer.steering.selections import SELECTION_FIELDS, SelectionError, parse_selection
from capsteer.steering.values import (  # SteeringSpecError: re-exported
    SteeringSpecError,
    all_numbers,
    check_vector,
    decode_b64,
    finite_number,
)

OPS = ("add", "ablate", "clamp")
POSITIONS = ("all", "prompt", "generated")
_VECTOR_FIELDS = {"hook", "layer", "layers", "vector", "scale", "op", "value", "positions",
                  "when", *SELECTION_FIELDS}

# A registry lookup: name -> one vector [hidden] or per-layer vectors {layer: [hidden]}, or
# those as NamedVectors (then the wire form carries the name, not the floats).
VectorLookup = Callable[[str], "np.ndarray | Mapping[int, np.ndarray] | NamedVectors"]
# A worker's reader of named vectors: (name, content sha256) -> the stored value, or an
# error when the registry no longer holds that content under that name.
VectorResolve = Callable[[str, str], "np.ndarray | Mapping[int, np.ndarray]"]


def vector_digest(vec: np.ndarray) -> str:
    """sha256 of a vector's float32 little-endian bytes: its content's identity."""
    return hashlib.sha256(np.ascontiguousarray(vec, dtype="<f4").tobytes()).hexdigest()


@dataclass(frozen=True, eq=False)
class NamedVectors:
    """A registry entry as a lookup may return it: its value, each vector's digest (keyed
    like the value: None for a single vector) and the entry's content sha256. With it a
    request's wire form names the entry instead of carrying its floats (156 KB a request
    for 28 layers of 1024), and the workers read it from the same registry directory."""

    name: str
    value: np.ndarray | Mapping[int, np.ndarray]
    digests: Mapping[int | None, str]

    @classmethod
    def of(cls, name: str, value: np.ndarray | Mapping[int, np.ndarray]) -> NamedVectors:
        if isinstance(value, Mapping):
            return cls(name, value, {int(k): vector_digest(v) for k, v in value.items()})
        return cls(name, value, {None: vector_digest(value)})

    @cached_property
    def sha256(self) -> str:
        """The entry's content identity (what a worker checks before it steers with it)."""
        items = sorted(self.digests.items(), key=lambda kv: -1 if kv[0] is None else kv[0])
        return hashlib.sha256(json.dumps(items).encode()).hexdigest()

    @cached_property
    def _checked(self) -> dict[int, str | None]:
        return {}  # (width, whose width) -> why the value does not fit (None: it does)


@dataclass(frozen=True)
class VectorSource:
    """A named op's vector in the registry: entry `name` with content `sha256`, its vector
    for `layer` (None: the entry's single vector), whose own digest is `digest`."""

    name: str
    sha256: str
    layer: int | None
    digest: str


@dataclass(frozen=True)
class SteeringOp:
    """One resolved operation at one (hook, layer)."""

    hook: str
    layer: int
    op: str
    vector: np.ndarray  # float32 [width]; unit length for ablate/clamp (a selection's: its mask)
    scale: float
    value: float
    positions: str
    # `when` (steering/conditions.py): the op applies at a token where
    # src . gate + gate_bias > 0 (src: the value at the hook before steering); None: always.
    gate: np.ndarray | None = None  # float32 [hidden]
    gate_bias: float = 0.0
    # Where a named vector came from: the wire form then refers to it (not part of the op's
    # content: the same vector sent inline steers, and shares entries, alike).
    source: VectorSource | None = field(default=None, compare=False)
    # A selection's 0/1 mask over the hook's width (steering/selections.py), or None.
    select: np.ndarray | None = None

    def to_dict(self, vector_index: int, gate_index: int | None = None,
                select_index: int | None = None) -> dict:
        """Wire form: the vector (and the gate's) is a reference into the spec's table of
        distinct vectors; an ungated op's form has no `gate` key."""
        out = {"hook": self.hook, "layer": self.layer, "op": self.op, "scale": self.scale,
               "value": self.value, "positions": self.positions, "vector": vector_index}
        if self.gate is not None:
            out["gate"] = [gate_index, self.gate_bias]
        if self.select is not None:
            out["select"] = select_index
        return out

    @classmethod
    def from_dict(cls, d: Mapping, table: list[np.ndarray]) -> SteeringOp:
        gate = d.get("gate")
        return cls(d["hook"], int(d["layer"]), d["op"], table[int(d["vector"])],
                   float(d["scale"]), float(d["value"]), d["positions"],
                   None if gate is None else table[int(gate[0])],
                   0.0 if gate is None else float(gate[1]),
                   select=table[int(d["select"])] if "select" in d else None)


def _unb64(text: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text), dtype="<f4").astype(np.float32)


def unit_vector(vec: np.ndarray) -> np.ndarray:
    """What ablate and clamp use of a vector (the parser and the workers compute it alike)."""
    return (vec / float(np.linalg.norm(vec))).astype(np.float32)


def _table_entry(entry: str | list, refs: list, stored: dict[int, object],
                 resolve: VectorResolve | None) -> np.ndarray:
    """One vector of a wire form's table: base64 text, or [index into `refs`, layer (None:
    the entry's single vector), 1 if ablate/clamp's unit vector]."""
    if isinstance(entry, str):
        return _unb64(entry)
    if resolve is None:
        raise ValueError("the steering names a registry vector, and no vector registry "
                         "is configured here")
    r, layer, unit = entry
    if r not in stored:
        stored[r] = resolve(str(refs[r]["name"]), str(refs[r]["sha256"]))
    value = stored[r]
    vec = np.asarray(value if layer is None else value[int(layer)], dtype=np.float32)
    return unit_vector(vec) if unit else vec


@dataclass(frozen=True)
class SteeringSpec:
    """All operations of one request, in the order the request listed them; `patches`
    (steering/patches.py) replace values at positions after the ops at their point."""

    ops: tuple[SteeringOp, ...]
    patches: tuple[PatchOp, ...] = ()

    def to_dict(self) -> dict:
        """Wire form, computed once: each distinct vector is encoded once (`vectors_b64`) and
        ops refer to it by index, so steering every layer with one vector stays small on
        its way through the engine to every worker. Callers must not mutate it."""
        return self._wire[0]

    @cached_property
    def _wire(self) -> tuple[dict, str, str]:
        """Vectors by content: the key hashes each distinct vector's digest with the ops, so
        a named vector and the same floats sent inline share entries and prefix cache. A
        named vector's table entry refers to its registry entry (`refs`: name and content
        sha256) instead of carrying it; an inline one is base64 text."""
        index: dict[str, int] = {}  # content digest -> table row
        digests: list[str] = []
        table: list[str | list] = []
        refs: dict[tuple[str, str], int] = {}
        seen: dict[int, tuple[str, bytes | None]] = {}  # id(vector) -> (digest, bytes)
        ops = []
        def row(vec: np.ndarray, src: VectorSource | None, unit: bool) -> int:
            if src is not None and not unit:  # the stored vector itself: digest known
                digest, raw = src.digest, None
            elif id(vec) in seen:  # one array on many layers (`layers: all`)
                digest, raw = seen[id(vec)]
            else:
                raw = vec.astype("<f4").tobytes()
                digest = hashlib.sha256(raw).hexdigest()
                seen[id(vec)] = (digest, raw)
            if digest not in index:
                index[digest] = len(table)
                digests.append(digest)
                if src is not None:
                    ref = refs.setdefault((src.name, src.sha256), len(refs))
                    table.append([ref, src.layer, int(unit)])  # a list: 28+ of them
                else:
                    assert raw is not None  # inline: its bytes were just hashed
                    table.append(base64.b64encode(raw).decode())
            return index[digest]

        for op in self.ops:
            vector = row(op.vector, op.source, op.op in ("ablate", "clamp"))
            ops.append(op.to_dict(vector, None if op.gate is None else row(op.gate, None, False),
                                  None if op.select is None else row(op.select, None, False)))
        # The ops' text once, for the key and the wire text (to_dict's key order is fixed;
        # encoding 28+ op dicts is most of a named request's wire cost).
        ops_text = json.dumps(ops, separators=(",", ":"))
        patched = "".join(p.digest() for p in self.patches)
        digest = hashlib.sha256((json.dumps(digests) + ops_text + patched).encode()).hexdigest()
        body: dict = {"vectors_b64": table, "ops": ops, "key": digest}
        if refs:
            body["refs"] = [{"name": n, "sha256": h} for n, h in refs]
        if self.patches:
            body["patches"] = [p.to_dict() for p in self.patches]
        return body, digest, ops_text

    @cached_property
    def wire_text(self) -> str:
        """The wire form as JSON text, computed once. This is what travels in `extra_args`:
        vLLM deep-copies every request's SamplingParams, and a str is copied by reference,
        where the nested form (one dict per op, 28+ for all layers) cost ~450 us a request
        on the front end's thread (the request's `steering_key` rides beside it, so
        workers that know the spec never parse it)."""
        body, digest, ops_text = self._wire
        compact = (",", ":")
        text = (f'{{"vectors_b64":{json.dumps(body["vectors_b64"], separators=compact)},'
                f'"ops":{ops_text},"key":"{digest}"')
        if "refs" in body:
            text += f',"refs":{json.dumps(body["refs"], separators=compact)}'
        if "patches" in body:
            text += f',"patches":{json.dumps(body["patches"], separators=compact)}'
        return text + "}"

    @classmethod
    def from_wire(cls, wire: Mapping | str, resolve: VectorResolve | None = None) -> SteeringSpec:
        """From either wire form: `to_dict()`'s mapping or `wire_text`. `resolve` reads the
        named vectors it refers to (a worker's registry reader)."""
        return cls.from_dict(json.loads(wire) if isinstance(wire, str) else wire, resolve)

    @classmethod
    def from_dict(cls, d: Mapping, resolve: VectorResolve | None = None) -> SteeringSpec:
        refs, stored = list(d.get("refs", ())), {}
        table = [_table_entry(t, refs, stored, resolve) for t in d.get("vectors_b64", ())]
        return cls(tuple(SteeringOp.from_dict(o, table) for o in d["ops"]),
                   tuple(PatchOp.from_dict(p) for p in d.get("patches", ())))

    @staticmethod
    def key_of(d: Mapping) -> str | None:
        """The sharing key a wire-form spec carries (workers skip decoding known specs)."""
        key = d.get("key")
        return key if isinstance(key, str) else None

    def cache_salt(self) -> str:
        """Equal for identical steering, different otherwise: blocks are shared only then.

        Steering limited to prompt or generated positions depends on where the prompt
        ends, and the same tokens can be prompt in one request and generated in another
        (a follow-up turn): such requests never share blocks.
        """
        salt = "capsteer-steer-" + self.sharing_key[:32]
        if any(op.positions != "all" for op in self.ops):
            salt += "-" + uuid.uuid4().hex
        return salt

    @property
    def sharing_key(self) -> str:
        """Identity of the spec's content (steering-table entries are shared by it)."""
        return self._wire[1]

    @property
    def is_noop(self) -> bool:
        """True when every op is an `add` with scale 0 and nothing is patched (output must
        equal vanilla)."""
        return not self.patches and all(op.op == "add" and op.scale == 0.0 for op in self.ops)


def _parse_layers(item: Mapping, field: str, num_layers: int) -> list[int]:
    if "layer" in item and "layers" in item:
        raise SteeringSpecError(field, "give either 'layer' or 'layers', not both")
    key = "layer" if "layer" in item else "layers"
    raw = item[key]
    if key == "layer" and (isinstance(raw, bool) or not isinstance(raw, int)):
        raise SteeringSpecError(field + ".layer", "must be an integer")
    try:
        return parse_layers(raw, num_layers)
    except ValueError as exc:
        raise SteeringSpecError(f"{field}.{key}", str(exc)) from None


# A resolved item's vectors: {layer: vector}, and {layer: source} for the named ones.
_Resolved = tuple[dict[int, np.ndarray], dict[int, VectorSource]]


def _lookup(raw: Mapping, field: str, lookup: VectorLookup | None) -> tuple[str, object]:
    """(name, what the registry holds under it) for a `{"name": ...}` vector."""
    name = raw["name"]
    if not isinstance(name, str) or not name:
        raise SteeringSpecError(field + ".name", "must be a non-empty string")
    if lookup is None:
        raise SteeringSpecError(field + ".name", "no vector registry is configured")
    try:
        return name, lookup(name)
    except KeyError:
        raise SteeringSpecError(field + ".name", f"unknown vector name {name!r}") from None
    except SteeringSpecError as exc:  # the registry holds it, but this model cannot use it
        raise SteeringSpecError(field + ".name", exc.reason) from None


def _named_vector(name: str, found: object, key: int | None, field: str, width: int,
                  where: str) -> tuple[np.ndarray, VectorSource | None]:
    """One vector of a lookup's answer (`key` None: its single vector), checked against the
    width of the hook it steers (`where` says it), and its source when the answer is a
    NamedVectors (checked once per entry and hook, not per request)."""
    what = f"vector {name!r}"
    if not isinstance(found, NamedVectors):
        return check_vector(np.asarray(found if key is None else found[key]), field,
                             width, where, what), None
    verdicts, at = found._checked, (width, where)
    if at not in verdicts:
        try:
            for vec in (found.value.values() if isinstance(found.value, Mapping)
                        else (found.value,)):
                check_vector(np.asarray(vec), field, width, where, what)
            verdicts[at] = None
        except SteeringSpecError as exc:
            verdicts[at] = exc.reason
    if verdicts[at] is not None:
        raise SteeringSpecError(field, verdicts[at])
    vec = np.asarray(found.value if key is None else found.value[key], dtype=np.float32)
    return vec, VectorSource(found.name, found.sha256, key, found.digests[key])


def _resolve_vectors(
    raw: object, field: str, layers: list[int], hidden: int, lookup: VectorLookup | None,
    where: str | None = None,
) -> _Resolved:
    """One float32 vector per layer (and the sources of named ones); `hidden` is the width
    of the item's hook, which `where` names (hooks.hook_width_text)."""
    if isinstance(raw, list):
        if not raw or not all_numbers(raw):
            raise SteeringSpecError(field, "must be a non-empty list of numbers")
        try:
            values = np.asarray(raw, dtype=np.float64)
        except OverflowError:
            raise SteeringSpecError(field, "holds a number too large for float64") from None
        vec = check_vector(values, field, hidden, where)
        return dict.fromkeys(layers, vec), {}
    if isinstance(raw, Mapping) and "b64" in raw:
        vec = check_vector(decode_b64(raw, field), field, hidden, where)
        return dict.fromkeys(layers, vec), {}
    if isinstance(raw, Mapping) and "name" in raw:
        name, found = _lookup(raw, field, lookup)
        value = found.value if isinstance(found, NamedVectors) else found
        vectors, sources = {}, {}
        if isinstance(value, Mapping):
            missing = [layer for layer in layers if layer not in value]
            if missing:
                raise SteeringSpecError(field + ".name",
                                        f"vector {name!r} has no entry for layer(s) {missing}")
            for layer in layers:
                vectors[layer], src = _named_vector(name, found, layer, field, hidden, where)
                if src is not None:
                    sources[layer] = src
            return vectors, sources
        vec, src = _named_vector(name, found, None, field, hidden, where)
        return dict.fromkeys(layers, vec), (dict.fromkeys(layers, src) if src else {})
    raise SteeringSpecError(field, "must be a list of numbers, {'name': ...} or {'b64': ..., 'dtype': ...}")


def parse_steering_spec(
    obj: object, *, num_layers: int, hidden_size: int, lookup: VectorLookup | None = None,
    max_ops: int = 4096, unavailable: Mapping[str, str] | None = None,
    readers: ReaderGetter | None = None, widths: Mapping[str, int] | None = None,
    patches: PatchGetter | None = None,
) -> SteeringSpec | None:
    """Validate a request's `steering` value; None when it asks for nothing.
    `widths`: the hooks not hidden_size wide (mlp_post: d_mlp), whose vectors have that
    width.
    `unavailable`: hooks the served model does not have, each with the reason its 400
    gives (a parallel block's resid_mid). `readers`: the reader registry's tensors by
    name, for `when` gates and SAE-feature vectors (steering/conditions.py). `patches`:
    the captures `op: patch` items read (steering/patches.py)."""
    if obj is None:
        return None
    if not isinstance(obj, Mapping):
        raise SteeringSpecError("steering", "must be an object with a 'vectors' list")
    unknown = set(obj) - {"vectors"}
    if unknown:
        raise SteeringSpecError("steering", f"unknown field(s) {sorted(unknown)}")
    items = obj.get("vectors")
    if not isinstance(items, list):
        raise SteeringSpecError("steering.vectors", "must be a list")
    ops: list[SteeringOp] = []
    patched: list[PatchOp] = []
    projections: set[tuple[str, int, str]] = set()
    gates: dict[tuple[str, int, str], bytes | None] = {}  # point and class -> its gate
    for i, item in enumerate(items):
        field = f"steering.vectors[{i}]"
        if not isinstance(item, Mapping):
            raise SteeringSpecError(field, "must be an object")
        if item.get("op") == "patch":
            try:
                patched += parse_patch_item(item, field, num_layers=num_layers,
                                            hidden_size=hidden_size, getter=patches,
                                            unavailable=unavailable)
            except PatchSpecError as exc:
                raise SteeringSpecError(exc.field, exc.reason) from None
            continue
        unknown = set(item) - _VECTOR_FIELDS
        if unknown:
            raise SteeringSpecError(field, f"unknown field(s) {sorted(unknown)}")
        hook = parse_item_hook(item, field, unavailable, SteeringSpecError)
        op = item.get("op", "add")
        if op not in OPS:
            raise SteeringSpecError(field + ".op", f"must be one of {', '.join(OPS)}, patch")
        positions = item.get("positions", "all")
        if positions not in POSITIONS:
            raise SteeringSpecError(field + ".positions", f"must be one of {', '.join(POSITIONS)}")
        scale = finite_number(item.get("scale", 1.0), field + ".scale")
        value = finite_number(item.get("value", 0.0), field + ".value")
        if op == "clamp" and "value" not in item:
            raise SteeringSpecError(field + ".value", "clamp needs a 'value'")
        width = int((widths or {}).get(hook, hidden_size))
        where = hook_width_text(hook, width, hidden_size)
        try:
            select = parse_selection(item, field, hook, width, (widths or {}).get(HEADS_KEY))
        except SelectionError as exc:
            raise SteeringSpecError(exc.field, exc.reason) from None
        limit = (unavailable or {}).get(hook_use(hook, PROJECTION))
        if limit is not None and op != "add" and select is None:  # mlp_post/attn_z under TP
            raise SteeringSpecError(field + ".op", limit)
        if limit is not None and "when" in item:
            raise SteeringSpecError(field + ".when", limit)
        if select is not None and op != "add":  # the selected slices are zeroed or set
            if "vector" in item:
                raise SteeringSpecError(field + ".vector", f"{op} with a selection acts on "
                                        "the selected slices: it takes no vector")
            item = {**item, "vector": select.tolist()}
        if "vector" not in item:
            raise SteeringSpecError(field + ".vector", "is required")
        if "layer" not in item and "layers" not in item:
            if not (isinstance(item["vector"], Mapping) and "name" in item["vector"]):
                raise SteeringSpecError(field + ".layer", "is required (or 'layers')")
            layers = None
        else:
            layers = _parse_layers(item, field, num_layers)
        gate = None
        try:
            if "when" in item:
                gate = parse_when(item["when"], field + ".when", width, readers, where)
            if isinstance(item["vector"], Mapping) and "reader" in item["vector"]:
                if layers is None:  # a decoder row is one vector, for any layer
                    raise SteeringSpecError(field + ".layer", "is required (or 'layers')")
                vec = feature_vector(item["vector"], field + ".vector", width, readers, where)
                item = {**item, "vector": vec.tolist()}
        except ConditionError as exc:
            raise SteeringSpecError(exc.field, exc.reason) from None
        if layers is None:
            layers = list(range(num_layers))
            vectors, sources = _resolve_per_layer_name(item["vector"], field + ".vector",
                                                       width, lookup, num_layers, where)
            layers = sorted(vectors)
        else:
            vectors, sources = _resolve_vectors(item["vector"], field + ".vector", layers,
                                                width, lookup, where)
        for layer in layers:
            vec = vectors[layer]
            _check_one_gate(gates, gate, hook, layer, positions, num_layers, field)
            if op in ("ablate", "clamp"):
                if float(np.linalg.norm(vec)) == 0.0:
                    raise SteeringSpecError(field + ".vector", f"{op} needs a non-zero vector")
                vec = vec if select is not None else unit_vector(vec)
                point = ("resid_pre", layer + 1) if (
                    hook == "resid_post" and layer + 1 < num_layers) else (hook, layer)
                for pos in (("prompt", "generated") if positions == "all" else (positions,)):
                    key = (*point, pos)
                    if key in projections:
                        raise SteeringSpecError(
                            field + ".op",
                            f"at most one ablate/clamp per hook, layer and position class "
                            f"({hook}, layer {layer}, {pos})")
                    projections.add(key)
            if vec.dtype != np.float32 or not vec.flags.writeable:  # registry arrays are read-only
                vec = vec.astype(np.float32)
            # one array on many layers stays one object: the wire form hashes it once
            ops.append(SteeringOp(hook, layer, op, vec, scale, value, positions,
                                  *(gate or (None, 0.0)), sources.get(layer), select))
            if len(ops) > max_ops:
                raise SteeringSpecError("steering.vectors", f"more than {max_ops} (vector, layer) ops")
    try:
        check_patches(patched, num_layers)
    except PatchSpecError as exc:
        raise SteeringSpecError(exc.field, exc.reason) from None
    return SteeringSpec(tuple(ops), tuple(patched)) if ops or patched else None


def _check_one_gate(gates: dict, gate: tuple[np.ndarray, float] | None, hook: str, layer: int,
                    positions: str, num_layers: int, field: str) -> None:
    """Ops at one point and position class fold into one map (engine_ext/plan.py), read
    by one gate: they must share their `when` (or all have none)."""
    point = ("resid_pre", layer + 1) if hook == "resid_post" and layer + 1 < num_layers \
        else (hook, layer)
    ident = None if gate is None else gate[0].tobytes() + np.float64(gate[1]).tobytes()
    for pos in (("prompt", "generated") if positions == "all" else (positions,)):
        key = (*point, pos)
        if key in gates and gates[key] != ident:
            raise SteeringSpecError(
                field + ".when", f"items at one hook, layer and position class ({hook}, layer "
                f"{layer}, {pos}) must share one `when` (or all have none): they fold into "
                "one map read by one gate")
        gates[key] = ident


def _resolve_per_layer_name(
    raw: Mapping, field: str, hidden: int, lookup: VectorLookup | None, num_layers: int,
    where: str | None = None,
) -> _Resolved:
    name, found = _lookup(raw, field, lookup)
    value = found.value if isinstance(found, NamedVectors) else found
    if not isinstance(value, Mapping):
        raise SteeringSpecError(field.rsplit(".", 1)[0] + ".layer",
                                "is required: the named vector holds a single vector")
    out, sources = {}, {}
    for layer in value:
        try:
            resolved = resolve_layer(int(layer), num_layers)
        except ValueError as exc:
            raise SteeringSpecError(field + ".name", str(exc)) from None
        out[resolved], src = _named_vector(name, found, layer, field, hidden, where)
        if src is not None:
            sources[resolved] = src
    return out, sources
