"""Engine + durable writer: what lands on disk equals what the hooks captured."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from capsteer.capture import read
from capsteer.engine import Request
from capsteer.reference import hf_greedy
from capsteer.steering.spec import parse_steering_spec

from .helpers import assert_matches_hf, capsteer_engine, greedy, token_prompt, vector

pytestmark = [pytest.mark.engine, pytest.mark.uses_engine("qwen3-durable")]


@pytest.mark.parametrize("layout", ["packed", "per_file"])
def test_durable_capture_equals_memory_and_hf(engine_pool, model_dirs, hf_models, capture_root,
                                              layout):
    engine = capsteer_engine(engine_pool, model_dirs, "qwen3", capture_root=capture_root)
    spec = {"hooks": ["resid_post", "mlp_out"], "layers": "all", "positions": "all",
            "layout": layout, "tag": "engine-test"}
    prompt = token_prompt(400, 20)
    memory, durable = engine.generate([
        Request(prompt_token_ids=prompt, sampling=greedy(6), capture=spec),
        Request(prompt_token_ids=prompt, sampling=greedy(6), capture=spec, durable=True),
    ])
    receipt = durable.receipt
    assert receipt.status == "ok", receipt
    directory = Path(capture_root) / receipt.dir
    assert directory.parts[-2] == "engine-test"
    manifest = json.loads((directory / "manifest.json").read_text())
    assert manifest["capture_id"] == durable.capture_id
    on_disk = read(directory)  # verifies sha256 of every file
    # Published by the worker's writer process (the default), not by a fallback.
    (writer,) = engine.writer_stats()
    assert writer["failure"] is None and writer["process"] == manifest["writer"]["pid"]
    np.testing.assert_array_equal(on_disk.positions, memory.captures.positions)
    np.testing.assert_array_equal(on_disk.token_ids, memory.captures.token_ids)
    for (hook, layer), value in memory.captures.tensors.items():
        torch.testing.assert_close(on_disk.tensor(hook, layer), value, atol=1e-5, rtol=1e-5)
    # Plain safetensors, no capsteer code: the packed file or one file per key.
    first = sorted(directory.glob("*.safetensors"))[0]
    assert "positions" in load_file(str(first))
    assert_matches_hf(hf_models["qwen3"], memory)


def test_prompt_capture_closes_once_the_prompt_is_fed(engine_pool, model_dirs, hf_models,
                                                      capture_root):
    """A capture that keeps only prompt positions closes at the step that fed the prompt's
    last token, not when its request ends: the manifest counts only the prompt as fed, the
    decode steps after it build no per-step plan (captured batches used to build one every
    step), and the captured values, the tokens and a steered request's steering after the
    close are unchanged (= HF, durable = memory)."""
    engine = capsteer_engine(engine_pool, model_dirs, "qwen3", capture_root=capture_root)
    spec = {"hooks": ["resid_post", "attn_out"], "layers": "all", "positions": "prompt"}
    steering = {"vectors": [{"hook": "resid_post", "layer": 1, "vector": vector(7),
                             "scale": 6.0}]}
    steer_spec = parse_steering_spec(steering, num_layers=4, hidden_size=128)
    prompt, other = token_prompt(410, 24), token_prompt(411, 17)
    decode = 40
    (before,) = engine.stats()
    (writer_before,) = engine.writer_stats()
    memory, durable, steered = engine.generate([
        Request(prompt_token_ids=prompt, sampling=greedy(decode), capture=spec),
        Request(prompt_token_ids=prompt, sampling=greedy(decode), capture=spec, durable=True),
        Request(prompt_token_ids=other, sampling=greedy(decode), capture=spec, durable=True,
                steering=steering),
    ])
    (after,) = engine.stats()
    assert after["early_closes"] - before["early_closes"] == 3, (before, after)
    # One build for the prefill, one when the batch turns steering-only; decode reuses it.
    assert after["plan_builds"] - before["plan_builds"] < decode // 4, (before, after)
    assert after["live_requests"] == 0
    # The durable writer's counters, per worker (benchmarks charge a batch with its budget
    # and ring waits): its budget, and the rows it held at the peak.
    (writer,) = engine.writer_stats()
    assert writer is not None and writer["budget_bytes"] > 0, writer
    assert writer["peak_bytes"] > 0, writer
    assert writer["ring_waits"] >= writer_before["ring_waits"], (writer_before, writer)
    # The worker's own count of those ring waits (capsteer_capture_engine_wait_seconds_total;
    # a CPU engine has no harvester, so no harvest_slot).
    assert after["engine_wait_s"] == {"writer_ring": pytest.approx(writer["ring_wait_s"],
                                                                   abs=1e-5)}, (after, writer)
    # The hooks' own per-step host time is accounted for, phase by phase.
    assert all(after["host_s"][k] > before["host_s"][k]
               for k in ("before_step", "before_forward", "after_step")), (before, after)
    # ... with the step thread's CPU time beside it: never more than the wall time (up to
    # the clocks' granularity), and spent in every phase too.
    for k in ("before_step", "before_forward", "after_step"):
        wall = after["host_s"][k] - before["host_s"][k]
        cpu = after["host_cpu_s"][k] - before["host_cpu_s"][k]
        assert 0 < cpu <= wall + 1e-3, (k, wall, cpu)
    assert memory.captures.positions.tolist() == list(range(24))
    assert_matches_hf(hf_models["qwen3"], memory)
    for result, n in ((durable, 24), (steered, 17)):
        assert result.receipt.status == "ok", result.receipt
        directory = Path(capture_root) / result.receipt.dir
        manifest = json.loads((directory / "manifest.json").read_text())
        assert manifest["prompt_tokens"] == manifest["fed_tokens"] == n
        assert manifest["timings"]["closed_at"] <= manifest["timings"]["published_at"]
        on_disk = read(directory)
        assert on_disk.positions.tolist() == list(range(n))
    assert durable.token_ids == memory.token_ids
    on_disk = read(Path(capture_root) / durable.receipt.dir)
    for (hook, layer), value in memory.captures.tensors.items():
        torch.testing.assert_close(on_disk.tensor(hook, layer), value, atol=1e-5, rtol=1e-5)
    ref_tokens, _ = hf_greedy(hf_models["qwen3"], other, decode, steering=steer_spec)
    assert steered.token_ids == ref_tokens  # steering went on after the capture closed


def test_a_finished_request_publishes_before_the_batch_ends(engine_pool, model_dirs,
                                                            capture_root):
    """Captures that keep generated positions close when the front end reports their
    output length: `Engine.generate` reports it in the step a request finishes, so a
    short request's capture is on disk while a long one in the same batch still runs
    (reported after the whole batch, both closed at once at its end)."""
    engine = capsteer_engine(engine_pool, model_dirs, "qwen3", capture_root=capture_root)
    spec = {"hooks": ["resid_post"], "layers": [1], "positions": "all"}
    short, long_ = engine.generate([
        Request(prompt_token_ids=token_prompt(420, 12), sampling=greedy(1), capture=spec,
                durable=True),
        Request(prompt_token_ids=token_prompt(421, 12), sampling=greedy(60), capture=spec,
                durable=True),
    ])
    timings = {}
    for name, result, generated in (("short", short, 1), ("long", long_, 60)):
        assert result.receipt.status == "ok", result.receipt
        directory = Path(capture_root) / result.receipt.dir
        manifest = json.loads((directory / "manifest.json").read_text())
        timings[name] = manifest["timings"]
        # every fed position: the prompt and each generated token but the last
        assert read(directory).positions.tolist() == list(range(12 + generated - 1))
    assert timings["short"]["published_at"] < timings["long"]["closed_at"], timings
