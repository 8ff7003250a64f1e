"""Quick P1-P3 side by side with vanilla vLLM, and P6 (a capture burst's time to durable).

One process per configuration, one after another: vanilla; plain (P1); steer (every layer,
P2); capture (resid_post at every layer x every prompt position, durable: P3). `--p6` times
103 requests x 128 prompt tokens x all layers to durable (Llama-3-8B widths with 36 layers on
cuda). perf_method.py is the method behind the verdicts; this is the quick look: median of
the timed repetitions (CAPSTEER_BENCH_REPS) after a warm-up, fresh prompts every batch.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as `python bench/throughput.py`
import perf_method
import perf_models

P6_SHAPE = {"cuda": "llama3-8b-36l", "cpu": "llama-tiny"}  # else perf_method's SHAPE


def workload(device: str, p6: bool) -> dict[str, int]:
    n, prompt, gen, reps = (103, 128, 1, 3) if p6 else (256, 512, 64, 3) if device == "cuda" \
        else (32, 128, 16, 2)
    return {"requests": n, "prompt": prompt, "gen": gen, "reps": reps}


def run_one(a: argparse.Namespace) -> dict:
    """One configuration in this process (perf_method's engines and batches); its timings."""
    cfg, shape = workload(a.device, a.p6), perf_models.SHAPES[a.shape]
    kw = dict(perf_models.engine_kwargs(a.shape), max_model_len=cfg["prompt"] + cfg["gen"] + 16,
              seed=0, gpu_memory_utilization=perf_models.MEM[a.device],
              max_num_batched_tokens=perf_method.STEP_TOKENS[a.device])  # vanilla's too
    steer = {"vectors": [{"hook": "resid_post", "layers": "all", "scale": 1.0,
                          "vector": [0.01] * shape.hidden}]} if a.one == "steer" else None
    capture = {"hooks": ["resid_post"], "layers": "all", "positions": "prompt",
               "layout": "packed"} if a.one == "capture" else None

    def fresh(seed: int) -> list[list[int]]:
        """New prompts for every batch: a repeated prompt would hit the prefix cache."""
        rng = random.Random(seed)
        return [[rng.randrange(10, 500) for _ in range(cfg["prompt"])]
                for _ in range(cfg["requests"])]

    started = time.perf_counter()
    # one step's captured rows (tokens x layers) must fit the staging buffer
    batch, close = perf_method.open_engine(a.one, a.model, kw, Path(a.capture_dir),
                                           kw["max_num_batched_tokens"] * (shape.layers + 1))
    startup = time.perf_counter() - started
    batch(fresh(0)[: max(4, cfg["requests"] // 16)], cfg["gen"], capture, steer)  # warm-up
    times = []
    for rep in range(int(os.environ.get("CAPSTEER_BENCH_REPS") or cfg["reps"])):
        prompts, t = fresh(1 + rep), time.perf_counter()
        batch(prompts, cfg["gen"], capture, steer)
        times.append(time.perf_counter() - t)
        if capture:  # every repetition writes afresh
            perf_models.fresh_dir(Path(a.capture_dir))
    close()
    wall = statistics.median(times)
    return {"config": a.one, "startup_s": startup, "times_s": times, "wall_s": wall,
            "tokens_per_s": cfg["requests"] * (cfg["prompt"] + cfg["gen"]) / wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--p6", action="store_true")
    ap.add_argument("--shape", choices=sorted(perf_models.SHAPES), default=None,
                    help="a bench/perf_models.py geometry")
    ap.add_argument("--configs", default=None, help="comma-separated subset")
    for hidden in ("--one", "--model", "--capture-dir", "--result-file"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=perf_models.default_out())
    args = ap.parse_args()
    args.shape = args.shape or (P6_SHAPE if args.p6 else perf_method.SHAPE)[args.device]
    if args.one:
        Path(args.result_file).write_text(json.dumps(run_one(args)))
        return
    configs = (args.configs.split(",") if args.configs
               else ["capture"] if args.p6 else perf_method.CONFIGS)
    # Stable model and capture paths (vLLM's compile-cache key): a warm re-run does not recompile.
    stable = Path(tempfile.gettempdir())
    capture_dir, result = stable / "capsteer-tp-captures", stable / "capsteer-tp-result.json"
    rows = []
    try:
        t = time.perf_counter()
        model = str(perf_models.write_model(stable / "capsteer-models" / args.shape, args.shape,
                                            args.device))
        print(f"model written in {time.perf_counter() - t:.1f} s", flush=True)
        for config in configs:
            perf_models.fresh_dir(capture_dir)
            result.unlink(missing_ok=True)
            cmd = [sys.executable, __file__, "--device", args.device, "--one", config,
                   "--model", model, "--capture-dir", str(capture_dir), "--shape", args.shape,
                   "--result-file", str(result), *(["--p6"] if args.p6 else [])]
            rows.append(perf_models.run_child(cmd, result, config))
            print(f"{config}: {rows[-1]['wall_s']:.3f} s, {rows[-1]['tokens_per_s']:,.0f} tok/s "
                  f"(start-up {rows[-1]['startup_s']:.0f} s)", flush=True)
    finally:
        shutil.rmtree(capture_dir, ignore_errors=True)
    vanilla = [r["tokens_per_s"] for r in rows if r["config"] == "vanilla"]  # ratios: vs their mean
    print(f"\n{'config':10}{'wall s':>9}{'tok/s':>12}{'vs vanilla':>12}{'target':>8}")
    for r in rows:
        r.update({"ratio_vs_vanilla": r["tokens_per_s"] / statistics.mean(vanilla)} if vanilla else {})
        ratio = f"{r['ratio_vs_vanilla']:.3f}" if vanilla else "-"
        print(f"{r['config']:10}{r['wall_s']:>9.3f}{r['tokens_per_s']:>12,.0f}{ratio:>12}"
              f"{perf_method.TARGETS.get(r['config'], '-')!s:>8}")
    perf_models.write_result(args.out, {
        **perf_models.meta("throughput.py", args.device), "shape": perf_models.describe(args.shape),
        "workload": workload(args.device, args.p6), "p6": args.p6, "rows": rows},
        f"{'p6' if args.p6 else 'throughput'}-{args.shape}")


if __name__ == "__main__":
    main()
