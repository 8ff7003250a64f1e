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
import perf_models

WARM_CHUNKS = 3  # untimed chunk steps of each size first (a size may compile or capture)
PROFILED_CHUNKS = 5


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

    for _ in range(a.decoders):
        add(16, decoder_tokens)
    decode_steps(3)  # their prompts, then decoding
    decode_ms: list[float] = []
    for tokens in a.tokens:
        for _ in range(WARM_CHUNKS):
            chunk_step(tokens)
        times = []
        for _ in range(a.reps):
            times.append(chunk_step(tokens))
            decode_ms += [t * 1e3 for t in decode_steps(a.decode_steps)]
        out["steps"][str(tokens)] = {"times_s": times, "median_ms": statistics.median(times) * 1e3}
        print(f"  {a.config:<9}{tokens:7d}{out['steps'][str(tokens)]['median_ms']:10.3f}",
              flush=True)
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
    configs = [c.strip() for c in a.configs.split(",") if c.strip()]
    results = config_children.run_configs(__file__, sys.argv[1:], configs, a.work, "small-steps")
    by = {r["config"]: r for r in results}
    if "vanilla" in by and "capsteer" in by:
        print("capsteer / vanilla, medians:", "  ".join(
            f"{t}: {by['capsteer']['steps'][t]['median_ms'] / v['median_ms']:.3f}"
            for t, v in by["vanilla"]["steps"].items()), f"  decode: "
            f"{by['capsteer']['decode_ms']['median'] / by['vanilla']['decode_ms']['median']:.3f}",
            flush=True)
    for r in results:
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
