"""Every supported model family: captures and steering equal HF transformers.

One engine per family (fp32 demo model, compiled, 4 layers, hidden 128), many requests
each. Families run through different layouts (engine_ext/families.py): vLLM's deferred
norms (Llama-likes, Phi-3, MoE, gpt-oss), post-normed sublayers (Gemma 2/3), and HF-shaped
layers that add the residual themselves (OLMo 2, GPT-NeoX and Starcoder2 via vLLM's
Transformers backend; Granite, GPT-2 and Cohere natively). GPT-NeoX (Pythia's
use_parallel_residual) and Cohere are parallel blocks: they have no resid_mid, and a
request naming it is refused with the reason.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from capsteer.capture.spec import SpecError
from capsteer.demo_model import FAMILIES, STREAM_ONLY_FAMILIES
from capsteer.engine import Request
from capsteer.hooks import HOOKS
from capsteer.reference import hf_activations, hf_greedy
from capsteer.steering.spec import SteeringSpecError, parse_steering_spec

from .helpers import (
    ALL_HOOKS,
    HIDDEN,
    LAYERS,
    assert_matches_hf,
    capsteer_engine,
    check_steering_equals_hf,
    fed_tokens,
    greedy,
    token_prompt,
    vector,
)

pytestmark = pytest.mark.engine

# test_equivalence already compares every hook of these three with HF.
NEW_FAMILIES = [f for f in FAMILIES if f not in ("qwen3", "llama", "qwen2")]
# Phi-2 has no family row: vLLM's Transformers backend runs it, capsteer offers
# resid_pre / resid_post only.
STREAM_ONLY = list(STREAM_ONLY_FAMILIES)
# One steering point per way a hook is read: stream at a layer input / resid_mid module /
# final norm, and both sublayer outputs.
STEER_POINTS = [("resid_post", 1), ("resid_pre", 2), ("resid_mid", 0), ("attn_out", 2),
                ("mlp_out", 1), ("resid_post", 3), ("mlp_in", 2), ("mlp_post", 2),
                ("attn_z", 1)]
PARALLEL = ("gpt_neox", "cohere")  # parallel blocks: no resid_mid
MOE = ("qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "gpt_oss")  # no mlp_post
D_MLP = 256  # the demo model's intermediate size: mlp_post's width
HEADS, D_HEAD = 4, 32  # the demo model's attention: attn_z is [4, 32] per token (128 wide)


def _steer_points(engine) -> list[tuple[str, int]]:
    """STEER_POINTS; a hook the model lacks is replaced by the first layer's input."""
    points = [("resid_pre", 0) if h in engine.unavailable else (h, layer)
              for h, layer in STEER_POINTS]
    return list(dict.fromkeys(points))


@pytest.mark.parametrize("engine_name", NEW_FAMILIES + STREAM_ONLY)
def test_every_hook_layer_position_equals_hf(engine_pool, model_dirs, hf_models, engine_name):
    engine = capsteer_engine(engine_pool, model_dirs, engine_name)
    assert ("resid_mid" in engine.unavailable) == (engine_name in (*PARALLEL, *STREAM_ONLY))
    assert ("attn_out" in engine.unavailable) == (engine_name in STREAM_ONLY)
    assert ("mlp_in" in engine.unavailable) == (engine_name in ("olmo2", *STREAM_ONLY))
    assert ("mlp_post" in engine.unavailable) == (engine_name in (*MOE, *STREAM_ONLY))
    assert ("router_logits" in engine.unavailable) == (engine_name not in MOE)
    if engine_name in MOE:
        assert "mixture of experts" in engine.unavailable["mlp_post"]
        assert engine.hook_widths["router_logits"] == 4  # the demo MoE's experts
        with pytest.raises(SteeringSpecError, match="read only") as info:  # capture only
            engine.generate([Request(prompt_token_ids=token_prompt(5, 6), sampling=greedy(1),
                                     steering={"vectors": [{"hook": "router_logits",
                                                            "layer": 0, "vector": [1.0] * 4}]})])
        assert info.value.field == "steering.vectors[0].hook"
    else:
        assert engine.hook_widths["mlp_post"] == D_MLP
    assert ("attn_z" in engine.unavailable) == (engine_name in STREAM_ONLY)
    assert (engine.hook_widths["attn_z"], engine.hook_widths["attn_z.heads"]) == (
        HEADS * D_HEAD, HEADS)
    hooks = [h for h in HOOKS if h not in engine.unavailable]
    every = {**ALL_HOOKS, "hooks": hooks}
    results = engine.generate([
        Request(prompt_token_ids=token_prompt(1, 12), sampling=greedy(6), capture=every),
        # 150 prompt tokens, max_num_batched_tokens=64: three prefill chunks; longer than
        # the 64-token sliding windows (Gemma 2/3, Starcoder2, gpt-oss).
        Request(prompt_token_ids=token_prompt(2, 150), sampling=greedy(4), capture=every),
    ])
    for res in results:
        caps = res.captures
        assert sorted(caps.tensors) == sorted((h, layer) for h in hooks for layer in range(LAYERS))
        np.testing.assert_array_equal(caps.positions, np.arange(len(fed_tokens(res))))
        assert assert_matches_hf(hf_models[engine_name], res) > 0


