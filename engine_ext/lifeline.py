"""Engine processes exit when the process that launched them dies.

vLLM's EngineCore does not watch its parent: when the launcher (an `Engine`, a Ray
extraction replica, `capsteer serve`) is SIGKILLed, its EngineCore and workers live on
as orphans that hold the GPU's memory for nobody (its workers only watch the EngineCore).
The launcher names itself in the environment its engine processes inherit; each
capsteer worker watches that process and, once it is gone, kills the EngineCore it was
started by (when the launcher started that EngineCore) and then itself.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import psutil

LAUNCHER_ENV = "CAPSTEER_LAUNCHER"  # "<pid>:<create_time>" of the launching process
POLL_S = 1.0

logger = logging.getLogger(__name__)


def mark_launcher() -> None:
    """Name this process as the launcher of the engines it starts from now on."""
    me = psutil.Process()
    os.environ[LAUNCHER_ENV] = f"{me.pid}:{me.create_time()!r}"


def _launcher() -> psutil.Process | None:
    token = os.environ.get(LAUNCHER_ENV)
    if not token:
        return None
    pid, _, created = token.partition(":")
    try:
        proc = psutil.Process(int(pid))
        if created and abs(proc.create_time() - float(created)) > 1e-3:
            return None  # the pid was reused: the launcher is gone already
        return proc
    except (ValueError, psutil.Error):
        return None


def _alive(proc: psutil.Process) -> bool:
    """Running and not a zombie (a killed launcher stays one until its parent reaps it);
    is_running() also sees a reused pid as gone."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _engine_core(me: psutil.Process, launcher: psutil.Process) -> psutil.Process | None:
    """This worker's parent when it is the EngineCore the launcher started (vLLM runs
    workers as its child processes): a Python process like this one whose parent is the
    launcher; never the launcher itself, a shell, a raylet or init."""
    try:
        parent = me.parent()
        if parent is None or parent.ppid() != launcher.pid:
            return None
        return parent if parent.exe() == me.exe() else None
    except psutil.Error:
        return None


def watch_launcher(poll_s: float = POLL_S) -> threading.Thread | None:
    """Start the watch in an engine process (a worker); None where there is no launcher
    to watch: none was named, or it is this process or not one of its ancestors."""
    launcher = _launcher()
    me = psutil.Process()
    if launcher is None or launcher.pid not in {p.pid for p in me.parents()}:
        return None  # this process is the launcher, or the name was inherited elsewhere
    core = _engine_core(me, launcher)

    def watch() -> None:
        while _alive(launcher):
            time.sleep(poll_s)
        logger.error("capsteer: the engine's launcher (pid %d) is gone; this engine process "
                     "exits with it", launcher.pid)
        if core is not None and _alive(core):
            core.send_signal(signal.SIGKILL)
        os.kill(me.pid, signal.SIGKILL)

    thread = threading.Thread(target=watch, name="capsteer-lifeline", daemon=True)
    thread.start()
    return thread
