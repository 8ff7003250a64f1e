"""Steering equals HF forward hooks doing the same thing at the same point."""

from __future__ import annotations

import pytest
import torch

from capsteer.engine import Request
from capsteer.reference import hf_greedy
from capsteer.steering.spec import parse_steering_spec

from .helpers import (
    HIDDEN,
    LAYERS,
    LOGPROB_ATOL,
    MAX_TOKENS,
    assert_matches_hf,
    capsteer_engine,
    greedy,
    token_prompt,
    vector,
)

pytestmark = pytest.mark.engine

def check_against_hf(engine, hf, prompt, steering, *, must_change=True):
    """Same greedy tokens over 32 steps; top-5 logprobs within 1e-3 of HF's."""
    spec = parse_steering_spec(steering, num_layers=LAYERS, hidden_size=HIDDEN)
    plain, steered = engine.generate([
        Request(prompt_token_ids=prompt, sampling=greedy(MAX_TOKENS, logprobs=5)),
        Request(prompt_token_ids=prompt, sampling=greedy(MAX_TOKENS, logprobs=5), steering=steering),
    ])
    ref_tokens, ref_logprobs = hf_greedy(hf, prompt, MAX_TOKENS, steering=spec)
    assert steered.token_ids == ref_tokens
    if must_change:
        assert steered.token_ids != plain.token_ids, "steering did not change the output"
    for step, (got, want) in enumerate(zip(steered.logprobs, ref_logprobs, strict=True)):
        for token, lp in got.items():
            assert abs(lp - float(want[token])) < LOGPROB_ATOL, (step, token, lp, float(want[token]))
    return steered


ADD_CASES = [
    ("resid_post", 1, 8.0), ("resid_pre", 2, 8.0), ("resid_mid", 0, 8.0),
    ("attn_out", 3, 8.0), ("mlp_out", 2, 8.0), ("resid_post", 3, 8.0),
]


@pytest.mark.parametrize(("hook", "layer", "scale"), ADD_CASES,
                         ids=[f"{h}{layer}" for h, layer, _ in ADD_CASES])
def test_add_equals_hf_hook(engine_pool, model_dirs, hf_models, hook, layer, scale):
    engine = capsteer_engine(engine_pool, model_dirs, "qwen3")
    steering = {"vectors": [{"hook": hook, "layer": layer, "vector": vector(layer), "scale": scale}]}
    check_against_hf(engine, hf_models["qwen3"], token_prompt(10 + layer, 9), steering)


def test_add_on_layer_range_and_generated_positions(engine_pool, model_dirs, hf_models):
    engine = capsteer_engine(engine_pool, model_dirs, "qwen3")
    steering = {"vectors": [
        {"hook": "resid_post", "layers": "1-2", "vector": vector(5), "scale": 6.0,
         "positions": "generated"},
        {"hook": "resid_pre", "layer": 1, "vector": vector(6), "scale": 5.0, "positions": "prompt"},
    ]}
    check_against_hf(engine, hf_models["qwen3"], token_prompt(21, 11), steering)


@pytest.mark.parametrize("op", ["ablate", "clamp"])
@pytest.mark.parametrize("hook", ["resid_post", "resid_mid", "attn_out", "mlp_out"])
def test_projection_ops_equal_hf(engine_pool, model_dirs, hf_models, op, hook):
    engine = capsteer_engine(engine_pool, model_dirs, "qwen3")
    item = {"hook": hook, "layer": 1, "vector": vector(30), "op": op}
    if op == "clamp":
        item["value"] = 25.0
    steering = {"vectors": [item, {"hook": "resid_post", "layer": 2, "vector": vector(31),
                                   "scale": 2.0}]}
    # Ablation of one random direction may leave greedy tokens unchanged; logprobs still must match.
    check_against_hf(engine, hf_models["qwen3"], token_prompt(40, 10), steering,
                     must_change=(op == "clamp"))


def test_captures_see_steered_values(engine_pool, model_dirs, hf_models):
    engine = capsteer_engine(engine_pool, model_dirs, "qwen3")
    steering = {"vectors": [
        {"hook": "attn_out", "layer": 1, "vector": vector(50), "scale": 3.0},
        {"hook": "resid_post", "layer": 1, "vector": vector(51), "op": "clamp", "value": 2.0},
    ]}
    spec = parse_steering_spec(steering, num_layers=LAYERS, hidden_size=HIDDEN)
    (res,) = engine.generate([Request(
        prompt_token_ids=token_prompt(52, 8), sampling=greedy(5), steering=steering,
        capture={"hooks": ["resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out"]})])
    assert_matches_hf(hf_models["qwen3"], res, steering=spec)
    # The clamp holds: the stream leaving layer 1 has component 2.0 along the vector.
    u = torch.tensor(vector(51))
    comp = res.captures.tensors[("resid_post", 1)] @ u
    torch.testing.assert_close(comp, torch.full_like(comp, 2.0), atol=1e-4, rtol=0)


@pytest.mark.uses_engine("llama")
def test_llama_add_equals_hf(engine_pool, model_dirs, hf_models):
    engine = capsteer_engine(engine_pool, model_dirs, "llama")
    steering = {"vectors": [{"hook": "resid_post", "layer": 2, "vector": vector(60), "scale": 8.0}]}
    check_against_hf(engine, hf_models["llama"], token_prompt(61, 9), steering)
