"""Overload: `reject` answers 429 with Retry-After; `block` completes every capture."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from capsteer.capture import read

from .helpers import ALL_HOOKS, PROMPT, capture_dir

# 2 keys x 512 B per position; with LONG new tokens ~135 KiB a request: two fit in 300 KiB.
SMALL = {"hooks": ["resid_post"], "layers": [0, 1], "positions": "all"}
LONG = 120


def _body(capture: dict, max_tokens: int) -> dict:
    return {"model": "demo", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "capture": capture, "capture_wait": True}


def _post(url: str, capture: dict, max_tokens: int = 16) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=120, json=_body(capture, max_tokens))


def _burst(url: str, capture: dict, n: int, max_tokens: int = 16) -> list[httpx.Response]:
    """n requests sent at once from one event loop: threads of this (busy) test process
    can be let run one at a time, so a thread pool's requests need not overlap."""
    async def send() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            return list(await asyncio.gather(*(
                client.post(url + "/v1/completions", json=_body(capture, max_tokens))
                for _ in range(n))))

    return asyncio.run(send())


@pytest.mark.server
@pytest.mark.uses_engine("server-reject")
def test_reject_policy_answers_429_and_stays_healthy(reject_server):
    url = reject_server.url
    responses = _burst(url, SMALL, 8, max_tokens=LONG)
    codes = [r.status_code for r in responses]
    assert 429 in codes and 200 in codes, codes
    assert set(codes) <= {200, 429}, codes
    for r in responses:
        if r.status_code == 429:
            assert int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["param"] == "capture"
        else:
            assert r.json()["capture_results"]["status"] == "ok"
    too_big = _post(url, ALL_HOOKS, max_tokens=64)
    assert too_big.status_code == 400 and "budget" in too_big.json()["error"]["message"]
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    assert _post(url, SMALL).status_code == 200  # the budget was freed
    # Requests vLLM itself refuses (400) after admission reserved their bytes (three would
    # hold more than the budget): no capture id reaches the client, and the reservations
    # are freed (vLLM validates before any engine sees a request).
    for _ in range(3):
        refused = httpx.post(url + "/v1/completions", timeout=60,
                             json={**_body(SMALL, LONG), "temperature": -1.0})
        assert refused.status_code == 400, refused.text
        assert "x-capsteer-capture-id" not in refused.headers
    deadline = time.monotonic() + 30
    while (code := _post(url, SMALL).status_code) == 429 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert code == 200
    metrics = httpx.get(url + "/metrics", timeout=30).text
    assert f"capsteer_capture_rejected_total {float(codes.count(429))}" in metrics


@pytest.mark.server
@pytest.mark.uses_engine("server")
def test_block_policy_completes_every_capture(server):
    """64 KiB budget, eight concurrent captures of ~200 KB each: the writer spills, all land.
    The server runs two writer processes (32 KiB each): both publish, neither is the engine."""
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda _: _post(server.url, ALL_HOOKS, max_tokens=8), range(8)))
    assert [r.status_code for r in responses] == [200] * 8
    publishers, engines = set(), set()
    for r in responses:
        results = r.json()["capture_results"]
        assert results["status"] == "ok", results
        cap = read(capture_dir(server, results))
        assert len(cap.positions) == r.json()["usage"]["prompt_tokens"] + 7
        assert results["bytes"] > 64 * 1024
        publishers.add(cap.manifest["writer"]["pid"])
        engines.add(cap.manifest["writer"]["engine_pid"])
    assert len(publishers) == 2 and len(engines) == 1 and not publishers & engines
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
