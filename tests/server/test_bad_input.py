"""Invalid capsteer fields get a 400 naming the field, and never reach the engine."""

from __future__ import annotations

import base64
import json
import os

import pytest

from .helpers import PROMPT, metric_value, scrape

pytestmark = [pytest.mark.engine, pytest.mark.uses_engine("server")]
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
