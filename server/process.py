"""A server (`capsteer serve`, `vllm serve`, or a shell line that runs one) as a child
process: started in its own session, ready once `GET /v1/models` answers, and stopped
with every process it started. Tests, benchmarks and GPU checks drive servers through it,
so a server left holding memory or a port after its run is fixed in one place."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ManagedServer:
    """`argv` running in its own session with its output in `log_path`; the constructor
    returns once `url` answers (`ready_s` says after how long) or raises RuntimeError with
    the log's tail."""

    def __init__(self, argv: Sequence[str], *, url: str, log_path: Path,
                 cwd: Path | None = None, env: Mapping[str, str] | None = None,
                 start_timeout_s: float = 400.0, stop_timeout_s: float = 60.0) -> None:
        self.url = url
        self.log_path = Path(log_path)
        self.stop_timeout_s = stop_timeout_s
        self._log = open(self.log_path, "wb")
        started = time.monotonic()
        self.proc = subprocess.Popen(list(argv), stdout=self._log, stderr=subprocess.STDOUT,
                                     cwd=cwd, env=None if env is None else dict(env),
                                     start_new_session=True)
        try:
            self._wait_ready(start_timeout_s)
        except BaseException:
            self.close()
            raise
        self.ready_s = time.monotonic() - started

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n"
                                   f"{self.log_tail()}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)  # a start takes 12-30 s on CPU: poll often enough to lose little
        raise RuntimeError(f"server not ready after {timeout_s:g} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def close(self) -> None:
        """SIGINT (vLLM shuts its engines down), then SIGKILL for whatever of the session
        is left: an engine process outliving its server would hold the next one's memory."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(self.stop_timeout_s)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(30)
        self._log.close()
