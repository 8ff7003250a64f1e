"""Adds readout results to vLLM's responses: `readout_results` in the JSON body, or a
`readout` key on each SSE chunk with the scores computed in the steps that produced the
chunk's tokens (the prompt's come with the first chunk).

The workers' records reach this process through its `ResultsHub`
(steering/readers/results.py); a worker writes a step's records before the step's tokens
leave it, so a chunk rarely waits. The token ids vLLM returns (`return_token_ids`, which
the middleware turns on) tell which positions a chunk's scores cover. A step's forward
reads positions up to the last token it was fed: after the chunk that brings output token
g (0-based), positions below prompt + g have scores, so the last sampled token, never fed,
has none. A stream's chunks after the first are edited as bytes (vLLM writes compact
JSON): reading and rewriting every chunk as JSON would cost more than vLLM's own work on it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from capsteer.capture.spec import RANGE_KINDS, range_bounds
from capsteer.server.responses import BodyRewriter
from capsteer.steering.readers.collect import ReadoutValues, entry_head, fed_limit
from capsteer.steering.readers.readout import ReadoutItem
from capsteer.steering.readers.results import ResultsHub

Send = Callable[[dict], Awaitable[None]]
_DONE = b"data: [DONE]"
_TOKEN_IDS = b'"token_ids":'
_PROMPT_IDS = b'"prompt_token_ids":'
# ~10x json.dumps on a chunk's few small lists; writes the workers' scores as they came
# (msgspec.Raw, steering/readers/results.py)
_ENCODE = msgspec.json.Encoder().encode


class ReadoutResponder(BodyRewriter):
    """One request's response path with a readout (see module docstring)."""

    def __init__(self, send: Send, *, hub: ResultsHub, readout_id: str,
                 items: list[ReadoutItem], client_wants_token_ids: bool,
                 timeout_s: float = 60.0) -> None:
        super().__init__(send)
        self.items = items
        self.keep_token_ids = client_wants_token_ids
        self.timeout_s = timeout_s
        self._hub = hub
        self._readout_id = readout_id
        self._inbox = hub.open(readout_id)
        self.prompt: list[int] | None = None
        self.output: list[int] = []
        # item -> position -> its scores or [feature, value] pairs (the worker's JSON);
        # item -> why it failed (steering/readers/collect.py, shared with the engine)
        self.got = ReadoutValues(items)
        self.values: dict[int, dict[int, msgspec.Raw]] = self.got.values
        self.errors: dict[int, str] = self.got.errors
        self.sent: dict[int, int] = {item.index: 0 for item in items}  # positions streamed
        self.complete: dict[int, int] = {item.index: 0 for item in items}  # all below arrived
        # A range item's entry as bytes up to its positions, and its values' key: a chunk's
        # entries are written as msgspec would write the entry dicts, without building them.
        self._heads = {item.index: (_ENCODE(entry_head(item))[:-1] + b',"positions":[',
                                    b'],"scores":[' if item.reader.kind == "probe"
                                    else b'],"features":[')
                       for item in items if item.positions.kind in RANGE_KINDS}

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
        if kind == "http.response.body" and self.mode == "sse":  # one coroutine less a chunk
            await self._feed_sse(message.get("body", b""), message.get("more_body", False))
            return
        await self._route_body(message)

    def finish(self) -> None:
        """After the handler returned: later records for this readout are dropped."""
        self._hub.close(self._readout_id)

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
            body = _ENCODE(data)
        else:
            body = bytes(self._body)
        await self._send_json_raw(body)

    # ---- SSE ----
    async def _feed_sse(self, chunk: bytes, more: bool) -> None:
        events = (self._pending + chunk).split(b"\n\n")
        self._pending = events.pop()
        out = []
        for event in events:  # most chunks edited at once, without a coroutine
            now = self._event_now(event)
            out.append(now if now is not None else await self._event(event))
        if not more and self._pending:
            out.append(self._pending)
            self._pending = b""
        if out or not more:
            body = b"".join(e + b"\n\n" for e in out)
            await self._send({"type": "http.response.body", "body": body, "more_body": more})

    async def _event(self, event: bytes) -> bytes:
        if not event.startswith(b"data:") or event.strip() == _DONE:
            return event
        if self.prompt is not None:
            fast = await self._event_bytes(event)
            if fast is not None:
                return fast
        try:
            chunk = json.loads(event[5:])
        except ValueError:
            return event
        if not isinstance(chunk, dict) or not chunk.get("choices"):
            return event
        self._note_tokens(chunk, chunk["choices"][0])
        if self.prompt is None:
            return event
        chunk["readout"] = await self._chunk_entries()
        self._strip_token_ids(chunk)
        return b"data: " + _ENCODE(chunk)

    def _event_now(self, event: bytes) -> bytes | None:
        """`_event`'s result when it needs no wait: not a chunk, or a chunk edited as bytes
        whose positions' results are all here; None otherwise (nothing changed)."""
        if not event.startswith(b"data:") or event.strip() == _DONE:
            return event
        if self.prompt is None:
            return None
        parsed = _parse_chunk(event)
        if parsed is None:
            return None
        new, cuts = parsed
        limit = fed_limit(len(self.prompt), len(self.output) + len(new))
        if not self._arrived(limit):
            if self._inbox.records:
                return None
            self._hub.pump()  # as _wait_for looks at the streams before it waits
            if not self._arrived(limit):
                return None
        self.output.extend(new)
        return self._splice(event, cuts, self._entries_bytes(limit))

    async def _event_bytes(self, event: bytes) -> bytes | None:
        """A chunk after the prompt's, edited as bytes: its token ids read, its readout
        inserted, the ids cut unless the client asked. None: not a chunk of the usual shape
        (no choices, a prompt, several choices), so it goes the JSON way."""
        parsed = _parse_chunk(event)
        if parsed is None:
            return None
        new, cuts = parsed
        self.output.extend(new)
        limit = self._fed_limit()
        if not self._arrived(limit):
            await self._wait_for(limit)  # returns once all arrived, or failed
        return self._splice(event, cuts, self._entries_bytes(limit))

    def _splice(self, event: bytes, cuts: list[tuple[int, ...]], entries: bytes) -> bytes:
        if not self.keep_token_ids:
            event = _cut_spans(event, cuts)
        close = event.rindex(b"}")
        return b"".join((event[:close], b',"readout":', entries, event[close:]))

    async def _chunk_entries(self) -> list[dict[str, Any]]:
        """The readouts of the positions this chunk makes final, for each item."""
        limit = self._fed_limit()
        await self._wait_for(limit)
        entries = []
        for item in self.items:
            start = self.sent[item.index]
            entry = self._entry(item, start, limit)
            self.sent[item.index] = max(start, limit)
            if entry.get("positions") or "error" in entry:
                entries.append(entry)
        return entries

    def _entries_bytes(self, limit: int) -> bytes:
        """`_chunk_entries` encoded (the same bytes), once every item has its positions
        below `limit` or failed (`_arrived`): range items' entries written as bytes."""
        out = []
        prompt, output = self.prompt or [], self.output
        n_prompt = len(prompt)
        for item in self.items:
            index = item.index
            start = self.sent[index]
            self.sent[index] = max(start, limit)
            head = self._heads.get(index)
            if head is None or index in self.errors:
                entry = self._entry(item, start, limit)
                if entry.get("positions") or "error" in entry:
                    out.append(_ENCODE(entry))
                continue
            lo, hi = range_bounds(item.positions.kind, n_prompt, start, limit)
            if lo >= hi:
                continue
            have = self.values[index]
            span = range(lo, hi)
            out.append(b"".join((
                head[0], b",".join([b"%d" % p for p in span]), b'],"token_ids":[',
                b",".join([b"%d" % (prompt[p] if p < n_prompt else output[p - n_prompt])
                           for p in span]),
                head[1], b",".join([have[p] for p in span]), b"]}")))
        return b"[" + b",".join(out) + b"]"

    def _arrived(self, limit: int) -> bool:
        """Whether every item has its positions below `limit` (or failed), from the records
        delivered so far; `complete` advanced as `_wait_for` does."""
        if self._inbox.records:
            self.got.add(self._inbox.take())
        n_prompt = len(self.prompt or ())
        for item in self.items:
            index = item.index
            start = self.complete[index]
            if start >= limit or index in self.errors:
                continue
            self.complete[index] = upto = self.got.complete_upto(item, n_prompt, start, limit)
            if upto < limit:
                return False
        return True

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
        return fed_limit(len(self.prompt or ()), len(self.output))

    async def _wait_for(self, limit: int) -> None:
        """Until every item has its positions below `limit` (or failed, or time ran out);
        each position is checked once (`complete`), so a stream costs O(its length)."""
        deadline = None
        pumped = False
        while True:
            self._read(pump=pumped)
            missing = []
            for item in self.items:
                start = self.complete[item.index]
                if item.index in self.errors or start >= limit:
                    continue
                upto = self.got.complete_upto(item, len(self.prompt or ()), start, limit)
                self.complete[item.index] = upto
                if upto < limit:
                    missing.append(item)
            if not missing:
                return
            if not pumped:  # look at the streams at once before waiting for the hub's poll
                pumped = True
                continue
            if deadline is None:
                deadline = time.monotonic() + self.timeout_s
            if time.monotonic() >= deadline:
                for item in missing:
                    self.errors[item.index] = (f"readout results did not arrive within "
                                               f"{self.timeout_s:.0f} s")
                return
            await self._hub.wait(self._inbox, min(0.05, max(deadline - time.monotonic(), 0)))

    def _read(self, *, pump: bool) -> None:
        if pump and not self._inbox.records:
            self._hub.pump()
        self.got.add(self._inbox.take())

    def _entry(self, item: ReadoutItem, start: int, limit: int) -> dict[str, Any]:
        return self.got.entry(item, self.prompt or [], self.output, start, limit)

    def _strip_token_ids(self, data: dict) -> None:
        if self.keep_token_ids:
            return
        data.pop("prompt_token_ids", None)
        for choice in data.get("choices") or ():
            if isinstance(choice, dict):
                choice.pop("token_ids", None)
                choice.pop("prompt_token_ids", None)


