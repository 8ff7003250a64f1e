"""Every hook, every layer, every position equals HF transformers on the same weights."""

from __future__ import annotations

import numpy as np
import pytest

from capsteer.engine import Request

from .helpers import (
    ALL_HOOKS,
    DENSE_HOOKS,
    assert_matches_hf,
    capsteer_engine,
    fed_tokens,
    greedy,
    token_prompt,
)

pytestmark = pytest.mark.engine

@pytest.mark.parametrize("engine_name", ["qwen3", "llama", "qwen2", "qwen3-eager"])
def test_all_hooks_layers_positions_equal_hf(engine_pool, model_dirs, hf_models, engine_name):
    family = engine_name.split("-")[0]
    engine = capsteer_engine(engine_pool, model_dirs, family, eager=engine_name.endswith("eager"))
    requests = [
        Request(prompt_token_ids=token_prompt(1, 12), sampling=greedy(6), capture=ALL_HOOKS),
        # 150 prompt tokens with max_num_batched_tokens=64: prefilled in three chunks.
        Request(prompt_token_ids=token_prompt(2, 150), sampling=greedy(4), capture=ALL_HOOKS),
        Request(prompt="what is a residual stream", sampling=greedy(5), capture=ALL_HOOKS),
    ]
    results = engine.generate(requests)
    hf = hf_models[family]
    for res in results:
        caps = res.captures
        assert sorted(caps.tensors) == sorted((h, layer) for h in DENSE_HOOKS
                                              for layer in range(4))
        np.testing.assert_array_equal(caps.positions, np.arange(len(fed_tokens(res))))
        assert assert_matches_hf(hf, res) > 0


@pytest.mark.parametrize(
    ("positions", "expect"),
    [
        ("prompt", lambda p, f: list(range(p))),
        ("generated", lambda p, f: list(range(p, f))),
        ("last_prompt", lambda p, f: [p - 1]),
        ("last", lambda p, f: [f - 1]),
        ([0, -1, 13], lambda p, f: [0, p - 1, 13]),
    ],
    ids=["prompt", "generated", "last_prompt", "last", "explicit"],
)
def test_position_selection(engine_pool, model_dirs, hf_models, positions, expect):
    engine = capsteer_engine(engine_pool, model_dirs, "qwen3")
    spec = {"hooks": {"resid_post": [0, -1], "mlp_out": "1-2"}, "positions": positions}
    (res,) = engine.generate([Request(prompt_token_ids=token_prompt(3, 10), sampling=greedy(6),
                                      capture=spec)])
    fed = len(fed_tokens(res))
    assert res.captures.positions.tolist() == expect(10, fed)
    assert sorted(res.captures.tensors) == [("mlp_out", 1), ("mlp_out", 2), ("resid_post", 0),
                                            ("resid_post", 3)]
    assert_matches_hf(hf_models["qwen3"], res)


def test_capture_with_n_greater_than_one_is_refused(engine_pool, model_dirs):
    from capsteer.capture.spec import SpecError

    engine = capsteer_engine(engine_pool, model_dirs, "qwen3")
    with pytest.raises(SpecError) as err:
        engine.generate([Request(prompt_token_ids=token_prompt(9, 5), sampling=greedy(2, n=2),
                                 capture={"hooks": ["resid_post"]})])
    assert err.value.field == "capture"


def test_stop_string_truncation_is_respected(engine_pool, model_dirs, hf_models):
    """A stop string ends the output in vLLM's front end, possibly after the engine fed
    more tokens: captures end at the last token that belongs to the output."""
    engine = capsteer_engine(engine_pool, model_dirs, "qwen3")
    prompt = token_prompt(77, 9)
    (plain,) = engine.generate([Request(prompt_token_ids=prompt, sampling=greedy(40))])
    stop = plain.text[len(plain.text) // 2:][:3]
    assert stop.strip(), plain.text
    results = engine.generate([Request(
        prompt_token_ids=prompt, sampling={**greedy(40), "stop": [stop], "ignore_eos": False},
        capture={"hooks": ["resid_post"], "layers": [0, -1], "positions": spec})
        for spec in ("all", "last")])
    for res in results:
        assert len(res.token_ids) < 40  # the stop string ended it early
    full, last = results
    fed = len(fed_tokens(full))
    assert full.captures.positions.tolist() == list(range(fed))
    assert last.captures.positions.tolist() == [fed - 1]
    assert_matches_hf(hf_models["qwen3"], full)
