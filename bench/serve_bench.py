"""The serve path against stock `vllm serve`, measured with vLLM's own client (issue 63).

Per shape and round: `capsteer serve --vanilla` (stock vLLM, the same flags) and `capsteer
serve` one after the other (the order flips every round), each driven by `vllm bench serve`
(random dataset, streamed completions, fresh prompts per case, `--extra-body` for capsteer's
fields). After an untimed warm-up, the cases (vanilla runs plain and short):

  plain         no fields
  short         prompt 16, max_tokens 1, high concurrency: the API path's own cost (req/s)
  steer_all     every layer steered by a named per-layer vector (PUT once per server)
  distinct_N    N = 1, 32, 256 configs: request i carries inline vector i mod N on every layer
  capture       one layer (resid_post, the middle one), every position
  capture_wait  the same, each response held until its capture is durable
  readout_probe / readout_sae16k   a probe / a 16k-feature TopK SAE read at that layer,
                every token, streamed; steer_conditional  steer_all gated by the probe

distinct_N runs `vllm.benchmarks.serve.benchmark` with each sample's `request_overrides`
(capsteer's steering table sized for N specs of every layer; a case where a request ran
unsteered has no figure). Ratios: each capsteer case over vanilla's plain (short over
short) of its shape and round; distinct_256 over distinct_1; median over rounds, spread
min-max, worst shape. Commands: bench/README.md. Writes <out>/raw/*.json, serve-bench.json
and its PNG (`--summary`: the serve_* keys into summary.json).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import datetime as dt
import io
import json
import random
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))  # run as `python bench/serve_bench.py`
import perf_models
import summary as summary_file

from capsteer.server.process import ManagedServer, free_port

CONFIGS = ("vanilla", "capsteer")
VECTOR_NAME = "serve-bench"
DISTINCT = (1, 32, 256)
REFUSED = "capsteer_steering_refused_total"
STEER_SCALE = 0.5
VECTOR_STD = 0.05  # small: a random-weight model keeps finite activations when steered
CASE_NAMES = ("plain", "short", "steer_all", *(f"distinct_{n}" for n in DISTINCT),
              "capture", "capture_wait", "readout_probe", "readout_sae16k", "steer_conditional")
METRICS = ("completed", "failed", "duration", "request_throughput", "output_throughput",
           "total_token_throughput", "max_concurrent_requests",
           *(f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "p50", "p99")))
LATENCIES = tuple(f"{p}_{m}_ms" for m in ("ttft", "tpot", "itl") for p in ("p50", "p99"))
# key -> (ratio row, column) of the summary's serve_* keys; targets: summary.SERVE_TARGETS
KEYS = {"serve_plain": ("plain", "throughput"), "serve_steer_all": ("steer_all", "throughput"),
        "serve_distinct_256": ("distinct_256/distinct_1", "throughput"),
        "serve_capture_one_layer": ("capture", "throughput"),
        "serve_capture_one_layer_wait": ("capture_wait", "throughput"),
        "serve_short_rps": ("short", "throughput"),
        "serve_ttft_p99_plain": ("plain", "p99_ttft_ms"),
        "serve_tpot_p99_plain": ("plain", "p99_tpot_ms"),
        **{k: (k, "throughput") for k in ("readout_probe", "readout_sae16k", "steer_conditional")}}
MIN_ROUNDS = 3  # fewer interleaved starts than this: every verdict stays unresolved


@dataclass(frozen=True)
class Case:
    """One `vllm bench serve` run against one server."""

    name: str
    workload: str  # "long" | "short" | "warm-up"
    body: dict[str, Any] | None = None  # --extra-body: capsteer's fields
    distinct: int = 0  # > 0: request i steered by inline vector i mod `distinct`
    capture: bool = False


def cases(config: str, layers: int, chosen: tuple[str, ...]) -> list[Case]:
    """The warm-up and the cases a configuration runs, in CASE_NAMES order."""
    steer = {"steering": {"vectors": [{"hook": "resid_post", "vector": {"name": VECTOR_NAME},
                                       "scale": STEER_SCALE}]}}
    cap = {"capture": {"hooks": ["resid_post"], "layers": [layers // 2], "positions": "all"}}
    read = {"hook": "resid_post", "layer": layers // 2}  # a probe / a 16k TopK SAE, every token
    when = {"when": {"reader": {"name": perf_models.PROBE}, "index": 0, "above": 0.0}}
    every = [Case("plain", "long"), Case("short", "short"), Case("steer_all", "long", steer),
             *(Case(f"distinct_{n}", "long", distinct=n) for n in DISTINCT),
             Case("capture", "long", cap, capture=True),
             Case("capture_wait", "long", {**cap, "capture_wait": True}, capture=True),
             Case("readout_probe", "long", {"readout": [{"reader": {"name": perf_models.PROBE}, **read}]}),
             Case("readout_sae16k", "long", {"readout": [{"reader": {"name": perf_models.SAE16K},
                                                          "top_k": 16, **read}]}),
             Case("steer_conditional", "long", {"steering": {"vectors": [
                 {**steer["steering"]["vectors"][0], **when}]}})]
    own = ("plain", "short") if config == "vanilla" else CASE_NAMES
    return [Case("warm-up", "warm-up"), *(c for c in every if c.name in own and c.name in chosen)]


def bench_argv(case: Case, a: argparse.Namespace, url: str, model: str, result_dir: Path) -> list[str]:
    """`vllm bench serve`'s arguments for a case (the same for both configurations)."""
    prompt, out, n, conc = {
        "long": (a.prompt, a.output_len, a.num_prompts, a.concurrency),
        "short": (16, 1, a.short_prompts, a.short_concurrency),
        "warm-up": (a.prompt, 16, a.concurrency, a.concurrency)}[case.workload]
    seed = a.seed + 1 + (CASE_NAMES.index(case.name) if case.name in CASE_NAMES else 100)
    argv = ["--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
            "--model", model, "--tokenizer", model, "--dataset-name", "random",
            "--random-input-len", str(prompt), "--random-output-len", str(out),
            "--num-prompts", str(n), "--max-concurrency", str(conc), "--request-rate", "inf",
            "--temperature", "0", "--ignore-eos", "--seed", str(seed),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--disable-tqdm", "--save-result", "--result-dir", str(result_dir),
            "--result-filename", f"{case.name}.json", "--label", case.name]
    argv += ["--served-model-name", a.served_model_name] if a.served_model_name else []
    return argv + (["--extra-body", json.dumps(case.body)] if case.body is not None else [])


