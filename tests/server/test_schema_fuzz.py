"""Schemathesis over capsteer's endpoints on the shared server, from the server's own
/openapi.json: no answer is a 5xx, and every answer conforms to the schema (its status is
documented, its content type is, its body matches the documented schema, its headers and
a refused method's `Allow` do). Bounded examples, derandomized: a few minutes on 2 cores.

Generation requests keep vLLM's side fixed (model, a short prompt, 2 tokens) and take
capsteer's fields (`capture`, `capture_wait`, `steering`, in `extra_body` too) from what
schemathesis generates for the schema's description of them: vLLM's own fields are vLLM's
to fuzz, and a 4096-token generation would only spend the time."""

from __future__ import annotations

import json

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
    unsupported_method,
)

from tests.server.helpers import ADMIN_KEY, PROMPT

pytestmark = [pytest.mark.server, pytest.mark.uses_engine("server")]

CAPSTEER_PATHS = r"^/v1/(steering/vectors|captures/|capsteer/hooks)"
GENERATION_PATHS = r"^/v1/(chat/)?completions$"
CAPSTEER_FIELDS = ("capture", "capture_wait", "steering")
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance, response_headers_conformance]
HEADERS = {"X-Admin-Key": ADMIN_KEY}  # the write endpoints are exercised too
FUZZ = dict(deadline=None, derandomize=True, database=None,
            suppress_health_check=list(HealthCheck))
KNOWN_VECTOR = "0"  # the name schemathesis tries first: GET, PUT and DELETE meet a vector


@pytest.fixture
def capsteer_schema(server):
    _put_known_vector(server.url)
    return schemathesis.openapi.from_url(server.url + "/openapi.json").include(
        path_regex=CAPSTEER_PATHS)


@pytest.fixture
def generation_schema(server):
    return schemathesis.openapi.from_url(server.url + "/openapi.json").include(
        path_regex=GENERATION_PATHS)


def _hidden_size(url: str) -> int:
    return httpx.get(url + "/v1/capsteer/hooks", timeout=30).json()["hidden_size"]


def _put_known_vector(url: str) -> None:
    r = httpx.put(f"{url}/v1/steering/vectors/{KNOWN_VECTOR}", headers=HEADERS, timeout=30,
                  content=json.dumps([0.01] * _hidden_size(url)))
    assert r.status_code == 201, r.text


capsteer = schemathesis.pytest.from_fixture("capsteer_schema")
generation = schemathesis.pytest.from_fixture("generation_schema")


@capsteer.parametrize()
@settings(max_examples=40, **FUZZ)
def test_capsteers_endpoints_conform_to_their_schema(case):
    case.call_and_validate(headers=HEADERS, checks=[*CHECKS, unsupported_method], timeout=60)


def _capsteer_only(body: object) -> object:
    """A generation body with vLLM's fields fixed and capsteer's as generated."""
    if not isinstance(body, dict):
        return body  # not an object: the middleware's 400 is what is under test
    out: dict = {"model": "demo", "max_tokens": 2}
    out.update({k: body[k] for k in CAPSTEER_FIELDS if k in body})
    extra = body.get("extra_body")
    if isinstance(extra, dict):
        out["extra_body"] = {k: extra[k] for k in CAPSTEER_FIELDS if k in extra}
    return out


@generation.parametrize()
@settings(max_examples=25, **FUZZ)
def test_capsteers_generation_fields_conform_to_the_schema(case):
    body = _capsteer_only(case.body)
    if isinstance(body, dict):
        if case.path.endswith("chat/completions"):
            body["messages"] = [{"role": "user", "content": PROMPT}]
        else:
            body["prompt"] = PROMPT
    case.body = body
    case.call_and_validate(headers=HEADERS, checks=CHECKS, timeout=120)


def test_real_receipts_and_vectors_conform_to_the_schema(server):
    """Answers fuzzing rarely reaches (a vector that exists, a capture's receipt), each
    checked against the documented schema."""
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    r = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "model": "demo", "prompt": PROMPT, "max_tokens": 2, "capture_wait": True,
        "capture": {"hooks": ["resid_post"], "layers": [0], "positions": "last_prompt"}})
    assert r.status_code == 200, r.text
    schema["/v1/completions"]["POST"].validate_response(r)
    capture_id = r.json()["capture_results"]["capture_id"]
    vector = schema["/v1/steering/vectors/{name}"]
    calls = [
        (schema["/v1/captures/{capture_id}"]["GET"], {"capture_id": capture_id}, {}, None),
        (vector["PUT"], {"name": "conform"}, {},
         json.dumps({"layers": {"0": [0.5] * _hidden_size(server.url)}}).encode()),
        (vector["GET"], {"name": "conform"}, {}, None),
        (vector["GET"], {"name": "conform"}, {"format": "safetensors"}, None),
        (vector["DELETE"], {"name": "conform"}, {}, None),
        (schema["/v1/capsteer/hooks"]["GET"], {}, {}, None),
        (schema["/v1/steering/vectors"]["GET"], {}, {}, None),
    ]
    for operation, params, query, content in calls:
        path = operation.path.format(**params)
        r = httpx.request(operation.method.upper(), server.url + path, params=query,
                          content=content, headers=HEADERS, timeout=60)
        assert r.status_code < 300, (operation.method, path, r.status_code, r.text)
        operation.validate_response(r)
