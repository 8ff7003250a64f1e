"""The family table: every hook at every layer is read by exactly one tap, in both
layouts; names resolve; refusals name the reason."""

from __future__ import annotations

import pytest

from capsteer.demo_model import FAMILIES as DEMO_FAMILIES
from capsteer.engine_ext import families
from capsteer.engine_ext.runtime import hook_point, layers_needed, site_count
from capsteer.hooks import HOOKS


def _coverage(family: families.Family, materialized: bool, num_layers: int,
              parallel: bool = False) -> dict:
    """(kind, site) -> how many taps read it."""
    seen: dict[tuple[int, int], int] = {}
    placed = [(tap.site(layer, num_layers), tap) for layer in range(num_layers)
              for tap in families.layer_taps(family, materialized, parallel)]
    placed.append((2 * num_layers, families.final_tap(family, materialized)))
    for site, tap in placed:
        for kind in (families.SUB, families.STREAM):
            if tap.kinds >> kind & 1:
                seen[(kind, site)] = seen.get((kind, site), 0) + 1
    return seen


@pytest.mark.parametrize("family", families.FAMILIES, ids=lambda f: f.name)
@pytest.mark.parametrize("materialized", [False, True], ids=["deferred", "materialized"])
def test_every_hook_is_read_exactly_once(family, materialized):
    """...and a parallel block's resid_mid by none (it is refused by name instead), nor
    OLMo 2's mlp_in (no norm precedes its MLP), nor an MoE family's mlp_post."""
    num_layers = 3
    parallel = family.parallel is not False
    seen = _coverage(family, materialized, num_layers, parallel)
    missing = families.unavailable_hooks(family, _Config(use_parallel_residual=True))
    assert set(missing) == ({"resid_mid"} if parallel else set()) | (
        {"mlp_in"} if family.name == "olmo2" else set()) | (
        {"mlp_post"} if family.moe else {"router_logits"})
    for hook in HOOKS:
        for layer in range(num_layers):
            point = hook_point(hook, layer, num_layers)
            assert seen.get(point, 0) == (hook not in missing), (hook, layer)
    assert all(site < site_count(num_layers) for _, site in seen)


def test_inner_sites_follow_the_stream_sites():
    """mlp_in(L) is site 2N+1+L, mlp_post(L) 3N+1+L, attn_z(L) 4N+1+L; a forward reaches
    them once layer L ran (stop_at_layer)."""
    n = 4
    assert site_count(n) == 6 * n + 1
    assert [hook_point("mlp_in", layer, n) for layer in range(n)] == [
        (families.SUB, 9), (families.SUB, 10), (families.SUB, 11), (families.SUB, 12)]
    assert [hook_point("mlp_post", layer, n)[1] for layer in range(n)] == [13, 14, 15, 16]
    assert [hook_point("attn_z", layer, n)[1] for layer in range(n)] == [17, 18, 19, 20]
    assert [hook_point("router_logits", layer, n)[1] for layer in range(n)] == [21, 22, 23, 24]
    assert [families.site_layers(s, n) for s in range(site_count(n))] == [
        0, 1, 1, 2, 2, 3, 3, 4, 4, *[1, 2, 3, 4] * 4]
    assert layers_needed([("mlp_in", 1)], n) == 2
    assert layers_needed([("mlp_in", 0), ("resid_pre", 1)], n) == 1
    assert layers_needed([("mlp_in", 3)], n) is None


class _Config:
    """An HF config's attributes, as `is_parallel` reads them."""

    def __init__(self, **attrs: object) -> None:
        self.__dict__.update(attrs)


def test_parallel_residual_follows_the_checkpoint():
    neox = families.family_for("GPTNeoXForCausalLM")
    assert families.is_parallel(neox, _Config(use_parallel_residual=True))
    assert not families.is_parallel(neox, _Config(use_parallel_residual=False))
    assert set(families.unavailable_hooks(neox, _Config(use_parallel_residual=False))) == {
        "router_logits"}  # dense: no router; a sequential block has resid_mid
    cohere = families.family_for("CohereForCausalLM")
    reason = families.unavailable_hooks(cohere, _Config())["resid_mid"]
    assert "parallel block" in reason and "resid_post = resid_pre + attn_out + mlp_out" in reason
    assert families.hf_modules(cohere, parallel=True)["resid_mid"] is None
    with pytest.raises(ValueError, match="parallel block"):
        families.layer_taps(families.family_for("LlamaForCausalLM"), False, parallel=True)


