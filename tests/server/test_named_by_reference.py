"""Named vectors travel to the workers by reference (name and content sha256), through the
real server: the same tokens as the floats sent inline, a replaced vector used from the
next request on, and a vector that changed under a request steers it with the content the
server checked, never the other."""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest

from capsteer.server.fields import ModelShape, parse_hook_fields, rewrite_body
from capsteer.steering.registry import VectorRegistry

from .helpers import ADMIN_KEY, greedy_ids, metric_value, scrape

pytestmark = [pytest.mark.server, pytest.mark.uses_engine("server")]
HIDDEN, LAYERS = 128, 4
PROMPT_IDS = [17, 250, 33, 98, 141, 5, 77, 300, 12, 64, 199, 8]
ADMIN = {"X-Admin-Key": ADMIN_KEY}


def _rows(seed: int) -> np.ndarray:
    """One vector per layer, large enough to change greedy tokens."""
    rows = np.random.default_rng(seed).standard_normal((LAYERS, HIDDEN)).astype(np.float32)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True) * 6.0


def _npy(rows: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, rows.astype("<f4"))
    return buf.getvalue()


def _put(http, name: str, rows: np.ndarray) -> None:
    r = http.put(f"/v1/steering/vectors/{name}", content=_npy(rows), headers=ADMIN)
    assert r.status_code == 201, r.text


def _tokens(client, steering: dict | None) -> list[int]:
    return greedy_ids(client, PROMPT_IDS, steering)


def _named(name: str) -> dict:
    return {"vectors": [{"hook": "resid_post", "vector": {"name": name}, "scale": 1.5}]}


def _inline(rows: np.ndarray) -> dict:
    return {"vectors": [{"hook": "resid_post", "layer": i, "vector": rows[i].tolist(),
                         "scale": 1.5} for i in range(LAYERS)]}


def test_named_per_layer_vector_is_small_on_the_wire_and_steers_as_inline(server, client,
                                                                         http):
    rows = _rows(41)
    _put(http, "byref", rows)
    named = _tokens(client, _named("byref"))
    assert named == _tokens(client, _inline(rows))  # greedy: the same vectors applied
    assert named != _tokens(client, None), "steering did not change the output"
    # What the middleware writes for it (its own functions, on the server's registry).
    registry = VectorRegistry(server.workdir / "vectors", hidden_size=HIDDEN,
                              num_layers=LAYERS, read_only=True)
    shape = ModelShape(LAYERS, HIDDEN, 512, 4)
    body = {"model": "demo", "prompt": PROMPT_IDS, "steering": _named("byref")}
    hooks = parse_hook_fields(body, shape, lookup=registry.lookup_named,
                              default_layout="packed", capture_default=None)
    xargs = rewrite_body(body, hooks, None)["vllm_xargs"]
    assert len(json.dumps(xargs)) < 2048, len(json.dumps(xargs))
    inline_hooks = parse_hook_fields({**body, "steering": _inline(rows)}, shape, lookup=None,
                                     default_layout="packed", capture_default=None)
    assert hooks.steering.sharing_key == inline_hooks.steering.sharing_key


def test_replaced_vector_steers_the_next_request(server, client, http):
    first, second = _rows(42), _rows(43)
    _put(http, "replaced", first)
    assert _tokens(client, _named("replaced")) == _tokens(client, _inline(first))
    _put(http, "replaced", second)  # the same name, other content
    got = _tokens(client, _named("replaced"))
    assert got == _tokens(client, _inline(second)) != _tokens(client, _inline(first))


def test_vector_changed_under_a_request_steers_with_the_checked_content(server, client, http):
    """The race, made deterministic: the file's bytes change in place (same inode, size,
    header and mtime) after the API process cached its decode, so the server checks the
    request against the old content while the name's file holds other content. The
    workers read the content the server checked, kept by its sha256, never the name's
    file: they steer with the old vector, as every tensor-parallel rank would, and refuse
    nothing (tests/unit/test_named_by_reference.py: content gone is refused alike)."""
    old, new = _rows(44), _rows(45)
    kept = server.workdir / "vectors" / ".content"
    before = set(os.listdir(kept)) if kept.exists() else set()
    _put(http, "tampered", old)  # the server decodes it here (its cache keys on the file)
    (content,) = set(os.listdir(kept)) - before  # the old content, by its sha256
    path = server.workdir / "vectors" / "tampered.safetensors"
    st = os.stat(path)
    blob = path.read_bytes()
    start = blob.index(old.astype("<f4").tobytes()[:64])
    with open(path, "r+b") as f:
        f.seek(start)
        f.write(new.astype("<f4").tobytes())
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_size == st.st_size
    refused = metric_value(scrape(server.url), "capsteer_steering_refused_total")
    got = _tokens(client, _named("tampered"))
    assert metric_value(scrape(server.url), "capsteer_steering_refused_total") == refused
    assert got == _tokens(client, _inline(old)) != _tokens(client, _inline(new))
    assert (kept / content).exists()
