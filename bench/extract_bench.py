"""Extraction throughput, side by side (P4): `capsteer extract` vs stock vLLM prefilling the
same prompts, and vs HF transformers (`output_hidden_states` + safetensors).

Sides (`--sides`), one process each: capsteer (resid_post at the chosen layers x every prompt
position, its forward stopped after the deepest, as the CLI); capsteer_full (`--full-forward`);
vllm (max_tokens=1, nothing captured); hf (rows of real tokens saved per batch, `os.sync`;
the fastest `--hf-batch` size on probe batches; with `--shape` length-sorted chunks and
`logits_to_keep=1`). capsteer and vllm run --reps passes over fresh prompt sets after a
warm-up; HF one pass until --hf-min-seconds. Writes <tag>-<date>-extract[-layers-L].json.
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import perf_models

ALL_SIDES = ("hf", "capsteer", "capsteer_full", "vllm")
TARGET_VS_VLLM = 0.90
TARGET_VS_HF = 10.0
DEMO = ("model layer stream residual token vector capture steering attention mlp norm batch "
        "shard index prompt").split()


def _prompt_set(a: argparse.Namespace, seed: int, n: int | None = None) -> list[str]:
    """Word prompts: 24-96 demo words, or with --shape --prompt-tokens vocabulary words (tokens)."""
    rng, shape = random.Random(seed), perf_models.SHAPES.get(a.shape or "")
    words = [f"w{i}" for i in range(shape.vocab - len(perf_models.SPECIALS))] if shape else DEMO
    lo, hi = a.token_range if shape else (24, 96)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(lo, hi)))
            for _ in range(n or a.prompts)]


def run_hf(a: argparse.Namespace, layers: list[int], out: Path) -> dict[str, Any]:
    """HF output_hidden_states + save_file; best of the --hf-batch sizes, then >= min-seconds."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0, dtype = time.perf_counter(), getattr(torch, a.dtype)
    tok = AutoTokenizer.from_pretrained(a.model)
    tok.pad_token = tok.pad_token or tok.eos_token or tok.unk_token
    tok.padding_side = "right"
    shape = perf_models.SHAPES.get(a.shape) if a.shape else None
    if shape is not None and shape.weights == "dummy":  # no checkpoint: HF's own init
        with torch.device(a.device):
            model = AutoModelForCausalLM.from_config(perf_models.hf_config(shape),
                                                     dtype=dtype).eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype).eval().to(a.device)
    load_s, prompts, careful = time.perf_counter() - t0, _prompt_set(a, 0), bool(a.shape)
    keep_kw: dict[str, Any] = {"logits_to_keep": 1} if careful and (
        "logits_to_keep" in inspect.signature(model.forward).parameters) else {}
    counter = itertools.count()

    def forward(batch: list[str]) -> int:
        enc = tok(batch, return_tensors="pt", padding=True).to(a.device)
        states = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
                       output_hidden_states=True, **keep_kw).hidden_states[1:]
        lengths = enc["attention_mask"].sum(1).tolist()
        rows = {f"resid_post.{layer}": states[layer].cpu() for layer in layers}
        rows["token_ids"] = enc["input_ids"].cpu()
        tensors = {k: torch.cat([h[i, :n] for i, n in enumerate(lengths)]).contiguous()
                   for k, h in rows.items()}
        save_file(tensors, str(out / f"hf-{next(counter):06d}.safetensors"))
        return int(sum(lengths))

    def batches(size: int, items: list[str]):
        chunk = size * 4 if careful else size  # sort within chunks: less padding, no bias
        for c in range(0, len(items), chunk):
            part = sorted(items[c: c + chunk], key=len) if careful else items[c: c + chunk]
            for b in range(0, len(part), size):
                yield part[b: b + size]

    sizes, probes = [int(x) for x in str(a.hf_batch).split(",")], {}
    if len(sizes) > 1:
        probe_prompts = _prompt_set(a, 99, max(sizes))
        with torch.inference_mode():
            forward(probe_prompts[: min(sizes)])  # first-call set-up, untimed
            for size in sizes:
                try:
                    t = time.perf_counter()
                    n = sum(forward(b) for b in batches(size, probe_prompts))
                    if a.device == "cuda":
                        torch.cuda.synchronize()
                    probes[size] = n / (time.perf_counter() - t)
                except torch.OutOfMemoryError:
                    probes[size] = 0.0
                    torch.cuda.empty_cache()  # only CUDA raises it
        for f in out.glob("hf-*.safetensors"):
            f.unlink()
    best = max(probes, key=lambda s: probes[s]) if probes else sizes[0]
    tokens = done = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for b in batches(best, prompts):
            tokens += forward(b)
            done += len(b)
            if a.hf_min_seconds and time.perf_counter() - t0 >= a.hf_min_seconds:
                break
    os.sync()
    run_s = time.perf_counter() - t0
    return {"load_s": load_s, "run_s": run_s, "tokens": tokens, "prompts": done,
            "batch": best, "probe_tokens_per_s": probes, "logits_to_keep": bool(keep_kw),
            "length_sorted_chunks": careful, "tokens_per_s": tokens / run_s}


