"""Issue 12's method for P1-P3: interleaved processes, >= 10 s repetitions, resolved ratios.

Configurations, each in its own process, interleaved over rounds
(vanilla, plain, steer, capture, vanilla, plain, ...; slot = position in that order):
- vanilla: stock vLLM (`vllm.LLM`);
- plain:   capsteer loaded, no fields (P1, target >= 0.99, min over both workloads);
- steer:   every request steered at all layers, resid_post add (P2, >= 0.95 per workload);
- capture: every request captures resid_post at one layer x all prompt positions, packed,
           durable (timed until every manifest is on disk) (P3, >= 0.90). The first capture
           process of a run also measures P3-all: all layers x all prompt positions, bytes/s
           written durably / the disk's `dd conv=fsync` rate measured in the same process.
Every process runs both workloads on the Qwen3-0.6B shape (bench/perf_models.py: real
vocabulary): prefill-heavy 256 x (512 in + 64 out) and decode-heavy 256 x (128 in + 512
out), ignore_eos, greedy. Each batch uses fresh random prompts (seeded by workload and batch
number, the same in every process), so vLLM's prefix cache, on as by default, never turns a
repeated prefill into a cache hit (the cached-token count is recorded to show it). After one
untimed full-size batch, a timed repetition runs whole batches until >= --min-seconds of
wall time; tokens/s = (prompt + generated tokens) / time. vanilla and plain processes also
generate 64 greedy requests for `plain_identity` (capsteer vs vanilla, vanilla vs vanilla).

Per configuration and workload: per-process medians, their median, and min/max. Ratio vs
vanilla = median / vanilla median; its spread = [min / vanilla max, max / vanilla min]. A
ratio is resolved only when that interval excludes its target ("met" / "missed"),
otherwise "unresolved". Paired per-round ratios are reported beside it.

`--paired`: the processes of one round are alive together (each engine takes
1/len(configs) of the GPU memory) and take turns on the GPU batch by batch: the driver
hands the next batch to the process with the least timed seconds in the earliest phase
(identity, warm-up, timed, per workload), so only one process ever runs and the
configurations' repetitions are spread over the same minutes. A host whose speed drifts
by tens of percent from minute to minute (seen on the lent H200s: one vanilla process's
batches took 1.5-2.2 s) then slows every configuration of a round alike. Each process
still runs its own >= --min-seconds repetition (20 s by default on cuda: batch times vary
by up to 40% from one batch to the next, nearly independently (session 36), so a mean over
15-20 batches is what makes a few-percent difference resolvable). The verdict then uses
the rounds' paired ratios (config / vanilla of the same round): ratio = their median,
spread = their min and max, >= 3 rounds; the unpaired spread is reported beside it.

    python bench/perf_method.py --device cpu --min-seconds 1           # smoke
    python bench/perf_method.py --device cuda --out $OUT               # all 12 slots
    python bench/perf_method.py --device cuda --slots 1-6 ; ... --slots 7-12   # two calls
    python bench/perf_method.py --device cuda --paired --rounds 3      # rounds taking turns
    python bench/perf_method.py --summarize DIR [DIR ...]              # merge process files

Each process's result is written as `perf-proc-SS-CONFIG.json` in --out and in --work (kept
on a warm machine between calls), and the summary (`<tag>-<date>-perf-method.json`) is
built from every process file found in both, so slots run in separate calls combine.
`--deadline EPOCH` stops launching processes that would not finish in time.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import queue
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import host_counters
import perf_models
import storage
from steer_ab import worker_counters

CONFIGS = ("vanilla", "plain", "steer", "capture")
TARGETS = {"plain": 0.99, "steer": 0.95, "capture": 0.90}
# Diagnostic configurations (name them in --configs): ratios vs vanilla, no target.
# steer_one: steering at one layer (the middle one) instead of all; beside `steer` it says
# how much of steering's cost grows with the number of steered sites.
# capture_w4: `capture` with 4 capture writer processes instead of the engine's default (2
# on a 16-CPU host); beside `capture` it says whether publishing's rate bounds P3.
# steer_dictwire: `steer` with the steering spec sent as nested dicts in extra_args (the
# wire form before 2026-11-26) instead of JSON text; beside `steer` it measures that change.
# capture_nocopy / capture_switch: `capture` with a part of the worker's capture path
# switched (steer_ab.DIAGNOSTICS "nocopy": rows not copied into the writer's ring;
# "switch": a 0.5 ms GIL switch interval in the engine process); beside `capture` they
# say how much of P3's gap that part makes.
# capture_copyring: `capture` with rows through the harvester's pinned ring and a host
# copy (the path before 2026-11-26's device ring); beside `capture` it measures that change.
# capture_first: `capture` of each request's first position only (one row, not 512):
# beside `capture` it separates the per-request capture machinery from the rows' volume.
# capture_direct: `capture` with the writer's data files through O_DIRECT (capture_io:
# direct); beside `capture`, and in P3-all, it measures direct I/O against the page cache.
DIAGNOSTIC = ("steer_one", "capture_w4", "steer_dictwire", "capture_nocopy", "capture_switch",
              "capture_copyring", "capture_first", "capture_direct")
CAPTURING = ("capture", "capture_w4", "capture_nocopy", "capture_switch", "capture_copyring",
             "capture_first", "capture_direct")
WORKER_PARTS = {"capture_nocopy": "nocopy", "capture_switch": "switch",
                "capture_copyring": "copyring"}
MIN_PROCESSES = 3  # per configuration, before a ratio's spread counts
# name: (requests, prompt tokens, generated tokens)
WORKLOADS = {
    "cuda": {"prefill": (256, 512, 64), "decode": (256, 128, 512)},
    "cpu": {"prefill": (16, 128, 8), "decode": (16, 16, 64)},
}
SHAPE = {"cuda": "qwen3-0.6b", "cpu": "qwen3-tiny"}
IDENTITY = {"cuda": (64, (16, 256), 32), "cpu": (64, (8, 64), 16)}  # requests, prompt range, gen
STEP_TOKENS = {"cuda": 2048, "cpu": 512}  # max_num_batched_tokens, the same for every config
MEM = {"cuda": 0.85, "cpu": 0.3}
DD_MIB = {"cuda": 4096, "cpu": 256}


# ---------------------------------------------------------------- helpers shared with gpu_perf


def gpu_query(fields: str) -> list[str] | None:
    """One nvidia-smi query (no CUDA context in this process, so no GPU memory held)."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (subprocess.SubprocessError, OSError):
        return None
    first = out.strip().splitlines()[0] if out.strip() else ""
    return [x.strip() for x in first.split(",")] if first else None


