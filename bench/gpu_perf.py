"""Issue 12 on the lent GPU in as few device calls as possible: every part, a runtime
estimate first, a deadline so a call ends before the 10-minute limit, results under $OUT.

Parts (`--parts`, any of p1..p6 run together, e.g. `p1p2p3`, `p4p5p6`, `all`):
- p1 / p2 / p3: one interleave (bench/perf_method.py) of vanilla + plain (p1) + steer (p2)
  + capture (p3) over --rounds processes each; both workloads on the Qwen3-0.6B shape;
  the first capture process also measures p3_capture_all_vs_disk; vanilla and plain
  processes give plain_identity. `--slots 1-6` runs part of the interleave: run the rest
  in the next call with the same --parts and `--slots 7-12` (process files kept in --work
  on a warm machine, and returned under $OUT either way, combine).
- p5: bench/storage.py (packed writer vs the disk's fsync'd rate) in --work's filesystem.
- p6: bench/throughput.py --p6 --shape llama3-8b-36l (103 requests x 36 layers x 128
  prompt positions to durable, receipts awaited), median of 5 after a warm-up.
- p4: bench/extract_bench.py --shape llama3-8b, one layer (16): capsteer extract vs stock
  vLLM prefill (2 passes each) and vs HF output_hidden_states (best of batch 8/16/32/64).
Order: interleave, p5, p6, p4. A step whose estimate does not fit before the deadline
(--budget-s from the start) is skipped and the command to run it is printed.

Writes under --out ($OUT): each step's result files and logs, `summary-update.json`
(the keys measured, with date/device/command) and, on cuda, `summary.json` (the repo's
bench/results/summary.json merged with the update; copy it back, or run
`python bench/summary.py apply <dir>/summary-update.json` in the repo).

    bash bench/gpu_perf.sh --parts p1p2p3 --slots 1-5        # on the GPU machine
    python bench/gpu_perf.py --device cuda --parts all --dry-run  # the estimate only
    python bench/gpu_perf.py --device cpu --parts all              # CPU smoke (tiny sizes)
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import perf_method
import summary as summary_mod

HERE = Path(__file__).resolve().parent

# Seconds; guesses from the H100 runs of 2026-11-22 (warm start-up of a 0.6B engine ~20 s
# after imports, cold ~100 s; an 8B-shaped engine cold ~135 s). Refined by each run's log.
EST = {
    "cuda": {"import": 12, "start_8b": 55, "cold_8b": 75, "p5": 45, "p6_rep": 5.0,
             "p4_cs_rep": 15, "p4_vllm_rep": 20, "hf": 60},
    "cpu": {"import": 8, "start_8b": 45, "cold_8b": 20, "p5": 20, "p6_rep": 2.0,
            "p4_cs_rep": 1, "p4_vllm_rep": 1, "hf": 25},
}
# 2,560 prompts: the job's forward stops after layer 16, and its pass over 2,560 prompts
# took 12.1 s on an H100 (1,280 would take about 6); the method wants >= 10 s of
# GPU work per timed repetition.
P4 = {"cuda": ["--shape", "llama3-8b", "--capture-layers", "16", "--prompts", "2560",
               "--prompt-tokens", "64-512", "--hf-batch", "8,16,32,64", "--hf-min-seconds", "10",
               "--reps", "2"],
      "cpu": ["--shape", "llama-tiny", "--capture-layers", "3", "--prompts", "96",
              "--prompt-tokens", "16-128", "--hf-batch", "4,8", "--hf-min-seconds", "1",
              "--reps", "2"]}
P6_SHAPE = {"cuda": "llama3-8b-36l", "cpu": "llama-tiny"}
P6_REPS = 5
GRACE_S = 20.0  # a step running at the deadline is killed this much later
P5 = {"cuda": ["--total-mib", "1024", "--repeat", "2"],
      "cpu": ["--total-mib", "128", "--repeat", "1", "--layers", "8", "--hidden", "1024"]}


def parse_parts(text: str) -> list[str]:
    if text == "all":
        return [f"p{i}" for i in range(1, 7)]
    parts = sorted(set(re.findall(r"p[1-6]", text)))
    if not parts:
        raise SystemExit(f"--parts {text!r}: name parts p1..p6, e.g. p1p2p3 or p4,p5,p6")
    return parts


def interleave_configs(parts: list[str]) -> list[str]:
    extra = [c for p, c in (("p1", "plain"), ("p2", "steer"), ("p3", "capture")) if p in parts]
    return ["vanilla", *extra] if extra else []


def _cold(work: Path, mark: str) -> bool:
    root = os.environ.get("VLLM_CACHE_ROOT") or str(Path.home() / ".cache" / "vllm")
    cache = Path(root) / "torch_compile_cache"
    return not (work / "warm" / mark).exists() or not cache.exists()


def plan(a: argparse.Namespace) -> list[dict[str, Any]]:
    """The steps of this call with their estimates."""
    e = EST[a.device]
    work = Path(a.work)
    steps: list[dict[str, Any]] = []
    configs = interleave_configs(a.parts)
    if configs:
        total = a.rounds * len(configs)
        slots = perf_method.parse_slots(a.slots, total)
        kinds = [configs[(s - 1) % len(configs)] for s in slots]
        first_capture = next((s for s, k in zip(slots, kinds, strict=True) if k == "capture"), None)
        seen: set[str] = set()
        est = 5.0  # the model (0.6B: written on the GPU, seconds)
        for s, k in zip(slots, kinds, strict=True):
            kind = "vanilla" if k == "vanilla" else "capsteer"
            cold = _cold(work, kind) and kind not in seen
            seen.add(kind)
            est += perf_method.estimate_process_s(a.device, k, a.min_seconds, a.reps,
                                                  s == first_capture and a.p3all, cold,
                                                  first=s == slots[0])
        steps.append({"name": "interleave", "configs": configs, "slots": slots, "est": est,
                      "what": f"{len(slots)} processes ({','.join(kinds)})"})
    if "p5" in a.parts:
        steps.append({"name": "p5", "est": e["p5"], "what": "storage.py"})
    if "p6" in a.parts:
        shape = P6_SHAPE[a.device]
        cold = _cold(work, f"{shape}-capsteer")
        steps.append({"name": "p6", "est": 10 + e["import"] + e["start_8b"] + cold * e["cold_8b"]
                      + (P6_REPS + 1) * e["p6_rep"] + 5, "what": f"1 process, {shape}",
                      "cold": cold})
    if "p4" in a.parts:
        shape = P4[a.device][1]
        cc, cv = _cold(work, f"{shape}-capsteer"), _cold(work, f"{shape}-vanilla")
        est = (5 + e["hf"] + 2 * e["import"] + 2 * e["start_8b"] + (cc + cv) * e["cold_8b"]
               + 2 * (e["p4_cs_rep"] + e["p4_vllm_rep"]) + 10)
        steps.append({"name": "p4", "est": est, "what": f"3 processes (hf, capsteer, vllm), {shape}"})
    return steps


def run_step(cmd: list[str], log: Path, deadline: float, env: dict[str, str] | None = None) -> int:
    """Run `cmd`, streaming its output to stdout and `log`; killed GRACE_S after the deadline
    (a watchdog: a silent child is stopped too), so the device call ends with results."""
    print("$ " + " ".join(cmd), flush=True)
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, **(env or {})}, start_new_session=True)
        killed = threading.Event()

        def kill() -> None:
            if proc.poll() is None:
                killed.set()
                os.killpg(proc.pid, signal.SIGKILL)  # our own child's process group

        watchdog = threading.Timer(max(1.0, deadline + GRACE_S - time.time()), kill)
        watchdog.start()
        assert proc.stdout is not None
        for line in proc.stdout:
            fh.write(line)
            if not re.search(r"\b(INFO|DEBUG|WARNING)\b|it/s\]|^\s*$", line):
                print("  " + line.rstrip(), flush=True)
        rc = proc.wait()
        watchdog.cancel()
        if killed.is_set():
            print(f"  killed at the deadline: {cmd[1]}", flush=True)
        return rc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--parts", default="all", help="e.g. p1p2p3, p4p5p6, all")
    ap.add_argument("--slots", default=None, help="part of the interleave, e.g. 1-5")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--paired", action="store_true",
                    help="interleave: a round's processes take turns batch by batch "
                         "(perf_method.py --paired)")
    ap.add_argument("--reps", type=int, default=1, help="timed repetitions per workload/process")
    ap.add_argument("--min-seconds", type=float, default=None,
                    help="per timed repetition (default 10 on cuda, 1 on cpu)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="stop starting steps after this (default 560 on cuda: calls end at 600)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and estimate only")
    ap.add_argument("--no-p3all", dest="p3all", action="store_false",
                    help="skip P3-all in the first capture process")
    ap.add_argument("--work", default=os.environ.get("CAPSTEER_WORK") or "/tmp/capsteer-perf")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(HERE / "results" / "gpu-perf"))
    a = ap.parse_args(argv)
    t0 = time.time()
    a.parts = parse_parts(a.parts)
    if a.min_seconds is None:
        a.min_seconds = 10.0 if a.device == "cuda" else 1.0
    budget = a.budget_s if a.budget_s is not None else (560.0 if a.device == "cuda" else 3600.0)
    deadline = t0 + budget
    steps = plan(a)
    print(f"gpu_perf: device {perf_method.device_name(a.device)}, parts {''.join(a.parts)}, "
          f"budget {budget:.0f} s")
    for s in steps:
        print(f"  {s['name']:11}{s['est'] / 60:6.1f} min  {s['what']}")
    total = sum(s["est"] for s in steps)
    print(f"  {'total':11}{total / 60:6.1f} min (estimate; cold compiles counted where this "
          f"machine has not run the engine yet)", flush=True)
    if a.dry_run:
        return 0
    out, work = Path(a.out), Path(a.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    (work / "warm").mkdir(exist_ok=True)
    py = sys.executable
    results: list[Path] = []
    record: dict[str, Any] = {"argv": sys.argv[1:], "steps": []}
    for step in steps:
        left = deadline - time.time()
        if step["name"] != "interleave" and step["est"] > left:
            print(f"skip {step['name']}: ~{step['est']:.0f} s estimated, {left:.0f} s left; run it "
                  f"in the next call: bash bench/gpu_perf.sh --parts {step['name']}", flush=True)
            record["steps"].append({"name": step["name"], "skipped": True})
            continue
        started = time.time()
        sub = out / step["name"]
        sub.mkdir(exist_ok=True)
        if step["name"] == "interleave":
            cmd = [py, str(HERE / "perf_method.py"), "--device", a.device, "--configs",
                   ",".join(step["configs"]), "--rounds", str(a.rounds), "--reps", str(a.reps),
                   "--min-seconds", str(a.min_seconds), "--work", str(work), "--out", str(sub),
                   "--deadline", str(deadline)]
            if a.slots:
                cmd += ["--slots", a.slots]
            if a.paired:
                cmd.append("--paired")
            if "capture" not in step["configs"] or not a.p3all:
                cmd.append("--no-p3all")
            rc = run_step(cmd, sub / "driver.log", deadline)
            results += sorted(sub.glob("*-perf-method.json"))
        elif step["name"] == "p5":
            cmd = [py, str(HERE / "storage.py"), "--json", "--dir", str(work), *P5[a.device]]
            rc = run_step(cmd, sub / "storage.log", deadline)
            lines = [ln for ln in (sub / "storage.log").read_text().splitlines()
                     if ln.startswith("{")]
            if rc == 0 and lines:
                path = sub / f"storage-{dt.date.today().isoformat()}.json"
                path.write_text(json.dumps({
                    "kind": "storage", "date": dt.date.today().isoformat(),
                    "device": perf_method.device_name(a.device),
                    "command": "python bench/storage.py " + " ".join(cmd[2:]),
                    "result": json.loads(lines[-1])}, indent=1))
                results.append(path)
        elif step["name"] == "p6":
            shape = P6_SHAPE[a.device]
            cmd = [py, str(HERE / "throughput.py"), "--device", a.device, "--p6", "--shape", shape,
                   "--out", str(sub)]
            rc = run_step(cmd, sub / "p6.log", deadline, {"CAPSTEER_BENCH_REPS": str(P6_REPS),
                                                          "TMPDIR": str(work)})
            results += sorted(sub.glob("*-p6-*.json"))
            if rc == 0:
                (work / "warm" / f"{shape}-capsteer").touch()
        else:  # p4
            cmd = [py, str(HERE / "extract_bench.py"), "--device", a.device, *P4[a.device],
                   "--work", str(work), "--out", str(sub)]
            rc = run_step(cmd, sub / "p4.log", deadline)
            results += sorted(sub.glob("*-extract-*.json"))
            if rc == 0:
                shape = P4[a.device][1]
                for kind in ("capsteer", "vanilla"):
                    (work / "warm" / f"{shape}-{kind}").touch()
        took = time.time() - started
        record["steps"].append({"name": step["name"], "rc": rc, "seconds": took,
                                "estimate_s": step["est"]})
        print(f"== {step['name']}: rc {rc}, {took:.0f} s (estimated {step['est']:.0f} s)",
              flush=True)
    update: summary_mod.Update = {}
    for path in results:
        for key, v in summary_mod.updates_from(path).items():
            v["command"] = (f"bash bench/gpu_perf.sh {' '.join(sys.argv[1:])}  "
                            f"# ran: {v.get('command')}")
            update[key] = v
    record["seconds"] = time.time() - t0
    (out / "gpu_perf-record.json").write_text(json.dumps(record, indent=1))
    if update:
        name = "summary-update.json" if a.device == "cuda" else "summary-update-cpu.json"
        (out / name).write_text(json.dumps(update, indent=1))
        if a.device == "cuda":  # CPU figures never go into the summary
            merged = summary_mod.merge(summary_mod.load(summary_mod.DEFAULT), update)
            (out / "summary.json").write_text(json.dumps(merged, indent=2) + "\n")
            summary_mod.show(merged)
        else:
            summary_mod.show(summary_mod.merge({}, update))
    print(f"gpu_perf: {record['seconds']:.0f} s in all; results under {out}", flush=True)
    return 0 if all(s.get("rc", 0) == 0 for s in record["steps"]) else 1


if __name__ == "__main__":
    sys.exit(main())
