"""A dedicated capture server (`--global-capture`) captures requests that carry no field."""

from __future__ import annotations

import httpx
import pytest

from capsteer.capture import read

from .helpers import PROMPT, wait_for_receipt

pytestmark = [pytest.mark.server, pytest.mark.uses_engine("server-reject")]


def test_requests_without_fields_are_captured(reject_server):
    from openai import OpenAI

    client = OpenAI(base_url=reject_server.url + "/v1", api_key="none", max_retries=0)
    plain = client.completions.create(model="demo", prompt=PROMPT, max_tokens=3, temperature=0)
    chat = client.chat.completions.create(model="demo", max_tokens=3,
                                          messages=[{"role": "user", "content": PROMPT}])
    for resp in (plain, chat):
        results = resp.model_extra["capture_results"]
        capture_id = results["capture_id"]
        body = wait_for_receipt(reject_server.url, capture_id)
        assert body["status"] == "ok", body
        cap = read(reject_server.workdir / "captures" / body["dir"])
        assert sorted(cap.keys()) == [("mlp_out", 3), ("resid_post", 0)]
        assert cap.positions.tolist() == [resp.usage.prompt_tokens - 1]
    waited = httpx.post(reject_server.url + "/v1/completions", timeout=60, json={
        "model": "demo", "prompt": PROMPT, "max_tokens": 2, "capture_wait": True}).json()
    assert waited["capture_results"]["status"] == "ok"
    opted_out = httpx.post(reject_server.url + "/v1/completions", timeout=60, json={
        "model": "demo", "prompt": PROMPT, "max_tokens": 2, "capture": False}).json()
    assert "capture_results" not in opted_out
