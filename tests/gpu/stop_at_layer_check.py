"""A stopped forward changes no captured value: the same extraction job run twice, once
stopping after its deepest layer (the default) and once with `full_forward` (every
layer), each in its own process, then every row of the two jobs compared.

    python3 tests/gpu/stop_at_layer_check.py --device cuda            # Qwen3-0.6B shape, bf16
    .venv/bin/python tests/gpu/stop_at_layer_check.py --device cpu     # qwen3-tiny smoke run

Prints and writes <out>/<tag>-<date>-stop-at-layer.json: per side the job's tokens/s
(start-up excluded) and the engine's `forward_layers`; then, over every request and
captured key, how many rows are bitwise equal and the largest difference relative to
the row's scale. Same prompts, order and step size on both sides, and every prompt queued
at once, so both sides run the same batches (bf16 results depend on the batch).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))  # perf_models
import perf_models

HOOKS = ["resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out"]


def _prompts(n: int, vocab: int, seed: int = 11) -> list[dict[str, str]]:
    rng = random.Random(seed)
    words = vocab - len(perf_models.SPECIALS)
    return [{"id": f"p{i}", "prompt": " ".join(f"w{rng.randrange(words)}"
                                               for _ in range(rng.randint(64, 512)))}
            for i in range(n)]


def _side(a: argparse.Namespace) -> dict[str, Any]:
    """One job in this process: `a.one` is "stopped" or "full"."""
    import time

    from capsteer.capture.spec import parse_capture_spec
    from capsteer.engine import Engine
    from capsteer.extraction.job import job_config
    from capsteer.extraction.local import extract

    shape = perf_models.SHAPES[a.shape]
    spec = parse_capture_spec({"hooks": HOOKS, "layers": [a.layer], "positions": "prompt"},
                              num_layers=shape.layers)
    kw: dict[str, Any] = {**perf_models.engine_kwargs(a.shape), "max_model_len": 640,
                          "gpu_memory_utilization": 0.6 if a.device == "cuda" else 0.3}
    out = Path(a.job)
    config = job_config(out, spec, 256 << 20, kw, num_layers=shape.layers,
                        full_forward=a.one != "stopped")
    t0 = time.perf_counter()
    engine = Engine(a.model, capsteer_config=config, **kw)
    load_s = time.perf_counter() - t0
    try:
        # Every prompt queued up front: the scheduler's batches then depend on the queue
        # alone, not on when the loop refills it, so both sides run the same batches.
        n = len(Path(a.input).read_text().splitlines())
        res = extract(a.model, a.input, out, hooks=HOOKS, layers=[a.layer], positions="prompt",
                      progress=False, engine=engine, window=n)
        (stats,) = engine.llm.collective_rpc("capsteer_stats")
    finally:
        engine.close()
    return {"load_s": load_s, "tokens": res.tokens, "run_s": res.seconds,
            "tokens_per_s": res.tokens_per_s, "stop_at_layer": stats["stop_at_layer"],
            "forward_layers": stats["forward_layers"]}


def _compare(stopped: Path, full: Path) -> dict[str, Any]:
    import torch

    from capsteer.capture.sharded import read_sharded

    a, b = read_sharded(stopped), read_sharded(full)
    ids = sorted(str(e["id"]) for e in a.index)
    assert ids == sorted(str(e["id"]) for e in b.index), "the jobs hold different requests"
    rows = equal = 0
    worst = 0.0
    per_key: dict[str, float] = {}
    for rid in ids:
        x, y = a.request(rid), b.request(rid)
        assert list(x["token_ids"]) == list(y["token_ids"])
        for hook in HOOKS:
            key = next(k for k in x if isinstance(k, tuple) and k[0] == hook)
            u, v = torch.as_tensor(x[key]).float(), torch.as_tensor(y[key]).float()
            rows += u.shape[0]
            equal += int((u == v).all(dim=1).sum())
            rel = float(((u - v).abs().amax(dim=1) / v.abs().amax(dim=1).clamp_min(1e-6)).max())
            worst = max(worst, rel)
            per_key[hook] = max(per_key.get(hook, 0.0), rel)
    return {"requests": len(ids), "rows": rows, "bitwise_equal_rows": equal,
            "max_rel_diff": worst, "max_rel_diff_by_hook": per_key}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--shape", default=None, help="perf_models shape (default: qwen3-0.6b on "
                    "cuda, qwen3-tiny on cpu)")
    ap.add_argument("--layer", type=int, default=None, help="captured layer (default: middle)")
    ap.add_argument("--prompts", type=int, default=None, help="default 512 on cuda, 24 on cpu")
    ap.add_argument("--sides", default="stopped,full",
                    help="the two jobs compared: stopped,full (default) or full,full2, the "
                         "control (two full forwards: vLLM's own run-to-run differences)")
    ap.add_argument("--work", default=None)
    ap.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).parent / "results"))
    for hidden in ("--one", "--model", "--input", "--job", "--result-file"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.shape = a.shape or ("qwen3-0.6b" if a.device == "cuda" else "qwen3-tiny")
    shape = perf_models.SHAPES[a.shape]
    a.layer = shape.layers // 2 if a.layer is None else a.layer
    if a.one:
        Path(a.result_file).write_text(json.dumps(_side(a)))
        return 0
    n = a.prompts or (512 if a.device == "cuda" else 24)
    base = Path(tempfile.mkdtemp(prefix="capsteer-stop-", dir=a.work))
    try:
        model = perf_models.write_model(base / a.shape, a.shape, a.device)
        inp = base / "prompts.jsonl"
        inp.write_text("".join(json.dumps(p) + "\n" for p in _prompts(n, shape.vocab)))
        sides: dict[str, Any] = {}
        names = a.sides.split(",")
        if len(names) != 2 or not set(names) <= {"stopped", "full", "full2"}:
            raise SystemExit("--sides: two of stopped, full, full2")
        for side in names:
            result = base / f"{side}.json"
            cmd = [sys.executable, __file__, "--device", a.device, "--shape", a.shape,
                   "--layer", str(a.layer), "--one", side, "--model", str(model),
                   "--input", str(inp), "--job", str(base / f"job-{side}"),
                   "--result-file", str(result)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                print(proc.stdout[-3000:], proc.stderr[-6000:], flush=True)
                raise SystemExit(f"{side} failed")
            sides[side] = json.loads(result.read_text())
            s = sides[side]
            print(f"{side}: {s['tokens_per_s']:,.0f} tok/s over {s['tokens']:,} tokens, "
                  f"forward_layers {s['forward_layers']} (load {s['load_s']:.0f} s)", flush=True)
        compared = _compare(base / f"job-{names[0]}", base / f"job-{names[1]}")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    from perf_models import device_name, device_tag

    name = device_name(a.device)
    row = {"device": name, "date": dt.date.today().isoformat(),
           "command": "python tests/gpu/stop_at_layer_check.py " + " ".join(
               argv if argv is not None else sys.argv[1:]),
           "model": perf_models.describe(a.shape), "hooks": HOOKS, "layer": a.layer,
           "prompts": n, "sides": names, **sides,
           "speedup": sides[names[0]]["tokens_per_s"] / sides[names[1]]["tokens_per_s"],
           "compare": compared}
    print(json.dumps(compared, indent=1))
    print(f"{names[0]} / {names[1]}: {row['speedup']:.3f}")
    control = "" if "stopped" in names else "-control"
    out = Path(a.out) / f"{device_tag(name)}-{row['date']}-stop-at-layer{control}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(row, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
