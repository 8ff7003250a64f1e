"""What the plain CUDA graphs save: decode steps of requests without fields (issue 12).

Since --plain-graphs (on by default) a GPU engine records each CUDA graph twice, with the
tap kernels and without them, and a step whose requests carry no capture or steering
replays the set without (engine_ext/adapter.PlainGraphs). This bench measures that in
one process, so the host's speed (which differs between processes on the lent host by
up to 2x, session 51) is the same for both sets: --decoders requests decode throughout,
and blocks of --steps engine steps alternate between the plain set and the hooked set
(the hooked set forced through the worker's capsteer_plain_graphs, as every step used
it before). Per set: each block's median step, and one torch.profiler window of --profile-steps steps: CUDA
kernels a step and their time (the GPU's side, whatever the host's speed). Greedy tokens
of the same requests must be equal on both sets: the compiled code is the same, and the
taps change nothing in rows without hooks.

`--config vanilla` runs stock vLLM through the same schedule (its one set of graphs in two
labels, "vanilla" and "vanilla-b"), so its steps see the same context lengths as
capsteer's: kernel counts and times beside capsteer's, and its own block-to-block spread.

    python bench/plain_graphs.py --device cuda --out $OUT/pg
    python bench/plain_graphs.py --device cuda --config vanilla --out $OUT/pg
    python bench/plain_graphs.py --device cuda --shape llama3-8b-36l --decoders 8 --out $OUT/pg8b

Writes <out>/plain-graphs-<config>-<shape>.json.
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
import perf_models  # bench/ is not a package


def run(a: argparse.Namespace) -> dict[str, Any]:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the profiler sees the step
    import torch
    from vllm import SamplingParams

    shape = perf_models.shape_for(a)
    model = str(perf_models.write_model(a.work / f"model-{shape}", shape, a.device))
    steps_total = 2 * (a.blocks * a.steps + a.profile_steps + a.warm) + 64
    kw: dict[str, Any] = {**perf_models.engine_kwargs(shape), "seed": 0,
                          "max_model_len": a.prompt + steps_total + 16,
                          "gpu_memory_utilization": 0.6 if a.device == "cuda" else 0.3,
                          # the token check runs the same prompts again: no cache hit may
                          # give the later run other batch shapes (bf16 is batch-variant)
                          "enable_prefix_caching": False}
    started = time.perf_counter()
    if a.config == "vanilla":
        from vllm import LLM

        llm = LLM(model=model, **kw)
    else:
        from capsteer.engine import Engine

        flags = {"capture_dir": str(a.work / "captures")}
        llm = Engine(model, capsteer_config=flags, **kw).llm
    out: dict[str, Any] = {"config": a.config, "shape": shape, "decoders": a.decoders,
                           "start_s": round(time.perf_counter() - started, 1)}
    engine = llm.llm_engine
    rng = random.Random(7)
    # Vanilla runs the same schedule in two labels (the same graphs): its steps then see
    # the same context lengths as capsteer's sets (attention's time grows with them), and
    # its two labels show how far one set differs from itself between blocks.
    sets = ["vanilla", "vanilla-b"]
    if a.config == "capsteer":
        if llm.collective_rpc("capsteer_plain_graphs", args=(True,))[0] is not None:
            sets = ["plain", "hooked"]
        else:  # a CPU engine (no CUDA graphs), or see the engine's log
            print("  this engine has no plain graphs: the hooked set, in two labels", flush=True)
            sets = ["hooked", "hooked-b"]

    def use(which: str) -> None:
        if sets[0] == "plain":
            llm.collective_rpc("capsteer_plain_graphs", args=(which == "plain",))

    def step_times(n: int) -> list[float]:
        times = []
        for _ in range(n):
            t = time.perf_counter()
            engine.step()
            times.append((time.perf_counter() - t) * 1e3)
        return times

    for i in range(a.decoders):
        engine.add_request(f"d{i}", {"prompt_token_ids": [rng.randrange(10, 500)
                                                         for _ in range(a.prompt)]},
                           SamplingParams(max_tokens=steps_total, temperature=0.0,
                                          ignore_eos=True))
    step_times(4)  # the prompts, then decoding only
    for which in sets:
        use(which)
        step_times(a.warm)
    blocks: dict[str, list[float]] = {s: [] for s in sets}
    for _ in range(a.blocks):
        for which in sets:
            use(which)
            blocks[which].append(statistics.median(step_times(a.steps)))
    out["block_median_ms"] = blocks
    out["median_ms"] = {s: statistics.median(v) for s, v in blocks.items()}
    profile: dict[str, Any] = {}
    for which in sets:
        use(which)
        step_times(3)
        activities = [torch.profiler.ProfilerActivity.CPU] + (
            [torch.profiler.ProfilerActivity.CUDA] if a.device == "cuda" else [])
        with torch.profiler.profile(activities=activities) as prof:
            step_times(a.profile_steps)
        kernels = [e for e in prof.key_averages()
                   if str(getattr(e, "device_type", "")).endswith("CUDA")]
        # capsteer's Triton kernel is named `_tap`; Inductor's kernels that only fuse code
        # around the op carry its name too (…_fused_add_rms_norm_tap_0), and are not taps
        taps = [e for e in kernels if e.key == "_tap"]
        profile[which] = {
            "kernels_a_step": round(sum(e.count for e in kernels) / a.profile_steps, 1),
            "kernel_ms_a_step": round(sum(e.self_device_time_total for e in kernels)
                                      / a.profile_steps / 1e3, 4),
            "tap_kernels_a_step": round(sum(e.count for e in taps) / a.profile_steps, 1),
            "tap_kernel_ms_a_step": round(sum(e.self_device_time_total for e in taps)
                                          / a.profile_steps / 1e3, 4),
            # every kernel by name: where capsteer's compiled code differs from vanilla's
            "kernels": sorted(([e.key[:120], round(e.count / a.profile_steps, 2),
                                round(e.self_device_time_total / a.profile_steps, 2)]
                               for e in kernels), key=lambda k: -k[2])}
    out["profile"] = profile
    use(sets[0])
    # Greedy tokens of fresh requests on each set (capsteer): must be the same.
    params = SamplingParams(max_tokens=a.check_tokens, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [rng.randrange(10, 500) for _ in range(a.prompt)]}
               for _ in range(a.decoders)]
    engine.abort_request([f"d{i}" for i in range(a.decoders)])

    def greedy(tag: str) -> list[list[int]]:
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{tag}-{i}", prompt, params)
        done: dict[str, list[int]] = {}
        while len(done) < len(prompts):
            for o in engine.step():
                if o.finished and o.request_id.startswith(f"{tag}-"):
                    done[o.request_id] = list(o.outputs[0].token_ids)
        return [done[f"{tag}-{i}"] for i in range(len(prompts))]

    tokens = {}
    for which in sets:
        use(which)
        tokens[which] = greedy(which)
    if sets[0] == "plain":
        use("plain")
        again = greedy("plain-again")  # how far two runs on one set differ on their own
        out["same_tokens"] = {"plain_vs_hooked": tokens["plain"] == tokens["hooked"],
                              "plain_vs_plain_again": tokens["plain"] == again}
    if a.config == "capsteer":
        out["stats"] = llm.collective_rpc("capsteer_stats")[0].get("graph_replays")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    perf_models.add_device_and_shape(ap, "qwen3-0.6b")
    ap.add_argument("--config", choices=("capsteer", "vanilla"), default="capsteer")
    ap.add_argument("--decoders", type=int, default=8, help="requests decoding throughout")
    ap.add_argument("--prompt", type=int, default=128, help="their prompt tokens")
    ap.add_argument("--steps", type=int, default=100, help="engine steps a block")
    ap.add_argument("--blocks", type=int, default=8, help="blocks of each set, alternating")
    ap.add_argument("--warm", type=int, default=20, help="untimed steps on each set first")
    ap.add_argument("--profile-steps", type=int, default=50)
    ap.add_argument("--check-tokens", type=int, default=32, help="greedy tokens compared")
    ap.add_argument("--work", type=Path, default=Path("/tmp/capsteer-plain-graphs"))
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "bench/results"))
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    out = run(a)
    print(json.dumps(out, indent=1), flush=True)
    for which, ms in out["median_ms"].items():
        prof = out["profile"][which]
        print(f"  {out['config']:<9}{which:<8} step {ms:7.3f} ms (blocks "
              f"{min(out['block_median_ms'][which]):.3f}-{max(out['block_median_ms'][which]):.3f})"
              f"  kernels {prof['kernels_a_step']:6.1f} a step, {prof['kernel_ms_a_step']:.4f} ms"
              f"  (taps {prof['tap_kernels_a_step']:.1f}, {prof['tap_kernel_ms_a_step']:.4f} ms)",
              flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / f"plain-graphs-{out['config']}-{out['shape']}.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
