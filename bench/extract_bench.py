"""Extraction throughput, side by side: `capsteer extract` vs HF transformers
(`output_hidden_states` + safetensors, batched) on the same prompts and model.

    .venv/bin/python bench/extract_bench.py [--prompts 256] [--hidden 512] [--layers 8]
    python bench/extract_bench.py --device cuda --prompts 2048 --hidden 1024 --layers 28  # P4

Both capture resid_post at every layer for every prompt position and write
safetensors to local disk; times exclude model load / engine start-up (reported
separately). Writes bench/results/<machine>-<date>-extract.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import shutil
import tempfile
import time
from pathlib import Path


def make_prompts(n: int, seed: int = 0) -> list[str]:
    words = ("model layer stream residual token vector capture steering attention mlp norm "
             "batch shard index prompt").split()
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(24, 96))) for _ in range(n)]


def run_hf(model_dir: str, prompts: list[str], out: Path, batch: int, device: str,
           dtype: str, layers: list[int]) -> dict:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(model_dir)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token or tok.unk_token
    tok.padding_side = "right"
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype)).eval().to(device)
    load_s = time.perf_counter() - t0
    tokens = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for b in range(0, len(prompts), batch):
            enc = tok(prompts[b: b + batch], return_tensors="pt", padding=True).to(device)
            states = model(**enc, output_hidden_states=True).hidden_states[1:]
            hs = {layer: states[layer].cpu() for layer in layers}
            enc = enc.to("cpu")
            lengths = enc["attention_mask"].sum(1).tolist()
            tensors = {}
            rows = [(i, n) for i, n in enumerate(lengths)]
            for layer, h in hs.items():
                tensors[f"resid_post.{layer}"] = torch.cat([h[i, :n] for i, n in rows]).contiguous()
            tensors["token_ids"] = torch.cat([enc["input_ids"][i, :n] for i, n in rows])
            save_file(tensors, str(out / f"hf-{b // batch:05d}.safetensors"))
            tokens += sum(lengths)
    os.sync()
    return {"load_s": load_s, "run_s": time.perf_counter() - t0, "tokens": tokens}


def run_capsteer(model_dir: str, prompts: list[str], out: Path, dtype: str, mem: float,
                 layers: list[int]) -> dict:
    from capsteer.engine import Engine
    from capsteer.extract import extract

    inp = out / "prompts.jsonl"
    inp.write_text("".join(json.dumps({"id": str(i), "prompt": p}) + "\n"
                           for i, p in enumerate(prompts)))
    job = out / "job"
    t0 = time.perf_counter()
    from capsteer.capture.spec import parse_capture_spec

    spec = parse_capture_spec({"hooks": ["resid_post"], "layers": layers, "positions": "prompt"},
                              num_layers=_layers(model_dir))
    from capsteer.extract import job_config

    kw = {"dtype": dtype, "gpu_memory_utilization": mem, "max_model_len": 512}
    engine = Engine(model_dir, capsteer_config=job_config(job, spec, 256 << 20, kw), **kw)
    load_s = time.perf_counter() - t0
    result = extract(model_dir, inp, job, hooks=["resid_post"], layers=layers, positions="prompt",
                     progress=False, engine=engine)
    engine.close()
    os.sync()
    return {"load_s": load_s, "run_s": result.seconds, "tokens": result.tokens,
            "bytes": result.bytes_written}


def run_vllm_plain(model_dir: str, prompts: list[str], dtype: str, mem: float) -> dict:
    """Stock vLLM prefilling the same prompts (max_tokens=1), nothing captured: the
    engine's own speed on this machine, to separate it from capture overhead."""
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=model_dir, dtype=dtype, gpu_memory_utilization=mem, max_model_len=512,
              max_num_batched_tokens=2048)  # the extraction job's step size
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    run_s = time.perf_counter() - t0
    llm.llm_engine.engine_core.shutdown()
    return {"load_s": load_s, "run_s": run_s,
            "tokens": sum(len(o.prompt_token_ids) for o in outs)}


def _layers(model_dir: str) -> int:
    return int(json.loads((Path(model_dir) / "config.json").read_text())["num_hidden_layers"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--capture-layers", default="all",
                    help="'all' or comma-separated layers (e.g. one layer for SAE training)")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    mem = 0.4 if args.device == "cuda" else 0.3
    from capsteer.demo_model import DemoShape, write_demo_model

    work = Path(tempfile.mkdtemp(prefix="capsteer-bench-"))
    try:
        shape = DemoShape(hidden_size=args.hidden, num_layers=args.layers,
                          intermediate_size=args.hidden * 3, num_heads=args.hidden // 64,
                          num_kv_heads=max(1, args.hidden // 256), head_dim=64)
        model_dir = str(write_demo_model(work / "model", "qwen3", seed=3, shape=shape, dtype=dtype,
                                         device=args.device))
        prompts = make_prompts(args.prompts)
        layers = list(range(args.layers)) if args.capture_layers == "all" else [
            int(x) for x in args.capture_layers.split(",")]
        (work / "hf").mkdir()
        (work / "cs").mkdir()
        hf = run_hf(model_dir, prompts, work / "hf", args.hf_batch, args.device, dtype, layers)
        shutil.rmtree(work / "hf")  # both outputs at once can fill a small disk
        cs = run_capsteer(model_dir, prompts, work / "cs", dtype, mem, layers)
        plain = run_vllm_plain(model_dir, prompts, dtype, mem)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    row = {
        "machine": platform.node(), "cpus": os.cpu_count(),
        "date": dt.date.today().isoformat(), "prompts": args.prompts,
        "device": args.device, "hf_batch": args.hf_batch,
        "model": f"qwen3-shaped random, hidden {args.hidden}, {args.layers} layers, {dtype}",
        "capture": f"resid_post, layers {args.capture_layers}, all prompt positions",
        "hf": {**hf, "tokens_per_s": hf["tokens"] / hf["run_s"]},
        "capsteer": {**cs, "tokens_per_s": cs["tokens"] / cs["run_s"]},
        "vllm_no_capture": {**plain, "tokens_per_s": plain["tokens"] / plain["run_s"]},
    }
    row["ratio_capsteer_over_hf"] = row["capsteer"]["tokens_per_s"] / row["hf"]["tokens_per_s"]
    print(f"{'':16}{'tokens':>9}{'run s':>9}{'tok/s':>10}{'load s':>9}")
    for name in ("hf", "capsteer", "vllm_no_capture"):
        r = row[name]
        print(f"{name:16}{r['tokens']:>9}{r['run_s']:>9.2f}{r['tokens_per_s']:>10.0f}"
              f"{r['load_s']:>9.1f}")
    print(f"capsteer / HF throughput: {row['ratio_capsteer_over_hf']:.2f}x")
    suffix = "" if args.capture_layers == "all" else "-layers-" + args.capture_layers.replace(",", "_")
    out = Path(args.out) / (f"{'gpu' if args.device == 'cuda' else 'cpu'}-{row['date']}-extract"
                            f"{suffix}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(row, indent=2))
    print(f"wrote {out}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        names = ("hf", "capsteer", "vllm_no_capture")
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.bar(["HF transformers", "capsteer extract", "vLLM, no capture"],
               [row[n]["tokens_per_s"] for n in names])
        ax.set_ylabel("tokens/s")
        ax.set_title(f"extraction, {row['capture']} ({args.device})", fontsize=9)
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=120)
    except ImportError:
        print("(matplotlib not installed: no plot)")


if __name__ == "__main__":
    main()
