"""The start-up sweep of what a SIGKILLed server left (server/leftovers.py), on real files:
a runtime directory with an owner file, and shared-memory names in a stand-in for /dev/shm
that this process really maps or holds open. (The end-to-end check, a real server killed
and restarted, is tests/server/test_leftovers.py.)"""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path

import pytest

from capsteer.server.leftovers import (
    RUNTIME_PREFIX,
    dead_runtime_dirs,
    held_shm_inodes,
    read_owner,
    start_tick,
    sweep_dead_servers,
    write_owner,
)


def _runtime_dir(tmp: Path, pid: int, tick: int, started: float) -> Path:
    path = tmp / f"{RUNTIME_PREFIX}x{pid}{tick}"
    path.mkdir()
    (path / "pending").mkdir()
    (path / "owner").write_text(f"{pid} {tick} {started}\n")
    return path


@pytest.fixture
def dirs(tmp_path):
    tmp, shm = tmp_path / "tmp", tmp_path / "shm"
    tmp.mkdir()
    shm.mkdir()
    return tmp, shm


def test_owner_names_this_process_and_reads_alive(tmp_path):
    write_owner(tmp_path)
    owner = read_owner(tmp_path)
    assert owner is not None and owner.pid == os.getpid()
    assert owner.tick == start_tick(os.getpid()) and owner.alive()
    assert abs(owner.started - time.time()) < 60
    assert not (tmp_path / ".owner.tmp").exists()


def test_a_reused_pid_reads_as_a_dead_owner(dirs):
    tmp, _ = dirs
    mine = start_tick(os.getpid())
    assert mine is not None
    live = _runtime_dir(tmp, os.getpid(), mine, time.time())
    reused = _runtime_dir(tmp, os.getpid(), mine + 1, time.time())  # same pid, another start
    (tmp / f"{RUNTIME_PREFIX}being-made").mkdir()  # no owner file yet: never swept
    assert [path for path, _ in dead_runtime_dirs(tmp)] == [reused]
    assert live.exists()


def test_only_unheld_entries_of_the_dead_servers_lifetime_go(dirs):
    tmp, shm = dirs
    old = shm / "psm_00000001"
    old.write_bytes(b"\0" * 4096)  # changed before the dead server started: not its
    time.sleep(0.3)
    started = time.time()
    mine = start_tick(os.getpid()) or 0
    runtime = _runtime_dir(tmp, os.getpid(), mine + 1, started)
    leaked = [shm / "psm_0eb97d03", shm / "sem.mp-8dge9pya"]
    mapped, opened = shm / "psm_6f88a89c", shm / "sem.mp-abc_0123"
    foreign = shm / "psm_not-ours"
    for path in (*leaked, mapped, opened, foreign):
        path.write_bytes(b"\0" * 4096)
    with open(mapped, "r+b") as fh:
        view = mmap.mmap(fh.fileno(), 4096)  # held by its mapping once the file is closed
    fd = os.open(opened, os.O_RDONLY)
    try:
        held = held_shm_inodes(shm)
        assert held is not None
        assert {mapped.stat().st_ino, opened.stat().st_ino} <= held
        assert not {p.stat().st_ino for p in leaked} & held
        # too young: a just-made entry is held by nobody until its maker maps it
        assert sweep_dead_servers(tmp, shm).shm == []
        assert runtime.exists() is False  # the dead server's directory goes regardless
        runtime = _runtime_dir(tmp, os.getpid(), mine + 1, started)
        swept = sweep_dead_servers(tmp, shm, now=time.time() + 60)
    finally:
        view.close()
        os.close(fd)
    assert sorted(swept.shm) == sorted(p.name for p in leaked)
    assert swept.runtime_dirs == [runtime] and swept.owners == [os.getpid()]
    assert not runtime.exists() and not any(p.exists() for p in leaked)
    assert mapped.exists() and opened.exists() and foreign.exists() and old.exists()


def test_no_dead_server_no_sweep(dirs):
    tmp, shm = dirs
    live = tmp / f"{RUNTIME_PREFIX}live"
    live.mkdir()
    write_owner(live)
    leaked = shm / "psm_0eb97d03"
    leaked.write_bytes(b"\0")
    swept = sweep_dead_servers(tmp, shm, now=time.time() + 60)
    assert not swept and leaked.exists()
