"""capsteer on vLLM's own OpenAI server, as one ASGI middleware (`--middleware`).

`capsteer serve` adds `--middleware capsteer.server.middleware.CapsteerMiddleware`
to `vllm serve`, so every vLLM endpoint and flag keeps working. The middleware:
- at start-up, reads its settings, checks the model, mounts capsteer's routes
  (hooks, vector registry, capture receipts) and documents the extra request
  fields in /openapi.json;
- on chat/completions, validates `capture`, `capture_wait` and `steering` before
  vLLM sees the request (400 naming the field; 429 under the reject policy) and
  rewrites them into `vllm_xargs` and `cache_salt`;
- on every JSON POST, refuses a client's own `vllm_xargs.capsteer` (the workers' payload,
  which only these checks may write);
- on the way back, adds `capture_results` (see responses.py);
- on /metrics, appends the capsteer metrics to vLLM's (see metrics.py for several
  API server processes).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable

from capsteer.config.errors import CapsteerError
from capsteer.config.server import ServerSettings
from capsteer.engine_ext.payload import EXTRA_ARGS_KEY, new_capture_id, new_readout_id
from capsteer.server import metrics, openapi, routes
from capsteer.server.errors import error_body, exception_body
from capsteer.server.fields import (
    HOOK_FIELDS,
    FieldError,
    estimate_capture_bytes,
    lift_extra_body,
    parse_hook_fields,
    refuse_reserved_args,
    response_id,
    rewrite_body,
)
from capsteer.server.readouts import ReadoutResponder
from capsteer.server.responses import CaptureResponder
from capsteer.server.state import CapsteerState

log = logging.getLogger("vllm.capsteer.server")
GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")
Scope = dict
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


async def send_json(send: Send, status: int, body: bytes, headers: list | None = None) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        *(headers or [])]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def read_body(receive: Receive) -> bytes:
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        body += message.get("body", b"")
        if not message.get("more_body", False):
            break
    return bytes(body)


def replay(body: bytes, receive: Receive) -> Receive:
    """A receive that yields `body` once, then the client's own messages (disconnects)."""
    sent = False

    async def inner() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return inner


def parse_json(raw: bytes) -> tuple[object, str | None]:
    """The body's JSON value, or None and why it is not JSON: a body nested past Python's
    recursion limit is a client error (400), like any other unreadable body, never a 500."""
    try:
        return json.loads(raw), None
    except RecursionError:
        return None, "the JSON body is nested too deeply"
    except ValueError as exc:  # invalid JSON, or bytes that are not UTF-8/16/32
        return None, f"the body is not valid JSON ({exc})"


def _is_json(scope: Scope) -> bool:
    """A body FastAPI parses as JSON: application/json or application/*+json."""
    content_type = dict(scope["headers"]).get(b"content-type", b"")
    kind = content_type.split(b";")[0].strip().lower()
    return kind == b"application/json" or (kind.startswith(b"application/")
                                           and kind.endswith(b"+json"))


def with_content_length(scope: Scope, length: int) -> Scope:
    headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
    headers.append((b"content-length", str(length).encode()))
    return {**scope, "headers": headers}


