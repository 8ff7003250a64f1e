"""The readout responder's byte-level chunk editing (every chunk after the first) gives
exactly what reading and rewriting each chunk as JSON gives, for vLLM's completion and chat
chunk shapes, with and without the client's own `return_token_ids`."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from capsteer.capture.spec import parse_positions
from capsteer.server.readouts import (
    _PROMPT_IDS,
    _TOKEN_IDS,
    ReadoutResponder,
    _cut_key,
    _cut_spans,
    _find_value,
)
from capsteer.steering.readers.kinds import LinearProbe
from capsteer.steering.readers.readout import ReadoutItem
from capsteer.steering.readers.registry import ReaderShape
from capsteer.steering.readers.results import ResultsHub, ResultsStream, probe_record, sae_record

pytestmark = pytest.mark.unit
PROMPT = [11, 12, 13, 14]
OUTPUT = [21, 22, 23, 24, 25]


class JsonOnly(ReadoutResponder):
    """The reference: every chunk read and rewritten as JSON."""

    def _event_now(self, event: bytes) -> bytes | None:
        return None

    async def _event_bytes(self, event: bytes) -> bytes | None:
        return None


def _items() -> list[ReadoutItem]:
    probe = LinearProbe(torch.ones(2, 8), torch.zeros(2), "none")
    sae = ReaderShape("sae", "sae", 8, 32, "0" * 64)
    return [ReadoutItem(0, ReaderShape(None, "probe", 8, 2, None), probe, "resid_post", 1,
                        parse_positions("all"), None, None),
            ReadoutItem(1, sae, None, "resid_post", 1, parse_positions("generated"), 2, 0.0),
            ReadoutItem(2, ReaderShape(None, "probe", 8, 2, None), probe, "resid_post", 1,
                        parse_positions([1, 5]), None, None)]


def _chunks(chat: bool) -> list[bytes]:
    """A stream as vLLM writes it with return_token_ids (compact JSON, exclude_unset)."""
    out = []
    for g, token in enumerate(OUTPUT):
        if chat:
            choice = {"index": 0, "delta": {"content": f" t{g}"}, "logprobs": None,
                      "finish_reason": "length" if g == len(OUTPUT) - 1 else None,
                      "token_ids": [token]}
            chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
                     "model": "m", "choices": [choice]}
            if g == 0:
                chunk["prompt_token_ids"] = PROMPT
        else:
            choice = {"index": 0, "text": f" t{g}", "logprobs": None,
                      "finish_reason": None, "stop_reason": None,
                      "prompt_token_ids": PROMPT if g == 0 else None, "token_ids": [token]}
            chunk = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
                     "choices": [choice]}
        out.append(b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n")
    usage = {"id": "x", "object": "o", "created": 1, "model": "m", "choices": [],
             "usage": {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9}}
    out.append(b"data: " + json.dumps(usage, separators=(",", ":")).encode() + b"\n\n")
    out.append(b"data: [DONE]\n\n")
    return out


def _write_results(root) -> None:
    stream = ResultsStream(root)
    fed = len(PROMPT) + len(OUTPUT) - 1
    stream.append(b"".join(probe_record("ro-1", i, [p], [[p * 1.5, -p]])
                           for p in range(fed) for i in (0, 2) if i == 0 or p in (1, 5)))
    stream.append(b"".join(sae_record("ro-1", 1, [p], [[(p, p / 4), (p + 1, 0.125)]])
                           for p in range(len(PROMPT), fed)))


async def _run(cls, root, chunks: list[bytes], keep_ids: bool) -> list[dict | str]:
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    hub = ResultsHub(root)
    responder = cls(send, hub=hub, readout_id="ro-1", items=_items(),
                    client_wants_token_ids=keep_ids, timeout_s=2.0)
    await responder.send({"type": "http.response.start", "status": 200,
                          "headers": [(b"content-type", b"text/event-stream")]})
    for i, chunk in enumerate(chunks):
        await responder.send({"type": "http.response.body", "body": chunk,
                              "more_body": i < len(chunks) - 1})
    responder.finish()
    hub.stop()
    body = b"".join(m.get("body", b"") for m in sent[1:])
    return [json.loads(e[5:]) if e.startswith(b"data: {") else e.decode()
            for e in body.split(b"\n\n") if e]


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("keep_ids", [False, True])
def test_byte_edits_equal_json_edits(tmp_path, chat, keep_ids):
    _write_results(tmp_path)
    chunks = _chunks(chat)
    fast = asyncio.run(_run(ReadoutResponder, tmp_path, chunks, keep_ids))
    slow = asyncio.run(_run(JsonOnly, tmp_path, chunks, keep_ids))
    assert fast == slow
    # And the edits are the right ones: every fed position once, in the chunk after it.
    streamed = [p for event in fast if isinstance(event, dict)
                for entry in event.get("readout", ()) if entry["item"] == 0
                for p in entry["positions"]]
    assert streamed == list(range(len(PROMPT) + len(OUTPUT) - 1))
    ids = [e for e in fast if isinstance(e, dict) and e["choices"]]
    assert all(("token_ids" in e["choices"][0]) == keep_ids for e in ids)
    sae = [entry for e in fast if isinstance(e, dict) for entry in e.get("readout", ())
           if entry["item"] == 1]
    assert [p for entry in sae for p in entry["positions"]] == [4, 5, 6, 7]
    assert sae[0]["features"] == [[[4, 1.0], [5, 0.125]]]


def test_cut_key_removes_one_key_and_one_comma():
    assert _cut_key(b'{"a":1,"token_ids":[1,2],"b":2}', b'"token_ids":') == b'{"a":1,"b":2}'
    assert _cut_key(b'{"token_ids":null,"b":2}', b'"token_ids":') == b'{"b":2}'
    assert _cut_key(b'{"prompt_token_ids":[3],"x":1}', b'"token_ids":') == \
        b'{"prompt_token_ids":[3],"x":1}'


@pytest.mark.parametrize("event", [
    b'{"prompt_token_ids":null,"token_ids":[5],"x":1}',
    b'{"x":1,"prompt_token_ids":null,"token_ids":[5]}',
    b'{"token_ids":[5],"x":1,"prompt_token_ids":null}',
    b'{"prompt_token_ids":null,"token_ids":[5]}',
    b'{"token_ids":[5,6],"prompt_token_ids":null,"x":[1]}'])
def test_cutting_both_keys_at_once_equals_cutting_one_after_the_other(event):
    both = _cut_spans(event, [_find_value(event, _TOKEN_IDS), _find_value(event, _PROMPT_IDS)])
    assert both == _cut_key(_cut_key(event, _TOKEN_IDS), _PROMPT_IDS)
    assert json.loads(both) == {k: v for k, v in json.loads(event).items()
                                if k not in ("token_ids", "prompt_token_ids")}
