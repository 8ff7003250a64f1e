"""capsteer's own endpoints, mounted on vLLM's app (so its --api-key guard covers them).

- GET /v1/capsteer/hooks: model geometry and the hook vocabulary.
- GET/PUT/DELETE /v1/steering/vectors/{name}, GET /v1/steering/vectors: the registry.
- GET /v1/captures/{capture_id}: a capture's receipt (the manifest is the truth).
"""

from __future__ import annotations

import asyncio
import hmac
import json
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from capsteer.capture.layouts import MANIFEST_FILE
from capsteer.capture.paths import find_capture_dirs, validate_capture_id
from capsteer.capture.receipts import find_receipt, pending
from capsteer.capture.spec import DTYPES, LAYOUTS, POSITION_KINDS, SpecError
from capsteer.engine_ext import families
from capsteer.engine_ext.vllm.topology import ServedModel
from capsteer.hooks import ALIASES, HOOK_SEMANTICS_VERSION, HOOKS
from capsteer.server.errors import error_response, from_exception
from capsteer.server.state import CapsteerState
from capsteer.steering.formats import VectorFormatError
from capsteer.steering.registry import VectorNameError
from capsteer.steering.spec import OPS, POSITIONS

router = APIRouter(tags=["capsteer"])
HOOK_DOCS = {
    "resid_pre": ("stream entering layer L", "hidden_states[L]"),
    "resid_mid": ("stream after attention's residual add, before the MLP", None),
    "resid_post": ("stream leaving layer L (block output; the last layer's is before the "
                   "final norm)", "hidden_states[L+1] for L < last"),
    "attn_out": ("attention sublayer output added to the stream", None),
    "mlp_out": ("MLP sublayer output added to the stream", None),
}
MAX_VECTOR_UPLOAD = 256 << 20


def _state(request: Request) -> CapsteerState:
    return request.app.state.capsteer


_ERROR_SCHEMA = {"application/json": {"schema": {
    "type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type", "code"], "properties": {
            "message": {"type": "string"}, "type": {"type": "string"},
            "param": {"type": ["string", "null"]}, "code": {"type": "integer"}}}}}}}
