"""Linear-probe readers: every upload format, scikit-learn's own models, the math."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest
import torch
from safetensors.numpy import save as st_save
from sklearn.linear_model import LogisticRegression

from capsteer.steering.readers.formats import ReaderFormatError, sniff_format
from capsteer.steering.readers.kinds import LinearProbe, probe_scores
from capsteer.steering.readers.registry import (
    ReaderNameError,
    ReaderNotFoundError,
    ReaderRegistry,
    ReaderRegistryError,
)
from tests.upload_bodies import npy_bytes, npz_bytes, pt_bytes

D = 12
RNG = np.random.default_rng(0)
W = RNG.standard_normal((3, D)).astype(np.float32)
B = RNG.standard_normal(3).astype(np.float32)


def _registry(tmp_path, hidden: int = D) -> ReaderRegistry:
    return ReaderRegistry(tmp_path / "readers", hidden_size=hidden)





UPLOADS = {
    "safetensors": (lambda: st_save({"weight": W, "bias": B},
                                    metadata={"activation": "softmax",
                                              "names": json.dumps(["a", "b", "c"])}),
                    "softmax", ("a", "b", "c")),
    "npz": (lambda: npz_bytes(weight=W, bias=B, names=np.array(["a", "b", "c"])), "none",
            ("a", "b", "c")),
    "npz-sklearn": (lambda: npz_bytes(coef_=W, intercept_=B), "none", None),
    "pt": (lambda: pt_bytes({"weight": torch.from_numpy(W), "bias": torch.from_numpy(B)}), "none",
           None),
    "json": (lambda: json.dumps({"weight": W.tolist(), "bias": B.tolist(),
                                 "names": ["a", "b", "c"], "activation": "sigmoid"}).encode(),
             "sigmoid", ("a", "b", "c")),
    "json-sklearn-keys": (lambda: json.dumps({"coef_": W.tolist(),
                                              "intercept_": B.tolist()}).encode(), "none", None),
}


@pytest.mark.parametrize("fmt", sorted(UPLOADS))
def test_probe_uploads_round_trip_exactly(tmp_path, fmt):
    make, activation, names = UPLOADS[fmt]
    registry = _registry(tmp_path)
    info = registry.put("p", make())
    assert (info["kind"], info["d_in"], info["outputs"], info["activation"]) == \
        ("probe", D, 3, activation)
    assert info["names"] == (list(names) if names else None) and info["error"] is None
    probe = registry.get("p")
    assert isinstance(probe, LinearProbe) and probe.names == names
    assert torch.equal(probe.weight, torch.from_numpy(W))
    assert torch.equal(probe.bias, torch.from_numpy(B))


def test_npy_is_a_weight_without_bias(tmp_path):
    registry = _registry(tmp_path)
    info = registry.put("v", npy_bytes(W[0]), activation="sigmoid")
    assert info["outputs"] == 1 and info["activation"] == "sigmoid"
    probe = registry.get("v")
    assert probe.weight.shape == (1, D) and torch.equal(probe.bias, torch.zeros(1))


def test_probe_scores_are_x_wt_plus_b_then_the_activation():
    x = torch.from_numpy(RNG.standard_normal((7, D)).astype(np.float32))
    w, b = torch.from_numpy(W), torch.from_numpy(B)
    raw = x @ w.T + b
    assert torch.equal(probe_scores(x, w, b, "none"), raw)
    assert torch.equal(probe_scores(x, w, b, "sigmoid"), torch.sigmoid(raw))
    assert torch.equal(probe_scores(x, w, b, "softmax"), torch.softmax(raw, dim=-1))
    probe = LinearProbe(w, b, "sigmoid").to(dtype=torch.float64)
    assert probe.weight.dtype == torch.float64 and probe.scores(x).shape == (7, 3)
    np.testing.assert_allclose(
        probe.scores(x).numpy(), 1 / (1 + np.exp(-(x.double().numpy() @ W.T.astype(np.float64)
                                                    + B))), rtol=1e-6)


def _fit(n_classes: int) -> tuple[LogisticRegression, np.ndarray]:
    rng = np.random.default_rng(n_classes)
    x = rng.standard_normal((120, D))
    y = (x @ rng.standard_normal((D, n_classes))).argmax(axis=1)
    labels = np.array(["honest", "deceptive", "unsure"])[:n_classes]
    return LogisticRegression(max_iter=500).fit(x, labels[y]), x


@pytest.mark.parametrize("n_classes", [2, 3])
@pytest.mark.parametrize("how", ["npz", "json"])
def test_scikit_learn_logistic_regression_scores_as_predict_proba(tmp_path, n_classes, how):
    model, x = _fit(n_classes)
    activation = "sigmoid" if n_classes == 2 else "softmax"
    if how == "npz":
        blob = npz_bytes(coef_=model.coef_, intercept_=model.intercept_, classes_=model.classes_)
    else:
        blob = json.dumps({"coef_": model.coef_.tolist(), "intercept_": model.intercept_.tolist(),
                           "classes_": model.classes_.tolist()}).encode()
    registry = _registry(tmp_path)
    info = registry.put("lr", blob, activation=activation)
    probe = registry.get("lr").to(dtype=torch.float64)
    got = probe.scores(torch.from_numpy(x)).numpy()
    proba = model.predict_proba(x)
    if n_classes == 2:
        assert info["names"] == [str(model.classes_[1])]  # the class a positive score means
        np.testing.assert_allclose(got[:, 0], proba[:, 1], rtol=1e-5, atol=1e-6)
    else:
        assert info["names"] == [str(c) for c in model.classes_]
        np.testing.assert_allclose(got, proba, rtol=1e-5, atol=1e-6)
    raw = LinearProbe(probe.weight, probe.bias).scores(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(raw.squeeze(-1) if n_classes == 2 else raw,
                               model.decision_function(x), rtol=1e-5, atol=1e-5)


BAD = {
    "wide": (lambda: json.dumps({"weight": np.zeros((2, D + 1)).tolist()}).encode(), "weight"),
    "nan-weight": (lambda: npz_bytes(weight=np.full((2, D), np.nan)), "weight"),
    "inf-bias": (lambda: st_save({"weight": W, "bias": np.array([1, np.inf, 0], np.float32)}),
                 "bias"),
    "bias-shape": (lambda: npz_bytes(weight=W, bias=np.zeros(5)), "bias"),
    "no-weight": (lambda: npz_bytes(other=W), "weight"),
    "both-keys": (lambda: npz_bytes(weight=W, coef_=W), "weight"),
    "names-count": (lambda: json.dumps({"weight": W.tolist(), "names": ["a"]}).encode(),
                    "names"),
    "activation": (lambda: json.dumps({"weight": W.tolist(), "activation": "tanh"}).encode(),
                   "activation"),
    "unknown-key": (lambda: json.dumps({"weight": W.tolist(), "scale": 2}).encode(), "scale"),
    "3d": (lambda: npy_bytes(np.zeros((2, 2, D))), "weight"),
    "pickle": (lambda: pt_bytes({"weight": torch.from_numpy(W), "note": object()}), "body"),
    "garbage": (lambda: b"\x00\x01not a probe at all", "body"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_probe_uploads_are_400s_naming_the_field(tmp_path, case):
    make, param = BAD[case]
    registry = _registry(tmp_path)
    with pytest.raises(ReaderFormatError) as err:
        registry.put("bad", make())
    assert err.value.status == 400 and err.value.param == param, err.value
    assert registry.names() == []


def test_names_formats_and_missing_entries(tmp_path):
    registry = _registry(tmp_path)
    for bad in ("", "../x", "a/b", ".hidden", "x.tmp", "a" * 65):
        with pytest.raises(ReaderNameError):
            registry.put(bad, npy_bytes(W[0]))
    with pytest.raises(ReaderNotFoundError) as err:
        registry.get("absent")
    assert err.value.status == 404 and isinstance(err.value, KeyError)
    with pytest.raises(KeyError):
        registry.lookup("../etc")
    with pytest.raises(ReaderFormatError) as fmt_err:
        registry.put("x", npy_bytes(W[0]), fmt="pickle")
    assert fmt_err.value.param == "format"
    assert sniff_format(b"{\"weight\": [1]}") == "json"


def test_registry_is_the_directory_and_publishes_atomically(tmp_path):
    registry = _registry(tmp_path)
    registry.put("a", npz_bytes(weight=W, bias=B))
    other = _registry(tmp_path)  # another process on the same directory
    assert other.names() == ["a"] and torch.equal(other.get("a").weight, torch.from_numpy(W))
    registry.put("a", npy_bytes(W[1]))  # replaced: the other process sees the new one
    assert other.info("a")["outputs"] == 1
    assert sorted(os.listdir(registry.root)) == ["a.safetensors"]  # no temp files left
    assert [i["name"] for i in other.list()] == ["a"]
    assert other.delete("a") and not registry.delete("a")
    with pytest.raises(ReaderNotFoundError):
        registry.info("a")


def test_a_reader_for_another_width_is_described_but_refused(tmp_path):
    _registry(tmp_path).put("narrow", npz_bytes(weight=W))
    wide = _registry(tmp_path, hidden=D * 2)
    info = wide.info("narrow")
    assert info["d_in"] == D and "hidden size" in info["error"]
    with pytest.raises(ReaderRegistryError):
        wide.lookup("narrow")
    with pytest.raises(ReaderRegistryError):
        wide.get("narrow")


def test_replaced_reader_is_detected_by_its_sha256(tmp_path):
    registry = _registry(tmp_path)
    shape = registry.put("r", npy_bytes(W[0])) and registry.shape("r")
    registry.put("r", npy_bytes(W[1]))
    with pytest.raises(ReaderRegistryError, match="replaced"):
        registry.get("r", sha256=shape.sha256)


def test_stale_temp_files_are_swept_and_young_ones_kept(tmp_path):
    root = tmp_path / "readers"
    root.mkdir()
    old, young, scratch = root / ".a.x.tmp", root / ".b.y.tmp", root / ".c.z.tmp"
    old.write_bytes(b"x")
    young.write_bytes(b"y")
    scratch.mkdir()
    (scratch / "cfg.json").write_text("{}")
    past = time.time() - 7200
    os.utime(old, (past, past))
    os.utime(scratch, (past, past))
    ReaderRegistry(root, hidden_size=D)
    assert sorted(p.name for p in root.iterdir()) == [".b.y.tmp"]
