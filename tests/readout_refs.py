"""The readers the readout tests read with (a sigmoid probe, one SAELens SAE per
architecture, random weights, seeded), the items they ask for, and the check that results
equal HF's activations read by the same probe and by SAELens's own `SAE.encode`: shared by
the server's readout tests and the in-process engine's, which must agree."""

from __future__ import annotations

import io
import tarfile

import numpy as np
import torch
from sae_lens import (
    JumpReLUSAE,
    JumpReLUSAEConfig,
    StandardSAE,
    StandardSAEConfig,
    TopKSAE,
    TopKSAEConfig,
)

from capsteer.reference import hf_activations
from tests.upload_bodies import npz_bytes

HIDDEN = 128
D_SAE = 256
RNG = np.random.default_rng(11)
W = (RNG.standard_normal((3, HIDDEN)) / np.sqrt(HIDDEN)).astype(np.float32)
B = RNG.standard_normal(3).astype(np.float32)
SAES = {
    "relu": lambda: StandardSAE(StandardSAEConfig(d_in=HIDDEN, d_sae=D_SAE)),
    "jumprelu": lambda: JumpReLUSAE(JumpReLUSAEConfig(d_in=HIDDEN, d_sae=D_SAE)),
    "topk": lambda: TopKSAE(TopKSAEConfig(d_in=HIDDEN, d_sae=D_SAE, k=12)),
}


def make_sae(arch: str):
    """A SAELens SAE with random weights everywhere (b_dec and b_enc too), seeded."""
    torch.manual_seed({"relu": 1, "jumprelu": 2, "topk": 3}[arch])
    sae = SAES[arch]()
    with torch.no_grad():
        for name, param in sae.named_parameters():
            if name == "threshold":
                param.copy_(torch.rand_like(param) * 0.2)
            elif name in ("b_dec", "b_enc"):
                param.copy_(torch.randn_like(param) * 0.1)
    return sae.eval()


def sae_tar(directory) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        tf.add(directory, arcname="sae")
    return buf.getvalue()


def reader_bodies(tmp_path_factory) -> tuple[dict, dict[str, bytes]]:
    """Readers uploaded once: a sigmoid probe and one SAE per architecture."""
    saes = {arch: make_sae(arch) for arch in SAES}
    bodies = {"probe": npz_bytes(weight=W, bias=B)}
    for arch, sae in saes.items():
        directory = tmp_path_factory.mktemp(f"sae-{arch}")
        sae.save_model(directory)
        bodies[f"sae-{arch}"] = sae_tar(directory)
    return saes, bodies


def put_readers(registry, bodies: dict[str, bytes]) -> None:
    """The readers into a registry under the names ITEMS uses (`PUT /v1/readers` does the
    same through the server)."""
    for name, body in bodies.items():
        registry.put(f"ro-{name}", body, activation="sigmoid" if name == "probe" else None)


ITEMS = [
    {"reader": {"name": "ro-probe"}, "hook": "resid_post", "layer": 1},
    {"reader": {"name": "ro-sae-relu"}, "hook": "resid_post", "layer": 0, "top_k": 5},
    {"reader": {"name": "ro-sae-jumprelu"}, "hook": "mlp_out", "layer": -1, "top_k": 8,
     "positions": "generated"},
    {"reader": {"name": "ro-sae-topk"}, "hook": "resid_pre", "layer": 1, "top_k": 12,
     "threshold": 0.05, "positions": "prompt"},
    {"reader": {"weight": W[:1].tolist(), "bias": B[:1].tolist()}, "hook": "attn_out",
     "layer": 0, "positions": [0, 3, -1]},
]


def check_against_hf(hf_model, saes, results):
    """Every item's values equal HF's activations read by the same probe / SAELens."""
    tokens = results[0]["token_ids"]
    positions = results[0]["positions"]
    assert positions == list(range(len(positions)))  # `all`: every fed position
    acts = hf_activations(hf_model, tokens)
    prompt_len = None
    for item, got in zip(ITEMS, results, strict=True):
        assert "error" not in got, got
        assert got["token_ids"] == [tokens[p] for p in got["positions"]]
        x = acts[(got["hook"], got["layer"])][got["positions"]].float()
        if "scores" in got:
            weight = W if item["reader"].get("name") else W[:1]
            bias = B if item["reader"].get("name") else B[:1]
            ref = x @ torch.from_numpy(weight).T + torch.from_numpy(bias)
            if item["reader"].get("name") == "ro-probe":
                ref = torch.sigmoid(ref)
            scale = max(1.0, float(ref.abs().max()))
            assert np.allclose(got["scores"], ref.numpy(), atol=1e-4 * scale), got
            continue
        arch = item["reader"]["name"].removeprefix("ro-sae-")
        with torch.no_grad():
            ref = saes[arch].encode(x)
        k, threshold = item["top_k"], item.get("threshold", 0.0)
        for row, pairs in zip(ref, got["features"], strict=True):
            values, ids = torch.sort(row, descending=True)
            want = [(int(i), float(v)) for i, v in zip(ids[:k], values[:k], strict=True)
                    if v > threshold]
            assert [f for f, _ in pairs] == [f for f, _ in want], (pairs, want)
            scale = max(1.0, max((abs(v) for _, v in want), default=1.0))
            assert np.allclose([v for _, v in pairs], [v for _, v in want], atol=1e-4 * scale)
        if got["hook"] == "resid_pre":  # positions "prompt"
            prompt_len = len(got["positions"])
    return prompt_len


