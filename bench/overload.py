"""The overload policies under a burst of concurrent captures, through the real server.

Per policy: `capsteer serve` on the demo model (a 256 KiB capture budget, one writer
process), `--loads` bursts of `--requests` concurrent completions with `capture_wait`, and the
promise checked: block, every response 200 and every capture ok and verified; drop, every
response 200, the dropped receipts exactly the increase of `capsteer_capture_dropped_total`,
the rest ok; reject, every refusal a 429 with `Retry-After`, as many as the increase of
`capsteer_capture_rejected_total`, the admitted ok. The writer processes' memory (RssAnon,
RssShmem: the shared ring, RssFile) after a warm-up, each burst and `--idle-s` idle seconds.
Prints a table per policy; exits 1 when a promise broke.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import re
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from capsteer.capture import read
from capsteer.demo_model import write_demo_model
from capsteer.server.process import ManagedServer, free_port

POLICIES = ("block", "drop", "reject")
WRITER_MODULE = "capsteer.capture.writer.child"
PROMPT = "the quick brown fox jumps over the lazy dog and keeps running"
MEMORY_FIELDS = ("VmRSS", "RssAnon", "RssShmem", "RssFile")


def server_argv(model: Path, port: int, policy: str, args: argparse.Namespace,
                capture_dir: Path) -> list[str]:
    """The demo model on CPU; capsteer's flags set the budget, policy and one writer."""
    return [sys.executable, "-m", "capsteer.cli", "serve", str(model), "--cpu-defaults",
            "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "demo",
            "--dtype", "float32", "--kv-cache-memory-bytes", str(256 << 20),
            "--max-model-len", "512", "--max-num-seqs", str(args.max_num_seqs),
            "--enforce-eager", "--seed", "0", "--capture-dir", str(capture_dir),
            "--capture-overload", policy, "--capture-budget", args.budget,
            "--capture-writer-processes", "1", "--capture-wait-timeout", "300"]


def session_processes(sid: int, module: str) -> list[int]:
    """Pids in session `sid` whose command line runs `module` (`python -m module`)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text() if entry.name.isdigit() else ""
            cmdline = (entry / "cmdline").read_bytes().split(b"\0") if stat else []
        except OSError:
            continue
        # the fields after the command name, which may hold spaces
        if stat and int(stat.rsplit(")", 1)[1].split()[3]) == sid and module.encode() in cmdline:
            found.append(int(entry.name))
    return sorted(found)


def writers_memory(server: ManagedServer) -> dict[str, dict[str, float]]:
    """Each writer process's MEMORY_FIELDS from /proc/<pid>/status in MiB, by pid."""
    return {str(pid): {name: round(int(value.split()[0]) / 1024, 1)
                       for name, _, value in (line.partition(":") for line in
                                              Path(f"/proc/{pid}/status").read_text().splitlines())
                       if name in MEMORY_FIELDS}
            for pid in session_processes(server.proc.pid, WRITER_MODULE)}


def counters(url: str) -> dict[str, float]:
    """capsteer_capture_{dropped,rejected}_total, summed over label sets."""
    text = httpx.get(url + "/metrics", timeout=60).text
    return {k: sum(float(m.group(1)) for m in re.finditer(
        rf"^capsteer_capture_{k}_total(?:\{{[^}}]*\}})?\s+(\S+)$", text, re.M))
        for k in ("dropped", "rejected")}


async def burst(url: str, n: int, capture: dict[str, Any], max_tokens: int) -> list[httpx.Response]:
    """n completions sent at once from one event loop, one connection each."""
    body = {"model": "demo", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "capture": capture, "capture_wait": True}
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        return list(await asyncio.gather(*(client.post(url + "/v1/completions", json=body)
                                           for _ in range(n))))


