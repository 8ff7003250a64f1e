"""Request builders and checks shared by the server tests."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import torch

from capsteer.capture import read
from capsteer.reference import hf_activations

ATOL = 1e-4
ALL_HOOKS = {"hooks": ["resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out"],
             "layers": "all", "positions": "all"}
PROMPT = "the quick brown fox jumps over the lazy dog and keeps running"


def capture_dir(server, results: dict) -> Path:
    assert results["status"] == "ok", results
    return server.workdir / "captures" / results["dir"]


def assert_capture_matches_hf(hf_model, directory: Path, fed: list[int] | None = None,
                              steering=None) -> int:
    """Every captured (hook, layer) on disk equals HF on the fed sequence (default: the
    manifest's token ids, for captures of every position). Returns values compared."""
    cap = read(directory)  # verifies sha256 of every file
    prompt_len = int(cap.manifest["prompt_tokens"])
    if fed is None:
        assert cap.positions.tolist() == list(range(int(cap.manifest["fed_tokens"])))
        fed = [int(t) for t in cap.manifest["token_ids"]]
    ref = hf_activations(hf_model, fed, steering=steering, prompt_len=prompt_len)
    positions = torch.as_tensor(cap.positions)
    assert cap.token_ids.tolist() == [fed[p] for p in cap.positions.tolist()]
    compared = 0
    for key, got in cap.tensors().items():
        torch.testing.assert_close(got.float(), ref[key][positions], atol=ATOL, rtol=ATOL,
                                   msg=lambda m, k=key: f"{k}: {m}")
        compared += got.numel()
    assert compared > 0
    return compared


def metric_value(text: str, name: str, **labels: str) -> float:
    """One sample from a Prometheus text exposition (0.0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    pattern = re.compile(rf"^{re.escape(name)}(\{{[^}}]*\}})?\s+(\S+)$", re.M)
    for m in pattern.finditer(text):
        got = (m.group(1) or "{}")[1:-1]
        if ",".join(sorted(got.split(","))) == want or (not want and not got):
            return float(m.group(2))
    return 0.0


def scrape(base_url: str) -> str:
    r = httpx.get(base_url + "/metrics", timeout=30)
    r.raise_for_status()
    return r.text


def wait_for_receipt(http: httpx.Client | str, capture_id: str, timeout_s: float = 60) -> dict:
    """Poll `GET /v1/captures/{id}` until the receipt is no longer pending, or the deadline:
    the last receipt either way (the caller asserts its status). `http` is a client with
    the server's base URL, or the base URL itself."""
    deadline = time.monotonic() + timeout_s
    while True:
        if isinstance(http, str):
            r = httpx.get(f"{http}/v1/captures/{capture_id}", timeout=30)
        else:
            r = http.get(f"/v1/captures/{capture_id}")
        assert r.status_code == 200, r.text
        body = r.json()
        if body["status"] != "pending" or time.monotonic() > deadline:
            return body
        time.sleep(0.05)
