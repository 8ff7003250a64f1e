"""Activation patching (`op: patch`) on the lent GPU: device mode, CUDA graphs on (vLLM's
defaults), sync debug on, fp32. A capture of prompt A, then prompt B patched with A's
values at resid_post 2 (prompt positions) and mlp_out 4 (two of them generated, so decode
steps replay graphs with patched rows), beside two plain requests in one batch:
1. greedy tokens and top-5 log-probs vs HF fp32 with forward hooks setting the same
   values, then teacher-forced log-probs of HF's tokens;
2. the plain requests equal HF without hooks (batch isolation);
3. sync debug: no host sync in any step; the worker ran in device mode.
Writes patch.json to --out ($OUT), prints it.

    python tests/gpu/gpu_patch_check.py --out $OUT      # GPU
    .venv/bin/python tests/gpu/gpu_patch_check.py --device cpu    # CPU smoke (host mode)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

TOKENS = 24
ATOL = 1e-3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=".")
    parser.add_argument("--model-root", default="/tmp/capsteer-patch-models")
    args = parser.parse_args()
    # After argparse: --help answers without loading torch and vLLM.
    import torch

    from capsteer.demo_model import DemoShape, write_demo_model
    from capsteer.engine import Engine
    from capsteer.reference import hf_greedy, load_hf

    # The checkout's `tests` package, after the installed capsteer (appended, not prepended).
    sys.path.append(str(Path(__file__).resolve().parents[2]))
    from tests.engine.patch_runs import capture_points, run_patched

    gpu = args.device == "cuda"
    shape = DemoShape(hidden_size=512, num_layers=6, num_heads=8, num_kv_heads=4, head_dim=64,
                      intermediate_size=1024) if gpu else DemoShape(num_layers=6)
    model_dir = f"{args.model_root}/qwen3-{args.device}"
    write_demo_model(model_dir, "qwen3", seed=5, shape=shape, dtype="float32",
                     device=args.device)
    kw = (dict(gpu_memory_utilization=0.4, max_model_len=1024) if gpu else
          dict(kv_cache_memory_bytes=256 << 20, max_model_len=512, max_num_batched_tokens=64,
               max_num_seqs=16, block_size=32))
    t0 = time.time()
    engine = Engine(model_dir, dtype="float32", seed=0,
                    capsteer_config={"sync_debug": True}, **kw)
    row: dict = {"device": args.device, "engine_start_s": round(time.time() - t0, 1),
                 "cudagraph_mode": str(engine.llm.llm_engine.vllm_config.compilation_config
                                       .cudagraph_mode)}
    hf = load_hf(model_dir, dtype=torch.float32, device=args.device)
    gen = torch.Generator().manual_seed(0)
    source, prompt = ([int(t) for t in torch.randint(5, 700, (n,), generator=gen)]
                      for n in (40, 30))
    # mlp_out's 31, 33: B's generated positions
    points = [("resid_post", 2, [3, 4, 5, 6, 7]), ("mlp_out", 4, [10, 31, 33])]
    cap = capture_points(engine, source, points, {"max_tokens": 2, "temperature": 0.0})
    sampling = {"max_tokens": TOKENS, "temperature": 0.0, "ignore_eos": True, "logprobs": 5}
    run = run_patched(engine, hf, cap, prompt, points, sampling, device=args.device)
    plain, patched, plain2, forced = run.plain, run.patched, run.plain2, run.forced
    ref_tokens, ref_lps = run.ref_tokens, run.ref_lps
    with torch.no_grad():
        plain_ref, plain_lps = hf_greedy(hf, prompt, TOKENS)
    row["patched_tokens_equal_hf"] = patched.token_ids == ref_tokens
    row["patch_changed_tokens"] = patched.token_ids != plain.token_ids
    row["patched_max_lp_diff"] = max(abs(lp - float(ref_lps[i][t]))
                                     for i, step in enumerate(patched.logprobs)
                                     for t, lp in step.items())
    row["teacher_forced_max_lp_diff"] = max(
        abs(forced.prompt_logprobs[len(prompt) + i][t] - float(ref_lps[i][t]))
        for i, t in enumerate(ref_tokens))
    row["plain_tokens_equal_hf"] = plain.token_ids == plain_ref == plain2.token_ids
    row["plain_max_lp_diff"] = max(abs(lp - float(plain_lps[i][t]))
                                   for res in (plain, plain2)
                                   for i, step in enumerate(res.logprobs)
                                   for t, lp in step.items())
    stats = engine.stats()[0]
    row["mode"] = stats.get("mode")
    row["stats"] = {k: v for k, v in stats.items() if isinstance(v, (int, float, str))}
    print(json.dumps(row, indent=1))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"patch_{args.device}.json").write_text(json.dumps(row, indent=1))
    assert row["patched_tokens_equal_hf"] and row["patch_changed_tokens"], row
    assert row["patched_max_lp_diff"] < ATOL and row["teacher_forced_max_lp_diff"] < ATOL, row
    assert row["plain_tokens_equal_hf"] and row["plain_max_lp_diff"] < ATOL, row
    assert row["mode"] == ("device" if gpu else "host"), row
    print("ok")


if __name__ == "__main__":
    main()