def test_layouts_read_the_documented_modules():
    gemma2 = families.family_for("Gemma2ForCausalLM")
    deferred = families.layer_taps(gemma2, materialized=False)
    assert [(t.module, t.read, t.offset, t.inner) for t in deferred] == [
        ("input_layernorm", "pair", 0, None), ("self_attn.o_proj", "input", 0, "attn_z"),
        ("pre_feedforward_layernorm", "pair", 1, None),
        ("mlp", "input", 0, "mlp_in"), ("mlp.down_proj", "input", 0, "mlp_post")]
    # mlp_in is the MLP module's input: vLLM's native Mixtral calls it block_sparse_moe.
    mixtral = families.family_for("MixtralForCausalLM")
    assert families.mlp_in_tap(mixtral, backend=False).module == "block_sparse_moe"
    assert families.mlp_in_tap(mixtral, backend=True).module == "mlp"
    # router_logits: the MoE router's output (capture only), vLLM's native Mixtral's gate
    # under block_sparse_moe; gpt-oss calls its router `router`
    assert (families.router_tap(mixtral, backend=False).module,
            families.router_tap(mixtral, backend=False).read) == ("block_sparse_moe.gate",
                                                                  "output")
    gpt_oss = families.family_for("GptOssForCausalLM")
    assert families.router_tap(gpt_oss, backend=False).module == "mlp.router"
    assert families.router_tap(families.family_for("LlamaForCausalLM"), False) is None
    gpt2 = families.family_for("GPT2LMHeadModel")
    assert [(t.module, t.read, t.kinds) for t in families.layer_taps(gpt2, True)][1:5] == [
        ("attn.c_proj", "input", families.SUB_BIT), ("attn", "output", families.SUB_BIT),
        ("ln_2", "input", families.STREAM_BIT), ("mlp", "input", families.SUB_BIT)]
    gpt_oss = families.family_for("GptOssForCausalLM")  # vLLM's native attention is `attn`
    assert families.attn_z_tap(gpt_oss, backend=False).module == "attn.o_proj"
    assert families.attn_z_tap(gpt_oss, backend=True).module == "self_attn.o_proj"
    olmo2 = families.family_for("Olmo2ForCausalLM")
    assert [(t.module, t.read, t.offset) for t in families.layer_taps(olmo2, False)] == [
        ("", "input", 0), ("self_attn.o_proj", "input", 0),
        ("post_attention_layernorm", "output", 1), ("mlp", "input", 1),
        ("mlp.down_proj", "input", 0), ("post_feedforward_layernorm", "output", 2)]
    assert families.final_tap(olmo2, False).read == "input"


def test_every_demo_family_has_a_row():
    names = {f.name for f in families.FAMILIES}
    assert set(DEMO_FAMILIES) <= names
    for family in families.FAMILIES:
        for arch in family.architectures:
            assert families.family_for(arch) is family
            assert families.refusal_reason(arch) is None


@pytest.mark.parametrize(("arch", "kind"), [
    ("JambaForCausalLM", "hybrid state-space model"),
    ("Qwen3NextForCausalLM", "hybrid state-space model"),
    ("BertModel", "encoder model"),
    ("LlavaForConditionalGeneration", "multimodal model"),
    ("Gemma3ForConditionalGeneration", "multimodal model"),
    ("Qwen2VLForConditionalGeneration", "multimodal model"),
])
def test_refusals_name_the_reason(arch, kind):
    assert families.family_for(arch) is None
    assert families.refusal_reason(arch).startswith(kind)


def test_unknown_architecture_has_no_row_and_no_named_refusal():
    assert families.family_for("BloomForCausalLM") is None
    assert families.refusal_reason("BloomForCausalLM") is None


