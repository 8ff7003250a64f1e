"""Document capsteer's request and response fields in vLLM's /openapi.json.

vLLM's request models do not know the fields (the middleware removes them before
vLLM parses the body), so the generated schema is extended after the fact.
"""

from __future__ import annotations

from typing import Any

from capsteer.capture.spec import DTYPES, LAYOUTS, SPEC_KEYS
from capsteer.hooks import ALIASES, HOOKS
from capsteer.steering.readers.kinds import ACTIVATIONS
from capsteer.steering.readers.readout import ITEM_KEYS
from capsteer.steering.readers.readout import POSITIONS as READOUT_POSITIONS
from capsteer.steering.spec import OPS, POSITIONS

_HOOK = {"type": "string", "enum": [*HOOKS, *ALIASES]}
_LAYERS = {"description": '"all" | [ints] | "a-b" | "a:b"; negative counts from the end',
           "anyOf": [{"type": "string"}, {"type": "integer"},
                     {"type": "array", "items": {"type": "integer"}}]}
CAPTURE = {
    "description": "Capture activations to the server's capture root (api.md §2). "
                   "`true` means the server's default spec.",
    "anyOf": [
        {"type": "boolean"},
        {"type": "object", "additionalProperties": False, "properties": {
            "hooks": {"anyOf": [{"type": "array", "items": _HOOK}, _HOOK,
                                {"type": "object", "additionalProperties": _LAYERS}]},
            "layers": _LAYERS,
            "positions": {"description": '"all" | "prompt" | "generated" | "last_prompt" | '
                                         '"last" | [ints] (negative: from the end of the prompt)',
                          "anyOf": [{"type": "string", "enum": ["all", "prompt", "generated",
                                                                "last_prompt", "last"]},
                                    {"type": "integer"},
                                    {"type": "array", "items": {"type": "integer"}}]},
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
STEERING = {
    "type": "object", "description": "Steer the residual stream per request (api.md §2).",
    "required": ["vectors"], "additionalProperties": False,
    "properties": {"vectors": {"type": "array", "items": {
        "type": "object", "required": ["vector"],
        "not": {"required": ["layer", "layers"]},  # one of them, as the server checks
        "properties": {
            "hook": _HOOK, "layer": {"type": "integer"}, "layers": _LAYERS,
            "vector": {"anyOf": [
                {"type": "array", "items": {"type": "number"}},
                {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}},
                {"type": "object", "required": ["b64"], "properties": {
                    "b64": {"type": "string"},
                    "dtype": {"type": "string", "enum": ["float32", "float16", "float64",
                                                         "bfloat16"]}}}]},
            "scale": {"type": "number", "default": 1.0},
            "op": {"type": "string", "enum": list(OPS), "default": "add"},
            "value": {"type": "number", "description": "clamp target"},
            "positions": {"type": "string", "enum": list(POSITIONS), "default": "all"},
        }}}},
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
REQUEST_FIELDS = {"capture": CAPTURE, "capture_wait": CAPTURE_WAIT, "steering": STEERING,
                  "extra_body": {"type": "object", "description":
                                 "Accepted for curl users copying SDK code: its fields are "
                                 "read as if given at the top level."}}
_GENERATION = {"/v1/chat/completions": ("ChatCompletionRequest", "ChatCompletionResponse"),
               "/v1/completions": ("CompletionRequest", "CompletionResponse")}


def extend_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """Add the capsteer fields to the chat/completions request and response schemas."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for request_name, response_name in _GENERATION.values():
        if request_name in components:
            components[request_name].setdefault("properties", {}).update(REQUEST_FIELDS)
        if response_name in components:
            components[response_name].setdefault("properties", {})["capture_results"] = \
                CAPTURE_RESULTS
    return schema


def document(app: Any) -> None:
    """Wrap the app's schema builder once (FastAPI caches the result)."""
    original = app.openapi

    def openapi() -> dict[str, Any]:
        if getattr(app, "_capsteer_schema", None) is None:
            app._capsteer_schema = extend_schema(original())
        return app._capsteer_schema

    app.openapi = openapi
