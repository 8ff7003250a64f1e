"""Plain decode before and after bursts of hooked requests, in one offline engine.

Through the server (bench/mixed_latency.py, sessions 46-49 on H200 hosts), plain
requests' time per output token matched vanilla's before any capture burst and ran about
4% above it after bursts, until the next one. This takes the API server out and asks which
kind of burst leaves the engine slower. One engine runs phases of plain batches (C
requests of P prompt tokens, G generated, ignore_eos: decode-bound), and between them one
step of `--sequence`:

- steer:   a burst of R requests steered at every layer (hooks, no capture);
- memory:  R requests capturing resid_post at every layer over the prompt, returned in
           memory (the GPU copies and the harvester, no writer processes);
- durable: the same to durable storage through the writer processes (P6's burst);
- mixed:   a durable burst and one plain batch in the same `generate` call, so plain
           requests share steps with captured ones (as beside a server's bursts);
- delete:  no burst; the published captures are deleted (mixed_latency.py deletes them
           before its quiet phase, where plain decode ran at vanilla's pace, and keeps
           them between bursts, where it did not);
- idle:    no burst; --idle-s seconds without requests (past the writer processes'
           30 s idle heap trim).

`--config vanilla` runs the same sequence in stock vLLM, its bursts without hooks: how far
the phases drift without capsteer. Each configuration runs in its own process, vanilla
first. For each phase, the script prints the median plain batch time and its ratio to the
process's first phase. The last column is capsteer's ratio over vanilla's for the same
phase. A phase after a burst of kind K that stays above 1 there says K leaves the engine
slower.

    python bench/post_burst.py --device cuda --shape llama3-8b-36l --out $OUT/pb
    python bench/post_burst.py --device cpu --batches 3 --burst-requests 16 --idle-s 2   (smoke)

Writes <out>/post-burst.json (every batch time, and the worker's hook host time per
phase).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import config_children  # bench/ is not a package
import perf_models

KINDS = ("steer", "memory", "durable", "mixed", "delete", "idle")
CAPTURED = ("memory", "durable", "mixed")
DURABLE = ("durable", "mixed")
BURST_SAMPLING = {"max_tokens": 1, "ignore_eos": True}


def run_one(a: argparse.Namespace) -> dict[str, Any]:
    """One configuration's phases in this process (an engine of its own)."""
    model = str(perf_models.write_model(a.work / f"model-{a.shape}", a.shape, a.device))
    kw: dict[str, Any] = {**perf_models.engine_kwargs(a.shape), "seed": 0,
                          "max_model_len": max(a.prompt + a.gen, a.burst_prompt + 1) + 16,
                          "gpu_memory_utilization": 0.85 if a.device == "cuda" else 0.3,
                          "max_num_batched_tokens": a.max_num_batched_tokens}
    layers = perf_models.SHAPES[a.shape].layers
    rng = random.Random(11)

    def prompts(n: int, length: int) -> list[list[int]]:
        """Fresh ids every batch: a repeated prompt would hit the prefix cache."""
        return [[rng.randrange(10, 500) for _ in range(length)] for _ in range(n)]

    plain_sampling = {"max_tokens": a.gen, "temperature": 0.0, "ignore_eos": True}
    capture_dir = a.work / "captures"
    shutil.rmtree(capture_dir, ignore_errors=True)
    stats: Callable[[], dict[str, Any]] | None = None
    if a.config == "vanilla":
        from vllm import LLM, SamplingParams

        llm = LLM(model=model, **kw)

        def generate(ps: list[list[int]], sampling: dict, kind: str | None = None,
                     beside: list[list[int]] = ()) -> None:
            llm.generate([{"prompt_token_ids": p} for p in [*ps, *beside]],
                         [SamplingParams(**sampling)] * len(ps)
                         + [SamplingParams(**plain_sampling)] * len(beside), use_tqdm=False)
    else:
        from capsteer.engine import Engine, Request

        staging = a.max_num_batched_tokens * layers + a.max_num_batched_tokens
        engine = Engine(model, capsteer_config={"capture_dir": str(capture_dir),
                                                "staging_rows": staging}, **kw)
        hidden = engine.hidden_size
        capture = {"hooks": ["resid_post"], "layers": "all", "positions": "prompt",
                   "layout": "packed"}
        steering = {"vectors": [{"hook": "resid_post", "layers": "all",
                                 "vector": [0.01] * hidden, "scale": 1.0}]}

        def generate(ps: list[list[int]], sampling: dict, kind: str | None = None,
                     beside: list[list[int]] = ()) -> None:
            reqs = [Request(prompt_token_ids=p, sampling=sampling,
                            steering=steering if kind == "steer" else None,
                            capture=capture if kind in CAPTURED else None,
                            durable=kind in DURABLE) for p in ps]
            reqs += [Request(prompt_token_ids=p, sampling=plain_sampling) for p in beside]
            for r in engine.generate(reqs, timeout=600)[:len(ps)]:
                if kind in DURABLE and (r.receipt is None or r.receipt.status != "ok"):
                    raise RuntimeError(f"capture failed: {r.receipt}")
                if kind == "memory" and r.captures is None:
                    raise RuntimeError("an in-memory capture came back empty")

        def stats() -> dict[str, Any]:
            return engine.stats()[0]

    generate(prompts(a.plain_requests, a.prompt), plain_sampling)  # warm-up, untimed
    generate(prompts(a.burst_requests, a.burst_prompt), BURST_SAMPLING)
    phases: list[dict[str, Any]] = []

    def plain_phase(label: str) -> None:
        before = stats() if stats is not None else None
        times = []
        for _ in range(a.batches):
            t = time.perf_counter()
            generate(prompts(a.plain_requests, a.prompt), plain_sampling)
            times.append(time.perf_counter() - t)
        phase: dict[str, Any] = {"phase": label, "batch_s": times,
                                 "median_s": statistics.median(times)}
        if stats is not None and before is not None:
            after = stats()
            phase["hook_host_cpu_ms"] = {k: round((after["host_cpu_s"][k] - v) * 1e3, 3)
                                         for k, v in before["host_cpu_s"].items()}
            phase["plan_builds"] = after["plan_builds"] - before["plan_builds"]
            phase["live_requests"] = after["live_requests"]
        phases.append(phase)
        print(f"  {a.config:<9}{label:<20}{phase['median_s']:9.4f}"
              f"{phase['median_s'] / phases[0]['median_s']:9.4f}", flush=True)

    plain_phase("before")
    for i, kind in enumerate(a.sequence):
        t = time.perf_counter()
        if kind == "idle":
            time.sleep(a.idle_s)
        elif kind == "delete":  # vanilla has published nothing to delete
            for child in capture_dir.iterdir() if capture_dir.exists() else ():
                shutil.rmtree(child, ignore_errors=True)
        else:  # vanilla's burst: the same requests without hooks
            generate(prompts(a.burst_requests, a.burst_prompt), BURST_SAMPLING, kind,
                     beside=prompts(a.plain_requests, a.prompt) if kind == "mixed" else [])
        burst_s = time.perf_counter() - t
        plain_phase(f"after {kind} ({i + 1})")
        phases[-1]["burst_s"] = burst_s
    return {"config": a.config, "phases": phases}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    perf_models.add_device_and_shape(ap, "llama3-8b-36l")
    ap.add_argument("--plain-requests", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--batches", type=int, default=10, help="plain batches a phase")
    ap.add_argument("--burst-requests", type=int, default=103)
    ap.add_argument("--burst-prompt", type=int, default=128)
    ap.add_argument("--sequence", default="steer,memory,durable,durable,mixed,delete,idle",
                    help=f"comma-separated burst kinds, in order, from {', '.join(KINDS)}")
    ap.add_argument("--idle-s", type=float, default=35.0)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    config_children.add_config_args(ap, "/tmp/capsteer-post-burst")
    a = ap.parse_args()
    a.shape = perf_models.shape_for(a)
    a.sequence = [k.strip() for k in a.sequence.split(",") if k.strip()]
    bad = [k for k in a.sequence if k not in KINDS]
    if bad:
        ap.error(f"--sequence: unknown kind(s) {bad}; choose from {', '.join(KINDS)}")
    a.work.mkdir(parents=True, exist_ok=True)
    if a.config:  # a child: one configuration, its result as JSON on the last line
        print(config_children.result_line(run_one(a)), flush=True)
        return
    configs = [c.strip() for c in a.configs.split(",") if c.strip()]
    print(perf_models.describe(a.shape), flush=True)
    print(f"  {'config':<9}{'phase':<20}{'median s':>9}{'/ first':>9}", flush=True)
    results = config_children.run_configs(__file__, sys.argv[1:], configs, a.work, "post-burst")
    by = {r["config"]: r for r in results}
    if "vanilla" in by and "capsteer" in by:
        print("capsteer / vanilla, each phase's median over its first phase's:", flush=True)
        van, cap = by["vanilla"]["phases"], by["capsteer"]["phases"]
        for v, c in zip(van, cap, strict=True):
            ratio = (c["median_s"] / cap[0]["median_s"]) / (v["median_s"] / van[0]["median_s"])
            c["vs_vanilla_drift"] = ratio
            print(f"  {c['phase']:<20}{ratio:9.4f}", flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    out = a.out / "post-burst.json"
    out.write_text(json.dumps({"command": " ".join(sys.argv), "shape": a.shape,
                               "device": a.device, "workload": {
                                   k: getattr(a, k) for k in (
                                       "plain_requests", "prompt", "gen", "batches",
                                       "burst_requests", "burst_prompt", "sequence",
                                       "idle_s", "max_num_batched_tokens")},
                               "results": results}, indent=1))
    print(f"wrote {out}", flush=True)


if __name__ == "__main__":
    main()
