"""Plain requests' latency beside capture bursts, through the real server (issue 12).

Each process is one server, `capsteer serve --vanilla` (stock vLLM) or capsteer, interleaved
over rounds. After a warm-up: quiet (closed-loop clients stream completions), then bursts
(the clients go on while --burst-requests one-token requests start every --burst-every s; in
capsteer each captures resid_post at every layer over the prompt, durable, with
`capture_wait`: P6's shape). Plain requests are grouped: quiet, bursts (the whole phase) and
beside (overlapping a burst); per group the median and p95 of TTFT and latency, each burst's
time, capsteer / vanilla ratios per round and over the medians (above 1 = slower), TTFT and
TPOT by start after a burst. Captures are deleted only between phases. Writes
<out>/mixed-latency.json (every request's times). CPU runs are a smoke test only: on 2
cores vLLM's processes busy-wait, so streamed tokens arrive late and together.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import gzip
import json
import random
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))  # run as `python bench/mixed_latency.py`
import perf_models

from capsteer.server.process import ManagedServer, free_port

CONFIGS = ("vanilla", "capsteer")


def server_argv(config: str, model: Path, shape: str, args: argparse.Namespace, port: int,
                capture_dir: Path) -> list[str]:
    """The same engine flags for both configurations; capsteer adds its capture root."""
    max_len = max(args.prompt + args.gen, args.burst_prompt + 1) + 16
    argv = [sys.executable, "-m", "capsteer.cli", "serve", str(model), "--host", "127.0.0.1",
            "--port", str(port), *perf_models.serve_flags(shape), "--max-model-len", str(max_len),
            "--seed", "0", "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--gpu-memory-utilization", str(perf_models.MEM[args.device])]
    if args.burst_priority is not None:  # vLLM's own policy, in both configurations
        argv += ["--scheduling-policy", "priority"]
    if config == "vanilla":
        return [*argv, "--vanilla"]
    # The staging buffer holds a whole step of burst prompts at every layer (default: 4 a token).
    staging = args.max_num_batched_tokens * perf_models.SHAPES[shape].layers
    return [*argv, "--capture-dir", str(capture_dir), "--capture-staging-rows", str(staging),
            *args.capsteer_flags]


class Traffic:
    """One server's plain clients and bursts; every request's times, from one clock."""

    def __init__(self, url: str, model: str, args: argparse.Namespace, capture: bool,
                 capture_dir: Path) -> None:
        import httpx
        from openai import AsyncOpenAI

        # No retries (they would hide latency), so idle pooled connections go before the
        # server's 5 s keep-alive closes them: reusing one then fails (httpx.ReadError on GPU).
        http = httpx.AsyncClient(timeout=900, limits=httpx.Limits(
            max_connections=None, max_keepalive_connections=None, keepalive_expiry=2.0))
        self.client = AsyncOpenAI(base_url=url + "/v1", api_key="none", timeout=900,
                                  max_retries=0, http_client=http)
        self.model, self.args, self.capture, self.capture_dir = model, args, capture, capture_dir
        self.rng, self.t0 = random.Random(7), time.monotonic()
        self.plain: list[dict[str, Any]] = []
        self.bursts: list[dict[str, Any]] = []

    def now(self) -> float:
        return time.monotonic() - self.t0

    def prompt(self, n: int) -> list[int]:
        """Fresh token ids every request: a repeated prompt would hit the prefix cache."""
        return [self.rng.randrange(10, 500) for _ in range(n)]

    async def one_plain(self, phase: str) -> None:
        start, first, chunks = self.now(), None, 0
        stream = await self.client.completions.create(
            model=self.model, prompt=self.prompt(self.args.prompt), max_tokens=self.args.gen,
            temperature=0.0, stream=True, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text is not None:
                chunks, first = chunks + 1, first if first is not None else self.now()
        self.plain.append({"phase": phase, "start": start, "first": first, "end": self.now(),
                           "chunks": chunks})

    async def clients(self, phase: str, until: asyncio.Event) -> None:
        async def loop() -> None:
            while not until.is_set():
                await self.one_plain(phase)
        await asyncio.gather(*(loop() for _ in range(self.args.clients)))

    async def burst(self, record: bool = True) -> dict[str, Any]:
        extra: dict[str, Any] = {"ignore_eos": True, **({"capture": {
            "hooks": ["resid_post"], "layers": "all", "positions": "prompt", "layout": "packed"},
            "capture_wait": True} if self.capture else {})}
        if self.args.burst_priority is not None:  # plain requests keep vLLM's default, 0
            extra["priority"] = self.args.burst_priority
        start = self.now()

        async def one() -> str:
            r = await self.client.completions.create(
                model=self.model, prompt=self.prompt(self.args.burst_prompt), max_tokens=1,
                temperature=0.0, extra_body=extra)
            got = (r.model_extra or {}).get("capture_results") or {}
            return str(got.get("status")) if self.capture else "none"

        statuses = await asyncio.gather(*(one() for _ in range(self.args.burst_requests)))
        out = {"start": start, "end": self.now(), "statuses": statuses, "seconds": self.now() - start}
        if self.capture and any(s != "ok" for s in statuses):
            raise RuntimeError(f"capture burst: receipts {sorted(set(statuses))}")
        if record:
            self.bursts.append(out)
        return out

    def clear_captures(self) -> None:
        """Published captures deleted, only while no request is timed (the disk is shared)."""
        for child in self.capture_dir.iterdir():
            shutil.rmtree(child, ignore_errors=True)

    async def run(self) -> None:
        a = self.args
        # Warm-up (untimed): a burst (where bursts are timed; without bursts no capture runs,
        # so a flag shrinking capture buffers can be tried) and a round of plain requests.
        if a.bursts:
            await self.burst(record=False)
        await asyncio.gather(*(self.one_plain("warm-up") for _ in range(a.clients)))
        self.clear_captures()
        quiet_done, bursts_done = asyncio.Event(), asyncio.Event()
        quiet = asyncio.create_task(self.clients("quiet", quiet_done))
        await asyncio.sleep(a.quiet_s)
        quiet_done.set()
        await quiet
        beside = asyncio.create_task(self.clients("bursts", bursts_done))
        for i in range(a.bursts):
            started = self.now()
            await self.burst()
            if i + 1 < a.bursts:  # until the next burst starts
                await asyncio.sleep(max(0.0, a.burst_every - (self.now() - started)))
        bursts_done.set()
        await beside
        await self.client.close()
        self.clear_captures()


def group(plain: list[dict], bursts: list[dict]) -> dict[str, list[dict]]:
    """quiet, bursts (the whole burst phase) and beside (those overlapping a burst)."""
    return {"quiet": [r for r in plain if r["phase"] == "quiet"],
            "bursts": [r for r in plain if r["phase"] == "bursts"],
            "beside": [r for r in plain if r["phase"] == "bursts" and any(
                r["start"] < b["end"] and r["end"] > b["start"] for b in bursts)]}


def p95(xs: list[float]) -> float:
    return sorted(xs)[min(len(xs) - 1, round(0.95 * (len(xs) - 1)))]


SETTLED_S = 4.0  # a burst is past its prefill by then: what it leaves behind, for decodes


def since_burst(r: dict, bursts: list[dict]) -> float | None:
    """Seconds from the latest burst start before request `r` started (None: before any)."""
    since = [r["start"] - b["start"] for b in bursts if r["start"] >= b["start"]]
    return min(since) if since else None


def tpot_s(r: dict) -> float | None:
    """Seconds per streamed token after the first: the decode steps a request saw."""
    return None if r["first"] is None or r["chunks"] < 2 else \
        (r["end"] - r["first"]) / (r["chunks"] - 1)


def by_offset(plain: list[dict], bursts: list[dict], tpot: bool) -> dict[str, float]:
    """Medians by start after the latest burst's: TTFT (0.5 s bins) or TPOT (2 s, and quiet)."""
    width = 2.0 if tpot else 0.5
    bins: dict[float, list[float]] = {}
    for r in plain:
        t = tpot_s(r) if tpot else None if r["first"] is None else r["first"] - r["start"]
        since = since_burst(r, bursts) if r["phase"] == "bursts" else None
        if t is not None and (since is not None or (tpot and r["phase"] == "quiet")):
            bins.setdefault(-1.0 if since is None else since // width * width, []).append(t)
    return {"quiet" if k < 0 else f"{k:.0f}" if tpot else f"{k:.1f}": statistics.median(v)
            for k, v in sorted(bins.items())}


def figures(plain: list[dict], bursts: list[dict]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, rs in group(plain, bursts).items():
        out[name] = {"n": len(rs)}
        for what, xs in (("ttft", [r["first"] - r["start"] for r in rs if r["first"] is not None]),
                         ("latency", [r["end"] - r["start"] for r in rs])):
            if xs:
                out[name].update({f"{what}_median_s": statistics.median(xs), f"{what}_p95_s": p95(xs)})
    if tpot := [t for r in plain if r["phase"] == "quiet" and (t := tpot_s(r)) is not None]:
        out["quiet"]["tpot_median_s"] = statistics.median(tpot)
    settled = [t for r in plain if r["phase"] == "bursts" and (t := tpot_s(r)) is not None
               and (since := since_burst(r, bursts)) is not None and since >= SETTLED_S]
    out["settled"] = {"n": len(settled)}
    if settled:
        out["settled"]["tpot_median_s"] = statistics.median(settled)
    secs = [b["seconds"] for b in bursts]
    return out | {"ttft_by_offset": by_offset(plain, bursts, False), "burst_s": secs,
                  "tpot_by_offset": by_offset(plain, bursts, True),
                  "burst_median_s": statistics.median(secs) if secs else None}


def run_process(config: str, model: Path, args: argparse.Namespace, work: Path) -> dict:
    capture_dir = perf_models.fresh_dir(work / "captures")
    port = free_port()
    # cwd: not the checkout, whose capsteer/ folder would shadow the installed package
    server = ManagedServer(server_argv(config, model, args.shape, args, port, capture_dir),
                           url=f"http://127.0.0.1:{port}", log_path=work / f"serve-{config}.log",
                           cwd=work, start_timeout_s=args.start_timeout, stop_timeout_s=90)
    try:
        traffic = Traffic(server.url, str(model), args, config == "capsteer", capture_dir)
        asyncio.run(traffic.run())
    except BaseException:
        print(server.log_text()[-4000:], file=sys.stderr)
        raise
    finally:
        server.close()
        shutil.rmtree(capture_dir, ignore_errors=True)
    return {"config": config, "startup_s": server.ready_s, "plain": traffic.plain,
            "bursts": traffic.bursts, "figures": figures(traffic.plain, traffic.bursts)}


KEYS = [("quiet", "ttft_median_s"), ("quiet", "latency_median_s"), ("quiet", "tpot_median_s"),
        ("bursts", "ttft_median_s"), ("bursts", "ttft_p95_s"), ("bursts", "latency_median_s"),
        ("bursts", "latency_p95_s"), ("beside", "latency_median_s"), ("beside", "latency_p95_s"),
        ("settled", "tpot_median_s")]
HEADS = ["q ttft", "q lat", "q tpot", "p ttft", "p ttft95", "p lat", "p lat95", "b lat",
         "b lat95", "s tpot"]


def print_process(label: str, f: dict) -> None:
    """A process's figures (seconds, TPOT in ms); TTFT and TPOT by start after a burst's."""
    cells = [f"{f.get(g, {}).get(k, float('nan')) * (1000 if k.startswith('tpot') else 1):9.3f}"
             for g, k in KEYS]
    burst = f["burst_median_s"]
    print(f"{label:<22}" + "".join(cells) + f"{burst if burst is not None else float('nan'):9.3f}"
          f"   n quiet {f['quiet']['n']}, burst phase {f['bursts']['n']}, beside "
          f"{f['beside']['n']}\n    TTFT ms by start after a burst's (s): " + " ".join(
              f"{k}:{v * 1000:.0f}" for k, v in list((f.get("ttft_by_offset") or {}).items())[:12])
          + "\n    TPOT ms, quiet and by start after a burst's (s): " + " ".join(
              f"{k}:{v * 1000:.2f}" for k, v in (f.get("tpot_by_offset") or {}).items()), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--shape", choices=sorted(perf_models.SHAPES), default=None,
                    help="a perf_models.py geometry (default llama3-8b-36l, llama-tiny on cpu)")
    # --rounds: processes per configuration; --clients: closed-loop plain clients, sending
    # --prompt tokens and generating --gen; --burst-every: seconds between burst starts
    for name, default in (("--rounds", 2), ("--clients", 8), ("--prompt", 256), ("--gen", 64),
                          ("--quiet-s", 20.0), ("--bursts", 3), ("--burst-every", 12.0),
                          ("--burst-requests", 103), ("--burst-prompt", 128),
                          ("--max-num-batched-tokens", 2048), ("--start-timeout", 600.0)):
        ap.add_argument(name, type=type(default), default=default)
    ap.add_argument("--capsteer-flags", default="", help="more capsteer serve flags, one string")
    ap.add_argument("--burst-priority", type=int, default=None, help="both servers with vLLM's "
                    "priority scheduling, bursts at this priority (plain: 0, served first)")
    ap.add_argument("--capsteer-first", action="store_true",
                    help="capsteer's process first in each round (a control for the order)")
    ap.add_argument("--alternate", action="store_true",
                    help="the order reversed every other round (a control for the order)")
    ap.add_argument("--deadline", type=float, default=0.0,
                    help="epoch seconds: start no process after it")
    ap.add_argument("--work", type=Path, default=Path("/tmp/capsteer-mixed"))
    ap.add_argument("--out", type=Path, default=Path(perf_models.default_out()))
    ap.add_argument("--merge", type=Path, nargs="+", default=None, metavar="JSON", help="run "
                    "nothing: join these mixed-latency.json (.gz) files, in run order, into --out")
    args = ap.parse_args()
    if args.merge:
        merge(args.merge, args.out / "mixed-latency.json")
        return
    args.shape = args.shape or ("llama3-8b-36l" if args.device == "cuda" else "llama-tiny")
    args.capsteer_flags = args.capsteer_flags.split()
    args.work.mkdir(parents=True, exist_ok=True)
    model = perf_models.write_model(args.work / f"model-{args.shape}", args.shape, args.device)
    print(perf_models.describe(args.shape), flush=True)
    processes: list[dict] = []
    out, args.device_name = args.out / "mixed-latency.json", perf_models.device_name(args.device)
    out.parent.mkdir(parents=True, exist_ok=True)
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
            got = run_process(config, model, args, args.work) | {"round": r + 1}
            processes.append(got)
            print_process(f"{config} round {r + 1}", got["figures"])
            out.write_text(json.dumps(report(args, processes), indent=1))  # survives a timeout
    result = report(args, processes)
    out.write_text(json.dumps(result, indent=1))
    print_ratios(result)


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
        if any(run[k] != first[k] for k in ("shape", "workload", "capsteer_flags")):
            raise SystemExit(f"{f}: another shape, workload or flags than {files[0]}")
    processes, offset = [], 0
    for run in runs:  # rounds renumbered; figures of this code
        processes += [{**p, "round": offset + p["round"], "figures": figures(p["plain"], p["bursts"])}
                      for p in run["processes"]]
        offset += max((p["round"] for p in run["processes"]), default=0)
    args = argparse.Namespace(device_name=first["device"], shape=first["shape"],
                              capsteer_flags=first["capsteer_flags"], **first["workload"])
    result = report(args, processes) | {"command": "; ".join(run["command"] for run in runs),
                                        "merged_from": [str(f) for f in files]}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    for p in processes:
        print_process(f"{p['config']} round {p['round']}", p["figures"])
    print_ratios(result)


def report(args: argparse.Namespace, processes: list[dict]) -> dict:
    """Per-process figures, and capsteer / vanilla ratios by round and over medians."""
    ratios: dict[str, dict[str, float | None]] = {}

    def ratio(cap: dict, van: dict) -> dict[str, float | None]:
        pairs = [(f"{g}_{k}", cap.get(g, {}).get(k), van.get(g, {}).get(k)) for g, k in KEYS]
        pairs.append(("burst_median_s", cap["burst_median_s"], van["burst_median_s"]))
        return {name: a / b if a is not None and b else None for name, a, b in pairs}

    by_round: dict[int, dict[str, dict]] = {}
    for p in processes:
        by_round.setdefault(p["round"], {})[p["config"]] = p
    paired = {r for r, both in by_round.items() if set(both) == set(CONFIGS)}
    for r in sorted(paired):
        ratios[f"round {r}"] = ratio(by_round[r]["capsteer"]["figures"], by_round[r]["vanilla"]["figures"])
    medians = {}
    for config in CONFIGS:  # rounds with both configurations only (a deadline can cut one)
        fs = [p["figures"] for p in processes if p["config"] == config and p["round"] in paired]
        if not fs:
            continue
        med: dict[str, Any] = {g: {} for g, _k in KEYS}
        for g, k in [*KEYS, (None, "burst_median_s")]:
            vals = [x for f in fs if (x := (f.get(g, {}) if g else f).get(k)) is not None]
            (med[g] if g else med)[k] = statistics.median(vals) if vals else None
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
