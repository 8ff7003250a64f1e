"""Invalid capsteer fields get a 400 naming the field, and never reach the engine."""

from __future__ import annotations

import base64
import json
import os

import pytest

from .helpers import PROMPT, metric_value, scrape

pytestmark = [pytest.mark.server, pytest.mark.uses_engine("server")]
V = [0.1] * 128
BAD: list[tuple[str, dict, str]] = [
    ("unknown hook", {"capture": {"hooks": ["post_mlp"]}}, "capture.hooks"),
    ("layer out of range", {"capture": {"hooks": ["resid_post"], "layers": [4]}}, "capture.layers"),
    ("negative layer out of range", {"capture": {"hooks": ["resid_post"], "layers": [-5]}},
     "capture.layers"),
    ("bad positions", {"capture": {"positions": "middle"}}, "capture.positions"),
    ("bad layout", {"capture": {"layout": "zip"}}, "capture.layout"),
    ("bad dtype", {"capture": {"dtype": "int8"}}, "capture.dtype"),
    ("tag escaping the root", {"capture": {"tag": "../../etc"}}, "capture.tag"),
    ("tag with a separator", {"capture": {"tag": "a/b"}}, "capture.tag"),
    ("tag dot-dot", {"capture": {"tag": ".."}}, "capture.tag"),
    ("unknown capture field", {"capture": {"path": "/tmp/x"}}, "capture.path"),
    ("capture not an object", {"capture": "yes"}, "capture"),
    ("capture_wait not a bool", {"capture": True, "capture_wait": "yes"}, "capture_wait"),
    ("capture_wait alone", {"capture_wait": True}, "capture_wait"),
    ("n > 1 with capture", {"capture": True, "n": 2}, "n"),
    ("vector of the wrong width",
     {"steering": {"vectors": [{"hook": "resid_post", "layer": 0, "vector": [1.0] * 64}]}},
     "steering.vectors[0].vector"),
    ("non-finite vector",
     {"steering": {"vectors": [{"hook": "resid_post", "layer": 0, "vector": [1e309] * 128}]}},
     "steering.vectors[0]"),
    ("unknown steering hook",
     {"steering": {"vectors": [{"hook": "post_mlp", "layer": 0, "vector": V}]}},
     "steering.vectors[0].hook"),
    ("steering layer out of range",
     {"steering": {"vectors": [{"hook": "resid_post", "layer": 9, "vector": V}]}},
     "steering.vectors[0].layer"),
    ("unknown vector name",
     {"steering": {"vectors": [{"hook": "resid_post", "layer": 0, "vector": {"name": "nope"}}]}},
     "steering.vectors[0].vector.name"),
    ("unknown op", {"steering": {"vectors": [{"hook": "resid_post", "layer": 0, "vector": V,
                                              "op": "multiply"}]}}, "steering.vectors[0].op"),
    ("bad base64", {"steering": {"vectors": [{"hook": "resid_post", "layer": 0,
                                              "vector": {"b64": "@@@", "dtype": "float32"}}]}},
     "steering.vectors[0].vector"),
    ("b64 of the wrong width", {"steering": {"vectors": [{
        "hook": "resid_post", "layer": 0,
        "vector": {"b64": base64.b64encode(b"\0" * 4 * 7).decode(), "dtype": "float32"}}]}},
     "steering.vectors[0].vector"),
    ("steering positions", {"steering": {"vectors": [{"hook": "resid_post", "layer": 0,
                                                      "vector": V, "positions": "middle"}]}},
     "steering.vectors[0].positions"),
    ("steering not an object", {"steering": [1, 2]}, "steering"),
    ("extra_body not an object", {"extra_body": "capture"}, "extra_body"),
    ("field twice", {"capture": True, "extra_body": {"capture": True}}, "extra_body.capture"),
    ("reserved vllm_xargs key", {"capture": True, "vllm_xargs": {"capsteer": "{}"}},
     "vllm_xargs.capsteer"),
    # Past int64: once crashed the engine core (numpy overflow on the step thread).
    ("position past int64", {"capture": {"positions": [2**63]}}, "capture.positions"),
    ("position past the context", {"capture": {"positions": [0, 10**6]}}, "capture.positions"),
    ("position before any prompt", {"capture": {"positions": -(10**6)}}, "capture.positions"),
    ("stream_options not an object",
     {"capture": True, "stream": True, "stream_options": "usage"}, "stream_options"),
    # vLLM's beam search builds its own sampling params: no payload, no receipt, ever
    ("beam search with capture", {"capture": True, "use_beam_search": True}, "use_beam_search"),
    ("beam search, lax true", {"capture": True, "use_beam_search": "yes"}, "use_beam_search"),
    # the reserved key beside fields that ask for nothing, or lifted from extra_body
    ("reserved key beside capture false", {"capture": False, "vllm_xargs": {"capsteer": "{}"}},
     "vllm_xargs.capsteer"),
    ("reserved key in extra_body", {"extra_body": {"vllm_xargs": {"capsteer": "{}"}}},
     "vllm_xargs.capsteer"),
    ("beam search with steering", {"use_beam_search": True, "steering": {"vectors": [
        {"hook": "resid_post", "layer": 0, "vector": V}]}}, "use_beam_search"),
]


