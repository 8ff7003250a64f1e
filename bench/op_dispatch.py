"""Host cost of one `capsteer::tap` call, the way a step outside a CUDA graph pays it
(once per site): capsteer's dispatcher-registered op against the same schema registered
through `torch.library.custom_op` (what capsteer used before), with no runtime installed
(the op returns at once), so the figure is dispatch alone.

    python bench/op_dispatch.py [--calls 20000] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from capsteer.engine_ext.runtime import new_site_key  # (importing registers capsteer::tap)


@torch.library.custom_op("capsteer_bench::tap", mutates_args=("x",))
def _custom_op_tap(x: torch.Tensor, residual: torch.Tensor | None, key: torch.Tensor,
                   kinds: int) -> None:
    return None


def per_call_us(op, x: torch.Tensor, residual: torch.Tensor, calls: int) -> float:
    key = new_site_key(3, x.device)
    for _ in range(1000):
        op(x, residual, key, 3)
    best = float("inf")
    for _ in range(5):  # best of 5: the floor, not the noise of a shared machine
        start = time.perf_counter()
        for _ in range(calls):
            op(x, residual, key, 3)
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    x = torch.zeros(2048, 1024, device=args.device)
    residual = torch.zeros_like(x)
    out = {"device": args.device, "torch": torch.__version__}
    with torch.inference_mode():
        out["capsteer_tap_us"] = per_call_us(torch.ops.capsteer.tap.default, x, residual,
                                             args.calls)
        out["custom_op_tap_us"] = per_call_us(torch.ops.capsteer_bench.tap.default, x,
                                              residual, args.calls)
    out["ratio"] = out["custom_op_tap_us"] / out["capsteer_tap_us"]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
