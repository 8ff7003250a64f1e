"""Real `capsteer serve` processes on the demo model (and one stock `vllm serve` to compare).

Each server is a subprocess started through the same CLI users run (tests/server/helpers.py
has the harness); tests talk to it with the official openai SDK and httpx. The shared pool
keeps one process alive.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.server.helpers import ServerProcess, main_server, start_server


@pytest.fixture(scope="session")
def server_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("servers")


@pytest.fixture
def server(engine_pool, model_dirs, server_root) -> ServerProcess:
    return main_server(engine_pool, model_dirs, server_root)


@pytest.fixture(scope="session")
def reject_capture_fs(server_root):
    """The reject server's capture root on a small tmpfs of its own (where this process may
    mount one), so a test can fill that disk for real; None elsewhere."""
    root = server_root / "server-reject" / "captures"
    root.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        yield None
        return
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(root)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        yield None
        return
    try:
        yield root
    finally:
        subprocess.run(["umount", "-l", str(root)], check=False)


@pytest.fixture
def reject_server(engine_pool, model_dirs, server_root, reject_capture_fs) -> ServerProcess:
    """capsteer with the reject policy and a tiny budget (admission is the API's job), as a
    dedicated capture server: every request without a capture field is captured. Its
    capture root is a 16 MiB tmpfs where one can be mounted (`reject_capture_fs`)."""
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
