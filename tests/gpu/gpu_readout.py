"""Readouts on the GPU (issue 61): device mode with CUDA graphs, checked against HF, and
their throughput through the server beside plain requests.

1. Correctness: a float32 demo Qwen3 served by `capsteer serve` (CUDA graphs on); a
   sigmoid probe and a TopK / JumpReLU SAE registered; chat requests with readouts (alone,
   streamed, and 16 at once beside plain ones) equal HF's activations read by the same
   probe and `sae_encode` (SAELens's equality is the CPU suite's test) within TOL of scale.
2. Throughput (`--bench`): a bf16 shape (default qwen3-0.6b) under one server, rounds of
   N concurrent completions (random prompts, fixed output length) interleaved: plain,
   one probe at one layer on every token (`readout_probe`), a 16k-feature TopK SAE at one
   layer on every token (`readout_sae16k`); output tok/s ratios to plain.

    python tests/gpu/gpu_readout.py --out DIR [--bench] [--rounds 3]
Writes <out>/<device>-<date>-readout.json; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))  # perf_models
from capsteer.server.process import ManagedServer, free_port

LAYER = 1
TOL = 5e-3  # of scale: float32 on the GPU (vLLM's attention kernels) vs HF; CPU CI: 1e-4


def write_sae(directory: Path, d_in: int, d_sae: int, arch: str, seed: int, k: int = 32) -> None:
    """An SAE directory in SAELens's saved format, random weights."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {"W_enc": torch.randn(d_in, d_sae, generator=gen) / d_in ** 0.5,
               "b_enc": torch.randn(d_sae, generator=gen) * 0.1,
               "W_dec": torch.randn(d_sae, d_in, generator=gen) / d_sae ** 0.5,
               "b_dec": torch.randn(d_in, generator=gen) * 0.1}
    cfg = {"architecture": arch, "d_in": d_in, "d_sae": d_sae, "sae_lens_version": "6.5.0",
           "apply_b_dec_to_input": True, "normalize_activations": "none",
           "metadata": {"hook_name": f"blocks.{LAYER}.hook_resid_post"}}
    if arch == "topk":
        cfg["k"] = k
    if arch == "jumprelu":
        tensors["threshold"] = torch.rand(d_sae, generator=gen) * 0.2
    save_file(tensors, str(directory / "sae_weights.safetensors"))
    (directory / "cfg.json").write_text(json.dumps(cfg))


def register_readers(root: Path, hidden: int, d_sae: int) -> None:
    from capsteer.steering.readers.registry import ReaderRegistry

    reg = ReaderRegistry(root, hidden_size=hidden)
    rng = np.random.default_rng(3)
    weight = (rng.standard_normal((2, hidden)) / hidden ** 0.5).astype(np.float32)
    body = json.dumps({"weight": weight.tolist(), "bias": [0.1, -0.2],
                       "activation": "sigmoid"}).encode()
    reg.put("probe", body, "json")
    write_sae(root / "sae-topk", hidden, d_sae, "topk", seed=4)
    write_sae(root / "sae-jumprelu", hidden, d_sae, "jumprelu", seed=5)


def serve(model: Path, work: Path, name: str, *extra: str) -> ManagedServer:
    port = free_port()
    argv = [sys.executable, "-m", "capsteer.cli", "serve", str(model), "--port", str(port),
            "--capture-dir", str(work / name / "captures"),
            "--readers-dir", str(work / "readers"), *extra]
    (work / name).mkdir(parents=True, exist_ok=True)
    # cwd: not the checkout, whose capsteer/ folder would shadow the installed package
    return ManagedServer(argv, url=f"http://127.0.0.1:{port}", log_path=work / f"{name}.log",
                         cwd=work, start_timeout_s=900)