def judge(responses: list[httpx.Response], capture_dir: Path) -> dict[str, Any]:
    """Counts of statuses and receipts; every ok receipt's files read and verified."""
    codes: dict[str, int] = dict(Counter(str(r.status_code) for r in responses))
    receipts: dict[str, int] = {}
    retry_after = verified = 0
    problems: list[str] = []
    for r in responses:
        if r.status_code == 429:
            retry_after += int(r.headers.get("retry-after", "0")) >= 1
            continue
        if r.status_code != 200:
            problems.append(f"HTTP {r.status_code}: {r.text[:200]}")
            continue
        results = r.json().get("capture_results") or {}
        status = str(results.get("status"))
        receipts[status] = receipts.get(status, 0) + 1
        if status == "ok":
            try:
                read(capture_dir / results["dir"])  # verifies every file's digest
                verified += 1
            except Exception as exc:  # counted, and named in the record
                problems.append(f"{results.get('capture_id')}: {type(exc).__name__}: {exc}")
    return {"codes": codes, "receipts": receipts, "verified": verified,
            "retry_after": retry_after, "problems": problems[:20]}


def promises(policy: str, load: dict[str, Any], n: int) -> list[str]:
    """What the policy promised and this burst did not keep."""
    broken, codes, receipts = list(load["problems"]), load["codes"], load["receipts"]
    ok, refused = receipts.get("ok", 0), codes.get("429", 0)
    if load["verified"] != ok:
        broken.append(f"{ok - load['verified']} ok captures failed verification")
    if receipts.get("pending", 0) or receipts.get("error", 0):
        broken.append(f"receipts not final or in error: {receipts}")
    if policy == "block" and (codes.get("200", 0) != n or ok != n):
        broken.append(f"block: not every capture ok: {codes} {receipts}")
    if policy == "drop" and codes.get("200", 0) != n:
        broken.append(f"drop: not every response 200: {codes}")
    if receipts.get("dropped", 0) != load["dropped_metric"]:
        broken.append(f"dropped receipts {receipts.get('dropped', 0)} != metric "
                      f"{load['dropped_metric']:g}")
    if refused != load["rejected_metric"]:
        broken.append(f"429s {refused} != metric {load['rejected_metric']:g}")
    if load["retry_after"] != refused:
        broken.append(f"{refused - load['retry_after']} 429s without Retry-After")
    return broken


class PolicyRun:
    """One server and its bursts; `finish_idle` reads memory after the idle wait and stops it."""

    def __init__(self, policy: str, model: Path, work: Path, args: argparse.Namespace) -> None:
        self.policy, self.args = policy, args
        self.capture_dir = work / policy / "captures"
        self.capture_dir.mkdir(parents=True, exist_ok=True)
        port = free_port()
        self.server = ManagedServer(server_argv(model, port, policy, args, self.capture_dir),
                                    url=f"http://127.0.0.1:{port}",
                                    log_path=work / policy / "server.log")
        self.record: dict[str, Any] = {"policy": policy, "start_s": round(self.server.ready_s, 1),
                                       "loads": [], "broken": []}
        self.idle_from = 0.0

    def run_loads(self) -> None:
        args, url = self.args, self.server.url
        asyncio.run(burst(url, 1, args.capture, args.max_tokens))  # the writer's first capture
        time.sleep(1.0)
        self.record["memory_start"] = writers_memory(self.server)
        for i in range(args.loads):
            before, started = counters(url), time.monotonic()
            responses = asyncio.run(burst(url, args.requests, args.capture, args.max_tokens))
            elapsed, after = time.monotonic() - started, counters(url)
            load = judge(responses, self.capture_dir) | {
                "dropped_metric": after["dropped"] - before["dropped"],
                "rejected_metric": after["rejected"] - before["rejected"],
                "seconds": round(elapsed, 1)}
            time.sleep(1.0)  # the writer's last "done" batch and publish bookkeeping
            load["memory"] = writers_memory(self.server)
            self.record["broken"] += [f"load {i + 1}: {b}"
                                      for b in promises(self.policy, load, args.requests)]
            self.record["loads"].append(load)
            print(f"  {self.policy} load {i + 1}: {elapsed:.1f} s {load['codes']} "
                  f"{load['receipts']} verified {load['verified']}", flush=True)
        self.idle_from = time.monotonic()

    def finish_idle(self) -> None:
        if self.args.idle_s > 0:
            time.sleep(max(0.0, self.idle_from + self.args.idle_s - time.monotonic()))
            self.record["idle_s"] = round(time.monotonic() - self.idle_from, 1)
            self.record["memory_idle"] = writers_memory(self.server)
        self.server.close()
        if not self.args.keep:
            shutil.rmtree(self.capture_dir, ignore_errors=True)


