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

    python bench/api_cost.py [--iters 400] [--out /tmp/api_cost.json]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from capsteer.config.server import ServerSettings
from capsteer.server.fields import (
    ModelShape,
    lift_extra_body,
    parse_hook_fields,
    response_id,
    rewrite_body,
)
from capsteer.server.middleware import parse_json
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
    from capsteer.capture.spec import parse_capture_spec

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=400)
    ap.add_argument("--in-flight", type=int, default=256)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
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
