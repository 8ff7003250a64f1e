"""Which host counter tracks the batch-to-batch spread of perf_method.py's timed batches.

Reads perf-proc-*.json files (perf_method.py records bench/host_counters.py's figures per
timed batch) and prints, per process and workload, each batch's wall time beside the
step thread's (the busiest thread's) run and run-queue wait, the host's CPU steal and CPU
pressure; then, over all batches of a workload, the correlation of each counter with the
batch time. A counter that explains the spread correlates and moves by as many seconds
as the batch time does.

With the engine probe (`--engine-probe`), each config's cost is also estimated at equal
host speed: one least-squares fit over a workload's batches, batch_s = a + b * eloop +
one offset per config (vanilla the baseline), where eloop is the probe's fixed loop timed
on the step thread during that batch. The offset is the config's extra seconds a batch
with the host's speed held equal, given with its standard error (session 59: the lent
hosts' batch-to-batch speed swings, 0.8-1.9 ms of loop, outweigh a 1% effect). A
diagnostic beside perf_method.py's verdicts, not one.

    python bench/host_noise.py DIR [DIR ...] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

# counter -> its unit
COUNTERS = {"top_run_s": "s", "top_wait_s": "s", "steal_s": "s", "pressure_s": "s",
            "tree_wait_s": "s", "probe_loop_ms": "ms", "probe_copy_ms": "ms",
            "gpu_util_pct": "%", "sm_clock_mhz": "MHz", "power_w": "W",
            # bench/engine_probe (--engine-probe): the EngineCore's steps and where they went
            "engine_steps": "steps", "engine_tokens": "tokens", "engine_step_s": "s",
            "engine_schedule_s": "s", "engine_update_s": "s", "engine_forward_s": "s",
            "engine_sample_s": "s", "engine_gc0_s": "s",
            "engine_gc1_s": "s", "engine_gc2_s": "s", "front_gc0_s": "s", "front_gc1_s": "s",
            "front_gc2_s": "s", "top_migrations": "moves",
            # the probe's fixed loop on the step thread (session 51): the host's own speed
            "engine_loop_ms": "ms"}


def rows(procs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for p in procs:
        for wl, w in p["workloads"].items():
            for rep in w["reps"]:
                for i, (t, h) in enumerate(zip(rep["batch_s"], rep.get("host") or [], strict=False)):
                    top = h.get("top_thread", {})
                    out.append({"slot": p["slot"], "config": p["config"], "workload": wl,
                                "batch": i, "batch_s": t, "top_name": top.get("name"),
                                **{c: h.get(c) for c in COUNTERS},  # the batch's own counters
                                "engine_loop_ms": _loop_ms(h),
                                "top_run_s": top.get("run_s"), "top_wait_s": top.get("wait_s"),
                                "top_cpu": top.get("last_cpu"),
                                "top_migrations": (float(top["migrations"])
                                                   if top.get("migrations") is not None else None),
                                "pinned": p.get("pinned_cpus") is not None,
                                "process_cv": None})
    for p in procs:  # each process's own batch-to-batch spread (stdev / mean, per workload)
        for wl in p["workloads"]:
            mine = [r for r in out if r["slot"] == p["slot"] and r["workload"] == wl]
            ts = [r["batch_s"] for r in mine]
            cv = statistics.pstdev(ts) / statistics.mean(ts) if len(ts) > 1 else None
            for r in mine:
                r["process_cv"] = cv
    return out


def _loop_ms(h: dict[str, Any]) -> float | None:
    """The engine probe's fixed loop, mean ms over the batch's samples (None without any)."""
    n, s = h.get("engine_speed_n"), h.get("engine_speed_s")
    return s / n * 1e3 if n and s is not None else None


def _gc_s(r: dict[str, Any]) -> float | None:
    """Garbage-collection seconds of the engine processes, all generations."""
    parts = [r.get(f"engine_gc{g}_s") for g in range(3)]
    return sum(parts) if all(isinstance(x, float) for x in parts) else None


def _corr(xs: list[float], ys: list[float]) -> float | None:
    if len(xs) < 3 or statistics.pstdev(xs) == 0 or statistics.pstdev(ys) == 0:
        return None
    return statistics.correlation(xs, ys)


def _slope(xs: list[float], ys: list[float]) -> float | None:
    """Seconds of counter per second of batch time (least squares)."""
    if len(xs) < 3 or statistics.pstdev(xs) == 0:
        return None
    return statistics.linear_regression(xs, ys).slope


def analyse(table: list[dict[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for wl in sorted({r["workload"] for r in table}):
        for pinned in sorted({r["pinned"] for r in table}):
            sel = [r for r in table if r["workload"] == wl and r["pinned"] == pinned]
            t = [r["batch_s"] for r in sel]
            cvs = sorted({r["process_cv"] for r in sel if r["process_cv"] is not None})
            by_cpu: dict[int, list[float]] = {}
            for r in sel:
                if r["top_cpu"] is not None:
                    by_cpu.setdefault(r["top_cpu"], []).append(r["batch_s"])
            entry: dict[str, Any] = {"batches": len(sel), "batch_s_median": statistics.median(t),
                                     "batch_s_min": min(t), "batch_s_max": max(t),
                                     "process_cv_median": statistics.median(cvs) if cvs else None,
                                     "by_last_cpu": {c: {"batches": len(v),
                                                         "median_s": statistics.median(v)}
                                                     for c, v in sorted(by_cpu.items())}}
            for c in COUNTERS:
                pairs = [(r["batch_s"], r[c]) for r in sel if r[c] is not None]
                if pairs:
                    xs, ys = zip(*pairs, strict=True)
                    entry[c] = {"median": statistics.median(ys), "corr": _corr(list(xs), list(ys)),
                                "slope": _slope(list(xs), list(ys))}
            result[f"{wl}{' pinned' if pinned else ''}"] = entry
    return result


def speed_adjusted(table: list[dict[str, Any]]) -> dict[str, Any]:
    """Per workload: each config's offset against vanilla in batch_s = a + b * eloop +
    offset(config), least squares over every batch that has the probe's loop."""
    import numpy as np

    result: dict[str, Any] = {}
    for wl in sorted({r["workload"] for r in table}):
        sel = [r for r in table if r["workload"] == wl and r["engine_loop_ms"] is not None]
        configs = sorted({r["config"] for r in sel} - {"vanilla"})
        if not configs or not any(r["config"] == "vanilla" for r in sel):
            continue
        x = np.array([[1.0, r["engine_loop_ms"]] + [float(r["config"] == c) for c in configs]
                      for r in sel])
        y = np.array([r["batch_s"] for r in sel])
        dof = len(y) - x.shape[1]
        if dof < 2 or np.linalg.matrix_rank(x) < x.shape[1]:
            continue
        beta = np.linalg.lstsq(x, y, rcond=None)[0]
        resid = y - x @ beta
        se = np.sqrt(np.diag(float(resid @ resid) / dof * np.linalg.inv(x.T @ x)))
        loop = float(np.median(x[:, 1]))
        base = float(beta[0] + beta[1] * loop)  # vanilla's batch at the median loop
        result[wl] = {"batches": len(y), "loop_ms_median": loop, "vanilla_batch_s": base,
                      "s_per_loop_ms": float(beta[1]), "configs": {
                          c: {"offset_s": float(beta[2 + i]), "se_s": float(se[2 + i]),
                              "ratio": base / (base + float(beta[2 + i]))}
                          for i, c in enumerate(configs)}}
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="+", type=Path)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    procs = [json.loads(f.read_text()) for d in a.dirs for f in sorted(d.glob("perf-proc-*.json"))]
    table = rows(procs)
    if not table:
        print("no batches with host counters found", file=sys.stderr)
        return 1
    print(f"{'slot':>4} {'config':9}{'workload':9}{'b':>3}{'batch_s':>9}{'top run':>9}"
          f"{'top wait':>9}{'steal':>8}{'pressure':>9}{'loop ms':>8}{'copy ms':>8}{'gpu %':>7}"
          f"{'sm MHz':>8}{'steps':>6}{'step s':>8}{'gc s':>7}{'eloop':>7}{'cpu':>4}{'moves':>6}"
          "  top thread   (loop ms: the side process's loop; eloop: the engine probe's, "
          "on the step thread)")
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else "-"  # noqa: E731
    fmt1 = lambda v: f"{v:.1f}" if isinstance(v, float) else "-"  # noqa: E731
    for r in table:
        print(f"{r['slot']:>4} {r['config']:9}{r['workload']:9}{r['batch']:>3}{r['batch_s']:>9.3f}"
              f"{fmt(r['top_run_s']):>9}{fmt(r['top_wait_s']):>9}{fmt(r['steal_s']):>8}"
              f"{fmt(r['pressure_s']):>9}{fmt(r['probe_loop_ms']):>8}{fmt(r['probe_copy_ms']):>8}"
              f"{fmt1(r['gpu_util_pct']):>7}{fmt1(r['sm_clock_mhz']):>8}"
              f"{r['engine_steps'] if r['engine_steps'] is not None else '-':>6}"
              f"{fmt(r['engine_step_s']):>8}{fmt(_gc_s(r)):>7}{fmt(r['engine_loop_ms']):>7}"
              f"{r['top_cpu'] if r['top_cpu'] is not None else '-':>4}"
              f"{int(r['top_migrations']) if r['top_migrations'] is not None else '-':>6}"
              f"  {r['top_name']}")
    result = analyse(table)
    for key, e in result.items():
        print(f"\n{key}: {e['batches']} batches, {e['batch_s_min']:.3f}-{e['batch_s_max']:.3f} s "
              f"(median {e['batch_s_median']:.3f}); a process's stdev/mean, median over "
              f"processes: {fmt(e['process_cv_median'])}")
        if e["by_last_cpu"]:
            print("  by the step thread's last CPU: " + ", ".join(
                f"cpu {c}: {v['batches']} x {v['median_s']:.3f} s"
                for c, v in e["by_last_cpu"].items()))
        for c in COUNTERS:
            if c in e:
                corr, slope = e[c]["corr"], e[c]["slope"]
                unit = COUNTERS[c]
                print(f"  {c:13} median {e[c]['median']:.3f} {unit}, corr with batch_s "
                      f"{'-' if corr is None else f'{corr:+.2f}'}, slope "
                      f"{'-' if slope is None else f'{slope:+.2f}'} {unit}/s")
    adjusted = speed_adjusted(table)
    for wl, e in adjusted.items():
        print(f"\n{wl}, at equal host speed (batch_s = a + b * eloop + offset(config), "
              f"{e['batches']} batches; b = {e['s_per_loop_ms']:.2f} s per ms of loop; vanilla "
              f"{e['vanilla_batch_s']:.3f} s at the median loop {e['loop_ms_median']:.2f} ms):")
        for c, v in e["configs"].items():
            print(f"  {c:9} {v['offset_s']:+.3f} s a batch (standard error {v['se_s']:.3f}), "
                  f"throughput ratio vs vanilla {v['ratio']:.3f}")
    if a.json:
        a.json.write_text(json.dumps({"batches": table, "analysis": result,
                                      "speed_adjusted": adjusted}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
