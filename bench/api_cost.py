"""What the API process spends on one request before vLLM's engine sees it (CPU, no model).

For each case of `serve_bench.py` (plain, a named per-layer vector steering every layer,
one inline vector on every layer, capture of one layer, capture_wait) it times, on one
thread, over many requests:
  capsteer  the middleware's own work: parse the body, check the fields (registry
            lookups), write the payload, serialize the rewritten body;
  vllm      what the rewritten body then costs vLLM's front end: JSON parse, the request
            model's validation, SamplingParams, and the msgpack encoding that carries
            them to the engine core (the payload's size is paid here);
  poller    the receipt poller's CPU share (of one core) while `--in-flight` captures
            are generating (the serve harness runs 256 concurrent requests).
The geometry defaults to Qwen3-0.6B's (28 layers, hidden 1024), the serve harness's shape.

`--server` measures the same cases end to end instead: a demo model of that geometry
(random weights) served by `capsteer serve` and by stock `vllm serve`, each case's
requests (16 prompt tokens, 1 output token, `--concurrency` at a time) sent over HTTP,
and the CPU time of the API process (the server's own pid, not the engine core) per
request read from /proc.

    python bench/api_cost.py [--iters 400] [--out /tmp/api_cost.json]
    python bench/api_cost.py --server --requests 400 [--work /tmp/api_cost]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np

from capsteer.capture.spec import parse_capture_spec
from capsteer.config.server import ServerSettings
from capsteer.server.fields import (
    ModelShape,
    lift_extra_body,
    parse_hook_fields,
    response_id,
    rewrite_body,
)
from capsteer.server.middleware import parse_json
from capsteer.server.process import ManagedServer, free_port
from capsteer.server.tracker import CaptureTracker
from capsteer.steering.registry import VectorRegistry

PROMPT = "the quick brown fox jumps over the lazy dog " * 40


def bodies(layers: int, hidden: int) -> dict[str, dict]:
    rng = np.random.default_rng(0)
    one = base64.b64encode(rng.standard_normal(hidden).astype("<f4").tobytes()).decode()
    base = {"model": "m", "prompt": PROMPT, "max_tokens": 128}
    cap = {"hooks": ["resid_post"], "layers": [layers // 2], "positions": "all"}
    return {
        "plain": base,
        "steer_all": {**base, "steering": {"vectors": [
            {"hook": "resid_post", "vector": {"name": "per-layer"}, "scale": 4.0}]}},
        "inline_one": {**base, "steering": {"vectors": [
            {"hook": "resid_post", "layers": "all", "vector": {"b64": one, "dtype": "float32"},
             "scale": 4.0}]}},
        "capture": {**base, "capture": cap},
        "capture_wait": {**base, "capture": cap, "capture_wait": True},
    }


def per_call_us(fn: Callable[[], object], iters: int) -> float:
    """Fastest of 7 blocks of `iters // 7` calls (the host is shared), in us a call."""
    fn()
    block = max(iters // 7, 1)
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(block):
            fn()
        times.append((time.perf_counter() - t0) / block * 1e6)
    return min(times)


def vllm_front(encoded: bytes) -> Callable[[], object]:
    """vLLM's own per-request work on the rewritten body, up to the engine core's socket."""
    # vLLM loads when the bench runs, not at import.
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.v1.serial_utils import MsgpackEncoder

    encoder = MsgpackEncoder()

    def run() -> object:
        req = CompletionRequest.model_validate(json.loads(encoded))
        params = req.to_sampling_params(128)
        return encoder.encode(params.clone())
    return run


def poll_cpu_share(tracker: CaptureTracker, n: int, seconds: float = 2.0) -> float:
    """CPU seconds per second the receipt poller takes (its event-loop work and its scans)
    while `n` captures are in flight and none has ended (requests still generating)."""
    spec = parse_capture_spec({"hooks": ["resid_post"], "layers": [0], "positions": "all"},
                              num_layers=4)

    async def run() -> float:
        for i in range(n):
            tracker.track(f"cap-{i:032x}", spec, dir_time=time.time())
        await asyncio.sleep(0.3)
        cpu = time.process_time()
        await asyncio.sleep(seconds)
        share = (time.process_time() - cpu) / seconds
        for i in range(n):
            tracker.untrack(f"cap-{i:032x}")
        return share
    return asyncio.run(run())


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process (its threads, not its children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def drive(url: str, body: dict, n: int, concurrency: int) -> float:
    """Send `n` completions, `concurrency` at a time; the wall seconds they took."""
    async def run() -> float:
        gate = asyncio.Semaphore(concurrency)
        async with httpx.AsyncClient(base_url=url, timeout=600,
                                     limits=httpx.Limits(max_connections=concurrency)) as c:
            async def one() -> None:
                async with gate:
                    r = await c.post("/v1/completions", json=body)
                    r.raise_for_status()
            started = time.monotonic()
            await asyncio.gather(*(one() for _ in range(n)))
            return time.monotonic() - started
    return asyncio.run(run())


def serve_cases(a: argparse.Namespace) -> dict:
    """API-process CPU per request through real servers (see the module docstring)."""
    model = a.work / "model"
    if not (model / "config.json").exists():
        subprocess.run([sys.executable, "-m", "capsteer.cli", "demo-model", str(model),
                        "--num-layers", str(a.layers), "--hidden-size", str(a.hidden),
                        # narrow attention and MLP: the API path's cost depends on the
                        # layers and the stream's width only, and the engine stays quick
                        "--intermediate-size", "64", "--num-heads", "4",
                        "--num-kv-heads", "2", "--head-dim", "32"], check=True)
    prompt = list(range(20, 36))
    out: dict = {}
    for config in a.configs.split(","):
        port = free_port()
        work = a.work / config
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        cmd = [sys.executable, "-m", "capsteer.cli", "serve", str(model), "--dtype", "float32",
               "--max-model-len", "512", "--max-num-seqs", str(a.concurrency),
               "--kv-cache-memory-bytes", str(1 << 30), "--served-model-name", "demo",
               "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--vanilla"] if config == "vanilla" else [
            "--capture-dir", str(work / "captures"), "--steering-dir", str(work / "vectors")]
        server = ManagedServer(cmd, url=f"http://127.0.0.1:{port}", log_path=work / "log",
                               cwd=work)
        try:
            if config == "capsteer":
                buf = io.BytesIO()
                np.save(buf, np.random.default_rng(1).standard_normal(
                    (a.layers, a.hidden)).astype("<f4"))
                httpx.put(server.url + "/v1/steering/vectors/per-layer",
                          content=buf.getvalue(), timeout=60).raise_for_status()
            names = ("plain",) if config == "vanilla" else tuple(bodies(a.layers, a.hidden))
            base = {"model": "demo", "prompt": prompt, "max_tokens": 1, "temperature": 0}
            drive(server.url, base, a.concurrency, a.concurrency)  # warm-up
            for name in names:
                fields = {k: v for k, v in bodies(a.layers, a.hidden)[name].items()
                          if k not in ("model", "prompt", "max_tokens")}
                body = {**base, **fields}
                cpu = proc_cpu_s(server.proc.pid)
                wall = drive(server.url, body, a.requests, a.concurrency)
                used = proc_cpu_s(server.proc.pid) - cpu
                row = {"api_cpu_ms_per_request": round(used / a.requests * 1e3, 3),
                       "requests_per_s": round(a.requests / wall, 1)}
                out[f"{config}/{name}"] = row
                print(f"{config:8s} {name:13s} {row}", flush=True)
        finally:
            server.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=400)
    ap.add_argument("--in-flight", type=int, default=256)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--server", action="store_true", help="through real servers (CPU)")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--configs", default="vanilla,capsteer")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "api_cost")
    a = ap.parse_args()
    if a.server:
        result = serve_cases(a)
        if a.out:
            a.out.write_text(json.dumps(result, indent=1))
        return
    shape = ModelShape(a.layers, a.hidden, 4096, 2)
    settings = ServerSettings.model_construct()  # the defaults, no env or file
    out: dict = {"layers": a.layers, "hidden": a.hidden, "cases": {}}
    with tempfile.TemporaryDirectory() as tmp:
        registry = VectorRegistry(Path(tmp) / "vectors", hidden_size=a.hidden,
                                  num_layers=a.layers)
        buf = io.BytesIO()
        np.save(buf, np.random.default_rng(1).standard_normal((a.layers, a.hidden)).astype("<f4"))
        registry.put("per-layer", buf.getvalue())
        lookup = getattr(registry, "lookup_named", registry.lookup)
        tracker = CaptureTracker(Path(tmp) / "captures", 1 << 40)
        for name, body in bodies(a.layers, a.hidden).items():
            raw = json.dumps(body).encode()
            encoded: list[bytes] = []

            def capsteer(raw: bytes = raw) -> bytes:
                parsed, _ = parse_json(raw)
                parsed = lift_extra_body(parsed)
                if not any(k in parsed for k in ("capture", "steering", "extra_body")):
                    return raw  # the middleware passes a body without fields through
                hooks = parse_hook_fields(parsed, shape, lookup=lookup,
                                          default_layout=settings.capture_layout,
                                          capture_default=settings.capture_default)
                cid = "cap-" + "0" * 32 if hooks.capture is not None else None
                rid = response_id(parsed, "/v1/completions", None) if cid else None
                return json.dumps(rewrite_body(parsed, hooks, cid, time.time(), rid)).encode()
            encoded.append(capsteer())
            row = {"client_body_bytes": len(raw), "engine_body_bytes": len(encoded[0]),
                   "capsteer_us": round(per_call_us(capsteer, a.iters), 1),
                   "vllm_us": round(per_call_us(vllm_front(encoded[0]), a.iters), 1)}
            out["cases"][name] = row
            print(f"{name:13s} {row}", flush=True)
        share = poll_cpu_share(tracker, a.in_flight)
        out["poller_cpu_share"] = {str(a.in_flight): round(share, 4)}
        print(f"receipt poller, {a.in_flight} captures in flight: {share:.2%} of a core",
              flush=True)
    if a.out:
        a.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
