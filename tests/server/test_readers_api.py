"""The reader registry over HTTP: probes in every format, SAELens SAEs as tar and zip,
the admin key, and bad uploads as 400s naming their field."""

from __future__ import annotations

import io
import json
import tarfile
import zipfile

import numpy as np
import pytest
import torch
from sae_lens import JumpReLUSAE, JumpReLUSAEConfig, TopKSAE, TopKSAEConfig
from safetensors.numpy import save as st_save

from tests.upload_bodies import npy_bytes, npz_bytes, pt_bytes

from .helpers import ADMIN_KEY

pytestmark = [pytest.mark.server, pytest.mark.uses_engine("server")]
HIDDEN = 128
ADMIN = {"X-Admin-Key": ADMIN_KEY}
W = np.random.default_rng(0).standard_normal((3, HIDDEN)).astype(np.float32)
B = np.arange(3, dtype=np.float32)





PROBES = {
    "safetensors": lambda: st_save({"weight": W, "bias": B}),
    "npz": lambda: npz_bytes(weight=W, bias=B),
    "npz-sklearn": lambda: npz_bytes(coef_=W, intercept_=B),
    "pt": lambda: pt_bytes({"weight": torch.from_numpy(W), "bias": torch.from_numpy(B)}),
    "npy": lambda: npy_bytes(W),
    "json": lambda: json.dumps({"weight": W.tolist(), "bias": B.tolist(),
                                "names": ["a", "b", "c"], "activation": "softmax"}).encode(),
}


def _put(http, name: str, data: bytes, headers=ADMIN, **params):
    return http.put(f"/v1/readers/{name}", content=data, headers=headers, params=params)


@pytest.mark.parametrize("fmt", sorted(PROBES))
def test_probe_round_trip(server, http, fmt):
    name = f"probe-{fmt}"
    r = _put(http, name, PROBES[fmt](), activation="sigmoid" if fmt != "json" else None)
    assert r.status_code == 201, r.text
    got = http.get(f"/v1/readers/{name}").json()
    assert (got["kind"], got["d_in"], got["outputs"], got["architecture"]) == \
        ("probe", HIDDEN, 3, "linear")
    assert got["activation"] == ("softmax" if fmt == "json" else "sigmoid")
    assert got["error"] is None and got["sha256"]
    assert name in [item["name"] for item in http.get("/v1/readers").json()["data"]]
    assert http.delete(f"/v1/readers/{name}", headers=ADMIN).status_code == 200
    assert http.get(f"/v1/readers/{name}").status_code == 404


def _saved_sae(tmp_path, arch: str):
    if arch == "jumprelu":
        sae = JumpReLUSAE(JumpReLUSAEConfig(d_in=HIDDEN, d_sae=256))
    else:
        sae = TopKSAE(TopKSAEConfig(d_in=HIDDEN, d_sae=256, k=16))
    sae.save_model(tmp_path / arch)
    return tmp_path / arch


@pytest.mark.parametrize("fmt", ["tar", "zip"])
def test_sae_archive_round_trip(server, http, tmp_path, fmt):
    arch = "jumprelu" if fmt == "tar" else "topk"
    directory = _saved_sae(tmp_path, arch)
    buf = io.BytesIO()
    if fmt == "tar":
        with tarfile.open(fileobj=buf, mode="w:gz") as tf:
            tf.add(directory, arcname="sae")
    else:
        with zipfile.ZipFile(buf, "w") as zf:
            for path in directory.iterdir():
                zf.write(path, path.name)
    r = _put(http, f"sae-{fmt}", buf.getvalue())
    assert r.status_code == 201, r.text
    got = http.get(f"/v1/readers/sae-{fmt}").json()
    assert (got["kind"], got["architecture"], got["d_in"], got["d_sae"]) == \
        ("sae", arch, HIDDEN, 256)
    assert got["source_format"] == fmt and got["error"] is None
    if arch == "topk":
        assert got["config"]["k"] == 16
    assert http.delete(f"/v1/readers/sae-{fmt}", headers=ADMIN).status_code == 200


