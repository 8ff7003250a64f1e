"""Is vLLM itself run-to-run deterministic here? Two fresh vanilla engines and one
capsteer engine (no hooks in any request) generate the same greedy batch.

    python bench/gpu_determinism.py --model-dir DIR [--eager]
"""

from __future__ import annotations

import argparse
import gc
import json


def main() -> None:
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", default="/tmp/capsteer-gpu-model")
    ap.add_argument("--eager", action="store_true")
    args = ap.parse_args()
    from vllm import LLM, SamplingParams

    from capsteer.engine import Engine, Request

    gen = torch.Generator().manual_seed(0)
    prompts = [[int(t) for t in torch.randint(5, 700, (n,), generator=gen)]
               for n in (37, 300, 12, 90, 150, 64)]
    sampling = {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    common = dict(dtype="bfloat16", gpu_memory_utilization=0.5, max_model_len=2048, seed=0,
                  enforce_eager=args.eager)
    runs = {}
    for name in ("vanilla_a", "vanilla_b", "capsteer"):
        if name == "capsteer":
            eng = Engine(args.model_dir, **common)
            runs[name] = [r.token_ids for r in eng.generate(
                [Request(prompt_token_ids=p, sampling=sampling) for p in prompts])]
            eng.close()
        else:
            llm = LLM(model=args.model_dir, **common)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                SamplingParams(**sampling), use_tqdm=False)
            runs[name] = [list(o.outputs[0].token_ids) for o in outs]
            llm.llm_engine.engine_core.shutdown()
            del llm
        gc.collect()
        torch.cuda.empty_cache()
    same = lambda a, b: [x == y for x, y in zip(runs[a], runs[b], strict=True)]  # noqa: E731
    print(json.dumps({"eager": args.eager,
                      "vanilla_a_vs_vanilla_b": same("vanilla_a", "vanilla_b"),
                      "vanilla_a_vs_capsteer": same("vanilla_a", "capsteer")}), flush=True)


if __name__ == "__main__":
    main()
