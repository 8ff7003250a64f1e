"""A `capsteer serve` killed with SIGKILL leaves vLLM's shared memory in /dev/shm and its
runtime directory; the next start sweeps both and says so in its log. The shared server is
killed after its last test and the next start is the reject server the following tests use
(its own group, between the two in ENGINE_ORDER): no extra start."""

from __future__ import annotations

import os
import signal
import tempfile
import time
from pathlib import Path

import pytest

from capsteer.server.leftovers import (
    MIN_AGE_S,
    RUNTIME_PREFIX,
    SHM_DIR,
    SHM_NAME,
    held_shm_inodes,
    read_owner,
)

pytestmark = [pytest.mark.server, pytest.mark.uses_engine("server-leftovers")]


def _group(pgid: int) -> set[int]:
    """The live processes of process group `pgid`."""
    pids = set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if os.getpgid(int(entry.name)) == pgid:
                    pids.add(int(entry.name))
            except ProcessLookupError:
                continue
    return pids


def test_the_next_start_sweeps_what_a_killed_server_left(server, request):
    pgid = server.proc.pid
    pids = _group(pgid)
    held = held_shm_inodes(SHM_DIR, pids)
    assert held is not None
    mine = sorted(e.name for e in os.scandir(SHM_DIR)
                  if SHM_NAME.fullmatch(e.name) and e.inode() in held)
    assert any(name.startswith("psm_") for name in mine), os.listdir(SHM_DIR)
    runtime = [p for p in Path(tempfile.gettempdir()).glob(RUNTIME_PREFIX + "*")
               if (o := read_owner(p)) is not None and o.pid == pgid]
    assert len(runtime) == 1

    os.killpg(pgid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while _group(pgid) and time.monotonic() < deadline:
        server.proc.poll()  # reaps the leader: a zombie keeps its group, and the loop waited 30 s
        time.sleep(0.1)
    server.proc.wait(5)
    assert not _group(pgid)
    assert all((SHM_DIR / name).exists() for name in mine), "nothing was left to sweep"
    assert runtime[0].is_dir()
    # The sweep leaves an entry changed in the last MIN_AGE_S alone, and the killed server
    # wrote its rings until the kill: the next start comes after that.
    changed = max(max(st.st_ctime, st.st_mtime) for st in ((SHM_DIR / n).stat() for n in mine))
    time.sleep(max(0.0, changed + MIN_AGE_S + 1.0 - time.time()))

    # The next start (the pool drops the killed server): the reject server, which the tests
    # after this one share; asked for only now, after the kill.
    fresh = request.getfixturevalue("reject_server")
    assert fresh.proc.pid != pgid
    assert not [name for name in mine if (SHM_DIR / name).exists()]
    assert not runtime[0].exists()
    log = fresh.log_text()
    line = next((x for x in log.splitlines() if "swept what" in x), None)
    assert line is not None, fresh.log_tail()
    assert f"pid {pgid}" in line and all(name in line for name in mine), line
    print(f"left by the killed server: {mine}\n{line}")  # shown with -s
