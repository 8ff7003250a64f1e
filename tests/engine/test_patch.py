"""Activation patching (`op: patch`, api.md §7) equals an HF forward hook that replaces the
value at those positions with the captured values: greedy tokens, top-5 and
teacher-forced log-probs; plain requests in the same batch are unchanged."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from capsteer.engine import Request
from capsteer.reference import hf_greedy, hf_patched
from capsteer.steering.patches import PatchSource

from .helpers import (
    MAX_TOKENS,
    assert_logprobs_match,
    assert_teacher_forced_match,
    assert_unsteered_like_hf,
    capsteer_engine,
    greedy,
    token_prompt,
)

pytestmark = pytest.mark.engine


def sources_of(result):
    """The in-process engine's patch sources: this one in-memory capture."""
    def get(capture_id: str) -> PatchSource:
        if capture_id != result.capture_id:
            raise KeyError(capture_id)
        return PatchSource.of_tensors(capture_id, "demo", result.captures.positions,
                                      result.captures.tensors)
    return get


def test_patch_equals_hf_with_the_captured_values(engine_pool, model_dirs, hf_models):
    """A capture of prompt A, then prompt B patched with A's values at some positions of
    resid_post 1 and mlp_out 2 (one of them past B's prompt: a generated position)."""
    engine = capsteer_engine(engine_pool, model_dirs, "qwen3")
    hf = hf_models["qwen3"]
    source_prompt, prompt = token_prompt(90, 16), token_prompt(91, 12)
    (cap,) = engine.generate([Request(
        prompt_token_ids=source_prompt, sampling=greedy(4),
        capture={"hooks": {"resid_post": [1], "mlp_out": [2]}, "positions": "all"})])
    captured = cap.captures
    assert captured is not None and captured.error is None
    engine.patch_sources = sources_of(cap)
    resid_at, mlp_at = [2, 3, 4, 5], [7, 13]  # 13: B's second generated token's position
    steering = {"vectors": [
        {"op": "patch", "hook": "resid_post", "layer": 1,
         "source": {"capture_id": cap.capture_id, "positions": resid_at}},
        {"op": "patch", "hook": "mlp_out", "layer": 2,
         "source": {"capture_id": cap.capture_id, "positions": mlp_at}}]}
    index = {int(p): i for i, p in enumerate(captured.positions)}

    def rows(hook: str, layer: int, at: list[int]) -> torch.Tensor:
        return captured.tensors[(hook, layer)][[index[p] for p in at]].float()
    sampling = greedy(MAX_TOKENS, logprobs=5)
    try:
        plain, patched, plain2 = engine.generate([
            Request(prompt_token_ids=prompt, sampling=sampling),
            Request(prompt_token_ids=prompt, sampling=sampling, steering=steering),
            Request(prompt_token_ids=prompt, sampling=sampling)])
        with hf_patched(hf, [("resid_post", 1, resid_at, rows("resid_post", 1, resid_at)),
                             ("mlp_out", 2, mlp_at, rows("mlp_out", 2, mlp_at))]):
            ref_tokens, ref_lps = hf_greedy(hf, prompt, MAX_TOKENS)
        (forced,) = engine.generate([Request(
            prompt_token_ids=prompt + ref_tokens,
            sampling={"max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0},
            steering=steering)])
    finally:
        engine.patch_sources = None
    assert patched.token_ids == ref_tokens
    assert_logprobs_match(patched, ref_lps)
    assert_teacher_forced_match(forced, len(prompt), ref_tokens, ref_lps)
    assert patched.token_ids != plain.token_ids, "the patch changed nothing"
    assert_unsteered_like_hf(hf, prompt, (plain, plain2))


def test_patching_a_prompt_with_its_own_capture_changes_nothing(engine_pool, model_dirs):
    """The values a request had anyway, patched back in: the same tokens and log-probs
    (the stream is x + residual, set through x, so rounding stays within float32's)."""
    engine = capsteer_engine(engine_pool, model_dirs, "qwen3")
    prompt = token_prompt(92, 14)
    sampling = greedy(8, logprobs=5)
    (cap,) = engine.generate([Request(prompt_token_ids=prompt, sampling=sampling,
                                      capture={"hooks": ["resid_post"], "layers": [0, 3],
                                               "positions": "prompt"})])
    engine.patch_sources = sources_of(cap)
    try:
        (same,) = engine.generate([Request(prompt_token_ids=prompt, sampling=sampling, steering={
            "vectors": [{"op": "patch", "hook": "resid_post", "layers": [0, 3],
                         "source": {"capture_id": cap.capture_id,
                                    "positions": list(range(len(prompt)))}}]})])
    finally:
        engine.patch_sources = None
    assert same.token_ids == cap.token_ids
    for got, want in zip(same.logprobs, cap.logprobs, strict=True):
        assert got.keys() == want.keys()
        assert np.allclose([got[t] for t in got], [want[t] for t in got], atol=1e-4)
