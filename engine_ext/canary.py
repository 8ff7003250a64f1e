"""Start-up canary: prove the hooks fire in the compiled model, or refuse to start.

Two dummy forwards through the real (compiled, graph-captured) model, capturing
every row at every site:
- every site is reached, and every captured value is finite;
- the stream identities hold: resid_mid = resid_pre + attn_out and
  resid_post = resid_mid + mlp_out (captures are copies, not views that a fused
  in-place kernel changed afterwards);
- resid_pre(0) equals the embedding of the input ids computed eagerly;
- steering adds exactly its vector at its site and changes what follows.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from capsteer.capture.spec import parse_capture_spec
from capsteer.engine_ext import adapter
from capsteer.engine_ext.plan import EXTRA_ARGS_KEY, RequestHooks, build_step_plan
from capsteer.engine_ext.runtime import STREAM, SUB, StepPlan
from capsteer.hooks import HOOKS
from capsteer.steering.spec import parse_steering_spec

CANARY_TOKENS = 8
FAULT_ENV = "CAPSTEER_FAULT_INJECT"  # "skip_site:N": tests prove the canary refuses


def faulty_site() -> int | None:
    """A site left unhooked on purpose (fault injection for the canary's own test)."""
    fault = os.environ.get(FAULT_ENV, "")
    return int(fault.split(":", 1)[1]) if fault.startswith("skip_site:") else None


class CanaryFailed(RuntimeError):
    """The hooks do not do what they claim; the engine must not start."""


def _tolerance(dtype: torch.dtype) -> float:
    """Relative (norm) tolerance: bf16/fp16 round every stored stream value."""
    return 1e-4 if dtype == torch.float32 else 2e-2


def _canary_request(runtime, steer: torch.Tensor | None) -> RequestHooks:
    """A synthetic request capturing every hook at every layer and position."""
    payload = {"capture": parse_capture_spec(
        {"hooks": list(HOOKS), "layers": "all", "positions": "all"},
        num_layers=runtime.num_layers).to_dict(), "capture_id": "cap-canary"}
    if steer is not None:
        payload["steering"] = parse_steering_spec(
            {"vectors": [{"hook": "resid_pre", "layer": 1, "vector": steer.tolist()}]},
            num_layers=runtime.num_layers, hidden_size=runtime.hidden_size).to_dict()
    hooks = RequestHooks.from_extra_args("_capsteer_canary", {EXTRA_ARGS_KEY: payload},
                                         CANARY_TOKENS, runtime)
    assert hooks is not None
    return hooks


def _forward(hooks, steer: torch.Tensor | None = None) -> dict[tuple[int, int], torch.Tensor]:
    """One dummy forward through the real step path; captured rows per (kind, site)."""
    runtime, n = hooks.runtime, CANARY_TOKENS
    request = _canary_request(runtime, steer)
    try:
        plan = build_step_plan([request.req_id], np.array([0, n]), np.array([0]),
                               {request.req_id: request}, None)
        if runtime.device_driven:
            runtime.staging.fill_(float("nan"))
        runtime.set_plan(plan, n)
        hooks.pinned_plan = True
        try:
            adapter.dummy_forward(hooks.worker.model_runner, n)
        finally:
            hooks.pinned_plan = False
        fired = list(runtime.fired)
        if runtime.device_driven:
            host = runtime.staging[: plan.staging_rows].float().cpu()
            captured = {p: host[off: off + n] for p, off in plan.staging_offset.items()}
            runtime.reset_dense()
        else:
            captured = {p: v.float().cpu() for p, v in runtime.take_captured().items()}
            runtime.set_plan(StepPlan(), 0)
    finally:
        request.release(runtime)
    if not runtime.device_driven:
        missing = [s for s, count in enumerate(fired) if count == 0]
        if missing:
            raise CanaryFailed(f"hook op never ran at site(s) {missing}")
    return captured


def run_canary(hooks) -> None:
    """Raise CanaryFailed with the reason when any check fails."""
    runtime = hooks.runtime
    num_sites, n = runtime.num_sites, CANARY_TOKENS
    tol = _tolerance(runtime.dtype)
    base = _forward(hooks)
    for key, value in base.items():
        if value.shape[0] != n or not torch.isfinite(value).all():
            raise CanaryFailed(f"site {key[1]} ({'stream' if key[0] else 'sublayer'}) "
                               "captured nothing or non-finite values")

    def close(a: torch.Tensor, b: torch.Tensor) -> bool:
        return float((a - b).norm()) <= tol * max(float(b.norm()), 1e-6)

    for layer in range(runtime.num_layers):
        pre, mid, post = (base[(STREAM, 2 * layer + i)] for i in range(3))
        if not close(mid, pre + base[(SUB, 2 * layer + 1)]):
            raise CanaryFailed(f"layer {layer}: resid_mid != resid_pre + attn_out")
        if not close(post, mid + base[(SUB, 2 * layer + 2)]):
            raise CanaryFailed(f"layer {layer}: resid_post != resid_mid + mlp_out")
    embedded = adapter.eager_embedding(hooks.worker.model_runner, n).float().cpu()
    if not close(base[(STREAM, 0)], embedded):
        raise CanaryFailed("resid_pre(0) differs from the eagerly computed embedding")

    # Scaled well above the stream so low-precision rounding cannot hide or fake it.
    scale = 8.0 * float(base[(STREAM, 2)].abs().mean()) + 1.0
    vec = torch.linspace(-1.0, 1.0, runtime.hidden_size) * scale
    steered = _forward(hooks, steer=vec)
    # Within one forward (dummy batches may differ between runs): the stream entering
    # layer 1 is what layer 0 produced plus exactly the steering vector.
    produced = steered[(STREAM, 1)] + steered[(SUB, 2)]
    want = vec.to(runtime.dtype).float().expand(n, -1)
    added = steered[(STREAM, 2)] - produced
    if not close(added, want):
        raise CanaryFailed(
            "steering at resid_pre(1) did not add its vector "
            f"(added norm {float(added.norm()):.4g}, vector norm {float(want.norm()):.4g}, "
            f"max error {float((added - want).abs().max()):.4g}, "
            f"stream max {float(steered[(STREAM, 2)].abs().max()):.4g})")
    if close(steered[(STREAM, num_sites - 1)], base[(STREAM, num_sites - 1)]):
        raise CanaryFailed("steering at resid_pre(1) did not change the final stream")