_WHY = {400: "a bad name, id or body (the error's `param` names it)",
        401: "the admin key is missing or wrong", 404: "no such vector or capture"}


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for the OpenAI-shaped errors an endpoint answers."""
    return {status: {"description": _WHY[status], "content": _ERROR_SCHEMA}
            for status in statuses}


def hook_entries(model: ServedModel) -> list[dict[str, Any]]:
    """Per hook: what it is, the HF module it equals and the layers that have it (none,
    with the reason a request naming it gets, for a hook the model lacks: a parallel
    block's resid_mid)."""
    missing = model.unavailable
    where = families.hf_modules(model.family, parallel="resid_mid" in missing) \
        if model.family else {}
    every = list(range(model.num_layers))
    entries = []
    for h in HOOKS:
        entry = {"name": h, "aliases": [a for a, c in ALIASES.items() if c == h],
                 "description": HOOK_DOCS[h][0], "hf_reference": HOOK_DOCS[h][1],
                 "hf_module": where.get(h), "layers": [] if h in missing else every}
        if h in missing:
            entry["unavailable"] = missing[h]
        entries.append(entry)
    return entries


@router.get("/v1/capsteer/hooks")
async def hooks(request: Request) -> dict[str, Any]:
    """Model geometry and what can be captured and steered."""
    state = _state(request)
    model = state.model
    return {
        "model": model.name,
        "architecture": model.architecture,
        "family": model.family.name if model.family else None,
        "family_notes": model.family.notes if model.family else None,
        "num_layers": model.num_layers,
        "hidden_size": model.hidden_size,
        "dtype": str(model.dtype).removeprefix("torch."),
        "hook_semantics_version": HOOK_SEMANTICS_VERSION,
        "hooks": hook_entries(model),
        "capture": {"positions": [k for k in POSITION_KINDS if k != "explicit"] + ["[ints]"],
                    "layouts": list(LAYOUTS), "dtypes": list(DTYPES),
                    "default": state.settings.capture_default,
                    "default_layout": state.settings.capture_layout,
                    "overload_policy": state.settings.capture_overload},
        "steering": {"ops": list(OPS), "positions": list(POSITIONS)},
    }


# ---- registry ----
def _check_admin(request: Request) -> JSONResponse | None:
    key = _state(request).settings.admin_key
    if not key:
        return None
    given = request.headers.get("x-admin-key", "")
    if not given or not hmac.compare_digest(given.encode(), key.encode()):
        return error_response(401, "this server needs its admin key in the X-Admin-Key header "
                           "to change the vector registry", "X-Admin-Key")
    return None


@router.get("/v1/steering/vectors")
async def list_vectors(request: Request) -> dict[str, Any]:
    """Every registered vector (no values)."""
    items = await asyncio.to_thread(_state(request).registry.list)
    return {"object": "list", "data": items}


async def _body_up_to(request: Request, limit: int) -> bytes | None:
    """The body, or None once it passes `limit` bytes (read no further: an oversized
    upload is never held whole in memory)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        return None
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > limit:
            return None
    return bytes(data)


@router.put("/v1/steering/vectors/{name}", status_code=201, responses=_errors(400, 401))
async def put_vector(name: str, request: Request, format: str | None = None) -> Response:
    """Register (or replace) a vector. Body: safetensors, .pt, .npy, JSON or a GGUF control
    vector (llama.cpp / repeng), sniffed from its bytes unless `?format=` says."""
    denied = _check_admin(request)
    if denied is not None:
        return denied
    data = await _body_up_to(request, MAX_VECTOR_UPLOAD)
    if data is None:  # api.md §4: too many bytes is a 400 naming the field
        return error_response(400, f"vector upload is over {MAX_VECTOR_UPLOAD} bytes", "body")
    if not data:
        return error_response(400, "empty body: send the vector file as the request body", "body")
    try:
        info = await asyncio.to_thread(_state(request).registry.put, name, data, format)
    except VectorNameError as exc:
        return from_exception(exc, "name")
    except VectorFormatError as exc:
        return from_exception(exc, "vector")
    return JSONResponse(info, status_code=201)


@router.get("/v1/steering/vectors/{name}", responses=_errors(400, 404))
async def get_vector(name: str, request: Request, format: str | None = None) -> Response:
    """A vector's description and values (`?format=safetensors`: the stored file)."""
    registry = _state(request).registry
    try:
        info = await asyncio.to_thread(registry.info, name)
        vectors = await asyncio.to_thread(registry.get, name)
    except VectorNameError as exc:
        return from_exception(exc, "name")
    except KeyError:
        return error_response(404, f"no steering vector named {name!r}", "name")
    except VectorFormatError as exc:
        return from_exception(exc, "name")
    if format == "safetensors":
        path = Path(registry.root) / f"{name}.safetensors"
        return Response(await asyncio.to_thread(path.read_bytes),
                        media_type="application/octet-stream")
    if vectors.single is not None:
        info["vector"] = vectors.single.tolist()
    else:
        info["vectors"] = {str(k): v.tolist() for k, v in sorted(vectors.per_layer.items())}
    return JSONResponse(info)


@router.delete("/v1/steering/vectors/{name}", responses=_errors(400, 401, 404))
async def delete_vector(name: str, request: Request) -> Response:
    denied = _check_admin(request)
    if denied is not None:
        return denied
    try:
        deleted = await asyncio.to_thread(_state(request).registry.delete, name)
    except VectorNameError as exc:
        return from_exception(exc, "name")
    if not deleted:
        return error_response(404, f"no steering vector named {name!r}", "name")
    return JSONResponse({"name": name, "deleted": True})


# ---- receipts ----
@router.get("/v1/captures/{capture_id}", responses=_errors(400, 404))
async def capture_receipt(capture_id: str, request: Request) -> Response:
    """Status, directory, files and the manifest of one capture."""
    state = _state(request)
    try:
        validate_capture_id(capture_id)
    except SpecError as exc:
        return from_exception(exc)
    root = Path(state.settings.capture_dir)
    receipt = await asyncio.to_thread(find_receipt, root, capture_id)
    if receipt is None:
        if state.tracker.is_tracked(capture_id):
            return JSONResponse(pending(capture_id).to_dict())
        return error_response(404, f"no capture {capture_id!r} on this server", "capture_id")
    out = receipt.to_dict()
    dirs = await asyncio.to_thread(find_capture_dirs, root, capture_id)
    if dirs:
        try:
            out["manifest_data"] = json.loads((dirs[0] / MANIFEST_FILE).read_text())
        except (OSError, ValueError):
            pass
    return JSONResponse(out)
