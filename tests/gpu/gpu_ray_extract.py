"""Ray Data extraction on the GPU (issue 14): 2 engine replicas vs 1 on the same prompts.

    python3 tests/gpu/gpu_ray_extract.py                   # nvidia-h200-x2, steps: tests/gpu/README.md
    .venv/bin/python tests/gpu/gpu_ray_extract.py --device cpu          # smoke run, tiny shape
    python3 tests/gpu/gpu_ray_extract.py --slim-ray-wheel SRC.whl DST.whl  # carrying Ray (tests/gpu/README.md)

Model: Llama-3-8B geometry (hidden 4096, 32 layers, intermediate 14336, 32 heads, 8 KV
heads, head_dim 128, vocab 128256), bf16. Its weights are generated on the machine by vLLM
at load (`load_format=dummy`: seeded, so every engine holds the same weights, and no 16 GB
checkpoint is written or read); the directory holds the config and a word-level tokenizer
with exactly that vocabulary. One layer is captured (resid_post at --layer), every prompt
position, sharded and durable as `capsteer extract` always writes.

Each replica count R in --replicas runs `extract(..., ray=True, num_replicas=R)` in its own
process (its own local Ray cluster, one GPU per replica, its own job directory) over the
same prompts. Figures per run: tokens/s of the job (from the first batch a replica starts
to the driver's last commit: engine start-up excluded) and wall seconds with start-up.
Then: throughput ratio R=2 / R=1 (target >= 1.8), and the two jobs' rows: the same ids
exactly once, per id the same row count, token ids and positions, and values within bf16
rounding (different batch compositions change GEMM tiling, so not bitwise) on --compare
sampled requests; both jobs verify (every shard's digest).
Writes <out>/<tag>-<date>-ray-extract.json (out: --out, else $OUT, else /tmp/capsteer-gpu-checks).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import random
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))  # perf_models
import perf_models
from perf_models import SHAPES, SPECIALS

TARGET_RATIO = 1.8
# Shapes and the model writer: bench/perf_models.py (the script's own directory is on
# sys.path); the ones this run offers.
SHAPE_NAMES = ("llama3-8b", "llama-tiny")


def write_prompts(path: Path, n: int, lo: int, hi: int, vocab: int, seed: int) -> int:
    """JSONL with an id on every row (so Ray Data reads the file itself); returns tokens."""
    rng = random.Random(seed)
    tokens = 0
    with open(path, "w") as fh:
        for i in range(n):
            k = rng.randint(lo, hi)
            tokens += k
            words = " ".join(f"w{rng.randrange(vocab - len(SPECIALS))}" for _ in range(k))
            fh.write(json.dumps({"id": f"p{i:06d}", "prompt": words}) + "\n")
    return tokens


def engine_args(a: argparse.Namespace) -> dict[str, Any]:
    kw: dict[str, Any] = dict(load_format="dummy", max_model_len=a.max_model_len, seed=0,
                              max_num_batched_tokens=a.max_num_batched_tokens)
    if a.device == "cpu":
        kw.update(dtype="float32", gpu_memory_utilization=0.05, enforce_eager=True,
                  max_num_seqs=16)
    else:
        kw.update(dtype="bfloat16", gpu_memory_utilization=a.gpu_memory_utilization)
    if a.tensor_parallel_size > 1:
        kw["tensor_parallel_size"] = a.tensor_parallel_size
    return kw


# ------------------------------------------------------------------- one run (child)
def child(a: argparse.Namespace) -> None:
    """One replica count in this process: its own Ray cluster, its own job directory."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # the GPU machine reaches nothing
    from capsteer.extraction.local import extract

    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda rec: lines.append(rec.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("capsteer.extract")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    t0 = time.time()
    result = extract(a.model_dir, a.input, a.job, hooks=["resid_post"], layers=[a.layer],
                     positions="prompt", shard_size=a.shard_size, progress=False, ray=True,
                     num_replicas=a.child, ray_batch_size=a.ray_batch_size, **engine_args(a))
    wall = time.time() - t0
    per_replica = next((m.split(": ")[-1] for m in lines if "requests per replica" in m), "")
    Path(a.result).write_text(json.dumps({
        "replicas": a.child, "requests": result.requests, "skipped": result.skipped,
        "tokens": result.tokens, "seconds": result.seconds, "tokens_per_s": result.tokens_per_s,
        "wall_s_with_startup": wall, "bytes": result.bytes_written, "shards": len(result.shards),
        "per_replica": per_replica}))


# --------------------------------------------------------------------------- compare
def compare(job_a: Path, job_b: Path, sample: int) -> dict[str, Any]:
    """Rows of two jobs over the same prompts: ids once each, same metadata, close values."""
    import numpy as np
    import torch

    from capsteer.capture.sharded import read_sharded

    t0 = time.time()
    a, b = read_sharded(job_a), read_sharded(job_b)  # every shard's digest verified
    verify_s = time.time() - t0
    ids_a, ids_b = a.ids(), b.ids()
    out: dict[str, Any] = {
        "verify_s": round(verify_s, 1), "requests": [len(ids_a), len(ids_b)],
        "ids_once": len(ids_a) == len(set(ids_a)) and len(ids_b) == len(set(ids_b)),
        "same_ids": set(ids_a) == set(ids_b), "keys": [list(k) for k in a.keys()]}
    ea = {str(e["id"]): e for e in a.index}
    eb = {str(e["id"]): e for e in b.index}
    out["same_row_counts"] = out["same_ids"] and all(
        ea[i]["row_count"] == eb[i]["row_count"] and ea[i]["prompt_tokens"] ==
        eb[i]["prompt_tokens"] for i in ea)
    picked = sorted(ea)[:: max(1, len(ea) // max(sample, 1))][:sample]
    same_tokens = same_positions = True
    max_abs = max_rel = 0.0
    bitwise = 0
    for rid in picked:
        ra, rb = a.request(rid), b.request(rid)
        same_tokens &= bool(np.array_equal(ra["token_ids"], rb["token_ids"]))
        same_positions &= bool(np.array_equal(ra["positions"], rb["positions"]))
        for key in a.keys():
            x, y = ra[key].float(), rb[key].float()
            bitwise += int(torch.equal(ra[key], rb[key]))
            max_abs = max(max_abs, float((x - y).abs().max()))
            max_rel = max(max_rel, float((x - y).norm() / y.norm().clamp_min(1e-30)))
    out.update(sampled=len(picked), same_token_ids=same_tokens, same_positions=same_positions,
               values_max_abs_diff=max_abs, values_max_rel_err=max_rel,
               bitwise_equal_requests=bitwise)
    return out


def rows_equal(cmp: dict[str, Any], tolerance: float) -> bool:
    return bool(cmp["ids_once"] and cmp["same_ids"] and cmp["same_row_counts"]
                and cmp["same_token_ids"] and cmp["same_positions"]
                and cmp["values_max_rel_err"] <= tolerance)


# ------------------------------------------------------------------ carrying Ray
def slim_ray_wheel(src: Path, dst: Path) -> None:
    """Repack a Ray wheel without its Java jars (~31 MiB compressed; Python never loads
    them), so it fits one device call (64 MiB); RECORD is rewritten to match."""
    import base64
    import csv
    import hashlib
    import io

    drop = ("ray/jars/",)
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED,
                                                      compresslevel=6) as zout:
        names = [n for n in zin.namelist() if not n.startswith(drop)]
        record = next(n for n in names if n.endswith(".dist-info/RECORD"))
        rows = []
        for n in names:
            if n == record:
                continue
            data = zin.read(n)
            zout.writestr(zin.getinfo(n), data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            rows.append((n, f"sha256={digest.decode()}", str(len(data))))
        rows.append((record, "", ""))
        buf = io.StringIO()
        csv.writer(buf).writerows(rows)
        zout.writestr(record, buf.getvalue())
    print(f"{dst}: {dst.stat().st_size / 2**20:.1f} MiB (from {src.stat().st_size / 2**20:.1f})")


def preflight() -> dict[str, Any]:
    """Versions of what Ray Data needs (carried with --no-deps onto the machine's own
    packages): Ray or vLLM missing stops here; an older dependency than Ray declares is
    printed and recorded (it may still work)."""
    from importlib.metadata import PackageNotFoundError, version

    need = {"ray": "2.60", "vllm": "0", "pyarrow": "17", "pandas": "2.2.3",
            "packaging": "24.2", "msgpack": "1.0", "jsonschema": "0"}
    found: dict[str, Any] = {}
    older = []
    for name, least in need.items():
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            if name in ("ray", "vllm"):
                raise SystemExit(f"gpu_ray_extract: {name} is not installed (tests/gpu/README.md, "
                                 "carrying Ray)") from None
            older.append(f"{name} missing")
            continue
        have = tuple(int(x) for x in found[name].split("+")[0].split(".")[:3] if x.isdigit())
        if have < tuple(int(x) for x in least.split(".")):
            older.append(f"{name} {found[name]} < {least}")
    if older:
        print("gpu_ray_extract: older than Ray declares: " + "; ".join(older), flush=True)
    found["older_than_declared"] = older
    return found


# ----------------------------------------------------------------------------- main
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--shape", choices=SHAPE_NAMES, default=None,
                   help="default: llama3-8b on cuda, llama-tiny on cpu")
    p.add_argument("--replicas", default="1,2", help="replica counts, each its own run")
    p.add_argument("--prompts", type=int, default=None, help="default 2048 (cuda), 256 (cpu)")
    p.add_argument("--prompt-tokens", default=None, help="lo-hi tokens per prompt "
                   "(default 256-768 on cuda, 16-96 on cpu)")
    p.add_argument("--layer", type=int, default=None, help="captured layer (default: middle)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs per replica")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="engine step size (default 8192 on cuda, 2048 on cpu)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--ray-batch-size", type=int, default=None,
                   help="prompts per Ray Data batch (default 64 on cuda, 8 on cpu)")
    p.add_argument("--shard-size", type=int, default=1 << 30)
    p.add_argument("--compare", type=int, default=256, help="requests whose values are compared")
    p.add_argument("--tolerance", type=float, default=2e-2,
                   help="max relative error of a request's values (bf16 rounding)")
    p.add_argument("--work", default=None, help="model + job directories (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the job directories")
    p.add_argument("--out", default=None)
    p.add_argument("--slim-ray-wheel", nargs=2, metavar=("SRC", "DST"))
    # child mode (one replica count)
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    for name in ("--model-dir", "--input", "--job", "--result"):
        p.add_argument(name, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.slim_ray_wheel:
        slim_ray_wheel(Path(a.slim_ray_wheel[0]), Path(a.slim_ray_wheel[1]))
        return 0
    cuda = a.device == "cuda"
    a.shape = a.shape or ("llama3-8b" if cuda else "llama-tiny")
    shape = SHAPES[a.shape]
    a.layer = shape.layers // 2 if a.layer is None else a.layer
    a.max_num_batched_tokens = a.max_num_batched_tokens or (8192 if cuda else 2048)
    a.ray_batch_size = a.ray_batch_size or (64 if cuda else 8)
    if a.child is not None:
        child(a)
        return 0

    versions = preflight() if cuda else {}
    replicas = [int(r) for r in a.replicas.split(",")]
    n = a.prompts or (2048 if cuda else 256)
    lo, hi = (int(x) for x in (a.prompt_tokens or ("256-768" if cuda else "16-96")).split("-"))
    work = Path(a.work) if a.work else Path(os.environ.get("TMPDIR", "/tmp")) / "capsteer-ray-bench"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    model = perf_models.write_model(work / "model", a.shape, a.device)
    prompts = work / "prompts.jsonl"
    total_tokens = write_prompts(prompts, n, lo, hi, shape.vocab, seed=11)
    print(f"{a.shape} ({a.device}), {n} prompts, {total_tokens} tokens, layer {a.layer}, "
          f"replicas {replicas}", flush=True)

    runs: dict[int, dict[str, Any]] = {}
    for r in replicas:
        job, result = work / f"job-r{r}", work / f"result-r{r}.json"
        cmd = [sys.executable, __file__, "--device", a.device, "--shape", a.shape, "--child",
               str(r), "--model-dir", str(model), "--input", str(prompts), "--job", str(job),
               "--result", str(result), "--layer", str(a.layer),
               "--max-model-len", str(a.max_model_len),
               "--max-num-batched-tokens", str(a.max_num_batched_tokens),
               "--gpu-memory-utilization", str(a.gpu_memory_utilization),
               "--tensor-parallel-size", str(a.tensor_parallel_size),
               "--ray-batch-size", str(a.ray_batch_size), "--shard-size", str(a.shard_size)]
        t0 = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.stderr.write(proc.stdout[-6000:] + proc.stderr[-6000:])
            raise SystemExit(f"the {r}-replica run failed (exit {proc.returncode})")
        runs[r] = json.loads(result.read_text())
        runs[r]["process_wall_s"] = round(time.time() - t0, 1)
        print(f"  {r} replica(s): {runs[r]['tokens_per_s']:,.0f} tok/s over "
              f"{runs[r]['seconds']:.1f} s, wall {runs[r]['wall_s_with_startup']:.1f} s "
              f"with start-up; {runs[r]['per_replica']}", flush=True)

    report: dict[str, Any] = {
        "bench": "gpu_ray_extract", "date": dt.date.today().isoformat(), "device": a.device,
        "shape": {"name": a.shape, **asdict(shape)}, "weights": "vLLM load_format=dummy",
        "prompts": n, "prompt_tokens": [lo, hi], "tokens": total_tokens,
        "captured": {"hook": "resid_post", "layer": a.layer, "positions": "prompt"},
        "engine_args": engine_args(a), "ray_batch_size": a.ray_batch_size,
        "shard_size": a.shard_size, "versions": versions, "runs": runs}
    if cuda:
        import torch

        report["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    if 1 in runs and 2 in runs:
        ratio = runs[2]["tokens_per_s"] / runs[1]["tokens_per_s"]
        cmp = compare(work / "job-r1", work / "job-r2", a.compare)
        report.update(throughput_ratio_2_vs_1=round(ratio, 3),
                      wall_ratio_1_vs_2=round(runs[1]["wall_s_with_startup"]
                                              / runs[2]["wall_s_with_startup"], 3),
                      target_ratio=TARGET_RATIO, ratio_met=ratio >= TARGET_RATIO,
                      rows=cmp, rows_equal=rows_equal(cmp, a.tolerance), tolerance=a.tolerance)
        print(f"throughput ratio 2 vs 1 replicas: {ratio:.2f} (target >= {TARGET_RATIO}); rows "
              f"equal: {report['rows_equal']} (ids once {cmp['ids_once']}, same ids "
              f"{cmp['same_ids']}, tokens {cmp['same_token_ids']}, positions "
              f"{cmp['same_positions']}, max rel err {cmp['values_max_rel_err']:.2e} over "
              f"{cmp['sampled']} requests, {cmp['bitwise_equal_requests']} bitwise equal)")
    tag = "cpu" if not cuda else (report["gpus"][0].split()[-1].lower() if report["gpus"]
                                  else "gpu")
    out_dir = Path(a.out or os.environ.get("OUT") or Path(__file__).parent / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{tag}-{report['date']}-ray-extract.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path}")
    if not a.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if report.get("rows_equal", True) else 1


if __name__ == "__main__":
    sys.exit(main())
