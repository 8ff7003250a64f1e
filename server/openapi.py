"""Document capsteer's request and response fields in vLLM's /openapi.json.

vLLM's request models do not know the fields (the middleware removes them before
vLLM parses the body), so the generated schema is extended after the fact.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from capsteer.capture.paths import CAPTURE_ID_RE
from capsteer.capture.spec import DTYPES, LAYOUTS, SPEC_KEYS
from capsteer.hooks import ALIASES, HOOKS, describe_widths, width_table
from capsteer.steering.formats import FORMATS
from capsteer.steering.readers.kinds import ACTIVATIONS
from capsteer.steering.readers.readout import ITEM_KEYS
from capsteer.steering.readers.readout import POSITIONS as READOUT_POSITIONS
from capsteer.steering.registry import NAME_RE
from capsteer.steering.spec import OPS, POSITIONS

_HOOK = {"type": "string", "enum": [*HOOKS, *ALIASES]}
MAX_ABS = 1e30  # steering.spec's and steering.formats' bound on every number
_NUMBER = {"type": "number", "minimum": -MAX_ABS, "maximum": MAX_ABS}
# A steering vector: `document` bounds its length by the served model's hook widths.
VECTOR = {"type": "array", "items": _NUMBER,
          "description": "as many numbers as its hook is wide (hidden_size; mlp_post: d_mlp)"}
# `for_model` bounds these by the served model: its layers, its context.
LAYER = {"type": "integer", "description": "a layer; negative counts from the end"}
POSITION = {"type": "integer",
            "description": "a token position; negative counts back from the prompt's end"}
_LAYERS = {"description": '"all" | [ints] | "a-b" | "a:b"; negative counts from the end',
           "anyOf": [{"type": "string"}, LAYER, {"type": "array", "items": LAYER}]}
CAPTURE = {
    "description": "Capture activations to the server's capture root (api.md §2). "
                   "`true` means the server's default spec.",
    "anyOf": [
        {"type": "boolean"},
        {"type": "object", "additionalProperties": False, "properties": {
            "hooks": {"anyOf": [{"type": "array", "items": _HOOK}, _HOOK,
                                {"type": "object", "propertyNames": _HOOK,
                                 "additionalProperties": _LAYERS}]},
            "layers": _LAYERS,
            "positions": {"description": '"all" | "prompt" | "generated" | "last_prompt" | '
                                         '"last" | [ints] (negative: from the end of the prompt)',
                          "anyOf": [{"type": "string", "enum": ["all", "prompt", "generated",
                                                                "last_prompt", "last"]},
                                    POSITION, {"type": "array", "items": POSITION}]},
            "layout": {"type": "string", "enum": list(LAYOUTS)},
            "dtype": {"type": "string", "enum": list(DTYPES)},
            "tag": {"type": "string", "pattern": "^[A-Za-z0-9._-]{1,64}$"},
        }},
    ],
}
assert set(CAPTURE["anyOf"][1]["properties"]) == set(SPEC_KEYS)
CAPTURE_WAIT = {"type": "boolean", "default": False,
                "description": "Hold the response until the capture is durable "
                               "(bounded by --capture-wait-timeout)."}
WHEN = {
    "type": "object", "description": "Apply the item only at tokens where the reader's score "
    "(same hook and layer, before steering) is above / below the threshold (api.md §7).",
    "required": ["reader"], "additionalProperties": False,
    "oneOf": [{"required": ["above"]}, {"required": ["below"]}],
    "properties": {
        "reader": {"type": "object", "required": ["name"], "additionalProperties": False,
                   "properties": {"name": {"type": "string"}}},
        "index": {"type": "integer", "minimum": 0,
                  "description": "probe output or SAE feature; optional for one output"},
        "above": _NUMBER, "below": _NUMBER,
    },
}
PATCH_ITEM = {
    "type": "object", "description": "Set the value at this hook, layer(s) and positions to "
    "what an earlier capture recorded there (api.md §7, docs/steering.md).",
    "required": ["op", "source"], "additionalProperties": False,
    "not": {"required": ["layer", "layers"]},
    "anyOf": [{"required": ["layer"]}, {"required": ["layers"]}],
    "properties": {
        "op": {"type": "string", "enum": ["patch"]}, "hook": _HOOK, "layer": LAYER,
        "layers": _LAYERS,
        "source": {"type": "object", "required": ["capture_id", "positions"],
                   "additionalProperties": False, "properties": {
                       "capture_id": {"type": "string"},
                       "positions": {"type": "array", "minItems": 1, "uniqueItems": True,
                                     "items": {"type": "integer", "minimum": 0},
                                     "description": "absolute positions, as captured"}}},
    },
}
STEERING = {
    "type": "object", "description": "Steer the residual stream per request (api.md §2), or "
    "patch it from a capture (api.md §7).",
    "required": ["vectors"], "additionalProperties": False,
    "properties": {"vectors": {"type": "array", "items": {"anyOf": [PATCH_ITEM, {
        "type": "object", "required": ["vector"], "additionalProperties": False,
        "not": {"required": ["layer", "layers"]},  # not both, as the server checks
        # one of them, unless the vector is a registered name (a per-layer entry then
        # steers every layer it holds); a clamp needs its value
        "anyOf": [{"required": ["layer"]}, {"required": ["layers"]},
                  {"properties": {"vector": {"type": "object", "required": ["name"]}}}],
        "if": {"required": ["op"], "properties": {"op": {"const": "clamp"}}},
        "then": {"required": ["value"]},
        "properties": {
            "hook": _HOOK, "layer": LAYER, "layers": _LAYERS,
            "vector": {"anyOf": [
                VECTOR,
                {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}},
                {"type": "object", "required": ["b64"], "properties": {
                    "b64": {"type": "string"},
                    "dtype": {"type": "string", "enum": ["float32", "float16", "float64",
                                                         "bfloat16"]}}},
                {"type": "object", "description": "an SAE feature's decoder row (api.md §7)",
                 "required": ["reader", "feature"], "additionalProperties": False,
                 "properties": {"reader": {"type": "string"},
                                "feature": {"type": "integer", "minimum": 0}}}]},
            "when": WHEN,
            "scale": {**_NUMBER, "default": 1.0},
            "op": {"type": "string", "enum": list(OPS), "default": "add"},
            "value": {**_NUMBER, "description": "clamp target"},
            "positions": {"type": "string", "enum": list(POSITIONS), "default": "all"},
        }}]}}},
}
CAPTURE_RESULTS = {
    "type": "object", "description": "Receipt of this request's capture (api.md §3).",
    "properties": {
        "capture_id": {"type": "string"},
        "status": {"type": "string", "enum": ["ok", "pending", "error", "dropped", "rejected"]},
        "dir": {"type": ["string", "null"]}, "layout": {"type": ["string", "null"]},
        "files": {"type": "array", "items": {"type": "string"}},
        "manifest": {"type": ["string", "null"]}, "bytes": {"type": "integer"},
        "positions": {"type": "integer"}, "error": {"type": ["string", "null"]},
    },
}
_INLINE_PROBE = {"type": "object", "required": ["weight"], "properties": {
    "weight": {"description": "[k, hidden] or [hidden]", "type": "array"},
    "bias": {"description": "[k]", "anyOf": [{"type": "array", "items": {"type": "number"}},
                                             {"type": "number"}]},
    "names": {"type": "array", "items": {"type": "string"}},
    "activation": {"type": "string", "enum": list(ACTIVATIONS), "default": "none"}}}
READOUT = {
    "type": "array", "description": "Read scores inside the forward with registered readers "
    "(GET /v1/readers) or an inline probe (api.md §7).",
    "items": {"type": "object", "required": ["reader"], "additionalProperties": False,
              "properties": {
                  "reader": {"anyOf": [{"type": "object", "required": ["name"],
                                        "properties": {"name": {"type": "string"}}},
                                       _INLINE_PROBE]},
                  "hook": _HOOK, "layer": {"type": "integer", "description":
                                           "negative counts from the end; default: the "
                                           "layer an SAE's hook_name records"},
                  "positions": {"anyOf": [{"type": "string", "enum": list(READOUT_POSITIONS)},
                                          {"type": "array", "items": {"type": "integer"}}],
                                "default": "all"},
                  "top_k": {"type": "integer", "minimum": 1, "description": "SAE only"},
                  "threshold": {"type": "number", "default": 0.0,
                                "description": "SAE only: keep features above it"}}}}
assert set(READOUT["items"]["properties"]) == set(ITEM_KEYS)

# ---- capsteer's own endpoints (server/routes.py) ----
_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": "integer"}}}}}
_WHY = {400: "a bad name, id, parameter or body (the error's `param` names it)",
        401: "the admin key is missing or wrong", 404: "no such vector, reader or capture"}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for the OpenAI-shaped errors an endpoint answers."""
    return {status: {"description": _WHY[status],
                     "content": {"application/json": {"schema": _ERROR}}}
            for status in statuses}


