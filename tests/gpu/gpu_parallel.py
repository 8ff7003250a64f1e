"""GPU validation of tensor and pipeline parallelism (run on a 2-GPU lent machine).

One bf16 random-weight Qwen3 (CUDA graphs on, sync debug mode "error" over every hooked
step), three engines in turn, each in its own process: TP=1 (the reference), TP=2, PP=2.
Each serves the same requests:
- captures of every hook x layer x position, durable, packed and per_file;
- steering at layers of both pipeline halves (greedy, with log-probs);
then this parent compares TP=2 and PP=2 with TP=1:
- exactly one manifest per capture, every listed file present once and nothing unlisted,
  written by one process (TP: rank 0 only) or merged from one part per stage (PP);
- captured values against TP=1 (relative error per key: bf16 and a different reduction
  order under TP, so equality is within bf16 rounding, not bitwise);
- steered greedy tokens against TP=1 (identical tokens; first divergence reported).

    python tests/gpu/gpu_parallel.py [--layers 8] [--out DIR]
Writes <out>/gpu-<date>-parallel.json and prints a table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path

CONFIGS = {"tp1": {}, "tp2": {"tensor_parallel_size": 2}, "pp2": {"pipeline_parallel_size": 2}}
HOOKS = ["resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out"]


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(10, 400) for _ in range(length + 7 * i)] for i in range(n)]


def steering(hidden: int, layers: int) -> dict:
    import numpy as np

    rng = np.random.default_rng(5)
    return {"vectors": [
        {"hook": "resid_post", "layer": 1, "vector": (rng.standard_normal(hidden) * 4).tolist()},
        {"hook": "mlp_out", "layer": layers - 2,
         "vector": (rng.standard_normal(hidden) * 4).tolist()},
        {"hook": "resid_mid", "layer": layers - 1, "vector": rng.standard_normal(hidden).tolist(),
         "op": "clamp", "value": 3.0}]}


def run_config(name: str, model: str, root: str, layers: int, hidden: int, device: str) -> dict:
    """In a child process: serve the requests on one engine configuration."""
    from capsteer.engine import Engine, Request

    kw: dict = dict(dtype="bfloat16", gpu_memory_utilization=0.5)
    if device == "cpu":  # a smoke run of this script: one CPU per worker process
        cpus = sorted(os.sched_getaffinity(0))
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"{cpus[0]}|{cpus[1 % len(cpus)]}"
        kw = dict(dtype="float32", gpu_memory_utilization=0.3, distributed_executor_backend="mp")
    t0 = time.time()
    engine = Engine(model, max_model_len=2048, seed=0,
                    capsteer_config={"capture_dir": root, "sync_debug": True},
                    **CONFIGS[name], **kw)
    startup = time.time() - t0
    captured = [Request(prompt_token_ids=p, sampling={"max_tokens": 12, "temperature": 0.0,
                                                      "ignore_eos": True},
                        capture={"hooks": HOOKS, "layers": "all", "positions": "all",
                                 "layout": layout}, durable=True)
                for p, layout in zip(prompts(4, 60, 1), ["packed", "per_file"] * 2, strict=True)]
    steer = steering(hidden, layers)
    steered = [Request(prompt_token_ids=p, sampling={"max_tokens": 32, "temperature": 0.0,
                                                     "ignore_eos": True, "logprobs": 1},
                       steering=steer) for p in prompts(4, 40, 2)]
    plain = [Request(prompt_token_ids=p, sampling={"max_tokens": 32, "temperature": 0.0,
                                                   "ignore_eos": True}) for p in prompts(4, 40, 2)]
    # Teacher-forced steering check: the same prompts fed with and without steering, every
    # layer's stream captured (durable) at every prompt position. Greedy tokens of a random-
    # weight model flip on bf16 rounding (plain requests diverge between TP=1 and TP=2 too),
    # so the steering effect is compared on identical inputs.
    forced = [Request(prompt_token_ids=p, sampling={"max_tokens": 1, "temperature": 0.0},
                      steering=s_, capture={"hooks": ["resid_post"], "layers": "all",
                                            "positions": "prompt"}, durable=True)
              for s_ in (steer, None) for p in prompts(4, 40, 2)]
    t0 = time.time()
    results = engine.generate(captured + steered + plain + forced, timeout=300)
    wall = time.time() - t0
    stats = engine.llm.collective_rpc("capsteer_stats")
    engine.close()
    caps, st, pl, fo = results[:4], results[4:8], results[8:12], results[12:]

    def receipt(r) -> dict:
        return {"status": r.receipt.status, "dir": r.receipt.dir, "files": list(r.receipt.files),
                "error": r.receipt.error}

    return {
        "config": name, "startup_s": round(startup, 1), "wall_s": round(wall, 2),
        "receipts": [receipt(r) for r in caps],
        "forced_steered": [receipt(r) for r in fo[:4]],
        "forced_plain": [receipt(r) for r in fo[4:]],
        "steered_tokens": [r.token_ids for r in st],
        "plain_tokens": [r.token_ids for r in pl],
        "worker_stats": stats,
    }


def compare(root: Path, results: dict) -> dict:
    """Each configuration against TP=1."""
    import torch

    from capsteer.capture import read

    ref = results["tp1"]
    out = {}
    for name, res in results.items():
        row: dict = {"startup_s": res["startup_s"], "wall_s": res["wall_s"],
                     "sync_checked_steps": [s["sync_checked_steps"] for s in res["worker_stats"]],
                     "harvest_errors": sum(len(s["harvest_errors"]) for s in res["worker_stats"])}
        problems, worst, compared = [], 0.0, 0
        for i, (rec, ref_rec) in enumerate(zip(res["receipts"], ref["receipts"], strict=True)):
            if rec["status"] != "ok":
                problems.append(f"capture {i}: {rec['status']} {rec['error']}")
                continue
            directory = root / name / rec["dir"]
            manifest = json.loads((directory / "manifest.json").read_text())
            listed = sorted(f["name"] for f in manifest["files"])
            on_disk = sorted(p.name for p in directory.glob("*.safetensors"))
            if listed != on_disk:
                problems.append(f"capture {i}: listed {listed} but on disk {on_disk}")
            writers = {p["writer"]["pid"] for p in manifest.get("stage_parts", [])} or {
                manifest["writer"]["pid"]}
            want_writers = 2 if name == "pp2" else 1
            if len(writers) != want_writers or manifest.get("stages", 1) != want_writers:
                problems.append(f"capture {i}: {len(writers)} writer process(es), "
                                f"stages {manifest.get('stages', 1)}")
            got = read(directory)
            want = read(root / "tp1" / ref_rec["dir"])
            # Compare the positions whose fed tokens agree (greedy continuations may flip).
            a_ids, b_ids = got.token_ids.tolist(), want.token_ids.tolist()
            same = next((j for j, (x, y) in enumerate(zip(a_ids, b_ids, strict=False)) if x != y),
                        min(len(a_ids), len(b_ids)))
            prompt_len = int(manifest["prompt_tokens"])
            if got.positions.tolist()[:same] != want.positions.tolist()[:same] or same < prompt_len:
                problems.append(f"capture {i}: positions or prompt tokens differ from TP=1")
                continue
            compared = max(compared, same)
            for key in want.keys():
                a, b = got.tensor(*key)[:same].float(), want.tensor(*key)[:same].float()
                worst = max(worst, float((a - b).norm() / b.norm().clamp_min(1e-6)))
        row["capture_rel_err_max_vs_tp1"] = worst
        row["capture_positions_compared_max"] = compared
        # Steering on identical inputs: the steered stream and the steering effect
        # (steered - plain, per layer) against TP=1's.
        eff_err, steered_err = 0.0, 0.0
        for k in range(len(res["forced_steered"])):
            mine = [read(root / name / res[f][k]["dir"]) for f in ("forced_steered", "forced_plain")]
            ref_caps = [read(root / "tp1" / ref[f][k]["dir"])
                        for f in ("forced_steered", "forced_plain")]
            for key in ref_caps[0].keys():
                s_m, p_m = (c.tensor(*key).float() for c in mine)
                s_r, p_r = (c.tensor(*key).float() for c in ref_caps)
                steered_err = max(steered_err, float((s_m - s_r).norm() / s_r.norm()))
                eff_err = max(eff_err, float(((s_m - p_m) - (s_r - p_r)).norm()
                                             / (s_r - p_r).norm().clamp_min(1e-6)))
        row["steered_stream_rel_err_vs_tp1"] = steered_err
        row["steering_effect_rel_err_vs_tp1"] = eff_err
        same = [a == b for a, b in zip(res["steered_tokens"], ref["steered_tokens"], strict=True)]
        row["steered_tokens_identical_to_tp1"] = f"{sum(same)}/{len(same)}"
        same = [a == b for a, b in zip(res["plain_tokens"], ref["plain_tokens"], strict=True)]
        row["plain_tokens_identical_to_tp1"] = f"{sum(same)}/{len(same)}"

        def divergence(xs, ys):
            return [next((j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
                    for a, b in zip(xs, ys, strict=True)]

        row["steered_first_divergence"] = divergence(res["steered_tokens"], ref["steered_tokens"])
        row["plain_first_divergence"] = divergence(res["plain_tokens"], ref["plain_tokens"])
        row["steering_changed_output"] = sum(
            a != b for a, b in zip(res["steered_tokens"], res["plain_tokens"], strict=True))
        row["problems"] = problems
        out[name] = row
    del torch
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--work", default="/tmp/capsteer-parallel")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).parent / "results"))
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    work = Path(args.work)
    model = str(work / "model")
    if args.one:
        res = run_config(args.one, model, str(work / "captures" / args.one), args.layers,
                         args.hidden, args.device)
        print("RESULT " + json.dumps(res), flush=True)
        return
    import torch

    from capsteer.demo_model import DemoShape, write_demo_model

    shape = DemoShape(hidden_size=args.hidden, num_layers=args.layers, num_heads=16,
                      num_kv_heads=8, head_dim=64, intermediate_size=3 * args.hidden,
                      vocab_size=1024, max_position_embeddings=4096)
    cuda = args.device == "cuda"
    write_demo_model(model, "qwen3", seed=3, shape=shape,
                     dtype="bfloat16" if cuda else "float32", device=args.device)
    if cuda:
        torch.cuda.empty_cache()
    results, report = {}, {"device": torch.cuda.get_device_name(0) if cuda else "cpu",
                           "gpus": torch.cuda.device_count(), "date": dt.date.today().isoformat(),
                           "layers": args.layers, "hidden": args.hidden, "errors": {}}
    for name in args.configs.split(","):
        cmd = [sys.executable, __file__, "--one", name, "--work", str(work), "--device", args.device,
               "--layers", str(args.layers), "--hidden", str(args.hidden)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not line:
            report["errors"][name] = (proc.stdout[-2000:] + "\n" + proc.stderr[-6000:])
            print(f"{name} failed:\n{proc.stderr[-6000:]}", flush=True)
            continue
        results[name] = json.loads(line[0][7:])
        print(f"{name}: start-up {results[name]['startup_s']} s, wall {results[name]['wall_s']} s",
              flush=True)
    if "tp1" in results:
        report["compare"] = compare(work / "captures", results)
    report["results"] = results
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{'gpu' if cuda else 'cpu'}-{report['date']}-parallel.json").write_text(json.dumps(report, indent=2))
    for name, row in report.get("compare", {}).items():
        print(f"{name:5} captures vs TP=1 {row['capture_rel_err_max_vs_tp1']:.4f}  steered stream "
              f"{row['steered_stream_rel_err_vs_tp1']:.4f}  steering effect "
              f"{row['steering_effect_rel_err_vs_tp1']:.4f}  tokens identical: steered "
              f"{row['steered_tokens_identical_to_tp1']} plain {row['plain_tokens_identical_to_tp1']}"
              f"  sync-checked steps {row['sync_checked_steps']}  problems "
              f"{row['problems'] or 'none'}")


if __name__ == "__main__":
    main()
