"""Conditional steering (`when`) and SAE-feature vectors equal HF forward hooks that
implement the same rule with the reader's own scores (SAELens's encode for SAEs)."""

from __future__ import annotations

import io
import json
import tarfile
from contextlib import contextmanager

import pytest
import torch
from sae_lens import JumpReLUSAE, JumpReLUSAEConfig

from capsteer.engine import Request
from capsteer.reference import decoder_layers, hf_activations, hf_family, hf_greedy
from capsteer.steering.readers.kinds import LinearProbe
from capsteer.steering.readers.registry import ReaderRegistry

from .helpers import (
    HIDDEN,
    MAX_TOKENS,
    assert_logprobs_match,
    assert_teacher_forced_match,
    assert_unsteered_like_hf,
    capsteer_engine,
    greedy,
    token_prompt,
    vector,
)

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def readers(tmp_path_factory):
    """A reader registry as the server keeps one: a JumpReLU SAE built, randomized and saved
    by SAELens (uploaded as a tar), and a sigmoid probe (JSON)."""
    root = tmp_path_factory.mktemp("cond-readers")
    reg = ReaderRegistry(root / "store", hidden_size=HIDDEN)
    sae = JumpReLUSAE(JumpReLUSAEConfig(d_in=HIDDEN, d_sae=64))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in sae.named_parameters():
            values = torch.randn(param.shape, generator=gen)
            param.copy_(values.abs() * 0.2 if name == "threshold" else values * 0.3)
    sae.save_model(str(root / "sae"))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        tf.add(root / "sae", arcname="sae")
    reg.put("jump", buf.getvalue(), "tar")
    probe = LinearProbe(torch.randn(2, HIDDEN, generator=gen) * 0.5, torch.zeros(2), "sigmoid")
    reg.put("honest", json.dumps({"weight": probe.weight.tolist(), "bias": [0.0, 0.0],
                                  "activation": "sigmoid"}).encode(), "json")
    reg.saelens = sae
    return reg


@contextmanager
def readers_on(engine, registry):
    """The shared engine parses with this registry's readers for the test's duration."""
    before, engine.reader_lookup = engine.reader_lookup, registry.get
    try:
        yield
    finally:
        engine.reader_lookup = before


