"""Batch isolation and prefix caching: a request's tokens and captures do not depend on
what else is in the batch or in the cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from capsteer.engine import Request
from capsteer.reference import hf_greedy
from capsteer.steering.spec import parse_steering_spec

from .helpers import assert_matches_hf, capsteer_engine, greedy, token_prompt, vector

pytestmark = pytest.mark.engine


def mixed_requests() -> list[Request]:
    cap_a = {"hooks": ["resid_post", "attn_out"], "layers": "all", "positions": "all"}
    cap_b = {"hooks": {"resid_mid": [1], "mlp_out": "all"}, "positions": "prompt"}
    steer = lambda seed, hook, layer, **kw: {  # noqa: E731
        "vectors": [{"hook": hook, "layer": layer, "vector": vector(seed), "scale": 6.0, **kw}]}
    return [
        Request(prompt_token_ids=token_prompt(100, 30), sampling=greedy(8), capture=cap_a),
        Request(prompt_token_ids=token_prompt(101, 9), sampling=greedy(12)),
        Request(prompt_token_ids=token_prompt(102, 45), sampling=greedy(6),
                steering=steer(1, "resid_post", 1)),
        Request(prompt_token_ids=token_prompt(103, 12), sampling=greedy(10), capture=cap_b),
        Request(prompt_token_ids=token_prompt(104, 20), sampling=greedy(7),
                steering=steer(2, "mlp_out", 2, positions="generated")),
        Request(prompt_token_ids=token_prompt(105, 70), sampling=greedy(5)),
        Request(prompt_token_ids=token_prompt(106, 16), sampling=greedy(9),
                steering=steer(3, "resid_mid", 0), capture={"positions": "last"}),
        Request(prompt_token_ids=token_prompt(107, 25), sampling=greedy(8),
                steering={"vectors": [{"hook": "resid_post", "layer": 2, "vector": vector(4),
                                       "op": "clamp", "value": 5.0}]}),
        Request(prompt_token_ids=token_prompt(108, 5), sampling=greedy(11),
                capture={"hooks": ["resid_pre"], "positions": "generated"}),
        Request(prompt_token_ids=token_prompt(109, 33), sampling=greedy(6)),
    ]


@pytest.mark.parametrize("engine_name", ["qwen3", "qwen3_moe"])  # dense and MoE
def test_batched_equals_alone(engine_pool, model_dirs, hf_models, engine_name):
    engine = capsteer_engine(engine_pool, model_dirs, engine_name)
    requests = mixed_requests()
    batched = engine.generate(requests)
    for req, together in zip(requests, batched, strict=True):
        (alone,) = engine.generate([req])
        assert together.token_ids == alone.token_ids
        if req.capture is None:
            assert together.captures is None
            continue
        assert sorted(together.captures.tensors) == sorted(alone.captures.tensors)
        np.testing.assert_array_equal(together.captures.positions, alone.captures.positions)
        for key, value in together.captures.tensors.items():
            torch.testing.assert_close(value, alone.captures.tensors[key], atol=1e-5, rtol=1e-5)
        if req.steering is None:
            assert_matches_hf(hf_models[engine_name], together)


def test_prefix_cache_never_leaks_steering(engine_pool, model_dirs):
    engine = capsteer_engine(engine_pool, model_dirs, "qwen3")
    prompt = token_prompt(200, 80)  # two full 32-token blocks
    steering = {"vectors": [{"hook": "resid_post", "layer": 1, "vector": vector(7), "scale": 8.0}]}
    (plain_first,) = engine.generate([Request(prompt_token_ids=prompt, sampling=greedy(10))])
    (steered,) = engine.generate([Request(prompt_token_ids=prompt, sampling=greedy(10),
                                          steering=steering)])
    (steered_again,) = engine.generate([Request(prompt_token_ids=prompt, sampling=greedy(10),
                                                steering=steering)])
    (plain_after,) = engine.generate([Request(prompt_token_ids=prompt, sampling=greedy(10))])
    assert steered.token_ids != plain_first.token_ids
    assert steered.num_cached_tokens == 0  # did not reuse the unsteered blocks
    assert steered_again.num_cached_tokens > 0  # identical steering may share
    assert steered_again.token_ids == steered.token_ids
    assert plain_after.token_ids == plain_first.token_ids
    assert plain_after.num_cached_tokens > 0  # it reused the plain blocks, not the steered ones


def test_captured_prompt_never_reuses_cache(engine_pool, model_dirs, hf_models):
    engine = capsteer_engine(engine_pool, model_dirs, "qwen3")
    prompt = token_prompt(300, 40)
    engine.generate([Request(prompt_token_ids=prompt, sampling=greedy(4))])
    (cap,) = engine.generate([Request(prompt_token_ids=prompt, sampling=greedy(4),
                                      capture={"hooks": ["resid_post"], "positions": "prompt"})])
    assert cap.num_cached_tokens == 0
    assert cap.captures.positions.tolist() == list(range(40))
    assert_matches_hf(hf_models["qwen3"], cap)


def test_reused_plans_keep_steering_and_captures_exact(engine_pool, model_dirs, hf_models):
    """Steady decode of steering-only batches reuses the last step's plan; as requests
    finish and a capture joins and leaves, every output and capture still equals the
    request run alone, and the steered outputs equal HF's forward hooks."""
    engine = capsteer_engine(engine_pool, model_dirs, "qwen3")
    steer = lambda seed, hook, layer: {  # noqa: E731
        "vectors": [{"hook": hook, "layer": layer, "vector": vector(seed), "scale": 6.0}]}
    requests = [
        Request(prompt_token_ids=token_prompt(200 + i, 6 + 3 * i), sampling=greedy(6 + 5 * i),
                steering=steer(10 + i, hook, layer))
        for i, (hook, layer) in enumerate([("resid_post", 1), ("mlp_out", 2), ("resid_pre", 3),
                                           ("attn_out", 0), ("resid_mid", 2)])]
    requests.append(Request(prompt_token_ids=token_prompt(210, 8), sampling=greedy(18)))
    requests.append(Request(prompt_token_ids=token_prompt(211, 7), sampling=greedy(9),
                            capture={"hooks": ["resid_post"], "layers": "all",
                                     "positions": "all"}))
    (before,) = engine.stats()
    batched = engine.generate(requests)
    (after,) = engine.stats()
    assert after["plan_reuses"] > before["plan_reuses"], (before, after)
    assert after["plan_builds"] > before["plan_builds"]
    for req, together in zip(requests, batched, strict=True):
        (alone,) = engine.generate([req])
        assert together.token_ids == alone.token_ids
        if req.capture is not None:
            for key, value in together.captures.tensors.items():
                torch.testing.assert_close(value, alone.captures.tensors[key], atol=1e-5,
                                           rtol=1e-5)
            assert_matches_hf(hf_models["qwen3"], together)
        if req.steering is not None:
            spec = parse_steering_spec(req.steering, num_layers=4, hidden_size=128)
            ref_tokens, _ = hf_greedy(hf_models["qwen3"], req.prompt_token_ids,
                                      req.sampling["max_tokens"], steering=spec)
            assert together.token_ids == ref_tokens