def json_body(schema: dict[str, Any], description: str = "Successful Response") -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


VECTOR_NAME = {"pattern": f"^(?!.*\\.tmp$){NAME_RE.pattern}$",
               "description": "1-64 of A-Z a-z 0-9 . _ -, first a letter or digit, not "
                              "ending in .tmp"}
CAPTURE_ID = {"pattern": f"^{CAPTURE_ID_RE.pattern}$"}
PUT_FORMAT = {"enum": [*FORMATS, None], "description": "the upload's format; sniffed from "
              "its first bytes when not given"}
GET_FORMAT = {"enum": ["json", "safetensors", None], "description": "json (default): the "
              "description and values; safetensors: the stored file"}
_NUMBERS = VECTOR
_NULLABLE_NUMBER = {"type": ["number", "null"]}
VECTOR_INFO = {
    "type": "object", "required": ["name", "kind", "hidden_size", "bytes", "error"],
    "properties": {
        "name": {"type": "string"}, "kind": {"enum": ["single", "per_layer", None]},
        "layers": {"type": ["array", "null"], "items": {"type": "integer"}},
        "hidden_size": {"type": ["integer", "null"], "description": "the vectors' width "
                        "(its first name: the same as `width`)"},
        "width": {"type": ["integer", "null"], "description": "the vectors' width: the width "
                  "of the hook they steer"},
        "hooks": {"type": ["array", "null"], "items": {"type": "string"},
                  "description": "this model's hooks of that width (where it can steer)"},
        "source_format": {"type": ["string", "null"]}, "created": _NULLABLE_NUMBER,
        "sha256": {"type": ["string", "null"]}, "bytes": {"type": "integer"},
        "norm": _NULLABLE_NUMBER,
        "norms": {"type": ["object", "null"], "additionalProperties": {"type": "number"}},
        "error": {"type": ["string", "null"],
                  "description": "why this model cannot use the vector, if it cannot"},
    },
}
VECTOR_LIST = {"type": "object", "required": ["object", "data"], "properties": {
    "object": {"const": "list"}, "data": {"type": "array", "items": VECTOR_INFO}}}
