"""capsteer's own endpoints, mounted on vLLM's app (so its --api-key guard covers them).

- GET /v1/capsteer/hooks: model geometry and the hook vocabulary.
- GET/PUT/DELETE /v1/steering/vectors/{name}, GET /v1/steering/vectors: the registry.
- GET/PUT/DELETE /v1/readers/{name}, GET /v1/readers: probes and SAEs (api.md §7).
- GET /v1/captures/{capture_id}: a capture's receipt (the manifest is the truth).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import os
import tempfile
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi import Path as PathParam
from fastapi.responses import JSONResponse, Response

from capsteer.capture.layouts import MANIFEST_FILE
from capsteer.capture.paths import find_capture_dirs, validate_capture_id
from capsteer.capture.receipts import find_receipt, pending
from capsteer.capture.spec import DTYPES, LAYOUTS, POSITION_KINDS, SpecError
from capsteer.engine_ext import families
from capsteer.engine_ext.vllm.topology import ServedModel
from capsteer.hooks import (
    ALIASES,
    CAPTURE_ONLY,
    HEADS_KEY,
    HOOK_SEMANTICS_VERSION,
    HOOKS,
    SELECTIONS,
    tl_hook_name,
)
from capsteer.server import openapi as docs
from capsteer.server.errors import error_response, from_exception
from capsteer.server.state import CapsteerState
from capsteer.steering.formats import VectorFormatError
from capsteer.steering.readers.formats import FORMATS as READER_FORMATS
from capsteer.steering.readers.formats import ReaderFormatError
from capsteer.steering.readers.kinds import ACTIVATIONS, ARCHITECTURES
from capsteer.steering.readers.registry import (
    ReaderNameError,
    ReaderNotFoundError,
    ReaderRegistry,
)
from capsteer.steering.readers.sae import MAX_SAE_BYTES
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
    "mlp_in": ("the MLP's normalized input: the pre-MLP norm's output as the MLP reads it "
               "(the transcoder input); steering it changes what the MLP sees, not the "
               "stream", None),
    "mlp_post": ("the MLP's hidden activations after the nonlinearity, [d_mlp] (act(gate) * "
                 "up in a gated MLP): the input of its output projection; steering items may "
                 "select `neurons`", None),
    "attn_z": ("every head's attention output before the heads are mixed, [heads, d_head] "
               "per token (stored flat, heads * d_head): the input of attention's output "
               "projection; steering items may select `heads`", None),
    "router_logits": ("an MoE router's logits, [n_experts] per token (capture and readout "
                      "only)", None),
}
MAX_VECTOR_UPLOAD = 256 << 20


def _state(request: Request) -> CapsteerState:
    return request.app.state.capsteer


# The checks stay the handlers' own (an OpenAI-shaped 400 naming the parameter); the schema
# only says what they accept, so clients and schema-driven tests know it.
VectorName = Annotated[str, PathParam(json_schema_extra=docs.VECTOR_NAME)]
CaptureId = Annotated[str, PathParam(json_schema_extra=docs.CAPTURE_ID)]
PutFormat = Annotated[str | None, Query(json_schema_extra=docs.PUT_FORMAT)]
GetFormat = Annotated[str | None, Query(json_schema_extra=docs.GET_FORMAT)]
GET_FORMATS = ("json", "safetensors")


def _responses(ok: dict[str, Any], *errors: int, status: int = 200,
               ) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries: the success body's schema and the OpenAI-shaped errors."""
    return {status: ok, **docs.errors(*errors)}


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
                 "hf_module": where.get(h), "transformer_lens": tl_hook_name(h, "L"),
                 "layers": [] if h in missing else every,
                 "width": model.hook_widths.get(h, model.hidden_size)}
        if h in SELECTIONS:
            entry["selects"] = SELECTIONS[h]
        if h in CAPTURE_ONLY:
            entry["capture_only"] = True
        if h == "attn_z" and HEADS_KEY in model.hook_widths:
            heads = model.hook_widths[HEADS_KEY]
            entry["shape"] = [heads, entry["width"] // heads]
        if h in missing:
            entry["unavailable"] = missing[h]
        entries.append(entry)
    return entries


@router.get("/v1/capsteer/hooks", responses=_responses(docs.json_body(docs.HOOKS_INFO)))
async def hooks(request: Request) -> dict[str, Any]:
    """Model geometry and what can be captured and steered."""
    state = _state(request)
    model = state.model
    entries = hook_entries(model)
    # Every registered reader reads any hook of its width.
    usable = [r for r in (await asyncio.to_thread(state.readers.list)
                          if state.readers is not None else []) if r["error"] is None]
    for entry in entries:
        entry["readers"] = [r["name"] for r in usable if r["d_in"] == entry["width"]] \
            if entry["layers"] else []
    return {
        "model": model.name,
        "architecture": model.architecture,
        "family": model.family.name if model.family else None,
        "family_notes": model.family.notes if model.family else None,
        "num_layers": model.num_layers,
        "hidden_size": model.hidden_size,
        "dtype": str(model.dtype).removeprefix("torch."),
        "hook_semantics_version": HOOK_SEMANTICS_VERSION,
        "hooks": entries,
        "capture": {"positions": [k for k in POSITION_KINDS if k != "explicit"] + ["[ints]"],
                    "layouts": list(LAYOUTS), "dtypes": list(DTYPES),
                    "default": state.settings.capture_default,
                    "default_layout": state.settings.capture_layout,
                    "overload_policy": state.settings.capture_overload},
        "steering": {"ops": list(OPS), "positions": list(POSITIONS)},
        "readers": {"kinds": ["probe", "sae"], "activations": list(ACTIVATIONS),
                    "sae_architectures": list(ARCHITECTURES),
                    "formats": list(READER_FORMATS)},
    }


# ---- registry ----
def _check_admin(request: Request, what: str = "vector registry") -> JSONResponse | None:
    key = _state(request).settings.admin_key
    if not key:
        return None
    given = request.headers.get("x-admin-key", "")
    if not given or not hmac.compare_digest(given.encode(), key.encode()):
        return error_response(401, "this server needs its admin key in the X-Admin-Key header "
                           f"to change the {what}", "X-Admin-Key")
    return None


@router.get("/v1/steering/vectors", responses=_responses(docs.json_body(docs.VECTOR_LIST)))
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


@router.put("/v1/steering/vectors/{name}", status_code=201,
            responses=_responses(docs.json_body(docs.VECTOR_INFO), 400, 401, status=201),
            openapi_extra={"requestBody": docs.VECTOR_UPLOAD})
async def put_vector(name: VectorName, request: Request, format: PutFormat = None) -> Response:
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


@router.get("/v1/steering/vectors/{name}", responses=_responses(docs.VECTOR_DOWNLOAD, 400, 404))
async def get_vector(name: VectorName, request: Request, format: GetFormat = None) -> Response:
    """A vector's description and values (`?format=safetensors`: the stored file)."""
    registry = _state(request).registry
    if format not in (None, "", *GET_FORMATS):
        return error_response(400, f"unknown format {format!r}: give one of "
                              f"{', '.join(GET_FORMATS)}", "format")
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
        try:
            data = await asyncio.to_thread(path.read_bytes)
        except FileNotFoundError:  # deleted since its info was read
            return error_response(404, f"no steering vector named {name!r}", "name")
        return Response(data, media_type="application/octet-stream")
    if vectors.single is not None:
        info["vector"] = vectors.single.tolist()
    else:
        info["vectors"] = {str(k): v.tolist() for k, v in sorted(vectors.per_layer.items())}
    return JSONResponse(info)


@router.delete("/v1/steering/vectors/{name}",
               responses=_responses(docs.json_body(docs.VECTOR_DELETED), 400, 401, 404))
async def delete_vector(name: VectorName, request: Request) -> Response:
    """Remove a vector from the registry (needs the admin key when one is set)."""
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


# ---- readers ----
_SPOOL_CHUNK = 8 << 20


def _readers(request: Request) -> ReaderRegistry:
    readers = _state(request).readers
    assert readers is not None  # CapsteerState.create always makes one
    return readers


async def _spool_body(request: Request, directory: Path, limit: int) -> Path | None:
    """The body in a temp file under `directory` (SAEs run to gigabytes: never held
    whole in memory), or None once it passes `limit` bytes (the file is removed)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        return None
    fd, name = tempfile.mkstemp(prefix=".upload.", suffix=".tmp", dir=directory)
    path, size, pending = Path(name), 0, bytearray()
    try:
        with os.fdopen(fd, "wb") as f:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    path.unlink()
                    return None
                pending += chunk
                if len(pending) >= _SPOOL_CHUNK:
                    await asyncio.to_thread(f.write, bytes(pending))
                    pending.clear()
            await asyncio.to_thread(f.write, bytes(pending))
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return path


@router.get("/v1/readers")
async def list_readers(request: Request) -> dict[str, Any]:
    """Every registered reader, described (no weights)."""
    items = await asyncio.to_thread(_readers(request).list)
    return {"object": "list", "data": items}


@router.put("/v1/readers/{name}", status_code=201, responses=docs.errors(400, 401))
async def put_reader(name: str, request: Request, format: str | None = None,
                     activation: str | None = None) -> Response:
    """Register (or replace) a reader. A linear probe: safetensors or .npz (`weight`,
    `bias`, or scikit-learn's `coef_`, `intercept_`), .npy, .pt or JSON; an SAE: a tar
    or zip of SAELens's saved directory. Sniffed from its bytes unless `?format=` says;
    `?activation=` (none, sigmoid, softmax) sets a probe's output activation."""
    denied = _check_admin(request, "reader registry")
    if denied is not None:
        return denied
    readers = _readers(request)
    try:
        path = await _spool_body(request, readers.root, MAX_SAE_BYTES)
    except OSError as exc:
        return error_response(500, f"could not store the upload: {exc}", "body")
    if path is None:
        return error_response(400, f"reader upload is over {MAX_SAE_BYTES} bytes", "body")
    try:
        if path.stat().st_size == 0:
            return error_response(400, "empty body: send the reader file as the request body",
                                  "body")
        info = await asyncio.to_thread(readers.put, name, path, format,
                                       activation=activation or None)  # `?activation=`: unset
    except ReaderNameError as exc:
        return from_exception(exc, "name")
    except ReaderFormatError as exc:
        return from_exception(exc, "body")
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    return JSONResponse(info, status_code=201)


@router.get("/v1/readers/{name}", responses=docs.errors(400, 404))
async def get_reader(name: str, request: Request) -> Response:
    """A reader's description: kind, `d_in` (the hook width it reads), `outputs` (probe)
    or `d_sae` (SAE), architecture, activation and names, and `error` if this model
    cannot use it."""
    try:
        info = await asyncio.to_thread(_readers(request).info, name)
    except ReaderNameError as exc:
        return from_exception(exc, "name")
    except ReaderNotFoundError:
        return error_response(404, f"no reader named {name!r}", "name")
    return JSONResponse(info)


@router.delete("/v1/readers/{name}", responses=docs.errors(400, 401, 404))
async def delete_reader(name: str, request: Request) -> Response:
    denied = _check_admin(request, "reader registry")
    if denied is not None:
        return denied
    try:
        deleted = await asyncio.to_thread(_readers(request).delete, name)
    except ReaderNameError as exc:
        return from_exception(exc, "name")
    if not deleted:
        return error_response(404, f"no reader named {name!r}", "name")
    return JSONResponse({"name": name, "deleted": True})


# ---- receipts ----
@router.get("/v1/captures/{capture_id}",
            responses=_responses(docs.json_body(docs.CAPTURE_RECEIPT), 400, 404))
async def capture_receipt(capture_id: CaptureId, request: Request) -> Response:
    """Status, directory, files and the manifest of one capture."""
    state = _state(request)
    try:
        validate_capture_id(capture_id)
    except SpecError as exc:
        return from_exception(exc)
    root = Path(state.settings.capture_dir)
    receipt = await asyncio.to_thread(find_receipt, root, capture_id)
    if receipt is None:
        kept = state.tracker.unwritten(capture_id)
        if kept is not None:  # final, but the disk refused its manifest
            return JSONResponse(kept.to_dict())
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


# ---- other methods ----
def _refuse_method(allowed: tuple[str, ...]):
    async def refuse(request: Request) -> Response:
        response = error_response(405, f"{request.method} is not allowed here; this path "
                                  f"answers {', '.join(allowed)}")
        response.headers["Allow"] = ", ".join(allowed)
        return response
    return refuse


# Starlette answers a method no route of a path takes with the `Allow` of the first route it
# tried only (PUT for the registry's GET/PUT/DELETE path), and not OpenAI-shaped: these
# answer every other method with the path's whole list.
_OTHER_METHODS = ("POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD", "TRACE")
for _path, _allowed in {"/v1/capsteer/hooks": ("GET",), "/v1/steering/vectors": ("GET",),
                        "/v1/steering/vectors/{name}": ("GET", "PUT", "DELETE"),
                        "/v1/captures/{capture_id}": ("GET",)}.items():
    router.add_api_route(_path, _refuse_method(_allowed), include_in_schema=False,
                         methods=[m for m in _OTHER_METHODS if m not in _allowed])
