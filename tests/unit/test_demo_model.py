"""Demo models are a pure function of (family, shape, seed)."""

from __future__ import annotations

import hashlib

import pytest

from capsteer.demo_model import DemoShape, write_demo_model

TINY = DemoShape(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32,
                 intermediate_size=96, vocab_size=300)


def digest(path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path, family):
    a = write_demo_model(tmp_path / "a", family, seed=1, shape=TINY)
    b = write_demo_model(tmp_path / "b", family, seed=1, shape=TINY)
    c = write_demo_model(tmp_path / "c", family, seed=2, shape=TINY)
    assert digest(a) == digest(b) != digest(c)
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    assert "chat_template" in (a / "tokenizer_config.json").read_text() or (
        a / "chat_template.jinja").exists()
