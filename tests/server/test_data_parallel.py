"""`capsteer serve --data-parallel-size 2`: vLLM's own DP (two engine processes, two API
server processes on one port, internal load balancing) behind one capture root.

One server for the module (two engines on a small CPU machine start slowly). Checked:
concurrent chat and completion captures (prompt, generated and all positions, some
steered) from both ranks are each on disk exactly once and equal HF; the output length
of a generated-position capture reaches the rank holding it (else the worker's 60 s
fallback would outlast the 30 s wait); receipts are found from either API server,
pending ones too; /metrics has every capsteer family once with deployment totals; the
DP layouts capsteer does not serve are refused by name.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys

import httpx
import pytest

from capsteer.capture.paths import find_capture_dirs
from capsteer.steering.spec import parse_steering_spec

from .helpers import ServerProcess, assert_capture_matches_hf, capture_dir, wait_for_receipt

NAME = "server-dp2"
HIDDEN, LAYERS = 128, 4
START_TIMEOUT_S = 900  # two engines start on two shared cores
ALL = {"hooks": ["resid_post", "mlp_out"], "layers": "all", "positions": "all"}
GENERATED = {"hooks": ["resid_mid"], "layers": [0, -1], "positions": "generated"}
PROMPT_ONLY = {"hooks": {"resid_pre": [1]}, "positions": "prompt", "layout": "per_file"}
STEER = {"vectors": [{"hook": "resid_post", "layer": 1, "scale": 3.0,
                      "vector": [((i * 37) % 11 - 5) / 5.0 for i in range(HIDDEN)]}]}


@pytest.fixture
def dp_server(engine_pool, model_dirs, server_root) -> ServerProcess:
    root = server_root / NAME
    return engine_pool.get(("server", NAME), lambda: ServerProcess(
        model_dirs["qwen3"], root, [
            # Eager: two engines compiling on two shared cores took 67-75 s of CI; the DP path
            # (ranks, API servers, receipts, metrics) is the same either way, and compiled
            # captures are covered by the single-engine server and engine tests.
            "--enforce-eager",
            "--data-parallel-size", "2", "--capture-dir", str(root / "captures"),
            "--steering-dir", str(root / "vectors"), "--capture-wait-timeout", "30"], NAME,
        start_timeout_s=START_TIMEOUT_S))


def _request(i: int) -> tuple[str, dict]:
    """Request i of the mix: chat or completion; all / generated / prompt positions;
    every third steered."""
    capture = (ALL, GENERATED, PROMPT_ONLY)[i % 3]
    extra: dict = {"capture": capture, "capture_wait": True, "return_token_ids": True}
    if i % 4 == 1:
        extra["steering"] = STEER
    words = " ".join(f"w{(i * 7 + k) % 23}" for k in range(3 + i % 5))
    if i % 2:
        return "chat", {"messages": [{"role": "user", "content": words}], **extra}
    return "completion", {"prompt": words, **extra}


async def _send(client, i: int):
    kind, body = _request(i)
    extra = {k: v for k, v in body.items() if k not in ("messages", "prompt")}
    if kind == "chat":
        return await client.chat.completions.create(
            model="demo", messages=body["messages"], max_tokens=5, temperature=0,
            extra_body=extra)
    return await client.completions.create(model="demo", prompt=body["prompt"], max_tokens=5,
                                           temperature=0, extra_body=extra)


def _tokens(resp) -> tuple[list[int], list[int]]:
    """(prompt, output) token ids (vLLM's return_token_ids; chat has the prompt on top)."""
    prompt = resp.model_extra.get("prompt_token_ids") or resp.choices[0].prompt_token_ids
    return list(prompt), list(resp.choices[0].token_ids)


def _families(text: str) -> list[str]:
    from prometheus_client.parser import text_string_to_metric_families

    return [f.name for f in text_string_to_metric_families(text)]


def _sample(text: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    found = [s.value for f in text_string_to_metric_families(text) for s in f.samples
             if s.name == name and s.labels == labels]
    assert len(found) <= 1, (name, labels, found)
    return found[0] if found else 0.0


@pytest.mark.server
@pytest.mark.uses_engine(NAME)
def test_captures_from_both_ranks_once_each_equal_hf(dp_server, hf_models):
    from openai import AsyncOpenAI

    n = 18
    before = httpx.get(dp_server.url + "/metrics", timeout=60).text

    async def run_all():
        async with AsyncOpenAI(base_url=dp_server.url + "/v1", api_key="none", max_retries=0,
                               timeout=300) as client:
            return await asyncio.gather(*[_send(client, i) for i in range(n)])
    responses = asyncio.run(run_all())

    results = [r.model_extra["capture_results"] for r in responses]
    assert [r["status"] for r in results] == ["ok"] * n, results
    ids = [r["capture_id"] for r in results]
    assert len(set(ids)) == n
    root = dp_server.workdir / "captures"
    for cid in ids:
        assert len(find_capture_dirs(root, cid)) == 1, cid
    on_disk = sorted(p.name for p in root.glob("*/*/*") if p.is_dir())
    assert on_disk == sorted(ids)  # nothing else, nothing twice

    # Both ranks wrote: every manifest names the worker its writer process publishes for;
    # two engines, two workers.
    writers = set()
    with httpx.Client(base_url=dp_server.url, timeout=60) as http:
        for cid in ids:
            body = http.get(f"/v1/captures/{cid}").json()
            assert body["status"] == "ok" and body["capture_id"] == cid
            writer = body["manifest_data"]["writer"]
            assert writer["pid"] != writer["engine_pid"]  # the worker's writer process
            writers.add(writer["engine_pid"])
    worker_pids = {int(p) for p in re.findall(
        r"\((?:Worker|EngineCore)\w* pid=(\d+)\).*capsteer: hooks installed",
        dp_server.log_text())}
    assert len(worker_pids) == 2, worker_pids
    assert writers == worker_pids

    steer_spec = parse_steering_spec(STEER, num_layers=LAYERS, hidden_size=HIDDEN)
    for i, (resp, res) in enumerate(zip(responses, results, strict=True)):
        body = _request(i)[1]
        directory = capture_dir(dp_server, res)
        steering = steer_spec if "steering" in body else None
        capture = body["capture"]
        prompt, output = _tokens(resp)
        fed = prompt + output[:-1]  # the last output token is never fed
        if capture is PROMPT_ONLY:
            fed = prompt
            assert res["positions"] == len(prompt)
        elif capture is GENERATED:  # ended where the response ended: the end report arrived
            assert res["positions"] == len(output) - 1
        else:
            assert res["positions"] == len(fed)
        assert_capture_matches_hf(hf_models["qwen3"], directory,
                                  fed=None if capture is ALL else fed, steering=steering)
    assert "no output length from the front end" not in dp_server.log_text()

    # Metrics: each capsteer family once, totals over both engines and both API servers,
    # whichever API server answers the scrape.
    steered = sum("steering" in _request(i)[1] for i in range(n))
    on_disk_bytes = sum((capture_dir(dp_server, r) / f).stat().st_size
                        for r in results for f in r["files"])
    for _ in range(6):  # a fresh connection each: the kernel spreads them over the API servers
        after = httpx.get(dp_server.url + "/metrics", timeout=60,
                          headers={"Connection": "close"}).text
        names = _families(after)
        capsteer = [f for f in names if f.startswith("capsteer_")]
        assert len(names) == len(set(names)), sorted(f for f in names if names.count(f) > 1)
        assert len(capsteer) == 16, capsteer  # graph replays: an empty family on CPU
        assert len(re.findall(r"^# TYPE capsteer_", after, re.M)) == 16
        # Both engines' ring waits in one sample (a CPU engine has no harvest slot).
        waits = re.findall(r"^capsteer_capture_engine_wait_seconds_total\{(.*)\} ", after, re.M)
        assert waits == ['wait="writer_ring"'], waits

        def delta(name: str, text: str = after, **labels: str) -> float:
            return _sample(text, name, **labels) - _sample(before, name, **labels)
        assert delta("capsteer_capture_requests_total", status="ok") == n
        assert delta("capsteer_capture_publish_seconds_count") == n
        assert delta("capsteer_capture_files_total") == sum(len(r["files"]) for r in results)
        assert delta("capsteer_capture_bytes_total") == on_disk_bytes
        assert delta("capsteer_steering_requests_total") == steered
        assert delta("capsteer_steering_refused_total") == 0  # every steered request steered
        assert _sample(after, "capsteer_capture_inflight_bytes") == 0
        assert "vllm:prompt_tokens_total" in after


@pytest.mark.server
@pytest.mark.uses_engine(NAME)
def test_pending_receipt_from_any_api_server(dp_server):
    """While a capture is in flight, a receipt lookup on a fresh connection (either API
    server) answers pending, never 404; then ok."""
    max_tokens = 480  # as long as --max-model-len 512 allows: the lookups race its end
    body = {"model": "demo", "prompt": "count with me: one two three", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "capture": {"hooks": ["resid_post"], "layers": [0], "positions": "generated"}}
    attempts = []
    for _ in range(10):  # CI once saw five attempts in a row end before the first lookup
        statuses = []
        with httpx.stream("POST", dp_server.url + "/v1/completions", json=body, timeout=120) as r:
            cid = r.headers["x-capsteer-capture-id"]
            lines = r.iter_lines()
            # Look up at once, before reading a token: the headers leave when the request
            # is admitted. The server still writes ahead of this client, and on this 2-core
            # machine the test process can stall for seconds under load (CI: 'ok' on the
            # first lookup, twice), so a capture that already ended is retried, not failed.
            for _ in range(8):
                got = httpx.get(f"{dp_server.url}/v1/captures/{cid}", timeout=30,
                                headers={"Connection": "close"})
                assert got.status_code == 200, got.text
                statuses.append(got.json()["status"])
            final = [json.loads(line[6:]) for line in lines if line.startswith("data: {")][-1]
        assert set(statuses) <= {"pending", "ok"}, statuses
        assert final["capture_results"]["capture_id"] == cid
        attempts.append(statuses)
        if statuses[0] == "pending":
            break
    assert attempts[-1][0] == "pending", f"every capture had ended at the first lookup: {attempts}"
    got = wait_for_receipt(dp_server.url, cid)
    assert got["status"] == "ok" and got["positions"] == max_tokens - 1
    missing = httpx.get(f"{dp_server.url}/v1/captures/cap-none", timeout=30)
    assert missing.status_code == 404


REFUSED_DP_MODES = [
    (["--data-parallel-size", "2", "--data-parallel-external-lb", "--data-parallel-rank", "0"],
     "--data-parallel-external-lb"),
    (["--data-parallel-size", "2", "--data-parallel-rank=1"], "--data-parallel-rank"),
    (["-dp", "4", "--data-parallel-size-local", "2", "--data-parallel-start-rank", "2"],
     "--data-parallel-start-rank"),
    (["--data-parallel-size", "2", "--data-parallel-hybrid-lb"], "--data-parallel-hybrid-lb"),
    (["-dp", "2", "--data-parallel-size-local=1"], "--data-parallel-size-local 1"),
    (["--data-parallel-size", "2", "--headless"], "--headless"),
    (["--data-parallel-size", "2", "--data-parallel-backend", "ray"],
     "--data-parallel-backend ray"),
]


@pytest.fixture(scope="module")
def refused_dp_runs(tmp_path_factory) -> dict[tuple[str, ...], tuple[int, str]]:
    """(exit status, stderr) of `capsteer serve` per refused layout, all started at once:
    each run is mostly a Python start-up, so seven in a row cost ~4 s each."""
    procs = {}
    for n, (flags, _) in enumerate(REFUSED_DP_MODES):
        cwd = tmp_path_factory.mktemp(f"dp-refused-{n}")
        procs[tuple(flags)] = subprocess.Popen(
            [sys.executable, "-m", "capsteer.cli", "serve", str(cwd), *flags],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=cwd)
    try:
        runs = {}
        for flags, proc in procs.items():
            stderr = proc.communicate(timeout=120)[1]
            runs[flags] = (proc.returncode, stderr)
        return runs
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("flags, named", REFUSED_DP_MODES)
def test_unsupported_dp_modes_are_refused_by_name(refused_dp_runs, flags, named):
    returncode, stderr = refused_dp_runs[tuple(flags)]
    assert returncode != 0
    assert named in stderr and "not supported" in stderr, stderr


def test_resolved_dp_configs_are_checked_by_name():
    """What the flags resolve to (a config file can set them too) is checked again in the
    API server and the workers."""
    from vllm.config import ParallelConfig

    from capsteer.engine_ext.vllm.refusals import data_parallel_problem

    assert data_parallel_problem(ParallelConfig(data_parallel_size=1)) is None
    assert data_parallel_problem(ParallelConfig(data_parallel_size=2,
                                                data_parallel_size_local=2)) is None
    cases = {
        "--data-parallel-external-lb": dict(data_parallel_external_lb=True,
                                            data_parallel_size_local=1),
        "--data-parallel-hybrid-lb": dict(data_parallel_hybrid_lb=True,
                                          data_parallel_size_local=1),
        "--data-parallel-size-local 1 of --data-parallel-size 2": dict(
            data_parallel_size_local=1),
    }
    for named, kwargs in cases.items():
        problem = data_parallel_problem(ParallelConfig(data_parallel_size=2, **kwargs))
        assert problem is not None and named in problem, problem


def test_reject_budget_is_shared_by_the_api_servers():
    from capsteer.config.server import ServerSettings
    from capsteer.engine_ext.vllm.topology import Topology
    from capsteer.server.state import admission_budget

    settings = ServerSettings(capture_budget=1 << 20)
    assert admission_budget(settings, Topology(1, 1, 0)) == 1 << 20
    assert admission_budget(settings, Topology(2, 2, 0)) == 1 << 20  # vLLM's default
    assert admission_budget(settings, Topology(2, 1, 0)) == 2 << 20
    assert admission_budget(settings, Topology(2, 4, 3)) == 1 << 19
