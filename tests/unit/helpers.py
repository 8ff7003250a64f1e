"""Request builders shared by the planner tests and the tap-kernel check (which runs as its
own process, so they cannot live in a test module)."""

from __future__ import annotations

import torch

from capsteer.capture.spec import parse_capture_spec
from capsteer.engine_ext.plan import RequestHooks
from capsteer.engine_ext.runtime import HookRuntime
from capsteer.steering.patches import PatchSource
from capsteer.steering.readers.kinds import LinearProbe
from capsteer.steering.spec import parse_steering_spec

HIDDEN, LAYERS = 8, 3


def runtime() -> HookRuntime:
    return HookRuntime(LAYERS, HIDDEN, torch.float32, torch.device("cpu"), max_tokens=64)


def probe_readers(seed: int = 0, outputs: int = 2, activation: str = "none"):
    """A reader getter holding one random linear probe, "probe" (for `when` gates)."""
    gen = torch.Generator().manual_seed(seed)
    probe = LinearProbe(torch.randn(outputs, HIDDEN, generator=gen),
                        torch.randn(outputs, generator=gen) * 0.1, activation)
    return {"probe": probe}.__getitem__


def patch_source(seed: int = 0):
    """A patch getter holding one capture, "cap-src": resid_post, resid_pre and mlp_out at
    every layer, positions 0-15, random rows."""
    gen = torch.Generator().manual_seed(seed)
    rows = {(hook, layer): torch.randn(16, HIDDEN, generator=gen)
            for hook in ("resid_post", "resid_pre", "mlp_out") for layer in range(LAYERS)}

    def get(capture_id: str) -> PatchSource:
        if capture_id != "cap-src":
            raise KeyError(capture_id)
        return PatchSource.of_tensors(capture_id, "demo", range(16), rows)
    get.rows = rows
    return get


def hooks_for(req_id, prompt_len, capture=None, steering=None, rt=None, readers=None,
              patches=None, widths=None):
    extra = {"capsteer": {}}
    if capture is not None:
        extra["capsteer"]["capture"] = parse_capture_spec(capture, num_layers=LAYERS).to_dict()
        extra["capsteer"]["capture_id"] = "cap-" + req_id
    if steering is not None:
        extra["capsteer"]["steering"] = parse_steering_spec(
            steering, num_layers=LAYERS, hidden_size=HIDDEN, readers=readers,
            widths=widths, patches=patches).to_dict()
    return RequestHooks.from_extra_args(req_id, extra, prompt_len, rt or runtime())
