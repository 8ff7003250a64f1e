"""Readouts through the in-process `Engine`: `Result.readout_results` carries the server's
`readout_results` (one entry per position each item reads, with its token), and its probe
scores and SAE top-k features equal HF activations read by the same probe and by SAELens's
`SAE.encode`, the check the server's readout test makes (tests/readout_refs.py)."""

from __future__ import annotations

import numpy as np
import pytest

from capsteer.engine import Request
from capsteer.steering.readers.readout import ReadoutSpecError
from capsteer.steering.values import SteeringSpecError
from tests.readout_refs import ITEMS, check_against_hf, put_readers, reader_bodies

from .helpers import capsteer_engine, greedy, token_prompt

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def readers(tmp_path_factory):
    return reader_bodies(tmp_path_factory)


def test_readout_results_equal_hf(engine_pool, model_dirs, hf_models, readers):
    engine = capsteer_engine(engine_pool, model_dirs, "qwen3")
    saes, bodies = readers
    put_readers(engine.readers, bodies)  # the registry the workers read named readers from
    prompts = [token_prompt(31, 9), token_prompt(32, 40)]  # the long one: chunked prefill
    requests = [Request(prompt_token_ids=p, sampling=greedy(6), readout=ITEMS)
                for p in prompts]
    requests.insert(1, Request(prompt_token_ids=token_prompt(33, 12), sampling=greedy(4)))
    results = engine.generate(requests)
    assert results[1].readout_results is None  # a plain request beside them
    for prompt, result in zip(prompts, (results[0], results[2]), strict=True):
        got = result.readout_results
        assert [r["item"] for r in got] == list(range(len(ITEMS)))
        fed_tokens = prompt + result.token_ids[:-1]  # the last token is never fed
        fed = len(fed_tokens)
        assert got[0]["positions"] == list(range(fed))  # `all`: one entry per position
        assert got[0]["token_ids"] == fed_tokens
        assert check_against_hf(hf_models["qwen3"], saes, got) == len(prompt)
        assert got[2]["positions"] == list(range(len(prompt), fed))  # generated
        assert got[3]["positions"] == list(range(len(prompt)))  # prompt
        assert got[4]["positions"] == [0, 3, len(prompt) - 1]  # explicit, -1 = prompt's last
        for entry in got:
            assert entry["token_ids"] == [fed_tokens[p] for p in entry["positions"]]
            values = entry.get("scores", entry.get("features"))
            assert len(values) == len(entry["positions"])
        assert len(got[0]["scores"][0]) == 3  # the probe's outputs
        assert all(len(row) <= 5 for row in got[1]["features"])  # top_k
        assert any(row for entry in got[1:4] for row in entry["features"])  # features fired
    # Nothing is left behind for the next batch.
    assert not engine._readouts().reader.inboxes


@pytest.mark.parametrize("request_kw,param", [
    ({"readout": [{"reader": {"name": "absent"}, "layer": 0}]}, "readout[0].reader.name"),
    ({"readout": [{"reader": {"name": "ro-probe"}, "layer": 9}]}, "readout[0].layer"),
    ({"readout": "probe"}, "readout"),
    ({"readout": ITEMS[:1], "capture": {"hooks": ["resid_post"]}}, "readout"),
    ({"readout": ITEMS[:1], "sampling": {"n": 2, "max_tokens": 2}}, "n"),
], ids=["unknown-reader", "layer", "not-a-list", "with-capture", "n"])
def test_bad_readout_is_refused_naming_the_field(engine_pool, model_dirs, readers,
                                                 request_kw, param):
    engine = capsteer_engine(engine_pool, model_dirs, "qwen3")
    put_readers(engine.readers, readers[1])
    with pytest.raises(ReadoutSpecError) as err:
        engine.generate([Request(prompt_token_ids=[5, 6, 7], **request_kw)])
    assert err.value.param == param


def test_a_when_gate_names_a_reader_of_the_engines_registry(engine_pool, model_dirs, readers):
    """Without a `reader_lookup` of the caller's, a `when` gate reads the same registry the
    readouts do (readers_dir): the reader's own tensors, and an unknown name is refused."""
    engine = capsteer_engine(engine_pool, model_dirs, "qwen3")
    put_readers(engine.readers, readers[1])
    when = {"reader": {"name": "ro-probe"}, "index": 2, "above": 0.5}
    vector = {"hook": "resid_post", "layer": 1, "vector": [0.1] * engine.hidden_size,
              "when": when}
    _, steering = engine.parse(Request(prompt_token_ids=[5], steering={"vectors": [vector]}))
    weight = engine.readers.get("ro-probe").weight[2].numpy()
    assert steering is not None and [op.gate is not None and np.allclose(op.gate, weight)
                                     for op in steering.ops] == [True]
    with pytest.raises(SteeringSpecError) as err:
        engine.parse(Request(prompt_token_ids=[5], steering={"vectors": [
            {**vector, "when": {**when, "reader": {"name": "absent"}}}]}))
    assert "when.reader.name" in err.value.param
