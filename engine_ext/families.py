"""Where each contract hook lives, one declarative row per model family.

Pure data: no vLLM import, so the HF reference (capsteer.reference), the server
and the docs read the same table as engine_ext/vllm/.

A hook is read at a *site*: site 2L is the stream entering layer L, site 2L+1 the
stream after attention's residual add, site 2L+2 (= 2(L+1)) the stream leaving
layer L; the last site, 2N, is the stream entering the final norm. At site 2L+1
the sublayer value is attn_out(L), at 2L+2 it is mlp_out(L). Two module layouts
exist in vLLM:

- ``deferred``: vLLM's own pre-norm decoders keep the stream as (hidden, residual)
  and fuse the residual add into the next norm, `norm(x, residual)`. The inputs of
  that norm give both values of a site: x is the sublayer output, x + residual the
  stream. The family names the norm whose input is resid_mid (Gemma 2/3 add the
  post-normed attention output there, so it is `pre_feedforward_layernorm`).
- ``materialized``: layers that add the residual themselves (OLMo 2, Granite, and
  every model vLLM runs through its Transformers backend, which is HF's own module
  tree). Stream sites are read at module inputs (the layer's `hidden_states`, the
  resid_mid module's input, the final norm's input) and sublayer values at module
  outputs (the family's attn_out / mlp_out modules), exactly HF's modules.

Steering edits the value where it is read: the sublayer output in place, or the
stream in place (a materialized layer's residual is the same tensor, so the add
and the next sublayer both see the steered stream).

A *parallel* block (GPT-NeoX with use_parallel_residual, Cohere) feeds resid_pre to
both sublayers and adds both outputs at once: resid_post = resid_pre + attn_out +
mlp_out. No stream exists between the sublayers, so resid_mid is refused by name
(`unavailable_hooks`) rather than given an invented value; site 2L+1 then carries
attn_out only.

Hooks inside a sublayer (INNER_HOOKS) get sites after the stream's: inner hook h of
layer L is site 2N+1 + hN + L. `mlp_in` is the MLP's normalized input (TransformerLens's
`blocks.L.ln2.hook_normalized`, the transcoder input): the family's MLP module's input,
which its pre-MLP norm produced (post_attention_layernorm, GPT-2's ln_2, Gemma 2/3's
pre_feedforward_layernorm). It is read and steered at that input, a tensor the stream
does not alias: steering changes what the MLP sees, not the stream. In a parallel block
whose one norm feeds both sublayers (Cohere) attention has already read that tensor
when the MLP is called, so steering mlp_in changes the MLP's input only. OLMo 2 has no
norm before its MLP (the MLP reads resid_mid itself), so mlp_in is refused there.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from capsteer.hooks import HEADS_KEY, PROJECTION, READOUT, SELECTIONS, WIDE_HOOKS, hook_use

SUB, STREAM = 0, 1  # what a site's value is: the sublayer output or the stream
SUB_BIT, STREAM_BIT = 1 << SUB, 1 << STREAM
BOTH = SUB_BIT | STREAM_BIT
# Hooks read inside a sublayer, each at one site per layer after the stream's (their
# value is a plain tensor: kind SUB, no residual).
INNER_HOOKS: tuple[str, ...] = ("mlp_in", "mlp_post", "attn_z", "router_logits")


def site_count(num_layers: int) -> int:
    """Sites of a model: 2N+1 stream sites, then N per inner hook."""
    return (2 + len(INNER_HOOKS)) * num_layers + 1


def inner_site(hook: str, layer: int, num_layers: int) -> int:
    """The site of an inner hook (INNER_HOOKS) at `layer`: 2N+1 + hN + L."""
    return 2 * num_layers + 1 + INNER_HOOKS.index(hook) * num_layers + layer


def site_layers(site: int, num_layers: int) -> int:
    """How many leading layers a forward must run to reach `site`: site 2L needs layers
    below L, sites 2L+1 and 2L+2 layer L too, an inner site its own layer."""
    if site > 2 * num_layers:
        return (site - 2 * num_layers - 1) % num_layers + 1
    return (site + 1) // 2


def hook_point(hook: str, layer: int, num_layers: int) -> tuple[int, int]:
    """(kind, site) where a hook's value is read; the same place steering acts. Stream
    sites: input_layernorm[L] = 2L, post_attention_layernorm[L] = 2L+1, final norm = 2N;
    an inner hook's (mlp_in) come after them (families.inner_site)."""
    if hook in INNER_HOOKS:
        return SUB, inner_site(hook, layer, num_layers)
    if hook == "resid_pre":
        return STREAM, 2 * layer
    if hook == "resid_mid":
        return STREAM, 2 * layer + 1
    if hook == "resid_post":
        return STREAM, 2 * layer + 2
    if hook == "attn_out":
        return SUB, 2 * layer + 1
    if hook == "mlp_out":
        return SUB, 2 * layer + 2
    raise ValueError(f"unknown hook {hook!r}")