BAD = {
    "wrong-width": (lambda: npz_bytes(weight=np.zeros((2, HIDDEN + 1), np.float32)), "weight"),
    "nan": (lambda: json.dumps({"weight": [[float("nan")] * HIDDEN]}).encode(), "weight"),
    "inf-bias": (lambda: st_save({"weight": W, "bias": np.array([0, np.inf, 0], np.float32)}),
                 "bias"),
    "activation": (lambda: npz_bytes(weight=W, activation=np.array("tanh")), "activation"),
    "garbage": (lambda: b"\x00garbage", "body"),
    "empty": (lambda: b"", "body"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_uploads_are_400s_naming_the_field(server, http, case):
    make, param = BAD[case]
    r = _put(http, "bad", make())
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert http.get("/v1/readers/bad").status_code == 404


def test_sae_for_another_width_is_a_400_naming_d_in(server, http, tmp_path):
    # 3 x hidden: no hook of the demo model has it (mlp_post's d_mlp is 2 x hidden)
    sae = TopKSAE(TopKSAEConfig(d_in=HIDDEN * 3, d_sae=64, k=4))
    sae.save_model(tmp_path / "wide")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for path in (tmp_path / "wide").iterdir():
            zf.write(path, path.name)
    r = _put(http, "wide-sae", buf.getvalue())
    assert r.status_code == 400 and r.json()["error"]["param"] == "d_in", r.text
    assert "d_in is 384, but no hook of this model has that width" in r.text
    assert "256 (mlp_post)" in r.text


def test_admin_key_names_and_missing_readers(server, http):
    data = PROBES["npy"]()
    r = _put(http, "locked", data, headers={})
    assert r.status_code == 401 and r.json()["error"]["param"] == "X-Admin-Key"
    assert _put(http, "locked", data, headers={"X-Admin-Key": "wrong"}).status_code == 401
    assert http.delete("/v1/readers/anything").status_code == 401
    r = _put(http, "bad name!", data)
    assert r.status_code == 400 and r.json()["error"]["param"] == "name"
    assert http.get("/v1/readers/absent").status_code == 404
    assert http.delete("/v1/readers/absent", headers=ADMIN).status_code == 404
    paths = http.get("/openapi.json").json()["paths"]
    assert {"400", "401"} <= set(paths["/v1/readers/{name}"]["put"]["responses"])
    assert {"400", "401", "404"} <= set(paths["/v1/readers/{name}"]["delete"]["responses"])
    assert http.get("/v1/capsteer/hooks").json()["readers"]["kinds"] == ["probe", "sae"]


def test_steering_reads_readers_over_http(server, http, tmp_path):
    """`when` gates and SAE-feature vectors resolve against the registry: a feature's
    vector steers as its decoder row inline does; bad ones are 400s naming the field."""
    sae = JumpReLUSAE(JumpReLUSAEConfig(d_in=HIDDEN, d_sae=64))
    with torch.no_grad():
        for param in sae.parameters():
            param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(5)))
    sae.save_model(tmp_path / "jump")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        tf.add(tmp_path / "jump", arcname="jump")
    topk_dir = _saved_sae(tmp_path, "topk")
    topk = io.BytesIO()
    with tarfile.open(fileobj=topk, mode="w") as tf:
        tf.add(topk_dir, arcname="topk")
    assert _put(http, "steer-sae", buf.getvalue()).status_code == 201
    assert _put(http, "steer-topk", topk.getvalue()).status_code == 201
    assert _put(http, "steer-probe", PROBES["npz"](), activation="sigmoid").status_code == 201
    row = sae.W_dec[9].detach().tolist()
    body = {"model": "demo", "prompt": "the quick brown fox", "max_tokens": 6,
            "temperature": 0.0}

    def steer(**item):
        return http.post("/v1/completions", json={**body, "steering": {"vectors": [
            {"hook": "resid_post", "layer": 1, "scale": 4.0, **item}]}})

    by_feature = steer(vector={"reader": "steer-sae", "feature": 9})
    inline = steer(vector=row)
    assert by_feature.status_code == inline.status_code == 200, by_feature.text
    assert by_feature.json()["choices"][0]["text"] == inline.json()["choices"][0]["text"]
    gated = steer(vector=row, when={"reader": {"name": "steer-probe"}, "index": 2,
                                    "above": 0.5})
    assert gated.status_code == 200, gated.text
    when = {"reader": {"name": "steer-sae"}, "index": 3, "below": 1.0}
    for item, param in [
        ({"vector": {"reader": "absent", "feature": 0}}, "vector.reader"),
        ({"vector": {"reader": "steer-probe", "feature": 0}}, "vector.reader"),
        ({"vector": {"reader": "steer-sae", "feature": 64}}, "vector.feature"),
        ({"vector": row, "when": {**when, "reader": {"name": "absent"}}}, "when.reader.name"),
        ({"vector": row, "when": {**when, "index": 64}}, "when.index"),
        ({"vector": row, "when": {**when, "above": 0.5}}, "when"),
        ({"vector": row, "when": {**when, "reader": {"name": "steer-topk"}}},
         "when.reader.name"),
    ]:
        r = steer(**item)
        assert r.status_code == 400, (item, r.text)
        assert r.json()["error"]["param"] == f"steering.vectors[0].{param}", r.text
    for name in ("steer-sae", "steer-topk", "steer-probe"):
        assert http.delete(f"/v1/readers/{name}", headers=ADMIN).status_code == 200
