"""Host time of the worker's per-request and per-step hook work, without an engine.

A hooked request costs the engine's step thread host time in three places: when it
arrives (payload -> RequestHooks, a table slot), every step it is in (the plan and its
upload) and when it leaves (slot and entries released). On a small model at large
steps vLLM's step thread is the bottleneck, so this time adds to every batch. This
replays the prefill workload's schedule (256 x 512-token prompts, 8192-token steps,
64 generated tokens) through the same functions the worker calls, on the device the
model would use (device mode), and reports each part's host time: ms per batch and
us per call (arrive/leave: per request; plan: building the step's plan; upload: writing
it, with any new slot rows, to the device). No GPU time is measured (nothing waits for the device).

    python bench/hook_host_cost.py [--device cuda] [--kind steer_one] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from capsteer.capture.spec import parse_capture_spec
from capsteer.engine import build_payload
from capsteer.engine_ext.plan import RequestHooks, build_step_plan
from capsteer.engine_ext.runtime import HookRuntime
from capsteer.steering.spec import parse_steering_spec


def schedule(requests: int, prompt: int, gen: int, step_tokens: int):
    """vLLM's schedule of the workload: per step, (req_ids, query_start_loc,
    start_positions, new request ids, finished request ids). Decode rows first, then
    prompt chunks (chunked prefill fills the step's token budget)."""
    computed = {}  # req -> tokens computed
    waiting = list(range(requests))
    done: list[int] = []
    steps = []
    while waiting or computed:
        budget, rows, new = step_tokens, [], []
        for r in list(computed):
            if computed[r] >= prompt:  # decoding: one row
                rows.append((r, computed[r], 1))
                budget -= 1
        for r in [r for r in computed if computed[r] < prompt]:  # a chunked prompt goes on
            take = min(prompt - computed[r], budget)
            if take > 0:
                rows.append((r, computed[r], take))
                budget -= take
        while waiting and budget > 0:
            r = waiting.pop(0)
            take = min(prompt, budget)
            rows.append((r, 0, take))
            new.append(r)
            computed[r] = 0
            budget -= take
        qsl = np.zeros(len(rows) + 1, np.int32)
        qsl[1:] = np.cumsum([n for _, _, n in rows])
        starts = np.array([s for _, s, _ in rows], np.int32)
        for r, _, n in rows:
            computed[r] += n
        finished = [r for r, c in computed.items() if c >= prompt + gen - 1]
        for r in finished:
            del computed[r]
        steps.append(([f"r{r}" for r, _, _ in rows], qsl, starts, new, list(done)))
        done = finished
    return steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--kind", default="steer_one",
                    choices=["steer_one", "steer_all", "capture_one"])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--step-tokens", type=int, default=8192)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    layers, hidden = 28, 1024  # Qwen3-0.6B
    device = torch.device(a.device)
    runtime = HookRuntime(layers, hidden, torch.bfloat16, device, max_tokens=a.step_tokens,
                          max_entries=4096, max_requests=512, staging_rows=4 * a.step_tokens,
                          device_driven=True)
    vec = [0.01] * hidden
    steering = capture = None
    if a.kind.startswith("steer"):
        chosen = "all" if a.kind == "steer_all" else [layers // 2]
        steering = parse_steering_spec(
            {"vectors": [{"hook": "resid_post", "layers": chosen, "vector": vec}]},
            num_layers=layers, hidden_size=hidden)
    else:
        capture = parse_capture_spec({"hooks": ["resid_post"], "layers": [layers // 2],
                                      "positions": "prompt"}, num_layers=layers)
    steps = schedule(a.requests, a.prompt, a.gen, a.step_tokens)
    parts: dict[str, list[float]] = {"arrive": [], "plan": [], "upload": [], "leave": []}
    calls = {"arrive": 0, "plan": 0, "upload": 0, "leave": 0}
    for _ in range(a.repeat):
        live: dict[str, RequestHooks] = {}
        payloads = [build_payload(capture, steering, durable=capture is not None).extra_args
                    for _ in range(a.requests)]  # the front end's work, not the worker's
        took = dict.fromkeys(parts, 0.0)
        for req_ids, qsl, starts, new, finished in steps:
            t = time.perf_counter()
            for r in finished:
                if f"r{r}" in live:  # a closed capture left already
                    live.pop(f"r{r}").release(runtime)
            took["leave"] += time.perf_counter() - t
            t = time.perf_counter()
            for r in new:
                live[f"r{r}"] = RequestHooks.from_extra_args(
                    f"r{r}", payloads[r], a.prompt, runtime)
            took["arrive"] += time.perf_counter() - t
            t = time.perf_counter()
            plan = build_step_plan(req_ids, qsl, starts, live, None, host_steering=False,
                                   uniform_slots=runtime.uniform_slots)
            t1 = time.perf_counter()
            runtime.set_plan(plan, int(qsl[-1]))  # slot rows and the per-token index
            took["plan"] += t1 - t
            took["upload"] += time.perf_counter() - t1
            calls["plan"] += 1
            calls["upload"] += 1
            # The worker closes a prompt-only capture once its prompt is fed; a request
            # with nothing else to do is then a plain request (_close_complete_captures).
            for r, h in list(live.items()):
                if h.capture is not None and h.fed_len >= h.prompt_len and not h.entries:
                    live.pop(r).release(runtime)
        for r in list(live):
            live.pop(r).release(runtime)
        calls["arrive"] += a.requests
        calls["leave"] += a.requests
        if device.type == "cuda":
            torch.cuda.synchronize()
        for k in parts:
            parts[k].append(took[k])
    res = {"device": str(device), "kind": a.kind, "steps_per_batch": len(steps),
           "ms_per_batch": {k: round(1e3 * statistics.median(v), 3) for k, v in parts.items()},
           "us_per_call": {k: round(1e6 * sum(v) / calls[k], 2) for k, v in parts.items()}}
    print(json.dumps(res) if a.json else json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
