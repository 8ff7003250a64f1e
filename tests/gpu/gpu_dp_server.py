"""The server under vLLM's data parallelism on a multi-GPU machine (issue 14).

Starts `capsteer serve MODEL --data-parallel-size N` (bf16 random Qwen3 shape, CUDA
graphs on), sends `--requests` concurrent capture requests (completions and chat, every
hook at two layers, all positions, half of them steered, `capture_wait`), then checks:
- every receipt is `ok`, and its directory exists exactly once under the capture root
  with a manifest whose files all verify; no capture directory is unaccounted for;
- `GET /v1/captures/{id}` answers for every id;
- the metrics scrape parses, each capsteer family once, and its totals equal what was
  sent (captures ok, steering requests);
- the engine log names every DP rank's worker (both ranks served).

    python tests/gpu/gpu_dp_server.py [--dp 2] [--requests 64] [--out DIR]   (--device cpu: smoke)
Writes <out>/<device>-<date>-dp-server.json.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))  # perf_models
from capsteer.server.process import ManagedServer, free_port

HOOKS = ["resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out"]


async def fire(url: str, model: str, n: int, hidden: int) -> list[dict]:
    import httpx

    vector = [0.05] * hidden
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def one(i: int) -> dict:
            body: dict = {"model": model, "max_tokens": 8, "temperature": 0,
                          "capture": {"hooks": HOOKS, "layers": [0, 1], "positions": "all"},
                          "capture_wait": True}
            if i % 2:
                body["steering"] = {"vectors": [{"hook": "resid_post", "layer": 1,
                                                 "vector": vector, "scale": 4.0}]}
            if i % 3 == 0:
                body["messages"] = [{"role": "user", "content": f"request {i}: tell me more"}]
                r = await client.post("/v1/chat/completions", json=body)
            else:
                body["prompt"] = f"request {i}: the quick brown fox " * (1 + i % 5)
                r = await client.post("/v1/completions", json=body)
            return {"status": r.status_code, "body": r.json()}

        return await asyncio.gather(*(one(i) for i in range(n)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--work", default="/tmp/capsteer-dp")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    import httpx
    import torch
    from prometheus_client.parser import text_string_to_metric_families

    from capsteer.capture import read
    from capsteer.demo_model import DemoShape, write_demo_model

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    cuda = args.device == "cuda"
    model = work / "model"
    shape = DemoShape(hidden_size=args.hidden, num_layers=args.layers, num_heads=16,
                      num_kv_heads=8, head_dim=64, intermediate_size=3 * args.hidden,
                      vocab_size=1024, max_position_embeddings=4096) if cuda else None
    write_demo_model(model, "qwen3", seed=3, shape=shape,
                     dtype="bfloat16" if cuda else "float32", device=args.device)
    port = free_port()
    flags = ["--data-parallel-size", str(args.dp), "--port", str(port), "--host", "127.0.0.1",
             "--capture-dir", str(work / "captures"), "--max-model-len", "1024"]
    flags += (["--dtype", "bfloat16", "--gpu-memory-utilization", "0.5"] if cuda else
              ["--dtype", "float32", "--gpu-memory-utilization", "0.15"])
    log_path = work / "serve.log"
    url = f"http://127.0.0.1:{port}"
    report: dict = {"device": torch.cuda.get_device_name(0) if cuda else "cpu",
                    "gpus": torch.cuda.device_count() if cuda else 0,
                    "date": dt.date.today().isoformat(), "dp": args.dp,
                    "requests": args.requests, "command": " ".join(sys.argv)}
    # cwd: not the checkout, whose capsteer/ folder would shadow the installed package
    server = ManagedServer([sys.executable, "-m", "capsteer.cli", "serve", str(model), *flags],
                           url=url, log_path=log_path, cwd=work, start_timeout_s=900,
                           stop_timeout_s=90)
    try:
        report["startup_s"] = round(server.ready_s, 1)
        t1 = time.monotonic()
        replies = asyncio.run(fire(url, str(model), args.requests, args.hidden))
        report["wall_s"] = round(time.monotonic() - t1, 2)
        receipts = [r["body"].get("capture_results") or {} for r in replies]
        report["http_ok"] = sum(r["status"] == 200 for r in replies)
        report["receipts_ok"] = sum(c.get("status") == "ok" for c in receipts)
        dirs = [c.get("dir") for c in receipts if c.get("status") == "ok"]
        on_disk = sorted(str(p.parent.relative_to(work / "captures"))
                         for p in (work / "captures").rglob("manifest.json"))
        report["dirs_unique"] = len(set(dirs)) == len(dirs)
        report["dirs_on_disk_equal_receipts"] = sorted(dirs) == on_disk
        verified = 0
        for d in dirs:
            read(work / "captures" / d)  # verifies every listed file's digest
            verified += 1
        report["captures_verified"] = verified
        report["get_by_id_ok"] = sum(
            httpx.get(f"{url}/v1/captures/{c['capture_id']}", timeout=30).is_success
            for c in receipts if c.get("capture_id"))
        text = httpx.get(url + "/metrics", timeout=30).text
        names = [f.name for f in text_string_to_metric_families(text)
                 if f.name.startswith("capsteer_")]
        report["metric_families_duplicated"] = sorted({n for n in names if names.count(n) > 1})
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for f in text_string_to_metric_families(text) for s in f.samples}
        report["metrics_captures_ok"] = samples.get(
            ("capsteer_capture_requests_total", (("status", "ok"),)))
        report["metrics_steering_requests"] = samples.get(
            ("capsteer_steering_requests_total", ()))
        report["steered_sent"] = args.requests // 2
    finally:
        server.close()
    ranks = sorted(set(re.findall(r"EngineCore_DP(\d+)", log_path.read_text(errors="replace"))))
    report["dp_ranks_in_log"] = ranks
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"{'gpu' if cuda else 'cpu'}-{report['date']}-dp-server.json"
    (out / name).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