def table(record: dict[str, Any]) -> str:
    lines = [f"{record['policy']}: server ready in {record['start_s']} s",
             "  load  seconds  HTTP                     receipts                  verified  "
             "dropped/metric  429/metric  Retry-After",]
    for i, load in enumerate(record["loads"], 1):
        lines.append(f"  {i:>4}  {load['seconds']:>7}  {json.dumps(load['codes']):<24} "
                     f"{json.dumps(load['receipts']):<25} {load['verified']:>8}  "
                     f"{load['receipts'].get('dropped', 0):>7}/{load['dropped_metric']:<6g} "
                     f"{load['codes'].get('429', 0):>5}/{load['rejected_metric']:<5g} "
                     f"{load['retry_after']:>6}")
    lines.append("  writer memory (MiB, all writer processes): " + "  ".join(MEMORY_FIELDS))
    rows = [("start", record.get("memory_start", {})),
            *((f"after load {i}", load["memory"]) for i, load in enumerate(record["loads"], 1)),
            *([(f"idle {record['idle_s']} s", record["memory_idle"])] if "memory_idle" in record
              else [])]
    lines += [f"    {name:<14}" + "".join(
        f"{round(sum(m.get(f, 0.0) for m in memory.values()), 1):>10}" for f in MEMORY_FIELDS)
        for name, memory in rows]
    return "\n".join(lines + [f"  BROKEN {b}" for b in record["broken"]])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policies", default=",".join(POLICIES))
    # --requests: concurrent requests a burst; --loads: bursts per policy
    for name, default in (("--requests", 500), ("--loads", 3), ("--max-tokens", 4),
                          ("--max-num-seqs", 128)):
        p.add_argument(name, type=int, default=default)
    p.add_argument("--budget", default="256KiB", help="--capture-budget of each server")
    p.add_argument("--capture", type=json.loads,
                   default={"hooks": ["resid_post"], "layers": [0, 1], "positions": "all"})
    p.add_argument("--idle-s", type=float, default=35.0,
                   help="seconds without requests before the last memory reading (the "
                        "writer hands its free heap back after 30)")
    p.add_argument("--work", type=Path, default=None, help="model and captures (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the captures")
    p.add_argument("--out", type=Path, default=None, help="JSON record")
    args = p.parse_args(argv)
    policies = [x for x in args.policies.split(",") if x]
    if not set(policies) <= set(POLICIES):
        p.error(f"policies are {', '.join(POLICIES)}")
    work = args.work or Path(tempfile.mkdtemp(prefix="capsteer-overload-"))
    model = work / "demo-qwen3"
    if not (model / "config.json").exists():
        write_demo_model(model, "qwen3", seed=7)
    started = time.monotonic()
    records: list[dict[str, Any]] = []
    live: list[PolicyRun] = []  # at most two: one idling while the next one's server starts
    def finish() -> None:
        done = live.pop(0)
        done.finish_idle()
        print(table(done.record), flush=True)
        records.append(done.record)

    try:
        for policy in policies:
            print(f"{policy}: starting the server", flush=True)
            live.append(PolicyRun(policy, model, work, args))
            if len(live) == 2:
                finish()
            live[0].run_loads()
        while live:
            finish()
    finally:
        for run in live:
            run.server.close()
    result = {"date": dt.date.today().isoformat(), "host": platform.node(),
              "cpus": os.cpu_count(), "argv": sys.argv[1:], "seconds": round(time.monotonic() - started, 1),
              "requests": args.requests, "loads": args.loads, "budget": args.budget,
              "capture": args.capture, "policies": records}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    print(f"done in {result['seconds']} s" + (f"; record: {args.out}" if args.out else ""))
    return 1 if any(r["broken"] for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
