"""`when` gates and SAE-feature vectors (api.md §7): the host's conversion of each
reader's rule into one linear test, the parse errors, the wire form, and the runtime's
gated steering in host and dense (graph-safe) modes."""

from __future__ import annotations

import io
import json
import math
import tarfile

import numpy as np
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

from capsteer.engine_ext.plan import build_step_plan, compose_entries
from capsteer.engine_ext.runtime import SUB, HookRuntime
from capsteer.steering.conditions import parse_when
from capsteer.steering.readers.kinds import LinearProbe
from capsteer.steering.readers.registry import ReaderRegistry
from capsteer.steering.spec import SteeringSpec, SteeringSpecError, parse_steering_spec

from .helpers import HIDDEN, LAYERS, hooks_for, probe_readers

D_SAE = 24


def _saelens(arch: str, seed: int, **cfg):
    """A SAELens SAE with every parameter random (biases and thresholds too)."""
    cls, cfg_cls = {"standard": (StandardSAE, StandardSAEConfig),
                    "jumprelu": (JumpReLUSAE, JumpReLUSAEConfig),
                    "topk": (TopKSAE, TopKSAEConfig)}[arch]
    sae = cls(cfg_cls(d_in=HIDDEN, d_sae=D_SAE, **cfg))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sae.named_parameters():
            values = torch.randn(param.shape, generator=gen) * 0.5
            param.copy_(values.abs() * 0.3 if name == "threshold" else values)
    return sae


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    """Readers as the server holds them: SAELens SAEs saved by SAELens and uploaded as
    tars, and probes uploaded as JSON."""
    root = tmp_path_factory.mktemp("readers")
    reg = ReaderRegistry(root / "store", hidden_size=HIDDEN)
    saes = {"relu": _saelens("standard", 1), "jump": _saelens("jumprelu", 2),
            "relu-nobdec": _saelens("standard", 3, apply_b_dec_to_input=False),
            "topk": _saelens("topk", 4, k=3),
            "relu-ln": _saelens("standard", 5, normalize_activations="layer_norm")}
    for name, sae in saes.items():
        sae.save_model(str(root / name))
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tf:
            tf.add(root / name, arcname=name)
        reg.put(name, buf.getvalue(), "tar")
    gen = torch.Generator().manual_seed(9)
    for name, k, act in (("lin", 3, "none"), ("sig", 2, "sigmoid"), ("soft2", 2, "softmax"),
                         ("soft1", 1, "softmax"), ("soft3", 3, "softmax")):
        body = {"weight": torch.randn(k, HIDDEN, generator=gen).tolist(),
                "bias": (torch.randn(k, generator=gen) * 0.3).tolist(), "activation": act}
        reg.put(name, json.dumps(body).encode(), "json")
    reg.saelens = saes  # the SAELens objects, for their own encode
    return reg


def _rows(n: int = 400, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed)) * 1.5


def _gate_passes(gate, rows: torch.Tensor) -> torch.Tensor:
    g, b = gate
    return rows.double() @ torch.from_numpy(g).double() + b > 0


SCORE_CASES = [  # reader, index, sense, threshold
    ("lin", 2, "above", 0.3), ("lin", 0, "below", -0.5), ("sig", 1, "above", 0.7),
    ("sig", 0, "below", 0.2), ("soft2", 0, "above", 0.6), ("soft2", 1, "below", 0.45),
    ("relu", 5, "above", 0.2), ("relu", 7, "below", 0.4), ("relu", 3, "above", 0.0),
    ("jump", 4, "above", 0.0), ("jump", 6, "above", 0.5), ("jump", 2, "below", 0.3),
    ("relu-nobdec", 1, "above", 0.1),
]


@pytest.mark.parametrize(("name", "index", "sense", "x"), SCORE_CASES,
                         ids=[f"{n}-{i}-{s}-{x}" for n, i, s, x in SCORE_CASES])
def test_each_readers_rule_becomes_one_linear_test(registry, name, index, sense, x):
    """The gate passes exactly where the reader's own score (SAELens's encode for SAEs)
    passes the test, on rows where both outcomes occur."""
    gate = parse_when({"reader": {"name": name}, "index": index, sense: x}, "when", HIDDEN,
                      registry.get)
    rows = _rows()
    if name in registry.saelens:
        with torch.no_grad():
            score = registry.saelens[name].encode(rows)[:, index]
    else:
        score = registry.get(name).scores(rows)[:, index]
    want = score > x if sense == "above" else score < x
    got = _gate_passes(gate, rows)
    assert 0 < int(want.sum()) < len(rows)
    assert torch.equal(got, want)


