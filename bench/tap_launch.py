"""Host cost of the device-mode tap on a step that runs outside a CUDA graph (a large
prefill), per call: the op with no request at its site (returns at once), the op
launching the Triton kernel for a steered site, and the bare kernel launch, both through
Triton's JIT and through the compiled kernel's launcher (tap_kernel's direct path).
Steering every layer pays the launch once per layer per eager step; this says how much
of a step's host time that is. Before timing, it checks that the direct launch writes
exactly what the JIT launch writes, and what the torch reference writes, for one mixed
plan (steered, captured and plain rows) over every site.

    python bench/tap_launch.py [--tokens 2048] [--hidden 1024] [--calls 2000]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from capsteer.capture.spec import parse_capture_spec
from capsteer.engine_ext import runtime as rt_mod
from capsteer.engine_ext import tap_kernel
from capsteer.engine_ext.families import STREAM
from capsteer.engine_ext.plan import RequestHooks, build_step_plan
from capsteer.engine_ext.runtime import HookRuntime, StepPlan, new_site_key
from capsteer.steering.spec import parse_steering_spec


def per_call_us(fn, calls: int) -> float:
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return best


def check_direct(layers: int, hidden: int, tokens: int) -> dict:
    """Direct launch == JIT launch (bitwise) ~= torch reference, x and staging, every site."""
    dev = torch.device("cuda")
    vec = torch.linspace(-1, 1, hidden).tolist()

    def hooks(rt, req_id, prompt_len, capture=None, steering=None):
        extra = {"capsteer": {}}
        if capture is not None:
            extra["capsteer"]["capture"] = parse_capture_spec(capture, num_layers=layers).to_dict()
            extra["capsteer"]["capture_id"] = "cap-" + req_id
        if steering is not None:
            extra["capsteer"]["steering"] = parse_steering_spec(
                steering, num_layers=layers, hidden_size=hidden).to_dict()
        return RequestHooks.from_extra_args(req_id, extra, prompt_len, rt)

    results = {}
    n = min(tokens, 512)
    quarter = n // 4
    for mode in ("direct", "jit", "torch"):
        rt = HookRuntime(layers, hidden, torch.bfloat16, dev, max_tokens=n,
                         staging_rows=n * (2 * layers + 2), device_driven=True)
        rt.tap_direct = mode == "direct"
        reqs = {
            "a": hooks(rt, "a", quarter, capture={"hooks": ["resid_mid", "attn_out"],
                                                  "positions": "all"},
                       steering={"vectors": [{"hook": "resid_post", "layers": "all",
                                              "vector": vec, "scale": 0.5}]}),
            "b": hooks(rt, "b", quarter, steering={"vectors": [
                {"hook": "attn_out", "layer": 1, "vector": vec, "op": "clamp", "value": 2.0}]}),
            "c": hooks(rt, "c", quarter, capture={"hooks": ["resid_pre", "resid_post"],
                                                  "layers": "all"}),
        }
        starts = np.array([0, quarter, 2 * quarter, 3 * quarter, n])
        plan = build_step_plan(["a", "plain", "b", "c"], starts, np.zeros(4, np.int64), reqs,
                               None, host_steering=False)
        rt.set_plan(plan, n)
        gen = torch.Generator(device=dev).manual_seed(1)
        x = torch.randn(n, hidden, generator=gen, device=dev).to(torch.bfloat16)
        res = torch.randn(n, hidden, generator=gen, device=dev).to(torch.bfloat16)
        res32 = res.float()  # Inductor hands some sites an fp32 copy of the residual
        for _ in range(2):  # the second pass runs on launchers the first one cached
            for site in range(2 * layers + 1):
                r = None if site == 0 else res if site % 3 else res32
                for kinds in ((1, 2) if site % 5 == 0 else (3,)):
                    if mode == "torch":
                        rt._tap_dense_torch(x, r, site, kinds)
                    else:
                        tap_kernel.tap(rt, x, r, site, kinds)
        torch.cuda.synchronize()
        results[mode] = (x.float().cpu(), rt.staging[: plan.staging_rows].float().cpu(),
                         len(rt.tap_launchers))
    d, j, t = results["direct"], results["jit"], results["torch"]
    return {"direct_equals_jit": bool(torch.equal(d[0], j[0]) and torch.equal(d[1], j[1])),
            "direct_vs_torch_max_abs": max(float((d[0] - t[0]).abs().max()),
                                           float((d[1] - t[1]).abs().max())),
            "captured_rows": int(d[1].shape[0]), "direct_launchers_cached": d[2],
            "jit_launchers_cached": j[2]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--calls", type=int, default=2000)
    a = ap.parse_args()
    dev = torch.device("cuda")
    rt = HookRuntime(a.layers, a.hidden, torch.bfloat16, dev, max_tokens=a.tokens,
                     staging_rows=16, device_driven=True)
    entry = rt.alloc_entry(torch.zeros(a.hidden), 0.0, torch.full((a.hidden,), 0.01))
    site = 5
    rt.slot_entry[1, :, STREAM, site] = entry
    rt.tok_slot[: a.tokens] = 1
    x = torch.zeros(a.tokens, a.hidden, dtype=torch.bfloat16, device=dev)
    r = torch.zeros_like(x)
    key = new_site_key(site, dev)
    rt_mod.install_runtime(rt)
    out: dict = {"torch": torch.__version__, "tokens": a.tokens, "hidden": a.hidden,
                 "device": torch.cuda.get_device_name()}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        pass
    out["direct_supported"] = tap_kernel.direct_launch_supported()
    with torch.inference_mode():
        out["check"] = check_direct(a.layers, a.hidden, a.tokens)
    op = torch.ops.capsteer.tap.default
    with torch.inference_mode():
        rt.plan = StepPlan(active_sites=frozenset())
        out["op_unused_site_us"] = per_call_us(lambda: op(x, r, key, 3), a.calls)
        rt.plan = StepPlan(active_sites=frozenset({site}))
        out["op_steered_site_us"] = per_call_us(lambda: op(x, r, key, 3), a.calls)
        out["kernel_launch_us"] = per_call_us(lambda: tap_kernel.tap(rt, x, r, site, 3), a.calls)
        direct, rt.tap_direct = rt.tap_direct, False
        rt.tap_launchers.clear()
        out["op_steered_site_jit_us"] = per_call_us(lambda: op(x, r, key, 3), a.calls)
        out["kernel_launch_jit_us"] = per_call_us(lambda: tap_kernel.tap(rt, x, r, site, 3),
                                                  a.calls)
        rt.tap_direct = direct
        x.zero_()
        op(x, r, key, 3)
        out["steered_value_ok"] = bool(torch.allclose(
            x.float(), torch.full_like(x, 0.01, dtype=torch.float32), atol=1e-3))
    rt_mod.install_runtime(None)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
