"""What /openapi.json says about capsteer's own endpoints agrees with what they do (the
schemathesis run over a real server is tests/server/test_schema_fuzz.py). Regression tests
for what that run found: path parameters the schema left unconstrained, so a name the
handler refuses read as schema-valid; a PUT body the schema did not mention; the `Allow`
of Starlette's 405 naming one method of three; a GET `format` ignored when unknown."""

from __future__ import annotations

import re

import pytest
import torch
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st

from capsteer.capture.paths import validate_capture_id
from capsteer.capture.spec import SpecError
from capsteer.server import routes
from capsteer.steering.readers.kinds import LinearProbe, SparseAutoencoder
from capsteer.steering.registry import VectorNameError, validate_name

VECTOR_PATH = "/v1/steering/vectors/{name}"


@pytest.fixture(scope="module")
def app() -> FastAPI:
    app = FastAPI()
    app.include_router(routes.router)
    return app


@pytest.fixture(scope="module")
def paths(app) -> dict:
    return app.openapi()["paths"]


def _param(operation: dict, name: str) -> dict:
    return next(p for p in operation["parameters"] if p["name"] == name)["schema"]


def _ecma_match(pattern: str, value: str) -> bool:
    """JSON Schema's `pattern` (ECMA-262: `$` ends the string, never before a newline)."""
    return re.search(pattern.replace("$", r"\Z"), value) is not None


def _accepts(check, value: str) -> bool:
    try:
        check(value)
    except (VectorNameError, SpecError):
        return False
    return True


names = st.one_of(st.text(max_size=70), st.from_regex(r"[A-Za-z0-9._-]{1,66}", fullmatch=True),
                  st.sampled_from(["a.tmp", "a.tmpx", ".a", "-a", "a" * 64, "a" * 65, "_x"]))


@settings(max_examples=300, deadline=None)
@given(name=names)
def test_the_path_patterns_are_the_handlers_checks(paths, name):
    for method in ("get", "put", "delete"):
        pattern = _param(paths[VECTOR_PATH][method], "name")["pattern"]
        assert _ecma_match(pattern, name) == _accepts(validate_name, name), (method, name)
    pattern = _param(paths["/v1/captures/{capture_id}"]["get"], "capture_id")["pattern"]
    assert _ecma_match(pattern, name) == _accepts(validate_capture_id, name), name


def test_every_operation_documents_its_body_and_statuses(paths):
    put = paths[VECTOR_PATH]["put"]
    assert put["requestBody"]["required"] is True
    assert {"application/octet-stream", "application/json"} <= set(put["requestBody"]["content"])
    assert {"201", "400", "401"} <= set(put["responses"])
    get = paths[VECTOR_PATH]["get"]
    assert {"application/json", "application/octet-stream"} == set(
        get["responses"]["200"]["content"])
    assert _param(get, "format")["enum"] == ["json", "safetensors", None]
    for path, method in ((VECTOR_PATH, "delete"), ("/v1/steering/vectors", "get"),
                         ("/v1/captures/{capture_id}", "get"), ("/v1/capsteer/hooks", "get")):
        ok = paths[path][method]["responses"]
        schema = ok["200"]["content"]["application/json"]["schema"]
        assert schema.get("properties") or schema.get("allOf"), (path, method)


@pytest.mark.parametrize(("path", "allowed"), [
    ("/v1/steering/vectors/x", "GET, PUT, DELETE"), ("/v1/steering/vectors", "GET"),
    ("/v1/captures/cap-1", "GET"), ("/v1/capsteer/hooks", "GET")])
def test_other_methods_get_405_naming_every_allowed_one(app, path, allowed):
    with TestClient(app) as client:
        for method in ("OPTIONS", "PATCH", "POST", "TRACE"):
            if method in allowed:
                continue
            r = client.request(method, path)
            assert r.status_code == 405, (method, path, r.text)
            assert r.headers["allow"] == allowed
            error = r.json()["error"]
            assert error["code"] == 405 and method in error["message"]


# Readers for the `when` and SAE-feature cases (width 8, as the items' vectors).
PROBE = LinearProbe(torch.ones(1, 8), torch.zeros(1), "sigmoid")
SAE = SparseAutoencoder("standard", torch.ones(8, 4), torch.zeros(4), torch.ones(4, 8),
                        torch.zeros(8))


