"""Where a capturing batch's time goes, by accounting rather than by A/B timing.

A/B timings on the lent hosts drift by more than the differences looked for, so this
measures, inside each batch, what every thread did: one process per configuration,
engine in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0: the step loop runs on the main
thread), P3's prefill workload (256 x 512 prompt + 64 out), and per batch:
- wall seconds and the main (step) thread's CPU seconds: wall - CPU is time the step
  thread was off the CPU (GIL waits, backpressure, device syncs);
- the hooks' own per-step host seconds on the step thread (before_step, the plan and
  index upload before the forward, after_step) and the harvester's ring waits
  (backpressure) and delivery seconds (capsteer_stats);
- every other thread's CPU seconds, by thread name (writer pool, digest pool,
  harvester): their Python holds the GIL the step thread needs.

`capture` publishes through the writer process (capture_writer=process, the default);
`capture_threads` through the in-process writer threads, for the A/B of the two;
`capture_spin` has the harvester spin on its copy events (the old wait) instead of
sleeping in the driver; `capture_all` captures every layer (P3-all; its captures are
removed after each batch, untimed), `capture_all_one` the same through one writer
process (the default is a pool of two on hosts of 8 or more CPUs), `capture_all_wN`
through N. The writer process's threads are accounted too
(`writer_threads_cpu_s`).

    python bench/capture_phases.py [--configs vanilla,plain,capture,capture_threads,capture_spin,capture_all,capture_memory]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

WORKLOAD = (256, 512, 64)
CAPTURE_DIR = "/tmp/phase-captures"


def _thread_deltas(before: dict, after: dict) -> list[tuple[float, str, int]]:
    """(CPU seconds, name, tid) of every thread that ran between two `thread_cpu()`
    snapshots, busiest first."""
    deltas = [(cpu - before.get(tid, (name, 0.0))[1], name, tid)
              for tid, (name, cpu) in after.items()]
    return sorted((d for d in deltas if d[0] > 0), reverse=True)


def _thread_groups(before: dict, after: dict) -> dict[str, float]:
    """CPU seconds per thread-name group between two `thread_cpu()` snapshots."""
    groups: dict[str, float] = {}
    for delta, name, _ in _thread_deltas(before, after):
        group = re.sub(r"[-_/]?\d+$", "", name.split("/")[0])
        groups[group] = round(groups.get(group, 0.0) + delta, 4)
    return dict(sorted(groups.items(), key=lambda kv: -kv[1]))


def _delta(before: dict, after: dict) -> dict:
    out = {}
    for k, v in after.items():
        if isinstance(v, dict):
            out[k] = _delta(before.get(k) or {}, v)
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = round(v - (before.get(k) or 0), 6)
    return out


def one(config: str, model: str, out: Path, batches: int, shape: str,
        workload: tuple[int, int, int], device: str) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if config == "capture_omp1":  # before torch loads: no intra-op OpenMP team at all
        os.environ["OMP_NUM_THREADS"] = "1"
    import random
    import shutil
    import threading

    import perf_models
    from stack_sampler import thread_cpu
    from vllm import LLM, SamplingParams

    kw = dict(perf_models.engine_kwargs(shape), seed=0, max_model_len=1024,
              gpu_memory_utilization=0.6 if device == "cuda" else 0.3,
              max_num_batched_tokens=2048 if device == "cuda" else 512)
    engine = None
    if config == "vanilla":
        llm = LLM(model=model, **kw)
    else:
        from capsteer.engine import Engine, Request

        writer = "threads" if config == "capture_threads" else "process"
        if config == "capture_spin":
            from capsteer.engine_ext.harvest import Harvester

            Harvester.blocking_wait = False  # in-process engine: the worker's harvester
        if config == "capture_torchcopy":  # rows into the writer's ring by torch's copy_
            from capsteer.capture.writer import process as writer_process

            writer_process.copy_rows = lambda dst, src: dst.copy_(src)
        # As perf_method.py: staging for a whole step at every layer (capture_all needs it).
        # (capture_small_staging: the default staging buffer.)
        staging = kw["max_num_batched_tokens"] * (perf_models.SHAPES[shape].layers + 1)
        settings = {"capture_dir": CAPTURE_DIR, "capture_writer": writer}
        if config == "capture_all_one":  # one writer process (the A/B of the default pool)
            settings["capture_writer_processes"] = 1
        elif re.fullmatch(r"capture_all_w\d+", config):  # capture_all_w4: four processes
            settings["capture_writer_processes"] = int(config[len("capture_all_w"):])
        if config != "capture_small_staging":
            settings["staging_rows"] = staging
        engine = Engine(model, capsteer_config=settings, **kw)
        llm = engine.llm
    n, prompt_len, gen = workload
    vocab = perf_models.SHAPES[shape].vocab - 1
    rng = random.Random(1)
    capture = None
    if config.startswith("capture"):
        capture = {"hooks": ["resid_post"],
                   "layers": "all" if config.startswith("capture_all")
                   else [engine.num_layers // 2],
                   "positions": "prompt", "layout": "packed"}
    steering = {"vectors": [{"hook": "resid_post", "layers": "all",
                             "vector": [0.01] * engine.hidden_size, "scale": 1.0}]} \
        if config == "steer" else None

    def batch() -> None:
        prompts = [[rng.randrange(100, vocab) for _ in range(prompt_len)] for _ in range(n)]
        if engine is None:
            llm.generate([{"prompt_token_ids": p} for p in prompts],
                         SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True),
                         use_tqdm=False)
            return
        results = engine.generate([
            Request(prompt_token_ids=p, capture=capture, steering=steering,
                    durable=capture is not None and config != "capture_memory",
                    sampling={"max_tokens": gen, "temperature": 0.0, "ignore_eos": True})
            for p in prompts], timeout=900)
        bad = [r.receipt for r in results if r.receipt is not None and r.receipt.status != "ok"]
        if bad:
            raise RuntimeError(f"{len(bad)} captures failed: {bad[0]}")

    def stats() -> dict:
        return engine.stats()[0] if engine is not None else {}

    def clear() -> None:
        if config.startswith("capture_all"):  # several GB a batch: keep the disk from filling
            shutil.rmtree(CAPTURE_DIR, ignore_errors=True)

    batch()  # warm-up
    clear()
    writer_pids: list[int] = []  # the writer processes (a pool's children)
    if engine is not None:
        first = next(iter(engine.writer_stats()), None) or {}
        writer_pids = [s.get("process") for s in first.get("processes") or [first]
                       if s and s.get("process")]

    def writer_cpu() -> dict:
        return {tid: v for pid in writer_pids for tid, v in thread_cpu(pid).items()}
    rows = []
    main = threading.main_thread().native_id
    for _ in range(batches):
        s0, t0, w0 = stats(), thread_cpu(), writer_cpu()
        cpu0, wall0 = time.thread_time(), time.perf_counter()
        batch()
        wall, cpu = time.perf_counter() - wall0, time.thread_time() - cpu0
        s1, t1, w1 = stats(), thread_cpu(), writer_cpu()
        t0.pop(main, None)
        t1.pop(main, None)
        rows.append({"wall_s": round(wall, 4), "main_cpu_s": round(cpu, 4),
                     "busiest_threads": [[round(c, 3), n, tid]
                                         for c, n, tid in _thread_deltas(t0, t1)[:24]],
                     "main_off_cpu_s": round(wall - cpu, 4),
                     "other_threads_cpu_s": _thread_groups(t0, t1),
                     "writer_threads_cpu_s": _thread_groups(w0, w1),
                     "writer_busiest_threads": [round(c, 3)
                                                for c, _, _ in _thread_deltas(w0, w1)[:12]],
                     "hooks": _delta(s0, s1)})
        clear()
    result = {"config": config, "shape": shape, "workload": workload, "batches": rows}
    if engine is not None:  # which writer published (a failed writer process says why)
        result["writer"] = list(engine.writer_stats())
        print("WRITER", json.dumps(result["writer"]), flush=True)
    (out / f"phases-{config}.json").write_text(json.dumps(result, indent=1))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--one")
    ap.add_argument("--configs", default="vanilla,plain,capture,capture_memory")
    ap.add_argument("--model", default="/tmp/phase-model")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: a smoke run of the script on a tiny shape")
    ap.add_argument("--workload", default=None, help="N,PROMPT,GEN (default 256,512,64)")
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--out", default=os.environ.get("OUT") or "/tmp/phase-out")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    shape = "qwen3-0.6b" if a.device == "cuda" else "qwen3-tiny"
    workload = tuple(int(v) for v in a.workload.split(",")) if a.workload else WORKLOAD
    if a.one:
        result = one(a.one, a.model, out, a.batches, shape, workload, a.device)
        print("RESULT " + json.dumps(result), flush=True)
        return
    import perf_models

    perf_models.write_model(a.model, shape, a.device)
    for config in a.configs.split(","):
        proc = subprocess.run([sys.executable, __file__, "--one", config, "--model", a.model,
                               "--out", str(out), "--batches", str(a.batches),
                               "--device", a.device, "--workload", ",".join(map(str, workload))],
                              capture_output=True, text=True)
        (out / f"{config}.log").write_text(proc.stdout[-20000:] + proc.stderr[-20000:])
        res = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if not res:
            print(config, "failed", proc.returncode, proc.stderr[-3000:], flush=True)
            continue
        for row in json.loads(res[0][7:])["batches"]:
            hooks = row["hooks"]
            print(f"{config:15s} wall {row['wall_s']:.3f} main cpu {row['main_cpu_s']:.3f} "
                  f"off-cpu {row['main_off_cpu_s']:.3f} hooks {hooks.get('host_s')} "
                  f"harvest {hooks.get('harvest')} others {row['other_threads_cpu_s']} "
                  f"writer process {row.get('writer_threads_cpu_s')} "
                  f"busiest {[c for c, _, _ in row['busiest_threads'][:16]]} "
                  f"writer busiest {row['writer_busiest_threads']}",
                  flush=True)


if __name__ == "__main__":
    main()
