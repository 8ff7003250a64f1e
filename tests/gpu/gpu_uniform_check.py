"""GPU check of the uniform steering plan (device mode only, so CI on CPU never runs it).

When every request of a step steers through one shared, class-free steering row, the
worker's plan is that slot alone (`StepPlan.uniform_slot`): no per-row index is uploaded
or expanded. This runs the same batch twice, with the same arithmetic on every row:
- uniform: every request carries one spec (resid_post add at all layers, scale S);
- split: every other request carries an equal spec written as two adds of S/2 (S a power
  of two: the composed vector is bitwise the same), a different sharing key and so a
  second slot, which brings the per-row index back.
Prompt log-probs (prefill rows), generated tokens and their log-probs must be identical,
as they are between two runs of the uniform batch (the control; the engine core runs in
this process so that runs schedule alike), steering must change the prompt log-probs
against plain requests, and the worker's counters must show only uniform plans in the
first run and mostly per-row ones in the second. Writes a JSON report and exits 1 on a mismatch.

    python tests/gpu/gpu_uniform_check.py [--requests 48] [--out DIR] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def main() -> int:
    import torch

    from capsteer.demo_model import DemoShape, write_demo_model
    from capsteer.engine import Engine, Request

    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--scale", type=float, default=32.0, help="a power of two")
    ap.add_argument("--model-dir", default="/tmp/capsteer-uniform-model")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/capsteer-gpu-checks"))
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: a dry run of the script (host mode has no uniform plan)")
    args = ap.parse_args()
    # Nothing here touches CUDA before the engine starts; spawned workers in any case.
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    # The engine core in this process: `generate` queues every request before the first
    # step, so two runs of one request list schedule alike (with the core in its own
    # process, its first steps take whichever requests have arrived).
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    shape = DemoShape(hidden_size=1024, num_layers=args.layers, num_heads=16, num_kv_heads=8,
                      head_dim=64, intermediate_size=3072, vocab_size=1024,
                      max_position_embeddings=4096)
    write_demo_model(args.model_dir, "qwen3", seed=5, shape=shape, dtype="bfloat16")
    # Small steps: prompts are chunked and share steps with decoding requests.
    engine = Engine(args.model_dir, dtype="bfloat16",
                    gpu_memory_utilization=0.5 if args.device == "cuda" else 0.3,
                    max_model_len=2048, seed=0, max_num_batched_tokens=1024,
                    # The two runs must schedule alike: a prompt cached by the first run would
                    # skip its prefill in the second (same spec, same cache salt).
                    enable_prefix_caching=False,
                    capsteer_config={"sync_debug": True})
    gen = torch.Generator().manual_seed(0)
    v = torch.randn(shape.hidden_size, generator=gen)
    v = (v / v.norm()).tolist()
    whole = {"vectors": [{"hook": "resid_post", "layers": "all", "vector": v,
                          "scale": args.scale}]}
    halves = {"vectors": [{"hook": "resid_post", "layers": "all", "vector": v,
                           "scale": args.scale / 2}] * 2}
    lengths = torch.randint(16, 600, (args.requests,), generator=gen).tolist()
    prompts = [torch.randint(5, 700, (n,), generator=gen).tolist() for n in lengths]
    sampling = {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True, "logprobs": 1,
                "prompt_logprobs": 1}

    def run(specs):
        before = engine.stats()[0]
        got = engine.generate([Request(prompt_token_ids=p, sampling=sampling, steering=s)
                               for p, s in zip(prompts, specs, strict=True)])
        after = engine.stats()[0]
        counts = {k: after[k] - before[k] for k in ("plan_builds", "plan_reuses", "plan_uniform")}
        return got, counts

    t0 = time.time()
    uniform, uniform_counts = run([whole] * len(prompts))
    split, split_counts = run([whole if i % 2 else halves for i in range(len(prompts))])
    again, _ = run([whole] * len(prompts))  # the control: the same run twice
    plain, _ = run([None] * len(prompts))

    def logprob_diff(a, b) -> float:
        worst = 0.0
        for x, y in zip(a or [], b or [], strict=True):
            if x is None or y is None:
                continue
            for tok, lp in x.items():
                worst = max(worst, abs(lp - y.get(tok, float("inf"))))
        return worst

    def own(res, prompt) -> list[float]:  # the log-prob of each prompt token itself
        return [lp[t] for lp, t in zip(res.prompt_logprobs, prompt, strict=True) if lp]

    def compare(first, second) -> dict:
        pairs = list(zip(first, second, prompts, strict=True))
        same = [(a, b) for a, b, _ in pairs if a.token_ids == b.token_ids]
        return {"tokens_equal": len(same),
                "max_abs_logprob_diff_generated": max(
                    [logprob_diff(a.logprobs, b.logprobs) for a, b in same] or [0.0]),
                "max_abs_prompt_token_logprob_diff": max(
                    max(abs(x - y) for x, y in zip(own(a, p), own(b, p), strict=True))
                    for a, b, p in pairs)}

    def exact(c: dict) -> bool:
        return (c["tokens_equal"] == len(prompts) and c["max_abs_logprob_diff_generated"] == 0
                and c["max_abs_prompt_token_logprob_diff"] == 0)

    report = {
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "requests": len(prompts),
        "seconds": round(time.time() - t0, 1),
        "uniform_run": uniform_counts, "split_run": split_counts,
        "uniform_vs_split": compare(uniform, split),
        "uniform_vs_uniform_again": compare(uniform, again),
        "uniform_vs_plain": compare(uniform, plain),
    }
    # The control must be exact for the comparison to mean anything: the engine core runs
    # in this process, so every request is queued before the first step is scheduled.
    report["deterministic"] = exact(report["uniform_vs_uniform_again"])
    ok = (report["deterministic"] and exact(report["uniform_vs_split"])
          and report["uniform_vs_plain"]["max_abs_prompt_token_logprob_diff"] > 0.1)
    if args.device == "cuda":  # host mode (CPU) has no uniform plan: a dry run skips this
        ok = ok and (uniform_counts["plan_uniform"] == uniform_counts["plan_builds"] > 0
                     and split_counts["plan_uniform"] < split_counts["plan_builds"])
    report["ok"] = ok
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "uniform-check.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