def test_invalid_fields_get_400_naming_the_field_and_never_reach_the_engine(server, http):
    before = scrape(server.url)
    seen = set()
    for label, fields, param in BAD:
        for path, base in (("/v1/completions", {"prompt": PROMPT}),
                           ("/v1/chat/completions",
                            {"messages": [{"role": "user", "content": PROMPT}]})):
            body = {"model": "demo", "max_tokens": 2, **base, **fields}
            r = http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
            assert r.status_code == 400, (label, path, r.status_code, r.text)
            error = r.json()["error"]
            assert error["param"] is not None and error["param"].startswith(param), (label, error)
            assert error["code"] == 400 and error["message"], (label, error)
            seen.add(label)
    assert len(seen) >= 15
    after = scrape(server.url)
    for name in ("vllm:prompt_tokens_total", "vllm:request_success_total"):
        assert metric_value(after, name, model_name="demo") == metric_value(
            before, name, model_name="demo"), name


RESERVED = '{"capture": "{\\"hooks\\": {\\"resid_post\\": [0]}}", "capture_id": "forged"}'
PLAIN = {"model": "demo", "max_tokens": 2}


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {**PLAIN, "prompt": PROMPT, "vllm_xargs": {"capsteer": RESERVED}},
     "vllm_xargs.capsteer"),
    ("/v1/chat/completions", {**PLAIN, "messages": [{"role": "user", "content": PROMPT}],
                              "vllm_xargs": {"capsteer": RESERVED}}, "vllm_xargs.capsteer"),
    ("/v1/responses", {"model": "demo", "input": PROMPT, "vllm_xargs": {"capsteer": RESERVED}},
     "vllm_xargs.capsteer"),
    ("/inference/v1/generate", {"model": "demo", "token_ids": [1, 2, 3], "sampling_params": {
        "max_tokens": 2, "extra_args": {"capsteer": RESERVED}}}, "sampling_params.extra_args"),
])
def test_a_clients_own_worker_payload_is_refused_on_every_endpoint(server, http, path, body,
                                                                    param):
    """Without capsteer fields a body goes to vLLM untouched, but a `capsteer` key of its
    own would reach the workers unchecked (no admission, no tracking): refused, also
    when the JSON spells the key with escapes."""
    before = scrape(server.url)
    text = json.dumps(body)
    for encoded, kind in ((text, "application/json"),
                          (text.replace('"capsteer"', '"\\u0063apsteer"'), "application/json"),
                          (text.encode("utf-16"), "application/json"),
                          (text, "application/vnd.api+json; charset=utf-8")):
        r = http.post(path, content=encoded, headers={"content-type": kind})
        assert r.status_code == 400, (path, kind, r.status_code, r.text)
        assert r.json()["error"]["param"].startswith(param), r.text
    after = scrape(server.url)
    assert metric_value(after, "vllm:request_success_total", model_name="demo") == \
        metric_value(before, "vllm:request_success_total", model_name="demo")


def test_other_vllm_xargs_still_reach_vllm(http):
    r = http.post("/v1/completions", json={**PLAIN, "prompt": PROMPT, "vllm_xargs": {"k": "v"}})
    assert r.status_code == 200, r.text


def test_a_capture_of_several_prompts_is_refused(http):
    """A completions `prompt` list runs one engine request per prompt: one capture id could
    not name them (one is renamed, never reported; they share a cache salt)."""
    for prompt in (["a b", "c d"], [[1, 2], [3, 4]]):
        r = http.post("/v1/completions", json={**PLAIN, "prompt": prompt, "capture": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    for prompt in (["a b"], [1, 2, 3]):  # one prompt, as a list of one or as tokens
        r = http.post("/v1/completions", json={**PLAIN, "prompt": prompt, "capture": True,
                                               "capture_wait": True, "n": "1"})
        assert r.status_code == 200 and r.json()["capture_results"]["status"] == "ok", r.text


def test_a_capture_vllm_refuses_names_no_capture_id(server, http):
    """vLLM's own 400 (a prompt past max_model_len): nothing was captured, so no capture
    id is handed out that GET /v1/captures would then answer 404 for."""
    r = http.post("/v1/completions", json={**PLAIN, "prompt": [1] * 600, "capture": True})
    assert r.status_code == 400, r.text
    assert "x-capsteer-capture-id" not in r.headers


def test_nothing_lands_outside_the_capture_root(server, http):
    root = server.workdir / "captures"
    outside_before = set(os.listdir(server.workdir))
    for tag in ("../x", "..", "/abs", "a/../../b", "%2e%2e", "x" * 65, ""):
        r = http.post("/v1/completions", json={"model": "demo", "prompt": PROMPT, "max_tokens": 1,
                                               "capture": {"tag": tag}})
        assert r.status_code == 400, tag
    for capture_id in ("..", "...", "a..b/c", "%2e%2e%2fetc"):
        assert http.get(f"/v1/captures/{capture_id}").status_code in (400, 404)
    assert set(os.listdir(server.workdir)) == outside_before
    for path in root.rglob("*"):
        assert path.resolve().is_relative_to(root.resolve())