@contextmanager
def hf_conditional(model, hook: str, layer: int, score, passes, act, masks: list):
    """An HF hook doing what the rule says: at `hook`/`layer`, `act` on the value at the
    tokens where `passes(score(value))`, the score read before the change; each forward's
    mask is appended to `masks`."""
    family = hf_family(model)
    layers = decoder_layers(model, family)

    def change(h: torch.Tensor) -> torch.Tensor:
        hf = h.float()
        mask = passes(score(hf[0]))
        masks.append(mask)
        return torch.where(mask[None, :, None], act(hf), hf).to(h.dtype)

    if hook == "resid_post":  # the stream entering the next layer
        def pre(mod, args, kwargs):
            h = args[0] if args else kwargs["hidden_states"]
            h = change(h)
            return ((h, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": h})
        handle = layers[layer + 1].register_forward_pre_hook(pre, with_kwargs=True)
    else:
        assert hook == "mlp_out"
        module = layers[layer]
        for part in family.mlp_out.split("."):
            module = getattr(module, part)

        def out(mod, args, output):
            if isinstance(output, tuple):
                return (change(output[0]), *output[1:])
            return change(output)
        handle = module.register_forward_hook(out)
    try:
        yield
    finally:
        handle.remove()


def _median_threshold(hf, prompt, hook, layer, score) -> float:
    """A threshold some prompt tokens pass and some do not, far from every score (a
    score on the threshold may land either side): midway between the middle two (the
    value at the point before the item's steering is the unsteered model's there)."""
    values = score(hf_activations(hf, prompt)[(hook, layer)].float()).sort().values
    mid = len(values) // 2
    positive = values[values > 0]  # an SAE feature is 0 where inactive
    return max(float(values[mid - 1] + values[mid]) / 2, 0.5 * float(positive.min()))


CASES = ["probe-resid_post-add", "sae-mlp_out-clamp"]


@pytest.mark.parametrize("case", CASES)
def test_conditional_steering_equals_hf_hook(engine_pool, model_dirs, hf_models, readers,
                                             case):
    """Greedy tokens and top-5 log-probs as HF with a hook implementing the rule, then
    teacher-forced log-probs of HF's tokens; some tokens pass the test and some do not;
    the plain request in the same batch is unchanged (HF without hooks)."""
    engine = capsteer_engine(engine_pool, model_dirs, "qwen3")
    hf = hf_models["qwen3"]
    prompt = token_prompt(77 if case.startswith("probe") else 78, 14)
    if case.startswith("probe"):
        hook, layer, index, sense = "resid_post", 1, 1, "above"
        probe = readers.get("honest")
        score = lambda h: probe.scores(h)[..., index]  # noqa: E731
        v = torch.tensor(vector(80))
        item = {"hook": hook, "layer": layer, "vector": v.tolist(), "scale": 8.0}
        act = lambda h: h + 8.0 * v  # noqa: E731
    else:
        hook, layer, index, sense = "mlp_out", 2, None, "below"
        sae = readers.saelens
        with torch.no_grad():  # the feature most often active on the prompt
            acts = sae.encode(hf_activations(hf, prompt)[(hook, layer)].float())
        index = int(((acts > 0).float().mean(0) - 0.5).abs().argmin())

        def score(h):
            with torch.no_grad():
                return sae.encode(h)[..., index]
        v = torch.tensor(vector(81))
        item = {"hook": hook, "layer": layer, "vector": v.tolist(), "op": "clamp",
                "value": 6.0}
        act = lambda h: h - (h @ v)[..., None] * v + 6.0 * v  # noqa: E731
    x = _median_threshold(hf, prompt, hook, layer, score)
    item["when"] = {"reader": {"name": "honest" if case.startswith("probe") else "jump"},
                    "index": index, sense: x}
    passes = (lambda s: s > x) if sense == "above" else (lambda s: s < x)
    steering = {"vectors": [item]}
    ungated = {"vectors": [{k: val for k, val in item.items() if k != "when"}]}
    sampling = greedy(MAX_TOKENS, logprobs=5)
    with readers_on(engine, readers):
        plain, steered, always, plain2 = engine.generate([
            Request(prompt_token_ids=prompt, sampling=sampling),
            Request(prompt_token_ids=prompt, sampling=sampling, steering=steering),
            Request(prompt_token_ids=prompt, sampling=sampling, steering=ungated),
            Request(prompt_token_ids=prompt, sampling=sampling)])
        masks: list[torch.Tensor] = []
        with hf_conditional(hf, hook, layer, score, passes, act, masks):
            ref_tokens, ref_lps = hf_greedy(hf, prompt, MAX_TOKENS)
        last = masks[-1]  # the last forward saw every position
        assert 0 < int(last.sum()) < len(last), "the test passed at every token or none"
        (forced,) = engine.generate([Request(
            prompt_token_ids=prompt + ref_tokens,
            sampling={"max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0},
            steering=steering)])
    assert steered.token_ids == ref_tokens
    assert_logprobs_match(steered, ref_lps)
    assert_teacher_forced_match(forced, len(prompt), ref_tokens, ref_lps)
    assert steered.token_ids != plain.token_ids, "conditional steering changed nothing"
    assert steered.token_ids != always.token_ids, "the gate made no difference"
    assert_unsteered_like_hf(hf, prompt, (plain, plain2))


def test_sae_feature_vector_equals_its_decoder_row_inline(engine_pool, model_dirs, readers):
    engine = capsteer_engine(engine_pool, model_dirs, "qwen3")
    row = readers.saelens.W_dec[17].detach().tolist()
    by_feature = {"vectors": [{"hook": "resid_post", "layer": 1, "scale": 6.0,
                               "vector": {"reader": "jump", "feature": 17}}]}
    inline = {"vectors": [{"hook": "resid_post", "layer": 1, "scale": 6.0, "vector": row}]}
    sampling = greedy(MAX_TOKENS, logprobs=5)
    prompt = token_prompt(79, 10)
    with readers_on(engine, readers):
        plain, feature, direct = engine.generate([
            Request(prompt_token_ids=prompt, sampling=sampling),
            Request(prompt_token_ids=prompt, sampling=sampling, steering=by_feature),
            Request(prompt_token_ids=prompt, sampling=sampling, steering=inline)])
    assert feature.token_ids == direct.token_ids != plain.token_ids
    assert feature.logprobs == direct.logprobs  # one spec: the same table entries
