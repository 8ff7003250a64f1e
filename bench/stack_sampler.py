"""A sampling profiler over every Python thread of this process (bench only).

torch.profiler sees torch ops and kernels; it does not say where the step thread, the
harvester and the writer threads spend their time between ops. This samples
`sys._current_frames()` every few milliseconds and counts, per thread name, the
innermost function ("self") and every function on the stack ("total").

    with StackSampler() as sampler:
        work()
    print(json.dumps(sampler.report(), indent=1))
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
from collections import Counter, defaultdict
from typing import Any


def _where(frame) -> str:
    code = frame.f_code
    parts = code.co_filename.rsplit("/", 2)
    return f"{'/'.join(parts[-2:])}:{code.co_firstlineno}({code.co_name})"


class StackSampler:
    def __init__(self, interval_s: float = 0.002, depth: int = 60) -> None:
        self.interval_s = interval_s
        self.depth = depth
        self.samples: Counter[str] = Counter()
        self.self_counts: dict[str, Counter[str]] = defaultdict(Counter)
        self.total_counts: dict[str, Counter[str]] = defaultdict(Counter)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)
        self.seconds = 0.0

    def __enter__(self) -> StackSampler:
        self._cpu_before = thread_cpu()
        self.gc_counts = [0, 0, 0]
        self.gc_seconds = [0.0, 0.0, 0.0]
        self._gc_started = 0.0
        gc.callbacks.append(self._on_gc)
        self._started = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.seconds = time.perf_counter() - self._started
        gc.callbacks.remove(self._on_gc)
        after = thread_cpu()
        self.cpu = sorted(((f"{name}/{tid}",
                            round(t - self._cpu_before.get(tid, (name, 0.0))[1], 3))
                           for tid, (name, t) in after.items()), key=lambda x: -x[1])

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            gen = int(info.get("generation", 0))
            self.gc_counts[gen] += 1
            self.gc_seconds[gen] += time.perf_counter() - self._gc_started

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.interval_s):
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                name = names.get(ident, str(ident))
                self.samples[name] += 1
                self.self_counts[name][_where(frame)] += 1
                seen = set()
                f, n = frame, 0
                while f is not None and n < self.depth:
                    w = _where(f)
                    if w not in seen:
                        seen.add(w)
                        self.total_counts[name][w] += 1
                    f, n = f.f_back, n + 1

    def report(self, top: int = 25) -> dict[str, Any]:
        """Per thread: samples, and the top functions by self and by total samples."""
        return {"interval_s": self.interval_s, "seconds": self.seconds,
                "gc": {"collections": self.gc_counts,
                       "seconds": [round(x, 4) for x in self.gc_seconds]},
                # CPU seconds each OS thread used (Python or not: OpenMP, CUDA, ...)
                "thread_cpu_s": [c for c in self.cpu if c[1] > 0][:top],
                "threads": {
            name: {"samples": count,
                   "self": self.self_counts[name].most_common(top),
                   "total": self.total_counts[name].most_common(top)}
            for name, count in self.samples.most_common()}}


def thread_cpu(pid: int | None = None) -> dict[int, tuple[str, float]]:
    """Every OS thread of this process (or of `pid`): tid -> (name, user + system CPU
    seconds). Python thread names are known for this process only."""
    tick = os.sysconf("SC_CLK_TCK")
    python = {t.native_id: f"py:{t.name}" for t in threading.enumerate()} if pid is None else {}
    proc = "/proc/self" if pid is None else f"/proc/{pid}"
    out = {}
    try:
        tids = os.listdir(f"{proc}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"{proc}/task/{tid}/stat") as f:
                stat = f.read()
            name = stat[stat.index("(") + 1: stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2:].split()
            out[int(tid)] = (python.get(int(tid), name), (int(fields[11]) + int(fields[12])) / tick)
        except (OSError, ValueError, IndexError):
            continue
    return out
