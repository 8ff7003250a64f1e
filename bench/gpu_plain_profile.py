"""Where plain (no fields), steered and capturing capsteer engines spend time that stock
vLLM does not.

One process per configuration (vanilla vLLM, capsteer plain), each in-process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, so torch.profiler sees the model's kernels): the model
runner class, the compilation config, then one prefill batch and one decode batch timed
and profiled. Prints the top kernels by CUDA time per configuration and the greedy
tokens of a few prompts (plain identity).

    python bench/gpu_plain_profile.py [--out DIR] [--configs vanilla,plain,steer,capture]
        [--step-tokens 2048] [--keep-code]     (--one CONFIG runs one process)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def one(config: str, model: str, out: Path, step_tokens: int) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if os.environ.get("CAPSTEER_KEEP_CODE"):
        # A fresh compile cache per configuration, so its Inductor output code can be kept
        # and the pieces of vanilla and capsteer compared line by line.
        os.environ["VLLM_CACHE_ROOT"] = f"/tmp/prof-cache-{config}"
    import random

    import torch
    from vllm import LLM, SamplingParams

    kw = dict(dtype="bfloat16", seed=0, max_model_len=1024, gpu_memory_utilization=0.6,
              max_num_batched_tokens=step_tokens)
    engine = None
    if config == "vanilla":
        llm = LLM(model=model, **kw)
    else:
        from capsteer.engine import Engine, Request

        # Experiments: CAPSTEER_PROFILE_CONFIG (JSON) adds capsteer config keys (e.g.
        # capture_workers); CAPSTEER_SWITCH_INTERVAL sets this process's GIL switch interval.
        extra = json.loads(os.environ.get("CAPSTEER_PROFILE_CONFIG") or "{}")
        if os.environ.get("CAPSTEER_SWITCH_INTERVAL"):
            sys.setswitchinterval(float(os.environ["CAPSTEER_SWITCH_INTERVAL"]))
        info_extra = {"capsteer_config": extra, "switch_interval": sys.getswitchinterval()}
        engine = Engine(model, capsteer_config={"capture_dir": "/tmp/prof-captures", **extra},
                        **kw)
        llm = engine.llm
    steering = {"vectors": [{"hook": "resid_post", "layers": "all",
                             "vector": [0.01] * engine.hidden_size, "scale": 1.0}]} \
        if config == "steer" else None
    capture = {"hooks": ["resid_post"], "layers": [engine.num_layers // 2],
               "positions": "prompt", "layout": "packed"} if config == "capture" else None
    receipts: list = []

    def generate(batch: list[dict], sp) -> None:
        if steering is None and capture is None:
            llm.generate(batch, sp, use_tqdm=False)
            return
        results = engine.generate(
            [Request(prompt_token_ids=b["prompt_token_ids"], steering=steering, capture=capture,
                     durable=capture is not None,
                     sampling={"max_tokens": sp.max_tokens, "temperature": 0.0,
                               "ignore_eos": True}) for b in batch], timeout=900)
        receipts.extend(r.receipt for r in results if r.receipt is not None)
    info = {"config": config, **(info_extra if engine is not None else {})}
    info["runner"] = llm.collective_rpc(
        lambda self: f"{type(self.model_runner).__module__}.{type(self.model_runner).__name__}")
    cc = llm.llm_engine.vllm_config.compilation_config
    info["cudagraph_mode"] = str(cc.cudagraph_mode)
    info["splitting_ops"] = list(cc.splitting_ops or [])
    info["custom_ops"] = list(cc.custom_ops or [])
    info["pass_config"] = str(cc.pass_config)
    rng = random.Random(1)

    def prompts(n: int, length: int) -> list[dict]:
        return [{"prompt_token_ids": [rng.randrange(100, 150000) for _ in range(length)]}
                for _ in range(n)]

    greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    ident = [{"prompt_token_ids": [random.Random(i).randrange(100, 150000) for _ in range(64)]}
             for i in range(8)]
    info["identity"] = [o.outputs[0].token_ids for o in llm.generate(ident, greedy, use_tqdm=False)]
    for name, (n, p, g) in {"prefill": (128, 512, 1), "decode": (256, 128, 128)}.items():
        sp = SamplingParams(max_tokens=g, temperature=0.0, ignore_eos=True)
        generate(prompts(n, p), sp)  # warm
        times = []
        receipts.clear()
        for _ in range(3):
            t = time.perf_counter()
            generate(prompts(n, p), sp)
            times.append(time.perf_counter() - t)
        info[f"{name}_s"] = sorted(times)[1]
        if engine is not None:  # the hooks' host seconds per phase, plan builds and reuses
            info[f"{name}_capsteer_stats"] = engine.stats()
        if capture is not None:
            info[f"{name}_publish"] = publish_timings(receipts)
        # Every Python thread's stacks over one more batch: where the host time goes
        # between torch ops (request path, scheduler, harvester, writer pool).
        from stack_sampler import StackSampler

        t = time.perf_counter()
        with StackSampler() as sampler:
            generate(prompts(n, p), sp)
        info[f"{name}_sampled_s"] = time.perf_counter() - t
        (out / f"stacks-{config}-{name}.json").write_text(
            json.dumps(sampler.report(top=40), indent=1))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            generate(prompts(n, p), sp)
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
        (out / f"profile-{config}-{name}.txt").write_text(table)
        info[f"{name}_top"] = table.splitlines()[:40]
        # Host cost is what an eager step pays: the same events by self CPU time.
        info[f"{name}_cpu_top"] = prof.key_averages().table(
            sort_by="self_cpu_time_total", row_limit=40).splitlines()[:46]
    (out / f"plain-profile-{config}-{os.getpid()}.json").write_text(json.dumps(info, indent=1))
    print("RESULT " + json.dumps({k: v for k, v in info.items() if not k.endswith("_top")}))
    if os.environ.get("CAPSTEER_KEEP_CODE"):
        subprocess.run(f"cd /tmp && find prof-cache-{config} -name '*.py' | "
                       f"tar czf {out}/code-{config}.tar.gz -T -", shell=True, check=False)


def publish_timings(receipts: list) -> dict:
    """Medians and maxima of the manifests' timings (seconds) over the receipts."""
    import statistics

    rows: dict[str, list[float]] = {}
    for r in receipts:
        for k, v in (r.timings or {}).items():
            if k.endswith("_s"):
                rows.setdefault(k, []).append(float(v))
    return {k: {"median": statistics.median(v), "max": max(v), "n": len(v)}
            for k, v in rows.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--one")
    ap.add_argument("--model", default="/tmp/prof-model")
    ap.add_argument("--out", default=os.environ.get("OUT") or "/tmp/prof-out")
    ap.add_argument("--keep-code", action="store_true",
                    help="tar each configuration's compiled code (Inductor output) into --out")
    ap.add_argument("--configs", default="vanilla,plain,steer")
    ap.add_argument("--step-tokens", type=int, default=2048, help="max_num_batched_tokens")
    a = ap.parse_args()
    if a.keep_code:
        os.environ["CAPSTEER_KEEP_CODE"] = "1"
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.one:
        one(a.one, a.model, out, a.step_tokens)
        return
    import perf_models

    perf_models.write_model(a.model, "qwen3-0.6b", "cuda")
    for config in a.configs.split(","):
        proc = subprocess.run([sys.executable, __file__, "--one", config, "--model", a.model,
                               "--out", str(out), "--step-tokens", str(a.step_tokens)],
                              capture_output=True, text=True)
        res = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        print(config, proc.returncode, res[0][:1500] if res else proc.stderr[-4000:], flush=True)
        (out / f"{config}-{time.time():.0f}.log").write_text(proc.stdout[-20000:] + proc.stderr[-20000:])
    for f in sorted(out.glob("profile-*-prefill.txt")):
        print(f"== {f.name}\n" + "\n".join(f.read_text().splitlines()[:14]), flush=True)


if __name__ == "__main__":
    main()
