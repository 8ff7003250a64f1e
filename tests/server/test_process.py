"""ManagedServer: ready once /v1/models answers, and closing it ends every process the
server started (an engine left behind would hold the next server's memory)."""

from __future__ import annotations

import os
import sys
import time

import pytest

from capsteer.server.process import ManagedServer, free_port

pytestmark = pytest.mark.proc

# A stand-in server: answers /v1/models after a short start, and starts a grandchild (as
# vllm serve starts engine processes) that ignores SIGINT.
SERVER = r"""
import http.server, os, signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(600)"])
print("grandchild", child.pid, flush=True)
time.sleep(0.5)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/v1/models" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has exited
        return f.read().split()[2] != "Z"


def test_ready_once_it_answers_and_closing_ends_the_whole_session(tmp_path):
    port = free_port()
    server = ManagedServer([sys.executable, "-c", SERVER, str(port)],
                           url=f"http://127.0.0.1:{port}", log_path=tmp_path / "s.log",
                           start_timeout_s=60, stop_timeout_s=5)
    assert server.ready_s >= 0.5
    grandchild = int(server.log_text().split()[1])
    assert _alive(grandchild)
    server.close()
    deadline = time.monotonic() + 10
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(grandchild), "the server's child outlived close()"
    assert server.proc.poll() is not None


def test_a_server_that_exits_before_it_answers_raises_with_its_log(tmp_path):
    with pytest.raises(RuntimeError, match="exited with 3") as info:
        ManagedServer([sys.executable, "-c", "print('no model here'); raise SystemExit(3)"],
                      url=f"http://127.0.0.1:{free_port()}", log_path=tmp_path / "s.log",
                      start_timeout_s=30)
    assert "no model here" in str(info.value)
