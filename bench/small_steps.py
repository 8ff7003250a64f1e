"""Plain requests' steps of a few hundred tokens: capsteer loaded (no fields) against vLLM.

A server's chat traffic runs steps that mix one or a few prompt chunks with the running
requests' decodes: a few hundred tokens, too many for the decode-only full CUDA graphs, so
vLLM runs them as piecewise graphs (up to its largest capture size) or without graphs,
and the host's time for the step shows in it. In bench/mixed_latency.py's trace (H200,
session 50) such steps of plain requests took longer in capsteer than in vanilla (263
tokens: 10.8 against 7.0 ms), while decode-only steps matched within 3%. P1 never ran
them: its prefill steps are 8192 tokens, where the GPU's time hides the host's.

One process per configuration, each in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0, so
torch.profiler sees the step), driven step by step (vLLM's LLMEngine.add_request and
step) as a server's engine runs: --decoders requests keep decoding throughout. For each
--tokens T, --reps times, one request of a T-token prompt (and one output token) joins
them, and the engine steps until it has finished: that time is the chunk step's (plus,
with async scheduling, the step it overlaps). Between those, --decode-steps steps of the
decoders alone are timed one by one. Then one profile of the first T's chunk steps: host
ops by self CPU time and the count of each, CUDA kernels and their time, so what capsteer
adds to such a step (its tap op calls, graph launches, copies) shows by name.

    python bench/small_steps.py --device cuda --out $OUT/small
    python bench/small_steps.py --device cuda --configs capsteer --out $OUT/small-c   (one
        configuration a call where a call's time limit is short)
    python bench/small_steps.py --device cuda --rounds 3 --tokens 518,263 --reps 8 --out $OUT/s
        (configurations interleaved, 3 processes each: the lent host's speed differs
        between processes by up to 2x, so compare medians over processes, each process's
        host speed beside its figures)
    python bench/small_steps.py --device cpu --reps 5 --tokens 64,200     (smoke)

Writes <out>/small-steps.json (every timing, each profile's top rows).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import config_children  # bench/ is not a package
import host_counters
import perf_models

WARM_CHUNKS = 3  # untimed chunk steps of each size first (a size may compile or capture)
PROFILED_CHUNKS = 5


def host_snapshot() -> dict[str, Any]:
    """host_counters' snapshot of this process tree's threads (run ns, last CPU), with each
    core's CPU seconds and the wall clock. Two of these around a timed section say whether
    the step thread waited or computed slowly, and whether another thread, a child process
    or a core was busy beside it."""
    import psutil

    return {"wall": time.perf_counter(), "threads": host_counters.snapshot()["threads"],
            "cores": [c.user + c.system for c in psutil.cpu_times(percpu=True)]}


def host_speed(device: str) -> dict[str, float]:
    """This process's host speed, for reading its step times beside another process's: on
    the lent GPU host one process's step thread ran up to 2x slower than the next one's
    through the whole run, vanilla's as much as capsteer's (session 51). Best of 5 of: a
    pure Python loop, 2,000 small torch ops (dispatch), 2,000 kernel launches."""
    import torch

    def best(fn: Any) -> float:
        times = []
        for _ in range(5):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return round(min(times) * 1e3, 3)

    x = torch.zeros(16, device=device)

    def launches() -> None:
        for _ in range(2000):
            x.add_(1)
        if device == "cuda":
            torch.cuda.synchronize()

    return {"python_ms": best(lambda: sum(i * i for i in range(200_000))),
            "torch_ops_ms": best(lambda: [torch.empty(0) for _ in range(2000)]),
            "launches_ms": best(launches), **interpreter_state()}


def interpreter_state() -> dict[str, Any]:
    """What could slow this interpreter's own code beside the machine: a trace or profile
    hook, sys.monitoring tools, the collector's state; and the step thread's core's clock."""
    import gc

    import psutil

    tools = [t for t in range(6) if sys.monitoring.get_tool(t)] if hasattr(sys, "monitoring") else []
    core = psutil.Process().cpu_num()
    mhz = None
    try:
        per_core = psutil.cpu_freq(percpu=True)
        mhz = round(per_core[core].current) if core < len(per_core) else None
    except (AttributeError, NotImplementedError, OSError):
        pass
    return {"trace_hook": sys.gettrace() is not None, "profile_hook": sys.getprofile() is not None,
            "monitoring_tools": tools, "gc_enabled": gc.isenabled(),
            "gc_frozen": gc.get_freeze_count(), "core": core, "core_mhz": mhz}


