"""GPU validation of the engine extension (run on the lent GPU through ../shared/gpu/).

bf16, torch.compile + CUDA graphs on (vLLM's defaults), sync debug mode "error" over
the hook code and the forward of every step with hooks. Checks:
- every hook, layer and position of captured requests against HF transformers (bf16,
  same GPU): relative error per (hook, layer);
- steering: greedy tokens and log-probs against an HF forward hook doing the same;
- a batched run equals each request run alone (tokens; capture relative error);
- no host sync in steered+captured steps, no harvest errors.
Writes a JSON report to $OUT (or .//tmp/capsteer-gpu-checks) and prints a table.

    python tests/gpu/gpu_validate.py [--layers 8] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def rel_err(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-6))


def main() -> None:
    import torch

    from capsteer.demo_model import DemoShape, write_demo_model
    from capsteer.engine import Engine, Request
    from capsteer.hooks import HOOKS
    from capsteer.reference import hf_activations, hf_greedy, load_hf
    from capsteer.steering.spec import parse_steering_spec

    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--model-dir", default="/tmp/capsteer-gpu-model")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/capsteer-gpu-checks"))
    ap.add_argument("--eager", action="store_true", help="enforce_eager (no CUDA graphs)")
    ap.add_argument("--canary-warn", action="store_true", help="diagnose a failing canary")
    ap.add_argument("--vanilla", action="store_true", help="also compare plain requests with vLLM")
    ap.add_argument("--capture-ring", default=None, metavar="SIZE",
                    help="writer processes' ring (capture_ring_bytes, e.g. 1MiB): a small one "
                         "sends routes past the device ring to the harvester's packed copy")
    args = ap.parse_args()
    report: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    t0 = time.time()
    shape = DemoShape(hidden_size=1024, num_layers=args.layers, num_heads=16, num_kv_heads=8,
                      head_dim=64, intermediate_size=3072, vocab_size=1024,
                      max_position_embeddings=4096)
    write_demo_model(args.model_dir, "qwen3", seed=3, shape=shape, dtype="bfloat16")
    report["model_write_s"] = round(time.time() - t0, 1)

    t0 = time.time()
    capture_root = Path(args.model_dir).parent / "capsteer-validate-captures"
    config = {"sync_debug": True, "capture_dir": str(capture_root),
              **({"canary": "warn"} if args.canary_warn else {}),
              **({"capture_ring_bytes": args.capture_ring} if args.capture_ring else {})}
    engine = Engine(args.model_dir, dtype="bfloat16", gpu_memory_utilization=0.5,
                    max_model_len=2048, seed=0, capsteer_config=config,
                    enforce_eager=args.eager)
    report["engine_start_s"] = round(time.time() - t0, 1)
    import vllm

    cc = engine.llm.llm_engine.vllm_config.compilation_config
    report["vllm"] = vllm.__version__
    report["cudagraph_mode"] = str(cc.cudagraph_mode)
    report["compile_mode"] = str(getattr(cc, "mode", getattr(cc, "level", None)))
    print(json.dumps(report), flush=True)

    hf = load_hf(args.model_dir, dtype=torch.bfloat16, device="cuda")
    # fp32 "truth" on the same weights: bf16 drift of vLLM and of HF side by side.
    hf32 = load_hf(args.model_dir, dtype=torch.float32, device="cuda")
    hidden, layers = shape.hidden_size, shape.num_layers
    gen = torch.Generator().manual_seed(0)

    def vec(scale: float = 1.0) -> list[float]:
        v = torch.randn(hidden, generator=gen)
        return (v / v.norm() * scale).tolist()

    prompts = [[int(t) for t in torch.randint(5, 700, (n,), generator=gen)] for n in
               (37, 300, 12, 90, 150, 64)]
    all_hooks = {"hooks": [h for h in HOOKS if h not in engine.unavailable], "layers": "all",
                 "positions": "all"}
    steer_add = {"vectors": [{"hook": "resid_post", "layer": layers // 2, "vector": vec(),
                              "scale": 40.0}]}
    steer_clamp = {"vectors": [{"hook": "resid_mid", "layer": 1, "vector": vec(), "op": "clamp",
                                "value": 30.0}]}
    greedy = lambda n, **kw: {"max_tokens": n, "temperature": 0.0, "ignore_eos": True, **kw}  # noqa: E731
    requests = [
        Request(prompt_token_ids=prompts[0], sampling=greedy(16), capture=all_hooks),
        Request(prompt_token_ids=prompts[1], sampling=greedy(8), capture=all_hooks),
        Request(prompt_token_ids=prompts[2], sampling=greedy(32, logprobs=5), steering=steer_add),
        Request(prompt_token_ids=prompts[3], sampling=greedy(32, logprobs=5), steering=steer_clamp),
        Request(prompt_token_ids=prompts[4], sampling=greedy(12), steering=steer_add,
                capture={"hooks": ["resid_post", "mlp_out"], "layers": "all"}),
        Request(prompt_token_ids=prompts[5], sampling=greedy(20)),
    ]
    t0 = time.time()
    batched = engine.generate(requests)
    report["batched_generate_s"] = round(time.time() - t0, 2)

    # 1. captures vs HF (bf16, same GPU) and vs HF fp32, next to HF bf16 vs HF fp32
    cap_errs: dict[str, float] = {}
    truth_errs: dict[str, list[float]] = {}
    for req, res in zip(requests, batched, strict=True):
        if res.captures is None:
            continue
        fed = res.prompt_token_ids + res.token_ids[:-1]
        spec = parse_steering_spec(req.steering, num_layers=layers, hidden_size=hidden)
        ref = hf_activations(hf, fed, steering=spec, prompt_len=len(res.prompt_token_ids))
        assert res.captures.positions.tolist() == list(range(len(fed))), "positions"
        assert res.captures.token_ids.tolist() == fed, "token ids"
        ref32 = hf_activations(hf32, fed, steering=spec, prompt_len=len(res.prompt_token_ids))
        for key, got in res.captures.tensors.items():
            err = rel_err(got, ref[key].cpu())
            name = f"{key[0]}"
            cap_errs[name] = max(cap_errs.get(name, 0.0), err)
            pair = truth_errs.setdefault(name, [0.0, 0.0])
            pair[0] = max(pair[0], rel_err(got, ref32[key].cpu()))
            pair[1] = max(pair[1], rel_err(ref[key].cpu(), ref32[key].cpu()))
    report["capture_max_rel_err_vs_hf_bf16"] = {k: round(v, 5) for k, v in cap_errs.items()}
    report["capture_max_rel_err_vs_hf_fp32__capsteer_bf16_vs_hf_bf16"] = {
        k: [round(a, 5), round(b, 5)] for k, (a, b) in truth_errs.items()}

    # 2. steering vs HF greedy (bf16 kernels differ, so report agreement)
    steer_rows = []
    for req, res in zip(requests, batched, strict=True):
        if req.steering is None or res.logprobs is None:
            continue
        spec = parse_steering_spec(req.steering, num_layers=layers, hidden_size=hidden)
        ref_tokens, ref_lp = hf_greedy(hf, req.prompt_token_ids, len(res.token_ids), steering=spec)
        plain, _ = hf_greedy(hf, req.prompt_token_ids, len(res.token_ids))
        truth, _ = hf_greedy(hf32, req.prompt_token_ids, len(res.token_ids), steering=spec)

        def prefix(a, b):
            return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        agree = next((i for i, (a, b) in enumerate(zip(res.token_ids, ref_tokens, strict=True))
                      if a != b), len(ref_tokens))
        lp_diff = max(abs(lp - float(ref_lp[i][t])) for i in range(agree)
                      for t, lp in res.logprobs[i].items()) if agree else None
        steer_rows.append({"op": req.steering["vectors"][0].get("op", "add"),
                           "tokens": len(ref_tokens), "agree_prefix": agree,
                           "max_logprob_diff_on_agreeing_steps": lp_diff,
                           "steering_changed_hf_output": plain != ref_tokens,
                           "agree_prefix_vs_hf_fp32__capsteer_bf16_vs_hf_bf16":
                               [prefix(res.token_ids, truth), prefix(ref_tokens, truth)]})
    report["steering_vs_hf"] = steer_rows

    # 2b. the same batch with durable captures (the writer processes; on the GPU the rows
    # go from the device into their shared memory): the files equal the in-memory captures
    from dataclasses import replace

    from capsteer.capture import read

    durable = engine.generate([replace(r, durable=True) for r in requests])
    dur_rows = []
    for mem, dur in zip(batched, durable, strict=True):
        if mem.captures is None:
            continue
        rec = dur.receipt
        row = {"status": None if rec is None else rec.status,
               "same_tokens": mem.token_ids == dur.token_ids}
        if rec is not None and rec.status == "ok":
            cap = read(capture_root / rec.dir)
            row["positions_equal"] = cap.positions.tolist() == mem.captures.positions.tolist()
            row["max_rel_err_vs_memory"] = max(rel_err(cap.tensor(*k), v)
                                               for k, v in mem.captures.tensors.items())
        dur_rows.append(row)
    # the batch once more in memory: how far two runs of it differ on their own (a second
    # run's scheduling can differ, and bf16 kernels are batch-variant); the durable run is
    # compared with it too, so a durable run that took the other schedule shows as 0 there
    again = engine.generate(requests)
    captured = [(m, d) for m, d in zip(batched, durable, strict=True) if m.captures is not None]
    for row, (mem, dur), mem2 in zip(dur_rows, captured,
                                     [r for r in again if r.captures is not None], strict=True):
        row["memory_rerun_same_tokens"] = mem.token_ids == mem2.token_ids
        row["memory_rerun_max_rel_err"] = max(rel_err(mem2.captures.tensors[k], v)
                                              for k, v in mem.captures.tensors.items())
        rec = dur.receipt
        if rec is not None and rec.status == "ok" and dur.token_ids == mem2.token_ids:
            cap = read(capture_root / rec.dir)
            row["durable_vs_rerun_max_rel_err"] = max(rel_err(cap.tensor(*k), v)
                                                      for k, v in mem2.captures.tensors.items())
    report["durable_vs_memory"] = dur_rows
    report["writer_stats"] = [{k: v for k, v in (s or {}).items() if k != "processes"}
                              for s in engine.writer_stats()]
    report["harvest"] = [s.get("harvest") for s in engine.stats()]

    # 3. batch isolation. bf16 kernels are batch-variant, so tokens may diverge at a near
    # tie; captures are compared where both runs fed identical inputs (prompt + agreeing
    # generated prefix), which separates numerical divergence from a hook mixing rows.
    iso = []
    for req, together in zip(requests, batched, strict=True):
        (alone,) = engine.generate([req])
        agree = next((i for i, (a, b) in enumerate(zip(together.token_ids, alone.token_ids,
                                                        strict=True)) if a != b),
                     len(alone.token_ids))
        row = {"same_tokens": alone.token_ids == together.token_ids, "agree_prefix": agree}
        if together.captures is not None:
            same_inputs = len(together.prompt_token_ids) + agree
            row["capture_max_rel_err_on_identical_inputs"] = max(
                rel_err(v[:same_inputs], alone.captures.tensors[k][:same_inputs])
                for k, v in together.captures.tensors.items())
        iso.append(row)
    report["batched_vs_alone"] = iso
    # 4b. a capture too large for one step's staging buffer fails alone, with a reason
    big = [int(t) for t in torch.randint(5, 700, (1900,), generator=gen)]
    over, after = engine.generate([
        Request(prompt_token_ids=big, sampling=greedy(2), capture=all_hooks),
        Request(prompt_token_ids=prompts[2], sampling=greedy(8), capture={"hooks": ["resid_post"]}),
    ])
    report["staging_overflow"] = {
        "error": over.captures.error if over.captures else "no result",
        "tokens_generated": len(over.token_ids),
        "next_capture_ok": bool(after.captures and after.captures.error is None
                                and len(after.captures.positions) == len(prompts[2]) + 7),
    }
    plain = [Request(prompt_token_ids=p, sampling=greedy(24)) for p in prompts]
    capsteer_plain = [r.token_ids for r in engine.generate(plain)]
    # 4a. plain steps replay the tap-free graphs (--plain-graphs): the same requests on the
    # hooked graphs, as every step ran before, must give the same tokens
    # (both after the run above, so both find its prompts in the prefix cache alike)
    if engine.llm.collective_rpc("capsteer_plain_graphs", args=(False,))[0] is not None:
        on_hooked = [r.token_ids for r in engine.generate(plain)]
        engine.llm.collective_rpc("capsteer_plain_graphs", args=(True,))
        on_plain = [r.token_ids for r in engine.generate(plain)]
        report["plain_graphs_same_tokens_as_hooked_graphs"] = [
            a == b for a, b in zip(on_plain, on_hooked, strict=True)]
    else:
        report["plain_graphs_same_tokens_as_hooked_graphs"] = "this engine has no plain graphs"

    # 4. sync debug + harvest stats
    report["worker_stats"] = engine.llm.collective_rpc("capsteer_stats")
    engine.close()
    del engine
    if args.vanilla:
        # 5. requests without hooks, through capsteer vs plain vLLM: same tokens
        import gc

        from vllm import LLM, SamplingParams

        gc.collect()
        torch.cuda.empty_cache()
        llm = LLM(model=args.model_dir, dtype="bfloat16", gpu_memory_utilization=0.5,
                  max_model_len=2048, seed=0, enforce_eager=args.eager)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(**greedy(24)), use_tqdm=False)
        vanilla = [list(o.outputs[0].token_ids) for o in outs]
        report["plain_requests_equal_vanilla"] = [a == b for a, b in
                                                  zip(capsteer_plain, vanilla, strict=True)]
    print(json.dumps(report, indent=1), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "gpu_validate_eager.json" if args.eager else "gpu_validate.json"
    (out / name).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
