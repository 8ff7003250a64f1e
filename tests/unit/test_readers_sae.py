"""SAE readers against SAELens itself: SAEs built and saved by SAELens (random weights,
`save_model`), uploaded as tar and zip, encode exactly as SAELens's `SAE.encode`."""

from __future__ import annotations

import io
import json
import tarfile
import zipfile
from pathlib import Path

import pytest
import torch
from sae_lens import (
    JumpReLUSAE,
    JumpReLUSAEConfig,
    StandardSAE,
    StandardSAEConfig,
    TopKSAE,
    TopKSAEConfig,
)

from capsteer.steering.readers.formats import ReaderFormatError, ReaderTooLargeError
from capsteer.steering.readers.kinds import (
    ReaderInputError,
    SparseAutoencoder,
    decoder_row,
    sae_encode,
    sae_top_k,
)
from capsteer.steering.readers.registry import ReaderRegistry, ReaderShape
from capsteer.steering.readers.sae import WEIGHTS_FILE

D_IN, D_SAE = 16, 48


def _sae(arch: str, seed: int = 0, **cfg):
    """A SAELens SAE with every parameter random (biases and thresholds too)."""
    cls, cfg_cls = {"standard": (StandardSAE, StandardSAEConfig),
                    "jumprelu": (JumpReLUSAE, JumpReLUSAEConfig),
                    "topk": (TopKSAE, TopKSAEConfig)}[arch]
    sae = cls(cfg_cls(d_in=D_IN, d_sae=D_SAE, **cfg))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sae.named_parameters():
            values = torch.randn(param.shape, generator=gen) * 0.5
            param.copy_(values.abs() * 0.3 if name == "threshold" else values)
    return sae


def _archive(directory: Path, fmt: str, prefix: str = "my-sae") -> bytes:
    """A tar.gz or zip of SAELens's saved directory, under a folder as users pack it."""
    buf = io.BytesIO()
    if fmt == "tar":
        with tarfile.open(fileobj=buf, mode="w:gz") as tf:
            tf.add(directory, arcname=prefix)
    else:
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
            for path in sorted(directory.iterdir()):
                zf.write(path, f"{prefix}/{path.name}")
    return buf.getvalue()


def _rows(n: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, D_IN, generator=torch.Generator().manual_seed(seed)) * 2.0


CASES = {
    "relu": ("standard", {}),
    "relu-no-bdec": ("standard", {"apply_b_dec_to_input": False}),
    "relu-layer-norm": ("standard", {"normalize_activations": "layer_norm"}),
    "relu-norm-rescale": ("standard", {"normalize_activations": "constant_norm_rescale"}),
    "jumprelu": ("jumprelu", {}),
    "topk": ("topk", {"k": 5}),
    "topk-rescaled": ("topk", {"k": 7, "rescale_acts_by_decoder_norm": True}),
}


