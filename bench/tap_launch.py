"""Host cost of the device-mode tap on a step that runs outside a CUDA graph (a large
prefill), per call: the op with no request at its site (returns at once), the op
launching the Triton kernel for a steered site, and the bare kernel launch. Steering
every layer pays the launch once per layer per eager step; this says how much of a
step's host time that is.

    python bench/tap_launch.py [--tokens 2048] [--hidden 1024] [--calls 2000]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from capsteer.engine_ext import runtime as rt_mod
from capsteer.engine_ext import tap_kernel
from capsteer.engine_ext.families import STREAM
from capsteer.engine_ext.runtime import HookRuntime, StepPlan, new_site_key


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
    op = torch.ops.capsteer.tap.default
    with torch.inference_mode():
        rt.plan = StepPlan(active_sites=frozenset())
        out["op_unused_site_us"] = per_call_us(lambda: op(x, r, key, 3), a.calls)
        rt.plan = StepPlan(active_sites=frozenset({site}))
        out["op_steered_site_us"] = per_call_us(lambda: op(x, r, key, 3), a.calls)
        out["kernel_launch_us"] = per_call_us(lambda: tap_kernel.tap(rt, x, r, site, 3), a.calls)
        x.zero_()
        op(x, r, key, 3)
        out["steered_value_ok"] = bool(torch.allclose(
            x.float(), torch.full_like(x, 0.01, dtype=torch.float32), atol=1e-3))
    rt_mod.install_runtime(None)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
