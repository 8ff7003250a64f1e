"""Start-up canary: prove the hooks fire in the compiled model, or refuse to start.

Two dummy forwards through the real (compiled, graph-captured) model, capturing
every row at every site:
- every site is reached, and every captured value is finite;
- the stream identities hold: resid_mid = resid_pre + attn_out and
  resid_post = resid_mid + mlp_out (captures are copies, not views that a fused
  in-place kernel changed afterwards); in a parallel block, which has no resid_mid,
  resid_post = resid_pre + attn_out + mlp_out;
- resid_pre(0) equals the embedding of the input ids computed eagerly (plus the
  learned position embedding where the family has one);
- steering adds exactly its vector at its site and changes what follows.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from capsteer.capture.spec import parse_capture_spec
from capsteer.config import errors
from capsteer.engine_ext.payload import EXTRA_ARGS_KEY
from capsteer.engine_ext.plan import RequestHooks, build_step_plan
from capsteer.engine_ext.runtime import STREAM, SUB, StepPlan
from capsteer.engine_ext.vllm.worker_access import dummy_forward, eager_embedding
from capsteer.hooks import HOOKS
from capsteer.steering.spec import parse_steering_spec

CANARY_TOKENS = 8
FAULT_ENV = "CAPSTEER_FAULT_INJECT"  # "skip_site:N": tests prove the canary refuses


def faulty_site() -> int | None:
    """A site left unhooked on purpose (fault injection for the canary's own test)."""
    fault = os.environ.get(FAULT_ENV, "")
    return int(fault.split(":", 1)[1]) if fault.startswith("skip_site:") else None


class CanaryFailed(errors.Unsupported, RuntimeError):
    """The hooks do not do what they claim; the engine must not start."""


def _tolerance(dtype: torch.dtype) -> float:
    """Relative (norm) tolerance: bf16/fp16 round every stored stream value."""
    return 1e-4 if dtype == torch.float32 else 2e-2


def _stream_hook(site: int) -> tuple[str, int]:
    """The hook whose value is the stream entering `site` (site >= 1)."""
    return ("resid_pre", site // 2) if site % 2 == 0 else ("resid_mid", site // 2)


def _canary_request(runtime, steer: torch.Tensor | None, steer_site: int,
                    unavailable: frozenset[str] = frozenset()) -> RequestHooks:
    """A synthetic request capturing every hook the model has at every layer and
    position (this worker copies those at its own sites)."""
    payload = {"capture": parse_capture_spec(
        {"hooks": [h for h in HOOKS if h not in unavailable], "layers": "all",
         "positions": "all"},
        num_layers=runtime.num_layers).to_dict(), "capture_id": "cap-canary"}
    if steer is not None:
        hook, layer = _stream_hook(steer_site)
        payload["steering"] = parse_steering_spec(
            {"vectors": [{"hook": hook, "layer": layer, "vector": steer.tolist()}]},
            num_layers=runtime.num_layers, hidden_size=runtime.hidden_size).to_dict()
    hooks = RequestHooks.from_extra_args("_capsteer_canary", {EXTRA_ARGS_KEY: payload},
                                         CANARY_TOKENS, runtime)
    assert hooks is not None
    return hooks


def _forward(hooks, steer: torch.Tensor | None = None,
             steer_site: int = 2) -> dict[tuple[int, int], torch.Tensor]:
    """One dummy forward through the real step path; captured rows per (kind, site)."""
    runtime, n = hooks.runtime, CANARY_TOKENS
    request = _canary_request(runtime, steer, steer_site,
                              frozenset(h for h, _ in hooks.sites.unavailable))
    try:
        plan = build_step_plan([request.req_id], np.array([0, n]), np.array([0]),
                               {request.req_id: request}, None)
        if runtime.device_driven:
            runtime.staging.fill_(float("nan"))
        runtime.set_plan(plan, n)
        hooks.pinned_plan = True
        try:
            dummy_forward(hooks.worker.model_runner, n)
        finally:
            hooks.pinned_plan = False
        fired = list(runtime.fired)
        if runtime.device_driven:
            host = runtime.staging[: plan.staging_rows].float().cpu()
            captured = {p: host[off: off + n, :runtime.site_widths[p[1]]]
                        for p, off in plan.staging_offset.items()}
            runtime.reset_dense()
        else:
            captured = {p: v.float().cpu() for p, v in runtime.take_captured().items()}
            runtime.set_plan(StepPlan(), 0)
    finally:
        request.release(runtime)
    if not runtime.device_driven:
        missing = [s for s, count in enumerate(fired) if count == 0 and s in runtime.local_sites]
        if missing:
            raise CanaryFailed(f"hook op never ran at site(s) {missing}")
    absent = sorted(set(plan.capture or plan.staging_offset) - set(captured))
    if absent:
        raise CanaryFailed(f"no value captured at (kind, site) {absent}")
    return captured


def _steer_site(local: list[int], parallel: bool = False, stream_only: bool = False) -> int:
    """A stream site whose previous site is local too (so the added vector is measurable
    on this worker), with a later local site when there is one (so its effect is). A
    parallel block has a stream at even sites only, each produced from the one before
    the previous; a stream-only model has even sites only."""
    if stream_only:
        pairs = [t for t in local if t >= 2 and t % 2 == 0 and t - 2 in local]
    elif parallel:
        pairs = [t for t in local if t >= 2 and t % 2 == 0 and {t - 2, t - 1} <= set(local)]
    else:
        pairs = [t for t in local if t >= 1 and t - 1 in local]
    later = [t for t in pairs if t < local[-1]]
    if not pairs:
        raise CanaryFailed(f"this worker's sites {local} leave no stream site to check "
                           "steering at (a pipeline stage needs at least one whole layer)")
    return 2 if 2 in later else (later or pairs)[0]


def _check_identities(captured: dict, local: frozenset[int], num_layers: int, close,
                      steered_site: int | None = None, multiplier: float = 1.0,
                      parallel: bool = False) -> None:
    """resid_mid = resid_pre + m attn_out and resid_post = resid_mid + m mlp_out (m is the
    family's residual multiplier, 1 but for Granite), wherever this worker holds every site
    involved (except where steering adds to the stream); a parallel block's
    resid_post = resid_pre + attn_out + mlp_out."""
    m = "" if multiplier == 1.0 else f"{multiplier:g} * "
    for layer in range(num_layers):
        a, b, c = 2 * layer, 2 * layer + 1, 2 * layer + 2
        if parallel:
            if {a, b, c} <= local and c != steered_site and not close(
                    captured[(STREAM, c)],
                    captured[(STREAM, a)] + captured[(SUB, b)] + captured[(SUB, c)]):
                raise CanaryFailed(f"layer {layer}: resid_post != resid_pre + attn_out + mlp_out")
            continue
        if {a, b} <= local and b != steered_site and not close(
                captured[(STREAM, b)], captured[(STREAM, a)] + multiplier * captured[(SUB, b)]):
            raise CanaryFailed(f"layer {layer}: resid_mid != resid_pre + {m}attn_out")
        if {b, c} <= local and c != steered_site and not close(
                captured[(STREAM, c)], captured[(STREAM, b)] + multiplier * captured[(SUB, c)]):
            raise CanaryFailed(f"layer {layer}: resid_post != resid_mid + {m}mlp_out")


def run_canary(hooks) -> None:
    """Raise CanaryFailed with the reason when any check fails.

    Under pipeline parallelism each stage checks its own sites: a later stage's dummy
    forward starts from vLLM's placeholder input, so its stream checks are repeated on
    the steered forward, whose stream is non-zero from the steered site on."""
    runtime = hooks.runtime
    n = CANARY_TOKENS
    # The stream's sites (inner sites, mlp_in's, are only checked to fire and be finite).
    local = sorted(s for s in runtime.local_sites if s <= 2 * runtime.num_layers)
    tol = _tolerance(runtime.dtype)
    sites = hooks.sites
    parallel = sites.parallel
    stream_only = any(hook == "attn_out" for hook, _ in sites.unavailable)
    site = _steer_site(local, parallel, stream_only)
    base = _forward(hooks, steer_site=site)
    for key, value in base.items():
        if value.shape[0] != n or not torch.isfinite(value).all():
            raise CanaryFailed(f"site {key[1]} ({'stream' if key[0] else 'sublayer'}) "
                               "captured nothing or non-finite values")

    def close(a: torch.Tensor, b: torch.Tensor) -> bool:
        return float((a - b).norm()) <= tol * max(float(b.norm()), 1e-6)

    mult = sites.residual_multiplier
    if not stream_only:  # a stream-only model has no sublayer values to add up
        _check_identities(base, runtime.local_sites, runtime.num_layers, close,
                          multiplier=mult, parallel=parallel)
    if 0 in runtime.local_sites:
        embedded = eager_embedding(hooks.worker.model_runner, n, sites.embedding_multiplier,
                                   sites.position_embedding).float().cpu()
        if not close(base[(STREAM, 0)], embedded):
            raise CanaryFailed("resid_pre(0) differs from the eagerly computed embedding")

    # Scaled well above the stream so low-precision rounding cannot hide or fake it.
    scale = 8.0 * float(base[(STREAM, site)].abs().mean()) + 1.0
    vec = torch.linspace(-1.0, 1.0, runtime.hidden_size) * scale
    steered = _forward(hooks, steer=vec, steer_site=site)
    if not stream_only:
        _check_identities(steered, runtime.local_sites, runtime.num_layers, close,
                          steered_site=site, multiplier=mult, parallel=parallel)
    # Within one forward (dummy batches may differ between runs): the stream entering
    # the site is what came before plus exactly the steering vector. A stream-only model
    # has no sublayer values to rebuild it from: the unsteered forward gives it, where
    # both forwards saw the same input.
    if stream_only:
        if not close(steered[(STREAM, site - 2)], base[(STREAM, site - 2)]):
            raise CanaryFailed("the two canary forwards saw different inputs; steering "
                               "cannot be checked on this stream-only model")
        produced = base[(STREAM, site)]
    elif parallel:
        produced = steered[(STREAM, site - 2)] + steered[(SUB, site - 1)] + steered[(SUB, site)]
    else:
        produced = steered[(STREAM, site - 1)] + mult * steered[(SUB, site)]
    want = vec.to(runtime.dtype).float().expand(n, -1)
    added = steered[(STREAM, site)] - produced
    hook, layer = _stream_hook(site)
    if not close(added, want):
        raise CanaryFailed(
            f"steering at {hook}({layer}) did not add its vector "
            f"(added norm {float(added.norm()):.4g}, vector norm {float(want.norm()):.4g}, "
            f"max error {float((added - want).abs().max()):.4g}, "
            f"stream max {float(steered[(STREAM, site)].abs().max()):.4g})")
    last = local[-1]
    if last > site and close(steered[(STREAM, last)], base[(STREAM, last)]):
        raise CanaryFailed(f"steering at {hook}({layer}) did not change the stream at site {last}")