@pytest.mark.parametrize(("name", "index", "sense", "x", "always"), [
    ("sig", 0, "above", 0.0, True), ("sig", 0, "above", 1.0, False),
    ("sig", 0, "below", 1.5, True), ("soft1", 0, "above", 0.5, True),
    ("soft1", 0, "below", 0.5, False), ("relu", 0, "above", -1.0, True),
    ("relu", 0, "below", 0.0, False), ("jump", 0, "below", -2.0, False),
])
def test_tests_a_score_cannot_fail_or_pass_are_constant(registry, name, index, sense, x,
                                                         always):
    g, b = parse_when({"reader": {"name": name}, "index": index, sense: x}, "when", HIDDEN,
                      registry.get)
    assert not g.any() and (b > 0) == always


BAD_WHEN = [
    ({"reader": {"name": "nope"}, "index": 0, "above": 1}, ".when.reader.name", "unknown"),
    ({"reader": "lin", "index": 0, "above": 1}, ".when.reader", "name"),
    ({"reader": {"name": "lin"}, "index": 3, "above": 1}, ".when.index", "0..2"),
    ({"reader": {"name": "relu"}, "index": D_SAE, "above": 1}, ".when.index", "feature"),
    ({"reader": {"name": "lin"}, "index": -1, "above": 1}, ".when.index", "0..2"),
    ({"reader": {"name": "lin"}, "index": True, "above": 1}, ".when.index", "integer"),
    ({"reader": {"name": "lin"}, "above": 1}, ".when.index", "required"),
    ({"reader": {"name": "lin"}, "index": 0}, ".when", "exactly one"),
    ({"reader": {"name": "lin"}, "index": 0, "above": 1, "below": 2}, ".when", "exactly one"),
    ({"reader": {"name": "lin"}, "index": 0, "above": float("nan")}, ".when.above", "finite"),
    ({"reader": {"name": "lin"}, "index": 0, "below": float("inf")}, ".when.below", "finite"),
    ({"reader": {"name": "lin"}, "index": 0, "above": "1"}, ".when.above", "number"),
    ({"reader": {"name": "topk"}, "index": 0, "above": 1}, ".when.reader.name", "TopK"),
    ({"reader": {"name": "relu-ln"}, "index": 0, "above": 1}, ".when.reader.name",
     "normalizes"),
    ({"reader": {"name": "soft3"}, "index": 0, "above": 0.5}, ".when.reader.name", "softmax"),
    ({"reader": {"name": "lin"}, "index": 0, "above": 1, "colour": 1}, ".when.colour",
     "unknown"),
    ([1, 2], ".when", "object"),
]


@pytest.mark.parametrize(("when", "field", "words"), BAD_WHEN,
                         ids=[f"{i}-{f}" for i, (_, f, _) in enumerate(BAD_WHEN)])
def test_a_bad_when_is_a_400_naming_the_field(registry, when, field, words):
    item = {"hook": "resid_post", "layer": 0, "vector": [1.0] * HIDDEN, "when": when}
    with pytest.raises(SteeringSpecError) as err:
        parse_steering_spec({"vectors": [item]}, num_layers=LAYERS, hidden_size=HIDDEN,
                            readers=registry.get)
    assert err.value.field == "steering.vectors[0]" + field
    assert words in err.value.reason


def test_a_reader_of_another_width_is_refused(registry):
    wide = LinearProbe(torch.ones(1, HIDDEN + 1), torch.zeros(1))
    for item in ({"layer": 0, "vector": [1.0] * HIDDEN,
                  "when": {"reader": {"name": "w"}, "above": 0}},
                 {"layer": 0, "vector": {"reader": "w", "feature": 0}}):
        with pytest.raises(SteeringSpecError) as err:
            parse_steering_spec({"vectors": [item]}, num_layers=LAYERS, hidden_size=HIDDEN,
                                readers={"w": wide}.__getitem__)
        assert "width" in err.value.reason and err.value.field.endswith(("name", "reader"))


def test_sae_feature_vector_is_the_decoder_row(registry):
    row = registry.saelens["jump"].W_dec[11].detach()
    by_feature = parse_steering_spec(
        {"vectors": [{"layer": 1, "vector": {"reader": "jump", "feature": 11}, "scale": 3.0,
                      "op": "add"}]},
        num_layers=LAYERS, hidden_size=HIDDEN, readers=registry.get)
    inline = parse_steering_spec({"vectors": [{"layer": 1, "vector": row.tolist(), "scale": 3.0}]},
                                 num_layers=LAYERS, hidden_size=HIDDEN)
    assert by_feature.sharing_key == inline.sharing_key
    np.testing.assert_array_equal(by_feature.ops[0].vector, row.numpy())


