"""Named vectors and readers as wide as the hook they act at (mlp_post: d_mlp), not the
hidden size: stored at their own width, refused at upload when no hook of the model has
it, checked against the hook a request names (a 400 naming the field and both widths)."""

from __future__ import annotations

import io
import json
import tarfile

import numpy as np
import pytest
import torch

from capsteer.hooks import HEADS_KEY, describe_widths, width_table
from capsteer.steering.formats import VectorFormatError
from capsteer.steering.readers.formats import ReaderFormatError
from capsteer.steering.readers.readout import ReadoutSpecError, parse_readout
from capsteer.steering.readers.registry import ReaderRegistry
from capsteer.steering.registry import VectorReader, VectorRegistry
from capsteer.steering.spec import SteeringSpecError, parse_steering_spec
from tests.upload_bodies import npz_bytes

HIDDEN, D_MLP, EXPERTS, LAYERS = 8, 24, 4, 3
WIDTHS = {"mlp_post": D_MLP, "attn_z": HIDDEN, HEADS_KEY: 2}
MOE_WIDTHS = {**WIDTHS, "router_logits": EXPERTS}
RNG = np.random.default_rng(5)
MLP_VEC = RNG.standard_normal(D_MLP).astype(np.float32)
PROBE_W = RNG.standard_normal((2, D_MLP)).astype(np.float32)
PROBE_B = RNG.standard_normal(2).astype(np.float32)


def _npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


@pytest.fixture
def vectors(tmp_path):
    return VectorRegistry(tmp_path / "vectors", hidden_size=HIDDEN, num_layers=LAYERS,
                          hook_widths=MOE_WIDTHS)


@pytest.fixture
def readers(tmp_path):
    return ReaderRegistry(tmp_path / "readers", hidden_size=HIDDEN, hook_widths=MOE_WIDTHS)


def _steer(vector: object, hook: str, lookup, layer: int = 1):
    return parse_steering_spec({"vectors": [{"hook": hook, "layer": layer, "vector": vector,
                                             "scale": 2.0}]},
                               num_layers=LAYERS, hidden_size=HIDDEN, lookup=lookup,
                               widths=WIDTHS)


def test_width_table_names_each_hook_the_model_has():
    table = width_table(HIDDEN, MOE_WIDTHS, {"resid_mid": "parallel block"})
    assert table["mlp_post"] == D_MLP and table["router_logits"] == EXPERTS
    assert "resid_mid" not in table and HEADS_KEY not in table
    assert "router_logits" not in width_table(HIDDEN, MOE_WIDTHS, steerable=True)
    assert "router_logits" not in width_table(HIDDEN, WIDTHS)  # a dense model has none
    assert describe_widths(table, HIDDEN) == (
        "4 (router_logits), 8 (the hidden size: resid_pre, resid_post, attn_out, mlp_out, "
        "mlp_in, attn_z), 24 (mlp_post)")


def test_a_d_mlp_vector_is_stored_at_its_width_and_listed_so(vectors, tmp_path):
    info = vectors.put("mlpdir", _npy(MLP_VEC))
    assert info["error"] is None and info["width"] == D_MLP and info["hooks"] == ["mlp_post"]
    per_layer = {"layers": {"0": MLP_VEC.tolist(), "2": (-MLP_VEC).tolist()}}
    assert vectors.put("mlpstack", json.dumps(per_layer).encode())["width"] == D_MLP
    vectors.put("stream", _npy(MLP_VEC[:HIDDEN]))
    listed = {e["name"]: e for e in vectors.list()}
    assert {n: (e["width"], e["hooks"]) for n, e in listed.items()} == {
        "mlpdir": (D_MLP, ["mlp_post"]), "mlpstack": (D_MLP, ["mlp_post"]),
        "stream": (HIDDEN, ["resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out",
                            "mlp_in", "attn_z"])}
    assert np.array_equal(vectors.get("mlpdir").single, MLP_VEC)
    # a worker's reader of the same directory serves it by its content sha256
    named = vectors.lookup_named("mlpdir")
    worker = VectorReader(tmp_path / "vectors", hidden_size=HIDDEN, num_layers=LAYERS,
                          hook_widths=WIDTHS)
    assert np.array_equal(worker("mlpdir", named.sha256), MLP_VEC)


@pytest.mark.parametrize("body,match", [
    (_npy(np.ones(10, np.float32)), r"width of one of this model's hooks: 8 \(the hidden "
                                    r"size: .*\), 24 \(mlp_post\), found shape \[10\]"),
    # router_logits is read, never steered: its width is no vector's
    (_npy(np.ones(EXPERTS, np.float32)), r"found shape \[4\]"),
    (json.dumps({"layers": {"0": [0.5] * D_MLP, "1": [0.5] * HIDDEN}}).encode(),
     r"width 24 \(as the upload's other vectors\), found shape \[8\]"),
    (_npy(np.full(D_MLP, np.nan, np.float32)), "finite"),
])
def test_a_vector_of_no_hooks_width_is_refused_at_upload(vectors, body, match):
    with pytest.raises(VectorFormatError, match=match):
        vectors.put("bad", body)
    assert vectors.names() == []


