"""What a `capsteer serve` killed by SIGKILL leaves behind, swept when the next one starts.

A clean stop removes everything. A SIGKILL of the server's process group (`kill -9`, the
OOM killer, a container stopped after its grace period) also kills multiprocessing's
resource tracker, which would have unlinked vLLM's shared memory, and skips the atexit
that removes the runtime directory. Left behind, a server at a time:

- its runtime directory (`peers.make_runtime_dir`), whose `owner` file names the
  launcher's pid, that process's start tick and the wall-clock time it started;
- vLLM's message-queue shared memory in /dev/shm: `psm_<8 hex>` segments
  (`multiprocessing.shared_memory`, the rings of `shm_broadcast.MessageQueue`) and
  `sem.mp-<8 chars>` semaphores (multiprocessing locks, such as the executor's worker
  lock); three entries on a one-engine server.

The shared-memory names carry no pid, so an entry is attributed to a dead predecessor when
all of these hold: a runtime directory says a capsteer server died (its owner pid is gone,
or now another process); the entry has a name multiprocessing gives, belongs to this uid,
and changed last after that server started; and no live process maps it or holds it open.
The last test goes by inode, since glibc maps a semaphore under a temporary name; an entry
that any live process uses is never removed, whoever made it.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

from capsteer.capture.publish import pid_alive

log = logging.getLogger("vllm.capsteer.server")

RUNTIME_PREFIX = "capsteer-serve-"
OWNER_FILE = "owner"
SHM_DIR = Path("/dev/shm")
# multiprocessing's names: SharedMemory's "psm_" + token_hex(4); SemLock's "/mp-" + 8 of
# [a-z0-9_], which glibc stores as "sem.mp-...".
SHM_NAME = re.compile(r"psm_[0-9a-f]{8}|sem\.mp-[a-z0-9_]{8}")
# An entry younger than this is left alone: between its creation and its first mapping it
# is held by nobody (microseconds for vLLM's queues; generous for anyone's hand-over).
MIN_AGE_S = 5.0


def start_tick(pid: int) -> int | None:
    """When `pid` started, in clock ticks since boot (/proc/PID/stat field 22): with the pid,
    it names one process, so a pid reused by another process reads as a different owner."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return int(fh.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def write_owner(directory: Path, pid: int | None = None) -> None:
    """Mark a runtime directory as this process's (renamed into place: never half read)."""
    pid = os.getpid() if pid is None else pid
    tmp = directory / f".{OWNER_FILE}.tmp"
    tmp.write_text(f"{pid} {start_tick(pid) or 0} {time.time():.3f}\n")
    os.replace(tmp, directory / OWNER_FILE)


@dataclass(frozen=True)
class Owner:
    """Who made a runtime directory, and when."""

    pid: int
    tick: int
    started: float  # wall clock

    def alive(self) -> bool:
        if not pid_alive(self.pid):
            return False
        tick = start_tick(self.pid)
        return not self.tick or tick is None or tick == self.tick


def read_owner(directory: Path) -> Owner | None:
    """The directory's owner, or None when it has none yet (being made) or it is unreadable."""
    try:
        pid, tick, started = (directory / OWNER_FILE).read_text().split()
        return Owner(int(pid), int(tick), float(started))
    except (OSError, ValueError):
        return None


@dataclass
class Swept:
    """What one start-up sweep removed."""

    owners: list[int] = field(default_factory=list)  # pids of the dead servers
    runtime_dirs: list[Path] = field(default_factory=list)
    shm: list[str] = field(default_factory=list)  # /dev/shm names
    skipped: str = ""  # why the shared memory was left alone, if it was

    def __bool__(self) -> bool:
        return bool(self.runtime_dirs or self.shm)


def dead_runtime_dirs(tmp: Path) -> list[tuple[Path, Owner]]:
    """Runtime directories of this uid whose owner process is gone."""
    found = []
    uid = os.getuid()
    for path in tmp.glob(RUNTIME_PREFIX + "*"):
        try:
            if not path.is_dir() or path.stat().st_uid != uid:
                continue
        except OSError:
            continue
        owner = read_owner(path)
        if owner is not None and not owner.alive():
            found.append((path, owner))
    return found