def layers_needed(keys: Iterable[tuple[str, int]], num_layers: int) -> int | None:
    """The fewest leading layers whose forward yields every (hook, layer) of `keys` (a
    forward stopped after layer E-1 reads site 2E at the final norm), or None when
    every layer is needed. Site 2L needs layers < L, sites 2L+1 and 2L+2 layer L too, as
    does an inner hook of layer L."""
    sites = [hook_point(hook, layer, num_layers)[1] for hook, layer in keys]
    if not sites:
        return None
    # At least one layer: the final norm wants a residual.
    stop = max(1, max(site_layers(site, num_layers) for site in sites))
    return stop if stop < num_layers else None


@dataclass(frozen=True)
class Family:
    """One family's hook layout. Module names are attribute paths under a decoder layer
    (HF's names; vLLM's native classes use the same ones)."""

    name: str
    architectures: tuple[str, ...]  # the config's `architectures` names it covers
    attn_out: str = "self_attn"  # module whose output is attn_out (added to the stream)
    resid_mid: str = "post_attention_layernorm"  # module whose input is resid_mid
    # (a parallel block has none: see `parallel`)
    mlp_out: str = "mlp"  # module whose output is mlp_out (MoE: the whole block)
    # The MLP module whose input is mlp_in (the pre-MLP norm's output; MoE: the whole
    # block's, router and experts); None: no norm precedes the MLP (OLMo 2).
    mlp_in: str | None = "mlp"
    # The same module's name in vLLM's native class where it differs from HF's.
    native_mlp_in: str | None = None
    # The MLP's output projection, whose input is mlp_post (act(gate) * up, or act(fc));
    # None: the MLP is a mixture of experts, which has no single hidden layer.
    mlp_post: str | None = "mlp.down_proj"
    native_mlp_post: str | None = None
    # The attention's output projection, whose input is attn_z (every head's output,
    # [tokens, heads * d_head], before the heads are mixed); vLLM's name where it differs.
    attn_z: str = "self_attn.o_proj"
    native_attn_z: str | None = None
    # An MoE family's router (gate), whose output's first tensor is router_logits
    # [tokens, n_experts]; None: a dense MLP. vLLM's name where it differs.
    router: str | None = None
    native_router: str | None = None
    # vLLM's fused add+norm whose input is resid_mid, for vLLM's native deferred layers;
    # None: vLLM's layers add the residual themselves (materialized, read at the modules).
    deferred_mid_norm: str | None = "post_attention_layernorm"
    # Config attribute scaling the embedding after `embed_input_ids` (Granite).
    embedding_multiplier: str | None = None
    # Config attribute scaling attn_out / mlp_out as they are added to the stream
    # (Granite): then resid_mid = resid_pre + m * attn_out. Other families: m = 1.
    residual_multiplier: str | None = None
    moe: bool = False
    notes: str = ""
    # Attention and MLP both read resid_pre and are added together (no resid_mid): True,
    # or the config attribute that says so (GPT-NeoX's use_parallel_residual).
    parallel: bool | str = False
    # Where the decoder sits in vLLM's native class (the Transformers backend always
    # holds HF's base model at `model`) and what its layer list and final norm are called
    # (HF's names, which vLLM's classes keep). GPT-2: transformer.h, transformer.ln_f.
    inner: str = "model"
    layers: str = "layers"
    final_norm: str = "norm"
    hf_base: str = "model"  # HF's base-model attribute (its base_model_prefix), for the docs
    # Module under the inner model whose output, looked up by position, is added to the
    # token embedding (GPT-2's learned `wpe`): part of resid_pre(0).
    position_embedding: str | None = None