VECTOR_DELETED = {"type": "object", "required": ["name", "deleted"], "properties": {
    "name": {"type": "string"}, "deleted": {"const": True}}}
VECTOR_DOWNLOAD = {"description": "the vector's description with its values (`vector`, or "
                                  "`vectors` by layer), or the stored safetensors file",
                   "content": {
                       "application/json": {"schema": {"allOf": [VECTOR_INFO, {
                           "type": "object", "properties": {
                               "vector": _NUMBERS,
                               "vectors": {"type": "object", "additionalProperties": _NUMBERS}}}]}},
                       "application/octet-stream": {"schema": {"type": "string",
                                                               "format": "binary"}}}}
VECTOR_UPLOAD = {"required": True, "description": "The vector file: safetensors, .pt, .npy, "
                 "JSON or a GGUF control vector, at most 256 MiB",
                 "content": {
                     "application/octet-stream": {"schema": {"type": "string",
                                                             "format": "binary"}},
                     "application/json": {"schema": {"anyOf": [
                         _NUMBERS,
                         {"type": "object", "required": ["vector"], "properties": {
                             "vector": _NUMBERS}, "additionalProperties": False},
                         {"type": "object", "required": ["layers"], "properties": {
                             "layers": {"type": "object", "additionalProperties": _NUMBERS}},
                          "additionalProperties": False}]}}}}
