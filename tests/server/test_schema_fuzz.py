"""Schemathesis over capsteer's endpoints on the shared server, from the server's own
/openapi.json: no answer is a 5xx, and every answer conforms to the schema (its status is
documented, its content type is, its body matches the documented schema, its headers
do). Positive and negative cases, bounded and derandomized: a few minutes on 2 cores.

Generation requests keep vLLM's side fixed (model, a short prompt, 2 tokens) and take
capsteer's fields (`capture`, `capture_wait`, `steering`, in `extra_body` too) from what
schemathesis generates for the schema's description of them: vLLM's own fields are vLLM's
to fuzz, and a 4096-token generation would only spend the time."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import BaseSchema, Case, GenerationMode, Response
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
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


def _hidden_size(url: str) -> int:
    return httpx.get(url + "/v1/capsteer/hooks", timeout=30).json()["hidden_size"]


def _put_known_vector(url: str) -> None:
    r = httpx.put(f"{url}/v1/steering/vectors/{KNOWN_VECTOR}", headers=HEADERS, timeout=30,
                  content=json.dumps([0.01] * _hidden_size(url)))
    assert r.status_code == 201, r.text


def fuzz(schema: BaseSchema, examples: int, send: Callable[[Case], Response],
         ) -> tuple[list[str], Counter[tuple[str, int]]]:
    """Up to `examples` cases of each operation of `schema`, positive and negative ones,
    each sent by `send` (which validates the answer): the failures, one line each, and how
    often each (operation, status) came back. Driven by hand rather than by schemathesis's
    pytest plugin, whose lazy schemas need a pytest internal that pytest 9.2 lacks."""
    failures = []
    seen: Counter[tuple[str, int]] = Counter()
    for result in schema.get_all_operations():
        operation = result.ok()
        cases = st.one_of(operation.as_strategy(GenerationMode.POSITIVE),
                          operation.as_strategy(GenerationMode.NEGATIVE))

        @settings(max_examples=examples, phases=[Phase.explicit, Phase.generate], **FUZZ)
        @given(case=cases)
        def run(case: Case) -> None:
            seen[f"{case.method} {case.path}", send(case).status_code] += 1

        try:
            run()
        except Exception as exc:  # every operation runs; all failures are reported
            failures.append(f"{operation.method.upper()} {operation.path}: {exc}")
    print(sorted(seen.items()))  # shown with -s or on failure: what the run reached
    return failures, seen


def test_capsteers_endpoints_conform_to_their_schema(server):
    _put_known_vector(server.url)
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json").include(
        path_regex=CAPSTEER_PATHS)
    failures, seen = fuzz(schema, 150, lambda case: case.call_and_validate(
        headers=HEADERS, checks=CHECKS, timeout=60))
    assert not failures, "\n\n".join(failures)
    # it reached the handlers' logic, not just their argument checks
    vector = "/v1/steering/vectors/{name}"
    for key in ((f"PUT {vector}", 201), (f"PUT {vector}", 400), (f"GET {vector}", 200),
                (f"GET {vector}", 404), (f"DELETE {vector}", 200),
                ("GET /v1/captures/{capture_id}", 404), ("GET /v1/capsteer/hooks", 200)):
        assert seen[key], (key, sorted(seen.items()))


def _capsteer_only(body: object, path: str) -> object:
    """A generation body with vLLM's fields fixed and capsteer's as generated."""
    if not isinstance(body, dict):
        return body  # not an object: the middleware's 400 is what is under test
    out: dict = {"model": "demo", "max_tokens": 2}
    if path.endswith("chat/completions"):
        out["messages"] = [{"role": "user", "content": PROMPT}]
    else:
        out["prompt"] = PROMPT
    out.update({k: body[k] for k in CAPSTEER_FIELDS if k in body})
    extra = body.get("extra_body")
    if isinstance(extra, dict):
        out["extra_body"] = {k: extra[k] for k in CAPSTEER_FIELDS if k in extra}
    return out


def capsteer_requests(served: dict) -> dict:
    """The served schema with the generation requests narrowed to capsteer's fields, so
    every case varies them (drawn from vLLM's hundred fields, most cases had none); the
    responses stay as served, and are what the answers are checked against."""
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        request = served["components"]["schemas"][name]
        request["properties"] = {k: request["properties"][k]
                                 for k in (*CAPSTEER_FIELDS, "extra_body")}
        request.pop("required", None)
    return served


def test_capsteers_generation_fields_conform_to_the_schema(server):
    served = httpx.get(server.url + "/openapi.json", timeout=30).json()
    schema = schemathesis.openapi.from_dict(capsteer_requests(served)).include(
        path_regex=GENERATION_PATHS)

    def send(case: Case) -> Response:
        case.body = _capsteer_only(case.body, case.path)
        return case.call_and_validate(base_url=server.url, headers=HEADERS, checks=CHECKS,
                                      timeout=120)

    failures, seen = fuzz(schema, 150, send)
    assert not failures, "\n\n".join(failures)
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert seen[f"POST {path}", 200] and seen[f"POST {path}", 400], sorted(seen.items())


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
    for method in ("PATCH", "OPTIONS", "POST"):  # through vLLM's middleware stack
        r = httpx.request(method, server.url + "/v1/steering/vectors/x", timeout=30)
        assert r.status_code == 405 and r.headers["allow"] == "GET, PUT, DELETE", r.text
        assert r.json()["error"]["code"] == 405
