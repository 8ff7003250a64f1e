"""Run under TRITON_INTERPRET=1 (see test_tap_kernel.py): the Triton tap kernel against
the torch reference on one mixed plan (steered, captured, plain rows; bf16 and fp32)."""

from __future__ import annotations

import sys

import numpy as np
import torch

from capsteer.engine_ext import tap_kernel
from capsteer.engine_ext.plan import build_step_plan
from capsteer.engine_ext.runtime import HookRuntime
from tests.unit.test_plan import HIDDEN, LAYERS, hooks_for


def run(dtype: torch.dtype) -> None:
    results = []
    for use_kernel in (True, False):
        rt = HookRuntime(LAYERS, HIDDEN, dtype, torch.device("cpu"), max_tokens=64, staging_rows=256,
                         device_driven=True)
        reqs = {
            "a": hooks_for("a", 3, rt=rt, capture={"hooks": ["resid_mid", "attn_out"],
                                                   "positions": "all"},
                           steering={"vectors": [{"hook": "attn_out", "layer": 1,
                                                  "vector": [0.3] * HIDDEN, "scale": 2.0}]}),
            "b": hooks_for("b", 2, rt=rt, steering={"vectors": [
                {"hook": "resid_mid", "layer": 1, "vector": [1.0] + [0.0] * (HIDDEN - 1),
                 "op": "clamp", "value": 4.0}]}),
            "c": hooks_for("c", 4, rt=rt, capture={"hooks": ["resid_pre", "resid_post"],
                                                   "layers": "all"}),
        }
        plan = build_step_plan(["a", "plain", "b", "c"], np.array([0, 3, 5, 9, 12]),
                               np.array([2, 0, 0, 1]), reqs, None, host_steering=False)
        rt.set_plan(plan, 13)
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(13, HIDDEN, generator=gen).to(dtype)
        res = torch.randn(13, HIDDEN, generator=gen).to(dtype)
        for site in range(2 * LAYERS + 1):
            r = None if site == 0 else res
            if use_kernel:
                tap_kernel.tap(rt, x, r, site)
            else:
                rt._tap_dense_torch(x, r, site)
        results.append((x.clone(), rt.staging[: plan.staging_rows].clone()))
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(results[0][0], results[1][0], **tol)
    torch.testing.assert_close(results[0][1], results[1][1], **tol)
    assert results[0][1].abs().sum() > 0


if __name__ == "__main__":
    assert tap_kernel.triton is not None
    for dt in (torch.float32, torch.bfloat16):
        run(dt)
    print("ok")
    sys.exit(0)