def _engine_kwargs(a: argparse.Namespace) -> dict[str, Any]:
    return {"dtype": a.dtype, "gpu_memory_utilization": perf_models.MEM[a.device],
            "max_model_len": a.max_model_len,
            **(perf_models.engine_kwargs(a.shape) if a.shape else {})}


def run_capsteer(a: argparse.Namespace, layers: list[int], out: Path, full: bool) -> dict[str, Any]:
    from capsteer.capture.spec import parse_capture_spec
    from capsteer.engine import Engine
    from capsteer.extraction.job import job_config
    from capsteer.extraction.local import extract

    job = Path(a.stable_dir) / "capsteer-extract-job"  # a stable path: see main()
    shutil.rmtree(job, ignore_errors=True)
    n_layers, t0 = a.num_layers, time.perf_counter()
    spec = parse_capture_spec({"hooks": ["resid_post"], "layers": layers, "positions": "prompt"},
                              num_layers=n_layers)
    kw = _engine_kwargs(a)
    config = job_config(job, spec, 256 << 20, kw, num_layers=n_layers, full_forward=full)
    engine = Engine(a.model, capsteer_config=config, **kw)
    load_s, lines = time.perf_counter() - t0, []  # lines: every pass's rows (see one())

    def one(tag: str, prompts: list[str]):  # a job resumes only over its own input
        lines.extend(json.dumps({"id": f"{tag}-{i}", "prompt": p}) + "\n"
                     for i, p in enumerate(prompts))
        inp = out / f"prompts-{tag}.jsonl"
        inp.write_text("".join(lines))  # earlier passes' ids are done: only this pass runs
        return extract(a.model, inp, job, hooks=["resid_post"], layers=layers,
                       positions="prompt", progress=False, engine=engine)

    warm = one("warm", _prompt_set(a, 1000, 64)) if a.reps > 0 and a.warmup else None
    reps = [{"run_s": res.seconds, "tokens": res.tokens, "bytes": res.bytes_written,
             "tokens_per_s": res.tokens / res.seconds}
            for res in (one(f"r{r}", _prompt_set(a, r)) for r in range(a.reps))]
    # Where the step loop waited (harvest wait_s: every pinned ring slot still being
    # delivered to the shard writer) and the hooks' own host seconds, over all passes.
    (stats,) = engine.llm.collective_rpc("capsteer_stats")
    engine.close()
    shutil.rmtree(job, ignore_errors=True)
    return {"load_s": load_s, "warmup_s": warm.seconds if warm else None, "reps": reps,
            "stop_at_layer": config.get("stop_at_layer"),
            "engine_stats": {k: stats.get(k) for k in ("forward_layers", "harvest", "host_s")},
            **_medians(reps)}