_GEMMA_NORMED = dict(attn_out="post_attention_layernorm", resid_mid="pre_feedforward_layernorm",
                     mlp_out="post_feedforward_layernorm",
                     deferred_mid_norm="pre_feedforward_layernorm")

FAMILIES: tuple[Family, ...] = (
    Family("llama", ("LlamaForCausalLM", "LLaMAForCausalLM", "InternLM3ForCausalLM")),
    Family("mistral", ("MistralForCausalLM", "Ministral3ForCausalLM")),
    Family("qwen2", ("Qwen2ForCausalLM",)),
    Family("qwen3", ("Qwen3ForCausalLM",)),
    Family("phi3", ("Phi3ForCausalLM",), notes="fused qkv_proj / gate_up_proj"),
    Family("gemma", ("GemmaForCausalLM",), notes="embedding scaled by sqrt(hidden_size)"),
    Family("gemma2", ("Gemma2ForCausalLM",), **_GEMMA_NORMED,
           notes="embedding scaled by sqrt(hidden_size); attn_out and mlp_out are the "
                 "post-normed sublayer outputs (post_attention_layernorm / "
                 "post_feedforward_layernorm), which are what is added to the stream"),
    Family("gemma3", ("Gemma3ForCausalLM",), **_GEMMA_NORMED,
           notes="as gemma2; text-only Gemma3ForCausalLM (the multimodal class is refused)"),
    Family("olmo2", ("Olmo2ForCausalLM", "Olmo3ForCausalLM"), attn_out="post_attention_layernorm",
           resid_mid="mlp", mlp_out="post_feedforward_layernorm", deferred_mid_norm=None,
           mlp_in=None,
           notes="norms after the sublayers: attn_out / mlp_out are the normed sublayer "
                 "outputs added to the stream; resid_mid is the MLP's input (no norm "
                 "precedes the MLP, so mlp_in is refused)"),
    Family("granite", ("GraniteForCausalLM",), deferred_mid_norm=None,
           embedding_multiplier="embedding_multiplier",
           residual_multiplier="residual_multiplier",
           notes="attn_out / mlp_out are the sublayer module outputs (HF's); the stream adds "
                 "them times residual_multiplier; the embedding is scaled by "
                 "embedding_multiplier"),
    Family("qwen2_moe", ("Qwen2MoeForCausalLM",), mlp_post=None, moe=True, router="mlp.gate",
           notes="mlp_out is the whole MoE block output, shared expert included"),
    Family("qwen3_moe", ("Qwen3MoeForCausalLM",), mlp_post=None, moe=True, router="mlp.gate",
           notes="mlp_out is the whole MoE block output"),
    Family("mixtral", ("MixtralForCausalLM",), mlp_post=None, moe=True,
           native_mlp_in="block_sparse_moe", router="mlp.gate",
           native_router="block_sparse_moe.gate",
           notes="mlp_out is the whole MoE block output (vLLM's block_sparse_moe)"),
    Family("olmoe", ("OlmoeForCausalLM",), mlp_post=None, moe=True, router="mlp.gate",
           notes="mlp_out is the whole MoE block output"),
    Family("gpt2", ("GPT2LMHeadModel",), attn_out="attn", resid_mid="ln_2", mlp_out="mlp",
           deferred_mid_norm=None, inner="transformer", layers="h", final_norm="ln_f",
           hf_base="transformer", position_embedding="wpe", mlp_post="mlp.c_proj",
           attn_z="attn.c_proj",
           notes="LayerNorm; learned positions: resid_pre(0) is the token embedding plus "
                 "the position embedding (wpe); resid_mid is ln_2's input"),
    Family("gpt_neox", ("GPTNeoXForCausalLM",), attn_out="attention",
           mlp_post="mlp.dense_4h_to_h", attn_z="attention.dense",
           deferred_mid_norm=None, final_norm="final_layer_norm", hf_base="gpt_neox",
           parallel="use_parallel_residual",
           notes="LayerNorm, partial rotary; with use_parallel_residual (Pythia, GPT-NeoX-20B) "
                 "attention and MLP both read resid_pre and resid_post = resid_pre + "
                 "attn_out + mlp_out, so resid_mid does not exist and is refused; served "
                 "through vLLM's Transformers backend (HF's modules)"),
    Family("starcoder2", ("Starcoder2ForCausalLM",), deferred_mid_norm=None,
           mlp_post="mlp.c_proj",
           notes="LayerNorm, non-gated MLP; served through vLLM's Transformers backend "
                 "(HF's modules)"),
    Family("cohere", ("CohereForCausalLM",), deferred_mid_norm=None, parallel=True,
           notes="parallel block: attention and MLP both read resid_pre (one LayerNorm) and "
                 "resid_post = resid_pre + attn_out + mlp_out, so resid_mid does not exist "
                 "and is refused; mlp_in is that norm's output as the MLP reads it: "
                 "steering it changes the MLP's input only (attention has read it already)"),
    Family("gpt_oss", ("GptOssForCausalLM",), mlp_post=None, moe=True,
           native_attn_z="attn.o_proj", router="mlp.router",
           notes="mlp_out is the whole MoE block output (router and experts); attention "
                 "has sinks and alternates sliding-window and full layers"),
)

