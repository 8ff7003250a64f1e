"""Engine-side counters for perf_method.py's `--engine-probe` (a benchmark diagnostic only).

The lent hosts run the same batch in 0.85-1.5 s with no autocorrelation between batches,
and the EngineCore's step thread is running for nearly all of it (CUDA's spin-waits count
as running). Host counters cannot say whether a slow batch did more engine steps, spent
its time in Python's garbage collector, or waited longer on the GPU. These counters can,
and they are the same for vanilla and capsteer processes: this file is imported by every
Python process started with `bench/engine_probe` on PYTHONPATH, and does nothing unless
CAPSTEER_ENGINE_PROBE_DIR is set.

Per process it keeps int64 counters in a small shared file `<dir>/probe-<pid>.bin`, which
`host_counters.engine_probe_read` reads around each batch:
- garbage collections and their nanoseconds, per generation (gc.callbacks);
- engine steps (vLLM's Scheduler.schedule calls that scheduled tokens), their scheduled
  tokens, and nanoseconds in schedule(), update_from_output() and the whole engine step
  (EngineCoreProc._process_engine_step: schedule, forward, sampling, output processing);
- nanoseconds in the model runner's execute_model() (input preparation and the forward's
  launch; with synchronous scheduling the wait for the GPU lands in sample_tokens()) and
  sample_tokens();
- the host's speed on the step thread: a fixed loop's samples and their nanoseconds
  (SPEED_EVERY_S).
vLLM's modules are wrapped after their import (a meta-path hook), never imported here.

With CAPSTEER_ENGINE_PROBE_TRACE=1 it also keeps one row per engine step that scheduled
tokens in `<dir>/trace-<pid>.bin` (TRACE_FIELDS; `host_counters.engine_probe_trace` reads
it): window counters average a step that decodes with one that also prefills, and a trace
can compare like with like (decode-only steps of the same batch size).
"""

from __future__ import annotations

import gc
import importlib.abc
import importlib.util
import mmap
import os
import resource
import sys
import time
from typing import Any

FIELDS = ("gc0_n", "gc0_ns", "gc1_n", "gc1_ns", "gc2_n", "gc2_ns", "steps", "tokens",
          "schedule_ns", "update_ns", "step_ns", "idle_steps", "forward_ns", "sample_ns",
          "speed_n", "speed_ns")
# The host's speed, sampled on the step thread itself: after the first engine step and
# then after a step that ends SPEED_EVERY_S or more after the last sample, a fixed pure
# Python loop (about 1 ms: 0.2% of the thread) is timed, into speed_n / speed_ns. The lent
# hosts run one process's Python up to 2x slower than the next one's (session 51), and
# vary between batches too, so a window's or a batch's step times come with its speed.
SPEED_EVERY_S = 0.5
SPEED_LOOP = 20_000
_DIR = os.environ.get("CAPSTEER_ENGINE_PROBE_DIR")
# A step's row: when it ended (CLOCK_MONOTONIC, the clock of every process here), its
# nanoseconds, scheduled tokens and requests, how many of those were fed more than one
# token (a prefill chunk), and its execute_model() and sample_tokens() nanoseconds; then the
# CPU time its thread ran in the step and in execute_model(): a step slower on the wall
# but not in CPU time waited (a device sync, the GIL, a CPU), one slower in both ran more
# or slower code. Then, from the step thread's getrusage over the step: its CPU time in
# the kernel (system calls, page faults), its minor page faults, and the times it was
# taken off the CPU while runnable (involuntary context switches): CPU time that grew
# with any of them is the kernel's or another thread's, not slower Python.
TRACE_FIELDS = ("end_ns", "step_ns", "tokens", "requests", "prefills", "forward_ns",
                "sample_ns", "step_cpu_ns", "forward_cpu_ns", "step_sys_ns", "step_minflt",
                "step_nivcsw")
TRACE_ROWS = 1 << 18  # ~25 minutes of steps at 160 a second; later steps are not kept
_TRACE = _DIR is not None and os.environ.get("CAPSTEER_ENGINE_PROBE_TRACE") == "1"
_END, _STEP, _T_TOKENS, _T_REQUESTS, _T_PREFILLS = range(5)  # TRACE_FIELDS' first five
_STEP_CPU = TRACE_FIELDS.index("step_cpu_ns")
_STEP_SYS = TRACE_FIELDS.index("step_sys_ns")


