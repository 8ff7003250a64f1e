"""Bodies no JSON parser should take whole get an OpenAI-shaped 400 naming `body`, never a
500, and the server keeps serving."""

from __future__ import annotations

import json

import pytest

from .helpers import PROMPT

pytestmark = [pytest.mark.server, pytest.mark.uses_engine("server")]
PATHS = ("/v1/completions", "/v1/chat/completions")


def _nested(depth: int) -> str:
    """A completion body whose `user` field is `depth` lists deep."""
    return ('{"model": "demo", "prompt": "x", "max_tokens": 1, "user": '
            + "[" * depth + "]" * depth + "}")


def _assert_openai_400(r, label: str) -> None:
    assert r.status_code == 400, (label, r.status_code, r.text)
    error = r.json()["error"]
    assert error["param"] == "body" and error["code"] == 400, (label, error)
    assert error["type"] == "BadRequestError" and error["message"], (label, error)


@pytest.mark.parametrize("path", PATHS)
def test_a_body_nested_past_the_recursion_limit_gets_400(http, path):
    for depth in (990, 5000, 100_000):
        r = http.post(path, content=_nested(depth), headers={"content-type": "application/json"})
        _assert_openai_400(r, f"depth {depth}")
        assert "nested too deeply" in r.json()["error"]["message"]


@pytest.mark.parametrize("path", PATHS)
def test_bodies_that_are_not_json_get_an_openai_shaped_400(http, path):
    cases = {
        "not json": b"{this is not json",
        "truncated": b'{"model": "demo", "prompt": ',
        "not utf-8": b'{"model": "demo", "prompt": "\xff\xfe\xfa"}',
        "empty": b"",
    }
    for label, raw in cases.items():
        r = http.post(path, content=raw, headers={"content-type": "application/json"})
        _assert_openai_400(r, label)


def test_capsteer_fields_beside_a_deep_value_get_400_and_the_server_keeps_serving(http):
    deep = "[" * 900 + "]" * 900
    raw = ('{"model": "demo", "prompt": "x", "max_tokens": 1, "capture": true, "user": '
           + deep + "}")
    r = http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, (r.status_code, r.text)
    assert r.json()["error"]["code"] == 400
    ok = http.post("/v1/completions", content=json.dumps(
        {"model": "demo", "prompt": PROMPT, "max_tokens": 2}),
        headers={"content-type": "application/json"})
    assert ok.status_code == 200, ok.text


def test_every_status_capsteers_endpoints_answer_is_in_the_openapi_schema(server, http):
    """What the endpoints answered, checked against what /openapi.json documents for them."""
    paths = http.get("/openapi.json").json()["paths"]
    calls = [
        ("get", "/v1/steering/vectors/{name}", "/v1/steering/vectors/no-such-vector", None, 404),
        ("get", "/v1/steering/vectors/{name}", "/v1/steering/vectors/bad%20name", None, 400),
        ("delete", "/v1/steering/vectors/{name}", "/v1/steering/vectors/no-such-vector", None,
         None),
        ("put", "/v1/steering/vectors/{name}", "/v1/steering/vectors/empty", b"", None),
        ("get", "/v1/readers/{name}", "/v1/readers/no-such-reader", None, 404),
        ("get", "/v1/readers/{name}", "/v1/readers/bad%20name", None, 400),
        ("delete", "/v1/readers/{name}", "/v1/readers/no-such-reader", None, 404),
        ("put", "/v1/readers/{name}", "/v1/readers/empty", b"", 400),
        ("get", "/v1/captures/{capture_id}", "/v1/captures/cap-0000", None, 404),
        ("get", "/v1/captures/{capture_id}", "/v1/captures/bad%20id", None, 400),
    ]
    for method, template, url, content, expected in calls:
        r = http.request(method.upper(), url, content=content,
                         headers={"x-admin-key": "test-admin-key"})
        if expected is not None:
            assert r.status_code == expected, (method, url, r.status_code, r.text)
        documented = paths[template][method]["responses"]
        assert str(r.status_code) in documented, (method, url, r.status_code, documented)
        if r.status_code >= 400:
            assert r.json()["error"]["code"] == r.status_code


def test_the_schema_refuses_a_steering_item_with_both_layer_and_layers(http):
    schema = http.get("/openapi.json").json()["components"]["schemas"]
    items = schema["CompletionRequest"]["properties"]["steering"]["properties"]["vectors"]["items"]
    # Each item is a vector op or an `op: patch` item; neither may give both.
    assert len(items["anyOf"]) == 2
    assert all(item["not"] == {"required": ["layer", "layers"]} for item in items["anyOf"])
    body = {"model": "demo", "prompt": "x", "max_tokens": 1, "steering": {"vectors": [
        {"hook": "resid_post", "layer": 0, "layers": [1], "vector": [0.0] * 128}]}}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
