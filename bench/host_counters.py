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

A host whose threads neither wait nor lose time to steal can still run the same work
slower (a shared cache or memory bus, the host's clock): `SpeedProbe` times fixed work
items in a process of its own (a Python loop, then a 16 MiB memory copy, each 10 ms)
so each batch gets the mean item time of its own seconds beside its counters.

`GpuMonitor` asks whether the GPU's own time moved instead: it streams nvidia-smi's
utilization, SM clock and power every 100 ms, and gives each batch the mean of its
samples. If a slow batch had the same GPU work spread over more time, its utilization
falls; if the GPU itself took longer (a lower clock, say), utilization holds.

The engine probe (`engine_probe/sitecustomize.py`, perf_method.py `--engine-probe`) adds
what the engine did in the batch, from inside every process: steps, scheduled tokens,
seconds in the step, the scheduler, the model runner and each GC generation
(`engine_probe_read` around the batch; `front_*` for this process, `engine_*` for its
children). On the lent H100s it showed the same steps, tokens and GC in slow batches as
in fast ones, with the GPU idle for longer: the host's step thread ran slower.
"""

from __future__ import annotations

import atexit
import functools
import importlib.util
import mmap
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

_TICK = os.sysconf("SC_CLK_TCK")


_PROBE = struct.Struct("<3q")  # items (each one loop, then one copy), loop ns, copy ns


class SpeedProbe:
    """Fixed work items timed in a child process, read through a small shared file."""

    def __init__(self) -> None:
        fd, self.path = tempfile.mkstemp(prefix="speed-probe-")
        os.write(fd, bytes(_PROBE.size))
        self._mm = mmap.mmap(fd, _PROBE.size)
        os.close(fd)
        self.proc = subprocess.Popen([sys.executable, __file__, self.path, str(os.getpid())])
        atexit.register(self.close)  # a run that fails leaves no probe behind

    def read(self) -> tuple[int, ...]:
        return _PROBE.unpack_from(self._mm)

    @staticmethod
    def delta(before: tuple[int, ...], after: tuple[int, ...]) -> dict[str, float | None]:
        """Mean item time (ms) between two reads; None where no item finished."""
        d = [b - a for a, b in zip(before, after, strict=True)]
        return {"probe_loop_ms": d[1] / d[0] / 1e6 if d[0] else None,
                "probe_copy_ms": d[2] / d[0] / 1e6 if d[0] else None}

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if not self._mm.closed:
            self._mm.close()
            os.unlink(self.path)


class GpuMonitor:
    """nvidia-smi's samples of GPU 0 every 100 ms, written to a file and read afterwards
    (no CUDA context or NVML binding in this process). Disabled without nvidia-smi."""

    FIELDS = ("utilization.gpu", "clocks.sm", "power.draw")

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.proc: subprocess.Popen | None = None
        exe = shutil.which("nvidia-smi")
        if exe is None:
            return
        self._out = self.path.open("w")
        self.proc = subprocess.Popen(
            [exe, "-i", "0", f"--query-gpu=timestamp,{','.join(self.FIELDS)}",
             "--format=csv,noheader,nounits", "-lms", "100"],
            stdout=self._out, stderr=subprocess.DEVNULL)
        atexit.register(self.close)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait()
            self._out.close()

    def samples(self) -> list[tuple[float, float, float, float]]:
        """(epoch seconds, utilization %, SM MHz, watts) per line nvidia-smi printed."""
        out = []
        if not self.path.exists():
            return out
        for line in self.path.read_text(errors="replace").splitlines():
            parts = [x.strip() for x in line.split(",")]
            if len(parts) != 4:
                continue
            try:
                stamp, frac = parts[0].rsplit(".", 1)
                t = time.mktime(time.strptime(stamp, "%Y/%m/%d %H:%M:%S")) + float(f"0.{frac}")
                out.append((t, float(parts[1]), float(parts[2]), float(parts[3])))
            except ValueError:
                continue
        return out

    @staticmethod
    def window(samples: list[tuple[float, float, float, float]], t0: float,
               t1: float) -> dict[str, float]:
        """Mean utilization, SM clock and power over the samples taken in [t0, t1]."""
        inside = [s for s in samples if t0 <= s[0] <= t1]
        if not inside:
            return {}
        return {"gpu_util_pct": statistics.mean(s[1] for s in inside),
                "sm_clock_mhz": statistics.mean(s[2] for s in inside),
                "power_w": statistics.mean(s[3] for s in inside), "gpu_samples": len(inside)}


def _probe_main(path: str, parent: int) -> None:
    """The probe's loop; it ends when its parent does (even one killed without cleanup)."""
    import numpy as np

    src = np.ones(16 << 20, np.uint8)
    dst = np.empty_like(src)
    fd = os.open(path, os.O_RDWR)
    mm = mmap.mmap(fd, _PROBE.size)
    counts = [0, 0, 0]
    while os.getppid() == parent:
        t0 = time.perf_counter_ns()
        total = 0
        for i in range(20_000):
            total += i * i
        t1 = time.perf_counter_ns()
        np.copyto(dst, src)
        t2 = time.perf_counter_ns()
        counts[0] += 1
        counts[1] += t1 - t0
        counts[2] += t2 - t1
        _PROBE.pack_into(mm, 0, *counts)
        time.sleep(max(0.0, 0.01 - (t2 - t0) / 1e9))


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


def _threads() -> dict[tuple[int, int], tuple[str, int, int, int, int]]:
    """(pid, tid) -> (thread name, run ns, run-queue wait ns, last CPU, migrations) for this
    process tree (migrations -1 where the kernel does not expose them)."""
    me = psutil.Process()
    pids = [me.pid] + [c.pid for c in me.children(recursive=True)]
    out: dict[tuple[int, int], tuple[str, int, int, int, int]] = {}
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
                with open(f"{base}/stat") as fh:  # field 39, counted after the ")" of comm
                    cpu = int(fh.read().rsplit(")", 1)[1].split()[36])
            except (OSError, ValueError, IndexError):
                continue
            out[(pid, int(tid))] = (name, run, wait, cpu, _migrations(base))
    return out


def _migrations(base: str) -> int:
    try:
        with open(f"{base}/sched") as fh:
            for line in fh:
                if line.startswith("se.nr_migrations"):
                    return int(line.split(":")[1])
    except (OSError, ValueError):
        pass
    return -1


def pin_step_thread(cpu: int) -> list[int]:
    """Bind the EngineCore process's main thread (its step loop) to `cpu` and every other
    thread of this process tree to the other allowed CPUs; returns [cpu]. Same-CPU runs make
    a paired round's configs meet the same core (session 38)."""
    allowed = sorted(os.sched_getaffinity(0))
    if cpu not in allowed or len(allowed) < 2:
        raise SystemExit(f"--pin step:{cpu}: CPU {cpu} not among the allowed {allowed}")
    rest = [c for c in allowed if c != cpu]
    threads = _threads()
    step = [key for key, v in threads.items()
            if v[0].startswith("VLLM::EngineCor") and key[0] == key[1]]
    if len(step) != 1:
        raise SystemExit(f"--pin step:{cpu}: expected one EngineCore process, found {step}")
    for key in threads:
        try:
            os.sched_setaffinity(key[1], [cpu] if key in step else rest)
        except OSError:  # a thread that ended meanwhile
            continue
    return [cpu]


ENGINE_PROBE = Path(__file__).parent / "engine_probe"  # its sitecustomize.py's directory


def engine_probe_env(directory: str | Path) -> dict[str, str]:
    """The environment that turns the engine probe on in Python processes started with it
    (a sitecustomize runs at interpreter start-up, so not in the process that sets it)."""
    path = os.environ.get("PYTHONPATH", "")
    return {"CAPSTEER_ENGINE_PROBE_DIR": str(directory),
            "PYTHONPATH": f"{ENGINE_PROBE}{os.pathsep}{path}" if path else str(ENGINE_PROBE)}


@functools.cache
def _engine_probe_module() -> Any:
    """The probe's file as a module of its own name (this process may have imported another
    sitecustomize): its field lists."""
    spec = importlib.util.spec_from_file_location("capsteer_engine_probe",
                                                  ENGINE_PROBE / "sitecustomize.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _engine_probe_fields() -> tuple[str, ...]:
    return tuple(_engine_probe_module().FIELDS)


def engine_probe_read(directory: str | Path | None) -> dict[int, tuple[int, ...]]:
    """pid -> the engine probe's counters, for this process tree's processes that have any."""
    if directory is None:
        return {}
    fields = _engine_probe_fields()
    me = psutil.Process()
    out = {}
    for pid in [me.pid] + [c.pid for c in me.children(recursive=True)]:
        try:
            raw = Path(directory, f"probe-{pid}.bin").read_bytes()
        except OSError:
            continue
        if len(raw) == 8 * len(fields):
            out[pid] = struct.unpack(f"<{len(fields)}q", raw)
    return out


def engine_probe_trace(directory: str | Path) -> dict[int, list[tuple[int, ...]]]:
    """pid -> the engine probe's step rows (CAPSTEER_ENGINE_PROBE_TRACE=1; TRACE_FIELDS),
    for every trace file in `directory`, whether its process still runs or not."""
    width = len(_engine_probe_module().TRACE_FIELDS)
    out = {}
    for path in Path(directory).glob("trace-*.bin"):
        with open(path, "rb") as fh:  # the file is sized for every row it may ever hold
            (n,) = struct.unpack("<q", fh.read(8))
            rows = struct.unpack(f"<{n * width}q", fh.read(8 * n * width))
        out[int(path.stem.split("-")[1])] = [rows[i: i + width] for i in range(0, len(rows), width)]
    return out


def _engine_probe_delta(before: dict[int, tuple[int, ...]],
                        after: dict[int, tuple[int, ...]]) -> dict[str, float]:
    """The batch's probe counters: `front_*` for this process (the LLM front end), `engine_*`
    summed over its children (the EngineCore, writers); seconds where the field is in ns."""
    fields = _engine_probe_fields()
    out: dict[str, float] = {}
    for prefix, mine in (("front", True), ("engine", False)):
        pids = [pid for pid in after if (pid == os.getpid()) == mine]
        if not pids:
            continue
        total = [0] * len(fields)
        for pid in pids:
            base = before.get(pid, (0,) * len(fields))
            total = [t + b - a for t, a, b in zip(total, base, after[pid], strict=True)]
        out.update({f"{prefix}_{k}": v for k, v in _probe_named(total).items()})
    return out


def _probe_named(values: list[int]) -> dict[str, float]:
    """Probe counter deltas by field name, in seconds (`x_s`) where the field is in ns."""
    return {(name[:-3] + "_s" if name.endswith("_ns") else name):
            (v / 1e9 if name.endswith("_ns") else v)
            for name, v in zip(_engine_probe_fields(), values, strict=True)}


def snapshot(probe_dir: str | Path | None = None) -> dict[str, Any]:
    return {"stat": _proc_stat(), "pressure": _pressure_us(), "threads": _threads(),
            "engine": engine_probe_read(probe_dir)}


def delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The batch's counters in seconds (see the module docstring)."""
    d = [b - a for a, b in zip(before["stat"], after["stat"], strict=True)]
    out: dict[str, Any] = {"steal_s": d[7] / _TICK, "busy_s": (sum(d) - d[3] - d[4]) / _TICK}
    if before["pressure"] is not None and after["pressure"] is not None:
        out["pressure_s"] = (after["pressure"] - before["pressure"]) / 1e6
    runs = []
    for key, (name, run, wait, cpu, moves) in after["threads"].items():
        _, run0, wait0, _, moves0 = before["threads"].get(key, (name, 0, 0, cpu, moves))
        runs.append((run - run0, wait - wait0, name, key, cpu,
                     moves - moves0 if moves >= 0 and moves0 >= 0 else None))
    out["tree_run_s"] = sum(r for r, *_ in runs) / 1e9
    out["tree_wait_s"] = sum(w for _, w, *_ in runs) / 1e9
    if runs:
        run, wait, name, key, cpu, moves = max(runs)
        out["top_thread"] = {"name": name, "pid": key[0], "run_s": run / 1e9, "wait_s": wait / 1e9,
                             "last_cpu": cpu, "migrations": moves}
    out.update(_engine_probe_delta(before.get("engine", {}), after.get("engine", {})))
    return out


def by_process(before: dict[str, Any], after: dict[str, Any]) -> dict[int, dict[str, float]]:
    """Between two snapshots, per process of the tree: its threads' run and run-queue wait
    (s), its busiest thread's run (s), and its engine-probe counters (steps, tokens, GC;
    seconds where the field is in ns) where it has any."""
    out: dict[int, dict[str, float]] = {}

    def process(pid: int) -> dict[str, float]:
        return out.setdefault(pid, {"run_s": 0.0, "wait_s": 0.0, "top_run_s": 0.0})

    for key, (_name, run, wait, _cpu, _moves) in after["threads"].items():
        _, run0, wait0, *_ = before["threads"].get(key, ("", 0, 0, 0, 0))
        got = process(key[0])
        got["run_s"] += (run - run0) / 1e9
        got["wait_s"] += (wait - wait0) / 1e9
        got["top_run_s"] = max(got["top_run_s"], (run - run0) / 1e9)
    for pid, counters in after.get("engine", {}).items():
        base = before.get("engine", {}).get(pid, (0,) * len(counters))
        process(pid).update(_probe_named([a - b for b, a in zip(base, counters, strict=True)]))
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


if __name__ == "__main__":
    _probe_main(sys.argv[1], int(sys.argv[2]))