# Any other architecture vLLM runs through its Transformers backend (HF's own module
# tree), whose decoder layers at `model.layers` take the stream as `hidden_states` and
# return it: only the stream between layers is known there, so it offers resid_pre and
# resid_post, each read at a layer's input (the last layer's at its output), and refuses
# the rest by name. Not in FAMILIES: family_for never returns it.
TRANSFORMERS_STREAM = Family(
    "transformers_stream", (), deferred_mid_norm=None,
    notes="an architecture without a capsteer family row, served through vLLM's "
          "Transformers backend: resid_pre / resid_post only (the stream entering and "
          "leaving each HF decoder layer)")
_STREAM_ONLY = ("{hook} is not offered for {arch}: it has no capsteer family row, so only "
                "the stream between its HF decoder layers is known (it is served through "
                "vLLM's Transformers backend); use resid_pre or resid_post")

# Refused by name, with the reason the message gives.
_HYBRID = ("layers mix attention with state-space / linear-attention mixers whose recurrent "
           "state lives outside the token rows; capsteer's hook points, prefix-cache rules "
           "and batch-isolation guarantees are defined for attention-only decoders")
_ENCODER = ("it is an encoder (or encoder-decoder) model; capsteer hooks the residual stream "
            "of decoder-only generative models")
_MULTIMODAL = ("it is a multimodal model; capsteer hooks text-only decoders (serve the "
               "text-only checkpoint, e.g. Gemma3ForCausalLM, where one exists)")