def run_vllm(a: argparse.Namespace) -> dict[str, Any]:
    """Stock vLLM prefilling the same prompts: the engine's own speed, without capture."""
    from vllm import LLM, SamplingParams

    t0, sp = time.perf_counter(), SamplingParams(max_tokens=1, temperature=0.0)
    llm = LLM(model=a.model, max_num_batched_tokens=2048,  # the extraction job's step size
              **_engine_kwargs(a))
    load_s = time.perf_counter() - t0
    if a.warmup:
        llm.generate(_prompt_set(a, 1000, 64), sp, use_tqdm=False)
    reps = []
    for r in range(a.reps):
        prompts, t0 = _prompt_set(a, r), time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        run_s, tokens = time.perf_counter() - t0, sum(len(o.prompt_token_ids) for o in outs)
        reps.append({"run_s": run_s, "tokens": tokens, "tokens_per_s": tokens / run_s,
                     "cached_tokens": sum(int(o.num_cached_tokens or 0) for o in outs)})
    llm.llm_engine.engine_core.shutdown()
    return {"load_s": load_s, "reps": reps, **_medians(reps)}


def _medians(reps: list[dict[str, Any]]) -> dict[str, Any]:
    rates = [r["tokens_per_s"] for r in reps]
    return {"tokens_per_s": statistics.median(rates), "min_tokens_per_s": min(rates),
            "max_tokens_per_s": max(rates), "tokens": reps[0]["tokens"],
            "run_s": statistics.median(r["run_s"] for r in reps)}