def client_main(plan_path: Path) -> None:
    """A plan's cases one after another (vLLM imported once), each result appended to the
    plan's `results` file as soon as it is in."""
    # vLLM's client: only this child process imports vLLM (the parent starts servers)
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    plan = json.loads(plan_path.read_text())
    for job in plan["jobs"]:
        parser = FlexibleArgumentParser()
        add_cli_args(parser)
        args = parser.parse_args(job["argv"])
        before = capsteer_counts(plan["url"]) if plan["capsteer"] else {}
        cpu0 = process_cpu(plan.get("server_pid"))
        spies = start_spies(plan, Path(args.result_dir), job["case"])
        t0 = time.monotonic()
        # vLLM prints its arguments and report per case: into the case's log, not the call's
        with open(Path(args.result_dir) / f"{job['case']}.log", "w") as log, \
                contextlib.redirect_stdout(log):
            result = distinct_run(args, job["distinct"], plan["hidden"]) if job["distinct"] \
                else main(args)
        wall, counts = time.monotonic() - t0, {}
        cpu1 = process_cpu(plan.get("server_pid"))
        for spy in spies:  # py-spy writes its profile on SIGINT
            spy.send_signal(signal.SIGINT)
            spy.wait(60)
        cpu = {role: cpu1[role] - cpu0.get(role, 0.0) for role in cpu1}
        if plan["capsteer"]:
            deadline = time.monotonic() + 180  # captures still in flight belong to this case
            while job["capture"] and time.monotonic() < deadline and capsteer_counts(
                    plan["url"]).get("capsteer_capture_inflight_bytes", 0.0) != 0.0:
                time.sleep(0.5)
            after = capsteer_counts(plan["url"])
            counts = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        if job["capture"] and plan.get("capture_dir"):  # published captures off the disk
            for child in Path(plan["capture_dir"]).glob("*"):
                shutil.rmtree(child, ignore_errors=True)
        row = {"case": job["case"], "wall_s": wall, "client": job["client"],
               "capsteer_counts": counts, "cpu_s": cpu, **{k: result.get(k) for k in METRICS}}
        with open(plan["results"], "a") as fh:
            fh.write(json.dumps(row) + "\n")
        print(f"  {job['case']:<14} {row['output_throughput'] or 0:10.1f} tok/s "
              f"{row['request_throughput'] or 0:8.2f} req/s  {wall:6.1f} s  busy cores: "
              + " ".join(f"{role} {cpu[role] / wall:.2f}" for role in sorted(cpu)), flush=True)