def device_name(device: str) -> str:
    if device != "cuda":
        return "cpu"
    got = gpu_query("name")
    return got[0] if got else "cuda"


def device_tag(name: str) -> str:
    """File-name tag of a device: h100, h200, gpu or cpu."""
    low = name.lower()
    for tag in ("h100", "h200", "b200", "a100"):
        if tag in low:
            return tag
    return "cpu" if low == "cpu" else "gpu"


def wait_gpu_free(fraction: float, timeout: float = 90.0) -> float:
    """Wait until `fraction` of the GPU's memory is free (the previous process's engine
    core may still be exiting); returns the seconds waited."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        got = gpu_query("memory.used,memory.total")
        if got is None:
            return 0.0
        used, total = float(got[0]), float(got[1])
        if total - used >= fraction * total:
            break
        time.sleep(0.5)
    return time.monotonic() - t0


def disk_rate(directory: Path, mib: int) -> float:
    """MB/s of `dd if=/dev/zero bs=1M conv=fsync` into `directory` (bench/storage.py's
    measurement; its Python write+fsync loop where there is no dd)."""
    directory.mkdir(parents=True, exist_ok=True)
    rate = storage.dd_rate(directory, mib)
    return rate if rate is not None else storage.loop_rate(directory, mib)


def parse_slots(text: str | None, total: int) -> list[int]:
    """'1-6', '7-12', '1,5,9' -> slot numbers (1-based); None -> all."""
    if not text:
        return list(range(1, total + 1))
    slots: list[int] = []
    for part in text.split(","):
        a, _, b = part.partition("-")
        slots.extend(range(int(a), int(b or a) + 1))
    return [s for s in slots if 1 <= s <= total]


# ---------------------------------------------------------------- one process


def _prompts(seed: int, n: int, length: int, vocab: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.integers(10, vocab, size=(n, length)).tolist()


def _identity_prompts(device: str, vocab: int) -> list[list[int]]:
    import numpy as np

    n, (lo, hi), _ = IDENTITY[device]
    rng = np.random.default_rng(12)
    return [rng.integers(10, vocab, size=int(rng.integers(lo, hi + 1))).tolist() for _ in range(n)]


def _wait_for(path: str | None, timeout: float) -> float:
    t0 = time.monotonic()
    while path and not os.path.exists(path) and time.monotonic() - t0 < timeout:
        time.sleep(0.1)
    return time.monotonic() - t0


class Turns:
    """A paired process's side of the turn protocol (see --paired): before using the GPU
    it says which phase it is in and how many timed seconds it has, and waits for "go";
    after, it says "done". Unpaired processes never wait."""

    def __init__(self, ctl_fd: int | None) -> None:
        self.ctl = os.fdopen(ctl_fd, "w", buffering=1) if ctl_fd is not None else None

    def take(self, phase: int, timed_s: float = 0.0) -> None:
        if self.ctl is None:
            return
        self.ctl.write(f"want {phase} {timed_s:.6f}\n")
        line = sys.stdin.readline()
        if line.strip() != "go":
            raise SystemExit(f"turn protocol: expected 'go', got {line!r}")

    def give(self) -> None:
        if self.ctl is not None:
            self.ctl.write("done\n")


def run_process(a: argparse.Namespace) -> dict[str, Any]:
    """One configuration, both workloads (+ identity, + P3-all); returns its figures."""
    t_start = time.time()
    pinned = None
    if a.pin == "cores":  # before any thread starts: every thread and child inherits it
        pinned = host_counters.one_cpu_per_core()
        os.sched_setaffinity(0, pinned)
    turns = Turns(a.ctl_fd)
    probe = host_counters.SpeedProbe() if a.speed_probe else None
    monitor = (host_counters.GpuMonitor(Path(a.work) / f"gpu-samples-{a.slot:02d}.csv")
               if a.gpu_monitor else None)
    spans: list[tuple[dict[str, Any], float, float]] = []  # (batch's host dict, start, end)
    probe_dir = os.environ.get("CAPSTEER_ENGINE_PROBE_DIR")  # set by the driver: --engine-probe
    import vllm  # noqa: F401  (the import is what the overlap hides)
    from vllm import SamplingParams

    if a.config != "vanilla":  # the vanilla process never imports capsteer
        from capsteer.engine import Engine, Request
    if a.config == "steer_dictwire":
        _send_steering_as_dicts()
    if a.config in WORKER_PARTS:  # the worker-side switch travels to the engine by cloudpickle
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"

    import_s = time.time() - t_start
    if a.imported_file:
        Path(a.imported_file).touch()
    waited_go = _wait_for(a.go_file, 3600)
    mem = a.mem_fraction or MEM[a.device]
    # paired processes share the GPU on purpose: the driver starts them one after another
    waited_mem = wait_gpu_free(mem + 0.05) if a.device == "cuda" and not a.ctl_fd else 0.0
    shape = perf_models.SHAPES[a.shape]
    workloads = {k: v for k, v in WORKLOADS[a.device].items() if k in a.workloads.split(",")}
    gens = [g for _, p, g in workloads.values()] + [IDENTITY[a.device][2]]
    longest = max([p + g for _, p, g in workloads.values()] + [IDENTITY[a.device][1][1] + gens[-1]])
    kw: dict[str, Any] = dict(perf_models.engine_kwargs(a.shape), seed=0,
                              max_model_len=longest + 16, gpu_memory_utilization=mem,
                              max_num_batched_tokens=a.step_tokens)
    # One path for every process: the capsteer config is part of vLLM's compile-cache key,
    # so a per-process path would recompile in every process (seen on CPU: one AOT cache
    # entry per capsteer process). Processes never overlap, so they can share it.
    capture_dir = Path(a.work) / "captures"
    shutil.rmtree(capture_dir, ignore_errors=True)
    capture_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    engine = llm = None
    if a.config == "vanilla":
        from vllm import LLM

        llm = LLM(model=a.model, **kw)
    else:
        staging = a.step_tokens * (shape.layers + 1)  # P3-all: a whole step, every layer
        settings: dict[str, Any] = {"capture_dir": str(capture_dir), "staging_rows": staging}
        if a.config == "capture_w4":
            settings["capture_writer_processes"] = 4
        if a.config == "capture_direct":
            settings["capture_io"] = "direct"
        engine = Engine(a.model, capsteer_config=settings, **kw)
        if a.config in WORKER_PARTS:
            from steer_ab import _worker_diagnostic

            engine.llm.collective_rpc(_worker_diagnostic, args=(WORKER_PARTS[a.config],))
    startup_s = time.perf_counter() - started
    if a.pin.startswith("step:"):
        pinned = host_counters.pin_step_thread(int(a.pin.split(":", 1)[1]))
    one_layer = shape.layers // 2
    steering = {"vectors": [{"hook": "resid_post", "layers": "all",
                             "vector": [0.01] * shape.hidden, "scale": 1.0}]}
    capture_one = {"hooks": ["resid_post"], "layers": [one_layer], "positions": "prompt",
                   "layout": "packed"}
    capture_all = {"hooks": ["resid_post"], "layers": "all", "positions": "prompt",
                   "layout": "packed"}

    def batch(prompts: list[list[int]], gen: int, capture: object = None,
              steer: object = None) -> dict[str, int]:
        """Run one batch to completion (captures: until durable); returns counters."""
        sampling = {"max_tokens": gen, "temperature": 0.0, "ignore_eos": True}
        if llm is not None:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                SamplingParams(**sampling), use_tqdm=False)
            return {"cached": sum(int(o.num_cached_tokens or 0) for o in outs), "bytes": 0,
                    "generated": sum(len(o.outputs[0].token_ids) for o in outs)}
        assert engine is not None
        results = engine.generate([Request(prompt_token_ids=p, sampling=sampling, steering=steer,
                                           capture=capture, durable=capture is not None)
                                   for p in prompts], timeout=900)
        tail = engine.last_phases.get("captures", 0.0)
        bad = [r.receipt for r in results if r.receipt is not None and r.receipt.status != "ok"]
        if bad:
            raise RuntimeError(f"{len(bad)} captures failed, e.g. {bad[0]}")
        return {"cached": sum(r.num_cached_tokens for r in results),
                "bytes": sum(r.receipt.bytes for r in results if r.receipt is not None),
                "generated": sum(len(r.token_ids) for r in results), "captures_s": tail}

    def clear_captures() -> None:
        shutil.rmtree(capture_dir, ignore_errors=True)
        capture_dir.mkdir(parents=True, exist_ok=True)

    steer = {"steer": steering, "steer_dictwire": steering, "steer_one": {"vectors": [
        {"hook": "resid_post", "layers": [one_layer], "vector": [0.01] * shape.hidden,
         "scale": 1.0}]}}.get(a.config)
    capture = capture_one if a.config in CAPTURING else None
    if a.config == "capture_first":  # one row a request: the per-request machinery alone
        capture = {**capture_one, "positions": [0]}
    per_round = len(a.configs.split(","))
    out: dict[str, Any] = {"config": a.config, "slot": a.slot,
                           "round": (a.slot - 1) // per_round + 1,
                           "shape": a.shape, "device": a.device, "pid": os.getpid(),
                           "import_s": import_s, "waited_go_s": waited_go,
                           "waited_gpu_memory_s": waited_mem, "startup_s": startup_s,
                           "engine_kwargs": kw, "min_seconds": a.min_seconds, "reps": a.reps,
                           "paired": a.ctl_fd is not None, "pinned_cpus": pinned,
                           "workloads": {}}
    if a.config in ("vanilla", "plain") and a.identity:
        n, _, gen = IDENTITY[a.device]
        prompts = _identity_prompts(a.device, shape.vocab)
        turns.take(0)
        if llm is not None:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True),
                                use_tqdm=False)
            tokens = [list(o.outputs[0].token_ids) for o in outs]
        else:
            assert engine is not None
            tokens = [r.token_ids for r in engine.generate(
                [Request(prompt_token_ids=p, sampling={"max_tokens": gen, "temperature": 0.0,
                                                       "ignore_eos": True}) for p in prompts])]
        turns.give()
        out["identity_tokens"] = tokens
    _wait_for(a.wait_file, 300)  # the next process has finished importing: nothing overlaps
    for w_index, (name, (n, prompt, gen)) in enumerate(workloads.items()):
        seed0 = {"prefill": 1_000, "decode": 2_000}[name]
        vocab = shape.vocab
        # Untimed warm-up: a quarter batch at full prompt length, 64 tokens out (CUDA graphs
        # are captured at start-up; this covers first-use set-up, not every batch size).
        turns.take(1 + 2 * w_index)
        t = time.perf_counter()
        batch(_prompts(seed0 + 999, max(1, n // 4), prompt, vocab), min(gen, 64), capture, steer)
        warm_s = time.perf_counter() - t
        turns.give()
        clear_captures()
        reps = []
        b = 0
        hooks_before = _hook_counters(engine)
        for _ in range(a.reps):
            times: list[float] = []
            tails: list[float] = []
            host: list[dict[str, Any]] = []
            cached = nbytes = generated = 0
            while sum(times) < a.min_seconds or len(times) < a.min_batches:
                prompts = _prompts(seed0 + b, n, prompt, vocab)
                b += 1
                turns.take(2 + 2 * w_index, sum(times) + 1e3 * len(reps))
                counters = host_counters.snapshot(probe_dir)
                speed = probe.read() if probe else None
                wall = time.time()
                t = time.perf_counter()
                got = batch(prompts, gen, capture, steer)
                times.append(time.perf_counter() - t)
                host.append(host_counters.delta(counters, host_counters.snapshot(probe_dir))
                            | (probe.delta(speed, probe.read()) if probe and speed else {}))
                spans.append((host[-1], wall, wall + times[-1]))
                turns.give()
                tails.append(got.get("captures_s", 0.0))
                cached += got["cached"]
                nbytes += got["bytes"]
                generated += got["generated"]
            clear_captures()  # untimed: every repetition writes afresh
            tokens = len(times) * n * prompt + generated
            reps.append({"batches": len(times), "seconds": sum(times), "batch_s": times,
                         "tokens": tokens, "tokens_per_s": tokens / sum(times),
                         "cached_tokens": cached, "capture_bytes": nbytes,
                         # of each batch_s: after the last output, waiting for receipts
                         "captures_tail_s": tails,
                         # per batch: CPU steal, CPU pressure, the process tree's threads
                         "host": host})
        out["workloads"][name] = {
            "requests": n, "prompt": prompt, "gen": gen, "warmup_s": warm_s, "reps": reps,
            "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in reps),
            # the timed batches' hook counters (host seconds by phase, the harvester's
            # backpressure wait and delivery seconds): where a hooked batch's time went
            "hook_counters": _counter_delta(hooks_before, _hook_counters(engine))}
        if a.profile_batch and engine is not None:  # untimed, after the timed batches
            turns.take(2 + 2 * w_index, 1e9)
            engine.llm.collective_rpc("capsteer_profile", args=(True, 40))
            batch(_prompts(seed0 + 10_000, n, prompt, vocab), gen, capture, steer)
            text = engine.llm.collective_rpc("capsteer_profile", args=(False, 40))[0]
            turns.give()
            clear_captures()
            prof = Path(a.work) / f"profile-{a.slot:02d}-{a.config}-{name}.txt"
            prof.write_text(text)
            out["workloads"][name]["profile_file"] = str(prof)
    if a.do_p3all and a.config == "capture":
        turns.take(99)  # alone on the GPU, after every other process's timed batches
        out["p3all"] = _p3all(a, batch, clear_captures, capture_all, capture_dir)
        turns.give()
    if probe is not None:
        probe.close()
    if monitor is not None:  # each batch's GPU samples (nvidia-smi's own clock, this host's)
        monitor.close()
        samples = monitor.samples()
        for entry, t0, t1 in spans:
            entry.update(monitor.window(samples, t0, t1))
    out["process_s"] = time.time() - t_start
    if llm is not None:
        llm.llm_engine.engine_core.shutdown()
    elif engine is not None:
        engine.close()
    shutil.rmtree(capture_dir, ignore_errors=True)
    return out


def _send_steering_as_dicts() -> None:
    """The steer_dictwire diagnostic: Engine.generate's payloads carry the steering spec as
    its mapping (`to_dict()`, one dict per op) without `steering_key`, as before the text
    form; workers read both."""
    import capsteer.engine as engine_mod

    text_form = engine_mod.build_payload

    def build_payload(capture, steering, *args, **kwargs):
        payload = text_form(capture, steering, *args, **kwargs)
        if payload is not None and steering is not None and not steering.is_noop:
            as_dict_wire(payload.extra_args[engine_mod.EXTRA_ARGS_KEY], steering)
        return payload

    engine_mod.build_payload = build_payload


def as_dict_wire(fields: dict[str, Any], steering: Any) -> None:
    """A payload's fields (`extra_args["capsteer"]`) with the steering spec in the nested
    mapping form sent before 2026-11-26 instead of JSON text and its key."""
    fields["steering"] = steering.to_dict()
    fields.pop("steering_key", None)


def _workload_line(p: dict[str, Any]) -> str:
    """One process's figures for its progress line; a capturing one adds the time its
    batches spent after their last output, waiting for durable receipts."""
    parts = []
    for k, v in p["workloads"].items():
        r = v["reps"][0]
        tail = sum(r.get("captures_tail_s") or [0.0])
        parts.append(f"{k} {v['median_tokens_per_s']:,.0f} tok/s ({r['batches']} batches, "
                     f"{r['seconds']:.1f} s" + (f", receipt tail {tail:.2f} s" if tail else "")
                     + ")")
    return " ".join(parts)


def _hook_counters(engine: Any) -> dict[str, float]:
    """The first worker's cumulative hook counters (none for vanilla)."""
    return {} if engine is None else worker_counters(engine)


