"""plain_identity without the full method: greedy tokens of N plain requests from two
vanilla engines and one capsteer engine (each in its own process, compiled unless
--eager), and how many prompts each pair agrees on.

    python bench/plain_identity.py --model-dir DIR [--dtype bfloat16] [--prompts 64]
        [--eager] [--out results.json]

CPU: --gpu-memory-utilization 0.3 sizes the KV cache (the default).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def _prompts(n: int, vocab: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(8, 200, (n,), generator=gen)
    return [[int(t) for t in torch.randint(5, vocab, (int(k),), generator=gen)] for k in lengths]


def _one(args: argparse.Namespace, which: str, out: Path) -> None:
    """Child process: one engine, all prompts, token ids to `out`."""
    prompts = _prompts(args.prompts, args.vocab)
    sampling = {"max_tokens": args.max_tokens, "temperature": 0.0, "ignore_eos": True}
    common = dict(dtype=args.dtype, gpu_memory_utilization=args.gpu_memory_utilization,
                  max_model_len=512, seed=0, enforce_eager=args.eager)
    if which == "capsteer":
        from capsteer.engine import Engine, Request

        engine = Engine(args.model_dir, **common)
        tokens = [list(r.token_ids) for r in engine.generate(
            [Request(prompt_token_ids=p, sampling=sampling) for p in prompts])]
        engine.close()
    else:
        from vllm import LLM, SamplingParams

        llm = LLM(model=args.model_dir, **common)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(**sampling), use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
    out.write_text(json.dumps(tokens))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--vocab", type=int, default=400)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--out")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _one(args, args.child, Path(args.child_out))
        return
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("vanilla_a", "capsteer", "vanilla_b"):
            path = Path(tmp) / f"{name}.json"
            subprocess.run([sys.executable, __file__, *sys.argv[1:], "--child",
                            name.split("_")[0], "--child-out", str(path)], check=True)
            runs[name] = json.loads(path.read_text())

    def agree(a: str, b: str) -> int:
        return sum(x == y for x, y in zip(runs[a], runs[b], strict=True))

    result = {"model_dir": args.model_dir, "dtype": args.dtype, "eager": args.eager,
              "prompts": args.prompts, "max_tokens": args.max_tokens,
              "vanilla_vs_vanilla": agree("vanilla_a", "vanilla_b"),
              "capsteer_vs_vanilla": agree("capsteer", "vanilla_a"),
              "command": " ".join(["python", "bench/plain_identity.py", *sys.argv[1:]])}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
