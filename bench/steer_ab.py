"""Where steering's cost comes from, measured inside one capsteer engine process.

Batches of different request kinds alternate in one engine (plain, steered at every
layer, steered at one layer, plain, ...), so the host's drift between processes (tens of
percent on the lent machines) cancels: what differs between the kinds is the steering
path alone. If steering all layers costs more than one layer, the per-site work (tap
launches, kernel time) matters; if both cost the same, the per-request or per-step work
does. `capture_memory` (rows returned in-process) against `capture_durable` (the writer
pool publishing to disk in the engine process) separates the capture path's own cost
from the writer's. `capture_durable_first` (one row a request) and `capture_durable_ends` (end reports for
every capture, the front end's loop before 2026-11-26) are front-end variants (FRONT_END).
Run once per environment variant (e.g. CAPSTEER_TAP_KERNEL=torch) to compare.
Diagnostic kinds (`steer_one_noplan`, ..., see DIAGNOSTICS) switch one part of the
worker's hook path off for their batches; the result records each kind's plan builds
and hook seconds so the switch is seen to work.

    python bench/steer_ab.py --out DIR [--rounds 4] [--workloads prefill,decode]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import perf_models

# name: (requests, prompt tokens, generated tokens): perf_method's GPU workloads
WORKLOADS = {"prefill": (256, 512, 64), "decode": (256, 128, 512)}
# A diagnostic kind is `<kind>_<part>`: <kind>'s requests with that part of the worker's
# hook path switched off in the worker, between batches.
DIAGNOSTICS = {
    "noregister": "the worker ignores new requests' payloads (front end, payload and "
                  "cache salt remain: everything outside the worker's hooks)",
    "noplan": "requests are registered (slots, entries) but no step builds or uploads a plan",
    "noop": "the tap op returns before the runtime (plans are still built and uploaded)",
    "nolaunch": "the tap runs its Python but launches no kernel",
    "nocopy": "captured rows are not copied into the writer process's ring (its files get "
              "whatever the ring held): the sink thread's bulk copy off",
    "copyring": "captured rows take the harvester's pinned ring and a host copy into the "
                "writer's ring instead of the GPU's copy straight into its device ring",
    "switch": "the engine process's GIL switch interval is 0.5 ms instead of 5 ms: a thread "
              "that wants the GIL waits less for the one holding it",
}


# Front-end variants of a capture kind, in the driver process (names end with them):
FRONT_END = {
    "first": "each request captures its first position only (one row, not the prompt): "
             "the per-request capture machinery without the rows' volume",
    "ends": "the front end reports every durable capture's output length to the workers "
            "(a blocking RPC in each step a request finishes), as before 2026-11-26 "
            "asked only of captures that keep generated positions",
}


def _diagnostic(kind: str) -> tuple[str, str] | None:
    """(base kind, part switched off) of a diagnostic kind, else None."""
    base, _, part = kind.rpartition("_")
    return (base, part) if base and part in DIAGNOSTICS else None


# The durable writer link's cumulative counters (the engine side of the writer processes).
WRITER_COUNTERS = ("ring_waits", "ring_wait_s", "copy_s", "send_s", "sends", "inline_writes",
                   "device_writes", "device_full")


def worker_counters(engine) -> dict[str, float]:
    """The first worker's cumulative hook counters: plan builds and reuses, host seconds
    by phase, the harvester's ring waits, delivery seconds and copies (captures), and
    the durable writer link's ring waits, copy and send seconds (captures)."""
    stats = engine.stats()[0]
    writer = next(iter(engine.writer_stats()), None) or {}
    return {"plan_builds": stats["plan_builds"], "plan_reuses": stats["plan_reuses"],
            "plan_uniform": stats.get("plan_uniform", 0),
            "ring_copies": stats.get("ring_copies", 0),
            **{f"host_s_{k}": v for k, v in stats["host_s"].items()},
            **{f"host_cpu_s_{k}": v for k, v in stats.get("host_cpu_s", {}).items()},
            **{f"harvest_{k}": float(v) for k, v in (stats.get("harvest") or {}).items()},
            **{f"writer_{k}": float(writer[k]) for k in WRITER_COUNTERS if k in writer}}


