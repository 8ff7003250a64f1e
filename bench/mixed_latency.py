"""Plain requests' latency beside capture bursts, through the real server (issue 12).

A capsteer server is shared between chat traffic and capture jobs, so what a capture burst
costs the plain requests batched beside it is what users feel. Each process here is one
server: `capsteer serve --vanilla` (stock `vllm serve`, same flags) or capsteer.
Configurations are interleaved over rounds (vanilla, capsteer, vanilla, ...). In each
server, after an untimed warm-up:

- quiet: C closed-loop clients send plain streamed completions (prompt P tokens, G
  generated, ignore_eos) for Q seconds;
- bursts: the same clients go on while a burst of R requests (prompt L tokens, one
  generated) starts every B seconds. In capsteer each request of a burst captures
  resid_post at every layer over the prompt, durable, with `capture_wait` (P6's shape at
  the defaults). In vanilla the same requests carry no capture.

Plain requests are grouped by when they ran: the quiet phase; the burst phase (all of
them: the same schedule in both configurations); and, within it, those beside a burst
(their time overlaps one; a capsteer burst lasts until its captures are durable, so its
window is longer than vanilla's). For each group it prints the median and p95 of time to
first token and of end-to-end latency, and each burst's time to its last response.
Beside them: capsteer / vanilla ratios of the same figures, for each round and over the
per-process medians of complete rounds (above 1 = slower than vanilla). Per process it also
prints TTFT by start time after a burst's start, and time per output token in the quiet
phase and by start after a burst (decode slowed by what a burst leaves behind shows there
once the burst is durable). `--probe` adds, per window (quiet, each burst, after each), the
CPU of every server process and the engine's steps, step times and GC, and the median time
of the engine's decode-only steps by batch size and of the steps that carried a prompt
chunk, by size (from a trace of every step, kept in the JSON as each process's `steps`).
Captures are deleted only between phases, never while requests are timed.

    python bench/mixed_latency.py --device cuda --shape llama3-8b-36l --rounds 2 --out $OUT/mixed
    python bench/mixed_latency.py --device cpu --shape llama-tiny --rounds 1 --quiet-s 10 \
        --bursts 2 --burst-requests 8 --burst-every 8 --clients 2        (smoke)

Writes <out>/mixed-latency.json (every request's times, per process) and prints a table.

CPU runs are a smoke test only. On the 2-core CPU machine vLLM's engine core and worker
processes busy-wait for each other and use both cores under load, in stock vLLM as in
capsteer (`--vanilla`: 6.3 + 7.9 CPU-s in 8 s of two streaming clients). The API server
then runs late, and a request's streamed tokens often arrive together at its end.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import gzip
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import perf_models  # bench/ is not a package
from serve_proc import free_port, stop, wait_ready

CONFIGS = ("vanilla", "capsteer")


def server_argv(config: str, model: Path, shape: str, args: argparse.Namespace, port: int,
                capture_dir: Path) -> list[str]:
    """The same engine flags for both configurations; capsteer adds its capture root."""
    kw = perf_models.engine_kwargs(shape)
    max_len = max(args.prompt + args.gen, args.burst_prompt + 1) + 16
    argv = [sys.executable, "-m", "capsteer.cli", "serve", str(model),
            "--host", "127.0.0.1", "--port", str(port), "--dtype", kw["dtype"],
            "--max-model-len", str(max_len), "--seed", "0",
            "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--gpu-memory-utilization", "0.85" if args.device == "cuda" else "0.3"]
    if "load_format" in kw:
        argv += ["--load-format", kw["load_format"]]
    if args.burst_priority is not None:  # vLLM's own policy, in both configurations
        argv += ["--scheduling-policy", "priority"]
    if args.profile_s:  # vLLM's torch profiler, started only in the profile phase
        argv += ["--profiler-config", json.dumps({
            "profiler": "torch", "torch_profiler_dir": str(profile_dir(capture_dir, config)),
            "torch_profiler_with_stack": False, "ignore_frontend": True,
            "torch_profiler_dump_cuda_time_total": False})]
    if config == "vanilla":
        return [*argv, "--vanilla"]
    # A step of burst prompts captures every layer of up to max-num-batched-tokens tokens:
    # the GPU staging buffer holds them all (its default holds 4 rows a token).
    staging = args.max_num_batched_tokens * perf_models.SHAPES[shape].layers
    return [*argv, "--capture-dir", str(capture_dir), "--capture-staging-rows", str(staging),
            *args.capsteer_flags]


def profile_dir(capture_dir: Path, config: str) -> Path:
    return capture_dir.parent / f"profile-{config}"


def process_roles(server_pid: int) -> dict[int, str]:
    """pid -> role in one server's process tree: api (the process launched), engine (vLLM's
    EngineCore), worker (another vLLM process), writer (a Python child of the engine or a
    worker: capsteer's writer processes), bench (this one)."""
    import psutil

    out = {os.getpid(): "bench"}
    try:
        tree = psutil.Process(server_pid).children(recursive=True)
    except psutil.Error:
        return out
    out[server_pid] = "api"
    named: dict[int, tuple[str, int]] = {}
    for child in tree:
        try:
            named[child.pid] = (child.name(), child.ppid())
        except psutil.Error:
            continue
    for pid, (name, _) in named.items():
        if name.startswith("VLLM::"):
            out[pid] = "engine" if name.startswith("VLLM::EngineCor") else "worker"
    for pid, (name, ppid) in named.items():
        if pid not in out:
            out[pid] = ("writer" if name.startswith("python") and out.get(ppid) in
                        ("engine", "worker") else "other")
    return out


class ServerProbe:
    """Counters of one server's process tree (`--probe`) at the workload's phase
    boundaries: each process's CPU (its threads' run time), its busiest thread, and the
    engine probe's steps, step times and garbage collections (bench/engine_probe). Between
    two marks they say which process spent what in that window, e.g. whether the engine's
    steps took longer after a burst, or other processes took CPU then. From /metrics it
    also takes capsteer's CUDA-graph replays by set (capsteer_graph_replays_total): whether
    a window's plain steps ran on the graphs without taps; and its engine's waits on
    captured rows (capsteer_capture_engine_wait_seconds_total): whether a burst held the
    steps, and every plain request in them, for a harvest slot or writer ring space."""

    def __init__(self, server_pid: int, probe_dir: Path, url: str) -> None:
        self.server_pid, self.probe_dir, self.url = server_pid, probe_dir, url
        self.marks: list[tuple[str, float, dict[str, Any]]] = []

    def take(self, label: str, at: float) -> None:
        """The window `label` starts now (and the previous one ends)."""
        import host_counters

        self.marks.append((label, at, {"counters": host_counters.snapshot(self.probe_dir),
                                       "roles": process_roles(self.server_pid),
                                       "metrics": capsteer_counters(self.url)}))

    def windows(self) -> list[dict[str, Any]]:
        import host_counters

        out = []
        for (label, t0, a), (_, t1, b) in zip(self.marks, self.marks[1:], strict=False):
            wall = max(t1 - t0, 1e-9)
            roles = {**a["roles"], **b["roles"]}
            by_role: dict[str, dict[str, float]] = {}
            for pid, got in host_counters.by_process(a["counters"], b["counters"]).items():
                role = by_role.setdefault(roles.get(pid, "other"), {})
                role["top_run_s"] = max(role.get("top_run_s", 0.0), got.pop("top_run_s"))
                for key, value in got.items():
                    role[key] = role.get(key, 0.0) + value
            deltas = {family: ({k: v - a["metrics"][family].get(k, 0.0)
                                for k, v in b["metrics"][family].items()}
                               if a["metrics"].get(family) and b["metrics"].get(family) else {})
                      for family in COUNTER_FAMILIES}  # {}: a failed read or no such family
            out.append({"window": label, "start": t0, "wall_s": wall, "roles": by_role,
                        **deltas})
        return out


COUNTER_FAMILIES = {"graph_replays": ("capsteer_graph_replays_total", "set"),
                    "engine_waits": ("capsteer_capture_engine_wait_seconds_total", "wait")}


def capsteer_counters(url: str) -> dict[str, dict[str, float]]:
    """From the server's /metrics: capsteer_graph_replays_total by set and
    capsteer_capture_engine_wait_seconds_total by wait ({} each where absent: vanilla, an
    engine that records one set). In capsteer a scrape also asks each worker for its
    metrics (one RPC between engine steps), which vanilla's does not: a few per process, at
    the window marks only."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[str, float]] = {family: {} for family in COUNTER_FAMILIES}
    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return out
    by_sample = {name: (family, label) for family, (name, label) in COUNTER_FAMILIES.items()}
    for metric in text_string_to_metric_families(text):
        for s in metric.samples:
            if s.name in by_sample:
                family, label = by_sample[s.name]
                out[family][s.labels[label]] = s.value
    return out


def loop_role(roles: dict[str, dict[str, float]]) -> dict[str, float]:
    """A window's counters of the process that runs the forward, where the probe times its
    host loop: a worker where there is one (vLLM's CPU backend), else the EngineCore."""
    worker = roles.get("worker", {})
    return worker if worker.get("speed_n") else roles.get("engine", {})


def probe_line(w: dict[str, Any]) -> str:
    """One window: CPU per wall second by role, and the engine's steps."""
    wall, roles = w["wall_s"], w["roles"]

    def cpu(role: str) -> str:
        got = roles.get(role)
        return f"{got['run_s'] / wall:6.2f}" if got else "     -"

    engine, worker = roles.get("engine", {}), roles.get("worker", {})
    steps = engine.get("steps", 0)

    def each(key: str) -> str:  # the model runner runs in a worker process where there is one
        total = engine.get(key, 0.0) + (0.0 if key == "step_s" else worker.get(key, 0.0))
        return f"{total / steps * 1e3:7.2f}" if steps else "      -"

    def gc_ms(role: dict[str, float]) -> float:
        return sum(role.get(f"gc{g}_s", 0.0) for g in range(3)) / wall * 1e3

    sampled = loop_role(roles)
    samples = sampled.get("speed_n", 0)
    loop = f"{sampled['speed_s'] / samples * 1e3:7.2f}" if samples else "      -"
    return (f"    {w['window']:<10}{wall:6.1f}{cpu('api')}{cpu('engine')}"
            f"{engine.get('top_run_s', 0.0) / wall:6.2f}{cpu('worker')}{cpu('writer')}"
            f"{steps / wall:8.0f}{each('step_s')}{each('forward_s')}{each('sample_s')}"
            f"{gc_ms(engine):6.1f}/{gc_ms(roles.get('api', {})):<5.1f}{loop}"
            f"{replays_cell(w.get('graph_replays') or {}):>14}"
            f"{waits_cell(w.get('engine_waits') or {}):>12}")


def replays_cell(replays: dict[str, float]) -> str:
    return f"{replays.get('plain', 0):.0f}/{replays.get('hooked', 0):.0f}" if replays else "-"


def waits_cell(waits: dict[str, float]) -> str:
    """The engine's waits on captured rows in a window, ms: harvest slot / writer ring."""
    return (f"{waits.get('harvest_slot', 0) * 1e3:.0f}/{waits.get('writer_ring', 0) * 1e3:.0f}"
            if waits else "-")


PROBE_HEAD = ("    window      wall   api engine  step worker writer steps/s step ms  fwd ms"
              " smpl ms  GC ms/s    loop ms  graphs p/h  waits h/r   (CPU s per s by process; step: the"
              " EngineCore's busiest thread; ms per engine step; GC: engine/api; loop: the"
              " host's speed, a fixed Python loop timed every 0.5 s on the thread that runs"
              " the forward, lower is"
              " faster; graphs: steps replayed from capsteer's CUDA graphs without taps / with"
              " them; waits: ms capsteer's engine waited for captured rows to move on, for a"
              " harvest slot (the step thread) / for writer ring space)")


class Traffic:
    """One server's plain clients and bursts; every request's times, from one clock."""

    def __init__(self, url: str, model: str, args: argparse.Namespace, capture: bool,
                 capture_dir: Path, probe: ServerProbe | None = None) -> None:
        import httpx
        from openai import AsyncOpenAI

        # No retries (they would hide latency), so an idle pooled connection must be dropped
        # before the server's 5 s keep-alive closes it: reusing one as uvicorn closes it
        # fails the request (httpx.ReadError, seen on GPU after the 103-request warm-up).
        http = httpx.AsyncClient(timeout=900, limits=httpx.Limits(
            max_connections=None, max_keepalive_connections=None, keepalive_expiry=2.0))
        self.client = AsyncOpenAI(base_url=url + "/v1", api_key="none", timeout=900,
                                  max_retries=0, http_client=http)
        self.model, self.args, self.capture, self.capture_dir = model, args, capture, capture_dir
        self.spy_to: tuple[int, Path] | None = None  # (server pid, raw profile) for spy_phase
        self.url = url
        self.rng = random.Random(7)
        self.t0 = time.monotonic()
        self.plain: list[dict[str, Any]] = []
        self.bursts: list[dict[str, Any]] = []
        self.probe = probe

    async def mark(self, label: str) -> None:
        """Start the probe's window `label` (off the event loop: reading a process tree's
        counters takes milliseconds)."""
        if self.probe is not None:
            await asyncio.to_thread(self.probe.take, label, self.now())

    def now(self) -> float:
        return time.monotonic() - self.t0

    def prompt(self, n: int) -> list[int]:
        """Fresh token ids every request: a repeated prompt would hit the prefix cache."""
        return [self.rng.randrange(10, 500) for _ in range(n)]

    async def one_plain(self, phase: str) -> None:
        start = self.now()
        first = None
        chunks = 0
        stream = await self.client.completions.create(
            model=self.model, prompt=self.prompt(self.args.prompt), max_tokens=self.args.gen,
            temperature=0.0, stream=True, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text is not None:
                chunks += 1
                if first is None:
                    first = self.now()
        end = self.now()
        self.plain.append({"phase": phase, "start": start, "first": first, "end": end,
                           "chunks": chunks})

    async def clients(self, phase: str, until: asyncio.Event) -> None:
        async def loop() -> None:
            while not until.is_set():
                await self.one_plain(phase)

        await asyncio.gather(*(loop() for _ in range(self.args.clients)))

    async def burst(self, record: bool = True) -> dict[str, Any]:
        extra: dict[str, Any] = {"ignore_eos": True}
        if self.args.burst_priority is not None:  # plain requests keep vLLM's default, 0
            extra["priority"] = self.args.burst_priority
        if self.capture:
            extra.update({"capture": {"hooks": ["resid_post"], "layers": "all",
                                      "positions": "prompt", "layout": "packed"},
                          "capture_wait": True})
        start = self.now()

        async def one() -> str:
            r = await self.client.completions.create(
                model=self.model, prompt=self.prompt(self.args.burst_prompt), max_tokens=1,
                temperature=0.0, extra_body=extra)
            if not self.capture:
                return "none"
            got = (r.model_extra or {}).get("capture_results") or {}
            return str(got.get("status"))

        statuses = await asyncio.gather(*(one() for _ in range(self.args.burst_requests)))
        out = {"start": start, "end": self.now(), "statuses": statuses}
        out["seconds"] = out["end"] - out["start"]
        if self.capture and any(s != "ok" for s in statuses):
            raise RuntimeError(f"capture burst: receipts {sorted(set(statuses))}")
        if record:
            self.bursts.append(out)
        return out

    async def profile_phase(self) -> None:
        """After the timed phases: the plain clients alone, with vLLM's torch profiler on for
        profile_s seconds (writing its trace stalls the engine; no figure counts this
        phase's requests)."""
        import httpx

        done = asyncio.Event()
        clients = asyncio.create_task(self.clients("profile", done))
        await asyncio.sleep(2.0)  # the clients spread out, as between bursts
        async with httpx.AsyncClient(base_url=self.url, timeout=600) as http:
            (await http.post("/start_profile")).raise_for_status()
            await asyncio.sleep(self.args.profile_s)
            (await http.post("/stop_profile")).raise_for_status()  # returns once written
        done.set()
        await clients

    async def spy_phase(self, server_pid: int, path: Path) -> None:
        """After the timed phases: the plain clients alone while py-spy samples the
        EngineCore, native frames included, for pyspy_s seconds (py-spy pauses the process
        for each sample, more so where it has more threads: no figure counts this phase);
        then each `--attach` command, one after another, on the same traffic."""
        done = asyncio.Event()
        clients = asyncio.create_task(self.clients("pyspy", done))
        await asyncio.sleep(2.0)  # the clients spread out, as between bursts
        try:
            engine = [pid for pid, role in process_roles(server_pid).items() if role == "engine"]
            if not engine:
                raise RuntimeError("no EngineCore process to sample")
            commands = [[str(self.args.pyspy), "record", "--native", "--threads", "-r", "200",
                         "-d", f"{self.args.pyspy_s:g}", "-f", "raw", "-o", str(path), "--pid",
                         str(engine[0])]] if self.args.pyspy_s else []
            for i, template in enumerate(self.args.attach):
                out = path.with_name(f"{path.name.removesuffix('.txt')}-attach{i + 1}.txt")
                commands.append(["bash", "-c", template.format(pid=engine[0], out=out)])
            for argv in commands:
                run = await asyncio.create_subprocess_exec(
                    *argv, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
                _, err = await run.communicate()
                if run.returncode:
                    print(f"{argv[0]} exited {run.returncode}: {err.decode()[-400:]}",
                          file=sys.stderr, flush=True)
        finally:
            done.set()
            await clients

    def clear_captures(self) -> None:
        """Delete published captures, only while no request is timed (a deletion would
        compete with the server for the disk and this loop's thread)."""
        for child in self.capture_dir.iterdir():
            shutil.rmtree(child, ignore_errors=True)

    async def run(self) -> None:
        a = self.args
        # Warm-up (untimed): a burst (where bursts are timed) and a round of plain requests.
        # Without bursts no capture runs, so a flag that shrinks capture buffers (staging
        # rows too few for a burst) can be tried on plain traffic alone.
        if a.bursts:
            await self.burst(record=False)
        await asyncio.gather(*(self.one_plain("warm-up") for _ in range(a.clients)))
        self.clear_captures()
        quiet_done = asyncio.Event()
        await self.mark("quiet")
        quiet = asyncio.create_task(self.clients("quiet", quiet_done))
        await asyncio.sleep(a.quiet_s)
        quiet_done.set()
        await quiet
        bursts_done = asyncio.Event()
        beside = asyncio.create_task(self.clients("bursts", bursts_done))
        for i in range(a.bursts):
            started = self.now()
            await self.mark(f"burst {i + 1}")
            await self.burst()
            if i + 1 < a.bursts:
                await self.mark(f"after {i + 1}")  # until the next burst starts
                await asyncio.sleep(max(0.0, a.burst_every - (self.now() - started)))
        await self.mark("end")
        bursts_done.set()
        await beside
        if a.profile_s:
            await self.profile_phase()
        if (a.pyspy_s or a.attach) and self.spy_to is not None:
            await self.spy_phase(*self.spy_to)
        await self.client.close()
        self.clear_captures()


def group(plain: list[dict], bursts: list[dict]) -> dict[str, list[dict]]:
    """quiet (the quiet phase); bursts (every plain request of the burst phase: the same
    schedule in both configurations); beside (those overlapping a burst, whose window is
    longer where bursts take longer, as capsteer's wait for durable captures)."""
    out: dict[str, list[dict]] = {"quiet": [], "bursts": [], "beside": []}
    for r in plain:
        if r["phase"] == "quiet":
            out["quiet"].append(r)
        elif r["phase"] == "bursts":
            out["bursts"].append(r)
            if any(r["start"] < b["end"] and r["end"] > b["start"] for b in bursts):
                out["beside"].append(r)
    return out


def p95(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(0.95 * (len(xs) - 1)))]


OFFSET_BIN_S = 0.5


def since_burst(r: dict, bursts: list[dict]) -> float | None:
    """Seconds from the latest burst start before request `r` started (None: before any)."""
    since = [r["start"] - b["start"] for b in bursts if r["start"] >= b["start"]]
    return min(since) if since else None


def ttft_by_offset(plain: list[dict], bursts: list[dict]) -> dict[str, float]:
    """Median TTFT of the burst phase's plain requests by when they started after the
    latest burst start (0.5 s bins): where in a burst the plain requests wait."""
    bins: dict[int, list[float]] = {}
    for r in plain:
        if r["phase"] != "bursts" or r["first"] is None:
            continue
        since = since_burst(r, bursts)
        if since is not None:
            bins.setdefault(int(since // OFFSET_BIN_S), []).append(r["first"] - r["start"])
    return {f"{k * OFFSET_BIN_S:.1f}": statistics.median(v) for k, v in sorted(bins.items())}


TPOT_BIN_S = 2.0
SETTLED_S = 4.0  # a burst is past its prefill by then: what it leaves behind, for decodes


def tpot_s(r: dict) -> float | None:
    """Seconds per streamed token after the first: the decode steps a request saw."""
    if r["first"] is None or r["chunks"] < 2:
        return None
    return (r["end"] - r["first"]) / (r["chunks"] - 1)


def tpot_by_offset(plain: list[dict], bursts: list[dict]) -> dict[str, float]:
    """Median time per output token: the quiet phase's, and the burst phase's by when a
    request started after the latest burst start (2 s bins, over the whole period). A
    decode step slowed by what a burst leaves behind shows here after the burst is durable,
    where TTFT no longer waits for its prefill."""
    bins: dict[str, list[float]] = {}
    for r in plain:
        t = tpot_s(r)
        if t is None:
            continue
        if r["phase"] == "quiet":
            bins.setdefault("quiet", []).append(t)
            continue
        since = since_burst(r, bursts)
        if r["phase"] == "bursts" and since is not None:
            bins.setdefault(f"{int(since // TPOT_BIN_S) * TPOT_BIN_S:.0f}", []).append(t)
    order = sorted(bins, key=lambda k: -1.0 if k == "quiet" else float(k))
    return {k: statistics.median(bins[k]) for k in order}


def figures(plain: list[dict], bursts: list[dict]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, rs in group(plain, bursts).items():
        ttft = [r["first"] - r["start"] for r in rs if r["first"] is not None]
        lat = [r["end"] - r["start"] for r in rs]
        out[name] = {"n": len(rs)}
        if ttft:
            out[name].update({"ttft_median_s": statistics.median(ttft), "ttft_p95_s": p95(ttft)})
        if lat:
            out[name].update({"latency_median_s": statistics.median(lat),
                              "latency_p95_s": p95(lat)})
    tpot = [t for r in plain if r["phase"] == "quiet" and (t := tpot_s(r)) is not None]
    if tpot:
        out["quiet"]["tpot_median_s"] = statistics.median(tpot)
    settled = [t for r in plain if r["phase"] == "bursts" and (t := tpot_s(r)) is not None
               and (since := since_burst(r, bursts)) is not None and since >= SETTLED_S]
    out["settled"] = {"n": len(settled)}
    if settled:
        out["settled"]["tpot_median_s"] = statistics.median(settled)
    out["ttft_by_offset"] = ttft_by_offset(plain, bursts)
    out["tpot_by_offset"] = tpot_by_offset(plain, bursts)
    secs = [b["seconds"] for b in bursts]
    out["burst_s"] = secs
    out["burst_median_s"] = statistics.median(secs) if secs else None
    return out


def run_process(config: str, model: Path, args: argparse.Namespace, work: Path,
                spy_path: Path | None = None) -> dict:
    """One server's run; with `--pyspy-s`, its EngineCore's py-spy samples go to spy_path."""
    capture_dir = work / "captures"
    shutil.rmtree(capture_dir, ignore_errors=True)
    capture_dir.mkdir(parents=True)
    shutil.rmtree(profile_dir(capture_dir, config), ignore_errors=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = work / f"serve-{config}.log"
    env = None
    probe_dir = work / f"probe-{config}"
    if args.probe:  # the same probe in both configurations' processes
        import host_counters

        shutil.rmtree(probe_dir, ignore_errors=True)
        probe_dir.mkdir(parents=True)
        env = os.environ | host_counters.engine_probe_env(probe_dir) | {
            "CAPSTEER_ENGINE_PROBE_TRACE": "1"}
    with open(log, "wb") as fh:
        proc = subprocess.Popen(server_argv(config, model, args.shape, args, port, capture_dir),
                                stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
                                cwd=work, env=env)  # not the checkout: the installed capsteer
    try:
        startup = wait_ready(proc, url, log, args.start_timeout)
        probe = ServerProbe(proc.pid, probe_dir, url) if args.probe else None
        traffic = Traffic(url, str(model), args, config == "capsteer", capture_dir, probe)
        if spy_path is not None:
            traffic.spy_to = (proc.pid, spy_path)
        asyncio.run(traffic.run())
    except BaseException:
        print(log.read_text(errors="replace")[-4000:], file=sys.stderr)
        raise
    finally:
        stop(proc)
        shutil.rmtree(capture_dir, ignore_errors=True)
    got = {"config": config, "startup_s": startup, "plain": traffic.plain,
           "bursts": traffic.bursts, "figures": figures(traffic.plain, traffic.bursts)}
    if args.profile_s:
        import step_profile

        trace = step_profile.trace_in(profile_dir(capture_dir, config))
        if trace is None:  # the timed figures stand without it
            got["step_profile_error"] = "vLLM wrote no profiler trace"
            print(f"{config}: vLLM wrote no profiler trace", file=sys.stderr, flush=True)
        else:
            got["step_profile"] = step_profile.summarize(step_profile.load_events(trace))
            shutil.rmtree(trace.parent, ignore_errors=True)
    if args.pyspy_s and spy_path is not None and spy_path.exists():
        import pyspy_native

        got["pyspy"] = pyspy_native.summarize(spy_path)
        subprocess.run(["gzip", "-f", str(spy_path)], check=False)
    if probe is not None:
        got["probe"] = probe.windows()
        got["steps"] = engine_steps(probe_dir, traffic.t0)
        for w in got["probe"]:
            w["decode_steps"] = decode_steps(got["steps"], w["start"], w["start"] + w["wall_s"])
            w["step_usage"] = step_usage(got["steps"], w["start"], w["start"] + w["wall_s"])
        got["chunk_steps"] = chunk_steps(got["steps"], got["probe"])
        got["host_loop_ms"] = host_loop_ms(got["probe"])
        got["chunk_steps_by_phase"] = {phase: chunk_steps(got["steps"], got["probe"], (phase,))
                                       for phase in ("quiet", "after")}
    return got


def engine_steps(probe_dir: Path, t0: float) -> list[list[float]]:
    """The EngineCore's step rows (the process with the most), on the traffic's clock:
    [end s, step ms, tokens, requests, prefills, execute_model ms, sample_tokens ms,
    the step thread's CPU ms in the step, and in execute_model, its kernel CPU ms in the
    step, minor page faults and involuntary context switches]."""
    import host_counters

    traces = host_counters.engine_probe_trace(probe_dir)
    if not traces:
        return []
    rows = max(traces.values(), key=len)
    return [[round(end / 1e9 - t0, 4), round(step / 1e6, 3), tokens, requests, prefills,
             round(fwd / 1e6, 3), round(smpl / 1e6, 3), round(step_cpu / 1e6, 3),
             round(fwd_cpu / 1e6, 3), round(sys_ns / 1e6, 3), minflt, nivcsw]
            for (end, step, tokens, requests, prefills, fwd, smpl, step_cpu, fwd_cpu, sys_ns,
                 minflt, nivcsw) in rows]


def decode_steps(steps: list[list[float]], t0: float, t1: float) -> dict[str, Any]:
    """Median ms of the window's steps that only decoded (no prefill chunk), by batch size:
    the window's step time, like for like (a window's mean step mixes in prefills)."""
    by_size: dict[int, list[float]] = {}
    for end, ms, _tokens, requests, prefills, *_times in steps:
        if t0 <= end < t1 and not prefills:
            by_size.setdefault(int(requests), []).append(ms)
    return {str(n): {"n": len(v), "median_ms": statistics.median(v)}
            for n, v in sorted(by_size.items())}


def step_usage(steps: list[list[float]], t0: float, t1: float) -> dict[str, Any]:
    """Means over every step of the window, of any kind (bursts' capture steps included), of
    the step thread's kernel CPU ms, minor page faults and involuntary context switches, and
    how many steps faulted at all: a per-step cost in the kernel shows in every window."""
    got = [row[9:12] for row in steps if len(row) >= 12 and t0 <= row[0] < t1]
    if not got:
        return {"n": 0}
    sys_ms, minflt, nivcsw = zip(*got, strict=True)
    return {"n": len(got), "sys_mean_ms": statistics.fmean(sys_ms),
            "minflt_mean": statistics.fmean(minflt), "nivcsw_mean": statistics.fmean(nivcsw),
            "faulting_steps": sum(1 for f in minflt if f)}


def host_loop_ms(windows: list[dict[str, Any]]) -> float | None:
    """The probe's fixed Python loop on the thread that runs the forward (a worker's where
    there is one, as on CPU), mean ms over the run: the host's speed for this process."""
    roles = [loop_role(w["roles"]) for w in windows]
    n = sum(r.get("speed_n", 0.0) for r in roles)
    return sum(r.get("speed_s", 0.0) for r in roles) / n * 1e3 if n else None


def host_ratios(cap: dict[str, Any], van: dict[str, Any]) -> dict[str, float | None]:
    """A probed round's host-bound figures: the steps of up to 512 tokens that carried a
    prompt chunk outside bursts, the host loop, and the first divided by the second. The
    host's speed differs between processes by up to 1.5x; the last ratio takes it out."""
    def chunk(p: dict[str, Any]) -> float | None:
        return (p.get("chunk_steps") or {}).get("1-512", {}).get("median_ms")

    got: dict[str, float | None] = {}
    for key, a, b in (("chunk_steps_512", chunk(cap), chunk(van)),
                      ("host_loop", cap.get("host_loop_ms"), van.get("host_loop_ms"))):
        got[key] = a / b if a is not None and b else None
    steps, loop = got["chunk_steps_512"], got["host_loop"]
    got["chunk_steps_512_per_host_loop"] = steps / loop if steps and loop else None
    return got


CHUNK_BINS = ((1, 512), (513, 1024), (1025, 1 << 30))  # scheduled tokens of a step


def chunk_steps(steps: list[list[float]], windows: list[dict[str, Any]],
                phases: tuple[str, ...] = ("quiet", "after")) -> dict[str, Any]:
    """Median ms of the steps that carried a prompt chunk in the windows of `phases` (by
    default outside bursts, the quiet and after windows: plain traffic only), by scheduled
    tokens: up to vLLM's largest piecewise CUDA graph by default (512), and beyond it.
    Beside the step's wall time: its execute_model's, and the step thread's CPU time in each
    (the wall time a step spent waiting is the difference); then the means of the thread's
    kernel CPU time in the step (a mean: the kernel counts it in whole ticks), its minor page
    faults and its involuntary context switches (rows of an older trace lack them)."""
    spans = [(w["start"], w["start"] + w["wall_s"]) for w in windows
             if w["window"].split()[0] in phases]
    out = {}
    for lo, hi in CHUNK_BINS:
        got = [(ms, cpu, fwd, fwd_cpu, *usage)
               for end, ms, tokens, _r, prefills, fwd, _smpl, cpu, fwd_cpu, *usage in steps
               if prefills and lo <= tokens <= hi and any(a <= end < b for a, b in spans)]
        if got:
            columns = list(zip(*got, strict=True))
            ms, cpu, fwd, fwd_cpu = (statistics.median(column) for column in columns[:4])
            key = f"{lo}-{hi if hi < 1 << 30 else ''}"
            out[key] = {"n": len(got), "median_ms": ms, "cpu_median_ms": cpu,
                        "forward_median_ms": fwd, "forward_cpu_median_ms": fwd_cpu}
            out[key].update(zip(("sys_mean_ms", "minflt_mean", "nivcsw_mean"),
                                (statistics.fmean(column) for column in columns[4:]),
                                strict=False))
    return out


KEYS = [("quiet", "ttft_median_s"), ("quiet", "latency_median_s"), ("quiet", "tpot_median_s"),
        ("bursts", "ttft_median_s"), ("bursts", "ttft_p95_s"),
        ("bursts", "latency_median_s"), ("bursts", "latency_p95_s"),
        ("beside", "latency_median_s"), ("beside", "latency_p95_s"),
        ("settled", "tpot_median_s")]
HEADS = ["q ttft", "q lat", "q tpot", "p ttft", "p ttft95", "p lat", "p lat95", "b lat",
         "b lat95", "s tpot"]


def device_name(device: str) -> str:
    """The GPU's name without a CUDA context in this process (the servers need the memory)."""
    if device != "cuda":
        return "cpu"
    got = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                         capture_output=True, text=True, check=False)
    return got.stdout.strip().splitlines()[0] if got.returncode == 0 and got.stdout.strip() else "cuda"


def row(label: str, f: dict) -> str:
    cells = [f"{f.get(g, {}).get(k, float('nan')) * (1000 if k.startswith('tpot') else 1):9.3f}"
             for g, k in KEYS]  # seconds; time per output token in ms
    burst = f["burst_median_s"]
    return (f"{label:<22}" + "".join(cells) + f"{burst if burst is not None else float('nan'):9.3f}"
            + f"   n quiet {f['quiet']['n']}, burst phase {f['bursts']['n']}, "
            f"beside {f['beside']['n']}")


def print_process(label: str, f: dict) -> None:
    """A process's figures, and its TTFT by start time after a burst's start."""
    got = f.get("ttft_by_offset") or {}
    print(row(label, f), flush=True)
    print("    TTFT ms by start after a burst's (s): "
          + " ".join(f"{k}:{v * 1000:.0f}" for k, v in list(got.items())[:12]), flush=True)
    tpot = f.get("tpot_by_offset") or {}
    print("    TPOT ms, quiet and by start after a burst's (s): "
          + " ".join(f"{k}:{v * 1000:.2f}" for k, v in tpot.items()), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    perf_models.add_device_and_shape(ap, "llama3-8b-36l")
    ap.add_argument("--rounds", type=int, default=2, help="processes per configuration")
    ap.add_argument("--clients", type=int, default=8, help="closed-loop plain clients")
    ap.add_argument("--prompt", type=int, default=256, help="plain requests' prompt tokens")
    ap.add_argument("--gen", type=int, default=64, help="plain requests' generated tokens")
    ap.add_argument("--quiet-s", type=float, default=20.0)
    ap.add_argument("--bursts", type=int, default=3)
    ap.add_argument("--burst-every", type=float, default=12.0, help="seconds between burst starts")
    ap.add_argument("--burst-requests", type=int, default=103)
    ap.add_argument("--burst-prompt", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--capsteer-flags", default="", help="more capsteer serve flags, one string")
    ap.add_argument("--burst-priority", type=int, default=None,
                    help="serve both configurations with vLLM's --scheduling-policy priority "
                    "and send bursts with this priority (plain requests keep 0; higher is "
                    "served later): plain requests then jump a burst's queue")
    ap.add_argument("--probe", action="store_true",
                    help="per window (quiet, each burst, after each): every server process's "
                    "CPU and the engine's steps, step times and GC, and from a trace of every "
                    "engine step the decode-only and prompt-chunk step times (bench/"
                    "engine_probe, in both configurations)")
    ap.add_argument("--profile-s", type=float, default=0.0,
                    help="after the timed phases, profile the engine for this many seconds "
                    "of plain traffic in both configurations (vLLM's torch profiler) and "
                    "compare their steps kind by kind: host ops and calls a step "
                    "(bench/step_profile.py)")
    ap.add_argument("--pyspy-s", type=float, default=0.0,
                    help="after the timed phases (and any profile), sample the EngineCore with "
                    "py-spy --native for this many seconds of plain traffic in both "
                    "configurations; <out>/spy-CONFIG-rROUND.txt.gz and a comparison by "
                    "library and frame (bench/pyspy_native.py)")
    ap.add_argument("--pyspy", type=Path, default=Path("/tmp/pyspy/bin/py-spy"),
                    help="the py-spy binary (pip install --target /tmp/pyspy py-spy)")
    ap.add_argument("--attach", action="append", default=[], metavar="CMD",
                    help="after any py-spy, run this bash command on the same plain traffic, "
                    "{pid} the EngineCore's, {out} a file beside the py-spy one (e.g. "
                    "\"timeout -s INT 5 strace -c -o {out} -p {pid}\"); repeatable")
    ap.add_argument("--capsteer-first", action="store_true",
                    help="start capsteer's process before vanilla's in each round (a control "
                    "for the order: the second server on a host may run differently)")
    ap.add_argument("--alternate", action="store_true",
                    help="reverse the order every other round (vanilla, capsteer, capsteer, "
                    "vanilla, ...): session 54 found the second server slower in small steps")
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--deadline", type=float, default=0.0,
                    help="epoch seconds: start no process after it")
    ap.add_argument("--work", type=Path, default=Path("/tmp/capsteer-mixed"))
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "bench/results"))
    ap.add_argument("--merge", type=Path, nargs="+", default=None, metavar="JSON",
                    help="run nothing: join these mixed-latency.json files (.gz too; one GPU "
                    "call each, in run order) into <out>/mixed-latency.json, rounds renumbered")
    args = ap.parse_args()
    if args.merge:
        merge(args.merge, args.out / "mixed-latency.json")
        return
    args.shape = perf_models.shape_for(args)
    args.capsteer_flags = args.capsteer_flags.split()
    args.work.mkdir(parents=True, exist_ok=True)
    model = perf_models.write_model(args.work / f"model-{args.shape}", args.shape, args.device)
    print(perf_models.describe(args.shape), flush=True)
    processes: list[dict] = []
    out = args.out / "mixed-latency.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    args.device_name = device_name(args.device)
    print(f"{'process':<22}" + "".join(f"{h:>9}" for h in HEADS) + f"{'burst s':>9}"
          "   (seconds, tpot ms; q: quiet phase; p: the burst phase, every plain request; b: those "
          f"overlapping a burst; tpot: time per output token; s: burst-phase requests started "
          f"{SETTLED_S:.0f} s or more after the latest burst's start)", flush=True)
    for r in range(args.rounds):
        flip = args.capsteer_first != (args.alternate and r % 2 == 1)
        for config in reversed(CONFIGS) if flip else CONFIGS:
            if args.deadline and time.time() > args.deadline:
                print(f"--deadline: not starting {config} round {r + 1}", flush=True)
                break
            spy = (args.out / f"spy-{config}-r{r + 1}.txt" if args.pyspy_s or args.attach
                   else None)
            got = run_process(config, model, args, args.work, spy)
            got["round"] = r + 1
            processes.append(got)
            print_process(f"{config} round {r + 1}", got["figures"])
            if got.get("probe"):
                print(PROBE_HEAD, flush=True)
                for w in got["probe"]:
                    print(probe_line(w), flush=True)
                print_step_times(got, args.clients)
            out.write_text(json.dumps(report(args, processes), indent=1))  # survives a timeout
        pair = [p for p in processes if p["round"] == r + 1]
        if args.profile_s:
            import step_profile

            print_round_comparison(pair, "step_profile", step_profile.compare_lines,
                                   "  profiled steps, vanilla/capsteer:")
        if args.pyspy_s:
            import pyspy_native

            print_round_comparison(pair, "pyspy", pyspy_native.compare_lines)
    result = report(args, processes)
    out.write_text(json.dumps(result, indent=1))
    print_ratios(result)


def print_step_times(got: dict[str, Any], clients: int) -> None:
    """A probed process's traced steps: each window's decode-only steps at the clients' full
    batch and one short of it; outside bursts, the steps that carried a prompt chunk, all
    together and then by phase; and each window's kernel time and faults per step."""
    sizes = [str(clients), str(clients - 1)]
    print(f"    decode-only steps, median ms (n) at {' and '.join(sizes)} requests: " + "; ".join(
        f"{w['window']} " + " ".join(
            f"{d['median_ms']:.2f}({d['n']})" if (d := w["decode_steps"].get(k)) else "-"
            for k in sizes) for w in got["probe"]), flush=True)
    print("    steps with a prompt chunk outside bursts, median ms (n) by tokens, then CPU ms"
          " in the step, execute_model ms and its CPU ms (- where the model runner has a "
          "process of its own, as on CPU), then means of the step thread's kernel CPU ms, "
          "minor page faults and involuntary context switches in the step: "
          + chunk_cells(got["chunk_steps"]), flush=True)
    for phase, cells in (got.get("chunk_steps_by_phase") or {}).items():
        if cells:
            print(f"      {phase} windows only: {chunk_cells(cells)}", flush=True)
    usage = [(w["window"], u) for w in got["probe"] if (u := w.get("step_usage", {})).get("n")]
    if usage:
        print("    every step, by window: mean kernel CPU ms, minor faults, steps that "
              "faulted / steps: " + "; ".join(
                  f"{name} {u['sys_mean_ms']:.3f} {u['minflt_mean']:.1f} "
                  f"{u['faulting_steps']}/{u['n']}" for name, u in usage), flush=True)


def chunk_cells(cells: dict[str, Any]) -> str:
    """chunk_steps' bins on one line."""
    return "; ".join(
        f"{k} {v['median_ms']:.2f}({v['n']}) cpu {v['cpu_median_ms']:.2f} fwd "
        + (f"{v['forward_median_ms']:.2f} cpu {v['forward_cpu_median_ms']:.2f}"
           if v["forward_median_ms"] else "- cpu -")
        + (f" sys {v['sys_mean_ms']:.3f} minflt {v['minflt_mean']:.1f} nivcsw "
           f"{v['nivcsw_mean']:.2f}" if "sys_mean_ms" in v else "")
        for k, v in cells.items())


def print_round_comparison(pair: list[dict[str, Any]], key: str, compare_lines: Any,
                           heading: str | None = None) -> None:
    """A round's two summaries under `key` (a step profile, py-spy samples), compared by
    `compare_lines(vanilla's, capsteer's, names)`; nothing unless both processes have one."""
    got = {p["config"]: p[key] for p in pair if p.get(key)}
    if len(got) == 2:
        if heading:
            print(heading, flush=True)
        for line in compare_lines(got["vanilla"], got["capsteer"], ("vanilla", "capsteer")):
            print(line, flush=True)


def print_ratios(result: dict) -> None:
    for name, ratios in result["ratios"].items():
        print(f"capsteer / vanilla, {name}: " + ", ".join(
            f"{k} {v:.3f}" for k, v in ratios.items() if v is not None), flush=True)


def merge(files: list[Path], out: Path) -> None:
    """Rounds run in separate calls (a GPU call has a time limit) judged as one run."""
    runs = [json.loads(gzip.decompress(f.read_bytes()) if f.suffix == ".gz" else f.read_text())
            for f in files]  # results/ keeps them gzipped
    first = runs[0]
    for f, run in zip(files, runs, strict=True):
        if (run["shape"], run["workload"], run["capsteer_flags"]) != (
                first["shape"], first["workload"], first["capsteer_flags"]):
            raise SystemExit(f"{f}: another shape, workload or flags than {files[0]}")
    processes, offset = [], 0
    for run in runs:
        for p in run["processes"]:
            processes.append({**p, "round": offset + p["round"],  # figures of this code
                              "figures": figures(p["plain"], p["bursts"]),
                              **({"host_loop_ms": host_loop_ms(p["probe"])}
                                 if "probe" in p else {})})
        offset += max((p["round"] for p in run["processes"]), default=0)
    args = argparse.Namespace(device_name=first["device"], shape=first["shape"],
                              capsteer_flags=first["capsteer_flags"], **first["workload"])
    result = report(args, processes)
    result["command"] = "; ".join(run["command"] for run in runs)
    result["merged_from"] = [str(f) for f in files]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    for p in processes:
        print_process(f"{p['config']} round {p['round']}", p["figures"])
    print_ratios(result)


def report(args: argparse.Namespace, processes: list[dict]) -> dict:
    """Per-process figures, and capsteer / vanilla ratios by round and over medians."""
    ratios: dict[str, dict[str, float | None]] = {}

    def ratio(cap: dict, van: dict) -> dict[str, float | None]:
        got: dict[str, float | None] = {}
        for g, k in KEYS:
            a, b = cap.get(g, {}).get(k), van.get(g, {}).get(k)
            got[f"{g}_{k}"] = a / b if a is not None and b else None
        a, b = cap["burst_median_s"], van["burst_median_s"]
        got["burst_median_s"] = a / b if a is not None and b else None
        return got

    by_round: dict[int, dict[str, dict]] = {}
    for p in processes:
        by_round.setdefault(p["round"], {})[p["config"]] = p
    paired = {r for r, both in by_round.items() if set(both) == set(CONFIGS)}
    for r in sorted(paired):
        cap, van = by_round[r]["capsteer"], by_round[r]["vanilla"]
        ratios[f"round {r}"] = ratio(cap["figures"], van["figures"])
        if "probe" in cap and "probe" in van:
            ratios[f"round {r}"].update(host_ratios(cap, van))
    medians = {}
    for config in CONFIGS:  # rounds with both configurations only (a deadline can cut one)
        fs = [p["figures"] for p in processes if p["config"] == config and p["round"] in paired]
        if not fs:
            continue
        med: dict[str, Any] = {g: {} for g, _k in KEYS}
        for g, k in KEYS:
            vals = [f[g][k] for f in fs if k in f.get(g, {})]
            med[g][k] = statistics.median(vals) if vals else None
        bs = [f["burst_median_s"] for f in fs if f["burst_median_s"] is not None]
        med["burst_median_s"] = statistics.median(bs) if bs else None
        medians[config] = med
    if set(medians) == set(CONFIGS):
        ratios["medians of processes"] = ratio(medians["capsteer"], medians["vanilla"])
    return {"date": dt.date.today().isoformat(), "command": " ".join(sys.argv),
            "device": args.device_name,
            "shape": args.shape, "workload": {k: getattr(args, k, None) for k in (
                "clients", "prompt", "gen", "quiet_s", "bursts", "burst_every",
                "burst_requests", "burst_prompt", "max_num_batched_tokens", "burst_priority")},
            "capsteer_flags": args.capsteer_flags, "processes": processes,
            "medians": medians, "ratios": ratios}


if __name__ == "__main__":
    main()