def start_spies(plan: dict[str, Any], out: Path, case: str) -> list[subprocess.Popen]:
    """--py-spy: sample the server's API, engine core and worker for the case, each into
    <case>-<role>.txt (py-spy's raw folded stacks with thread names)."""
    roles = process_cpu(plan.get("server_pid"), pids=True) if plan.get("py_spy") else {}
    return [subprocess.Popen([plan["py_spy"], "record", "--pid", str(pid), "--rate", "100",
                              "--format", "raw", "--threads", "--nonblocking", "--output",
                              str(out / f"{case}-{role}.txt")], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
            for role, pid in roles.items() if role in ("api", "engine_core", "worker")]


def process_cpu(root_pid: int | None, pids: bool = False) -> dict[str, Any]:
    """CPU seconds so far of the server's processes by role, from /proc: where a case's host
    time goes, and whether one (the API server's event loop) is saturated (busy near 1.0).
    `pids`: each role's first process id instead."""
    procs = {}  # pid -> (parent, name, cpu seconds, command line)
    for stat in Path("/proc").glob("[0-9]*/stat") if root_pid else ():
        with contextlib.suppress(OSError):
            name, _, rest = stat.read_text().partition("(")[2].rpartition(")")
            f = rest.split()
            procs[int(stat.parent.name)] = (int(f[1]), name, (int(f[11]) + int(f[12])) / 100,
                                            (stat.parent / "cmdline").read_bytes())
    tree, out = [root_pid] if root_pid in procs else [], {}
    for pid in tree:  # grows as children are found
        tree += [kid for kid, (parent, *_) in procs.items() if parent == pid]
        name = procs[pid][1]  # N API processes: "VLLM::APIServer_i"; writers: by command line
        role = "api" if pid == root_pid or "APIServer" in name else \
            "engine_core" if "EngineCor" in name else "worker" if "Worker" in name else \
            "writer" if b"capsteer.capture.writer.child" in procs[pid][3] else "other"
        out[role] = out.get(role, pid) if pids else out.get(role, 0.0) + procs[pid][2]
    return out


def distinct_run(args: argparse.Namespace, n: int, hidden: int) -> dict[str, Any]:
    """`vllm bench serve ARGS` with request i steered by inline vector i mod n on every layer
    (each sample's `request_overrides`, merged into its body by vLLM's `benchmark`)."""
    # vLLM's client: only this child process imports vLLM
    from vllm.benchmarks.datasets import get_samples
    from vllm.benchmarks.serve import TaskType, benchmark
    from vllm.tokenizers import get_tokenizer

    random.seed(args.seed)
    np.random.seed(args.seed)
    tokenizer = get_tokenizer(args.tokenizer or args.model, tokenizer_mode=args.tokenizer_mode,
                              trust_remote_code=args.trust_remote_code)
    samples = get_samples(args, tokenizer)
    rng = np.random.default_rng(args.seed)
    table = [base64.b64encode((rng.standard_normal(hidden) * VECTOR_STD).astype("<f4").tobytes())
             .decode() for _ in range(n)]
    for i, sample in enumerate(samples):
        sample.request_overrides = {"steering": {"vectors": [{
            "hook": "resid_post", "layers": "all", "scale": STEER_SCALE,
            "vector": {"b64": table[i % n], "dtype": "float32"}}]}}
    result = asyncio.run(benchmark(
        task_type=TaskType.GENERATION, endpoint_type=args.backend,
        api_url=args.base_url + args.endpoint, base_url=args.base_url, model_id=args.model,
        model_name=args.served_model_name, tokenizer=tokenizer, input_requests=samples,
        logprobs=args.logprobs, request_rate=args.request_rate, burstiness=args.burstiness,
        disable_tqdm=True, num_warmups=args.num_warmups, profile=False,
        selected_percentile_metrics=args.percentile_metrics.split(","),
        selected_percentiles=[float(p) for p in args.metric_percentiles.split(",")],
        ignore_eos=True, goodput_config_dict={}, max_concurrency=args.max_concurrency,
        lora_modules=None, extra_headers=None, extra_body={"temperature": args.temperature},
        ready_check_timeout_sec=args.ready_check_timeout_sec, self_timed=False))
    doc = {"date": dt.datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": args.backend,
           "label": args.label, "model_id": args.model, "num_prompts": args.num_prompts,
           "max_concurrency": args.max_concurrency, "distinct_configs": n,
           "client": "vllm.benchmarks.serve.benchmark, per-request request_overrides",
           "first_error": next((e for e in result.get("errors", []) if e), None),
           **{k: v for k, v in result.items() if k not in (
               "input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts",
               "errors")}}
    Path(args.result_dir, args.result_filename).write_text(json.dumps(doc))
    return doc


def capsteer_counts(url: str) -> dict[str, float]:
    """capsteer's counters on /metrics: captures by status, steered requests, bytes in flight."""
    names = ("capsteer_capture_requests_total", "capsteer_steering_requests_total",
             "capsteer_capture_inflight_bytes", REFUSED)
    lines = httpx.get(url + "/metrics", timeout=30).text.splitlines()
    return {line.rpartition(" ")[0].replace('"', ""): float(line.rpartition(" ")[2])
            for line in lines if line.startswith(names)}


def put_vector(url: str, layers: int, hidden: int, admin_key: str | None) -> None:
    """Register the named per-layer vector (one row per layer, .npy) that steer_all uses."""
    buf = io.BytesIO()
    np.save(buf, (np.random.default_rng(11).standard_normal((layers, hidden)) * VECTOR_STD)
            .astype(np.float32))
    httpx.put(f"{url}/v1/steering/vectors/{VECTOR_NAME}", content=buf.getvalue(),
              params={"format": "npy"}, headers={"X-Admin-Key": admin_key} if admin_key else {},
              timeout=60).raise_for_status()


def drive(config: str, url: str, model: str, a: argparse.Namespace, raw_dir: Path,
          tag: str, capture_dir: Path | None, server_pid: int | None = None) -> dict[str, Any]:
    """Every case of `config` against the server at `url`, in one client process."""
    layers = hidden = 0
    if config == "capsteer":
        geo = httpx.get(url + "/v1/capsteer/hooks", timeout=30).json()
        layers, hidden = int(geo["num_layers"]), int(geo["hidden_size"])
        if {"steer_all", "steer_conditional"} & set(a.cases):
            put_vector(url, layers, hidden, a.admin_key)
        if {"readout_probe", "readout_sae16k", "steer_conditional"} & set(a.cases):
            perf_models.put_readers(a.readers_dir or a.work / "readers", hidden)
    result_dir = raw_dir / tag
    shutil.rmtree(result_dir, ignore_errors=True)
    result_dir.mkdir(parents=True)
    jobs = [{"case": case.name, "argv": argv, "distinct": case.distinct, "capture": case.capture,
             "client": "vllm.benchmarks.serve.benchmark, per-request request_overrides"
             if case.distinct else "vllm bench serve " + " ".join(argv)}
            for case in cases(config, layers, a.cases)
            for argv in [bench_argv(case, a, url, model, result_dir)]]
    plan = {"url": url, "capsteer": config == "capsteer", "hidden": hidden, "jobs": jobs,
            "server_pid": server_pid, "py_spy": a.py_spy,
            "results": str(result_dir / "client.jsonl"),
            "capture_dir": str(capture_dir) if capture_dir else None}
    (result_dir / "plan.json").write_text(json.dumps(plan, indent=1))
    t0, results = time.monotonic(), Path(plan["results"])
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--client",
                           str(result_dir / "plan.json")], cwd=a.work, timeout=a.client_timeout)
    rows = [json.loads(x) for x in results.read_text().splitlines()] if results.exists() else []
    got = {r["case"]: r for r in rows if r["case"] != "warm-up"}
    # a case with a failed request has no figure (the summary would compare unlike work)
    failures = {name: f"{row['failed']} failed, {row['completed']} completed"
                for name, row in got.items() if row["failed"] or not row["completed"]}
    failures.update({name: f"{n:.0f} requests ran unsteered ({REFUSED})" for name, row
                     in got.items() if (n := row["capsteer_counts"].get(REFUSED, 0.0))})
    failures.update({job["case"]: f"client exited {proc.returncode} before it ran"
                     for job in jobs[1:] if job["case"] not in got and proc.returncode})
    for name, why in failures.items():
        print(f"{tag} {name}: NO FIGURE, {why} (see {result_dir})", flush=True)
    return {"config": config, "url": url, "client_s": time.monotonic() - t0,
            "layers": layers, "hidden": hidden, "failures": failures,
            "cases": {k: v for k, v in got.items() if k not in failures},
            "result_dir": str(result_dir)}


