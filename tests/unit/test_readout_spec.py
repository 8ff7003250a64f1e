"""The request's `readout` field (api.md §7): every bad input is a 400 naming its path."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from sae_lens import StandardSAE, StandardSAEConfig

from capsteer.steering.readers.kinds import LinearProbe, SparseAutoencoder
from capsteer.steering.readers.readout import (
    DEFAULT_TOP_K,
    ReadoutItem,
    ReadoutSpecError,
    parse_readout,
    reader_of,
)
from capsteer.steering.readers.registry import ReaderRegistry, ReaderRegistryError

D, LAYERS, D_SAE = 8, 4, 32
W = np.random.default_rng(0).standard_normal((2, D)).astype(np.float32)


@pytest.fixture
def registry(tmp_path) -> ReaderRegistry:
    reg = ReaderRegistry(tmp_path / "readers", hidden_size=D)
    buf = io.BytesIO()
    np.savez(buf, weight=W, bias=np.array([0.5, -0.5], np.float32))
    reg.put("probe", buf.getvalue(), activation="sigmoid")
    sae = StandardSAE(StandardSAEConfig(d_in=D, d_sae=D_SAE))
    sae.cfg.metadata.hook_name = "blocks.2.hook_resid_mid"
    sae.save_model(reg.root / "sae")  # read by path from under the root
    ReaderRegistry(tmp_path / "other", hidden_size=D + 1).put("wide", json.dumps(
        {"weight": [[0.0] * (D + 1)]}).encode())
    (reg.root / "wide.safetensors").write_bytes((tmp_path / "other" / "wide.safetensors")
                                                .read_bytes())
    return reg


def parse(value, registry: ReaderRegistry | None):
    return parse_readout(value, num_layers=LAYERS, hidden_size=D,
                         lookup=registry.lookup if registry is not None else None)


def test_named_probe_and_sae_items(registry):
    items = parse([
        {"reader": {"name": "probe"}, "hook": "post_block", "layer": -1,
         "positions": "generated"},
        {"reader": {"name": "sae"}, "top_k": 8, "threshold": 0.25},
        {"reader": {"name": "sae"}, "hook": "resid_post", "layer": 1, "positions": [0, -1]},
    ], registry)
    probe, sae, sae_default = items
    assert (probe.index, probe.hook, probe.layer, probe.positions.kind) == \
        (0, "resid_post", LAYERS - 1, "generated")
    assert probe.reader.kind == "probe" and probe.reader.outputs == 2
    assert probe.top_k is None and probe.threshold is None and probe.probe is None
    # hook and layer default to the SAE's recorded blocks.2.hook_resid_mid
    assert (sae.hook, sae.layer, sae.top_k, sae.threshold) == ("resid_mid", 2, 8, 0.25)
    assert sae.reader.outputs == D_SAE and sae.reader.sha256
    assert (sae_default.top_k, sae_default.threshold) == (DEFAULT_TOP_K, 0.0)
    assert sae_default.positions.explicit == (-1, 0)


def test_inline_probe_and_wire_round_trip(registry):
    (item,) = parse([{"reader": {"weight": W.tolist(), "bias": [1.0, 2.0],
                                 "names": ["x", "y"], "activation": "softmax"},
                      "layer": 0}], registry)
    assert item.reader.name is None and item.probe is not None
    assert item.probe.names == ("x", "y") and item.probe.activation == "softmax"
    back = ReadoutItem.from_dict(json.loads(json.dumps(item.to_dict())))
    assert torch.equal(back.probe.weight, item.probe.weight)
    assert torch.equal(back.probe.bias, torch.tensor([1.0, 2.0]))
    assert (back.hook, back.layer, back.reader) == (item.hook, item.layer, item.reader)
    assert back.positions == item.positions
    sae_item = parse([{"reader": {"name": "sae"}, "layer": -1, "positions": [3, -2],
                       "top_k": 5, "threshold": 0.5}], registry)[0]
    again = ReadoutItem.from_dict(json.loads(json.dumps(sae_item.to_dict())))
    assert again.probe is None and again.reader == sae_item.reader
    assert (again.layer, again.positions.explicit, again.top_k, again.threshold) == \
        (LAYERS - 1, (-2, 3), 5, 0.5)


BAD = {
    "not-a-list": ({"reader": {"name": "probe"}}, "readout"),
    "empty": ([], "readout"),
    "item-not-object": (["probe"], "readout[0]"),
    "unknown-field": ([{"reader": {"name": "probe"}, "layer": 0, "scale": 2}],
                      "readout[0].scale"),
    "no-reader": ([{"layer": 0}], "readout[0].reader"),
    "unknown-reader": ([{"reader": {"name": "nope"}, "layer": 0}], "readout[0].reader.name"),
    "bad-name": ([{"reader": {"name": "../x"}, "layer": 0}], "readout[0].reader.name"),
    "name-not-str": ([{"reader": {"name": 3}, "layer": 0}], "readout[0].reader.name"),
    "other-width": ([{"reader": {"name": "wide"}, "layer": 0}], "readout[0].reader.name"),
    "inline-width": ([{"reader": {"weight": [[1.0] * (D + 2)]}, "layer": 0}],
                     "readout[0].reader.weight"),
    "inline-nan": ([{"reader": {"weight": [[float("nan")] * D]}, "layer": 0}],
                   "readout[0].reader.weight"),
    "inline-bias": ([{"reader": {"weight": W.tolist(), "bias": [1.0]}, "layer": 0}],
                    "readout[0].reader.bias"),
    "inline-text": ([{"reader": {"weight": "ones"}, "layer": 0}], "readout[0].reader.weight"),
    "inline-extra": ([{"reader": {"weight": W.tolist(), "w2": 1}, "layer": 0}],
                     "readout[0].reader.w2"),
    "bad-hook": ([{"reader": {"name": "probe"}, "hook": "post_mlp", "layer": 0}],
                 "readout[0].hook"),
    "no-layer": ([{"reader": {"name": "probe"}}], "readout[0].layer"),
    "layer-range": ([{"reader": {"name": "probe"}, "layer": LAYERS}], "readout[0].layer"),
    "layer-type": ([{"reader": {"name": "probe"}, "layer": "2"}], "readout[0].layer"),
    "positions-kind": ([{"reader": {"name": "probe"}, "layer": 0, "positions": "last"}],
                       "readout[0].positions"),
    "positions-list": ([{"reader": {"name": "probe"}, "layer": 0, "positions": [1, "a"]}],
                       "readout[0].positions"),
    "positions-empty": ([{"reader": {"name": "probe"}, "layer": 0, "positions": []}],
                        "readout[0].positions"),
    "top-k-zero": ([{"reader": {"name": "sae"}, "top_k": 0}], "readout[0].top_k"),
    "top-k-over": ([{"reader": {"name": "sae"}, "top_k": D_SAE + 1}], "readout[0].top_k"),
    "top-k-float": ([{"reader": {"name": "sae"}, "top_k": 2.5}], "readout[0].top_k"),
    "threshold-nan": ([{"reader": {"name": "sae"}, "threshold": float("nan")}],
                      "readout[0].threshold"),
    "top-k-on-probe": ([{"reader": {"name": "probe"}, "layer": 0, "top_k": 3}],
                       "readout[0].top_k"),
    "second-item": ([{"reader": {"name": "probe"}, "layer": 0},
                     {"reader": {"name": "sae"}, "layer": 9}], "readout[1].layer"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_readout_is_a_400_naming_the_field(registry, case):
    value, param = BAD[case]
    with pytest.raises(ReadoutSpecError) as err:
        parse(value, registry)
    assert err.value.status == 400 and err.value.param == param, err.value


def test_named_reader_without_a_registry_is_unknown():
    with pytest.raises(ReadoutSpecError) as err:
        parse([{"reader": {"name": "probe"}, "layer": 0}], None)
    assert err.value.param == "readout[0].reader.name"
    (item,) = parse([{"reader": {"weight": W[0].tolist()}, "layer": 0}], None)
    assert item.reader.outputs == 1


def test_reader_of_loads_what_was_checked(registry):
    probe_item, sae_item, inline = parse([
        {"reader": {"name": "probe"}, "layer": 0}, {"reader": {"name": "sae"}},
        {"reader": {"weight": W.tolist()}, "layer": 1}], registry)
    probe = reader_of(probe_item, registry)
    assert isinstance(probe, LinearProbe) and torch.equal(probe.weight, torch.from_numpy(W))
    assert probe.activation == "sigmoid"
    sae = reader_of(sae_item, registry)
    assert isinstance(sae, SparseAutoencoder) and sae.d_sae == D_SAE
    assert reader_of(inline, None) is inline.probe
    buf = io.BytesIO()
    np.save(buf, W[0])
    registry.put("probe", buf.getvalue())  # replaced after the request was checked
    with pytest.raises(ReaderRegistryError, match="replaced"):
        reader_of(probe_item, registry)
