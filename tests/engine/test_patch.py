"""Activation patching (`op: patch`, api.md §7) equals an HF forward hook that replaces the
value at those positions with the captured values: greedy tokens, top-5 and
teacher-forced log-probs; plain requests in the same batch are unchanged."""

from __future__ import annotations

import numpy as np
import pytest

from capsteer.engine import Request

from .helpers import (
    MAX_TOKENS,
    assert_logprobs_match,
    assert_teacher_forced_match,
    assert_unsteered_like_hf,
    capsteer_engine,
    greedy,
    token_prompt,
)
from .patch_runs import capture_points, run_patched, sources_of

pytestmark = pytest.mark.engine


def test_patch_equals_hf_with_the_captured_values(engine_pool, model_dirs, hf_models):
    """A capture of prompt A, then prompt B patched with A's values at some positions of
    resid_post 1 and mlp_out 2 (one of them past B's prompt: a generated position)."""
    engine = capsteer_engine(engine_pool, model_dirs, "qwen3")
    hf = hf_models["qwen3"]
    source_prompt, prompt = token_prompt(90, 16), token_prompt(91, 12)
    # mlp_out's 13: B's second generated token's position
    points = [("resid_post", 1, [2, 3, 4, 5]), ("mlp_out", 2, [7, 13])]
    cap = capture_points(engine, source_prompt, points, greedy(4))
    run = run_patched(engine, hf, cap, prompt, points, greedy(MAX_TOKENS, logprobs=5))
    assert run.patched.token_ids == run.ref_tokens
    assert_logprobs_match(run.patched, run.ref_lps)
    assert_teacher_forced_match(run.forced, len(prompt), run.ref_tokens, run.ref_lps)
    assert run.patched.token_ids != run.plain.token_ids, "the patch changed nothing"
    assert_unsteered_like_hf(hf, prompt, (run.plain, run.plain2))


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