@pytest.mark.parametrize(("vector", "field", "words"), [
    ({"reader": "nope", "feature": 0}, ".vector.reader", "unknown"),
    ({"reader": "lin", "feature": 0}, ".vector.reader", "not an SAE"),
    ({"reader": "relu", "feature": D_SAE}, ".vector.feature", "feature"),
    ({"reader": "relu", "feature": -1}, ".vector.feature", "feature"),
    ({"reader": "relu", "feature": 1.0}, ".vector.feature", "integer"),
    ({"reader": "relu"}, ".vector.feature", "required"),
    ({"reader": "relu", "feature": 0, "x": 1}, ".vector.x", "unknown"),
    ({"reader": 3, "feature": 0}, ".vector.reader", "string"),
])
def test_a_bad_sae_feature_vector_names_the_field(registry, vector, field, words):
    with pytest.raises(SteeringSpecError) as err:
        parse_steering_spec({"vectors": [{"layer": 0, "vector": vector}]}, num_layers=LAYERS,
                            hidden_size=HIDDEN, readers=registry.get)
    assert err.value.field == "steering.vectors[0]" + field and words in err.value.reason


def test_no_reader_registry_is_a_400():
    with pytest.raises(SteeringSpecError, match="no reader registry"):
        parse_steering_spec({"vectors": [{"layer": 0, "vector": {"reader": "a", "feature": 0}}]},
                            num_layers=LAYERS, hidden_size=HIDDEN)


def test_items_at_one_point_must_share_their_when(registry):
    when = {"reader": {"name": "lin"}, "index": 0, "above": 0.1}
    gated = {"hook": "resid_post", "layer": 0, "vector": [1.0] * HIDDEN, "when": when}
    for other in ({"hook": "resid_pre", "layer": 1, "vector": [0.5] * HIDDEN},  # same point
                  {**gated, "when": {**when, "above": 0.2}}):
        with pytest.raises(SteeringSpecError) as err:
            parse_steering_spec({"vectors": [gated, other]}, num_layers=LAYERS,
                                hidden_size=HIDDEN, readers=registry.get)
        assert err.value.field == "steering.vectors[1].when"
    # The same `when` twice, or another position class, or another point: fine.
    for other in (gated, {**gated, "layer": 1}, {"hook": "resid_post", "layer": 0,
                                                  "positions": "prompt", "vector": [2.0] * HIDDEN}):
        if other.get("positions") == "prompt":
            gated_gen = {**gated, "positions": "generated"}
            parse_steering_spec({"vectors": [gated_gen, other]}, num_layers=LAYERS,
                                hidden_size=HIDDEN, readers=registry.get)
            continue
        parse_steering_spec({"vectors": [gated, other]}, num_layers=LAYERS, hidden_size=HIDDEN,
                            readers=registry.get)


def test_the_wire_form_carries_the_gate_and_the_salt_tells_it_apart(registry):
    item = {"hook": "mlp_out", "layer": 1, "vector": [1.0] * HIDDEN, "scale": 2.0}
    when = {"reader": {"name": "relu"}, "index": 3, "above": 0.25}
    plain = parse_steering_spec({"vectors": [item]}, num_layers=LAYERS, hidden_size=HIDDEN)
    gated = parse_steering_spec({"vectors": [{**item, "when": when}]}, num_layers=LAYERS,
                                hidden_size=HIDDEN, readers=registry.get)
    again = parse_steering_spec({"vectors": [{**item, "when": when}]}, num_layers=LAYERS,
                                hidden_size=HIDDEN, readers=registry.get)
    assert "gate" not in plain.to_dict()["ops"][0]  # ungated specs keep their old form
    assert gated.sharing_key == again.sharing_key != plain.sharing_key
    assert gated.cache_salt() == again.cache_salt() != plain.cache_salt()
    back = SteeringSpec.from_wire(gated.wire_text)
    np.testing.assert_array_equal(back.ops[0].gate, gated.ops[0].gate)
    assert back.ops[0].gate_bias == gated.ops[0].gate_bias and back.sharing_key == gated.sharing_key
    ((key, (_, _, _, gate, _)), *_) = compose_entries(back, HIDDEN, LAYERS).items()
    assert key[:2] == (SUB, 4) and torch.equal(gate[0], torch.from_numpy(gated.ops[0].gate))
    assert compose_entries(plain, HIDDEN, LAYERS)[key][3] is None


