"""Quick P1-P3 side by side with vanilla vLLM, and P6 (a capture burst's time to durable).

Each configuration runs in its own process, one after another (fresh device memory), on
the same model, prompts and flags:
- vanilla:  stock vLLM (`vllm.LLM`);
- plain:    capsteer loaded, no capture or steering in the batch (P1);
- steer:    every request steered at every layer (resid_post add) (P2);
- capture:  every request captures resid_post at every layer x every prompt position,
            packed, to local disk, timed until every capture is durable (P3).
`--p6` times 103 requests x 128 prompt tokens x all layers to durable (one generated
token), on `--shape llama3-8b-36l` by default on cuda (Llama-3-8B widths with 36 layers,
vLLM dummy weights, real vocabulary; bench/perf_models.py).

This is the quick look; bench/perf_method.py is the method behind the P1-P3 verdicts
(paired rounds, spread). Every repetition draws fresh prompts (a repeated batch would be
served from vLLM's prefix cache). Throughput = (prompt + generated tokens) / wall time,
median of the timed repetitions after one warm-up batch (CAPSTEER_BENCH_REPS overrides
their number); a configuration listed twice shows the spread between processes.

    python bench/throughput.py --device cpu                   # smoke, tiny shape
    python bench/throughput.py --device cuda --p6 --out $OUT  # P6 on the GPU
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as `python bench/throughput.py`
import perf_models
from perf_models import device_name, device_tag

CONFIGS = ("vanilla", "plain", "steer", "capture")
TARGETS = {"plain": 0.99, "steer": 0.95, "capture": 0.90}
SHAPE = {("cuda", False): "qwen3-0.6b", ("cuda", True): "llama3-8b-36l",
         ("cpu", False): "qwen3-tiny", ("cpu", True): "llama-tiny"}


def workload(device: str, p6: bool) -> dict[str, int]:
    """Requests, prompt and generated tokens, timed repetitions."""
    if p6:
        return {"requests": 103, "prompt": 128, "gen": 1, "reps": 3}
    if device == "cuda":
        return {"requests": 256, "prompt": 512, "gen": 64, "reps": 3}
    return {"requests": 32, "prompt": 128, "gen": 16, "reps": 2}


def run_one(config: str, model: str, device: str, p6: bool, capture_dir: str,
            shape: str) -> dict:
    """One configuration in this process; returns timings."""
    from vllm import SamplingParams

    cfg = workload(device, p6)
    kw = dict(perf_models.engine_kwargs(shape), max_model_len=cfg["prompt"] + cfg["gen"] + 16,
              seed=0, gpu_memory_utilization=0.85 if device == "cuda" else 0.3,
              # the same scheduler chunk for every configuration, vanilla included
              max_num_batched_tokens=2048 if device == "cuda" else 512)
    # one step's captured rows (tokens x layers) must fit the staging buffer
    staging_rows = kw["max_num_batched_tokens"] * (perf_models.SHAPES[shape].layers + 1)

    def fresh(seed: int) -> list[list[int]]:
        """New prompts for every batch: a repeated prompt would hit the prefix cache."""
        rng = random.Random(seed)
        return [[rng.randrange(10, 500) for _ in range(cfg["prompt"])]
                for _ in range(cfg["requests"])]

    sampling = {"max_tokens": cfg["gen"], "temperature": 0.0, "ignore_eos": True}
    started = time.perf_counter()
    if config == "vanilla":
        from vllm import LLM

        llm = LLM(model=model, **kw)

        def batch(ps: list[list[int]]) -> None:
            llm.generate([{"prompt_token_ids": p} for p in ps], SamplingParams(**sampling),
                         use_tqdm=False)
    else:
        from capsteer.engine import Engine, Request

        engine = Engine(model, capsteer_config={"capture_dir": capture_dir,
                                                "staging_rows": staging_rows}, **kw)
        steering = {"vectors": [{"hook": "resid_post", "layers": "all",
                                 "vector": [0.01] * engine.hidden_size, "scale": 1.0}]
                    } if config == "steer" else None
        capture = {"hooks": ["resid_post"], "layers": "all", "positions": "prompt",
                   "layout": "packed"} if config == "capture" else None

        def batch(ps: list[list[int]]) -> None:
            results = engine.generate([Request(prompt_token_ids=p, sampling=sampling,
                                               steering=steering, capture=capture,
                                               durable=capture is not None) for p in ps],
                                      timeout=600)
            for r in results:
                if r.receipt is not None and r.receipt.status != "ok":
                    raise RuntimeError(f"capture failed: {r.receipt}")
    startup = time.perf_counter() - started
    batch(fresh(0)[: max(4, cfg["requests"] // 16)])  # warm-up
    times = []
    for rep in range(int(os.environ.get("CAPSTEER_BENCH_REPS") or cfg["reps"])):
        prompts = fresh(1 + rep)
        t = time.perf_counter()
        batch(prompts)
        times.append(time.perf_counter() - t)
        if config == "capture":  # every repetition writes afresh
            shutil.rmtree(capture_dir, ignore_errors=True)
            os.makedirs(capture_dir, exist_ok=True)
    wall = statistics.median(times)
    return {"config": config, "startup_s": startup, "times_s": times, "wall_s": wall,
            "tokens_per_s": cfg["requests"] * (cfg["prompt"] + cfg["gen"]) / wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--p6", action="store_true")
    ap.add_argument("--shape", choices=sorted(perf_models.SHAPES), default=None,
                    help="a bench/perf_models.py geometry")
    ap.add_argument("--configs", default=None, help="comma-separated subset")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--capture-dir", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    args.shape = args.shape or SHAPE[(args.device, args.p6)]
    if args.one:
        print("RESULT " + json.dumps(run_one(args.one, args.model, args.device, args.p6,
                                             args.capture_dir, args.shape)), flush=True)
        return
    configs = args.configs.split(",") if args.configs else (
        ["capture"] if args.p6 else list(CONFIGS))
    # Stable model and capture paths: both are part of vLLM's compile-cache key, so a
    # re-run on a warm machine does not recompile.
    stable = Path(tempfile.gettempdir())
    capture_dir = stable / "capsteer-tp-captures"
    rows = []
    try:
        t = time.perf_counter()
        model = str(perf_models.write_model(stable / "capsteer-models" / args.shape, args.shape,
                                            args.device))
        print(f"model written in {time.perf_counter() - t:.1f} s", flush=True)
        for config in configs:
            shutil.rmtree(capture_dir, ignore_errors=True)
            capture_dir.mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, __file__, "--device", args.device, "--one", config,
                   "--model", model, "--capture-dir", str(capture_dir), "--shape", args.shape]
            proc = subprocess.run(cmd + (["--p6"] if args.p6 else []), capture_output=True,
                                  text=True)
            line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode != 0 or not line:
                print(proc.stdout[-3000:], proc.stderr[-5000:], flush=True)
                raise SystemExit(f"{config} failed")
            rows.append(json.loads(line[0][7:]))
            print(f"{config}: {rows[-1]['wall_s']:.3f} s, {rows[-1]['tokens_per_s']:,.0f} tok/s "
                  f"(start-up {rows[-1]['startup_s']:.0f} s)", flush=True)
    finally:
        shutil.rmtree(capture_dir, ignore_errors=True)
    # ratios against the mean of the vanilla processes
    vanilla = [r["tokens_per_s"] for r in rows if r["config"] == "vanilla"]
    print(f"\n{'config':10}{'wall s':>9}{'tok/s':>12}{'vs vanilla':>12}{'target':>8}")
    for r in rows:
        if vanilla:
            r["ratio_vs_vanilla"] = r["tokens_per_s"] / statistics.mean(vanilla)
        ratio = f"{r['ratio_vs_vanilla']:.3f}" if "ratio_vs_vanilla" in r else "-"
        print(f"{r['config']:10}{r['wall_s']:>9.3f}{r['tokens_per_s']:>12,.0f}{ratio:>12}"
              f"{TARGETS.get(r['config'], '-')!s:>8}")
    device = device_name(args.device)
    report = {"machine": platform.node(), "date": dt.date.today().isoformat(), "device": device,
              "command": "python bench/throughput.py " + " ".join(sys.argv[1:]),
              "shape": perf_models.describe(args.shape),
              "workload": workload(args.device, args.p6), "p6": args.p6, "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"{device_tag(device)}-{report['date']}-{'p6' if args.p6 else 'throughput'}-{args.shape}"
    (out / f"{name}.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {out / (name + '.json')}")


if __name__ == "__main__":
    main()
