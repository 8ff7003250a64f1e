"""The compiled Triton tap kernel (JIT and direct launches) equals the torch reference on
CUDA, with `when` gates among its entries: tests/unit/tap_kernel_check.py's plan (steered,
gated, captured and plain rows), fp32 and bf16, deferred and materialized layouts. The
CPU suite runs the same plan in Triton's interpreter; this runs the compiled kernel."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

# The checkout's `tests` package, after the installed capsteer (appended, not prepended).
sys.path.append(str(Path(__file__).resolve().parents[2]))

from tests.unit.tap_kernel_check import run


def main() -> None:
    assert torch.cuda.is_available(), "needs a CUDA device"
    for dtype in (torch.float32, torch.bfloat16):
        for layout in ("deferred", "materialized"):
            run(dtype, layout, device="cuda")
            print(f"{dtype} {layout}: kernel == torch reference")
    print("ok")


if __name__ == "__main__":
    main()
