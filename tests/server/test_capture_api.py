"""Captures through the HTTP API: chat and completions, streaming and not, against HF."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from .helpers import (
    ALL_HOOKS,
    PROMPT,
    assert_capture_matches_hf,
    capture_dir,
    metric_value,
    wait_for_receipt,
)

pytestmark = [pytest.mark.server, pytest.mark.uses_engine("server")]
MESSAGES = [{"role": "user", "content": "tell me about foxes and dogs"}]


def _check_durable(server, results: dict, completion_tokens: int, response_id: str) -> None:
    """The files were durable when the response arrived: manifest visible, every file
    listed exists with its size, and exactly the fed positions are there. The manifest
    names the response's own id."""
    directory = capture_dir(server, results)
    manifest = json.loads((directory / "manifest.json").read_text())
    assert manifest["request_id"] == response_id
    for f in manifest["files"]:
        assert (directory / f["name"]).stat().st_size == f["bytes"]
    assert manifest["fed_tokens"] == manifest["prompt_tokens"] + completion_tokens - 1
    assert results["positions"] == manifest["fed_tokens"]  # positions "all"


def test_completion_capture_wait_equals_hf(server, client, hf_models):
    resp = client.completions.create(model="demo", prompt=PROMPT, max_tokens=6, temperature=0,
                                     extra_body={"capture": ALL_HOOKS, "capture_wait": True})
    results = resp.model_extra["capture_results"]
    _check_durable(server, results, resp.usage.completion_tokens, resp.id)
    assert assert_capture_matches_hf(hf_models["qwen3"], capture_dir(server, results)) > 0


def test_chat_capture_wait_equals_hf(server, client, hf_models):
    resp = client.chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=5, temperature=0,
        extra_body={"capture": ALL_HOOKS, "capture_wait": True})
    results = resp.model_extra["capture_results"]
    _check_durable(server, results, resp.usage.completion_tokens, resp.id)
    assert_capture_matches_hf(hf_models["qwen3"], capture_dir(server, results))


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_manifest_names_the_response_id_the_client_chose(server, client, kind):
    """X-Request-Id (vLLM's own header) and the body's `request_id` both set the response's
    id; the capture's manifest records the same id, so the two can be joined."""
    extra = {"capture": True, "capture_wait": True}
    for header, body_id in (("hdr-7", None), (None, "body-8")):
        kwargs = {"model": "demo", "max_tokens": 2, "temperature": 0,
                  "extra_headers": {"X-Request-Id": header} if header else None,
                  "extra_body": {**extra, **({"request_id": body_id} if body_id else {})}}
        resp = client.chat.completions.create(messages=MESSAGES, **kwargs) if kind == "chat" \
            else client.completions.create(prompt=PROMPT, **kwargs)
        prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
        assert resp.id == prefix + (header or body_id)
        _check_durable(server, resp.model_extra["capture_results"], resp.usage.completion_tokens,
                       resp.id)


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_streaming_final_chunk_carries_results(server, client, hf_models, kind):
    extra = {"capture": ALL_HOOKS, "capture_wait": True}
    if kind == "chat":
        stream = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=7,
                                                temperature=0, stream=True, extra_body=extra)
    else:
        stream = client.completions.create(model="demo", prompt=PROMPT, max_tokens=7,
                                           temperature=0, stream=True, extra_body=extra)
    chunks = list(stream)
    last = chunks[-1]
    assert last.choices == []
    results = last.model_extra["capture_results"]
    assert last.id == chunks[0].id and last.model == "demo"
    assert all("capture_results" not in (c.model_extra or {}) for c in chunks[:-1])
    assert all(c.usage is None for c in chunks), "usage chunk leaked though not asked for"
    _check_durable(server, results, 7, last.id)
    assert_capture_matches_hf(hf_models["qwen3"], capture_dir(server, results))


def test_streaming_keeps_usage_when_asked(server, client):
    stream = client.completions.create(
        model="demo", prompt=PROMPT, max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True},
        extra_body={"capture": {"hooks": ["resid_post"], "positions": "prompt"}})
    chunks = list(stream)
    usage = [c for c in chunks if c.usage is not None]
    assert len(usage) == 1 and usage[0].usage.completion_tokens == 4
    assert chunks[-1].model_extra["capture_results"]["status"] == "pending"


def test_stop_string_ends_capture_at_the_output(server, client, hf_models):
    """vLLM finds stop strings in the front end, after the engine may have fed more
    tokens; the capture must end where the response ends."""
    plain = client.completions.create(model="demo", prompt=PROMPT, max_tokens=24, temperature=0)
    text = plain.choices[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip(), text
    resp = client.completions.create(
        model="demo", prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop],
        extra_body={"capture": {"hooks": ["resid_post"], "layers": "all", "positions": "all"},
                    "capture_wait": True})
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens < 24
    results = resp.model_extra["capture_results"]
    _check_durable(server, results, resp.usage.completion_tokens, resp.id)
    assert_capture_matches_hf(hf_models["qwen3"], capture_dir(server, results))