REFUSED: dict[str, str] = {
    **{a: f"hybrid state-space model: {_HYBRID}" for a in (
        "JambaForCausalLM", "MambaForCausalLM", "Mamba2ForCausalLM", "FalconMambaForCausalLM",
        "Qwen3NextForCausalLM", "GraniteMoeHybridForCausalLM", "FalconH1ForCausalLM",
        "NemotronHForCausalLM", "Zamba2ForCausalLM", "BambaForCausalLM", "Lfm2ForCausalLM",
        "Lfm2MoeForCausalLM", "Plamo2ForCausalLM", "MiniMaxText01ForCausalLM",
        "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "OlmoHybridForCausalLM")},
    **{a: f"encoder model: {_ENCODER}" for a in (
        "BertModel", "BertForMaskedLM", "BertForSequenceClassification", "RobertaModel",
        "RobertaForMaskedLM", "XLMRobertaModel", "XLMRobertaForSequenceClassification",
        "ModernBertModel", "ModernBertForSequenceClassification", "T5ForConditionalGeneration",
        "BartForConditionalGeneration", "WhisperForConditionalGeneration")},
}
MULTIMODAL_REASON = f"multimodal model: {_MULTIMODAL}"
POOLING_REASON = ("pooling model: vLLM runs it for embeddings or scores, not generation; "
                  "capsteer hooks generative decoder-only models")
HYBRID_REASON = f"hybrid state-space model: {_HYBRID}"

_BY_ARCH = {a: f for f in FAMILIES for a in f.architectures}


def family_for(architecture: str) -> Family | None:
    return _BY_ARCH.get(architecture)


def is_parallel(family: Family, config: object) -> bool:
    """Whether this checkpoint's blocks are parallel (`config`: its HF text config)."""
    if isinstance(family.parallel, bool):
        return family.parallel
    return bool(getattr(config, family.parallel, False))


def parallel_mid_reason(family: Family) -> str:
    return (f"resid_mid does not exist in the {family.name} family's parallel block: "
            "attention and MLP both read resid_pre and their outputs are added to it at "
            "once (resid_post = resid_pre + attn_out + mlp_out); use resid_pre, attn_out, "
            "mlp_out or resid_post")


def unavailable_hooks(family: Family, config: object) -> dict[str, str]:
    """Hooks this checkpoint does not have, each with the reason a request naming it gets
    (a 400): a parallel block has no resid_mid; a stream-only model has no sublayers."""
    if family is TRANSFORMERS_STREAM:
        names = list(getattr(config, "architectures", None) or ()) or ["this model"]
        return {h: _STREAM_ONLY.format(hook=h, arch=names[0])
                for h in ("resid_mid", "attn_out", "mlp_out", *INNER_HOOKS)}
    missing = {"resid_mid": parallel_mid_reason(family)} if is_parallel(family, config) else {}
    if family.mlp_in is None:
        missing["mlp_in"] = (f"mlp_in does not exist in the {family.name} family: no norm "
                             "precedes its MLP, which reads the stream itself (resid_mid); "
                             "use resid_mid")
    if family.mlp_post is None:
        missing["mlp_post"] = (f"mlp_post does not exist in the {family.name} family: its "
                               "MLP is a mixture of experts, whose experts each have their "
                               "own hidden layer (no single d_mlp activation per token); "
                               "use mlp_in or mlp_out")
    if family.router is None:
        missing["router_logits"] = (f"router_logits exists in mixture-of-experts families "
                                    f"only: the {family.name} family's MLP is dense (no "
                                    "router)")
    return missing


def tensor_parallel_reasons(tensor_parallel_size: int, gathered: bool = False) -> dict[str, str]:
    """What tensor parallelism refuses of the hooks whose columns are split across the
    ranks (mlp_post: d_mlp columns, attn_z: heads), keyed as `unavailable_hooks`.

    `gathered` (host-driven engines, CPU): the ranks gather each captured row whole for
    TP rank 0 and steer their own columns, so the hooks are offered but for what needs
    every rank's columns at once: a projection (ablate/clamp along a vector, a `when`
    gate) and readouts. Otherwise (device-driven, GPU) the hooks are refused whole: a
    capture or steering of one rank's slice would be silently partial."""
    if tensor_parallel_size <= 1:
        return {}
    if not gathered:
        return {h: (f"{h} is not offered under tensor parallelism on GPU engines "
                    f"(tensor_parallel_size={tensor_parallel_size}): its columns are split "
                    "across the ranks and capsteer does not assemble them there yet; serve "
                    "with tensor_parallel_size=1")
                for h in WIDE_HOOKS}
    reasons = {}
    for h in WIDE_HOOKS:
        reasons[hook_use(h, PROJECTION)] = (
            f"{h} under tensor parallelism (tensor_parallel_size={tensor_parallel_size}) "
            "takes add and ablate/clamp of selected "
            f"{SELECTIONS[h]} only: its columns are split across the ranks, and a projection "
            "onto a vector (ablate/clamp without a selection) or a `when` gate needs all of "
            "them at once; serve with tensor_parallel_size=1 for those")
        reasons[hook_use(h, READOUT)] = (
            f"readouts of {h} are not offered under tensor parallelism (tensor_parallel_size="
            f"{tensor_parallel_size}): its columns are split across the ranks; capture it "
            "instead (captures gather the ranks' columns)")
    return reasons


def hook_widths(config: object) -> dict[str, int]:
    """Width of each hook that is not the hidden size, from an HF (text) config: mlp_post's
    d_mlp is intermediate_size (GPT-2: n_inner, else 4 * n_embd)."""
    hidden = int(getattr(config, "hidden_size", 0) or getattr(config, "n_embd", 0) or 0)
    d_mlp = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) \
        or 4 * hidden
    heads = int(getattr(config, "num_attention_heads", 0) or getattr(config, "n_head", 0) or 1)
    d_head = int(getattr(config, "head_dim", 0) or hidden // heads)
    widths = {"mlp_post": int(d_mlp), "attn_z": heads * d_head, HEADS_KEY: heads}
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if experts:
        widths["router_logits"] = int(experts)
    return widths


def unavailable_hooks_of(config: object, transformers_backend: bool = False) -> dict[str, str]:
    """`unavailable_hooks` for an HF config (its first architecture's family, or the
    stream-only layout for one without a row that vLLM's Transformers backend runs; none
    for an architecture capsteer refuses, which never starts)."""
    names = list(getattr(config, "architectures", None) or ())
    family = family_for(names[0]) if names else None
    if family is None and transformers_backend:
        return unavailable_hooks(TRANSFORMERS_STREAM, config)
    text = getattr(config, "text_config", None) or config
    return unavailable_hooks(family, text) if family is not None else {}


def hf_modules(family: Family, parallel: bool = False) -> dict[str, str | None]:
    """Where each hook is, in HF transformers' module tree (the reference it equals);
    None for a hook the model does not have."""
    layer = f"{family.hf_base}.{family.layers}[L]"
    if family is TRANSFORMERS_STREAM:
        return {"resid_pre": f"{layer} input (hidden_states[L])", "resid_mid": None,
                "resid_post": f"{layer} output (hidden_states[L+1] for L < last)",
                "attn_out": None, "mlp_out": None, "mlp_in": None, "mlp_post": None,
                "attn_z": None, "router_logits": None}
    first = (" (hidden_states[0] = token + position embedding)"
             if family.position_embedding else "")
    return {"resid_pre": f"{layer} input (hidden_states[L]){first}",
            "resid_mid": None if parallel else f"{layer}.{family.resid_mid} input",
            "resid_post": f"{layer} output (hidden_states[L+1] for L < last)",
            "attn_out": f"{layer}.{family.attn_out} output",
            "mlp_out": f"{layer}.{family.mlp_out} output",
            "mlp_in": None if family.mlp_in is None else f"{layer}.{family.mlp_in} input",
            "mlp_post": None if family.mlp_post is None else f"{layer}.{family.mlp_post} input",
            "attn_z": f"{layer}.{family.attn_z} input",
            "router_logits": None if family.router is None
            else f"{layer}.{family.router} output[0]"}


def supported_names() -> str:
    return ", ".join(f.name for f in FAMILIES)


def refusal_reason(architecture: str) -> str | None:
    """Why an architecture is refused by name (hybrid, encoder, multimodal), or None."""
    if architecture in REFUSED:
        return REFUSED[architecture]
    if architecture.endswith(("ForConditionalGeneration", "VLForCausalLM")) or any(
            k in architecture for k in ("Llava", "VL", "Vision", "Omni", "Audio")):
        return MULTIMODAL_REASON
    return None


@dataclass(frozen=True)
class Tap:
    """One place under a decoder layer where part of a site is read (and steered).

    read: "pair" = the (x, residual) inputs of a fused add+norm (x is the sublayer
    value, x + residual the stream); "input" = the stream is the module's
    `hidden_states` input ("" = the layer itself); "output" = the sublayer value is
    the module's output. offset: the site is 2L + offset; `inner`: the site is that
    inner hook's instead (inner_site), its value the module's input (read "input",
    kind SUB: a tensor the stream does not alias)."""

    module: str
    read: str
    offset: int
    kinds: int
    inner: str | None = None

    def site(self, layer: int, num_layers: int) -> int:
        if self.inner is not None:
            return inner_site(self.inner, layer, num_layers)
        return 2 * layer + self.offset


def mlp_in_tap(family: Family, backend: bool) -> Tap | None:
    """The tap reading mlp_in at the MLP module's input, or None where the family has no
    norm before its MLP. `backend`: vLLM's Transformers backend (HF's module names)."""
    if family.mlp_in is None or family is TRANSFORMERS_STREAM:
        return None
    module = family.mlp_in if backend else family.native_mlp_in or family.mlp_in
    return Tap(module, "input", 0, SUB_BIT, inner="mlp_in")


def mlp_post_tap(family: Family, backend: bool) -> Tap | None:
    """The tap reading mlp_post at the input of the MLP's output projection, or None
    where the MLP is a mixture of experts."""
    if family.mlp_post is None or family is TRANSFORMERS_STREAM:
        return None
    module = family.mlp_post if backend else family.native_mlp_post or family.mlp_post
    return Tap(module, "input", 0, SUB_BIT, inner="mlp_post")


def attn_z_tap(family: Family, backend: bool) -> Tap | None:
    """The tap reading attn_z at the input of attention's output projection."""
    if family is TRANSFORMERS_STREAM:
        return None
    module = family.attn_z if backend else family.native_attn_z or family.attn_z
    return Tap(module, "input", 0, SUB_BIT, inner="attn_z")


def router_tap(family: Family, backend: bool) -> Tap | None:
    """The tap reading router_logits at an MoE router's output (capture only)."""
    if family.router is None or family is TRANSFORMERS_STREAM:
        return None
    module = family.router if backend else family.native_router or family.router
    return Tap(module, "output", 0, SUB_BIT, inner="router_logits")


def layer_taps(family: Family, materialized: bool, parallel: bool = False,
               backend: bool = False) -> tuple[Tap, ...]:
    """The taps of one decoder layer, in forward order. `materialized`: vLLM runs
    HF-shaped layers (its Transformers backend, or a native class that adds the residual
    itself). `parallel`: a parallel block, whose site 2L+1 has attn_out and no stream.
    `backend`: vLLM's Transformers backend runs the layer (HF's module names)."""
    if family is TRANSFORMERS_STREAM:  # the stream between layers only
        return (Tap("", "input", 0, STREAM_BIT),)
    inner = tuple(t for t in (mlp_in_tap(family, backend), router_tap(family, backend),
                              mlp_post_tap(family, backend)) if t is not None)
    z = attn_z_tap(family, backend)
    if not materialized and family.deferred_mid_norm is not None:
        if parallel:
            raise ValueError(f"{family.name}: a parallel block has no fused mid norm to read")
        return (Tap("input_layernorm", "pair", 0, BOTH), *filter(None, (z,)),
                Tap(family.deferred_mid_norm, "pair", 1, BOTH), *inner)
    mid = () if parallel else (Tap(family.resid_mid, "input", 1, STREAM_BIT),)
    return (Tap("", "input", 0, STREAM_BIT),
            *filter(None, (z,)),
            Tap(family.attn_out, "output", 1, SUB_BIT),
            *mid,
            *inner,
            Tap(family.mlp_out, "output", 2, SUB_BIT))


def final_tap(family: Family, materialized: bool) -> Tap:
    """The final norm (under the inner model): its input is resid_post of the last layer.
    The stream-only layout reads it at the last decoder layer's output instead (its final
    norm has no name capsteer knows)."""
    if family is TRANSFORMERS_STREAM:
        return Tap("", "output", 0, STREAM_BIT)
    if not materialized and family.deferred_mid_norm is not None:
        return Tap("norm", "pair", 0, BOTH)
    return Tap("norm", "input", 0, STREAM_BIT)
