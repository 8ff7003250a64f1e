"""Adds readout results to vLLM's responses: `readout_results` in the JSON body, or a
`readout` key on each SSE chunk with the scores computed in the steps that produced the
chunk's tokens (the prompt's come with the first chunk).

The worker appends each step's scores to the request's results file
(steering/readers/results.py) before the step's tokens reach this process, so a chunk
rarely waits; the token ids vLLM returns (`return_token_ids`, which the middleware turns
on) tell which positions a chunk's scores cover. A step's forward reads positions up to
the last token it was fed: after the chunk that brings output token g (0-based), positions
below prompt + g have scores, so the last sampled token, never fed, has none.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

from capsteer.server.responses import BodyRewriter
from capsteer.steering.readers.readout import ReadoutItem
from capsteer.steering.readers.results import ResultsTail

Send = Callable[[dict], Awaitable[None]]
_DONE = b"data: [DONE]"
_POLL_S = 0.002


class ReadoutResponder(BodyRewriter):
    """One request's response path with a readout (see module docstring)."""

    def __init__(self, send: Send, *, path: Path, items: list[ReadoutItem],
                 client_wants_token_ids: bool, timeout_s: float = 60.0) -> None:
        super().__init__(send)
        self.items = items
        self.keep_token_ids = client_wants_token_ids
        self.timeout_s = timeout_s
        self._tail = ResultsTail(path)
        self.prompt: list[int] | None = None
        self.output: list[int] = []
        # item -> position -> its scores or [feature, value] pairs; item -> why it failed
        self.values: dict[int, dict[int, Any]] = {item.index: {} for item in items}
        self.errors: dict[int, str] = {}
        self.sent: dict[int, int] = {item.index: 0 for item in items}  # positions streamed
        self.complete: dict[int, int] = {item.index: 0 for item in items}  # all below arrived

    # ---- ASGI send ----
    async def send(self, message: dict) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            if message["status"] != 200:
                self.mode = "pass"
            else:
                headers = {k.lower(): v for k, v in message.get("headers", [])}
                sse = headers.get(b"content-type", b"").startswith(b"text/event-stream")
                self.mode = "sse" if sse else "json"
                if not sse:
                    self._start = message
                    return
            await self._send(message)
            return
        await self._route_body(message)

    def finish(self) -> None:
        """After the handler returned: the results file goes (the worker's late appends
        land in the unlinked file)."""
        self._tail.remove()

    # ---- JSON ----
    async def _finish_json(self) -> None:
        try:
            data = json.loads(bytes(self._body))
        except ValueError:
            data = None
        if isinstance(data, dict) and data.get("choices"):
            choice = data["choices"][0]
            self._note_tokens(data, choice)
            await self._wait_for(self._fed_limit())
            data["readout_results"] = [self._entry(item, 0, self._fed_limit())
                                       for item in self.items]
            self._strip_token_ids(data)
            body = json.dumps(data).encode()
        else:
            body = bytes(self._body)
        await self._send_json_raw(body)

    # ---- SSE ----
    async def _feed_sse(self, chunk: bytes, more: bool) -> None:
        events = (self._pending + chunk).split(b"\n\n")
        self._pending = events.pop()
        out = [await self._event(event) for event in events]
        if not more and self._pending:
            out.append(self._pending)
            self._pending = b""
        if out or not more:
            body = b"".join(e + b"\n\n" for e in out)
            await self._send({"type": "http.response.body", "body": body, "more_body": more})

    async def _event(self, event: bytes) -> bytes:
        if not event.startswith(b"data:") or event.strip() == _DONE:
            return event
        try:
            chunk = json.loads(event[5:])
        except ValueError:
            return event
        if not isinstance(chunk, dict) or not chunk.get("choices"):
            return event
        self._note_tokens(chunk, chunk["choices"][0])
        if self.prompt is None:
            return event
        limit = self._fed_limit()
        await self._wait_for(limit)
        entries = []
        for item in self.items:
            start = self.sent[item.index]
            entry = self._entry(item, start, limit)
            self.sent[item.index] = max(start, limit)
            if entry.get("positions") or "error" in entry:
                entries.append(entry)
        chunk["readout"] = entries
        self._strip_token_ids(chunk)
        return b"data: " + json.dumps(chunk).encode()

    # ---- shared ----
    def _note_tokens(self, data: dict, choice: dict) -> None:
        prompt = data.get("prompt_token_ids") or choice.get("prompt_token_ids")
        if prompt is not None and self.prompt is None:
            self.prompt = list(prompt)
        ids = choice.get("token_ids")
        if ids:
            self.output.extend(int(t) for t in ids)

    def _fed_limit(self) -> int:
        """Positions below this have been fed (see module docstring)."""
        prompt = len(self.prompt or ())
        return prompt + max(len(self.output) - 1, 0)

    def _expected(self, item: ReadoutItem, start: int, limit: int) -> np.ndarray:
        span = np.arange(start, limit, dtype=np.int64)
        return span[item.positions.candidate(span, len(self.prompt or ()))]

    async def _wait_for(self, limit: int) -> None:
        """Until every item has its positions below `limit` (or failed, or time ran out);
        each position is checked once (`complete`), so a stream costs O(its length)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            self._read()
            missing = []
            for item in self.items:
                start = self.complete[item.index]
                if item.index in self.errors or start >= limit:
                    continue
                have = self.values[item.index]
                lacking = [int(p) for p in self._expected(item, start, limit) if int(p) not in have]
                if lacking:
                    self.complete[item.index] = lacking[0]
                    missing.append(item)
                else:
                    self.complete[item.index] = limit
            if not missing:
                return
            if time.monotonic() >= deadline:
                for item in missing:
                    self.errors[item.index] = (f"readout results did not arrive within "
                                               f"{self.timeout_s:.0f} s")
                return
            await asyncio.sleep(_POLL_S)

    def _read(self) -> None:
        for record in self._tail.poll():
            index = int(record.get("i", -1))
            if index not in self.values:
                continue
            if "error" in record:
                self.errors.setdefault(index, str(record["error"]))
                continue
            got = record.get("s", record.get("f"))
            for p, value in zip(record["p"], got, strict=True):
                self.values[index].setdefault(int(p), value)

    def _entry(self, item: ReadoutItem, start: int, limit: int) -> dict[str, Any]:
        entry: dict[str, Any] = {"item": item.index, "reader": item.reader.name,
                                 "hook": item.hook, "layer": item.layer}
        if item.index in self.errors:
            entry["error"] = self.errors[item.index]
            return entry
        tokens = (self.prompt or []) + self.output
        positions = [int(p) for p in self._expected(item, start, limit)
                     if int(p) in self.values[item.index]]
        entry["positions"] = positions
        entry["token_ids"] = [tokens[p] for p in positions]
        key = "scores" if item.reader.kind == "probe" else "features"
        entry[key] = [self.values[item.index][p] for p in positions]
        return entry

    def _strip_token_ids(self, data: dict) -> None:
        if self.keep_token_ids:
            return
        data.pop("prompt_token_ids", None)
        for choice in data.get("choices") or ():
            if isinstance(choice, dict):
                choice.pop("token_ids", None)
                choice.pop("prompt_token_ids", None)
