"""mlp_post and attn_z: hooks wider than the stream (d_mlp, heads * d_head), and neuron
and head selections as data."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from capsteer.capture.spec import parse_capture_spec
from capsteer.engine_ext import families
from capsteer.engine_ext.families import SUB, hook_point
from capsteer.engine_ext.plan import build_step_plan, compose_entries
from capsteer.engine_ext.runtime import HookRuntime
from capsteer.hooks import canonical_hook, parse_tl_hook_name, tl_hook_name
from capsteer.steering.spec import SteeringSpec, SteeringSpecError, parse_steering_spec
from tests.unit.helpers import HIDDEN, LAYERS, hooks_for

D_MLP = 3 * HIDDEN
HEADS, D_HEAD = 4, HIDDEN // 2  # attn_z: [4, 4] per token, 16 wide (the stream: 8)
WIDTHS = {"mlp_post": D_MLP, "attn_z": HEADS * D_HEAD, "attn_z.heads": HEADS}


def _parse(*items: dict) -> SteeringSpec:
    spec = parse_steering_spec({"vectors": list(items)}, num_layers=LAYERS, hidden_size=HIDDEN,
                               widths=WIDTHS)
    assert spec is not None
    return spec


def test_mlp_post_is_named_as_transformer_lens_names_it():
    assert canonical_hook("mlp.hook_post") == canonical_hook("hook_mlp_post") == "mlp_post"
    assert tl_hook_name("mlp_post", 3) == "blocks.3.mlp.hook_post"
    assert parse_tl_hook_name("blocks.3.mlp.hook_post") == ("mlp_post", 3)
    spec = parse_capture_spec({"hooks": {"mlp.hook_post": [1]}}, num_layers=LAYERS)
    assert spec.keys() == [("mlp_post", 1)]
    assert spec.row_bytes(HIDDEN, 4, WIDTHS) == D_MLP * 4
    assert parse_capture_spec({"hooks": ["mlp_post", "resid_pre"], "layers": [0]},
                              num_layers=LAYERS).row_bytes(HIDDEN, 2, WIDTHS) \
        == (D_MLP + HIDDEN) * 2


@pytest.mark.parametrize(("item", "field", "match"), [
    ({"hook": "mlp_post", "layer": 0, "vector": [1.0] * HIDDEN}, "steering.vectors[0].vector",
     f"width {HIDDEN}"),
    ({"hook": "resid_post", "layer": 0, "op": "ablate", "neurons": [1]},
     "steering.vectors[0].neurons", "resid_post takes no `neurons`"),
    ({"hook": "mlp_post", "layer": 0, "op": "ablate", "neurons": [D_MLP]},
     "steering.vectors[0].neurons", f"has {D_MLP} neurons"),
    ({"hook": "mlp_post", "layer": 0, "op": "ablate", "neurons": [2, 2]},
     "steering.vectors[0].neurons", "twice"),
    ({"hook": "mlp_post", "layer": 0, "op": "ablate", "neurons": []},
     "steering.vectors[0].neurons", "non-empty"),
    ({"hook": "mlp_post", "layer": 0, "op": "ablate", "neurons": [True]},
     "steering.vectors[0].neurons", "integers"),
    ({"hook": "mlp_post", "layer": 0, "op": "ablate", "neurons": [1],
      "vector": [1.0] * D_MLP}, "steering.vectors[0].vector", "takes no vector"),
    ({"hook": "mlp_post", "layer": 0, "neurons": [1]}, "steering.vectors[0].vector",
     "is required"),
])
def test_a_bad_selection_is_a_400_naming_its_field(item, field, match):
    with pytest.raises(SteeringSpecError, match=match) as info:
        _parse(item)
    assert info.value.field == field


def test_a_selection_survives_the_wire_and_composes_into_a_keep_row():
    neurons = [1, 7, D_MLP - 1]
    v = np.random.default_rng(0).standard_normal(D_MLP).astype(np.float32)
    spec = _parse({"hook": "mlp_post", "layer": 2, "vector": v.tolist(), "scale": 2.0,
                   "neurons": [3]},
                  {"hook": "mlp_post", "layer": 2, "op": "clamp", "value": 5.0,
                   "neurons": neurons},
                  {"hook": "mlp_post", "layer": 2, "vector": v.tolist(), "scale": 0.5})
    back = SteeringSpec.from_wire(spec.wire_text)
    assert back.sharing_key == spec.sharing_key
    clamp = back.ops[1]
    assert clamp.select is not None and np.flatnonzero(clamp.select).tolist() == neurons
    # a different selection is a different spec (entries are shared by content)
    other = _parse({"hook": "mlp_post", "layer": 2, "op": "clamp", "value": 5.0,
                    "neurons": [1, 7]})
    assert other.sharing_key != _parse({"hook": "mlp_post", "layer": 2, "op": "clamp",
                                        "value": 5.0, "neurons": neurons}).sharing_key
    maps = compose_entries(back, HIDDEN, LAYERS)
    site = hook_point("mlp_post", 2, LAYERS)
    ((key, (_, alpha, w, gate, keep)), *rest) = maps.items()
    assert key[:2] == site and len(rest) == 1 and gate is None and alpha == 0.0
    x = torch.randn(D_MLP)
    got = keep * x + w
    want = x.clone()
    want[3] += 2.0 * float(v[3])
    want[neurons] = 5.0
    want += 0.5 * torch.from_numpy(v)
    torch.testing.assert_close(got, want)


def test_host_mode_steers_and_copies_mlp_post_at_its_own_width():
    """The tables are as wide as d_mlp; the stream's sites read their first HIDDEN
    columns and are untouched by an mlp_post request; the mlp_post site's rows are
    ablated at the selected neurons only and copied whole."""
    rt = HookRuntime(LAYERS, HIDDEN, torch.float32, torch.device("cpu"), max_tokens=64,
                     hook_widths=WIDTHS)
    assert rt.width == D_MLP and rt.site_widths[hook_point("mlp_post", 1, LAYERS)[1]] == D_MLP
    neurons = [0, 9, D_MLP - 1]
    h = hooks_for("m", 3, rt=rt, widths=WIDTHS,
                  capture={"hooks": ["mlp_post", "resid_pre"], "layers": [1]},
                  steering={"vectors": [{"hook": "mlp_post", "layer": 1, "op": "ablate",
                                         "neurons": neurons},
                                        {"hook": "resid_pre", "layer": 1,
                                         "vector": [0.5] * HIDDEN}]})
    plan = build_step_plan(["m"], np.array([0, 3]), np.array([0]), {"m": h}, None)
    rt.set_plan(plan, 3)
    post = hook_point("mlp_post", 1, LAYERS)[1]
    hidden = torch.randn(3, D_MLP)
    want = hidden.clone()
    want[:, neurons] = 0.0
    stream = torch.randn(3, HIDDEN)
    for site in range(rt.num_sites):
        if site == post:
            rt.tap(hidden, None, site, 1)
        elif site == 2:
            rt.tap(stream, None, site, 2)
    torch.testing.assert_close(hidden, want)
    captured = rt.take_captured()
    torch.testing.assert_close(captured[(SUB, post)], want)
    assert captured[(1, 2)].shape == (3, HIDDEN)
    h.release(rt)
    assert rt.masked_entries == 1  # idle: kept while the table has room
    rt._free_spec(*rt.idle.popitem())
    # freeing the entry restores its keep row (the identity for the next spec)
    assert bool((rt.keep == 1).all()) and rt.masked_entries == 0


class _Config:
    architectures = ("LlamaForCausalLM",)
    hidden_size = HIDDEN
    intermediate_size = D_MLP
    num_attention_heads = 2


def test_widths_and_refusals_come_from_the_config():
    assert families.hook_widths(_Config()) == {"mlp_post": D_MLP, "attn_z": HIDDEN,
                                               "attn_z.heads": 2}

    class Gpt2:
        n_embd, n_inner, n_head = 64, None, 4
    assert families.hook_widths(Gpt2()) == {"mlp_post": 256, "attn_z": 64, "attn_z.heads": 4}
    mixtral = families.family_for("MixtralForCausalLM")
    assert "mixture of experts" in families.unavailable_hooks(mixtral, _Config())["mlp_post"]
    assert families.tensor_parallel_reasons(1) == {}
    reason = families.tensor_parallel_reasons(2)["mlp_post"]
    assert "tensor_parallel_size=2" in reason and "split across the ranks" in reason
    with pytest.raises(SteeringSpecError, match="tensor parallelism") as info:
        parse_steering_spec({"vectors": [{"hook": "mlp_post", "layer": 0, "op": "ablate",
                                          "neurons": [0]}]}, num_layers=LAYERS,
                            hidden_size=HIDDEN, widths=WIDTHS,
                            unavailable=families.tensor_parallel_reasons(2))
    assert info.value.field == "steering.vectors[0].hook"


def test_the_hooks_listing_gives_each_hooks_width_and_selection():
    from capsteer.engine_ext.vllm.topology import ServedModel
    from capsteer.server.routes import hook_entries

    llama = families.family_for("LlamaForCausalLM")
    entries = {e["name"]: e for e in hook_entries(ServedModel(
        "m", 2, HIDDEN, 512, torch.float32, "LlamaForCausalLM", llama, {}, WIDTHS))}
    assert entries["mlp_post"]["width"] == D_MLP and entries["mlp_post"]["selects"] == "neurons"
    assert entries["mlp_post"]["transformer_lens"] == "blocks.L.mlp.hook_post"
    assert entries["mlp_post"]["hf_module"] == "model.layers[L].mlp.down_proj input"
    assert entries["resid_post"]["width"] == HIDDEN and "selects" not in entries["resid_post"]
    z = entries["attn_z"]
    assert (z["width"], z["shape"], z["selects"]) == (HEADS * D_HEAD, [HEADS, D_HEAD], "heads")
    assert z["transformer_lens"] == "blocks.L.attn.hook_z"
    assert z["hf_module"] == "model.layers[L].self_attn.o_proj input"


def test_router_logits_is_capture_only_and_moe_only():
    with pytest.raises(SteeringSpecError, match="router_logits is read only") as info:
        parse_steering_spec({"vectors": [{"hook": "router_logits", "layer": 0,
                                          "vector": [1.0] * 4}]}, num_layers=LAYERS,
                            hidden_size=HIDDEN, widths={"router_logits": 4})
    assert info.value.field == "steering.vectors[0].hook"
    llama = families.family_for("LlamaForCausalLM")
    assert "dense" in families.unavailable_hooks(llama, _Config())["router_logits"]
    olmoe = families.family_for("OlmoeForCausalLM")
    assert "router_logits" not in families.unavailable_hooks(olmoe, _Config())

    class Moe(_Config):
        num_experts = 8
    assert families.hook_widths(Moe())["router_logits"] == 8
    assert parse_capture_spec({"hooks": ["router_logits"], "layers": [0]},
                              num_layers=LAYERS).keys() == [("router_logits", 0)]


def test_a_head_selection_covers_each_heads_d_head_columns():
    """`heads` on attn_z: ablate zeroes the selected heads' slices, add adds only there;
    `heads` elsewhere and out-of-range heads are 400s naming the field."""
    assert canonical_hook("attn.hook_z") == "attn_z"
    assert tl_hook_name("attn_z", 2) == "blocks.2.attn.hook_z"
    spec = _parse({"hook": "attn_z", "layer": 1, "op": "ablate", "heads": [1, 3]},
                  {"hook": "attn_z", "layer": 1, "vector": [1.0] * (HEADS * D_HEAD),
                   "heads": [0]})
    (_, (_, _, w, _, keep)), *_ = compose_entries(spec, HIDDEN, LAYERS).items()
    want_keep = torch.ones(HEADS, D_HEAD)
    want_keep[[1, 3]] = 0.0
    torch.testing.assert_close(keep, want_keep.reshape(-1))
    want_w = torch.zeros(HEADS, D_HEAD)
    want_w[0] = 1.0
    torch.testing.assert_close(w, want_w.reshape(-1))
    for item, field, match in [
        ({"hook": "attn_z", "layer": 0, "op": "ablate", "heads": [HEADS]}, "heads",
         f"has {HEADS} heads"),
        ({"hook": "attn_z", "layer": 0, "op": "ablate", "neurons": [0]}, "neurons",
         "attn_z takes no `neurons`"),
        ({"hook": "mlp_post", "layer": 0, "op": "ablate", "heads": [0]}, "heads",
         "mlp_post takes no `heads`"),
    ]:
        with pytest.raises(SteeringSpecError, match=match) as info:
            _parse(item)
        assert info.value.field == f"steering.vectors[0].{field}"


def test_tensor_parallel_host_engines_offer_split_hooks_but_projections():
    """Host-driven engines gather mlp_post's and attn_z's split columns: the hooks are
    offered under TP, add and selections parse, a projection or a `when` gate is a 400
    naming the field, as is a readout; device-driven engines still refuse the hooks."""
    offered = families.tensor_parallel_reasons(2, gathered=True)
    assert not {"mlp_post", "attn_z"} & set(offered)
    assert sorted(offered) == ["attn_z:projection", "attn_z:readout", "mlp_post:projection",
                               "mlp_post:readout"]
    kw = dict(num_layers=LAYERS, hidden_size=HIDDEN, widths=WIDTHS, unavailable=offered)
    ok = [{"hook": "mlp_post", "layer": 0, "vector": [1.0] * D_MLP},
          {"hook": "mlp_post", "layer": 1, "op": "ablate", "neurons": [0]},
          {"hook": "attn_z", "layer": 0, "op": "clamp", "value": 2.0, "heads": [1]}]
    assert parse_steering_spec({"vectors": ok}, **kw) is not None
    for item, field in [({"hook": "mlp_post", "layer": 0, "op": "ablate",
                          "vector": [1.0] * D_MLP}, "op"),
                        ({"hook": "attn_z", "layer": 0, "op": "clamp", "value": 1.0,
                          "vector": [1.0] * (HEADS * D_HEAD)}, "op"),
                        ({"hook": "mlp_post", "layer": 0, "vector": [1.0] * D_MLP,
                          "when": {"reader": {"name": "p"}, "above": 0}}, "when")]:
        with pytest.raises(SteeringSpecError, match="under tensor parallelism") as info:
            parse_steering_spec({"vectors": [item]}, **kw)
        assert info.value.field == f"steering.vectors[0].{field}"
    assert "on GPU engines" in families.tensor_parallel_reasons(2)["attn_z"]


def test_each_tensor_parallel_rank_steers_its_columns_and_gathers_captures_whole():
    """Two host runtimes as TP ranks 0 and 1 of an mlp_post site: each holds its half of
    the d_mlp columns; an add of a full-width vector and a neuron ablation spanning both
    halves act on each rank's own columns, and the captured rows, gathered in rank order,
    equal the full row steered at TP=1. A projection on split columns is refused."""
    from capsteer.engine_ext.selections import column_shards

    half = D_MLP // 2
    post = hook_point("mlp_post", 1, LAYERS)[1]
    neurons = [1, half - 1, half, D_MLP - 2]
    vec = torch.linspace(-1.0, 1.0, D_MLP)
    steering = {"vectors": [{"hook": "mlp_post", "layer": 1, "vector": vec.tolist(),
                             "scale": 3.0},
                            {"hook": "mlp_post", "layer": 1, "op": "ablate",
                             "neurons": neurons}]}
    capture = {"hooks": ["mlp_post"], "layers": [1]}
    full = torch.randn(3, D_MLP)
    want = full + 3.0 * vec
    want[:, neurons] = 0.0
    shards = [column_shards(WIDTHS, LAYERS, rank, 2) for rank in (0, 1)]
    assert shards[1][post] == slice(half, D_MLP)
    assert shards[0][hook_point("attn_z", 2, LAYERS)[1]] == slice(0, HEADS * D_HEAD // 2)
    sent: list[torch.Tensor] = []

    def gather_as(rank: int):
        def gather(rows: torch.Tensor) -> torch.Tensor:
            sent.append(rows.clone())
            others = sent[0] if rank == 0 else torch.zeros_like(rows)
            return torch.cat([rows, others] if rank == 0 else [others, rows], dim=-1)
        return gather

    out = {}
    for rank in (1, 0):  # rank 1's rows are there when rank 0 gathers
        rt = HookRuntime(LAYERS, HIDDEN, torch.float32, torch.device("cpu"), max_tokens=64,
                         hook_widths=WIDTHS)
        rt.split_columns(shards[rank], gather_as(rank))
        h = hooks_for("m", 3, rt=rt, widths=WIDTHS, capture=capture, steering=steering)
        rt.set_plan(build_step_plan(["m"], np.array([0, 3]), np.array([0]), {"m": h}, None), 3)
        local = full[:, shards[rank][post]].clone()
        rt.tap(local, None, post, 1)
        torch.testing.assert_close(local, want[:, shards[rank][post]])
        out[rank] = rt.take_captured()[(SUB, post)]
        with pytest.raises(ValueError, match="split across the tensor-parallel ranks"):
            hooks_for("p", 3, rt=rt, widths=WIDTHS, steering={"vectors": [
                {"hook": "mlp_post", "layer": 1, "op": "ablate", "vector": vec.tolist()}]})
    torch.testing.assert_close(out[0], want)


def test_the_workers_refuse_a_readout_of_split_columns_but_not_a_capture():
    """A payload that skipped the front end: under TP a readout of mlp_post is refused
    with the reason its key gives; a capture of it is served (gathered)."""
    from types import SimpleNamespace

    from capsteer.engine_ext.request_book import RequestBook

    reasons = families.tensor_parallel_reasons(2, gathered=True)
    book = SimpleNamespace(sites=SimpleNamespace(unavailable=tuple(reasons.items()),
                                                 num_layers=LAYERS))
    point = hook_point("mlp_post", 1, LAYERS)
    read = SimpleNamespace(points={}, readout_points={point: (("mlp_post", 1),)}, patches={},
                           entries={})
    captured = SimpleNamespace(points={point: (("mlp_post", 1),)}, readout_points={},
                               patches={}, entries={})
    assert RequestBook._unavailable_hook(book, read) == reasons["mlp_post:readout"]
    assert RequestBook._unavailable_hook(book, captured) is None