def check_correctness(work: Path, device: str) -> dict:
    import httpx

    from capsteer.demo_model import write_demo_model
    from capsteer.reference import hf_activations, load_hf
    from capsteer.steering.readers.registry import ReaderRegistry

    model = write_demo_model(work / "demo", "qwen3", seed=7, dtype="float32", device=device)
    register_readers(work / "readers", 128, 256)
    reg = ReaderRegistry(work / "readers", hidden_size=128)
    items = [{"reader": {"name": "probe"}, "hook": "resid_post", "layer": LAYER},
             {"reader": {"name": "sae-topk"}, "hook": "resid_post", "layer": LAYER, "top_k": 8},
             {"reader": {"name": "sae-jumprelu"}, "hook": "mlp_out", "layer": 0, "top_k": 6,
              "positions": "generated"}]
    server = serve(model, work, "check", "--dtype", "float32",
                   "--gpu-memory-utilization", "0.3")
    worst, checked, failures = 0.0, 0, []
    try:
        hf = load_hf(str(model), device=device)
        with httpx.Client(base_url=server.url, timeout=600) as http:
            mid = http.get("/v1/models").json()["data"][0]["id"]

            def body(i: int, stream: bool = False, readout: bool = True) -> dict:
                b = {"model": mid, "max_tokens": 12, "temperature": 0, "stream": stream,
                     "messages": [{"role": "user", "content": f"item {i}: the fox " * (1 + i % 4)}]}
                if readout:
                    b["readout"] = items
                return b

            async def many() -> list[dict]:
                async with httpx.AsyncClient(base_url=server.url, timeout=600) as client:
                    rs = await asyncio.gather(*(client.post(
                        "/v1/chat/completions", json=body(i, readout=i % 2 == 0))
                        for i in range(32)))
                return [r.json() for r in rs]

            responses = [http.post("/v1/chat/completions", json=body(0)).json()]
            responses += [r for r in asyncio.run(many()) if "readout_results" in r]
            for resp in responses:
                results = resp["readout_results"]
                tokens = results[0]["token_ids"]
                acts = hf_activations(hf, tokens)
                for item, got in zip(items, results, strict=True):
                    if "error" in got:
                        failures.append(got["error"])
                        continue
                    x = acts[(got["hook"], got["layer"])][got["positions"]].float()
                    reader = reg.get(item["reader"]["name"]).to(device)
                    if "scores" in got:
                        ref = reader.scores(x)
                        diff = float((torch.tensor(got["scores"], device=device) - ref).abs().max())
                        worst = max(worst, diff / max(1.0, float(ref.abs().max())))
                    else:
                        ref = reader.encode(x)
                        for row, pairs in zip(ref, got["features"], strict=True):
                            scale = max(1.0, float(row.abs().max()))
                            for f, v in pairs:
                                worst = max(worst, abs(float(row[f]) - v) / scale)
                            # The set is a top-k of the reference up to near-ties at its edge.
                            if pairs:
                                edge = float(torch.topk(row, len(pairs)).values[-1])
                                if min(v for _, v in pairs) < edge - TOL * scale:
                                    failures.append(f"not a top-{len(pairs)}: {pairs}")
                    checked += 1
            # Streamed: the chunks' readouts concatenate to the JSON result.
            streamed: dict[int, list] = {}
            with http.stream("POST", "/v1/chat/completions", json=body(0, stream=True)) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        for entry in json.loads(line[6:]).get("readout", []):
                            streamed.setdefault(entry["item"], []).extend(entry["positions"])
            for got in responses[0]["readout_results"]:
                if streamed.get(got["item"], []) != got["positions"]:
                    failures.append(f"stream positions differ for item {got['item']}")
    finally:
        server.close()
    ok = not failures and worst <= TOL and checked >= 3 * 2
    print(f"readout vs HF: {checked} item results, worst diff {worst:.2e} of scale, "
          f"{len(failures)} failures {'PASS' if ok else 'FAIL'}", flush=True)
    for f in failures[:10]:
        print("  ", f)
    return {"checked": checked, "worst": worst, "failures": failures[:20], "ok": ok}