def server_argv(config: str, model: Path, shape: str, a: argparse.Namespace, port: int) -> list[str]:
    """The same engine flags for both; capsteer adds its directories, the same for every
    server (the capture root is in vLLM's compile-cache key)."""
    max_len = max(a.prompt + a.output_len, 17) + 32
    argv = [sys.executable, "-m", "capsteer.cli", "serve", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--seed", "0", "--max-num-seqs", str(a.max_num_seqs)]
    argv += ["--gpu-memory-utilization", str(a.gpu_memory_utilization)] if a.device == "cuda" \
        else ["--cpu-defaults"]
    argv += ["--max-model-len", str(max_len)]
    argv += perf_models.serve_flags(shape) if shape in perf_models.SHAPES else []
    argv += a.server_flags
    if config == "vanilla":
        return [*argv, "--vanilla"]
    specs = max(DISTINCT) * json.loads((model / "config.json").read_text())["num_hidden_layers"]
    return [*argv, "--capture-dir", str(a.work / "captures"), "--steering-dir",
            str(a.work / "vectors"), "--readers-dir", str(a.work / "readers"), "--admin-key",
            a.admin_key, "--additional-config", json.dumps({"capsteer": {  # + steer_all's...
                "max_steering_entries": specs + 1024}}), *a.capsteer_flags]


def model_for(shape: str, a: argparse.Namespace) -> Path:
    """`--model-dir`, else the shape written under --work (demo: capsteer's demo model)."""
    out = Path(a.model_dir) if a.model_dir else a.work / f"model-{shape}"
    if a.model_dir or shape != "demo":
        return out if a.model_dir else perf_models.write_model(out, shape, a.device)
    from capsteer.demo_model import write_demo_model  # only the CPU smoke run needs it

    if not (out / "config.json").is_file():
        write_demo_model(out, "qwen3", seed=7)
    return out


def run_managed(a: argparse.Namespace) -> None:
    """R rounds; in each, every shape's two servers, the order flipping by round."""
    raw = a.out / "raw"
    for r in range(a.round, a.round + a.rounds):
        for shape in a.shapes:
            model, order = model_for(shape, a), CONFIGS if r % 2 == 1 else CONFIGS[::-1]
            if a.deadline and time.time() + 2 * a.min_server_s > a.deadline:
                print(f"--deadline: not starting {shape} round {r} (no time for both servers)",
                      flush=True)
                continue
            for config in order:
                tag, port = f"r{r}-{shape}-{config}", free_port()
                for d in (a.work / tag, *(a.work / x for x in ("captures", "vectors", "readers"))):
                    shutil.rmtree(d, ignore_errors=True)
                    d.mkdir(parents=True)
                argv = server_argv(config, model, shape, a, port)
                print(f"{tag}: starting", flush=True)
                # cwd: not the checkout, whose capsteer/ folder would shadow the package
                try:
                    server = ManagedServer(argv, url=f"http://127.0.0.1:{port}",
                                           log_path=a.work / tag / "serve.log", cwd=a.work / tag,
                                           start_timeout_s=a.start_timeout, stop_timeout_s=90)
                except RuntimeError as exc:  # the other shape's servers may still start
                    print(f"{tag}: NO START\n{exc}", flush=True)
                    break
                try:
                    got = drive(config, server.url, str(model), a, raw, tag, a.work / "captures",
                                server.proc.pid)
                except BaseException:
                    print(server.log_tail(80), file=sys.stderr)
                    raise
                finally:
                    server.close()
                    shutil.rmtree(a.work / "captures", ignore_errors=True)
                if a.device == "cuda":
                    perf_models.wait_gpu_free(0.9)
                save_raw(raw, tag, r, shape, config, a, {**got, "ready_s": server.ready_s,
                                                         "server_argv": argv})
                summarize([a.out], a.out, a.device_name)  # survives a time limit


def save_raw(raw: Path, tag: str, r: int, shape: str, config: str, a: argparse.Namespace,
             got: dict[str, Any]) -> None:
    raw.mkdir(parents=True, exist_ok=True)
    (raw / f"{tag}.json").write_text(json.dumps({
        "kind": "serve-bench-raw", "round": r, "shape": shape, "config": config,
        "device": a.device_name, "date": dt.date.today().isoformat(),
        "command": " ".join(sys.argv), "workload": {k: getattr(a, k) for k in (
            "prompt", "output_len", "num_prompts", "concurrency", "short_prompts",
            "short_concurrency", "max_num_seqs")}, **got}, indent=1))


def spread(xs: list[float]) -> dict[str, float]:
    return {"value": statistics.median(xs), "lo": min(xs), "hi": max(xs)}


def verdict(lo: float, hi: float, target: str, rounds: int) -> str:
    """met / missed over every round's figure; unresolved across it or under MIN_ROUNDS."""
    op, t = target.split()
    if rounds < MIN_ROUNDS:
        return "unresolved"
    return perf_models.verdict(lo, hi, float(t)) if op == ">=" else \
        perf_models.verdict(-hi, -lo, -float(t))  # a ceiling: the sides swap


def case_ratios(cap: dict[str, Any], van: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Each capsteer case over its vanilla baseline (plain, or short for short): throughput
    (tokens/s, requests/s for short) and p50/p99 latencies; distinct_256 over distinct_1."""
    def ratio(a: dict, b: dict, short: bool) -> dict[str, float]:
        tput = "request_throughput" if short else "output_throughput"
        cols = {"throughput": tput, **{m: m for m in (("p50_ttft_ms", "p99_ttft_ms") if short
                                                     else LATENCIES)}}
        return {c: a[m] / b[m] for c, m in cols.items() if a.get(m) and b.get(m)}

    out = {name: ratio(row, van[base], name == "short") for name, row in cap.items()
           if (base := "short" if name == "short" else "plain") in van}
    for n in DISTINCT:
        for other in ("distinct_1", "steer_all"):
            if f"distinct_{n}" in cap and other in cap and other != f"distinct_{n}":
                out[f"distinct_{n}/{other}"] = ratio(cap[f"distinct_{n}"], cap[other], False)
    return out


def summarize(dirs: list[Path], out: Path, device: str | None = None) -> dict[str, Any]:
    """serve-bench.json (and its PNG) from every raw file under `dirs`: per-case medians
    and min-max over rounds, ratios paired by round, the serve_* keys."""
    raws = [json.loads(p.read_text()) for d in dirs for p in sorted((d / "raw").glob("*.json"))]
    shapes: dict[str, Any] = {}
    for shape in dict.fromkeys(r["shape"] for r in raws):
        by_round: dict[int, dict[str, dict]] = {}
        for r in (r for r in raws if r["shape"] == shape):
            by_round.setdefault(r["round"], {})[r["config"]] = r["cases"]
        paired = sorted(k for k, v in by_round.items() if set(v) == set(CONFIGS))
        per_case: dict[str, dict[str, Any]] = {}
        for config, name in ((c, n) for c in CONFIGS for n in CASE_NAMES):
            rows = [by_round[k][config][name] for k in sorted(by_round)
                    if name in by_round[k].get(config, {})]
            if rows:
                per_case[f"{config}/{name}"] = {m: spread([x[m] for x in rows]) for m in METRICS
                                                if all(x.get(m) is not None for x in rows)}
        ratios: dict[str, dict[str, Any]] = {}
        for k in paired:
            for row, cols in case_ratios(by_round[k]["capsteer"], by_round[k]["vanilla"]).items():
                for col, v in cols.items():
                    ratios.setdefault(row, {}).setdefault(col, {"by_round": []})["by_round"].append(v)
        for entry in (e for cols in ratios.values() for e in cols.values()):
            entry.update(spread(entry["by_round"]))
        shapes[shape] = {"rounds": paired, "cases": per_case, "ratios": ratios}
    keys: dict[str, Any] = {}
    for key, (row, col) in KEYS.items():
        target = summary_file.SERVE_TARGETS[key]
        per = {s: v["ratios"][row][col] | {"rounds": len(v["rounds"])} for s, v in shapes.items()
               if col in v["ratios"].get(row, {})}
        if not per:
            continue
        worst = min if target.startswith(">=") else max
        lo, hi = worst(p["lo"] for p in per.values()), worst(p["hi"] for p in per.values())
        n = min(p["rounds"] for p in per.values())
        keys[key] = {"value": worst(p["value"] for p in per.values()), "lo": lo, "hi": hi,
                     "target": float(target.split()[1]), "target_text": target,
                     "verdict": verdict(lo, hi, target, n), "rounds": n,
                     "method": f"paired by round; {row}, {col}; worst shape", "shapes": per}
        if key == "serve_distinct_256":  # the same requests against the named one-config run
            keys[key]["vs_steer_all"] = {s: v["ratios"].get("distinct_256/steer_all", {})
                                         .get(col) for s, v in shapes.items()}
    devices = sorted({r["device"] for r in raws})
    doc = {"kind": "serve-bench", "date": max((r["date"] for r in raws), default=None),
           "device": device or ", ".join(devices), "devices": devices,
           "command": "; ".join(dict.fromkeys(r["command"] for r in raws)),
           "workloads": {f"{r['shape']}": r["workload"] for r in raws},
           "failures": {f"r{r['round']}-{r['shape']}-{r['config']}": r["failures"]
                        for r in raws if r.get("failures")},
           "shapes": shapes, "keys": keys}
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve-bench.json").write_text(json.dumps(doc, indent=1))
    return doc


def print_report(doc: dict[str, Any]) -> None:
    for shape, s in doc["shapes"].items():
        print(f"{shape}, paired rounds {s['rounds']}: capsteer / baseline (median, min-max)\n"
              f"  {'case':<25}" + "".join(f"{m:>20}" for m in ("tok/s (short: req/s)",
                                                              *(x[:-3] for x in LATENCIES))))
        for row, cols in s["ratios"].items():
            cells = [cols.get(c) for c in ("throughput", *LATENCIES)]
            print(f"  {row:<25}" + "".join(
                f"{c['value']:>7.3g} ({c['lo']:.3g}-{c['hi']:.3g})".rjust(20) if c else f"{'-':>20}"
                for c in cells))
    for key, v in doc["keys"].items():
        print(f"{key:30} {v['value']:.3f} ({v['lo']:.3f}-{v['hi']:.3f}) target "
              f"{v['target_text']}: {v['verdict']}")


def plot(doc: dict[str, Any], png: Path) -> None:
    """Per shape, every capsteer case's throughput over its baseline with the rounds'
    spread, and plain's p99 TTFT / TPOT (1 = vanilla)."""
    plt = perf_models.pyplot()
    if plt is None:
        return
    shapes, n = list(doc["shapes"].items()), max(len(doc["shapes"]), 1)
    fig, axes = plt.subplots(1, n, figsize=(6 * n, 4.6), squeeze=False)
    for ax, (shape, s) in zip(axes[0], shapes, strict=False):
        rows = [(f"{r} {'req/s' if r == 'short' else 'tok/s'}", c["throughput"])
                for r, c in s["ratios"].items() if "throughput" in c]
        rows += [(f"plain {m[:-3]}", s["ratios"]["plain"][m]) for m in ("p99_ttft_ms", "p99_tpot_ms")
                 if m in s["ratios"].get("plain", {})]
        for i, (_label, c) in enumerate(rows):
            ax.barh(i, c["value"], color="#1565c0", capsize=3,
                    xerr=[[c["value"] - c["lo"]], [c["hi"] - c["value"]]])
            ax.text(c["hi"] + 0.01, i, f"{c['value']:.3f}", va="center", fontsize=7)
        ax.axvline(1.0, color="black", linewidth=1)
        ax.set_yticks(range(len(rows)), [r[0] for r in rows], fontsize=8)
        ax.invert_yaxis()
        ax.set_title(f"{shape}: rounds {s['rounds']}", fontsize=9)
        ax.set_xlabel("capsteer / vanilla (rows A/B: capsteer's A over its B)", fontsize=8)
    fig.suptitle(f"serve path, vllm bench serve, {doc['device']} {doc['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"wrote {png}", flush=True)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--shapes", default=None, help="comma list of bench/perf_models.py shapes, "
                    "or demo (default qwen3-0.6b,llama3-8b on cuda, demo on cpu)")
    ap.add_argument("--cases", default=",".join(CASE_NAMES))
    # --rounds in this run, numbered from --round; --prompt: the long cases' prompt tokens
    for name, default in (("--rounds", 1), ("--round", 1), ("--prompt", 256),
                          ("--output-len", 128), ("--num-prompts", 512), ("--concurrency", 256),
                          ("--short-prompts", 4096), ("--short-concurrency", 256),
                          ("--max-num-seqs", 256), ("--seed", 0)):
        ap.add_argument(name, type=int, default=default)
    ap.add_argument("--server-flags", default="", help="more flags for both servers")
    ap.add_argument("--capsteer-flags", default="", help="more capsteer serve flags")
    ap.add_argument("--model-dir", default=None, help="serve (and tokenize with) this model")
    ap.add_argument("--served-model-name", default=None, help="--attach: the served name")
    ap.add_argument("--attach", action="append", default=[], metavar="CONFIG=URL",
                    help="run CONFIG's cases against a running server (no starts)")
    ap.add_argument("--admin-key", default=None, help="capsteer's admin key (managed: random)")
    # --deadline (epoch s): a shape's servers start only with 2 x --min-server-s (one server's
    # start, cases and stop) left before it
    for name, default in (("--gpu-memory-utilization", 0.85), ("--start-timeout", 600.0),
                          ("--client-timeout", 1800.0), ("--deadline", 0.0),
                          ("--min-server-s", 170.0)):
        ap.add_argument(name, type=float, default=default)
    ap.add_argument("--work", type=Path, default=Path("/tmp/capsteer-serve-bench"))
    ap.add_argument("--readers-dir", type=Path, help="--attach: capsteer's (else under --work)")
    ap.add_argument("--py-spy", default=None, help="py-spy's path: profile each case's server")
    ap.add_argument("--out", type=Path, default=Path(perf_models.default_out()) / "serve")
    ap.add_argument("--merge", type=Path, nargs="+", default=None, metavar="DIR",
                    help="run nothing: summarize the raw files of these --out dirs into --out")
    ap.add_argument("--summary", action="store_true", help="record the keys in the summary")
    ap.add_argument("--summary-path", type=Path, default=summary_file.DEFAULT)
    ap.add_argument("--allow-cpu", action="store_true")  # and, hidden, a client's plan:
    ap.add_argument("--client", type=Path, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.shapes = (a.shapes or ("qwen3-0.6b,llama3-8b" if a.device == "cuda" else "demo")).split(",")
    a.cases = tuple(c for c in a.cases.split(",") if c)
    if unknown := set(a.cases) - set(CASE_NAMES):
        ap.error(f"unknown cases {sorted(unknown)}; known: {', '.join(CASE_NAMES)}")
    a.server_flags, a.capsteer_flags = a.server_flags.split(), a.capsteer_flags.split()
    return a


def main(argv: list[str] | None = None) -> None:
    a = parse(argv)
    if a.client:
        client_main(a.client)
        return
    a.device_name = perf_models.device_name(a.device)
    if a.merge is None:
        a.work.mkdir(parents=True, exist_ok=True)
        if a.attach:
            for spec in a.attach:
                config, _, url = spec.partition("=")
                if config not in CONFIGS or not url or not a.model_dir:
                    raise SystemExit("--attach vanilla=URL or capsteer=URL, with --model-dir")
                tag = f"r{a.round}-{a.shapes[0]}-{config}"
                got = drive(config, url.rstrip("/"), a.model_dir, a, a.out / "raw", tag, None)
                save_raw(a.out / "raw", tag, a.round, a.shapes[0], config, a, got)
        else:
            a.admin_key = a.admin_key or secrets.token_hex(8)  # its own servers: any key
            run_managed(a)
    doc = summarize(a.merge or [a.out], a.out, a.device_name if a.merge is None else None)
    print_report(doc)
    plot(doc, a.out / "serve-bench.png")
    if a.summary:  # the serve_* keys into bench/results/summary.json and its PNG
        summary_file.main(["update", "--from", str(a.out / "serve-bench.json"), "--summary",
                           str(a.summary_path), *(["--allow-cpu"] if a.allow_cpu else [])])
        summary_file.main(["plot", "--summary", str(a.summary_path)])


if __name__ == "__main__":
    main()