class _Counters:
    """This process's counters in a shared file (re-created after a fork)."""

    def __init__(self) -> None:
        self.pid = -1
        self.view: Any = None

    def get(self) -> Any:
        if self.pid != os.getpid():
            self.pid = os.getpid()
            path = os.path.join(_DIR or ".", f"probe-{self.pid}.bin")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            os.ftruncate(fd, 8 * len(FIELDS))
            self.view = memoryview(mmap.mmap(fd, 8 * len(FIELDS))).cast("q")
            os.close(fd)
        return self.view


class _Trace:
    """This process's step rows in a shared file: [count, rows...] as int64."""

    def __init__(self) -> None:
        self.pid = -1
        self.view: Any = None
        self.pending = [0] * len(TRACE_FIELDS)  # the step in progress

    def get(self) -> Any:
        if self.pid != os.getpid():
            self.pid = os.getpid()
            size = 8 * (1 + TRACE_ROWS * len(TRACE_FIELDS))
            path = os.path.join(_DIR or ".", f"trace-{self.pid}.bin")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            os.ftruncate(fd, size)  # sparse: pages appear as rows are written
            self.view = memoryview(mmap.mmap(fd, size)).cast("q")
            os.close(fd)
        return self.view

    def end_step(self, step_ns: int, step_cpu_ns: int, usage: tuple[int, int, int]) -> None:
        """Append the step in progress (if it scheduled tokens) and start the next;
        `usage`: the step's (kernel CPU ns, minor faults, involuntary switches)."""
        row, self.pending = self.pending, [0] * len(TRACE_FIELDS)
        if not row[_T_TOKENS]:
            return
        v = self.get()
        n = v[0]
        if n >= TRACE_ROWS:
            return
        row[_END], row[_STEP], row[_STEP_CPU] = time.monotonic_ns(), step_ns, step_cpu_ns
        row[_STEP_SYS:_STEP_SYS + 3] = usage
        at = 1 + n * len(TRACE_FIELDS)
        for i, value in enumerate(row):
            v[at + i] = value
        v[0] = n + 1


_COUNTERS = _Counters()
_STEP_TRACE = _Trace() if _TRACE else None
_gc_start = [0]


def _on_gc(phase: str, info: dict[str, int]) -> None:
    if phase == "start":
        _gc_start[0] = time.perf_counter_ns()
        return
    v = _COUNTERS.get()
    g = min(int(info.get("generation", 2)), 2)
    v[2 * g] += 1
    v[2 * g + 1] += time.perf_counter_ns() - _gc_start[0]


def _timed(fn: Any, field: str, after: Any = None) -> Any:
    """`fn` with its nanoseconds added to `field`; `after(counters, result, elapsed,
    cpu)` then runs (cpu: the thread's CPU nanoseconds in the call, when tracing, else 0)."""
    index = FIELDS.index(field)
    cpu_clock = time.thread_time_ns if _TRACE else _zero

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        c0, t0 = cpu_clock(), time.perf_counter_ns()
        result = fn(*args, **kwargs)
        elapsed = time.perf_counter_ns() - t0
        cpu = cpu_clock() - c0
        v = _COUNTERS.get()
        v[index] += elapsed
        if after is not None:
            after(v, result, elapsed, cpu)
        return result

    wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


def _zero() -> int:
    return 0


_STEPS, _TOKENS, _IDLE_STEPS = (FIELDS.index(f) for f in ("steps", "tokens", "idle_steps"))


def _count_schedule(v: Any, output: Any, _elapsed: int, _cpu: int) -> None:
    tokens = int(getattr(output, "total_num_scheduled_tokens", 0) or 0)
    if tokens:
        v[_STEPS] += 1
        v[_TOKENS] += tokens
    else:
        v[_IDLE_STEPS] += 1
    if _STEP_TRACE is not None:
        per_request = getattr(output, "num_scheduled_tokens", None) or {}
        pending = _STEP_TRACE.pending
        pending[_T_TOKENS] += tokens
        pending[_T_REQUESTS] += len(per_request)
        pending[_T_PREFILLS] += sum(1 for n in per_request.values() if n > 1)


def _trace_add(field: str, cpu_field: str | None = None) -> Any:
    """An `after` for _timed when tracing (None otherwise: nothing added to the call): the
    call's nanoseconds also go to the traced step's `field`, its CPU time to `cpu_field`."""
    trace = _STEP_TRACE
    if trace is None:
        return None
    column = TRACE_FIELDS.index(field)
    cpu_column = TRACE_FIELDS.index(cpu_field) if cpu_field else None

    def add(_v: Any, _result: Any, elapsed: int, cpu: int) -> None:
        trace.pending[column] += elapsed
        if cpu_column is not None:
            trace.pending[cpu_column] += cpu

    return add


