"""Real `capsteer serve` processes on the demo model (and one stock `vllm serve` to compare).

Each server is a subprocess started through the same CLI users run; tests talk to it
with the official openai SDK and httpx. The shared pool keeps one process alive.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import EnginePool

ADMIN_KEY = "test-admin-key"
# The demo model, float32 so captures compare with HF at 1e-4; small prefill chunks.
MODEL_FLAGS = ["--dtype", "float32", "--gpu-memory-utilization", "0.15", "--max-model-len", "512",
               "--max-num-batched-tokens", "64", "--max-num-seqs", "16", "--block-size", "32",
               "--seed", "0", "--served-model-name", "demo"]
START_TIMEOUT_S = 400


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ProcessServer:
    """A long-running server subprocess in its own session, ready once /v1/models answers;
    `close()` stops it and everything it started (engines, API servers)."""

    def __init__(self, argv: list[str], *, cwd: Path, env: dict[str, str], url: str,
                 log_path: Path, start_timeout_s: float = START_TIMEOUT_S) -> None:
        self.url = url
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT,
                                     cwd=cwd, env=env, start_new_session=True)
        self._wait_ready(start_timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.close()
        raise RuntimeError(f"server not ready after {timeout_s:g} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        self._log.close()


class ServerProcess(ProcessServer):
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


@pytest.fixture(scope="session")
def server_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("servers")


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
        "--capture-overload", "block", "--capture-budget", "64KiB",
        "--capture-writer-processes", "2",
        "--capture-wait-timeout", "60", "--admin-key", ADMIN_KEY])


@pytest.fixture
def server(engine_pool, model_dirs, server_root) -> ServerProcess:
    return main_server(engine_pool, model_dirs, server_root)


@pytest.fixture
def reject_server(engine_pool, model_dirs, server_root) -> ServerProcess:
    """capsteer with the reject policy and a tiny budget (admission is the API's job), as a
    dedicated capture server: every request without a capture field is captured."""
    return start_server(engine_pool, model_dirs, server_root, "server-reject", [
        "--capture-dir", str(server_root / "server-reject" / "captures"),
        "--steering-dir", str(server_root / "server-reject" / "vectors"),
        "--capture-overload", "reject", "--capture-budget", "300KiB", "--enforce-eager",
        "--global-capture", "resid_post:0+mlp_out:-1@last_prompt"])


@pytest.fixture
def vanilla_server(engine_pool, model_dirs, server_root) -> ServerProcess:
    """Stock `vllm serve` with the same model and flags."""
    return start_server(engine_pool, model_dirs, server_root, "server-vanilla", ["--vanilla"])


@pytest.fixture
def client(server):
    from openai import OpenAI

    with OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c