def _counter_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: round(v - before.get(k, 0.0), 6) for k, v in after.items()}


def _p3all(a: argparse.Namespace, batch: Callable[..., dict[str, int]],
           clear: Callable[[], None], capture_all: dict, capture_dir: Path) -> dict[str, Any]:
    """All layers x all prompt positions, durable: MB/s vs the disk's fsync'd dd rate."""
    n, prompt, gen = WORKLOADS[a.device]["prefill"]
    vocab = perf_models.SHAPES[a.shape].vocab
    dd_before = disk_rate(capture_dir / "dd", DD_MIB[a.device])
    batch(_prompts(3_999, max(4, n // 16), prompt, vocab), gen, capture_all)  # warm-up
    clear()
    times: list[float] = []
    nbytes = 0
    b = 0
    while sum(times) < a.min_seconds or not times:
        free = shutil.disk_usage(capture_dir).free
        if times and free < 3 * nbytes / len(times):  # room for one more batch, with margin
            break
        prompts = _prompts(3_000 + b, n, prompt, vocab)
        b += 1
        t = time.perf_counter()
        nbytes += batch(prompts, gen, capture_all)["bytes"]
        times.append(time.perf_counter() - t)
    clear()
    dd_after = disk_rate(capture_dir / "dd", DD_MIB[a.device])
    disk = max(dd_before, dd_after)
    rate = nbytes / sum(times) / 1e6
    return {"batches": len(times), "seconds": sum(times), "bytes": nbytes, "mb_s": rate,
            "disk_dd_mb_s": [dd_before, dd_after], "disk_mb_s": disk, "ratio": rate / disk,
            "dd_mib": DD_MIB[a.device], "requests_per_batch": n, "prompt": prompt}


# ---------------------------------------------------------------- summary


def _verdict(lo: float, hi: float, target: float) -> str:
    if lo >= target:
        return "met"
    if hi < target:
        return "missed"
    return "unresolved"


def _pair_agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, float]:
    same = sum(x == y for x, y in zip(a, b, strict=True))
    prefix = []
    for x, y in zip(a, b, strict=True):
        k = next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), len(x))
        prefix.append(k / max(len(x), 1))
    return {"identical": same, "of": len(a), "fraction": same / max(len(a), 1),
            "mean_prefix_fraction": statistics.mean(prefix) if prefix else 1.0}