_SPEED_N, _SPEED_NS = FIELDS.index("speed_n"), FIELDS.index("speed_ns")


def speed_loop() -> int:
    """Nanoseconds of the fixed loop on the calling thread."""
    t0 = time.perf_counter_ns()
    sum(i * i for i in range(SPEED_LOOP))
    return time.perf_counter_ns() - t0


_SPEED_EVERY_NS = int(SPEED_EVERY_S * 1e9)
_last_sample = [-_SPEED_EVERY_NS]  # this process's last speed sample (monotonic ns)


def _then_sample(after: Any) -> Any:
    """An `after` for _timed: `after` (if any), then a host speed sample on the calling
    thread, at most every SPEED_EVERY_S a process. Both the engine step and execute_model
    carry it, so where the model runner runs in a worker process of its own (vLLM's CPU
    backend) that thread is sampled too; where both run on one thread it is sampled once."""

    def sampled(v: Any, result: Any, elapsed: int, cpu: int) -> None:
        if after is not None:
            after(v, result, elapsed, cpu)
        now = time.monotonic_ns()
        if now - _last_sample[0] >= _SPEED_EVERY_NS:
            _last_sample[0] = now
            v[_SPEED_NS] += speed_loop()
            v[_SPEED_N] += 1

    return sampled


def _thread_usage() -> tuple[int, int, int]:
    """The calling thread's kernel CPU ns, minor faults and involuntary switches so far."""
    got = resource.getrusage(resource.RUSAGE_THREAD)
    return int(got.ru_stime * 1e9), got.ru_minflt, got.ru_nivcsw


def _trace_step() -> Any:
    """An `after` for the engine step when tracing (None otherwise): the step's row."""
    trace = _STEP_TRACE
    if trace is None:
        return None
    return lambda _v, _result, elapsed, cpu: trace.end_step(
        elapsed, cpu, tuple(b - a for a, b in zip(_step_usage[0], _thread_usage(), strict=True)))


_step_usage = [(0, 0, 0)]  # the step thread's usage when its step in progress began


def _usage_at_start(fn: Any) -> Any:
    """`fn` with the step thread's usage taken before each call (for its trace row)."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _step_usage[0] = _thread_usage()
        return fn(*args, **kwargs)

    wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


def _patch_scheduler(module: Any) -> None:
    cls = module.Scheduler
    cls.schedule = _timed(cls.schedule, "schedule_ns", _count_schedule)
    cls.update_from_output = _timed(cls.update_from_output, "update_ns")


def _patch_core(module: Any) -> None:
    cls = module.EngineCoreProc  # the engine process's busy loop calls this once a step
    step = _timed(cls._process_engine_step, "step_ns", _then_sample(_trace_step()))
    cls._process_engine_step = _usage_at_start(step) if _STEP_TRACE is not None else step


def _patch_runner(module: Any) -> None:
    cls = module.GPUModelRunner  # vLLM's CPU runner inherits both
    cls.execute_model = _timed(cls.execute_model, "forward_ns",
                                 _then_sample(_trace_add("forward_ns", "forward_cpu_ns")))
    cls.sample_tokens = _timed(cls.sample_tokens, "sample_ns", _trace_add("sample_ns"))


_PATCHES = {"vllm.v1.core.sched.scheduler": _patch_scheduler,
            "vllm.v1.engine.core": _patch_core,
            "vllm.v1.worker.gpu_model_runner": _patch_runner,  # V1 runner (and CPU's)
            "vllm.v1.worker.gpu.model_runner": _patch_runner}  # V2 runner (GPU 0.26 default)


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Finds the named vLLM modules through the other finders and patches them once run."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name not in _PATCHES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        run = loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            _PATCHES[name](module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _run_next_sitecustomize() -> None:
    """This file shadows any other sitecustomize on the path (an environment's own): run
    the next one, so the probe adds to the interpreter's start-up and removes nothing."""
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if not entry or os.path.abspath(entry) == here:
            continue
        path = os.path.join(entry, "sitecustomize.py")
        if os.path.isfile(path):
            spec = importlib.util.spec_from_file_location("_next_sitecustomize", path)
            if spec is not None and spec.loader is not None:
                spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


if __name__ == "sitecustomize":  # not when loaded by name for FIELDS
    if _DIR:
        gc.callbacks.append(_on_gc)
        sys.meta_path.insert(0, _PatchAfterImport())
    _run_next_sitecustomize()
