"""Steering through the HTTP API and the named-vector registry, against HF."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from safetensors.numpy import save as save_safetensors

from capsteer.reference import hf_greedy
from capsteer.steering.formats import encode_gguf_control_vector
from capsteer.steering.spec import parse_steering_spec

from .helpers import ADMIN_KEY, ALL_HOOKS, assert_capture_matches_hf, capture_dir

pytestmark = [pytest.mark.server, pytest.mark.uses_engine("server")]
HIDDEN, LAYERS = 128, 4
PROMPT_IDS = [17, 250, 33, 98, 141, 5, 77, 300, 12, 64, 199, 8]
ADMIN = {"X-Admin-Key": ADMIN_KEY}


def _vec(seed: int, norm: float = 1.0) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal(HIDDEN).astype(np.float32)
    return v / np.linalg.norm(v) * norm


def _generate(client, steering: dict | None, max_tokens: int = 16, capture: dict | None = None):
    extra: dict = {"return_token_ids": True}
    if steering is not None:
        extra["steering"] = steering
    if capture is not None:
        extra.update(capture=capture, capture_wait=True)
    return client.completions.create(model="demo", prompt=PROMPT_IDS, max_tokens=max_tokens,
                                     temperature=0, extra_body=extra)


def _hf_tokens(hf_model, steering: dict, lookup=None, max_tokens: int = 16) -> list[int]:
    spec = parse_steering_spec(steering, num_layers=LAYERS, hidden_size=HIDDEN, lookup=lookup)
    tokens, _ = hf_greedy(hf_model, PROMPT_IDS, max_tokens, steering=spec)
    return tokens


def test_sdk_extra_body_steering_matches_hf(server, client, hf_models):
    hf = hf_models["qwen3"]
    steering = {"vectors": [
        {"hook": "resid_post", "layer": 1, "vector": _vec(1, 8.0).tolist(), "scale": 1.5},
        {"hook": "resid_mid", "layers": "2-3", "vector": _vec(2).tolist(), "op": "ablate"}]}
    plain = _generate(client, None).choices[0].token_ids
    steered = _generate(client, steering).choices[0].token_ids
    assert steered != plain, "steering did not change the output"
    assert list(steered) == _hf_tokens(hf, steering)
    assert list(plain) == hf_greedy(hf, PROMPT_IDS, 16)[0]


def test_capture_under_steering_equals_hf(server, client, hf_models):
    steering = {"vectors": [{"hook": "resid_post", "layer": 0, "vector": _vec(3, 6.0).tolist(),
                             "positions": "generated"}]}
    resp = _generate(client, steering, max_tokens=6, capture=ALL_HOOKS)
    results = resp.model_extra["capture_results"]
    spec = parse_steering_spec(steering, num_layers=LAYERS, hidden_size=HIDDEN)
    assert_capture_matches_hf(hf_models["qwen3"], capture_dir(server, results), steering=spec)


def _put(http, name: str, data: bytes, **params):
    return http.put(f"/v1/steering/vectors/{name}", content=data, headers=ADMIN, params=params)


def _uploads() -> dict[str, tuple[bytes, dict[int, np.ndarray] | np.ndarray]]:
    single = _vec(10, 3.0)
    per_layer = {1: _vec(11, 2.0), 2: _vec(12, 2.0), 3: _vec(13, 2.0)}
    buf_pt, buf_npy = io.BytesIO(), io.BytesIO()
    torch.save(torch.from_numpy(single), buf_pt)
    np.save(buf_npy, single)
    return {
        "safetensors": (save_safetensors({"vector": single}), single),
        "pt": (buf_pt.getvalue(), single),
        "npy": (buf_npy.getvalue(), single),
        "json-list": (json.dumps(single.tolist()).encode(), single),
        "json-layers": (json.dumps({"layers": {str(k): v.tolist() for k, v in per_layer.items()}})
                        .encode(), per_layer),
        "gguf": (encode_gguf_control_vector(per_layer), per_layer),
    }


@pytest.mark.parametrize("fmt", ["safetensors", "pt", "npy", "json-list", "json-layers", "gguf"])
def test_registry_round_trip(server, http, fmt):
    data, want = _uploads()[fmt]
    name = f"rt-{fmt}"
    r = _put(http, name, data)
    assert r.status_code == 201, r.text
    got = http.get(f"/v1/steering/vectors/{name}").json()
    if isinstance(want, dict):
        assert got["kind"] == "per_layer" and sorted(got["layers"]) == sorted(want)
        for layer, vec in want.items():
            np.testing.assert_array_equal(np.asarray(got["vectors"][str(layer)], np.float32), vec)
    else:
        assert got["kind"] == "single"
        np.testing.assert_array_equal(np.asarray(got["vector"], np.float32), want)
    assert name in [v["name"] for v in http.get("/v1/steering/vectors").json()["data"]]
    assert http.delete(f"/v1/steering/vectors/{name}", headers=ADMIN).status_code == 200
    assert http.get(f"/v1/steering/vectors/{name}").status_code == 404


def test_gguf_control_vector_steers_like_hf(server, client, http, hf_models):
    """llama.cpp / repeng add direction.N to the output of block N: our resid_post(N)."""
    per_layer = {1: _vec(21, 5.0), 2: _vec(22, 5.0), 3: _vec(23, 5.0)}
    assert _put(http, "gguf-cv", encode_gguf_control_vector(per_layer)).status_code == 201
    steering = {"vectors": [{"hook": "resid_post", "vector": {"name": "gguf-cv"}, "scale": 1.2}]}
    explicit = {"vectors": [{"hook": "resid_post", "layer": k, "vector": v.tolist(), "scale": 1.2}
                            for k, v in per_layer.items()]}
    steered = _generate(client, steering).choices[0].token_ids
    assert list(steered) == _hf_tokens(hf_models["qwen3"], explicit)
    assert list(steered) != list(_generate(client, None).choices[0].token_ids)


def test_named_single_vector_on_layers(server, client, http, hf_models):
    vec = _vec(31, 7.0)
    assert _put(http, "named-one", json.dumps(vec.tolist()).encode()).status_code == 201
    steering = {"vectors": [{"hook": "resid_pre", "layers": [1, 2], "vector": {"name": "named-one"},
                             "scale": -1.0}]}
    explicit = {"vectors": [{"hook": "resid_pre", "layers": [1, 2], "vector": vec.tolist(),
                             "scale": -1.0}]}
    assert list(_generate(client, steering).choices[0].token_ids) == _hf_tokens(
        hf_models["qwen3"], explicit)


def test_registry_admin_key_and_validation(server, http):
    data = json.dumps(_vec(40).tolist()).encode()
    assert http.put("/v1/steering/vectors/locked", content=data).status_code == 401
    assert http.put("/v1/steering/vectors/locked", content=data,
                    headers={"X-Admin-Key": "wrong"}).status_code == 401
    assert _put(http, "locked", data).status_code == 201
    assert http.delete("/v1/steering/vectors/locked").status_code == 401
    assert http.get("/v1/steering/vectors/locked").status_code == 200  # reads stay open
    wrong_width = _put(http, "narrow", json.dumps([1.0] * 64).encode())
    assert wrong_width.status_code == 400 and wrong_width.json()["error"]["param"] == "vector"
    not_finite = _put(http, "nan", b"[1.0, NaN" + b", 0.0" * (HIDDEN - 2) + b"]")
    assert not_finite.status_code == 400
    for hostile in ("..", ".hidden", "a%2F..%2Fb", "x" * 65):
        r = _put(http, hostile, data)
        assert r.status_code in (400, 404, 405), (hostile, r.status_code)
    vectors_dir = server.workdir / "vectors"
    assert sorted(p.name for p in vectors_dir.iterdir() if not p.name.startswith(".")) == sorted(
        f"{v['name']}.safetensors" for v in http.get("/v1/steering/vectors").json()["data"])
    assert http.delete("/v1/steering/vectors/locked", headers=ADMIN).status_code == 200