def _steering_item_errors(item: dict) -> list[str]:
    import jsonschema  # vLLM's dependency; only this test validates with it

    from capsteer.server.openapi import STEERING
    schema = {**STEERING, "properties": {"vectors": STEERING["properties"]["vectors"]}}
    validator = jsonschema.Draft202012Validator(schema)
    return [e.message for e in validator.iter_errors({"vectors": [item]})]


def test_the_steering_item_schema_says_what_the_parser_requires():
    """Found by schemathesis: an item with neither `layer` nor `layers` read as schema-valid,
    and the server refuses it (unless the vector is a registered name)."""
    from capsteer.steering.spec import SteeringSpecError, parse_steering_spec

    cases = [
        ({"vector": [0.5] * 8}, False),  # the parser: layer is required (or layers)
        ({"vector": [0.5] * 8, "layer": 0}, True),
        ({"vector": [0.5] * 8, "layers": "all"}, True),
        ({"vector": [0.5] * 8, "layer": 0, "layers": [1]}, False),
        ({"vector": {"name": "happy"}}, True),  # a per-layer entry's every layer
        ({"vector": [0.5] * 8, "layer": 0, "op": "clamp"}, False),  # clamp needs a value
        ({"vector": [0.5] * 8, "layer": 0, "op": "clamp", "value": 1.0}, True),
        ({"vector": [0.5] * 8, "layer": 0, "junk": 1}, False),  # unknown fields: refused
        ({"vector": {"reader": "sae", "feature": 3}, "layer": 0}, True),
        ({"vector": {"reader": "sae", "feature": 3}}, False),  # a decoder row needs a layer
        ({"vector": {"reader": "sae"}, "layer": 0}, False),
        ({"vector": [0.5] * 8, "layer": 0,
          "when": {"reader": {"name": "p"}, "index": 0, "above": 0.5}}, True),
        ({"vector": [0.5] * 8, "layer": 0, "when": {"reader": {"name": "p"}, "above": 0.5,
                                                    "below": 0.6}}, False),
        ({"vector": [0.5] * 8, "layer": 0, "when": {"reader": {"name": "p"}}}, False),
    ]
    for item, valid in cases:
        assert (not _steering_item_errors(item)) == valid, (item, _steering_item_errors(item))
        if "name" in item["vector"]:
            continue  # needs the registry to resolve
        try:
            parse_steering_spec({"vectors": [item]}, num_layers=2, hidden_size=8,
                                readers={"p": PROBE, "sae": SAE}.__getitem__)
            parsed = True
        except SteeringSpecError:
            parsed = False
        assert parsed == valid, item


def test_the_served_schema_bounds_what_the_model_bounds():
    """Found by schemathesis: layer 5621902 and position -2459562 were schema-valid and
    refused (the model has few layers and a finite context); so was capture_wait without
    a capture. The served schema now says all three."""
    import jsonschema  # vLLM's dependency; only these tests validate with it

    from capsteer.server.openapi import CAPTURE, STEERING, WAIT_NEEDS_CAPTURE, for_model

    fields = for_model({"capture": CAPTURE, "steering": STEERING, "wait": WAIT_NEEDS_CAPTURE},
                       hidden_size=8, num_layers=4, max_model_len=512)
    body = {"type": "object", "properties": {"capture": fields["capture"],
                                             "steering": fields["steering"]},
            "allOf": [fields["wait"]]}
    ok = jsonschema.Draft202012Validator(body).is_valid
    vector = [0.5] * 8
    assert ok({"steering": {"vectors": [{"vector": vector, "layer": -4}]}})
    assert not ok({"steering": {"vectors": [{"vector": vector, "layer": 4}]}})
    assert not ok({"steering": {"vectors": [{"vector": vector[:7], "layer": 0}]}})
    assert ok({"capture": {"layers": [0, 3], "positions": [-512, 511]}})
    assert not ok({"capture": {"layers": [5]}})
    assert not ok({"capture": {"positions": [512]}})
    assert not ok({"capture": {"positions": -513}})
    assert ok({"capture": True, "capture_wait": True}) and ok({"capture_wait": False})
    assert not ok({"capture_wait": True}) and not ok({"capture": False, "capture_wait": True})
    assert "minimum" not in str(CAPTURE)  # for_model changed a copy