def _parse_chunk(event: bytes) -> tuple[list[int], list[tuple[int, ...]]] | None:
    """A chunk's new token ids and the spans of the keys to cut (token ids, then a null
    prompt's ids if any); None: not a chunk of the usual shape (see `_event_bytes`)."""
    if b'"choices":[]' in event or event.count(b'"index":') != 1:
        return None
    found = _find_value(event, _TOKEN_IDS)
    if found is None:
        return None
    cuts = [found]
    at = event.find(_PROMPT_IDS)
    if at >= 0:
        if not event.startswith(b"null", at + len(_PROMPT_IDS)):
            return None
        cuts.append((at, at + len(_PROMPT_IDS) + 4))
    start, end = found[1], found[2]
    ids = event[start + 1: end - 1] if event[start] == 91 else b""  # 91: "["
    return (list(map(int, ids.split(b","))) if ids.strip() else []), cuts


def _find_value(event: bytes, key: bytes) -> tuple[int, int, int] | None:
    """Where `key` and its value (a flat list or null) lie in `event`: (key's start, the
    value's start, its end) in bytes."""
    at = event.find(key)
    if at < 0:
        return None
    start = at + len(key)
    if event.startswith(b"null", start):
        return at, start, start + 4
    if event.startswith(b"[", start):
        return at, start, event.index(b"]", start) + 1
    return None


def _cut_spans(event: bytes, spans: list[tuple[int, ...]]) -> bytes:
    """`event` without each (start, ..., end) span of a key and its value, and one comma
    beside each."""
    keep, last = [], 0
    for span in sorted(spans):
        at, end = span[0], span[-1]
        if at - 1 >= last and event[at - 1: at] == b",":
            at -= 1
        elif event[end: end + 1] == b",":
            end += 1
        keep.append(event[last:at])
        last = end
    keep.append(event[last:])
    return b"".join(keep)


def _cut_key(event: bytes, key: bytes) -> bytes:
    """`event` without `key` and its value (a flat list or null) and one comma beside it."""
    found = _find_value(event, key)
    return event if found is None else _cut_spans(event, [found])