@pytest.mark.parametrize("by_reference", [False, True])
def test_a_named_vector_steers_its_hook_as_the_same_vector_inline(vectors, by_reference):
    vectors.put("mlpdir", _npy(MLP_VEC))
    lookup = vectors.lookup_named if by_reference else vectors.lookup
    named = _steer({"name": "mlpdir"}, "mlp_post", lookup)
    inline = _steer(MLP_VEC.tolist(), "mlp_post", None)
    assert [(o.hook, o.layer) for o in named.ops] == [("mlp_post", 1)]
    assert np.array_equal(named.ops[0].vector, inline.ops[0].vector)
    assert named.sharing_key == inline.sharing_key
    with pytest.raises(SteeringSpecError) as err:
        _steer({"name": "mlpdir"}, "resid_post", lookup)
    assert err.value.field == "steering.vectors[0].vector"
    assert err.value.reason == ("vector 'mlpdir' has width 24; resid_post is 8 wide at "
                                "this model (its hidden size)")
    vectors.put("stream", _npy(MLP_VEC[:HIDDEN]))
    with pytest.raises(SteeringSpecError) as err:
        _steer({"name": "stream"}, "mlp_post", lookup)
    assert err.value.field == "steering.vectors[0].vector"
    assert err.value.reason == "vector 'stream' has width 8; mlp_post is 24 wide at this model"


def test_an_inline_vector_of_another_width_names_the_hooks_width():
    with pytest.raises(SteeringSpecError) as err:
        _steer([0.5] * HIDDEN, "mlp_post", None)
    assert err.value.field == "steering.vectors[0].vector"
    assert err.value.reason == "vector has width 8; mlp_post is 24 wide at this model"


def _sae_tar(tmp_path, d_in: int) -> bytes:
    """A SAELens (6.x) saved directory, tarred: cfg.json and sae_weights.safetensors."""
    from safetensors.torch import save_file  # SAELens's weights file format

    directory = tmp_path / f"sae-{d_in}"
    directory.mkdir()
    (directory / "cfg.json").write_text(json.dumps({
        "architecture": "standard", "d_in": d_in, "d_sae": 32, "sae_lens_version": "6.5.0",
        "apply_b_dec_to_input": True, "normalize_activations": "none",
        "metadata": {"hook_name": "blocks.0.mlp.hook_post"}}))
    gen = torch.Generator().manual_seed(d_in)
    weights = {"W_enc": torch.randn(d_in, 32, generator=gen),
               "b_enc": torch.randn(32, generator=gen),
               "W_dec": torch.randn(32, d_in, generator=gen),
               "b_dec": torch.randn(d_in, generator=gen)}
    save_file(weights, str(directory / "sae_weights.safetensors"))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        tf.add(directory, arcname="sae")
    return buf.getvalue()


def test_readers_are_stored_at_their_width(readers, tmp_path):
    probe = readers.put("mlp-probe", npz_bytes(weight=PROBE_W, bias=PROBE_B))
    assert probe["error"] is None and probe["d_in"] == D_MLP and probe["hooks"] == ["mlp_post"]
    sae = readers.put("mlp-sae", _sae_tar(tmp_path, D_MLP))
    assert sae["error"] is None and sae["d_in"] == D_MLP and sae["hooks"] == ["mlp_post"]
    router = readers.put("router", _npy(np.ones(EXPERTS, np.float32)))
    assert router["d_in"] == EXPERTS and router["hooks"] == ["router_logits"]
    got = readers.get("mlp-probe")
    assert torch.equal(got.weight, torch.from_numpy(PROBE_W))
    assert readers.get("mlp-sae").d_in == D_MLP
    assert {r["name"]: r["d_in"] for r in readers.list()} == {
        "mlp-probe": D_MLP, "mlp-sae": D_MLP, "router": EXPERTS}
    # a registry of another model (other widths) keeps them, marked unusable
    other = ReaderRegistry(tmp_path / "readers", hidden_size=HIDDEN, hook_widths={})
    assert "no hook of this model has that width" in other.info("mlp-probe")["error"]


def test_a_reader_of_no_hooks_width_is_refused_at_upload(readers, tmp_path):
    with pytest.raises(ReaderFormatError) as err:
        readers.put("odd", npz_bytes(weight=np.ones((2, 10), np.float32)))
    assert err.value.param == "weight"
    assert "d the width of a hook it reads: 4 (router_logits), 8 (the hidden size" in str(
        err.value) and "24 (mlp_post)" in str(err.value)
    with pytest.raises(ReaderFormatError) as err:
        readers.put("odd-sae", _sae_tar(tmp_path, 10))
    assert err.value.param == "d_in" and "d_in is 10, but no hook" in str(err.value)
    with pytest.raises(ReaderFormatError, match="finite"):
        readers.put("nan", npz_bytes(weight=np.full((1, D_MLP), np.nan, np.float32)))
    assert readers.names() == []


