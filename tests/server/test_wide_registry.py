"""Named vectors and readers at a hook wider than the stream (the demo model's mlp_post is
d_mlp = 256 wide, its hidden size 128), through the real server: a d_mlp vector steers
mlp_post by name exactly as the same floats inline; a d_mlp probe reads mlp_post by name
exactly as the same probe inline, and as HF's activations read by it; either named at a
hook of another width is a 400 naming the field with both widths."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from capsteer.reference import hf_activations
from tests.server.helpers import greedy_ids
from tests.upload_bodies import npz_bytes

from .helpers import ADMIN_KEY

pytestmark = [pytest.mark.server, pytest.mark.uses_engine("server")]
HIDDEN, D_MLP, LAYERS = 128, 256, 4
PROMPT_IDS = [17, 250, 33, 98, 141, 5, 77, 300, 12, 64, 199, 8]
ADMIN = {"X-Admin-Key": ADMIN_KEY}
RNG = np.random.default_rng(61)
ROWS = RNG.standard_normal((LAYERS, D_MLP)).astype(np.float32)
ROWS *= 8.0 / np.linalg.norm(ROWS, axis=1, keepdims=True)  # enough to move greedy tokens
PROBE_W = (RNG.standard_normal((3, D_MLP)) / np.sqrt(D_MLP)).astype(np.float32)
PROBE_B = RNG.standard_normal(3).astype(np.float32)


def _npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr.astype("<f4"))
    return buf.getvalue()


def _tokens(client, steering: dict | None) -> list[int]:
    return greedy_ids(client, PROMPT_IDS, steering)


def _post(http, **fields):
    return http.post("/v1/completions", json={"model": "demo", "prompt": PROMPT_IDS,
                                              "max_tokens": 4, "temperature": 0, **fields})


def test_a_d_mlp_vector_steers_mlp_post_by_name_as_inline(server, client, http):
    assert {h["name"]: h["width"] for h in http.get("/v1/capsteer/hooks").json()["hooks"]}[
        "mlp_post"] == D_MLP != HIDDEN
    r = http.put("/v1/steering/vectors/mlp-dir", content=_npy(ROWS), headers=ADMIN)
    assert r.status_code == 201, r.text
    assert (r.json()["width"], r.json()["hooks"], r.json()["error"]) == (D_MLP, ["mlp_post"],
                                                                         None)
    listed = {v["name"]: v for v in http.get("/v1/steering/vectors").json()["data"]}
    assert listed["mlp-dir"]["width"] == D_MLP and listed["mlp-dir"]["kind"] == "per_layer"

    named = _tokens(client, {"vectors": [{"hook": "mlp_post", "vector": {"name": "mlp-dir"},
                                          "scale": 1.5}]})
    inline = _tokens(client, {"vectors": [{"hook": "mlp_post", "layer": i, "scale": 1.5,
                                           "vector": ROWS[i].tolist()}
                                          for i in range(LAYERS)]})
    assert named == inline  # greedy: the same vectors applied at the same sites
    assert named != _tokens(client, None), "steering mlp_post did not change the output"

    # at a hook of the hidden size: a 400 naming the field and both widths
    r = _post(http, steering={"vectors": [{"hook": "resid_post",
                                           "vector": {"name": "mlp-dir"}}]})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "steering.vectors[0].vector"
    assert "'mlp-dir' has width 256; resid_post is 128 wide at this model" in error["message"]
    # a width no steerable hook has is refused at upload, naming the widths there are
    r = http.put("/v1/steering/vectors/odd", content=_npy(np.ones(100)), headers=ADMIN)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "vector"
    assert "128 (the hidden size:" in r.json()["error"]["message"]
    assert "256 (mlp_post)" in r.json()["error"]["message"]
    assert http.get("/v1/steering/vectors/odd").status_code == 404


def test_a_d_mlp_probe_reads_mlp_post_by_name_as_inline_and_as_hf(server, client, http,
                                                                   hf_models):
    r = http.put("/v1/readers/mlp-probe", content=npz_bytes(weight=PROBE_W, bias=PROBE_B),
                 headers=ADMIN)
    assert r.status_code == 201, r.text
    assert (r.json()["d_in"], r.json()["hooks"]) == (D_MLP, ["mlp_post"])
    listed = {v["name"]: v for v in http.get("/v1/readers").json()["data"]}
    assert listed["mlp-probe"]["d_in"] == D_MLP and listed["mlp-probe"]["error"] is None
    hooks = {h["name"]: h for h in http.get("/v1/capsteer/hooks").json()["hooks"]}
    assert "mlp-probe" in hooks["mlp_post"]["readers"]
    assert all("mlp-probe" not in h["readers"] for name, h in hooks.items()
               if name != "mlp_post")

    items = [{"reader": {"name": "mlp-probe"}, "hook": "mlp_post", "layer": 1},
             {"reader": {"weight": PROBE_W.tolist(), "bias": PROBE_B.tolist()},
              "hook": "mlp_post", "layer": 1}]
    out = client.completions.create(model="demo", prompt=PROMPT_IDS, max_tokens=4,
                                    temperature=0, extra_body={"readout": items})
    named, inline = out.model_extra["readout_results"]
    assert "error" not in named and named["positions"] == inline["positions"]
    assert np.array_equal(named["scores"], inline["scores"])  # the same reader, exactly
    x = hf_activations(hf_models["qwen3"], named["token_ids"])[("mlp_post", 1)]
    ref = x[named["positions"]].float() @ torch.from_numpy(PROBE_W).T + torch.from_numpy(PROBE_B)
    scale = max(1.0, float(ref.abs().max()))
    assert np.allclose(named["scores"], ref.numpy(), atol=1e-4 * scale)

    r = _post(http, readout=[{"reader": {"name": "mlp-probe"}, "hook": "resid_post",
                              "layer": 1}])
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "readout[0].reader.name"
    assert "'mlp-probe' reads width 256; resid_post is 128 wide at this model" in \
        error["message"]
    r = http.put("/v1/readers/odd", content=npz_bytes(weight=np.ones((1, 100), np.float32)),
                 headers=ADMIN)
    assert r.status_code == 400 and r.json()["error"]["param"] == "weight", r.text
    assert "256 (mlp_post)" in r.json()["error"]["message"]
