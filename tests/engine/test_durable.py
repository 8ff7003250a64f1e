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

from .conftest import capsteer_engine
from .helpers import assert_matches_hf, greedy, token_prompt

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
    np.testing.assert_array_equal(on_disk.positions, memory.captures.positions)
    np.testing.assert_array_equal(on_disk.token_ids, memory.captures.token_ids)
    for (hook, layer), value in memory.captures.tensors.items():
        torch.testing.assert_close(on_disk.tensor(hook, layer), value, atol=1e-5, rtol=1e-5)
    # Plain safetensors, no capsteer code: the packed file or one file per key.
    first = sorted(directory.glob("*.safetensors"))[0]
    assert "positions" in load_file(str(first))
    assert_matches_hf(hf_models["qwen3"], memory)