def _readout(hook: str, lookup, reader=None):
    return parse_readout([{"reader": reader or {"name": "mlp-probe"}, "hook": hook,
                           "layer": 0}], num_layers=LAYERS, hidden_size=HIDDEN,
                         lookup=lookup, widths=WIDTHS)


def test_a_named_reader_reads_its_hook_and_no_other(readers):
    readers.put("mlp-probe", npz_bytes(weight=PROBE_W, bias=PROBE_B))
    (item,) = _readout("mlp_post", readers.lookup)
    assert item.reader.d_in == D_MLP and item.hook == "mlp_post"
    with pytest.raises(ReadoutSpecError) as err:
        _readout("resid_post", readers.lookup)
    assert err.value.param == "readout[0].reader.name"
    assert err.value.reason == ("reader 'mlp-probe' reads width 24; resid_post is 8 wide "
                                "at this model (its hidden size)")
    inline = {"weight": PROBE_W.tolist(), "bias": PROBE_B.tolist()}
    assert _readout("mlp_post", None, inline)[0].reader.d_in == D_MLP
    with pytest.raises(ReadoutSpecError) as err:
        _readout("resid_post", None, inline)
    assert err.value.param == "readout[0].reader.weight"


def test_a_gate_reads_a_reader_of_its_hooks_width(readers):
    readers.put("mlp-probe", npz_bytes(weight=PROBE_W[:1], bias=PROBE_B[:1]))
    when = {"reader": {"name": "mlp-probe"}, "above": 0.0}

    def steer(hook: str, width: int):
        return parse_steering_spec({"vectors": [{"hook": hook, "layer": 0, "when": when,
                                                 "vector": [0.5] * width}]},
                                   num_layers=LAYERS, hidden_size=HIDDEN,
                                   readers=readers.tensors, widths=WIDTHS)
    (op,) = steer("mlp_post", D_MLP).ops
    assert np.allclose(op.gate, PROBE_W[0])
    with pytest.raises(SteeringSpecError) as err:
        steer("resid_post", HIDDEN)
    assert err.value.field == "steering.vectors[0].when.reader.name"
    assert "reads width 24; resid_post is 8 wide at this model" in err.value.reason


def test_the_schema_bounds_a_vector_by_the_hook_widths():
    import jsonschema  # vLLM's dependency; only schema tests validate with it

    from capsteer.server.openapi import STEERING, for_model

    fields = for_model({"steering": STEERING}, hidden_size=HIDDEN, num_layers=LAYERS,
                       max_model_len=64, widths=width_table(HIDDEN, MOE_WIDTHS,
                                                            steerable=True))
    ok = jsonschema.Draft202012Validator({"type": "object", "properties": fields}).is_valid
    for width, valid in ((HIDDEN, True), (D_MLP, True), (HIDDEN - 1, False),
                         (D_MLP + 1, False)):
        body = {"steering": {"vectors": [{"hook": "mlp_post", "layer": 0,
                                          "vector": [0.5] * width}]}}
        assert ok(body) == valid, width
    assert "24 (mlp_post)" in json.dumps(fields)


def test_attn_z_of_its_own_width_and_an_saes_recorded_hook(tmp_path):
    """Gemma-like: heads * d_head (2 x 6) is not the hidden size; an SAE that records
    SAELens's `blocks.0.mlp.hook_post` reads mlp_post by default."""
    widths = {"mlp_post": D_MLP, "attn_z": 12, HEADS_KEY: 2}
    reg = VectorRegistry(tmp_path / "vectors", hidden_size=HIDDEN, num_layers=LAYERS,
                         hook_widths=widths)
    z = RNG.standard_normal(12).astype(np.float32)
    assert reg.put("heads", _npy(z))["hooks"] == ["attn_z"]
    spec = parse_steering_spec({"vectors": [{"hook": "attn_z", "layer": 0, "vector": {
        "name": "heads"}}]}, num_layers=LAYERS, hidden_size=HIDDEN, lookup=reg.lookup,
        widths=widths)
    assert np.array_equal(spec.ops[0].vector, z)
    with pytest.raises(SteeringSpecError, match="'heads' has width 12; mlp_post is 24 wide"):
        parse_steering_spec({"vectors": [{"hook": "mlp_post", "layer": 0, "vector": {
            "name": "heads"}}]}, num_layers=LAYERS, hidden_size=HIDDEN, lookup=reg.lookup,
            widths=widths)
    readers = ReaderRegistry(tmp_path / "readers", hidden_size=HIDDEN, hook_widths=widths)
    readers.put("mlp-sae", _sae_tar(tmp_path, D_MLP))
    (item,) = parse_readout([{"reader": {"name": "mlp-sae"}}], num_layers=LAYERS,
                            hidden_size=HIDDEN, lookup=readers.lookup, widths=widths)
    assert (item.hook, item.layer, item.reader.d_in) == ("mlp_post", 0, D_MLP)
