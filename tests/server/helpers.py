"""The server harness (a server process that is ready once it answers, stopped with all it
started) and the request builders and checks shared by the server tests."""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import httpx
import torch

from capsteer.capture import read
from capsteer.reference import hf_activations
from capsteer.server.process import ManagedServer, free_port
from tests.conftest import EnginePool

ADMIN_KEY = "test-admin-key"
# The demo model, float32 so captures compare with HF at 1e-4; small prefill chunks. A fixed
# 256 MiB KV cache (as the engine tests): a memory fraction zeroes gigabytes per engine.
MODEL_FLAGS = ["--dtype", "float32", "--kv-cache-memory-bytes", str(256 << 20),
               "--max-model-len", "512",
               "--max-num-batched-tokens", "64", "--max-num-seqs", "16", "--block-size", "32",
               "--seed", "0", "--served-model-name", "demo"]
START_TIMEOUT_S = 400


class ServerProcess(ManagedServer):
    """`capsteer serve` on a demo model with the test flags, on a free port."""

    def __init__(self, model_dir: str, workdir: Path, extra: list[str], name: str,
                 start_timeout_s: float = START_TIMEOUT_S) -> None:
        self.port = free_port()
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "capsteer.cli", "serve", model_dir, *MODEL_FLAGS,
               "--host", "127.0.0.1", "--port", str(self.port), *extra]
        super().__init__(cmd, cwd=workdir, env={**os.environ, "VLLM_LOGGING_LEVEL": "INFO"},
                         url=f"http://127.0.0.1:{self.port}", log_path=workdir / f"{name}.log",
                         start_timeout_s=start_timeout_s)



def start_server(pool: EnginePool, model_dirs, server_root: Path, name: str,
                 extra: list[str]) -> ServerProcess:
    return pool.get(("server", name), lambda: ServerProcess(
        model_dirs["qwen3"], server_root / name, extra, name))


def main_server(pool: EnginePool, model_dirs, server_root: Path) -> ServerProcess:
    """capsteer with the block policy and a budget smaller than most captures (they spill),
    published by two writer processes (the default on hosts of 8 or more CPUs)."""
    return start_server(pool, model_dirs, server_root, "server", [
        "--capture-dir", str(server_root / "server" / "captures"),
        "--steering-dir", str(server_root / "server" / "vectors"),
        "--readers-dir", str(server_root / "server" / "readers"),
        "--capture-overload", "block", "--capture-budget", "64KiB",
        "--capture-writer-processes", "2",
        "--capture-wait-timeout", "60", "--admin-key", ADMIN_KEY])


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


def greedy_ids(client, prompt: list[int], steering: dict | None, max_tokens: int = 12) -> list[int]:
    """Greedy token ids of a completion through the OpenAI SDK, steered if given."""
    extra: dict = {"return_token_ids": True}
    if steering is not None:
        extra["steering"] = steering
    out = client.completions.create(model="demo", prompt=prompt, max_tokens=max_tokens,
                                    temperature=0, extra_body=extra)
    return list(out.choices[0].token_ids)
