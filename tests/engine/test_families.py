"""Every supported model family: captures and steering equal HF transformers.

One engine per family (fp32 demo model, compiled, 4 layers, hidden 128), many requests
each. Families run through different layouts (engine_ext/families.py): vLLM's deferred
norms (Llama-likes, Phi-3, MoE), post-normed sublayers (Gemma 2/3), and HF-shaped layers
that add the residual themselves (OLMo 2 via vLLM's Transformers backend, Granite).
"""

from __future__ import annotations

import numpy as np
import pytest

from capsteer.demo_model import FAMILIES
from capsteer.engine import Request
from capsteer.hooks import HOOKS
from capsteer.reference import hf_greedy
from capsteer.steering.spec import parse_steering_spec

from .helpers import (
    ALL_HOOKS,
    HIDDEN,
    LAYERS,
    LOGPROB_ATOL,
    MAX_TOKENS,
    assert_matches_hf,
    capsteer_engine,
    fed_tokens,
    greedy,
    token_prompt,
    vector,
)

pytestmark = pytest.mark.engine

# test_equivalence already compares every hook of these three with HF.
NEW_FAMILIES = [f for f in FAMILIES if f not in ("qwen3", "llama", "qwen2")]
# One steering point per way a hook is read: stream at a layer input / resid_mid module /
# final norm, and both sublayer outputs.
STEER_POINTS = [("resid_post", 1), ("resid_pre", 2), ("resid_mid", 0), ("attn_out", 2),
                ("mlp_out", 1), ("resid_post", 3)]


@pytest.mark.parametrize("engine_name", NEW_FAMILIES)
def test_every_hook_layer_position_equals_hf(engine_pool, model_dirs, hf_models, engine_name):
    engine = capsteer_engine(engine_pool, model_dirs, engine_name)
    results = engine.generate([
        Request(prompt_token_ids=token_prompt(1, 12), sampling=greedy(6), capture=ALL_HOOKS),
        # 150 prompt tokens, max_num_batched_tokens=64: three prefill chunks; longer than
        # Gemma's 64-token sliding window.
        Request(prompt_token_ids=token_prompt(2, 150), sampling=greedy(4), capture=ALL_HOOKS),
    ])
    for res in results:
        caps = res.captures
        assert sorted(caps.tensors) == sorted((h, layer) for h in HOOKS for layer in range(LAYERS))
        np.testing.assert_array_equal(caps.positions, np.arange(len(fed_tokens(res))))
        assert assert_matches_hf(hf_models[engine_name], res) > 0


def _steering(hook: str, layer: int) -> dict:
    return {"vectors": [{"hook": hook, "layer": layer, "vector": vector(7 * layer + len(hook)),
                         "scale": 8.0}]}


@pytest.mark.parametrize("engine_name", FAMILIES)
def test_add_steering_equals_hf_hook(engine_pool, model_dirs, hf_models, engine_name):
    """At every kind of point: the same 32 greedy tokens as an HF forward hook adding the
    same vector, top-5 log-probs within 1e-3; then teacher-forced, so a near tie can
    neither hide nor fake a difference: HF's steered tokens fed back as the prompt, the
    log-prob of each fed token within 1e-3 of HF's."""
    engine = capsteer_engine(engine_pool, model_dirs, engine_name)
    hf = hf_models[engine_name]
    prompt = token_prompt(21, 9)
    sampling = greedy(MAX_TOKENS, logprobs=5)
    plain, *steered = engine.generate(
        [Request(prompt_token_ids=prompt, sampling=sampling)]
        + [Request(prompt_token_ids=prompt, sampling=sampling, steering=_steering(h, layer))
           for h, layer in STEER_POINTS])
    references = [hf_greedy(hf, prompt, MAX_TOKENS, steering=parse_steering_spec(
        _steering(h, layer), num_layers=LAYERS, hidden_size=HIDDEN)) for h, layer in STEER_POINTS]
    forced = engine.generate([
        Request(prompt_token_ids=prompt + ref_tokens,
                sampling={"max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0},
                steering=_steering(h, layer))
        for (h, layer), (ref_tokens, _) in zip(STEER_POINTS, references, strict=True)])
    for point, res, (ref_tokens, ref_lps), tf in zip(STEER_POINTS, steered, references, forced,
                                                      strict=True):
        for step, (token, ref_lp) in enumerate(zip(ref_tokens, ref_lps, strict=True)):
            got = tf.prompt_logprobs[len(prompt) + step][token]
            assert abs(got - float(ref_lp[token])) < LOGPROB_ATOL, (point, "teacher-forced", step)
        assert res.token_ids == ref_tokens, point
        assert res.token_ids != plain.token_ids, f"steering at {point} changed nothing"
        for step, (got, want) in enumerate(zip(res.logprobs, ref_lps, strict=True)):
            for token, lp in got.items():
                assert abs(lp - float(want[token])) < LOGPROB_ATOL, (point, step, token)