def bench(work: Path, shape: str, rounds: int, requests: int, prompt_tokens: int,
          max_tokens: int) -> dict:
    import httpx
    from perf_models import SHAPES, write_model

    model = write_model(work / shape, shape, "cuda")
    hidden = SHAPES[shape].hidden
    layer = SHAPES[shape].layers // 2
    write_sae(work / "readers" / "sae16k", hidden, 16384, "topk", seed=6)
    from capsteer.steering.readers.registry import ReaderRegistry

    rng = np.random.default_rng(1)
    weight = (rng.standard_normal((1, hidden)) / hidden ** 0.5).astype(np.float32)
    ReaderRegistry(work / "readers", hidden_size=hidden).put(
        "probe1", json.dumps({"weight": weight.tolist(), "bias": [0.0]}).encode(), "json")
    cases = {"plain": None,
             "readout_probe": [{"reader": {"name": "probe1"}, "hook": "resid_post",
                                "layer": layer}],
             "readout_sae16k": [{"reader": {"name": "sae16k"}, "hook": "resid_post",
                                 "layer": layer, "top_k": 16}]}
    prompts = [rng.integers(100, 10000, prompt_tokens).tolist() for _ in range(requests)]
    server = serve(model, work, "bench", "--dtype", "bfloat16")
    out: dict[str, list[float]] = {c: [] for c in cases}
    try:
        mid = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]

        async def run(readout) -> float:
            async with httpx.AsyncClient(base_url=server.url, timeout=900,
                                         limits=httpx.Limits(max_connections=requests)) as c:
                def body(p):
                    b = {"model": mid, "prompt": p, "max_tokens": max_tokens,
                         "ignore_eos": True, "temperature": 0}
                    if readout:
                        b["readout"] = readout
                    return b
                start = time.perf_counter()
                rs = await asyncio.gather(*(c.post("/v1/completions", json=body(p))
                                            for p in prompts))
                took = time.perf_counter() - start
            tokens = 0
            for r in rs:
                data = r.json()
                assert r.status_code == 200, data
                if readout:
                    assert "error" not in data["readout_results"][0], data["readout_results"]
                tokens += data["usage"]["completion_tokens"]
            return tokens / took

        asyncio.run(run(None))  # warm-up
        for rnd in range(rounds):
            for case, readout in cases.items():
                out[case].append(asyncio.run(run(readout)))
                print(f"round {rnd + 1} {case}: {out[case][-1]:.0f} tok/s", flush=True)
    finally:
        server.close()
    plain = out["plain"]
    summary = {}
    for case in cases:
        ratios = [v / p for v, p in zip(out[case], plain, strict=True)]
        summary[case] = {"tok_s": out[case], "ratio": statistics.median(ratios),
                         "spread": [min(ratios), max(ratios)]}
        print(f"{case}: median ratio to plain {summary[case]['ratio']:.3f} "
              f"({min(ratios):.3f}-{max(ratios):.3f})", flush=True)
    return {"shape": shape, "layer": layer, "requests": requests,
            "prompt_tokens": prompt_tokens, "max_tokens": max_tokens, "cases": summary}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--work", default="/tmp/capsteer-readout")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False  # the HF reference in full float32
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    result: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                    "date": dt.date.today().isoformat(), "command": " ".join(sys.argv)}
    if not args.skip_check:
        result["check"] = check_correctness(work, device)
    if args.bench:
        result["bench"] = bench(work, args.shape, args.rounds, args.requests,
                                args.prompt_tokens, args.max_tokens)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = result["device"].replace(" ", "-").lower()
    (out / f"{tag}-{result['date']}-readout.json").write_text(json.dumps(result, indent=1))
    sys.exit(0 if result.get("check", {"ok": True})["ok"] else 1)


if __name__ == "__main__":
    main()