def _worker_diagnostic(worker, part: str) -> str:
    """Runs in the worker (collective_rpc): switch one part of the hook path off, or every
    part back on ("off")."""
    from capsteer.capture.writer import process as writer_process
    from capsteer.engine_ext import adapter, tap_kernel
    from capsteer.engine_ext import runtime as rt
    from capsteer.engine_ext.runtime import StepPlan

    hooks = worker.capsteer
    saved = hooks.__dict__.setdefault("_diagnostic_saved", {
        "tap": tap_kernel.tap, "copy_rows": writer_process.copy_rows,
        "switch": sys.getswitchinterval(), "device_rows": hooks.device_rows})
    writer_process.copy_rows = saved["copy_rows"]
    hooks.device_rows = saved["device_rows"]
    sys.setswitchinterval(saved["switch"])
    hooks.__dict__.pop("before_step", None)
    hooks.pinned_plan = False
    rt.install_runtime(hooks.runtime)
    tap_kernel.tap = saved["tap"]
    if part == "noregister":
        def finish_only(scheduler_output) -> None:
            for req_id in adapter.finished_requests(scheduler_output):
                hooks._finish(req_id)
        hooks.before_step = finish_only
    elif part == "noplan":
        if hooks.device_driven:
            hooks.runtime.reset_dense()
        hooks.runtime.set_plan(StepPlan(active_sites=frozenset()), 0)
        hooks.reuse, hooks.dense_live = None, False
        hooks.pinned_plan = True
    elif part == "noop":
        rt.install_runtime(None)
    elif part == "nolaunch":
        tap_kernel.tap = lambda *args, **kwargs: None
    elif part == "nocopy":
        writer_process.copy_rows = lambda dst, src: None
    elif part == "switch":
        sys.setswitchinterval(0.0005)
    elif part == "copyring":
        hooks.device_rows = False
    elif part != "off":
        raise ValueError(part)
    return part


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--work", default="/tmp/capsteer-ab")
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--workloads", default="prefill,decode")
    ap.add_argument("--kinds", default="plain,steer_all,steer_one")
    ap.add_argument("--tag", default="default")
    ap.add_argument("--requests", type=int, default=None, help="override (CPU smoke: 4)")
    ap.add_argument("--step-tokens", type=int, default=2048, help="max_num_batched_tokens")
    a = ap.parse_args()
    # torch.cuda.is_available() below poisons fork for CUDA, and with a model already on
    # disk nothing else initializes CUDA here, so vLLM would fork its engine core into a
    # process that cannot use the GPU.
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    if any(_diagnostic(k) for k in a.kinds.split(",")):  # the worker-side switch below travels to vLLM's engine core by cloudpickle
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    from capsteer.engine import Engine, Request

    shape = perf_models.SHAPES[a.shape]
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = perf_models.write_model(Path(a.work) / a.shape, a.shape, device)
    t = time.perf_counter()
    capture_dir = Path(a.work) / "captures"
    engine = Engine(str(model), capsteer_config={"capture_dir": str(capture_dir)},
                    **perf_models.engine_kwargs(a.shape), seed=0,
                    max_model_len=1024,
                    gpu_memory_utilization=0.8 if device == "cuda" else 0.3,
                    max_num_batched_tokens=a.step_tokens)
    startup = time.perf_counter() - t
    vec = [0.01] * shape.hidden
    spec = {
        "plain": None,
        "steer_all": {"vectors": [{"hook": "resid_post", "layers": "all", "vector": vec,
                                   "scale": 1.0}]},
        "steer_one": {"vectors": [{"hook": "resid_post", "layers": [shape.layers // 2],
                                   "vector": vec, "scale": 1.0}]},
    }
    # Diagnostic kinds (wrong outputs on purpose, never a product path): a kind's requests
    # with one part of the worker's hook path switched off (see DIAGNOSTICS), to find
    # which part a hooked request's cost comes from.
    for kind in a.kinds.split(","):
        if diag := _diagnostic(kind):
            spec[kind] = spec[diag[0]]

    def patched(kind: str):
        if not (diag := _diagnostic(kind)):
            return lambda: None
        engine.llm.collective_rpc(_worker_diagnostic, args=(diag[1],))
        return lambda: engine.llm.collective_rpc(_worker_diagnostic, args=("off",))
    capture_one = {"hooks": ["resid_post"], "layers": [shape.layers // 2], "positions": "prompt",
                   "layout": "packed"}
    # Front-end variants of a capture kind (`<kind>_first`, `<kind>_ends`, see FRONT_END).
    capture_first = {**capture_one, "positions": [0]}
    import capsteer.engine as engine_mod

    reports_end = engine_mod.needs_end_report

    def front_end(kind: str):
        """Set `kind`'s front-end variant up; returns its undo."""
        if kind.endswith("_ends"):
            engine_mod.needs_end_report = lambda capture, prompt_len: True
        return lambda: setattr(engine_mod, "needs_end_report", reports_end)
    kinds = a.kinds.split(",")
    rng = random.Random(0)
    out: dict = {"tag": a.tag, "step_tokens": a.step_tokens, "env": {k: v for k, v in os.environ.items()
                                       if k.startswith(("CAPSTEER", "VLLM"))},
                 "startup_s": startup, "workloads": {}}
    # per workload/kind: the worker's plan builds and reuses and its hooks' host seconds,
    # summed over that kind's batches (shows what a diagnostic switched off)
    worker_counts: dict[str, dict[str, float]] = {}
    out["worker_counts"] = worker_counts
    for wl in a.workloads.split(","):
        n, prompt, gen = WORKLOADS[wl]
        n = a.requests or n
        sampling = {"max_tokens": gen, "temperature": 0.0, "ignore_eos": True}

        def batch(kind: str, n: int = n, prompt: int = prompt,
                  sampling: dict = sampling, wl: str = wl) -> float:
            prompts = [[rng.randrange(10, shape.vocab - 10) for _ in range(prompt)]
                       for _ in range(n)]
            capture = None
            if kind.startswith("capture"):
                capture = capture_first if "_first" in kind else capture_one
            reqs = [Request(prompt_token_ids=p, sampling=sampling, steering=spec.get(kind),
                            capture=capture, durable=kind.startswith("capture_durable"))
                    for p in prompts]
            restore = patched(kind)
            undo = front_end(kind)
            before = worker_counters(engine)
            t0 = time.perf_counter()
            try:
                results = engine.generate(reqs, timeout=600)
            finally:
                took = time.perf_counter() - t0
                restore()
                undo()
            after = worker_counters(engine)
            seen = worker_counts.setdefault(f"{wl}/{kind}", {})
            for name, value in after.items():
                seen[name] = round(seen.get(name, 0) + value - before.get(name, 0.0), 6)
            bad = [r.receipt for r in results if r.receipt is not None and r.receipt.status != "ok"]
            if bad:
                raise RuntimeError(f"{len(bad)} captures failed, e.g. {bad[0]}")
            shutil.rmtree(capture_dir, ignore_errors=True)
            return took

        for kind in kinds:  # warm-up
            batch(kind)
        times: dict[str, list[float]] = {k: [] for k in kinds}
        for r in range(a.rounds):
            order = kinds if r % 2 == 0 else kinds[::-1]
            for kind in order:
                times[kind].append(batch(kind))
        base = statistics.median(times[kinds[0]])
        res = {k: {"batch_s": v, "median_s": statistics.median(v),
                   "ratio_vs_" + kinds[0]: base / statistics.median(v)} for k, v in times.items()}
        out["workloads"][wl] = res
        print(f"[{a.tag}] {wl}: " + "  ".join(
            f"{k} {statistics.median(v):.3f} s ({base / statistics.median(v):.3f})"
            for k, v in times.items()), flush=True)
    try:
        out["stats"] = engine.stats() if hasattr(engine, "stats") else None
    except Exception as exc:  # diagnostics only
        out["stats"] = repr(exc)
    engine.close()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / f"steer-ab-{a.tag}.json").write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