def summarize(procs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-config/workload statistics, ratios vs vanilla with spread and verdict, identity."""
    procs = sorted(procs, key=lambda p: p["slot"])
    stats: dict[str, dict[str, Any]] = {}
    for p in procs:
        for wl, w in p["workloads"].items():
            s = stats.setdefault(p["config"], {}).setdefault(wl, {"slots": [], "per_process": [],
                                                                  "rounds": [], "best": [],
                                                                  "all_paired": True})
            s["all_paired"] = s["all_paired"] and bool(p.get("paired"))
            s["slots"].append(p["slot"])
            s["rounds"].append(p["round"])
            s["per_process"].append(w["median_tokens_per_s"])
            # Supplementary: the process's fastest batch (noise on a shared host only ever
            # slows a batch down); reported beside the verdict, never instead of it.
            s["best"].append(max(r["tokens"] / r["batches"] / min(r["batch_s"])
                                 for r in w["reps"]))
    for cfg in stats.values():
        for s in cfg.values():
            v = s["per_process"]
            s.update(median=statistics.median(v), min=min(v), max=max(v), processes=len(v),
                     spread_pct=100 * (max(v) - min(v)) / statistics.median(v))
    ratios: dict[str, dict[str, Any]] = {}
    van = stats.get("vanilla", {})
    for cfg, target in [*TARGETS.items(), *((c, None) for c in DIAGNOSTIC)]:
        for wl, s in stats.get(cfg, {}).items():
            if wl not in van:
                continue
            v = van[wl]
            by_round = dict(zip(v["rounds"], v["per_process"], strict=True))
            paired = [x / by_round[r] for r, x in zip(s["rounds"], s["per_process"], strict=True)
                      if r in by_round]
            lo, hi = s["min"] / v["max"], s["max"] / v["min"]
            entry = {"ratio": s["median"] / v["median"], "lo": lo, "hi": hi, "method": "unpaired"}
            if s["all_paired"] and v["all_paired"] and paired:
                # processes of a round took turns on the GPU: judge by the rounds' ratios
                entry = {"ratio": statistics.median(paired), "lo": min(paired),
                         "hi": max(paired), "method": "paired",
                         "unpaired": {"ratio": s["median"] / v["median"], "lo": lo, "hi": hi}}
            # rounds (paired) or processes per configuration (unpaired) behind the spread
            samples = len(paired) if entry["method"] == "paired" else min(s["processes"],
                                                                           v["processes"])
            few = samples < MIN_PROCESSES
            ratios.setdefault(cfg, {})[wl] = entry | {
                "samples": samples,
                "target": target,
                # fewer processes than the method asks for: the spread is not measured
                "verdict": "n/a" if target is None else (
                    "unresolved" if few else _verdict(entry["lo"], entry["hi"], target)),
                "processes": [s["processes"], v["processes"]],
                "best_batch": {"ratio": statistics.median(s["best"]) / statistics.median(v["best"]),
                               "lo": min(s["best"]) / max(v["best"]),
                               "hi": max(s["best"]) / min(v["best"])},
                "paired_by_round": paired}
    out: dict[str, Any] = {"stats": stats, "ratios": ratios}
    keys: dict[str, Any] = {}
    for key, cfg in (("p1_plain", "plain"), ("p3_capture_one_layer", "capture")):
        per = ratios.get(cfg, {})
        if per:  # the min over the workloads; its bounds are the min of the bounds
            lo, hi = min(r["lo"] for r in per.values()), min(r["hi"] for r in per.values())
            few = any(r["samples"] < MIN_PROCESSES for r in per.values())
            keys[key] = {"value": min(r["ratio"] for r in per.values()), "lo": lo, "hi": hi,
                         "target": TARGETS[cfg],
                         "method": ",".join(sorted({r["method"] for r in per.values()})),
                         "verdict": "unresolved" if few else _verdict(lo, hi, TARGETS[cfg]),
                         "workloads": sorted(per)}
    for wl in ("prefill", "decode"):
        r = ratios.get("steer", {}).get(wl)
        if r:
            keys[f"p2_steer_{wl}"] = {"value": r["ratio"], "lo": r["lo"], "hi": r["hi"],
                                      "target": r["target"], "verdict": r["verdict"],
                                      "method": r["method"]}
    p3 = [p["p3all"] for p in procs if "p3all" in p]
    if p3:
        best = p3[0]
        keys["p3_capture_all_vs_disk"] = {"value": best["ratio"], "target": 0.80,
                                          "verdict": "met" if best["ratio"] >= 0.8 else "missed",
                                          "mb_s": best["mb_s"], "disk_mb_s": best["disk_mb_s"]}
        out["p3all"] = p3
    ident = {p["slot"]: (p["config"], p["identity_tokens"]) for p in procs if "identity_tokens" in p}
    vs = [s for s, (c, _) in ident.items() if c == "vanilla"]
    ps = [s for s, (c, _) in ident.items() if c == "plain"]
    if vs and ps:
        vv = [_pair_agreement(ident[x][1], ident[y][1]) | {"pair": [x, y]}
              for i, x in enumerate(vs) for y in vs[i + 1:]]
        pv = [_pair_agreement(ident[p][1], ident[v][1]) | {"pair": [p, v]} for p in ps for v in vs]
        mean_pv = statistics.mean(r["fraction"] for r in pv)
        mean_vv = statistics.mean(r["fraction"] for r in vv) if vv else None
        keys["plain_identity"] = {
            "value": mean_pv, "vanilla_vs_vanilla": mean_vv,
            "requests": len(ident[vs[0]][1]),
            "verdict": "unresolved" if mean_vv is None else (
                "met" if mean_pv >= mean_vv else "missed"),
            "note": "fraction of requests with identical greedy tokens, mean over process pairs"}
        out["identity"] = {"vanilla_vs_vanilla": vv, "plain_vs_vanilla": pv}
    out["keys"] = keys
    return out


def print_summary(summary: dict[str, Any]) -> None:
    stats, ratios = summary["stats"], summary["ratios"]
    print(f"\n{'config':9}{'workload':9}{'procs':>6}{'median tok/s':>14}{'min':>12}{'max':>12}"
          f"{'spread%':>9}{'ratio':>8}{'lo':>7}{'hi':>7}{'target':>7}  verdict")
    for cfg in (*CONFIGS, *DIAGNOSTIC):
        for wl, s in stats.get(cfg, {}).items():
            r = ratios.get(cfg, {}).get(wl)
            tail = (f"{r['ratio']:>8.3f}{r['lo']:>7.3f}{r['hi']:>7.3f}{r['target']!s:>7}  "
                    f"{r['verdict']:11}{r['method']:9}best batch {r['best_batch']['ratio']:.3f} "
                    f"({r['best_batch']['lo']:.3f}-{r['best_batch']['hi']:.3f})") if r else ""
            print(f"{cfg:9}{wl:9}{s['processes']:>6}{s['median']:>14,.0f}{s['min']:>12,.0f}"
                  f"{s['max']:>12,.0f}{s['spread_pct']:>9.1f}{tail}")
    for p in summary.get("p3all", []):
        print(f"P3-all: {p['bytes'] / 1e9:.2f} GB in {p['seconds']:.1f} s = {p['mb_s']:,.0f} MB/s; "
              f"disk dd conv=fsync {p['disk_dd_mb_s'][0]:,.0f} / {p['disk_dd_mb_s'][1]:,.0f} MB/s "
              f"-> ratio {p['ratio']:.2f} (target 0.80)")
    ident = summary.get("identity")
    if ident:
        vv = ", ".join(f"{r['pair']}: {r['identical']}/{r['of']}" for r in ident["vanilla_vs_vanilla"])
        pv = ", ".join(f"{r['pair']}: {r['identical']}/{r['of']}" for r in ident["plain_vs_vanilla"])
        print(f"identity (identical greedy requests) vanilla-vanilla {vv or '-'}; "
              f"plain-vanilla {pv}")
    print("\nkeys: " + json.dumps({k: round(v["value"], 4) if isinstance(v.get("value"), float)
                                   else v.get("value") for k, v in summary["keys"].items()}))


def load_procs(dirs: Iterable[Path]) -> list[dict[str, Any]]:
    """Every perf-proc-*.json under the given directories, one per slot (latest wins)."""
    found: dict[int, tuple[float, dict[str, Any]]] = {}
    for d in dirs:
        for f in sorted(Path(d).glob("**/perf-proc-*.json")):
            p = json.loads(f.read_text())
            stamp = float(p.get("finished_at", 0))
            if p["slot"] not in found or stamp > found[p["slot"]][0]:
                found[p["slot"]] = (stamp, p)
    return [p for _, p in found.values()]


def write_report(procs: list[dict[str, Any]], out: Path, meta: dict[str, Any]) -> Path:
    summary = summarize(procs)
    print_summary(summary)
    slim = [{k: v for k, v in p.items() if k != "identity_tokens"} for p in procs]
    report = {**meta, "summary": summary, "procs": slim}
    path = out / f"{device_tag(meta['device'])}-{meta['date']}-perf-method.json"
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}")
    return path


# ---------------------------------------------------------------- driver


def estimate_process_s(device: str, config: str, min_s: float, reps: int, p3all: bool,
                       cold: bool, first: bool = False) -> float:
    """A guess of one process's wall time, before any was measured (see gpu_perf.py):
    H100 2026-11-22, warm engine start ~20 s after imports, first compile ~+85 s; a
    process's imports overlap the previous one's start-up, except the first's."""
    if device != "cuda":
        return (45.0 + (8 if first else 0) + (15 if cold else 0) + 2 * reps * (min_s + 0.5)
                + (10 if p3all else 0))
    start = 25.0 + (10.0 if first else 0.0) + (85.0 if cold else 0.0)
    warm = 2.0  # a quarter batch of each workload
    work = reps * (min_s + 0.5 + min_s + 2.0)  # overshoot: half a batch on average
    extra = 2.0 if config in ("vanilla", "plain") else 0.0  # identity batch
    return start + warm + work + extra + (8 + 1 + max(min_s, 12) if p3all else 0.0) + 4.0


def _spawn(a: argparse.Namespace, slot: int, config: str, model: str, logs: Path,
           sig: Path, p3all: bool, go: Path | None,
           ctl_fd: int | None = None) -> tuple[subprocess.Popen, Path, Path]:
    result = Path(a.work) / "procs" / a.configs.replace(",", "-") / f"perf-proc-{slot:02d}-{config}.json"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "--one", config, "--slot", str(slot), "--model", model,
           "--device", a.device, "--shape", a.shape, "--min-seconds", str(a.min_seconds),
           "--min-batches", str(a.min_batches), "--reps", str(a.reps), "--work", a.work,
           "--step-tokens", str(a.step_tokens),
           "--workloads", a.workloads, "--result-file", str(result), "--configs", a.configs]
    if ctl_fd is None:
        cmd += ["--imported-file", str(sig / f"{slot}.imported"),
                "--wait-file", str(sig / f"{slot}.next-imported")]
    else:
        share = MEM[a.device] / len(a.configs.split(","))
        cmd += ["--ctl-fd", str(ctl_fd), "--mem-fraction", f"{share:.4f}"]
    if go is not None:
        cmd += ["--go-file", str(go)]
    if p3all:
        cmd.append("--do-p3all")
    if a.no_identity:
        cmd.append("--no-identity")
    if a.pin != "none":
        cmd += ["--pin", a.pin]
    if a.speed_probe:
        cmd.append("--speed-probe")
    if a.gpu_monitor:
        cmd.append("--gpu-monitor")
    if a.profile_batch:
        cmd.append("--profile-batch")
    log = logs / f"slot-{slot:02d}-{config}.log"
    env = None
    if a.engine_probe:  # the same probe in every config's processes (front end, EngineCore)
        probe_dir = Path(a.work) / "engine-probe"
        probe_dir.mkdir(parents=True, exist_ok=True)
        env = os.environ | host_counters.engine_probe_env(probe_dir)
    if ctl_fd is None:
        proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    else:
        proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env,
                                stdin=subprocess.PIPE, text=True, pass_fds=(ctl_fd,))
    return proc, result, log