@pytest.mark.parametrize("fmt", ["tar", "zip"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_registry_sae_encodes_as_saelens(tmp_path, case, fmt):
    arch, cfg = CASES[case]
    sae = _sae(arch, seed=len(case), **cfg)
    sae.save_model(tmp_path / "saved")
    registry = ReaderRegistry(tmp_path / "readers", hidden_size=D_IN)
    info = registry.put("sae-1", _archive(tmp_path / "saved", fmt))
    assert (info["kind"], info["architecture"], info["d_in"], info["d_sae"]) == \
        ("sae", arch, D_IN, D_SAE)
    assert info["source_format"] == fmt and info["error"] is None
    ours = registry.get("sae-1", sha256=info["sha256"])
    assert isinstance(ours, SparseAutoencoder) and ours.arch == arch
    x = _rows()
    want = sae.encode(x)
    got = sae_encode(x, ours)
    assert got.shape == (12, D_SAE)
    assert torch.equal(got, want), (got - want).abs().max()
    assert (want > 0).any() and (want == 0).any()  # the case exercises the activation
    torch.testing.assert_close(decoder_row(ours, 3), sae.W_dec[3].detach())


def test_encode_matches_saelens_in_bfloat16_and_on_zero_rows(tmp_path):
    sae = _sae("jumprelu", seed=3)
    sae.save_model(tmp_path / "saved")
    registry = ReaderRegistry(tmp_path / "readers", hidden_size=D_IN)
    registry.put("j", _archive(tmp_path / "saved", "zip"))
    ours = registry.get("j").to(dtype=torch.bfloat16)
    x = _rows(5)
    assert torch.equal(sae_encode(x, ours), sae.to(dtype=torch.bfloat16).encode(x))
    rescale = registry.get("j")
    rescale = SparseAutoencoder(**{**rescale.__dict__, "normalize": "constant_norm_rescale"})
    assert torch.isfinite(sae_encode(torch.zeros(2, D_IN), rescale)).all()  # padding rows


def test_top_k_has_fixed_shape_and_marks_dropped_entries():
    acts = torch.tensor([[0.0, 3.0, 0.5, 0.0, 2.0],
                         [0.0, 0.0, 0.0, 0.0, 0.0],
                         [1.0, 0.2, 0.0, 4.0, 0.0]])
    ids, values = sae_top_k(acts, 3, threshold=0.4)
    assert ids.shape == values.shape == (3, 3) and ids.dtype == torch.int64
    assert ids.tolist() == [[1, 4, 2], [-1, -1, -1], [3, 0, -1]]
    assert values.tolist() == [[3.0, 2.0, 0.5], [0.0, 0.0, 0.0], [4.0, 1.0, 0.0]]
    with pytest.raises(ReaderInputError) as err:
        sae_top_k(acts, 6)
    assert err.value.param == "top_k"
    with pytest.raises(ReaderInputError):
        sae_top_k(acts, 0)


def test_sae_encode_runs_in_a_compiled_graph_without_recompiles(tmp_path):
    """No data-dependent shapes or host syncs: one full graph, outputs shaped by n only."""
    sae = _sae("topk", k=4)
    sae.save_model(tmp_path / "saved")
    registry = ReaderRegistry(tmp_path / "readers", hidden_size=D_IN)
    registry.put("t", _archive(tmp_path / "saved", "tar"))
    ours = registry.get("t")

    def readout(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return sae_top_k(sae_encode(x, ours), 4, 0.0)

    compiled = torch.compile(readout, fullgraph=True, backend="eager")
    x = _rows(6)
    ids, values = compiled(x)
    want_ids, want_values = readout(x)
    assert torch.equal(ids, want_ids) and torch.equal(values, want_values)


def test_decoder_row_refuses_features_out_of_range(tmp_path):
    sae = _sae("standard")
    sae.save_model(tmp_path / "saved")
    registry = ReaderRegistry(tmp_path / "readers", hidden_size=D_IN)
    registry.put("s", _archive(tmp_path / "saved", "tar"))
    ours = registry.get("s")
    for bad in (D_SAE, -1, True, 1.5):
        with pytest.raises(ReaderInputError) as err:
            decoder_row(ours, bad, param="steering.vectors[0].vector.feature")
        assert err.value.param == "steering.vectors[0].vector.feature"


def test_wrong_width_and_non_finite_saes_are_refused_naming_the_field(tmp_path):
    registry = ReaderRegistry(tmp_path / "readers", hidden_size=D_IN + 1)
    sae = _sae("standard")
    sae.save_model(tmp_path / "saved")
    with pytest.raises(ReaderFormatError) as err:
        registry.put("w", _archive(tmp_path / "saved", "tar"))
    assert err.value.param == "d_in" and "hidden size" in str(err.value)
    registry = ReaderRegistry(tmp_path / "readers2", hidden_size=D_IN)
    with torch.no_grad():
        sae.W_enc[0, 0] = float("nan")
    sae.save_model(tmp_path / "nan")
    with pytest.raises(ReaderFormatError) as err:
        registry.put("n", _archive(tmp_path / "nan", "zip"))
    assert err.value.param == "W_enc"
    assert registry.names() == []


def _tar_with(members: list[tarfile.TarInfo], data: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for info in members:
            payload = data.get(info.name)
            if payload is not None:
                info.size = len(payload)
            tf.addfile(info, io.BytesIO(payload) if payload is not None else None)
    return buf.getvalue()


def test_archives_that_could_escape_or_lie_are_refused(tmp_path):
    sae = _sae("standard")
    sae.save_model(tmp_path / "saved")
    cfg = (tmp_path / "saved" / "cfg.json").read_bytes()
    weights = (tmp_path / "saved" / WEIGHTS_FILE).read_bytes()
    registry = ReaderRegistry(tmp_path / "readers", hidden_size=D_IN)

    escape = _tar_with([tarfile.TarInfo("../cfg.json"), tarfile.TarInfo(f"../{WEIGHTS_FILE}")],
                       {"../cfg.json": cfg, f"../{WEIGHTS_FILE}": weights})
    link = tarfile.TarInfo(WEIGHTS_FILE)
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
    symlinked = _tar_with([tarfile.TarInfo("cfg.json"), link], {"cfg.json": cfg})
    absolute = io.BytesIO()
    with zipfile.ZipFile(absolute, "w") as zf:
        zf.writestr("/abs/cfg.json", cfg)
        zf.writestr(f"/abs/{WEIGHTS_FILE}", weights)
    two_cfgs = io.BytesIO()
    with zipfile.ZipFile(two_cfgs, "w") as zf:
        for folder in ("a", "b"):
            zf.writestr(f"{folder}/cfg.json", cfg)
            zf.writestr(f"{folder}/{WEIGHTS_FILE}", weights)
    no_weights = io.BytesIO()
    with zipfile.ZipFile(no_weights, "w") as zf:
        zf.writestr("cfg.json", cfg)
    for blob in (escape, symlinked, absolute.getvalue(), two_cfgs.getvalue(),
                 no_weights.getvalue()):
        with pytest.raises(ReaderFormatError) as err:
            registry.put("bad", blob)
        assert err.value.param == "body", err.value
    assert not (tmp_path / "cfg.json").exists()
    assert registry.names() == [] and [p.name for p in registry.root.iterdir()] == []


def test_members_over_the_limits_are_refused(tmp_path, monkeypatch):
    from capsteer.steering.readers import sae as sae_module

    sae = _sae("standard")
    sae.save_model(tmp_path / "saved")
    monkeypatch.setattr(sae_module, "MAX_SAE_BYTES", 1024)  # far below the weights file
    registry = ReaderRegistry(tmp_path / "readers", hidden_size=D_IN)
    with pytest.raises(ReaderTooLargeError):
        registry.put("big", _archive(tmp_path / "saved", "zip"))


def test_pre_6_saelens_configs_load_like_saelens(tmp_path):
    """An old config (hook_point, activation_fn_kwargs.k, boolean normalization) and a
    JumpReLU with log_threshold read as SAELens's loader reads them."""
    sae = _sae("topk", k=3)
    sae.save_model(tmp_path / "topk")
    old = {"d_in": D_IN, "d_sae": D_SAE, "dtype": "float32", "device": "cpu",
           "hook_point": "blocks.2.hook_resid_pre", "activation_fn_str": "topk",
           "activation_fn_kwargs": {"k": 3}, "normalize_activations": False,
           "model_name": "tiny"}
    (tmp_path / "topk" / "cfg.json").write_text(json.dumps(old))
    registry = ReaderRegistry(tmp_path / "readers", hidden_size=D_IN)
    info = registry.put("old-topk", _archive(tmp_path / "topk", "tar"))
    assert info["config"]["k"] == 3 and info["config"]["hook_name"] == "blocks.2.hook_resid_pre"
    x = _rows()
    assert torch.equal(sae_encode(x, registry.get("old-topk")), sae.encode(x))
    assert registry.shape("old-topk") == ReaderShape("old-topk", "sae", D_IN, D_SAE,
                                                     info["sha256"], "blocks.2.hook_resid_pre")

    jump = _sae("jumprelu", seed=5)
    jump.save_model(tmp_path / "jump")
    from safetensors.torch import load_file, save_file

    tensors = load_file(tmp_path / "jump" / WEIGHTS_FILE)
    tensors["log_threshold"] = torch.log(tensors.pop("threshold"))
    save_file(tensors, tmp_path / "jump" / WEIGHTS_FILE)
    registry.put("log-thr", _archive(tmp_path / "jump", "zip"))
    torch.testing.assert_close(sae_encode(x, registry.get("log-thr")), jump.encode(x))


def test_an_saelens_directory_under_the_root_is_read_by_path(tmp_path):
    registry = ReaderRegistry(tmp_path / "readers", hidden_size=D_IN)
    sae = _sae("jumprelu", seed=9)
    sae.save_model(registry.root / "placed")
    info = registry.info("placed")
    assert (info["storage"], info["kind"], info["d_sae"], info["error"]) == \
        ("directory", "sae", D_SAE, None)
    x = _rows()
    assert torch.equal(sae_encode(x, registry.get("placed")), sae.encode(x))
    assert registry.names() == ["placed"]
    (registry.root / "placed" / "cfg.json").write_text(json.dumps(
        {**json.loads((registry.root / "placed" / "cfg.json").read_text()), "d_in": 99}))
    assert "hidden size" in registry.info("placed")["error"]  # re-read once changed
    assert registry.delete("placed") and registry.names() == []