HOOKS_INFO = {
    "type": "object",
    "required": ["model", "num_layers", "hidden_size", "dtype", "hook_semantics_version",
                 "hooks", "capture", "steering"],
    "properties": {
        "model": {"type": "string"}, "architecture": {"type": ["string", "null"]},
        "family": {"type": ["string", "null"]}, "family_notes": {"type": ["string", "null"]},
        "num_layers": {"type": "integer"}, "hidden_size": {"type": "integer"},
        "dtype": {"type": "string"}, "hook_semantics_version": {"type": ["string", "integer"]},
        "hooks": {"type": "array", "items": {
            "type": "object", "required": ["name", "aliases", "description", "layers"],
            "properties": {"name": {"type": "string", "enum": list(HOOKS)},
                           "aliases": {"type": "array", "items": {"type": "string"}},
                           "description": {"type": "string"},
                           "hf_reference": {"type": ["string", "null"]},
                           "hf_module": {"type": ["string", "null"]},
                           "transformer_lens": {"type": "string", "description":
                                                "TransformerLens's name (L: the layer)"},
                           "layers": {"type": "array", "items": {"type": "integer"}},
                           "width": {"type": "integer", "description": "numbers per token "
                                     "(hidden_size; mlp_post: d_mlp); a steering vector's "
                                     "length"},
                           "selects": {"type": "string", "description": "the selection a "
                                       "steering item may give on this hook (mlp_post: "
                                       "neurons, attn_z: heads)"},
                           "capture_only": {"type": "boolean", "description": "read "
                                            "only: steering it is a 400 (router_logits)"},
                           "shape": {"type": "array", "items": {"type": "integer"},
                                     "description": "attn_z: [heads, d_head] (its rows are "
                                     "stored flat)"},
                           "unavailable": {"type": "string", "description": "why this "
                                           "model has no such hook (layers is empty)"},
                           "readers": {"type": "array", "items": {"type": "string"},
                                       "description": "registered readers (probes, SAEs) a "
                                       "readout can use on this hook"}}}},
        "capture": {"type": "object"}, "steering": {"type": "object"},
        "readers": {"type": "object"},
    },
}
CAPTURE_RECEIPT: dict[str, Any] = {"allOf": [CAPTURE_RESULTS, {
    "type": "object", "required": ["capture_id", "status"]}, {
    "type": "object", "properties": {
        "timings": {"type": "object", "additionalProperties": {"type": "number"}},
        "manifest_data": {"type": "object", "description": "manifest.json (api.md §5)"}}}]}

REQUEST_FIELDS = {"capture": CAPTURE, "capture_wait": CAPTURE_WAIT, "steering": STEERING,
                  "readout": READOUT,
                  "extra_body": {"type": "object", "description":
                                 "Accepted for curl users copying SDK code: its fields are "
                                 "read as if given at the top level."}}
_GENERATION = {"/v1/chat/completions": ("ChatCompletionRequest", "ChatCompletionResponse"),
               "/v1/completions": ("CompletionRequest", "CompletionResponse")}


# capture_wait: true holds the response for a capture, so it needs one (server/fields.py)
WAIT_NEEDS_CAPTURE = {
    "if": {"required": ["capture_wait"], "properties": {"capture_wait": {"const": True}}},
    "then": {"required": ["capture"], "properties": {"capture": {"not": {"const": False}}}}}


def extend_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """Add the capsteer fields to the chat/completions request and response schemas."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for request_name, response_name in _GENERATION.values():
        if request_name in components:
            components[request_name].setdefault("properties", {}).update(REQUEST_FIELDS)
            components[request_name].setdefault("allOf", []).append(WAIT_NEEDS_CAPTURE)
        if response_name in components:
            components[response_name].setdefault("properties", {})["capture_results"] = \
                CAPTURE_RESULTS
    return schema


def for_model(schema: dict[str, Any], hidden_size: int, num_layers: int,
              max_model_len: int, widths: Mapping[str, int] | None = None) -> dict[str, Any]:
    """A copy of `schema` with the served model's bounds: a steering vector's width (from
    the narrowest to the widest hook steering may name: `widths`, hooks.width_table's,
    default the hidden size alone), the layer indices, the positions a context holds; so
    a client (or a schema-driven test) can tell what this server takes."""
    widths = dict(widths) if widths else {"resid_post": hidden_size}
    low, high = min(widths.values()), max(widths.values())
    text = (f"{hidden_size} numbers (the model's hidden size)" if low == high == hidden_size
            else f"as many numbers as the item's hook is wide: "
                 f"{describe_widths(widths, hidden_size)}")
    bounds = [(VECTOR, {"minItems": low, "maxItems": high, "description": text}),
              (LAYER, {"minimum": -num_layers, "maximum": num_layers - 1}),
              (POSITION, {"minimum": -max_model_len, "maximum": max_model_len - 1})]
    out = copy.deepcopy(schema)
    stack: list[Any] = [out]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            bound = next((extra for marker, extra in bounds if node == marker), None)
            if bound is not None:
                node.update(bound)
                continue
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return out


def document(app: Any) -> None:
    """Wrap the app's schema builder once (FastAPI caches the result)."""
    original = app.openapi

    def openapi() -> dict[str, Any]:
        if getattr(app, "_capsteer_schema", None) is None:
            schema = extend_schema(original())
            state = getattr(app.state, "capsteer", None)
            if state is not None:
                shape = state.shape
                schema = for_model(schema, shape.hidden_size, shape.num_layers,
                                   shape.max_model_len, width_table(
                                       shape.hidden_size, shape.hook_widths,
                                       shape.unavailable, steerable=True))
            app._capsteer_schema = schema
        return app._capsteer_schema

    app.openapi = openapi
