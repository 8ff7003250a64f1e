"""Without capsteer fields, `capsteer serve` answers exactly as stock `vllm serve` does
(same model, flags and seeds): same tokens, text and logprobs."""

from __future__ import annotations

import httpx
import pytest

from .helpers import PROMPT, main_server, start_server

pytestmark = [pytest.mark.server, pytest.mark.uses_engine("server-vanilla")]
MESSAGES = [{"role": "user", "content": "say something about the lazy dog"}]
REQUESTS = [
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 24, "temperature": 0}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 24, "temperature": 0.9, "top_p": 0.9,
                         "seed": 1234, "logprobs": 3}),
    ("/v1/completions", {"prompt": [5, 9, 77, 300, 41], "max_tokens": 16, "temperature": 1.0,
                         "seed": 7}),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 20, "temperature": 0}),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 20, "temperature": 0.8,
                              "seed": 99, "logprobs": True, "top_logprobs": 2}),
]


def _collect(url: str) -> list[dict]:
    out = []
    for path, body in REQUESTS:
        r = httpx.post(url + path, json={"model": "demo", "return_token_ids": True, **body},
                       timeout=120)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        text = choice.get("text", (choice.get("message") or {}).get("content"))
        out.append({"token_ids": choice["token_ids"], "text": text, "logprobs": choice["logprobs"]})
    return out


def test_plain_requests_equal_vllm_serve(engine_pool, model_dirs, server_root):
    vanilla = start_server(engine_pool, model_dirs, server_root, "server-vanilla", ["--vanilla"])
    want = _collect(vanilla.url)
    capsteer = main_server(engine_pool, model_dirs, server_root)  # stops the vanilla server
    got = _collect(capsteer.url)
    for (path, body), w, g in zip(REQUESTS, want, got, strict=True):
        assert g["token_ids"] == w["token_ids"], (path, body)
        assert g["text"] == w["text"], (path, body)
        assert g["logprobs"] == w["logprobs"], (path, body)