def test_a_parallel_blocks_resid_mid_is_a_400_and_listed_as_unavailable():
    """What the server does with a hook the model lacks: the request's field names it (a
    400 with the reason), and /v1/capsteer/hooks lists no layers for it, with the reason."""
    import torch

    from capsteer.engine_ext.vllm.topology import ServedModel
    from capsteer.server.fields import FieldError, ModelShape, parse_hook_fields
    from capsteer.server.routes import hook_entries

    cohere = families.family_for("CohereForCausalLM")
    missing = families.unavailable_hooks(cohere, _Config())
    shape = ModelShape(4, 8, 512, 4, missing)

    def fields(body: dict):
        return parse_hook_fields(body, shape, lookup=None, default_layout="packed",
                                 capture_default=None)

    assert fields({"capture": {"hooks": ["resid_pre", "attn_out", "mlp_out", "resid_post"]}})
    for hooks in (["resid_pre", "resid_mid"], ["post_attn"], {"resid_mid": [1]}):
        with pytest.raises(FieldError, match="parallel block") as info:
            fields({"capture": {"hooks": hooks}})
        assert info.value.field == "capture.hooks.resid_mid"
    with pytest.raises(FieldError, match="parallel block") as info:
        fields({"steering": {"vectors": [{"hook": "resid_pre", "layer": 0, "vector": [0.0] * 8},
                                         {"hook": "post_attn", "layer": 0,
                                          "vector": [1.0] * 8}]}})
    assert info.value.field == "steering.vectors[1].hook"
    served = ServedModel("m", 4, 8, 512, torch.float32, "CohereForCausalLM", cohere, missing)
    entries = {e["name"]: e for e in hook_entries(served)}
    assert entries["resid_mid"]["layers"] == [] and entries["resid_mid"]["hf_module"] is None
    assert "parallel block" in entries["resid_mid"]["unavailable"]
    for hook in ("resid_pre", "attn_out", "mlp_out", "resid_post"):
        assert entries[hook]["layers"] == [0, 1, 2, 3] and "unavailable" not in entries[hook]
    assert entries["attn_out"]["hf_module"] == "model.layers[L].self_attn output"
    # Cohere's one norm feeds both sublayers: mlp_in is offered (steering it changes the
    # MLP's input only), named as TransformerLens names it.
    assert entries["mlp_in"]["layers"] == [0, 1, 2, 3]
    assert entries["mlp_in"]["hf_module"] == "model.layers[L].mlp input"
    assert entries["mlp_in"]["transformer_lens"] == "blocks.L.ln2.hook_normalized"
    assert entries["resid_post"]["transformer_lens"] == "blocks.L.hook_resid_post"
    gpt2 = families.family_for("GPT2LMHeadModel")
    plain = {e["name"]: e for e in hook_entries(
        ServedModel("m", 2, 8, 512, torch.float32, "GPT2LMHeadModel", gpt2))}
    assert plain["resid_mid"]["layers"] == [0, 1]
    assert plain["resid_mid"]["hf_module"] == "transformer.h[L].ln_2 input"
    assert plain["mlp_in"]["hf_module"] == "transformer.h[L].mlp input"
    olmo2 = families.family_for("Olmo2ForCausalLM")
    no_norm = {e["name"]: e for e in hook_entries(ServedModel(
        "m", 2, 8, 512, torch.float32, "Olmo2ForCausalLM", olmo2,
        families.unavailable_hooks(olmo2, _Config())))}
    assert no_norm["mlp_in"]["layers"] == [] and "no norm" in no_norm["mlp_in"]["unavailable"]
    with pytest.raises(FieldError, match="no norm precedes its MLP") as info:
        parse_hook_fields({"steering": {"vectors": [{"hook": "ln2.hook_normalized", "layer": 0,
                                                     "vector": [1.0] * 8}]}},
                          ModelShape(2, 8, 512, 2, families.unavailable_hooks(olmo2, _Config())),
                          lookup=None, default_layout="packed", capture_default=None)
    assert info.value.field == "steering.vectors[0].hook"


def test_mlp_in_is_named_as_transformer_lens_names_it():
    """The alias, the TL names that the SAELens export writes and an SAE's recorded
    hook_name is read from, and a capture spec naming it."""
    from capsteer.capture.spec import parse_capture_spec
    from capsteer.hooks import canonical_hook, parse_tl_hook_name, tl_hook_name
    from capsteer.steering.readers.readout import _recorded_site

    assert canonical_hook("ln2.hook_normalized") == canonical_hook("hook_mlp_in") == "mlp_in"
    assert tl_hook_name("mlp_in", 5) == "blocks.5.ln2.hook_normalized"
    assert tl_hook_name("post_block", 1) == "blocks.1.hook_resid_post"
    assert parse_tl_hook_name("blocks.5.ln2.hook_normalized") == ("mlp_in", 5)
    assert parse_tl_hook_name("blocks.2.hook_mlp_out") == ("mlp_out", 2)
    assert parse_tl_hook_name("blocks.5.ln1.hook_normalized") is None
    assert _recorded_site("blocks.3.ln2.hook_normalized") == ("mlp_in", 3)
    spec = parse_capture_spec({"hooks": {"ln2.hook_normalized": [1], "mlp_out": [1]}},
                              num_layers=4)
    assert spec.keys() == [("mlp_in", 1), ("mlp_out", 1)]


def test_the_stream_only_layout_reads_each_stream_site_once():
    """A model without a row that the Transformers backend runs: every layer's input is
    resid_pre, the last layer's output resid_post; its sublayers and resid_mid are
    refused by name, as the architecture without a row served natively is refused."""
    from capsteer.engine_ext.vllm.refusals import architecture_problem

    stream = families.TRANSFORMERS_STREAM
    num_layers = 3
    placed = [(2 * layer + tap.offset, tap) for layer in range(num_layers)
              for tap in families.layer_taps(stream, True)]
    placed.append((2 * num_layers, families.final_tap(stream, True)))
    assert [(site, tap.read) for site, tap in placed] == [(0, "input"), (2, "input"),
                                                          (4, "input"), (6, "output")]
    missing = families.unavailable_hooks(stream, _Config(architectures=["PhiForCausalLM"]))
    assert sorted(missing) == ["attn_out", "attn_z", "mlp_in", "mlp_out", "mlp_post",
                               "resid_mid", "router_logits"]
    assert "not offered for PhiForCausalLM" in missing["attn_out"]
    assert families.unavailable_hooks_of(_Config(architectures=["PhiForCausalLM"]), True) \
        == missing
    assert families.unavailable_hooks_of(_Config(architectures=["PhiForCausalLM"])) == {}
    assert families.hf_modules(stream)["attn_out"] is None
    assert architecture_problem("PhiForCausalLM", None, transformers_backend=True) is None
    assert "no hook layout" in architecture_problem("PhiForCausalLM", None)
    assert "hybrid" in architecture_problem("JambaForCausalLM", None, transformers_backend=True)
