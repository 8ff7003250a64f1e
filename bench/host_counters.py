"""Host counters around one batch: where a host-bound batch's wall time went.

On the lent GPU hosts the same batch takes 0.9-1.6 s within one process, and the engine's
step thread is busy ~95% of the time (session 34's py-spy), so the spread comes from the
host CPU. These counters separate its candidate causes, per batch:
- `steal_s`: CPU time the hypervisor gave to other guests (/proc/stat, all CPUs);
- `pressure_s`: time some runnable task on this host waited for a CPU (/proc/pressure/cpu);
- over this process and its descendants (the EngineCore, writer processes), each thread's
  run and run-queue wait (/proc/PID/task/TID/schedstat); the busiest thread (the step
  thread, on a host-bound batch) is reported on its own: when its `run_s` tracks the batch
  time it was slowed while running (a slower or shared core), when its `wait_s` does it
  waited for a CPU.

    before = snapshot(); ...batch...; figures = delta(before, snapshot())
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import psutil

_TICK = os.sysconf("SC_CLK_TCK")


def _proc_stat() -> list[int]:
    """The aggregate `cpu` line of /proc/stat (user nice system idle iowait irq softirq steal)."""
    with open("/proc/stat") as fh:
        return [int(x) for x in fh.readline().split()[1:9]]


def _pressure_us() -> int | None:
    try:
        text = Path("/proc/pressure/cpu").read_text()
    except OSError:
        return None
    return int(text.split("total=")[1].split()[0])


def _threads() -> dict[tuple[int, int], tuple[str, int, int]]:
    """(pid, tid) -> (thread name, run ns, run-queue wait ns) for this process tree."""
    me = psutil.Process()
    pids = [me.pid] + [c.pid for c in me.children(recursive=True)]
    out: dict[tuple[int, int], tuple[str, int, int]] = {}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            base = f"/proc/{pid}/task/{tid}"
            try:
                with open(f"{base}/schedstat") as fh:
                    run, wait = (int(x) for x in fh.read().split()[:2])
                with open(f"{base}/comm") as fh:
                    name = fh.read().strip()
            except (OSError, ValueError):
                continue
            out[(pid, int(tid))] = (name, run, wait)
    return out


def snapshot() -> dict[str, Any]:
    return {"stat": _proc_stat(), "pressure": _pressure_us(), "threads": _threads()}


def delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The batch's counters in seconds (see the module docstring)."""
    d = [b - a for a, b in zip(before["stat"], after["stat"], strict=True)]
    out: dict[str, Any] = {"steal_s": d[7] / _TICK, "busy_s": (sum(d) - d[3] - d[4]) / _TICK}
    if before["pressure"] is not None and after["pressure"] is not None:
        out["pressure_s"] = (after["pressure"] - before["pressure"]) / 1e6
    runs = []
    for key, (name, run, wait) in after["threads"].items():
        _, run0, wait0 = before["threads"].get(key, (name, 0, 0))
        runs.append((run - run0, wait - wait0, name, key))
    out["tree_run_s"] = sum(r for r, *_ in runs) / 1e9
    out["tree_wait_s"] = sum(w for _, w, *_ in runs) / 1e9
    if runs:
        run, wait, name, key = max(runs)
        out["top_thread"] = {"name": name, "pid": key[0], "run_s": run / 1e9, "wait_s": wait / 1e9}
    return out


def _siblings(cpu: int) -> frozenset[int]:
    """The logical CPUs sharing `cpu`'s physical core (itself alone where unknown)."""
    path = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
    try:
        text = path.read_text().strip()
    except OSError:
        return frozenset({cpu})
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return frozenset(cpus)


def one_cpu_per_core() -> list[int]:
    """This process's allowed CPUs, keeping the lowest logical CPU of each physical core:
    bound to these, no two busy threads of the engine share a core's SMT pair."""
    allowed = sorted(os.sched_getaffinity(0))
    cores = {_siblings(c) & set(allowed) or frozenset({c}) for c in allowed}
    return sorted(min(core) for core in cores)


def topology() -> dict[str, Any]:
    """The host's CPU layout as this process sees it (recorded beside the figures)."""
    allowed = sorted(os.sched_getaffinity(0))
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"allowed_cpus": len(allowed), "physical_cores": len(one_cpu_per_core()),
            "siblings_of_cpu0": sorted(_siblings(allowed[0])), "model": model}