def held_shm_inodes(shm_dir: Path = SHM_DIR, pids: Collection[int] | None = None,
                    ) -> set[int] | None:
    """Inodes under `shm_dir` that a live process (of `pids`, default all) maps or holds
    open; None when a process of this uid (other than init) could not be read: then
    nothing is proven unused."""
    prefix = str(shm_dir) + "/"
    held: set[int] = set()
    uid = os.getuid()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or (pids is not None and int(entry.name) not in pids):
            continue
        try:
            with open(f"/proc/{entry.name}/maps", "rb") as fh:
                for line in fh:
                    parts = line.split(None, 5)
                    if len(parts) == 6 and parts[5].startswith(prefix.encode()):
                        held.add(int(parts[4]))
            for fd in os.scandir(f"/proc/{entry.name}/fd"):
                try:
                    if os.readlink(fd.path).startswith(prefix):
                        held.add(os.stat(fd.path).st_ino)
                except OSError:  # closed meanwhile
                    continue
        except FileNotFoundError:  # exited meanwhile
            continue
        except PermissionError:
            # another user's process cannot open this uid's 0600 entries; init (pid 1, which
            # a container's runtime may hide) runs no vLLM; any other could be one
            try:
                if entry.name != "1" and entry.stat().st_uid == uid:
                    return None
            except OSError:
                pass
            continue
        except OSError:
            continue
    return held


def sweep_dead_servers(tmp: Path | None = None, shm_dir: Path = SHM_DIR,
                       now: float | None = None) -> Swept:
    """Remove what dead `capsteer serve` processes left (module docstring); returns it."""
    swept = Swept()
    dead = dead_runtime_dirs(Path(tmp or tempfile.gettempdir()))
    if not dead:
        return swept
    since = min(owner.started for _, owner in dead)
    now = time.time() if now is None else now
    held = held_shm_inodes(shm_dir)
    if held is None:
        swept.skipped = "a process of this user could not be inspected"
    else:
        swept.shm = _remove_unheld(shm_dir, held, since, now)
    for path, owner in dead:
        shutil.rmtree(path, ignore_errors=True)
        swept.runtime_dirs.append(path)
        swept.owners.append(owner.pid)
    return swept


def _remove_unheld(shm_dir: Path, held: set[int], since: float, now: float) -> list[str]:
    removed = []
    uid = os.getuid()
    try:
        names = sorted(os.listdir(shm_dir))
    except OSError:
        return removed
    for name in names:
        if not SHM_NAME.fullmatch(name):
            continue
        path = shm_dir / name
        try:
            st = path.stat()
        except OSError:
            continue
        changed = max(st.st_ctime, st.st_mtime)
        if (st.st_uid != uid or st.st_ino in held or changed < since - 0.1
                or changed > now - MIN_AGE_S):
            continue
        try:
            path.unlink()
        except OSError:
            continue
        removed.append(name)
    return removed


def sweep_and_log() -> Swept:
    """`capsteer serve`'s start-up sweep, said in the log as the capture writer says its
    own (a sweep that fails is logged and never stops the start)."""
    try:
        swept = sweep_dead_servers()
    except Exception:
        log.exception("capsteer: the sweep of dead servers' leftovers failed")
        return Swept()
    if swept:
        log.warning("capsteer: swept what %d dead server(s) (pid %s) left: %d shared-memory "
                    "entr%s in %s (%s) and %d runtime director%s", len(swept.owners),
                    ", ".join(map(str, swept.owners)), len(swept.shm),
                    "y" if len(swept.shm) == 1 else "ies", SHM_DIR,
                    " ".join(swept.shm) or "none", len(swept.runtime_dirs),
                    "y" if len(swept.runtime_dirs) == 1 else "ies")
    if swept.skipped:
        log.warning("capsteer: shared memory left by dead servers was not swept: %s",
                    swept.skipped)
    return swept
