"""Fuzzing the extra fields: whatever a client sends in capture / capture_wait / steering
(valid, almost valid, or garbage), the server answers 200 or 4xx, never 5xx."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from capsteer.capture.spec import SPEC_KEYS

pytestmark = [pytest.mark.server, pytest.mark.uses_engine("server")]

json_scalars = st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(
    allow_nan=True, allow_infinity=True) | st.text(max_size=12)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.text(max_size=8), inner, max_size=4), max_leaves=12)
hook_names = st.sampled_from(["resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out",
                              "mlp_in", "ln2.hook_normalized", "mlp_post", "mlp.hook_post",
                              "attn_z", "attn.hook_z", "router_logits",
                              "post_block", "pre_attn",
                              "post_mlp", "", "RESID_POST"])
layers = st.one_of(st.sampled_from(["all", "0-3", "1:3", "-1", "3-1", "a-b", "0:"]),
                   st.integers(-6, 6), st.lists(st.integers(-6, 6), max_size=4))
positions = st.one_of(st.sampled_from(["all", "prompt", "generated", "last_prompt", "last", "x"]),
                      st.integers(-40, 40), st.lists(st.integers(-40, 40), max_size=5))
capture_objects = st.fixed_dictionaries({}, optional={
    "hooks": st.one_of(st.lists(hook_names, max_size=3), hook_names,
                       st.dictionaries(hook_names, layers, max_size=2)),
    "layers": layers, "positions": positions,
    "layout": st.sampled_from(["packed", "per_file", "zip", ""]),
    "dtype": st.sampled_from(["auto", "float32", "bfloat16", "float16", "bf16", "int8"]),
    "tag": st.one_of(st.text(max_size=70), st.sampled_from(["ok-tag", "../x", "a/b", ".."])),
    "junk": json_values,
})
assert set(SPEC_KEYS) <= {"hooks", "layers", "positions", "layout", "dtype", "tag"}
vectors = st.one_of(
    st.lists(st.floats(-10, 10, width=32), min_size=127, max_size=129),
    st.lists(json_scalars, max_size=4),
    st.fixed_dictionaries({"name": st.text(max_size=10)}),
    st.fixed_dictionaries({"b64": st.text(max_size=20)}, optional={"dtype": json_scalars}),
    json_values)
steering_items = st.fixed_dictionaries({}, optional={
    "hook": hook_names, "layer": st.one_of(st.integers(-6, 6), json_scalars), "layers": layers,
    "vector": vectors, "scale": st.one_of(st.floats(allow_nan=True), json_scalars),
    "op": st.sampled_from(["add", "ablate", "clamp", "mul"]), "value": json_scalars,
    "positions": st.sampled_from(["all", "prompt", "generated", "x"]), "extra": json_values})
fields = st.fixed_dictionaries({}, optional={
    "capture": st.one_of(st.booleans(), capture_objects, json_values),
    "capture_wait": st.one_of(st.booleans(), json_scalars),
    "steering": st.one_of(st.fixed_dictionaries({"vectors": st.lists(steering_items, max_size=3)}),
                          json_values),
})


@settings(max_examples=120, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(extra=fields, nested=st.booleans(), chat=st.booleans())
def test_extra_fields_never_cause_5xx(server, extra, nested, chat):
    body: dict = {"model": "demo", "max_tokens": 2}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
    body.update({"extra_body": extra} if nested else extra)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    r = httpx.post(server.url + path, content=json.dumps(body), timeout=120,
                   headers={"content-type": "application/json"})
    assert r.status_code < 500, (r.status_code, r.text[:500], body)
    if r.status_code == 200 and extra.get("capture") not in (None, False):
        assert "capture_results" in r.json()
    elif r.status_code == 400:
        assert r.json()["error"]["param"]


def test_server_healthy_after_fuzzing(server):
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
