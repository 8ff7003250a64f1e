"""Starting the writer child process (capsteer.capture.writer.child) and its two links."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import sysconfig
from multiprocessing.connection import Connection
from typing import Any

from capsteer.capture.manifest import ENGINE_PID_ENV
from capsteer.capture.writer.protocol import ControlLink

# The child's copies run on its calling threads: no OpenMP or BLAS team that would spin
# on other cores after each parallel region.
_ONE_THREAD_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def spawn_child(config: dict[str, Any], ring_fd: int) -> tuple[subprocess.Popen, Connection,
                                                              ControlLink]:
    """(the child, its message link, its control link). Diagnostics (stats, metrics) go on
    a socket of their own, answered by a thread of the child: a scrape never waits behind
    queued rows or for the sink thread's lock."""
    ours, theirs = socket.socketpair()
    conn = Connection(ours.detach())
    child_fd = theirs.detach()
    ctl_ours, ctl_theirs = socket.socketpair()
    ctl = ControlLink(Connection(ctl_ours.detach()))
    ctl_fd = ctl_theirs.detach()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", ENGINE_PID_ENV: str(os.getpid()),
           **_ONE_THREAD_ENV}
    try:
        # `-m` puts the working directory first on sys.path: the standard library's
        # folder adds nothing there, where a checkout's capsteer/ folder could shadow
        # the installed package.
        proc = subprocess.Popen(
            [sys.executable, "-m", "capsteer.capture.writer.child",
             "--sock-fd", str(child_fd), "--ctl-fd", str(ctl_fd), "--ring-fd", str(ring_fd),
             "--config", json.dumps(config)],
            pass_fds=(child_fd, ctl_fd, ring_fd), env=env, stdin=subprocess.DEVNULL,
            cwd=sysconfig.get_paths()["stdlib"])
    finally:
        os.close(child_fd)
        os.close(ctl_fd)
    return proc, conn, ctl