@pytest.mark.parametrize("engine_name", PARALLEL)
def test_parallel_block_refuses_resid_mid_by_name(engine_pool, model_dirs, hf_models,
                                                  engine_name):
    """No stream exists between a parallel block's sublayers: capture or steering of
    resid_mid is refused with the reason, by the engine and by the HF reference alike,
    and resid_post = resid_pre + attn_out + mlp_out holds."""
    engine = capsteer_engine(engine_pool, model_dirs, engine_name)
    prompt = token_prompt(3, 10)
    with pytest.raises(SpecError, match="parallel block") as info:
        engine.generate([Request(prompt_token_ids=prompt, sampling=greedy(2),
                                 capture={"hooks": ["resid_pre", "post_attn"], "layers": "all"})])
    assert info.value.field == "capture.hooks.resid_mid"
    with pytest.raises(SteeringSpecError, match="parallel block") as info:
        engine.generate([Request(prompt_token_ids=prompt, sampling=greedy(2),
                                 steering=_steering("resid_mid", 1))])
    assert info.value.field == "steering.vectors[0].hook"
    # A payload that went around the front ends' check: the worker refuses it too (the
    # capture ends with the reason, the steering is not applied), never a silent no-op.
    checked, engine.unavailable = engine.unavailable, {}
    try:
        plain, captured, steered = engine.generate([
            Request(prompt_token_ids=prompt, sampling=greedy(4)),
            Request(prompt_token_ids=prompt, sampling=greedy(4),
                    capture={"hooks": ["resid_mid", "resid_pre"], "layers": "all"}),
            Request(prompt_token_ids=prompt, sampling=greedy(4),
                    steering=_steering("resid_mid", 1))])
    finally:
        engine.unavailable = checked
    assert captured.captures.error is not None and "parallel block" in captured.captures.error
    assert not captured.captures.tensors
    assert captured.token_ids == steered.token_ids == plain.token_ids
    spec = parse_steering_spec(_steering("resid_mid", 1), num_layers=LAYERS, hidden_size=HIDDEN)
    with pytest.raises(ValueError, match="parallel block"):
        hf_greedy(hf_models[engine_name], prompt, 1, steering=spec)
    ref = hf_activations(hf_models[engine_name], prompt)
    for layer in range(LAYERS):
        assert ("resid_mid", layer) not in ref
        torch.testing.assert_close(ref[("resid_post", layer)], ref[("resid_pre", layer)]
                                   + ref[("attn_out", layer)] + ref[("mlp_out", layer)],
                                   atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("engine_name", STREAM_ONLY)
def test_a_model_without_a_family_row_offers_the_stream_only(engine_pool, model_dirs,
                                                               engine_name):
    """An architecture without a row that vLLM serves through its Transformers backend
    starts (its canary passed) with resid_pre / resid_post; asking for a sublayer or
    resid_mid is refused with the reason."""
    engine = capsteer_engine(engine_pool, model_dirs, engine_name)
    assert sorted(engine.unavailable) == ["attn_out", "attn_z", "mlp_in", "mlp_out", "mlp_post",
                                          "resid_mid", "router_logits"]
    prompt = token_prompt(4, 10)
    for hook in ("attn_out", "mlp_out", "resid_mid", "mlp_in", "mlp_post", "attn_z"):
        with pytest.raises(SpecError, match="Transformers backend") as info:
            engine.generate([Request(prompt_token_ids=prompt, sampling=greedy(2),
                                     capture={"hooks": [hook], "layers": "all"})])
        assert info.value.field == f"capture.hooks.{hook}"
        with pytest.raises(SteeringSpecError, match="PhiForCausalLM"):
            engine.generate([Request(prompt_token_ids=prompt, sampling=greedy(2),
                                     steering=_steering(hook, 1))])
    checked, engine.unavailable = engine.unavailable, {}  # as a payload around the front end
    try:
        (res,) = engine.generate([Request(prompt_token_ids=prompt, sampling=greedy(2),
                                          capture={"hooks": ["mlp_out"], "layers": [3]})])
    finally:
        engine.unavailable = checked
    assert res.captures.error is not None and "mlp_out is not offered" in res.captures.error
    assert "attn_out" not in res.captures.error  # only the hooks it asked for


def _steering(hook: str, layer: int) -> dict:
    """Adds a unit vector times 8 (mlp_post: a d_mlp-wide one times 32, its neurons move
    the stream less than a hidden-wide vector)."""
    if hook == "mlp_post":
        return {"vectors": [{"hook": hook, "layer": layer, "scale": 32.0,
                             "vector": wide_vector(7 * layer + len(hook))}]}
    return {"vectors": [{"hook": hook, "layer": layer, "vector": vector(7 * layer + len(hook)),
                         "scale": 8.0}]}


def wide_vector(seed: int) -> list[float]:
    """A unit vector of mlp_post's width (d_mlp)."""
    v = np.random.default_rng(seed).standard_normal(D_MLP)
    return (v / np.linalg.norm(v)).tolist()


def _layer1_cases(hook: str, cases: dict[str, dict]) -> dict[str, dict]:
    """Each case's `steering`: one item at `hook` layer 1 with the case's fields, its op
    the case name's first word (`clamp-neurons`: clamp)."""
    return {name: {"vectors": [{"hook": hook, "layer": 1, "op": name.split("-")[0], **f}]}
            for name, f in cases.items()}


def _selection_runs(engine, hf, cases: dict[str, dict], suffix: str, hooks: list[str],
                    prompt: list[int]) -> tuple[dict, dict[str, dict]]:
    """One batch: `prompt` plain and steered by each case named `*{suffix}` (the
    selections), each capturing `hooks` at layer 1; every run's captures equal HF's (the
    steered ones under their spec). The plain captures, and each selection's."""
    capture = {"hooks": hooks, "layers": [1], "positions": "all"}
    picked = [name for name in cases if name.endswith(suffix)]
    plain, *steered = engine.generate(
        [Request(prompt_token_ids=prompt, sampling=greedy(1), capture=capture)]
        + [Request(prompt_token_ids=prompt, sampling=greedy(1), capture=capture,
                   steering=cases[name]) for name in picked])
    assert assert_matches_hf(hf, plain) > 0
    for name, res in zip(picked, steered, strict=True):
        spec = parse_steering_spec(cases[name], num_layers=LAYERS, hidden_size=HIDDEN,
                                   widths=engine.hook_widths)
        assert assert_matches_hf(hf, res, steering=spec) > 0
    return plain.captures.tensors, {name: res.captures.tensors
                                    for name, res in zip(picked, steered, strict=True)}


@pytest.mark.parametrize("engine_name", FAMILIES + STREAM_ONLY_FAMILIES)
def test_add_steering_equals_hf_hook(engine_pool, model_dirs, hf_models, engine_name):
    """At every kind of point: the same 32 greedy tokens as an HF forward hook adding the
    same vector, top-5 log-probs within 1e-3; then teacher-forced, so a near tie can
    neither hide nor fake a difference: HF's steered tokens fed back as the prompt, the
    log-prob of each fed token within 1e-3 of HF's."""
    engine = capsteer_engine(engine_pool, model_dirs, engine_name)
    points = _steer_points(engine)
    check_steering_equals_hf(engine, hf_models[engine_name], token_prompt(21, 9),
                              {point: _steering(*point) for point in points})


@pytest.mark.parametrize("engine_name", ["qwen3", "gpt2", *PARALLEL, "gpt_oss"])
def test_steering_mlp_in_edits_the_mlps_input_only(engine_pool, model_dirs, hf_models,
                                                   engine_name):
    """mlp_in (the MLP's normalized input) steered by add / ablate / clamp equals an HF
    forward pre-hook handing the MLP the edited input. The stream and attention are left
    as they were: at the steered layer resid_pre, attn_out (and resid_mid) equal the
    unsteered run's, mlp_in holds the clamp, and mlp_out moves. In a parallel block
    whose one norm feeds both sublayers (Cohere), attention's input is that same tensor:
    it is not changed, attention has read it before the MLP runs."""
    engine = capsteer_engine(engine_pool, model_dirs, engine_name)
    hf = hf_models[engine_name]
    v = vector(71)
    item = {"hook": "mlp_in", "layer": 1, "vector": v}
    # Large enough to change the demo GPT-2's tokens (its MLPs move its stream little).
    clamp = {"vectors": [{**item, "op": "clamp", "value": 24.0}]}
    cases = {"add": {"vectors": [{**item, "scale": 32.0}]},
             "ablate": {"vectors": [{**item, "op": "ablate"}]}, "clamp": clamp}
    check_steering_equals_hf(engine, hf, token_prompt(72, 9), cases,
                              unchanged_ok=frozenset({"ablate"}))
    hooks = [h for h in ("resid_pre", "resid_mid", "attn_out", "mlp_in", "mlp_out")
             if h not in engine.unavailable]
    capture = {"hooks": hooks, "layers": [1], "positions": "all"}
    prompt = token_prompt(73, 12)
    plain, steered = engine.generate([
        Request(prompt_token_ids=prompt, sampling=greedy(1), capture=capture),
        Request(prompt_token_ids=prompt, sampling=greedy(1), capture=capture, steering=clamp)])
    spec = parse_steering_spec(clamp, num_layers=LAYERS, hidden_size=HIDDEN)
    assert assert_matches_hf(hf, steered, steering=spec) > 0
    got, was = steered.captures.tensors, plain.captures.tensors
    for hook in hooks[:-2]:
        torch.testing.assert_close(got[(hook, 1)], was[(hook, 1)], atol=1e-5, rtol=1e-5)
    comp = got[("mlp_in", 1)] @ torch.tensor(v)
    torch.testing.assert_close(comp, torch.full_like(comp, 24.0), atol=1e-4, rtol=0)
    assert not torch.allclose(got[("mlp_out", 1)], was[("mlp_out", 1)])


@pytest.mark.parametrize("engine_name", ["qwen3", "gpt2", *PARALLEL, "starcoder2"])
def test_steering_mlp_post_and_its_neurons_equals_hf(engine_pool, model_dirs, hf_models,
                                                     engine_name):
    """mlp_post (the MLP's hidden activations, d_mlp wide) steered by add / ablate / clamp
    of a d_mlp vector, and by selections of neurons (ablate zeroes them, clamp sets them,
    add adds only there), equals an HF forward pre-hook on the output projection doing the
    same. A selection changes the selected neurons only: captured at the steered layer,
    every other neuron equals the unsteered run's, and mlp_out moves."""
    engine = capsteer_engine(engine_pool, model_dirs, engine_name)
    hf = hf_models[engine_name]
    v = wide_vector(81)
    neurons = sorted(np.random.default_rng(82).choice(D_MLP, 48, replace=False).tolist())
    cases = _layer1_cases("mlp_post", {
        "add": {"vector": v, "scale": 48.0},
        "ablate": {"vector": v},
        "clamp": {"vector": v, "value": 40.0},
        "ablate-neurons": {"neurons": neurons},
        "clamp-neurons": {"value": 6.0, "neurons": neurons},
        "add-neurons": {"vector": v, "scale": 96.0, "neurons": neurons},
    })
    check_steering_equals_hf(engine, hf, token_prompt(83, 9), cases,
                              unchanged_ok=frozenset({"ablate", "ablate-neurons"}))
    prompt = token_prompt(84, 12)
    was, selected = _selection_runs(engine, hf, cases, "-neurons",
                                    ["mlp_in", "mlp_post", "mlp_out"], prompt)
    assert was[("mlp_post", 1)].shape == (len(prompt), D_MLP)
    others = np.setdiff1d(np.arange(D_MLP), neurons)
    for name, got in selected.items():
        torch.testing.assert_close(got[("mlp_in", 1)], was[("mlp_in", 1)], atol=1e-5, rtol=1e-5)
        post, before = got[("mlp_post", 1)], was[("mlp_post", 1)]
        torch.testing.assert_close(post[:, others], before[:, others], atol=1e-5, rtol=1e-5)
        want = {"ablate-neurons": torch.zeros_like(before[:, neurons]),
                "clamp-neurons": torch.full_like(before[:, neurons], 6.0),
                "add-neurons": before[:, neurons] + 96.0 * torch.tensor(v)[neurons]}[name]
        torch.testing.assert_close(post[:, neurons], want, atol=1e-4, rtol=1e-5)
        assert not torch.allclose(got[("mlp_out", 1)], was[("mlp_out", 1)])


@pytest.mark.parametrize("engine_name", ["qwen3", "gpt2", *PARALLEL, "gpt_oss"])
def test_steering_attn_z_and_its_heads_equals_hf(engine_pool, model_dirs, hf_models,
                                                 engine_name):
    """attn_z (every head's output before the output projection, [heads, d_head] per
    token, stored flat) steered by add / ablate / clamp, and by selections of heads
    (head ablation zeroes the head's d_head slice), equals an HF forward pre-hook on the
    attention's output projection doing the same; a selection changes the selected heads
    only, and attn_out moves."""
    engine = capsteer_engine(engine_pool, model_dirs, engine_name)
    hf = hf_models[engine_name]
    width = HEADS * D_HEAD
    v = vector(91)
    cases = _layer1_cases("attn_z", {
        "add": {"vector": v, "scale": 24.0},
        "clamp": {"vector": v, "value": 20.0},
        "ablate-heads": {"heads": [0, 2]},
        "clamp-heads": {"value": 3.0, "heads": [1]},
        "add-heads": {"vector": v, "scale": 48.0, "heads": [3]},
    })
    check_steering_equals_hf(engine, hf, token_prompt(92, 9), cases,
                              unchanged_ok=frozenset({"ablate-heads", "clamp-heads"}))
    prompt = token_prompt(93, 12)
    plain, selected = _selection_runs(engine, hf, cases, "-heads", ["attn_z", "attn_out"],
                                      prompt)
    was = plain[("attn_z", 1)].reshape(len(prompt), HEADS, D_HEAD)
    for name, caps in selected.items():
        got = caps[("attn_z", 1)]
        assert got.shape == (len(prompt), width)
        got = got.reshape(len(prompt), HEADS, D_HEAD)
        sel = cases[name]["vectors"][0]["heads"]
        rest = [h for h in range(HEADS) if h not in sel]
        torch.testing.assert_close(got[:, rest], was[:, rest], atol=1e-5, rtol=1e-5)
        want = {"ablate-heads": torch.zeros_like(was[:, sel]),
                "clamp-heads": torch.full_like(was[:, sel], 3.0),
                "add-heads": was[:, sel] + 48.0 * torch.tensor(v).reshape(HEADS, D_HEAD)[sel]
                }[name]
        torch.testing.assert_close(got[:, sel], want, atol=1e-4, rtol=1e-5)
        assert not torch.allclose(caps[("attn_out", 1)], plain[("attn_out", 1)])