def _one(a: argparse.Namespace) -> dict[str, Any]:
    a.num_layers = json.loads((Path(a.model) / "config.json").read_text())["num_hidden_layers"]
    layers = list(range(a.num_layers)) if a.capture_layers == "all" else [
        int(x) for x in a.capture_layers.split(",")]
    if a.device == "cuda":  # the previous side's engine core may still be exiting
        perf_models.wait_gpu_free(perf_models.MEM[a.device] + 0.05)
    work = Path(tempfile.mkdtemp(prefix=f"capsteer-x-{a.one}-", dir=a.work))
    try:
        if a.one == "hf":
            return run_hf(a, layers, work)
        if a.one in ("capsteer", "capsteer_full"):
            return run_capsteer(a, layers, work, full=a.one == "capsteer_full")
        return run_vllm(a)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _write_model(a: argparse.Namespace, work: Path) -> str:
    if a.shape:
        return str(perf_models.write_model(work / a.shape, a.shape, a.device))
    from capsteer.demo_model import DemoShape, write_demo_model

    shape = DemoShape(hidden_size=a.hidden, num_layers=a.layers, intermediate_size=a.hidden * 3,
                      num_heads=a.hidden // 64, num_kv_heads=max(1, a.hidden // 256), head_dim=64)
    return str(write_demo_model(work / "model", "qwen3", seed=3, shape=shape, dtype=a.dtype,
                                device=a.device))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(perf_models.SHAPES), default=None,
                    help="a perf_models geometry (replaces --hidden/--layers)")
    ap.add_argument("--prompt-tokens", default="64-512",
                    help="with --shape: prompt length range in tokens, lo-hi")
    # --hf-min-seconds: stop HF after this long (0: all prompts); --reps: capsteer's and vllm's
    for name, default in (("--prompts", 256), ("--hidden", 512), ("--layers", 8), ("--reps", 1),
                          ("--hf-min-seconds", 0.0)):
        ap.add_argument(name, type=type(default), default=default)
    ap.add_argument("--hf-batch", default="16", help="one size, or several to pick the best")
    ap.add_argument("--no-warmup", dest="warmup", action="store_false")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--sides", default="hf,capsteer,vllm", help=f"of {','.join(ALL_SIDES)}")
    ap.add_argument("--capture-layers", default="all",
                    help="'all' or comma-separated layers (e.g. one layer for SAE training)")
    ap.add_argument("--work", default=None, help="directory for the model and outputs")
    ap.add_argument("--out", default=perf_models.default_out())
    for hidden in ("--one", "--model", "--result-file", "--stable-dir"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    lo, _, hi = a.prompt_tokens.partition("-")
    a.token_range = (int(lo), int(hi or lo))
    a.dtype = perf_models.SHAPES[a.shape].dtype if a.shape else (
        "bfloat16" if a.device == "cuda" else "float32")
    a.max_model_len = (a.token_range[1] + 16) if a.shape else 512
    if a.one:
        Path(a.result_file).write_text(json.dumps(_one(a)))
        return 0
    base = Path(tempfile.mkdtemp(prefix="capsteer-bench-", dir=a.work))
    # Stable model and job paths (in vLLM's compile-cache key): a warm machine does not recompile.
    stable = Path(a.work or tempfile.gettempdir())
    rows: dict[str, Any] = {}
    try:
        t = time.perf_counter()
        model = _write_model(a, stable / "capsteer-models" if a.shape else base)
        print(f"model at {model} ({time.perf_counter() - t:.1f} s)", flush=True)
        for side in a.sides.split(","):
            result, t = base / f"{side}.json", time.perf_counter()
            cmd = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]),
                   "--one", side, "--model", model, "--result-file", str(result),
                   "--work", str(base), "--stable-dir", str(stable)]
            r = rows[side] = perf_models.run_child(cmd, result, side) | {
                "process_s": time.perf_counter() - t}
            print(f"{side}: {r['tokens_per_s']:,.0f} tok/s over {r['tokens']:,} tokens "
                  f"(load {r['load_s']:.0f} s, process {r['process_s']:.0f} s)", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    row: dict[str, Any] = {
        **perf_models.meta("extract_bench.py", a.device), "cpus": os.cpu_count(),
        "prompts": a.prompts, "hf_batch": rows.get("hf", {}).get("batch"), **rows,
        "model": perf_models.describe(a.shape) if a.shape else
        f"qwen3-shaped random, hidden {a.hidden}, {a.layers} layers, {a.dtype}",
        "capture": f"resid_post, layers {a.capture_layers}, all prompt positions"}
    if "capsteer" in rows and "hf" in rows:
        ratio = row["ratio_capsteer_over_hf"] = (rows["capsteer"]["tokens_per_s"]
                                                 / rows["hf"]["tokens_per_s"])
        row["p4_vs_hf"] = {"value": ratio, "target": TARGET_VS_HF,
                           "verdict": "met" if ratio >= TARGET_VS_HF else "missed"}
    if "capsteer" in rows and "vllm" in rows:
        cs, vl = rows["capsteer"], rows["vllm"]
        lo, hi = cs["min_tokens_per_s"] / vl["max_tokens_per_s"], cs["max_tokens_per_s"] / vl["min_tokens_per_s"]
        few = min(len(cs["reps"]), len(vl["reps"])) < 2
        row["p4_vs_vllm"] = {"value": cs["tokens_per_s"] / vl["tokens_per_s"], "lo": lo, "hi": hi,
                             "target": TARGET_VS_VLLM, "verdict": "unresolved" if few else
                             perf_models.verdict(lo, hi, TARGET_VS_VLLM),
                             "note": "spread over repetitions in one process per side"}
    row.update({f"ratio_{x}_over_capsteer_full": rows[x]["tokens_per_s"] / rows[
        "capsteer_full"]["tokens_per_s"] for x in ("capsteer", "vllm", "hf") if x in rows}
        if "capsteer_full" in rows else {})
    print(f"\n{'':14}{'tokens':>10}{'run s':>9}{'tok/s':>11}{'load s':>9}")
    for side, r in ((x, rows[x]) for x in ALL_SIDES if x in rows):
        print(f"{side:14}{r['tokens']:>10,}{r['run_s']:>9.2f}{r['tokens_per_s']:>11,.0f}"
              f"{r['load_s']:>9.1f}")
    for key, k in ((x, row[x]) for x in ("p4_vs_vllm", "p4_vs_hf") if x in row):
        extra = f" [{k['lo']:.3f}, {k['hi']:.3f}]" if "lo" in k else ""
        print(f"{key}: {k['value']:.3f}{extra} target {k['target']} -> {k['verdict']}")
    suffix = "" if a.capture_layers == "all" else "-layers-" + a.capture_layers.replace(",", "_")
    out = perf_models.write_result(a.out, row, f"extract{f'-{a.shape}' if a.shape else ''}{suffix}")
    plt = perf_models.pyplot()
    if plt is not None:
        labels = {"hf": "HF transformers", "capsteer": "capsteer extract",
                  "capsteer_full": "capsteer, every layer", "vllm": "vLLM, no capture"}
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.bar(*zip(*((labels[n], row[n]["tokens_per_s"]) for n in ALL_SIDES if n in row),
                    strict=True))
        ax.set_ylabel("tokens/s")
        ax.set_title(f"extraction, {row['capture']} ({a.device})", fontsize=9)
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
