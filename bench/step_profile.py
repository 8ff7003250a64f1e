"""Host work per engine step from a vLLM worker's torch-profiler trace (issue 12).

vLLM names each step it profiles after its batch: `execute_context_C(T)_generation_G(N)`
(C requests feeding T prompt tokens, G requests decoding N tokens), a user annotation
around the model runner's execute_model on the step thread: input preparation and the
forward's launches (capsteer's pre-forward hook included; its before_step and after_step,
and the sampling step, are outside it). This groups the host events inside those
annotations (torch ops and CUDA runtime calls) by step kind, so two servers' steps of the
same kind compare op by op: which calls one of them makes that the other does not, and
how long the runner takes. bench/mixed_latency.py `--profile-s` records the traces
(vLLM's /start_profile and /stop_profile, the same in vanilla and capsteer).

    python bench/step_profile.py VANILLA_TRACE.json.gz CAPSTEER_TRACE.json.gz
"""

from __future__ import annotations

import bisect
import gzip
import json
import statistics
import sys
from collections import Counter
from pathlib import Path
from typing import Any

HOST_CATEGORIES = ("cpu_op", "cuda_runtime", "cuda_driver")
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
STEP_PREFIX = "execute_"
TOP_OPS = 40  # per step kind, by host time
SLOWER_US = 100.0  # an op whose host time a step differs by this much is named


def load_events(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as fh:
        trace = json.load(fh)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def summarize(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Per step kind: how many steps, their median and range of wall time on the host, and
    per step the host events inside them by name (calls, microseconds; nested ops count in
    their parents' time too, the same way in every trace). Two medians say where a slow
    step's time goes: `gap_us`, the step's host time outside every host event (Python: the
    runner's and capsteer's own code, invisible to the profiler without stacks), and
    `device_us`, the GPU time of the kernels and copies its calls launched (matched by
    correlation id, CUDA graphs' kernels included)."""
    by_thread: dict[tuple[Any, Any], list[dict[str, Any]]] = {}
    device_us: Counter = Counter()
    steps = []
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        cat = e.get("cat")
        if cat == "user_annotation" and str(e.get("name", "")).startswith(STEP_PREFIX):
            steps.append(e)
        elif cat in HOST_CATEGORIES:
            by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
        elif cat in DEVICE_CATEGORIES and "correlation" in e.get("args", {}):
            device_us[e["args"]["correlation"]] += e["dur"]
    starts = {}
    for key, evs in by_thread.items():
        evs.sort(key=lambda e: e["ts"])
        starts[key] = [e["ts"] for e in evs]
    kinds: dict[str, dict[str, Any]] = {}
    for step in steps:
        key = (step.get("pid"), step.get("tid"))
        evs, ts = by_thread.get(key, []), starts.get(key, [])
        t0, t1 = step["ts"], step["ts"] + step["dur"]
        kind = kinds.setdefault(step["name"], {"durs": [], "gaps": [], "device": [],
                                               "calls": Counter(), "us": Counter()})
        kind["durs"].append(step["dur"])
        covered_to, covered, gpu = t0, 0.0, 0.0
        for e in evs[bisect.bisect_left(ts, t0):bisect.bisect_right(ts, t1)]:
            end = e["ts"] + e["dur"]
            if end > t1:
                continue
            kind["calls"][e["name"]] += 1
            kind["us"][e["name"]] += e["dur"]
            if end > covered_to:  # the union of the events' intervals, in ts order
                covered += end - max(e["ts"], covered_to)
                covered_to = end
            correlation = e.get("args", {}).get("correlation")
            if correlation is not None:
                gpu += device_us.get(correlation, 0.0)
        kind["gaps"].append(step["dur"] - covered)
        kind["device"].append(gpu)
    out = {}
    for name, k in sorted(kinds.items(), key=lambda kv: -len(kv[1]["durs"])):
        n = len(k["durs"])
        top = sorted(k["us"], key=lambda op: -k["us"][op])[:TOP_OPS]
        out[name] = {
            "n": n, "median_us": statistics.median(k["durs"]),
            "min_us": min(k["durs"]), "max_us": max(k["durs"]),
            "gap_us": statistics.median(k["gaps"]), "device_us": statistics.median(k["device"]),
            "host_events_a_step": sum(k["calls"].values()) / n,
            "calls_a_step": {op: k["calls"][op] / n for op in sorted(k["calls"])},
            "top_us_a_step": {op: round(k["us"][op] / n, 1) for op in top},
        }
    return out


def compare_lines(base: dict[str, Any], other: dict[str, Any], names: tuple[str, str],
                  min_steps: int = 3) -> list[str]:
    """Step kinds both traces have (at least min_steps each): median host wall time side by
    side, host events a step, the time outside them and the GPU time launched, every call
    whose count a step differs, and every op whose host time a step differs by SLOWER_US."""
    lines = []
    shared = [k for k in base if k in other and min(base[k]["n"], other[k]["n"]) >= min_steps]
    for kind in shared:
        a, b = base[kind], other[kind]
        lines.append(f"  {kind}: n {a['n']}/{b['n']}, median host ms {a['median_us'] / 1e3:.2f}"
                     f"/{b['median_us'] / 1e3:.2f} ({names[0]}/{names[1]}), host events a step "
                     f"{a['host_events_a_step']:.0f}/{b['host_events_a_step']:.0f}")
        lines.append(f"      outside host events (Python) ms {a['gap_us'] / 1e3:.2f}/"
                     f"{b['gap_us'] / 1e3:.2f}, GPU time launched ms "
                     f"{a['device_us'] / 1e3:.2f}/{b['device_us'] / 1e3:.2f}")
        ops = sorted(set(a["calls_a_step"]) | set(b["calls_a_step"]))
        for op in ops:
            ca, cb = a["calls_a_step"].get(op, 0.0), b["calls_a_step"].get(op, 0.0)
            if abs(ca - cb) >= 0.5:
                lines.append(f"      {op}: {ca:.1f}/{cb:.1f} calls a step")
        ta, tb = a["top_us_a_step"], b["top_us_a_step"]
        for op in sorted(set(ta) | set(tb), key=lambda o: -abs(ta.get(o, 0) - tb.get(o, 0))):
            if abs(ta.get(op, 0.0) - tb.get(op, 0.0)) < SLOWER_US:
                break
            lines.append(f"      {op}: {ta.get(op, 0.0) / 1e3:.2f}/{tb.get(op, 0.0) / 1e3:.2f}"
                         " ms a step")
    if not shared:
        lines.append(f"  no step kind with {min_steps}+ steps in both traces")
    return lines


def trace_in(directory: Path) -> Path | None:
    """The worker's trace vLLM wrote under `directory` (the newest)."""
    found = sorted(directory.glob("*.pt.trace.json*"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def main() -> None:
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    paths = [Path(p) for p in sys.argv[1:]]
    summaries = [summarize(load_events(p)) for p in paths]
    print("\n".join(compare_lines(summaries[0], summaries[1], (paths[0].name, paths[1].name))))


if __name__ == "__main__":
    main()