class _Child:
    """The driver's view of one paired process: its turn requests arrive on a pipe."""

    def __init__(self, a: argparse.Namespace, slot: int, config: str, model: str, logs: Path,
                 sig: Path, p3all: bool, events: queue.Queue) -> None:
        self.slot, self.config = slot, config
        read_fd, write_fd = os.pipe()
        self.proc, self.result, self.log = _spawn(a, slot, config, model, logs, sig, p3all,
                                                  None, ctl_fd=write_fd)
        os.close(write_fd)
        self.want: tuple[int, float] | None = None
        self.busy = True  # starting up, or running a turn
        self.turns = 0
        self.started = time.time()

        def read() -> None:
            with os.fdopen(read_fd) as fh:
                for line in fh:
                    events.put((self, line.split()))
            events.put((self, ["eof"]))

        threading.Thread(target=read, daemon=True).start()

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.want = None
        self.turns += 1
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()


def _wait_event(children: list[_Child], events: queue.Queue,
                until: Callable[[], bool], deadline: float | None) -> None:
    """Apply turn messages until `until()` holds (a dead process counts as done)."""
    while not until():
        try:
            child, msg = events.get(timeout=0.5)
        except queue.Empty:
            if deadline and time.time() > deadline + 30:
                for c in children:
                    c.proc.kill()
                raise SystemExit("paired round: past the deadline, processes killed") from None
            continue
        if msg[0] == "want":
            child.want = (int(msg[1]), float(msg[2]))
        elif msg[0] == "done":
            child.busy = False
        elif msg[0] == "eof":
            child.proc.wait()
            child.busy = False


