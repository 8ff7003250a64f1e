"""GPU time of the device-mode tap kernel over one forward's sites, kernel files side by side.

A decode step replays a CUDA graph holding one tap per site (57 on Qwen3-0.6B); each tap
covers a few hundred rows, so its time is launch and load latency, not bandwidth. The
2026-11-26 decode profile (h200-2026-11-26-profile-step8192) put the steered taps at
3.3 us a call, ~185 us of a ~4.4 ms step. This records the 57 taps of one step in a CUDA
graph for each scenario and each given kernel file (e.g. the current one and an older
one), replays it and reports GPU us a step, plus the host us a step of launching the same
taps eagerly (a large prefill runs outside graphs). Every kernel must produce the same
rows and copies as the first one on the same inputs (checked bitwise before timing).

    python bench/tap_kernel_time.py [--kernels new=engine_ext/tap_kernel.py,old=OLD/engine_ext/tap_kernel.py]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time

import numpy as np
import torch

from capsteer.capture.spec import parse_capture_spec
from capsteer.engine_ext.plan import RequestHooks, build_step_plan
from capsteer.engine_ext.runtime import HookRuntime
from capsteer.steering.spec import parse_steering_spec

LAYERS, HIDDEN = 28, 1024  # Qwen3-0.6B
SITES = 2 * LAYERS + 1


def load_kernel(name: str, path: str):
    spec = importlib.util.spec_from_file_location(f"tap_kernel_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def payload(kind: str, req: int) -> dict:
    vec = [0.01] * HIDDEN
    out: dict = {}
    if kind.startswith("steer"):
        layers = "all" if kind == "steer_all" else [LAYERS // 2]
        out["steering"] = parse_steering_spec(
            {"vectors": [{"hook": "resid_post", "layers": layers, "vector": vec}]},
            num_layers=LAYERS, hidden_size=HIDDEN).to_dict()
    if kind == "ablate_all":
        out["steering"] = parse_steering_spec(
            {"vectors": [{"hook": "resid_post", "layers": "all", "op": "ablate",
                          "vector": [1.0] + [0.0] * (HIDDEN - 1)}]},
            num_layers=LAYERS, hidden_size=HIDDEN).to_dict()
    if kind == "capture_one":
        out["capture"] = parse_capture_spec({"hooks": ["resid_post"], "layers": [LAYERS // 2],
                                             "positions": "all"}, num_layers=LAYERS).to_dict()
        out["capture_id"] = f"cap-{req}"
    return {"capsteer": out} if out else {}


def setup(kind: str, rows: int, per_req: int, device: torch.device) -> HookRuntime:
    """A runtime whose plan covers `rows` rows: requests of `per_req` rows each, all in
    the prompt (per_req > 1, a prefill) or all generating (per_req == 1, decode)."""
    rt = HookRuntime(LAYERS, HIDDEN, torch.bfloat16, device, max_tokens=rows,
                     max_requests=512, staging_rows=rows, device_driven=True)
    n_req = rows // per_req
    prompt = 512 if per_req > 1 else 128
    reqs = {}
    for r in range(n_req):
        hooks = RequestHooks.from_extra_args(f"r{r}", payload(kind, r), prompt, rt)
        if hooks is not None:
            reqs[f"r{r}"] = hooks
    qsl = np.arange(n_req + 1, dtype=np.int64) * per_req
    starts = np.zeros(n_req, np.int64) if per_req > 1 else np.full(n_req, prompt + 5)
    plan = build_step_plan([f"r{r}" for r in range(n_req)], qsl, starts, reqs, None,
                           host_steering=False)
    if device.type == "cuda":  # the step's index writes must not wait for the device
        torch.cuda.set_sync_debug_mode("error")
    try:
        rt.set_plan(plan, rows)
    finally:
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    # The per-row indices the device built, against the per-row answer.
    want_slot = np.zeros(rows, np.int64)
    want_gen = np.zeros(rows, np.int64)
    for r in range(n_req):
        hooks = reqs.get(f"r{r}")
        if hooks is not None:
            at = np.arange(qsl[r], qsl[r + 1])
            want_slot[at] = hooks.slot
            want_gen[at] = starts[r] + at - qsl[r] >= hooks.prompt_len
    hooked = want_slot != 0
    rt.expansion_ok = bool(np.array_equal(rt.tok_slot[:rows].cpu().numpy(), want_slot)
                           and np.array_equal(rt.tok_gen[:rows].cpu().numpy()[hooked],
                                              want_gen[hooked]))
    return rt


def one_step(mod, rt: HookRuntime, x: torch.Tensor, res: torch.Tensor) -> None:
    for site in range(SITES):
        mod.tap(rt, x, None if site == 0 else res, site, 3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", default="current=engine_ext/tap_kernel.py")
    ap.add_argument("--scenarios", default="plain,steer_one,steer_all,ablate_all,capture_one")
    ap.add_argument("--shapes", default="decode:256x1,prefill:8192x512")
    ap.add_argument("--replays", type=int, default=300)
    ap.add_argument("--eager-steps", type=int, default=200)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run (TRITON_INTERPRET=1), "
                    "equality only")
    a = ap.parse_args()
    device = torch.device(a.device)
    kernels = [(n, load_kernel(n, p)) for n, p in (kv.split("=", 1) for kv in a.kernels.split(","))]
    out = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
           "torch": torch.__version__,
           "kernels": a.kernels, "results": []}
    for shape in a.shapes.split(","):
        label, dims = shape.split(":")
        rows, per_req = (int(v) for v in dims.split("x"))
        gen = torch.Generator(device="cpu").manual_seed(0)
        x0 = torch.randn(rows, HIDDEN, generator=gen).to(torch.bfloat16).to(device)
        res = torch.randn(rows, HIDDEN, generator=gen).to(torch.bfloat16).to(device)
        for kind in a.scenarios.split(","):
            first = None
            for name, mod in kernels:
                rt = setup(kind, rows, per_req, device)
                x = x0.clone()
                one_step(mod, rt, x, res)  # compiles, then caches the direct launcher
                if device.type == "cuda":
                    torch.cuda.synchronize()
                got = (x.clone(), rt.staging[: rt.plan.staging_rows].clone())
                if first is None:
                    first = got
                same = all(torch.equal(g, f) for g, f in zip(got, first, strict=True))
                if device.type != "cuda":
                    row = {"shape": label, "scenario": kind, "kernel": name, "same_as_first": same,
                           "expansion_ok": rt.expansion_ok}
                    out["results"].append(row)
                    print(json.dumps(row), flush=True)
                    continue
                # GPU time: the step's taps in one CUDA graph, replayed.
                x.copy_(x0)
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    one_step(mod, rt, x, res)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    one_step(mod, rt, x, res)
                for _ in range(20):
                    graph.replay()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                start.record()
                for _ in range(a.replays):
                    graph.replay()
                end.record()
                torch.cuda.synchronize()
                gpu_us = start.elapsed_time(end) * 1e3 / a.replays
                # Host time: the same taps launched eagerly (a prefill step outside graphs).
                best = float("inf")
                for _ in range(3):
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    for _ in range(a.eager_steps):
                        one_step(mod, rt, x, res)
                    best = min(best, (time.perf_counter() - t) / a.eager_steps * 1e6)
                torch.cuda.synchronize()
                row = {"shape": label, "rows": rows, "scenario": kind, "kernel": name,
                       "gpu_us_per_step": round(gpu_us, 2),
                       "gpu_us_per_tap": round(gpu_us / SITES, 3),
                       "host_us_per_step_eager": round(best, 1), "same_as_first": same,
                       "expansion_ok": rt.expansion_ok}
                out["results"].append(row)
                print(json.dumps(row), flush=True)
                del graph
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
