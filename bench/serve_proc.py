"""A server process for the benchmarks that go through HTTP: a free port, waiting until it
answers, and stopping it with every process it started."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, url: str, log: Path, timeout: float) -> float:
    """Seconds until GET /v1/models answers; RuntimeError (with the log's tail) when the
    server exits first or `timeout` passes."""
    import httpx

    t0 = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}):\n"
                               + log.read_text(errors="replace")[-6000:])
        try:
            if httpx.get(url + "/v1/models", timeout=2).is_success:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"the server did not start in {timeout:.0f} s")
        time.sleep(1)


def stop(proc: subprocess.Popen) -> None:
    """SIGINT the server (started with start_new_session), then SIGKILL its whole group:
    engine processes it started may outlive it and hold the GPU memory the next needs."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(90)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
