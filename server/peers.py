"""Captures in flight in any API server process of one `capsteer serve`.

vLLM may run several API server processes on one port (`--data-parallel-size N`,
`--api-server-count N`; the kernel spreads connections over them), so the
`GET /v1/captures/{id}` that follows a response can reach a process that never saw
the request. Until the capture's manifest is on disk, only this board tells such a
process that the id is pending rather than unknown (404). One empty-ish file per
capture in a directory private to this server, holding the owner's pid: a marker
left by a process that died does not count.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from capsteer.capture.publish import pid_alive
from capsteer.server.leftovers import RUNTIME_PREFIX, write_owner

log = logging.getLogger("vllm.capsteer.server")
RUNTIME_ENV = "CAPSTEER_SERVE_RUNTIME_DIR"  # set by `capsteer serve`, inherited by API servers


def make_runtime_dir() -> str:
    """A directory shared by this server's processes, removed when the launcher exits; its
    owner file lets the next server sweep it (and vLLM's shared memory) after a SIGKILL."""
    import atexit

    path = tempfile.mkdtemp(prefix=RUNTIME_PREFIX)
    write_owner(Path(path))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


class PeerBoard:
    """Pending capture ids of every API server process (capture ids are validated slugs)."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory) / "pending"
        self.dir.mkdir(parents=True, exist_ok=True)
        self._pid = str(os.getpid()).encode()

    @classmethod
    def from_env(cls) -> PeerBoard | None:
        path = os.environ.get(RUNTIME_ENV)
        return cls(path) if path else None

    def add(self, capture_id: str) -> None:
        try:
            fd = os.open(self.dir / capture_id, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, self._pid)
            finally:
                os.close(fd)
        except OSError:  # GET from another process answers 404 until durable; say why once
            log.exception("capsteer: cannot mark capture %s pending for the other API "
                          "servers", capture_id)

    def remove(self, capture_id: str) -> None:
        try:
            os.unlink(self.dir / capture_id)
        except OSError:
            pass

    def holds(self, capture_id: str) -> bool:
        try:
            pid = int((self.dir / capture_id).read_bytes() or b"0")
        except (OSError, ValueError):
            return False
        return pid > 0 and pid_alive(pid)
