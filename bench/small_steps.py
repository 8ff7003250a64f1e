"""Plain requests' steps of a few hundred tokens: capsteer loaded (no fields) against vLLM.

A server's chat traffic runs steps that mix one or a few prompt chunks with the running
requests' decodes: a few hundred tokens, too many for the decode-only full CUDA graphs, so
vLLM runs them as piecewise graphs (up to its largest capture size) or without graphs,
and the host's time for the step shows in it. In bench/mixed_latency.py's trace (H200,
session 50) such steps of plain requests took longer in capsteer than in vanilla (263
tokens: 10.8 against 7.0 ms), while decode-only steps matched within 3%. P1 never ran
them: its prefill steps are 2048 tokens, where the GPU's time hides the host's.

One process per configuration, each in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0, so
torch.profiler sees the step): for each --tokens T, --reps requests of one T-token
prompt and one output token (one step of T tokens each), timed one by one. Then one
profile at the first T: host ops by self CPU time and the count of each, so what capsteer
adds to such a step (its tap op calls, graph launches, copies) shows by name.

    python bench/small_steps.py --device cuda --out $OUT/small
    python bench/small_steps.py --device cuda --configs capsteer --out $OUT/small-c   (one
        configuration a call where a call's time limit is short)
    python bench/small_steps.py --device cpu --reps 5 --tokens 64,200     (smoke)

Writes <out>/small-steps.json (every timing, each profile's top rows).
"""

from __future__ import annotations

import argparse
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


def run_one(a: argparse.Namespace) -> dict[str, Any]:
    """One configuration in this process (the engine in-process)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from vllm import SamplingParams

    model = str(perf_models.write_model(a.work / f"model-{a.shape}", a.shape, a.device))
    kw: dict[str, Any] = {**perf_models.engine_kwargs(a.shape), "seed": 0,
                          "max_model_len": max(a.tokens) + 16,
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
    one_token = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def step(tokens: int) -> float:
        """One request of `tokens` fresh prompt ids (no prefix-cache hit): one step."""
        prompt = {"prompt_token_ids": [rng.randrange(10, 500) for _ in range(tokens)]}
        t = time.perf_counter()
        llm.generate([prompt], one_token, use_tqdm=False)
        return time.perf_counter() - t

    for tokens in a.tokens:
        for _ in range(3):
            step(tokens)  # warm (a first step of a size may compile or capture)
        times = [step(tokens) for _ in range(a.reps)]
        out["steps"][str(tokens)] = {"times_s": times, "median_ms": statistics.median(times) * 1e3}
        print(f"  {a.config:<9}{tokens:7d}{out['steps'][str(tokens)]['median_ms']:10.3f}",
              flush=True)
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if a.device == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(5):
            step(a.tokens[0])
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
    ap.add_argument("--reps", type=int, default=20, help="timed steps per size")
    config_children.add_config_args(ap, "/tmp/capsteer-small-steps")
    a = ap.parse_args()
    a.shape = perf_models.shape_for(a)
    a.tokens = [int(t) for t in a.tokens.split(",") if t.strip()]
    a.work.mkdir(parents=True, exist_ok=True)
    if a.config:  # a child: one configuration, its result as JSON on the last line
        print(config_children.result_line(run_one(a)), flush=True)
        return
    print(perf_models.describe(a.shape), flush=True)
    print(f"  {'config':<9}{'tokens':>7}{'step ms':>10}", flush=True)
    configs = [c.strip() for c in a.configs.split(",") if c.strip()]
    results = config_children.run_configs(__file__, sys.argv[1:], configs, a.work, "small-steps")
    by = {r["config"]: r for r in results}
    if "vanilla" in by and "capsteer" in by:
        print("capsteer / vanilla, median step time:", "  ".join(
            f"{t}: {by['capsteer']['steps'][t]['median_ms'] / v['median_ms']:.3f}"
            for t, v in by["vanilla"]["steps"].items()), flush=True)
    for r in results:
        print(f"{r['config']}: host ops of {r['profile_tokens']}-token steps (5 steps), by self "
              "CPU ms:", flush=True)
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
