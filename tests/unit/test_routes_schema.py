"""What /openapi.json says about capsteer's own endpoints agrees with what they do (the
schemathesis run over a real server is tests/server/test_schema_fuzz.py). Regression tests
for what that run found: path parameters the schema left unconstrained, so a name the
handler refuses read as schema-valid; a PUT body the schema did not mention; the `Allow`
of Starlette's 405 naming one method of three; a GET `format` ignored when unknown."""

from __future__ import annotations

import re

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st

from capsteer.capture.paths import validate_capture_id
from capsteer.capture.spec import SpecError
from capsteer.server import routes
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