def drive_paired(a: argparse.Namespace) -> int:
    """--paired: each round's processes are alive together and take turns batch by batch."""
    configs = a.configs.split(",")
    total = a.rounds * len(configs)
    slots = parse_slots(a.slots, total)
    rounds = sorted({(s - 1) // len(configs) + 1 for s in slots})
    out, work = Path(a.out), Path(a.work)
    procs_dir = work / "procs" / a.configs.replace(",", "-")
    procs_dir.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    sig = work / f"signals-{os.getpid()}"
    sig.mkdir(exist_ok=True)
    model = str(perf_models.write_model(work / a.shape, a.shape, a.device))
    measured = any("p3all" in p for p in load_procs([procs_dir]))
    p3all_done = not a.p3all or measured
    failed: list[int] = []
    round_s: list[float] = []
    for r in rounds:
        plan = [((r - 1) * len(configs) + i + 1, c) for i, c in enumerate(configs)]
        guess = max(round_s) if round_s else sum(
            estimate_process_s(a.device, c, a.min_seconds, a.reps, False, False) for c in configs)
        if a.deadline and time.time() + guess > a.deadline:
            print(f"deadline: not starting round {r} (~{guess:.0f} s); run it with --slots "
                  f"{plan[0][0]}-{plan[-1][0]}", flush=True)
            break
        t_round = time.time()
        events: queue.Queue = queue.Queue()
        children: list[_Child] = []
        for slot, config in plan:  # one start-up at a time: each sizes its KV cache alone
            p3 = config == "capture" and not p3all_done
            p3all_done = p3all_done or p3
            child = _Child(a, slot, config, model, logs, sig, p3, events)
            children.append(child)
            _wait_event(children, events,
                        lambda c=child: c.want is not None or c.proc.poll() is not None,
                        a.deadline)
            print(f"round {r}: slot {slot} {config} up after {time.time() - child.started:.0f} s",
                  flush=True)
        while True:
            live = [c for c in children if c.proc.poll() is None]
            if not live:
                break
            _wait_event(children, events,
                        lambda cs=children: all(c.want is not None or c.proc.poll() is not None
                                                for c in cs), a.deadline)
            waiting = [c for c in children if c.want is not None and c.proc.poll() is None]
            if not waiting:
                continue
            nxt = min(waiting, key=lambda c: (c.want, c.slot))
            nxt.busy = True
            nxt.go()
            _wait_event(children, events, lambda c=nxt: not c.busy, a.deadline)
        for c in children:
            if c.proc.returncode != 0 or not c.result.exists():
                failed.append(c.slot)
                tail = c.log.read_text(errors="replace").splitlines()[-40:]
                print(f"slot {c.slot} {c.config} FAILED (rc {c.proc.returncode}); log tail:\n"
                      + "\n".join(tail), flush=True)
                continue
            p = json.loads(c.result.read_text())
            p["finished_at"] = time.time()
            p["wall_s"] = time.time() - c.started
            p["turns"] = c.turns
            c.result.write_text(json.dumps(p))
            (out / c.result.name).write_text(json.dumps(p))
            w = _workload_line(p)
            print(f"slot {c.slot:2} {c.config:8} start-up {p['startup_s']:.0f} s, "
                  f"{c.turns} turns: {w}", flush=True)
            _trim_log(c.log)
        round_s.append(time.time() - t_round)
    shutil.rmtree(sig, ignore_errors=True)
    procs = load_procs([out, procs_dir])
    if procs:
        write_report(procs, out, _meta(a) | {"paired": True})
    return 1 if failed else 0


def drive(a: argparse.Namespace) -> int:
    configs = a.configs.split(",")
    total = a.rounds * len(configs)
    slots = parse_slots(a.slots, total)
    out, work = Path(a.out), Path(a.work)
    procs_dir = work / "procs" / a.configs.replace(",", "-")  # one interleave, across calls
    procs_dir.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    sig = work / f"signals-{os.getpid()}"
    sig.mkdir(exist_ok=True)
    t0 = time.time()
    model = str(perf_models.write_model(work / a.shape, a.shape, a.device))
    print(f"model {perf_models.describe(a.shape)} at {model} ({time.time() - t0:.1f} s)",
          flush=True)
    plan = [(s, configs[(s - 1) % len(configs)]) for s in slots]
    measured = any("p3all" in p for p in load_procs([procs_dir]))  # by an earlier call
    p3all_slot = next((s for s, c in plan if c == "capture"), None) if (
        a.p3all and not measured) else None
    warm_marks = work / "warm"
    warm_marks.mkdir(exist_ok=True)
    est: dict[int, float] = {}
    seen: set[str] = set()
    for s, c in plan:
        kind = "vanilla" if c == "vanilla" else "capsteer"
        est[s] = estimate_process_s(a.device, c, a.min_seconds, a.reps, s == p3all_slot,
                                    not (warm_marks / kind).exists() and kind not in seen,
                                    first=s == plan[0][0])
        seen.add(kind)
    print(f"plan: {len(plan)} processes, slots {slots[0]}-{slots[-1]} "
          f"({', '.join(c for _, c in plan)}); estimated {sum(est.values()) / 60:.1f} min",
          flush=True)
    durations: list[float] = []
    failed: list[int] = []
    done: list[int] = []
    pending = None  # the next process, spawned early: it imports while this one starts up
    i = 0
    while i < len(plan):
        slot, config = plan[i]
        # the first process may include a first compile: later ones predict better
        guess = max(durations[1:]) if len(durations) > 1 else est[slot]
        if a.deadline and time.time() + guess > a.deadline:
            rest = ",".join(str(s) for s, _ in plan[i:])
            print(f"deadline: not starting slot {slot} (~{guess:.0f} s); run the rest with "
                  f"--slots {rest}", flush=True)
            if pending is not None:
                pending[0].kill()
            break
        started = time.time()
        if pending is None:
            proc, result, log = _spawn(a, slot, config, model, logs, sig, slot == p3all_slot, None)
        else:
            proc, result, log = pending
            (sig / f"{plan[i - 1][0]}.exited").touch()
        pending = None
        nxt = plan[i + 1] if i + 1 < len(plan) and a.overlap else None
        if nxt is not None:
            pending = _spawn(a, nxt[0], nxt[1], model, logs, sig, nxt[0] == p3all_slot,
                             sig / f"{slot}.exited")
            # this process waits for the next one's import before timing anything
            nxt_imported = sig / f"{nxt[0]}.imported"
        else:
            (sig / f"{slot}.next-imported").touch()
        while proc.poll() is None:
            if nxt is not None and nxt_imported.exists():
                (sig / f"{slot}.next-imported").touch()
            if nxt is not None and pending is not None and pending[0].poll() is not None:
                (sig / f"{slot}.next-imported").touch()  # the next one died: do not wait
            time.sleep(0.2)
        took = time.time() - started
        if proc.returncode != 0 or not result.exists():
            failed.append(slot)
            tail = log.read_text(errors="replace").splitlines()[-40:]
            print(f"slot {slot} {config} FAILED (rc {proc.returncode}); log tail:\n"
                  + "\n".join(tail), flush=True)
        else:
            p = json.loads(result.read_text())
            p["finished_at"] = time.time()
            p["wall_s"] = took
            result.write_text(json.dumps(p))
            (out / result.name).write_text(json.dumps(p))
            (warm_marks / ("vanilla" if config == "vanilla" else "capsteer")).touch()
            done.append(slot)
            durations.append(took)
            w = _workload_line(p)
            print(f"slot {slot:2} {config:8} import {p['import_s']:.0f} s, start-up "
                  f"{p['startup_s']:.0f} s, wall {took:.0f} s: {w}", flush=True)
        _trim_log(log)
        i += 1
    (sig / f"{plan[-1][0]}.exited").touch()
    shutil.rmtree(sig, ignore_errors=True)
    procs = load_procs([out, procs_dir])
    if procs:
        write_report(procs, out, _meta(a))
    return 1 if failed else 0


def _trim_log(log: Path, keep: int = 400) -> None:
    """Logs come back through $OUT: keep their tails only."""
    lines = log.read_text(errors="replace").splitlines()
    if len(lines) > keep:
        log.write_text("\n".join([f"[{len(lines) - keep} lines cut]", *lines[-keep:]]) + "\n")


def _meta(a: argparse.Namespace) -> dict[str, Any]:
    return {"machine": platform.node(), "device": device_name(a.device),
            "date": dt.date.today().isoformat(),
            "command": "python bench/perf_method.py " + " ".join(sys.argv[1:]),
            "shape": perf_models.describe(a.shape), "workloads": WORKLOADS[a.device],
            "min_seconds": a.min_seconds, "reps": a.reps, "step_tokens": a.step_tokens,
            "targets": TARGETS, "host_cpus": host_counters.topology(), "pin": a.pin}


def _pin_choice(text: str) -> str:
    if text in ("none", "cores") or re.fullmatch(r"step:\d+", text):
        return text
    raise argparse.ArgumentTypeError(f"none, cores or step:N, not {text!r}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--slots", help="which slots of the interleave to run, e.g. 1-6")
    ap.add_argument("--min-seconds", type=float, default=None,
                    help="wall time of one timed repetition (default: 20 on cuda, 1 on cpu)")
    ap.add_argument("--min-batches", type=int, default=1)
    ap.add_argument("--step-tokens", type=int, default=None,
                    help="max_num_batched_tokens, the same for every config (default 2048 on "
                         "cuda, 512 on cpu; 16384 is vLLM's own default for LLM on an H100)")
    ap.add_argument("--reps", type=int, default=1, help="timed repetitions per workload")
    ap.add_argument("--workloads", default="prefill,decode")
    ap.add_argument("--no-p3all", dest="p3all", action="store_false")
    ap.add_argument("--no-identity", action="store_true")
    ap.add_argument("--pin", default="none", type=_pin_choice,
                    help="none; cores: bind every process to one logical CPU per physical core "
                         "(no two engine threads on one SMT pair); step:N: after start-up, bind "
                         "the EngineCore's step thread to CPU N and every other thread of the "
                         "process tree to the other CPUs (the same N for every config, so "
                         "paired processes run their step loop on the same CPU)")
    ap.add_argument("--speed-probe", action="store_true",
                    help="time fixed CPU work items in a side process during every batch "
                         "(bench/host_counters.py SpeedProbe): is the host slower then?")
    ap.add_argument("--gpu-monitor", action="store_true",
                    help="nvidia-smi's GPU utilization, SM clock and power every 100 ms, "
                         "averaged per batch (GpuMonitor): did the GPU's own time move?")
    ap.add_argument("--engine-probe", action="store_true",
                    help="per batch, every process's engine steps, scheduled tokens, step, "
                         "schedule and update seconds and garbage-collection seconds "
                         "(bench/engine_probe): did a slow batch do more steps, or collect?")
    ap.add_argument("--profile-batch", action="store_true",
                    help="after the timed batches, one more batch per workload with the "
                         "worker's step loop under cProfile and the torch profiler (capsteer "
                         "configs); its table goes to WORK/profile-SLOT-CONFIG-WORKLOAD.txt")
    ap.add_argument("--paired", action="store_true",
                    help="a round's processes alive together, taking turns batch by batch")
    ap.add_argument("--no-overlap", dest="overlap", action="store_false",
                    help="do not start the next process's imports during this one's start-up")
    ap.add_argument("--deadline", type=float, default=None, help="epoch seconds")
    ap.add_argument("--shape", default=None)
    ap.add_argument("--work", default=None, help="work dir (default /tmp/capsteer-perf)")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).parent / "results"))
    ap.add_argument("--summarize", nargs="+", type=Path, help="merge process files in these dirs")
    for hidden in ("--one", "--model", "--result-file", "--imported-file", "--go-file",
                   "--wait-file"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    ap.add_argument("--slot", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--ctl-fd", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--mem-fraction", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--do-p3all", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.shape = a.shape or SHAPE[a.device]
    a.work = a.work or "/tmp/capsteer-perf"
    if a.min_seconds is None:  # cuda: 20 s resolved P1 and P3 prefill where 10 s did not
        a.min_seconds = 20.0 if a.device == "cuda" else 1.0
    a.step_tokens = a.step_tokens or STEP_TOKENS[a.device]
    if a.summarize:
        procs = load_procs(a.summarize)
        if not procs:
            raise SystemExit("no perf-proc-*.json found")
        a.device, a.shape = procs[0]["device"], procs[0]["shape"]
        a.min_seconds, a.reps = procs[0].get("min_seconds"), procs[0].get("reps")
        a.step_tokens = procs[0]["engine_kwargs"].get("max_num_batched_tokens", a.step_tokens)
        meta = _meta(a) | {"device": procs[0].get("device_name", a.device)}
        write_report(procs, Path(a.out), meta)
        return 0
    if a.one:
        a.config = a.one
        a.identity = not a.no_identity
        result = run_process(a)
        result["device_name"] = device_name(a.device)
        Path(a.result_file).parent.mkdir(parents=True, exist_ok=True)
        Path(a.result_file).write_text(json.dumps(result))
        return 0
    return drive_paired(a) if a.paired else drive(a)


if __name__ == "__main__":
    sys.exit(main())
