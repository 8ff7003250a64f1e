"""Engine processes die with their launcher: real processes, SIGKILLed like a crash."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

# A launcher marks itself and starts an "EngineCore", which starts a "worker" (optionally
# behind an intermediate process the launcher did not start); the worker runs the watch.
CHAIN = r"""
import json, os, subprocess, sys, time
role, pids_file, depth = sys.argv[1], sys.argv[2], int(sys.argv[3])
if role == "launcher":
    from capsteer.engine_ext.lifeline import mark_launcher
    mark_launcher()
if role == "worker":
    from capsteer.engine_ext.lifeline import watch_launcher
    assert watch_launcher(poll_s=0.05) is not None
    with open(pids_file, "a") as f:
        f.write(json.dumps({"worker": os.getpid()}) + "\n")
else:
    nxt = {"launcher": "core", "core": "middle" if depth > 2 else "worker",
           "middle": "worker"}[role]
    subprocess.Popen([sys.executable, __file__, nxt, pids_file, str(depth)])
    with open(pids_file, "a") as f:
        f.write(json.dumps({role: os.getpid()}) + "\n")
time.sleep(600)
"""


def _start_chain(tmp_path: Path, depth: int) -> tuple[subprocess.Popen, dict[str, int]]:
    pids_file, script = tmp_path / "pids.jsonl", tmp_path / "chain.py"
    script.write_text(CHAIN)
    launcher = subprocess.Popen([sys.executable, str(script), "launcher", str(pids_file),
                                 str(depth)])
    want = {"launcher", "core", "worker"} | ({"middle"} if depth > 2 else set())
    deadline = time.monotonic() + 60
    pids: dict[str, int] = {}
    while set(pids) != want:
        assert time.monotonic() < deadline, f"the chain did not start: {pids}"
        time.sleep(0.05)
        if pids_file.exists():
            for line in pids_file.read_text().splitlines():
                pids.update(json.loads(line))
    return launcher, pids


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True  # dead; nobody reaped it yet
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def _kill_all(pids: dict[str, int]) -> None:
    for pid in pids.values():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_engine_processes_exit_when_their_launcher_is_killed(tmp_path):
    launcher, pids = _start_chain(tmp_path, depth=2)
    try:
        time.sleep(0.5)  # the watch polls a live launcher and kills nothing
        assert not _gone(pids["core"], 0) and not _gone(pids["worker"], 0)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(10)
        assert _gone(pids["worker"], 10), "the worker outlived its launcher"
        assert _gone(pids["core"], 10), "the EngineCore outlived its launcher"
    finally:
        _kill_all(pids)


def test_the_watch_kills_only_a_parent_the_launcher_started(tmp_path):
    launcher, pids = _start_chain(tmp_path, depth=3)  # launcher -> core -> middle -> worker
    try:
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(10)
        assert _gone(pids["worker"], 10), "the worker outlived its launcher"
        time.sleep(0.5)
        assert not _gone(pids["middle"], 0), "killed a parent the launcher did not start"
    finally:
        _kill_all(pids)


def test_no_watch_without_a_launcher(monkeypatch):
    from capsteer.engine_ext.lifeline import LAUNCHER_ENV, mark_launcher, watch_launcher

    monkeypatch.delenv(LAUNCHER_ENV, raising=False)
    assert watch_launcher() is None  # not started by a capsteer launcher
    mark_launcher()
    assert watch_launcher() is None  # the launcher itself (an in-process engine)
    monkeypatch.setenv(LAUNCHER_ENV, f"{os.getpid()}:1.0")  # this pid, another start time
    assert watch_launcher() is None  # a reused pid is a launcher that is gone


@pytest.fixture(autouse=True)
def _restore_env():
    from capsteer.engine_ext.lifeline import LAUNCHER_ENV

    before = os.environ.get(LAUNCHER_ENV)
    yield
    if before is None:
        os.environ.pop(LAUNCHER_ENV, None)
    else:
        os.environ[LAUNCHER_ENV] = before
