"""A full disk and the reject policy's account (issue 60 items 2-4), on a real server whose
capture root is a real 16 MiB tmpfs.

- Every receipt is final within a bound even when the disk refuses the error manifest
  itself; /metrics counts what the receipts say; the reject budget comes back whole.
- The reject policy reserves what a capture will hold: the prompt counted by the served
  tokenizer, as vLLM counts it.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from pathlib import Path

import httpx
import pytest

from capsteer.engine_ext.vllm.serve import TokenizerSource
from capsteer.server.prompt_tokens import PromptCounter
from capsteer.server.tracker import ASK_AFTER_S

pytestmark = [pytest.mark.server, pytest.mark.uses_engine("server-reject")]

# 4 layers x 128 floats: 2 KiB of rows per position for resid_post on every layer.
EVERY_LAYER = {"hooks": ["resid_post"], "layers": "all", "positions": "all"}
ROW_BYTES = 4 * 128 * 4
FINAL_WITHIN_S = 2 * ASK_AFTER_S + 3.0  # the documented bound, plus this busy host's slack


def _metric(text: str, name: str, **labels: str) -> float:
    label = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = rf"^{re.escape(name)}{re.escape('{' + label + '}') if label else ''} (\S+)$"
    found = re.search(pattern, text, re.M)
    return float(found.group(1)) if found else 0.0


def _metrics(url: str) -> str:
    return httpx.get(url + "/metrics", timeout=30).text


def _fill(fs_root: Path) -> list[Path]:
    """Take every free page of the filesystem (not even a manifest fits)."""
    made = []
    free = os.statvfs(fs_root).f_bavail * os.statvfs(fs_root).f_frsize
    big = fs_root / "filler"
    big.write_bytes(b"\0" * free)
    made.append(big)
    try:
        while True:
            crumb = fs_root / f"crumb-{len(made)}"
            made.append(crumb)
            crumb.write_bytes(b"\0" * 4096)
    except OSError:
        pass
    return made


def _complete(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=120, json={
        "model": "demo", "temperature": 0, "ignore_eos": True, **body})


def _burst(url: str, n: int, **body) -> list[httpx.Response]:
    async def send() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            return list(await asyncio.gather(*(client.post(url + "/v1/completions", json={
                "model": "demo", "temperature": 0, "ignore_eos": True, **body})
                for _ in range(n))))
    return asyncio.run(send())


def test_a_full_disk_ends_every_receipt_and_frees_the_budget(reject_server, reject_capture_fs):
    if reject_capture_fs is None:
        pytest.skip("mounting a tmpfs needs root (CAP_SYS_ADMIN)")
    url = reject_server.url
    before = _metrics(url)
    made = _fill(reject_capture_fs)
    try:
        started = time.monotonic()
        responses = _burst(url, 4, prompt="the disk is full", max_tokens=4, capture_wait=True)
        elapsed = time.monotonic() - started
        assert [r.status_code for r in responses] == [200] * 4, [r.text for r in responses]
        receipts = [r.json()["capture_results"] for r in responses]
        for receipt in receipts:  # final in the response itself, not pending
            assert receipt["status"] == "error", receipt
            assert "No space left" in receipt["error"], receipt
            assert "could not be written" in receipt["error"], receipt
        assert elapsed < FINAL_WITHIN_S + 10, elapsed  # generation plus the bound
        for receipt in receipts:
            got = httpx.get(f"{url}/v1/captures/{receipt['capture_id']}", timeout=30)
            assert got.status_code == 200 and got.json()["status"] == "error", got.text
        after = _metrics(url)
        errors = (_metric(after, "capsteer_capture_requests_total", status="error")
                  - _metric(before, "capsteer_capture_requests_total", status="error"))
        assert errors == 4  # the metric and the receipts agree
        assert _metric(after, "capsteer_capture_admitted_bytes") == 0
    finally:
        for path in made:
            path.unlink(missing_ok=True)
    # Space is back: the whole budget admits a capture as large as it (a leaked
    # reservation would answer 429), and the kept error manifests reach the disk.
    time.sleep(1.1)
    big = _complete(url, prompt=list(range(10, 110)), max_tokens=40, capture=EVERY_LAYER,
                    capture_wait=True)
    assert big.status_code == 200, big.text
    assert big.json()["capture_results"]["status"] == "ok", big.json()["capture_results"]
    on_disk = {json.loads(p.read_text())["capture_id"]: json.loads(p.read_text())
               for p in reject_capture_fs.rglob("manifest.json")}
    for receipt in receipts:
        assert on_disk[receipt["capture_id"]]["status"] == "error"


def test_reject_reserves_what_the_capture_holds(reject_server):
    """100 prompt tokens + 40 new on every layer: 278 KiB of rows, admitted under a
    300 KiB budget (the byte bound reserved ~1.1 MB for the same request and refused it
    with 400); with 60 new tokens (318 KiB) it is more than the whole budget."""
    url = reject_server.url
    body = {"prompt": list(range(10, 110)), "max_tokens": 40, "capture": EVERY_LAYER,
            "capture_wait": True}
    one = _complete(url, **body)
    assert one.status_code == 200, one.text
    results = one.json()["capture_results"]
    assert results["status"] == "ok", results
    assert results["bytes"] >= (100 + 39) * ROW_BYTES  # rows, plus positions and token ids
    over = _complete(url, **{**body, "max_tokens": 60})
    assert over.status_code == 400, over.text
    assert f"needs up to {(100 + 59) * ROW_BYTES} bytes" in over.json()["error"]["message"]


def test_prompt_counts_are_vllms(reject_server, model_dirs):
    """The counter the reject policy uses agrees with vLLM's usage.prompt_tokens."""
    url = reject_server.url
    counter = PromptCounter(TokenizerSource(model_dirs["qwen3"], None, False, None))
    chats = [
        [{"role": "user", "content": "hello world"}],
        [{"role": "system", "content": "you are a probe"},
         {"role": "user", "content": "what is a residual stream " * 20}],
        [{"role": "user", "content": [{"type": "text", "text": "steer the"},
                                      {"type": "text", "text": "vector"}]}],
    ]
    for messages in chats:
        body = {"model": "demo", "messages": messages, "max_tokens": 1}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert counter.count(body) == r.json()["usage"]["prompt_tokens"], messages
    for prompt in ["the quick brown fox", "w1 w2 w3 " * 50, list(range(20, 57))]:
        body = {"model": "demo", "prompt": prompt, "max_tokens": 1}
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert counter.count(body) == r.json()["usage"]["prompt_tokens"], prompt