def test_requests_with_one_gated_spec_share_entries_and_free_them(registry):
    rt = HookRuntime(LAYERS, HIDDEN, torch.float32, torch.device("cpu"), max_tokens=16,
                     max_requests=4, device_driven=True)
    steering = {"vectors": [{"layer": 0, "vector": [0.5] * HIDDEN,
                             "when": {"reader": {"name": "lin"}, "index": 1, "below": 0.0}}]}
    a = hooks_for("a", 3, rt=rt, steering=steering, readers=registry.get)
    b = hooks_for("b", 3, rt=rt, steering=steering, readers=registry.get)
    plain = hooks_for("c", 3, rt=rt, steering={"vectors": [{"layer": 0,
                                                             "vector": [0.5] * HIDDEN}]})
    assert a.entries == b.entries and set(a.entries.values()).isdisjoint(plain.entries.values())
    (entry,) = set(a.entries.values())
    assert int(rt.gated[entry]) == 1 and rt.gated_entries == 1
    assert int(rt.gated[next(iter(plain.entries.values()))]) == 0
    for hooks in (a, b):
        hooks.release(rt)
    rt.free_entry(entry)  # as when the table needs room
    assert int(rt.gated[entry]) == 0 and float(rt.gate_b[entry]) == 1.0
    assert rt.gated_entries == 0 and not rt.gate[entry].any()


def test_gated_steering_in_dense_mode_equals_host_mode_and_the_rule(registry):
    """Device mode's graph-safe torch path (the Triton kernel's reference) gates exactly as
    host mode does, and both apply an item only at rows whose score passes."""
    readers = probe_readers(4, outputs=2)
    probe = readers("probe")
    items = [  # a gated clamp of attn_out(1), a gated add to resid_post(1), a plain add
        {"hook": "attn_out", "layer": 1, "op": "clamp", "value": 3.0, "vector": [1.0] * HIDDEN,
         "when": {"reader": {"name": "probe"}, "index": 0, "above": 0.0}},
        {"hook": "resid_post", "layer": 1, "vector": [0.7] * HIDDEN, "scale": 2.0,
         "when": {"reader": {"name": "probe"}, "index": 1, "below": 0.1}},
        {"hook": "resid_mid", "layer": 0, "vector": [0.2] * HIDDEN}]
    modes = {}
    for dense in (False, True):
        rt = HookRuntime(LAYERS, HIDDEN, torch.float32, torch.device("cpu"), max_tokens=32,
                         max_requests=4, staging_rows=64, device_driven=dense)
        reqs = {"g": hooks_for("g", 5, rt=rt, steering={"vectors": items}, readers=readers),
                "p": hooks_for("p", 2, rt=rt, steering={"vectors": items[2:]})}
        plan = build_step_plan(["plain", "g", "p"], np.array([0, 4, 24, 26]),
                               np.array([0, 0, 2]), reqs, None, host_steering=not dense)
        rt.set_plan(plan, 26)
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(26, HIDDEN, generator=gen)
        res = torch.randn(26, HIDDEN, generator=gen)
        x0 = x.clone()
        seen = {}
        for site in range(2 * LAYERS + 1):
            if site == 3:
                seen["sub"] = x.clone()
            if site == 4:
                seen["stream"] = (x + res).clone()
            rt.tap(x, res, site)
            if site == 3:
                seen["sub_after"] = x.clone()
        modes[dense] = (x, seen)
    torch.testing.assert_close(modes[True][0], modes[False][0], atol=0, rtol=0)
    x, seen = modes[False]
    rows = slice(4, 24)
    # attn_out(1): clamped to 3 along unit(1..1) exactly where score 0 > 0.
    passes = (seen["sub"][rows] @ probe.weight[0] + probe.bias[0]) > 0
    unit = torch.full((HIDDEN,), 1 / math.sqrt(HIDDEN))
    comp = seen["sub_after"][rows] @ unit
    assert 0 < int(passes.sum()) < 20
    torch.testing.assert_close(comp[passes], torch.full_like(comp[passes], 3.0))
    torch.testing.assert_close(seen["sub_after"][rows][~passes], seen["sub"][rows][~passes])
    # resid_post(1): +1.4 exactly where score 1 < 0.1, read before the add.
    passes = (seen["stream"][rows] @ probe.weight[1] + probe.bias[1]) < 0.1
    assert 0 < int(passes.sum()) < 20
    delta = x[rows] - seen["sub_after"][rows]
    torch.testing.assert_close(delta[passes], torch.full_like(delta[passes], 1.4))
    assert not delta[~passes].any()
    # Rows of other requests: the plain one untouched, the ungated one steered as before.
    assert torch.equal(x[:4], x0[:4])
    assert not torch.equal(x[24:], x0[24:])


def test_the_server_reuses_reader_tensors_until_the_reader_changes(tmp_path):
    reg = ReaderRegistry(tmp_path, hidden_size=HIDDEN)
    body = {"weight": [[0.5] * HIDDEN], "activation": "sigmoid"}
    reg.put("p", json.dumps(body).encode(), "json")
    first = reg.tensors("p")
    assert reg.tensors("p") is first
    reg.put("p", json.dumps({**body, "weight": [[0.25] * HIDDEN]}).encode(), "json")
    again = reg.tensors("p")
    assert again is not first and float(again.weight[0, 0]) == 0.25
    reg.delete("p")
    with pytest.raises(KeyError):
        reg.tensors("p")