def test_prompt_positions_per_file_with_tag(server, client, hf_models):
    resp = client.completions.create(
        model="demo", prompt=PROMPT, max_tokens=3, temperature=0,
        extra_body={"capture": {"hooks": {"resid_post": [0, -1], "attn_out": "1-2"},
                                "positions": "prompt", "layout": "per_file", "tag": "run-7"},
                    "capture_wait": True, "return_token_ids": True})
    results = resp.model_extra["capture_results"]
    directory = capture_dir(server, results)
    assert directory.parts[-2] == "run-7" and results["layout"] == "per_file"
    assert sorted(results["files"]) == sorted(
        ["resid_post.0.safetensors", "resid_post.3.safetensors", "attn_out.1.safetensors",
         "attn_out.2.safetensors"])
    prompt_ids = resp.choices[0].prompt_token_ids
    assert results["positions"] == len(prompt_ids)
    assert_capture_matches_hf(hf_models["qwen3"], directory, fed=list(prompt_ids))


def test_without_wait_receipt_is_pending_then_fetched(server, client, http):
    resp = client.completions.create(model="demo", prompt=PROMPT, max_tokens=4, temperature=0,
                                     extra_body={"capture": True})
    results = resp.model_extra["capture_results"]
    assert results["status"] == "pending"
    body = wait_for_receipt(http, results["capture_id"])
    assert body["status"] == "ok"
    assert body["manifest_data"]["capture_id"] == results["capture_id"]
    assert (capture_dir(server, body) / "manifest.json").exists()


def test_literal_extra_body_object_from_curl(server, http):
    r = http.post("/v1/completions", json={
        "model": "demo", "prompt": PROMPT, "max_tokens": 3, "temperature": 0,
        "extra_body": {"capture": {"hooks": ["post_block"], "layers": [-1]},
                       "capture_wait": True}})
    assert r.status_code == 200, r.text
    results = r.json()["capture_results"]
    assert results["status"] == "ok" and r.headers["x-capsteer-capture-id"] == results["capture_id"]


def test_no_capture_field_no_results(server, client):
    resp = client.completions.create(model="demo", prompt=PROMPT, max_tokens=3, temperature=0)
    assert "capture_results" not in (resp.model_extra or {})


def test_disconnected_stream_gets_an_error_receipt(server, http):
    """A client that goes away mid-stream aborts the request: no data files are
    published under a final name, the receipt says why.

    The client leaves as soon as the stream's headers arrive. The server writes ahead
    of a client that does not read, so a generation can still finish before the
    disconnect is seen (the whole 440 tokens take under a second here); such a capture
    is complete and ok. Each attempt checks whichever outcome it got; at least one of
    five must be the abort."""
    for _ in range(5):
        with http.stream("POST", "/v1/completions", json={
                "model": "demo", "prompt": PROMPT, "max_tokens": 440, "temperature": 0,
                "ignore_eos": True, "stream": True,
                "capture": {"hooks": ["resid_post"], "positions": "all"}}) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            capture_id = r.headers["x-capsteer-capture-id"]
        body = wait_for_receipt(http, capture_id)
        if body["status"] == "error":
            assert "abort" in body["error"], body
            assert body["files"] == [] and body["positions"] == 0, body
            return
        assert body["status"] == "ok", body
        prompt_len = body["manifest_data"]["prompt_tokens"]
        assert body["positions"] == prompt_len + 440 - 1, body  # finished: every position
    pytest.fail("five disconnected streams all finished before the server saw the disconnect")


