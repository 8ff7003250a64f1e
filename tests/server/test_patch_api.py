"""Activation patching through the API (api.md §7): a capture request with capture_wait,
then `op: patch` requests reading it; equal to HF with the captured values, plain
requests beside it unchanged, bad sources a 400 naming the field with nothing written."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from capsteer.capture import read
from capsteer.reference import hf_greedy, hf_patched

from .helpers import capture_dir, metric_value, scrape

pytestmark = [pytest.mark.server, pytest.mark.uses_engine("server")]
SOURCE_IDS = [40, 7, 311, 95, 260, 18, 133, 72, 9, 201, 150, 66, 3, 287]
PROMPT_IDS = [17, 250, 33, 98, 141, 5, 77, 300, 12, 64, 199, 8]
LOGPROB_ATOL = 1e-3
TOKENS = 16


def _capture(client) -> dict:
    """A prompt-only capture of resid_post 1 and mlp_out 2, durable before the answer."""
    res = client.completions.create(
        model="demo", prompt=SOURCE_IDS, max_tokens=2, temperature=0,
        extra_body={"capture": {"hooks": {"resid_post": [1], "mlp_out": [2]},
                                "positions": "prompt"}, "capture_wait": True})
    results = res.model_extra["capture_results"]
    assert results["status"] == "ok", results
    return results


def _patch(capture_id: str, hook: str = "resid_post", layer: int = 1,
           positions: list[int] | None = None) -> dict:
    return {"op": "patch", "hook": hook, "layer": layer,
            "source": {"capture_id": capture_id, "positions": positions or [2, 3, 4, 5]}}


def _complete(client, prompt: list[int], steering: dict | None = None, **kw):
    extra = {"return_token_ids": True}
    if steering is not None:
        extra["steering"] = steering
    return client.completions.create(model="demo", prompt=prompt, temperature=0,
                                     extra_body=extra, **kw)


def test_patch_from_a_capture_equals_hf_and_leaves_plain_requests_alone(server, client,
                                                                          hf_models):
    hf = hf_models["qwen3"]
    results = _capture(client)
    cap = read(capture_dir(server, results))
    index = {int(p): i for i, p in enumerate(cap.positions)}
    resid_at, mlp_at = [2, 3, 4, 5], [8, 13]  # 13: a generated position
    steering = {"vectors": [_patch(results["capture_id"], positions=resid_at),
                            _patch(results["capture_id"], "mlp_out", 2, mlp_at)]}

    def rows(hook: str, layer: int, at: list[int]) -> torch.Tensor:
        return cap.tensor(hook, layer)[[index[p] for p in at]].float()

    with ThreadPoolExecutor(3) as pool:  # one batch: plain requests beside the patched one
        futures = [pool.submit(_complete, client, PROMPT_IDS, s, max_tokens=TOKENS, logprobs=1)
                   for s in (None, steering, None)]
        plain, patched, plain2 = (f.result().choices[0] for f in futures)
    with hf_patched(hf, [("resid_post", 1, resid_at, rows("resid_post", 1, resid_at)),
                         ("mlp_out", 2, mlp_at, rows("mlp_out", 2, mlp_at))]):
        ref_tokens, ref_lps = hf_greedy(hf, PROMPT_IDS, TOKENS)
    assert list(patched.token_ids) == ref_tokens
    for step, (token, lp) in enumerate(zip(ref_tokens, patched.logprobs.token_logprobs,
                                           strict=True)):
        assert abs(lp - float(ref_lps[step][token])) < LOGPROB_ATOL, step
    forced = _complete(client, PROMPT_IDS + ref_tokens, steering, max_tokens=1, echo=True,
                       logprobs=0).choices[0]
    fed_lps = forced.logprobs.token_logprobs[len(PROMPT_IDS):len(PROMPT_IDS) + TOKENS]
    for step, (token, lp) in enumerate(zip(ref_tokens, fed_lps, strict=True)):
        assert abs(lp - float(ref_lps[step][token])) < LOGPROB_ATOL, ("teacher-forced", step)
    plain_ref, plain_lps = hf_greedy(hf, PROMPT_IDS, TOKENS)
    assert list(patched.token_ids) != plain_ref, "the patch changed nothing"
    for res in (plain, plain2):
        assert list(res.token_ids) == plain_ref
        for step, (token, lp) in enumerate(zip(plain_ref, res.logprobs.token_logprobs,
                                               strict=True)):
            assert abs(lp - float(plain_lps[step][token])) < LOGPROB_ATOL, ("plain", step)


def _other_model_copy(server, results: dict) -> str:
    """The same capture published again under a new id, as if taken from another model."""
    src = capture_dir(server, results)
    capture_id = results["capture_id"] + "-other"
    dst = src.parent / capture_id
    shutil.copytree(src, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    manifest.update(capture_id=capture_id, model="another-model")
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return capture_id


def test_bad_patch_sources_get_400_naming_the_field_and_write_nothing(server, client, http):
    results = _capture(client)
    cid = results["capture_id"]
    other = _other_model_copy(server, results)
    bad = [
        ("missing capture", _patch("cap-" + "0" * 32), "steering.vectors[0].source.capture_id"),
        ("not a capture id", _patch("../etc"), "steering.vectors[0].source.capture_id"),
        ("hook not captured", _patch(cid, "resid_mid", 1), "steering.vectors[0].hook"),
        ("layer not captured", _patch(cid, "resid_post", 2), "steering.vectors[0].layer"),
        ("positions not captured", _patch(cid, positions=[3, len(SOURCE_IDS) + 5]),
         "steering.vectors[0].source.positions"),
        ("capture of another model", _patch(other), "steering.vectors[0].source.capture_id"),
        ("no positions", {**_patch(cid), "source": {"capture_id": cid}},
         "steering.vectors[0].source.positions"),
        ("a vector beside the patch", {**_patch(cid), "vector": [0.0] * 128},
         "steering.vectors[0]"),
        ("patched twice", [_patch(cid, positions=[2, 3]), _patch(cid, positions=[3])],
         "steering.vectors"),
    ]
    root = server.workdir / "captures"
    files_before = sorted(p for p in root.rglob("*"))
    before = scrape(server.url)
    for label, item, param in bad:
        items = item if isinstance(item, list) else [item]
        body = {"model": "demo", "prompt": PROMPT_IDS, "max_tokens": 2,
                "steering": {"vectors": items}}
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 400, (label, r.status_code, r.text)
        error = r.json()["error"]
        assert error["param"] == param, (label, error)
        assert error["message"], label
    assert "another-model" in http.post("/v1/completions", json={
        "model": "demo", "prompt": PROMPT_IDS, "max_tokens": 2,
        "steering": {"vectors": [_patch(other)]}}).json()["error"]["message"]
    after = scrape(server.url)
    assert sorted(p for p in root.rglob("*")) == files_before
    for name in ("vllm:prompt_tokens_total", "vllm:request_success_total"):
        assert metric_value(after, name, model_name="demo") == metric_value(
            before, name, model_name="demo"), name