class CapsteerMiddleware:
    """See the module docstring."""

    def __init__(self, app: Callable) -> None:
        self.app = app
        self.state: CapsteerState | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, self._on_startup(scope, receive), send)
            return
        if scope["type"] != "http" or self.state is None:
            await self.app(scope, receive, send)
            return
        method, path = scope.get("method"), scope.get("path", "")
        if method == "POST" and path in GENERATION_PATHS:
            await self._generation(scope, receive, send)
        elif method == "POST" and _is_json(scope):
            await self._other_post(scope, receive, send)
        elif method == "GET" and path.rstrip("/") == "/metrics":
            await self._metrics(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    # ---- start-up ----
    def _on_startup(self, scope: Scope, receive: Receive) -> Receive:
        async def inner() -> dict:
            message = await receive()
            if message["type"] == "lifespan.startup" and self.state is None:
                self._setup(scope["app"])
            return message
        return inner

    def _setup(self, app: object) -> None:
        settings = ServerSettings.from_env()
        self.state = CapsteerState.create(app, settings)
        app.state.capsteer = self.state
        app.include_router(routes.router)
        openapi.document(app)
        log.info("capsteer: serving %s (%d layers, hidden %d); captures under %s (%s, %s policy); "
                 "vectors under %s", self.state.model.name, self.state.model.num_layers,
                 self.state.model.hidden_size, settings.capture_dir, settings.capture_layout,
                 settings.capture_overload, settings.steering_dir)

    # ---- every other JSON POST (responses, messages, token-in generate, ...) ----
    async def _other_post(self, scope: Scope, receive: Receive, send: Send) -> None:
        """vLLM endpoints beyond chat/completions take `vllm_xargs` too: a client's own
        capsteer payload there is refused (see refuse_reserved_args), all else untouched."""
        raw = await read_body(receive)
        # JSON may spell the key with escapes ("\u0063apsteer") or come in UTF-16/32 (NUL
        # bytes): such bodies are parsed too.
        suspect = EXTRA_ARGS_KEY.encode() in raw or b"\\u" in raw or b"\x00" in raw
        if suspect and self._authorized(scope):
            body, _ = parse_json(raw)  # vLLM answers an unreadable body itself
            if isinstance(body, dict):
                try:
                    refuse_reserved_args(body)
                except FieldError as exc:
                    await send_json(send, *exception_body(exc))
                    return
        await self.app(scope, replay(raw, receive), send)

    # ---- chat / completions ----
    def _authorized(self, scope: Scope) -> bool:
        """Mirror vLLM's --api-key check: an unauthenticated request goes on untouched and
        vLLM's own middleware answers 401 (so validation never leaks to it)."""
        keys = self.state.api_keys
        if not keys:
            return True
        value = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = value.partition(" ")
        if scheme.lower() != "bearer":
            return False
        digest = hashlib.sha256(token.encode()).digest()
        return any(secrets.compare_digest(digest, hashlib.sha256(k.encode()).digest()) for k in keys)

    async def _generation(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = self.state
        raw = await read_body(receive)
        if not self._authorized(scope):  # vLLM answers 401 before reading the body
            await self.app(scope, replay(raw, receive), send)
            return
        body, unreadable = parse_json(raw)
        if unreadable is not None:
            await send_json(send, 400, error_body(400, unreadable, "body"))
            return
        global_capture = state.global_capture
        if not isinstance(body, dict):  # vLLM's own validation names what is wrong
            await self.app(scope, replay(raw, receive), send)
            return
        if not (global_capture is not None or "extra_body" in body
                or any(f in body for f in HOOK_FIELDS)):
            try:
                refuse_reserved_args(body)
            except FieldError as exc:
                await send_json(send, *exception_body(exc))
                return
            await self.app(scope, replay(raw, receive), send)
            return
        try:
            body = lift_extra_body(body)
            if global_capture is not None and "capture" not in body:
                body["capture"] = global_capture  # a dedicated capture server
            parse = functools.partial(
                parse_hook_fields, body, state.shape, lookup=state.vector_lookup,
                default_layout=state.settings.capture_layout,
                capture_default=state.settings.capture_default,
                readers=state.readers.lookup if state.readers is not None else None,
                reader_tensors=state.readers.tensors if state.readers is not None else None,
                patches=state.patch_sources)
            # A patch reads its capture's files: off the event loop.
            hooks = await asyncio.to_thread(parse) if b'"patch"' in raw else parse()
            capture_id = new_capture_id() if hooks.capture is not None else None
            readout_id = new_readout_id() if hooks.readout else None
            dir_time = time.time()
            record_id = None
            if capture_id is not None:
                header = next((v for k, v in scope["headers"] if k.lower() == b"x-request-id"),
                              None)  # the first, as Starlette (and so vLLM) reads it
                record_id = response_id(body, scope.get("path", ""),
                                        None if header is None else header.decode("latin-1"))
            encoded = json.dumps(rewrite_body(body, hooks, capture_id, dir_time,
                                              record_id, readout_id)).encode()
        except CapsteerError as exc:  # a bad field (400), or a store that failed (503)
            await send_json(send, *exception_body(exc))
            return
        except RecursionError:  # parsed just under the limit, a few frames deeper to write
            await send_json(send, 400, error_body(400, "the JSON body is nested too deeply",
                                                  "body"))
            return
        if hooks.capture is not None:
            if state.settings.capture_overload == "reject":
                counted = None
                if state.prompt_counter is not None:
                    counted = await asyncio.to_thread(state.prompt_counter.count, body)
                estimate = estimate_capture_bytes(body, hooks.capture, state.shape, counted)
                if estimate > state.settings.capture_budget:
                    await send_json(send, 400, error_body(
                        400, f"capture: needs up to {estimate} bytes in flight, more than the "
                        f"server's whole capture budget ({state.settings.capture_budget}); "
                        "capture fewer hooks, layers or positions, or lower max_tokens",
                        "capture"))
                    return
                if not state.tracker.try_reserve(capture_id, hooks.capture, estimate,
                                                 dir_time=dir_time):
                    metrics.count_rejection()
                    await send_json(send, 429, error_body(
                        429, "capture: the server's capture budget is in use; retry shortly",
                        "capture"), [(b"retry-after", b"1")])
                    return
            else:
                state.tracker.track(capture_id, hooks.capture, dir_time=dir_time)
        if hooks.steering is not None and not hooks.steering.is_noop:
            metrics.STEERING_REQUESTS.inc()
        inner_scope = with_content_length(scope, len(encoded))
        if readout_id is not None:
            await self._with_readout(inner_scope, replay(encoded, receive), send, hooks,
                                     readout_id)
            return
        if capture_id is None:
            await self.app(inner_scope, replay(encoded, receive), send)
            return
        responder = CaptureResponder(
            send, capture_id=capture_id, wait=hooks.capture_wait,
            client_wants_usage=hooks.client_wants_usage, report_end=state.link.report_end,
            receipt=lambda cid: state.tracker.wait(cid, state.settings.capture_wait_timeout))
        try:
            await self.app(inner_scope, replay(encoded, receive), responder.send)
        finally:
            responder.finish()

    async def _with_readout(self, scope: Scope, receive: Receive, send: Send, hooks,
                            readout_id: str) -> None:
        """Run the request with its scores added on the way back (server/readouts.py)."""
        responder = ReadoutResponder(send, hub=self.state.readout_hub(),
                                     readout_id=readout_id, items=hooks.readout,
                                     client_wants_token_ids=hooks.client_wants_token_ids)
        try:
            await self.app(scope, receive, responder.send)
        finally:
            responder.finish()

    # ---- metrics ----
    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Plain text format, uncompressed, so capsteer's block can be appended.
        headers = [(k, v) for k, v in scope["headers"]
                   if k.lower() not in (b"accept", b"accept-encoding")]
        start: dict = {}
        body = bytearray()

        async def collect(message: dict) -> None:
            if message["type"] == "http.response.start":
                start.update(message)
            elif message["type"] == "http.response.body":
                body.extend(message.get("body", b""))

        await self.app({**scope, "headers": headers}, receive, collect)
        if start.get("status") == 200:
            snapshots = await self.state.link.metrics_snapshots()
            body[:] = metrics.strip_capsteer(bytes(body))
            readers = self.state.readers
            body.extend(metrics.render(snapshots, self.state.registry.count(),
                                       self.state.tracker.reserved_bytes,
                                       len(readers.names()) if readers is not None else 0))
        out_headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
        out_headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": start.get("status", 500),
                    "headers": out_headers})
        await send({"type": "http.response.body", "body": bytes(body), "more_body": False})