def _capture_queued_behind_a_long_batch(http, client, prompts: int, tokens: int):
    """Start one plain request of `prompts` long prompts, send a captured stream once a
    quick /metrics scrape shows at least 32 of them waiting (vLLM schedules first come,
    first served, so the capture waits behind them), and leave at its headers. Returns
    (capture id, the batch's completion tokens), or None when the chance was missed:
    the test process can stall for seconds while the server runs the batch on this
    2-core machine (a 4.3 s scrape in CI; 8 s between two quick ones locally), so a
    scrape that took 0.3 s or more does not count, and neither does a capture whose
    headers came after the batch had ended."""
    def long_plain_batch() -> int:
        resp = client.completions.create(model="demo", prompt=[PROMPT] * prompts,
                                         max_tokens=tokens, temperature=0,
                                         extra_body={"ignore_eos": True})
        return resp.usage.completion_tokens

    with ThreadPoolExecutor(1) as pool:
        batch = pool.submit(long_plain_batch)
        capture_id = None
        while not batch.done():
            started = time.monotonic()
            text = http.get("/metrics").text
            took = time.monotonic() - started
            waiting = metric_value(text, "vllm:num_requests_waiting", engine="0",
                                   model_name="demo")
            if took < 0.3 and waiting >= 32 and not batch.done():
                try:
                    with http.stream("POST", "/v1/completions", json={
                            "model": "demo", "prompt": PROMPT, "max_tokens": 8,
                            "temperature": 0, "stream": True,
                            "capture": {"hooks": ["resid_post"], "positions": "all"}}) as r:
                        assert r.status_code == 200
                        capture_id = r.headers["x-capsteer-capture-id"]
                        if batch.done():
                            capture_id = None
                except httpx.RemoteProtocolError:
                    # The pooled connection was closed by the server's keep-alive timer as
                    # the request went out (seen once in CI): no response, so no capture;
                    # the chance was missed, and the caller tries another batch.
                    capture_id = None
                break
            time.sleep(0.02)
        completion_tokens = batch.result()
    return None if capture_id is None else (capture_id, completion_tokens)


def test_abort_before_the_engine_ran_it_gets_an_error_receipt(server, http, client):
    """A request aborted while it waits for a slot never reaches a worker, so no writer
    will publish its capture: the server publishes the error outcome itself instead of
    leaving the receipt pending. One plain request of 64 long prompts fills every slot
    (--max-num-seqs 16, or fewer where the KV cache is the limit); the captured one is
    sent when at least 32 wait ahead of it, and its client leaves at the headers."""
    prompts, tokens = 64, 440
    for _ in range(5):
        queued = _capture_queued_behind_a_long_batch(http, client, prompts, tokens)
        if queued is None:
            continue
        capture_id, completion_tokens = queued
        assert completion_tokens == prompts * tokens
        body = wait_for_receipt(http, capture_id, timeout_s=30)
        # A capture with rows means a worker ran the request before the client's abort
        # reached the engine (the queue drained first): the precondition missed, try again.
        if not (body["status"] == "ok" and body["positions"] > 0):
            break
    else:  # the precondition, not the behaviour, could not be set up: say so, loudly
        pytest.skip("in 5 batches of 64 no captured request stayed queued until its client "
                    "left (the test process stalls under load)")
    # Only the server writes this reason: no worker opened the capture.
    assert body["status"] == "error" and "before the engine ran it" in body["error"], body
    assert body["files"] == [] and body["positions"] == 0
    manifest = body["manifest_data"]
    assert manifest["status"] == "error" and manifest["capture_id"] == capture_id
    assert manifest["spec"]["hooks"] == {"resid_post": [0, 1, 2, 3]}


def test_receipt_lookup_errors(server, http):
    assert http.get("/v1/captures/cap-doesnotexist").status_code == 404
    r = http.get("/v1/captures/..%2F..%2Fetc")
    assert r.status_code in (400, 404)


def test_hooks_endpoint(server, http):
    body = http.get("/v1/capsteer/hooks").json()
    assert body["num_layers"] == 4 and body["hidden_size"] == 128 and body["dtype"] == "float32"
    names = {h["name"]: h for h in body["hooks"]}
    assert set(names) == {"resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out",
                          "mlp_in", "mlp_post", "attn_z", "router_logits"}
    assert names["resid_post"]["aliases"] == ["post_block"]
    assert body["family"] == "qwen3" and body["architecture"] == "Qwen3ForCausalLM"
    for hook in names.values():  # qwen3's MLP is dense: it has no router
        assert hook["layers"] == ([] if hook["name"] == "router_logits" else [0, 1, 2, 3])
    assert "dense" in names["router_logits"]["unavailable"]
    assert names["router_logits"]["capture_only"] is True
    assert names["resid_mid"]["hf_module"] == "model.layers[L].post_attention_layernorm input"
    assert names["mlp_in"]["aliases"] == ["ln2.hook_normalized"]
    assert names["mlp_in"]["transformer_lens"] == "blocks.L.ln2.hook_normalized"
    assert names["mlp_post"]["transformer_lens"] == "blocks.L.mlp.hook_post"
    assert names["mlp_post"]["width"] == 256 and names["mlp_post"]["selects"] == "neurons"
    assert names["resid_post"]["width"] == 128
    assert names["attn_z"]["shape"] == [4, 32] and names["attn_z"]["selects"] == "heads"


def test_openapi_documents_the_fields(server):
    schema = httpx.get(server.url + "/openapi.json", timeout=30).json()
    components = schema["components"]["schemas"]
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        props = components[name]["properties"]
        assert {"capture", "capture_wait", "steering"} <= set(props)
    for path in ("/v1/capsteer/hooks", "/v1/steering/vectors/{name}", "/v1/captures/{capture_id}"):
        assert path in schema["paths"]