def host_activity(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What ran between two snapshots: the step thread's CPU seconds and core, and the
    busiest other threads of this process (by name), child processes and cores."""
    me = os.getpid()
    main_cpu = 0.0
    threads: dict[str, float] = {}  # this process's other threads, by name
    children: dict[int, float] = {}  # child processes, by pid
    names = {pid: name for (pid, tid), (name, *_rest) in after["threads"].items() if pid == tid}
    for (pid, tid), (name, run, *_rest) in after["threads"].items():
        run_s = (run - before["threads"].get((pid, tid), (name, 0))[1]) / 1e9
        if (pid, tid) == (me, me):
            main_cpu = run_s
        elif pid == me:
            threads[name] = threads.get(name, 0.0) + run_s
        else:
            children[pid] = children.get(pid, 0.0) + run_s

    def busiest(delta: dict[str, float]) -> dict[str, float]:
        return {k: round(v, 3) for k, v in sorted(delta.items(), key=lambda kv: -kv[1])[:6]
                if v > 0}

    def main_core(snap: dict[str, Any]) -> int | None:
        thread = snap["threads"].get((me, me))
        return thread[3] if thread else None

    cores = [round(e - b, 2) for b, e in zip(before["cores"], after["cores"], strict=True)]
    return {"wall_s": round(after["wall"] - before["wall"], 3), "main_cpu_s": round(main_cpu, 3),
            "threads_cpu_s": busiest(threads),
            "children_cpu_s": busiest({f"{pid} {names.get(pid, '?')}": v
                                       for pid, v in children.items()}),
            "cores_busy_s": cores, "main_core": [main_core(before), main_core(after)],
            "affinity": len(os.sched_getaffinity(0))}


def run_one(a: argparse.Namespace) -> dict[str, Any]:
    """One configuration in this process (the engine in-process)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from vllm import SamplingParams

    model = str(perf_models.write_model(a.work / f"model-{a.shape}", a.shape, a.device))
    # The decoders outlive the run: more tokens each than the run has steps (a chunk step
    # and the one it may overlap, then the decode steps, each rep; warm-up and profile too).
    decoder_tokens = (len(a.tokens) * (a.reps + WARM_CHUNKS) * (a.decode_steps + 2)
                      + PROFILED_CHUNKS * 2 + 64)
    kw: dict[str, Any] = {**perf_models.engine_kwargs(a.shape), "seed": 0,
                          "max_model_len": max(max(a.tokens), 16 + decoder_tokens) + 16,
                          "gpu_memory_utilization": 0.6 if a.device == "cuda" else 0.3,
                          "max_num_batched_tokens": max(2048, max(a.tokens))}
    if a.config == "vanilla":
        from vllm import LLM

        llm = LLM(model=model, **kw)
    else:
        from capsteer.engine import Engine

        llm = Engine(model, capsteer_config={"capture_dir": str(a.work / "captures")}, **kw).llm
    config = llm.llm_engine.vllm_config
    cc = config.compilation_config
    out: dict[str, Any] = {"config": a.config, "steps": {}, "engine": {
        "cudagraph_mode": str(cc.cudagraph_mode),
        "cudagraph_capture_sizes": list(cc.cudagraph_capture_sizes or []),
        "async_scheduling": getattr(config.scheduler_config, "async_scheduling", None)}}
    rng = random.Random(5)
    engine = llm.llm_engine
    ids = itertools.count()

    def add(tokens: int, max_tokens: int) -> str:
        """A request of `tokens` fresh prompt ids (no prefix-cache hit)."""
        rid = f"r{next(ids)}"
        engine.add_request(rid, {"prompt_token_ids": [rng.randrange(10, 500)
                                                      for _ in range(tokens)]},
                           SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                          ignore_eos=True))
        return rid

    def chunk_step(tokens: int) -> float:
        """Seconds from a T-token request's arrival beside the decoders to its end."""
        rid = add(tokens, 1)
        t = time.perf_counter()
        while not any(o.request_id == rid and o.finished for o in engine.step()):
            pass
        return time.perf_counter() - t

    def decode_steps(n: int) -> list[float]:
        times = []
        for _ in range(n):
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        return times

    out["host_speed"] = host_speed(a.device)
    print(f"  {a.config:<9} host speed {out['host_speed']}", flush=True)
    for _ in range(a.decoders):
        add(16, decoder_tokens)
    decode_steps(3)  # their prompts, then decoding
    decode_ms: list[float] = []
    for tokens in a.tokens:
        for _ in range(WARM_CHUNKS):
            chunk_step(tokens)
        times = []
        before = host_snapshot()
        for _ in range(a.reps):
            times.append(chunk_step(tokens))
            decode_ms += [t * 1e3 for t in decode_steps(a.decode_steps)]
        activity = host_activity(before, host_snapshot())
        out["steps"][str(tokens)] = {"times_s": times, "median_ms": statistics.median(times) * 1e3,
                                     "host": activity}
        print(f"  {a.config:<9}{tokens:7d}{out['steps'][str(tokens)]['median_ms']:10.3f}",
              flush=True)
        print(f"    host: wall {activity['wall_s']} s, step thread CPU {activity['main_cpu_s']} "
              f"s; threads {activity['threads_cpu_s']}; children "
              f"{activity['children_cpu_s']}; busiest cores "
              f"{sorted(activity['cores_busy_s'], reverse=True)[:6]} of "
              f"{activity['affinity']}", flush=True)
    out["decode_ms"] = {"n": len(decode_ms), "median": statistics.median(decode_ms)}
    print(f"  {a.config:<9}{'decode':>7}{out['decode_ms']['median']:10.3f}   ({a.decoders} "
          "requests, no prompt chunk)", flush=True)
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if a.device == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(PROFILED_CHUNKS):
            chunk_step(a.tokens[0])
    events = prof.key_averages()
    rows = sorted(events, key=lambda e: -e.self_cpu_time_total)[:40]
    out["profile_tokens"] = a.tokens[0]
    out["host_ops"] = [{"name": e.key, "count": e.count,
                        "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 3)} for e in rows]
    out["op_counts"] = {e.key: e.count for e in events if e.key.startswith(
        ("capsteer", "cudaGraphLaunch", "cudaLaunchKernel", "cudaMemcpyAsync", "aten::copy_",
         "aten::index", "cuLaunchKernel"))}
    if a.device == "cuda":  # the GPU's side of the same steps: kernels and their time
        kernels = [e for e in events if str(getattr(e, "device_type", "")).endswith("CUDA")]
        out["gpu"] = {"kernels": sum(e.count for e in kernels),
                      "kernel_ms": round(sum(getattr(e, "self_device_time_total", 0.0)
                                             for e in kernels) / 1e3, 3)}
    return out


def summarize(results: list[dict[str, Any]]) -> None:
    """Each process's medians and host speed, then each configuration's median over its
    processes with their range, and capsteer / vanilla of those: the lent host's speed
    differs between processes (up to 2x in a pure Python loop, session 51), so one process
    of each says little; the ranges show whether a ratio stands out of that spread."""
    sizes = list(results[0]["steps"])
    print("  per process (ms): " + "  ".join(f"{t:>7}" for t in sizes)
          + "   decode   python_ms", flush=True)
    for r in results:
        print(f"    {r['config']:<9}" + "  ".join(f"{r['steps'][t]['median_ms']:7.2f}" for t in sizes)
              + f"  {r['decode_ms']['median']:7.3f}  {r['host_speed']['python_ms']:8.2f}",
              flush=True)
    medians: dict[str, dict[str, float]] = {}
    for config in dict.fromkeys(r["config"] for r in results):
        mine = [r for r in results if r["config"] == config]
        per = {t: [r["steps"][t]["median_ms"] for r in mine] for t in sizes}
        per["decode"] = [r["decode_ms"]["median"] for r in mine]
        medians[config] = {t: statistics.median(v) for t, v in per.items()}
        print(f"  {config}: median over {len(mine)} processes (range) " + "  ".join(
            f"{t}: {medians[config][t]:.2f} ({min(v):.2f}-{max(v):.2f})" for t, v in per.items()),
            flush=True)
    if "vanilla" in medians and "capsteer" in medians:
        print("  capsteer / vanilla, medians over processes: " + "  ".join(
            f"{t}: {medians['capsteer'][t] / v:.3f}" for t, v in medians["vanilla"].items()),
            flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    perf_models.add_device_and_shape(ap, "qwen3-0.6b")
    ap.add_argument("--tokens", default="263,518,1028",
                    help="comma-separated step sizes (prompt tokens of each request)")
    ap.add_argument("--reps", type=int, default=20, help="timed chunk steps per size")
    ap.add_argument("--decoders", type=int, default=7,
                    help="requests decoding throughout, beside each chunk (0: none)")
    ap.add_argument("--decode-steps", type=int, default=5,
                    help="decode-only steps timed after each chunk step")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the configurations this many times, interleaved (one process "
                         "each): the host's speed differs between processes")
    config_children.add_config_args(ap, "/tmp/capsteer-small-steps")
    a = ap.parse_args()
    a.shape = perf_models.shape_for(a)
    a.tokens = [int(t) for t in a.tokens.split(",") if t.strip()]
    a.work.mkdir(parents=True, exist_ok=True)
    if a.config:  # a child: one configuration, its result as JSON on the last line
        print(config_children.result_line(run_one(a)), flush=True)
        return
    print(perf_models.describe(a.shape), flush=True)
    print(f"  {'config':<9}{'tokens':>7}{'ms':>10}   (a chunk's arrival to its end, beside "
          f"{a.decoders} decoding requests)", flush=True)
    configs = [c.strip() for c in a.configs.split(",") if c.strip()] * a.rounds
    results = config_children.run_configs(__file__, sys.argv[1:], configs, a.work, "small-steps")
    summarize(results)
    shown: set[str] = set()
    for r in results:
        if r["config"] in shown:  # one profile per configuration is enough to read
            continue
        shown.add(r["config"])
        print(f"{r['config']}: host ops of {PROFILED_CHUNKS} {r['profile_tokens']}-token "
              "chunk steps, by self CPU ms:", flush=True)
        for row in r["host_ops"][:15]:
            print(f"    {row['self_cpu_ms']:9.3f} {row['count']:6d}  {row['name'][:70]}",
                  flush=True)
        print("    counts: " + ", ".join(f"{k} {v}" for k, v in sorted(r["op_counts"].items())),
              flush=True)
        print(f"    engine: {r['engine']}; GPU: {r.get('gpu')}", flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / "small-steps.json"
    path.write_text(json.dumps({"command": " ".join(sys.argv), "shape": a.shape,
                                "device": a.device, "results": results}, indent=1))
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
