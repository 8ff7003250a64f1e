"""Adds `capture_results` to vLLM's responses: into the JSON body, or as one final SSE
chunk before `data: [DONE]` (shaped like any other chunk, so the OpenAI SDK parses it).

The responder sits between vLLM's handler and the client (an ASGI `send` wrapper).
When the response is complete it knows the real output length (`usage`), reports
it to the workers (which then publish the capture), optionally waits until the
capture is durable, and only then lets the end of the response out.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from capsteer.capture.receipts import Receipt, pending

Send = Callable[[dict], Awaitable[None]]
ReceiptSource = Callable[[str], Awaitable[Receipt]]
_DONE = b"data: [DONE]"
CAPTURE_ID_HEADER = b"x-capsteer-capture-id"


class BodyRewriter:
    """An ASGI send wrapper for a response it rewrites: a JSON body is held until whole
    (`_finish_json`), an SSE stream is handed on as it comes (`_feed_sse`); `mode` says
    which, or "pass" for a response left alone. Subclasses decide it at the response's
    start."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.mode: str | None = None  # "json" | "sse" | "pass"
        self._start: dict | None = None
        self._body = bytearray()
        self._pending = b""

    async def _route_body(self, message: dict) -> None:
        """Every message after the start: to the client, or to the mode's rewriting."""
        if message["type"] != "http.response.body" or self.mode == "pass":
            await self._send(message)
            return
        more = message.get("more_body", False)
        if self.mode == "json":
            self._body += message.get("body", b"")
            if not more:
                await self._finish_json()
            return
        await self._feed_sse(message.get("body", b""), more)

    async def _finish_json(self) -> None:
        raise NotImplementedError

    async def _feed_sse(self, chunk: bytes, more: bool) -> None:
        raise NotImplementedError

    async def _send_json_raw(self, body: bytes) -> None:
        """The held start (its content-length now `body`'s), then `body`."""
        start = dict(self._start or {"type": "http.response.start", "status": 200, "headers": []})
        start["headers"] = [(k, v) for k, v in start.get("headers", [])
                            if k.lower() != b"content-length"]
        start["headers"].append((b"content-length", str(len(body)).encode()))
        await self._send(start)
        await self._send({"type": "http.response.body", "body": body, "more_body": False})


class CaptureResponder(BodyRewriter):
    """One captured request's response path (see module docstring)."""

    def __init__(self, send: Send, *, capture_id: str, wait: bool, client_wants_usage: bool,
                 report_end: Callable[..., None], receipt: ReceiptSource) -> None:
        super().__init__(send)
        self.capture_id = capture_id
        self.wait = wait
        self.client_wants_usage = client_wants_usage
        self._report = report_end
        self._receipt = receipt
        self._chunk_meta: dict[str, Any] = {}
        self._num_output: int | None = None
        self.ended = False

    # ---- ASGI send ----
    async def send(self, message: dict) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            headers = {k.lower(): v for k, v in message.get("headers", [])}
            ctype = headers.get(b"content-type", b"")
            if message["status"] != 200:  # vLLM refused it: no id to ask for, and no
                self.mode = "pass"         # capture unless an engine had opened it (5xx)
                self._end(None, refused_status=int(message["status"]))
                await self._send(message)
                return
            # The id is known before the body: a client whose stream breaks can still ask
            # GET /v1/captures/{id}.
            message = {**message, "headers": [*message.get("headers", []),
                                              (CAPTURE_ID_HEADER, self.capture_id.encode())]}
            if ctype.startswith(b"text/event-stream"):
                self.mode = "sse"
                await self._send(message)
            else:
                self.mode = "json"
                self._start = message
            return
        await self._route_body(message)

    def finish(self) -> None:
        """After the handler returned (or was cancelled): a capture never ended is aborted."""
        self._end(None)

    # ---- internals ----
    def _end(self, num_output: int | None, refused_status: int | None = None) -> None:
        if not self.ended:
            self.ended = True
            self._report(self.capture_id, num_output, refused_status=refused_status)

    async def _results(self) -> dict[str, Any]:
        started = time.monotonic()
        receipt = await self._receipt(self.capture_id) if self.wait else pending(self.capture_id)
        out = receipt.to_dict()
        if self.wait:
            out.setdefault("timings", {})["wait_s"] = round(time.monotonic() - started, 6)
        return out

    async def _finish_json(self) -> None:
        try:
            data = json.loads(bytes(self._body))
        except ValueError:
            data = None
        if not isinstance(data, dict):
            self._end(None)
            await self._send_json_raw(bytes(self._body))
            return
        usage = data.get("usage") or {}
        tokens = usage.get("completion_tokens")
        self._end(int(tokens) if isinstance(tokens, int) else None)
        data["capture_results"] = await self._results()
        await self._send_json_raw(json.dumps(data).encode())

    async def _feed_sse(self, chunk: bytes, more: bool) -> None:
        data = self._pending + chunk
        events = data.split(b"\n\n")
        self._pending = events.pop()  # an incomplete event waits for the next chunk
        out: list[bytes] = []
        for event in events:
            if event.strip() == _DONE:
                if out:
                    await self._send_sse(out, more=True)
                    out = []
                await self._close_stream()
                continue
            keep = self._inspect_event(event)
            if keep:
                out.append(event)
        if not more and self._pending:
            out.append(self._pending)
            self._pending = b""
        if out or not more:
            await self._send_sse(out, more=more)

    def _inspect_event(self, event: bytes) -> bool:
        """Remember the chunk id/model and the usage chunk; drop usage the client did not ask
        for. Only the first chunk and usage chunks are parsed: parsing every chunk would cost
        more than vLLM's own work on it."""
        if not event.startswith(b"data:"):
            return True
        if self._chunk_meta and b'"usage":{' not in event and b'"usage": {' not in event:
            return True
        try:
            chunk = json.loads(event[5:])
        except ValueError:
            return True
        if not isinstance(chunk, dict):
            return True
        for key in ("id", "object", "created", "model"):
            if key in chunk and key not in self._chunk_meta:
                self._chunk_meta[key] = chunk[key]
        usage = chunk.get("usage")
        if isinstance(usage, dict) and not chunk.get("choices"):
            tokens = usage.get("completion_tokens")
            if isinstance(tokens, int):
                self._num_output = tokens
            return self.client_wants_usage
        return True

    async def _close_stream(self) -> None:
        self._end(self._num_output)
        chunk = {**self._chunk_meta, "choices": [], "capture_results": await self._results()}
        body = b"data: " + json.dumps(chunk).encode() + b"\n\n" + _DONE + b"\n\n"
        await self._send({"type": "http.response.body", "body": body, "more_body": True})

    async def _send_sse(self, events: list[bytes], *, more: bool) -> None:
        body = b"".join(e + b"\n\n" for e in events)
        await self._send({"type": "http.response.body", "body": body, "more_body": more})
