"""P1-P3 vs vanilla vLLM: paired rounds of processes taking turns on one GPU.

Configurations, one process each: vanilla (stock `vllm.LLM`); plain (capsteer, no fields:
P1, >= 0.99); steer (every request steered at all layers: P2, >= 0.95); capture (resid_post
at one layer x all prompt positions, packed, durable: P3, >= 0.90; the first capture process
also measures P3-all, all layers, bytes/s over the disk's `dd conv=fsync` rate). Not in the
default set: capture_mlp_post (P3 at the MLP's hidden activations, d_mlp wide, >= 0.90),
steer_conditional (steer's vector gated per token by a probe at every layer, >= 0.95),
readout_probe / readout_sae16k (a one-output probe / a 16,384-feature TopK SAE, top_k 16, read
at the middle layer's resid_post on every token, results collected in the timed batch: >= 0.97
/ 0.90). Workloads on the Qwen3-0.6B shape: prefill 256 x (512 in + 64 out), decode 256 x
(128 in + 512 out), greedy, fresh prompts every batch; after an untimed warm-up, whole batches
until --min-seconds; tokens/s = (prompt + generated) / time. vanilla and plain also generate
64 greedy requests for `plain_identity`.

A round's processes are alive together and take turns batch by batch (the next batch goes
to the one with the least timed seconds in the earliest phase), so a drifting host slows
all alike. Verdicts use the paired ratios (config / vanilla of the same round): median,
spread min-max, >= 3 rounds; met / missed only when the spread excludes the target. Process
files (`perf-proc-SS-CONFIG.json`) from `--slots` calls combine into
`<tag>-<date>-perf-method.json`; `--deadline EPOCH` starts no round that would not finish.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as `python bench/perf_method.py`
import perf_models
import storage
from perf_models import device_name

CONFIGS = ("vanilla", "plain", "steer", "capture")
MORE_CONFIGS = ("capture_mlp_post", "steer_conditional", "readout_probe", "readout_sae16k")
TARGETS = {"plain": 0.99, "steer": 0.95, "capture": 0.90, "capture_mlp_post": 0.90,
           "steer_conditional": 0.95, "readout_probe": 0.97, "readout_sae16k": 0.90}
CAPTURED = {"capture": "resid_post", "capture_mlp_post": "mlp_post"}  # config -> hook
READ = {"readout_probe": {"reader": {"name": perf_models.PROBE}},  # config -> its readout item
        "readout_sae16k": {"reader": {"name": perf_models.SAE16K}, "top_k": 16}}
MIN_PROCESSES = 3  # rounds per configuration before a ratio's spread counts
# name: (requests, prompt tokens, generated tokens)
WORKLOADS = {"cuda": {"prefill": (256, 512, 64), "decode": (256, 128, 512)},
             "cpu": {"prefill": (16, 128, 8), "decode": (16, 16, 64)}}
SHAPE = {"cuda": "qwen3-0.6b", "cpu": "qwen3-tiny"}
IDENTITY = {"cuda": (64, (16, 256), 32), "cpu": (64, (8, 64), 16)}  # requests, prompt range, gen
STEP_TOKENS = {"cuda": 2048, "cpu": 512}  # max_num_batched_tokens, the same for every config
DD_MIB = {"cuda": 4096, "cpu": 256}


def parse_slots(text: str | None, total: int) -> list[int]:
    """'1-6', '7-12', '1,5,9' -> slot numbers (1-based); None -> all."""
    if not text:
        return list(range(1, total + 1))
    spans = [(int(a), int(b or a)) for a, _, b in (part.partition("-") for part in text.split(","))]
    return [s for a, b in spans for s in range(a, b + 1) if 1 <= s <= total]


def _prompts(seed: int, n: int, length: int, vocab: int) -> list[list[int]]:
    return np.random.default_rng(seed).integers(10, vocab, size=(n, length)).tolist()


class Turns:
    """A process's side of the turn protocol (want, go, done); by hand (no --ctl-fd): no waits."""

    def __init__(self, ctl_fd: int | None) -> None:
        self.ctl = os.fdopen(ctl_fd, "w", buffering=1) if ctl_fd is not None else None

    @contextlib.contextmanager
    def turn(self, phase: int, timed_s: float = 0.0) -> Iterator[None]:
        if self.ctl is not None:
            self.ctl.write(f"want {phase} {timed_s:.6f}\n")
            if (line := sys.stdin.readline()).strip() != "go":
                raise SystemExit(f"turn protocol: expected 'go', got {line!r}")
        yield
        if self.ctl is not None:
            self.ctl.write("done\n")


def open_engine(config: str, model: str, kw: dict[str, Any], capture_dir: Path, staging: int,
                hidden: int) -> tuple[Callable[..., dict[str, Any]], Callable[[], None]]:
    """`config`'s engine (vanilla: `vllm.LLM`): one batch to completion (captures: durable)."""
    from vllm import LLM, SamplingParams

    if config == "vanilla":
        llm = LLM(model=model, **kw)

        def generate(prompts: list[list[int]], gen: int, capture: object = None,
                     steer: object = None) -> dict[str, Any]:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(
                max_tokens=gen, temperature=0.0, ignore_eos=True), use_tqdm=False)
            return {"cached": sum(int(o.num_cached_tokens or 0) for o in outs), "bytes": 0,
                    "tokens": [list(o.outputs[0].token_ids) for o in outs]}
        return generate, llm.llm_engine.engine_core.shutdown
    from capsteer.engine import Engine, Request  # not in the vanilla process

    config_section: dict[str, Any] = {"capture_dir": str(capture_dir), "staging_rows": staging}
    if config in READ or config == "steer_conditional":  # readers of this process's own
        config_section["readers_dir"] = str(capture_dir.parent / f"readers-{config}")
        perf_models.put_readers(Path(config_section["readers_dir"]), hidden)
    engine = Engine(model, capsteer_config=config_section, **kw)
    readout = [{**READ[config], "hook": "resid_post", "layer": engine.num_layers // 2}] \
        if config in READ else None  # the middle layer, as the capture configs

    def batch(prompts: list[list[int]], gen: int, capture: object = None,
              steer: object = None) -> dict[str, Any]:
        sampling = {"max_tokens": gen, "temperature": 0.0, "ignore_eos": True}
        results = engine.generate([Request(prompt_token_ids=p, sampling=sampling, steering=steer,
                                           capture=capture, durable=capture is not None,
                                           readout=readout)
                                   for p in prompts], timeout=900)
        bad = [r.receipt for r in results if r.receipt is not None and r.receipt.status != "ok"]
        bad += [e for r in results for e in r.readout_results or () if "error" in e]
        if bad:
            raise RuntimeError(f"{len(bad)} captures or readouts failed, e.g. {bad[0]}")
        return {"cached": sum(r.num_cached_tokens for r in results),
                "bytes": sum(r.receipt.bytes for r in results if r.receipt is not None),
                "tokens": [r.token_ids for r in results]}
    return batch, engine.close


def run_process(a: argparse.Namespace) -> dict[str, Any]:
    """One configuration, its workloads (+ identity, + P3-all); returns its figures."""
    t_start = time.time()
    turns = Turns(a.ctl_fd)
    import vllm  # noqa: F401  (timed as the process's import cost)

    if a.config != "vanilla":  # the vanilla process never imports capsteer's engine
        import capsteer.engine  # noqa: F401
    import_s = time.time() - t_start
    shape = perf_models.SHAPES[a.shape]
    workloads = {k: v for k, v in WORKLOADS[a.device].items() if k in a.workloads.split(",")}
    gen_id = IDENTITY[a.device][2]
    longest = max([p + g for _, p, g in workloads.values()] + [IDENTITY[a.device][1][1] + gen_id])
    kw: dict[str, Any] = dict(perf_models.engine_kwargs(a.shape), seed=0,
                              max_model_len=longest + 16, gpu_memory_utilization=a.mem_fraction,
                              max_num_batched_tokens=a.step_tokens)
    # One path for all processes (it is in vLLM's compile-cache key); turns keep writers apart.
    capture_dir = perf_models.fresh_dir(Path(a.work) / "captures")
    started = time.perf_counter()
    staging = a.step_tokens * (shape.layers + 1)  # P3-all: a whole step, every layer
    batch, close = open_engine(a.config, a.model, kw, capture_dir, staging, shape.hidden)
    startup_s = time.perf_counter() - started
    steer = {"vectors": [{"hook": "resid_post", "layers": "all", "vector": [0.01] * shape.hidden,
                          "scale": 1.0}]} if a.config in ("steer", "steer_conditional") else None
    if a.config == "steer_conditional":  # about half the tokens pass a random probe's test
        steer["vectors"][0]["when"] = {"reader": {"name": perf_models.PROBE}, "index": 0,
                                       "above": 0.0}
    capture = {"hooks": [CAPTURED[a.config]], "layers": [shape.layers // 2],
               "positions": "prompt", "layout": "packed"} if a.config in CAPTURED else None
    out: dict[str, Any] = {"config": a.config, "slot": a.slot,
                           "round": (a.slot - 1) // len(a.configs.split(",")) + 1,
                           "shape": a.shape, "device": a.device, "pid": os.getpid(),
                           "import_s": import_s, "startup_s": startup_s, "engine_kwargs": kw,
                           "min_seconds": a.min_seconds, "paired": True, "workloads": {}}
    if a.config in ("vanilla", "plain") and a.identity:
        with turns.turn(0):
            (n_id, (lo, hi), _), rng = IDENTITY[a.device], np.random.default_rng(12)
            prompts = [rng.integers(10, shape.vocab, size=int(rng.integers(lo, hi + 1))).tolist()
                       for _ in range(n_id)]
            out["identity_tokens"] = batch(prompts, gen_id)["tokens"]
    for w_index, (name, (n, prompt, gen)) in enumerate(workloads.items()):
        seed0 = {"prefill": 1_000, "decode": 2_000}[name]
        # Untimed warm-up: first-use set-up, not every batch size (CUDA graphs: at start-up).
        with turns.turn(1 + 2 * w_index):
            t, times = time.perf_counter(), []
            batch(_prompts(seed0 + 999, max(1, n // 4), prompt, shape.vocab), min(gen, 64),
                  capture, steer)
            warm_s = time.perf_counter() - t
        perf_models.fresh_dir(capture_dir)
        cached = nbytes = generated = 0
        while sum(times) < a.min_seconds or len(times) < a.min_batches:
            prompts = _prompts(seed0 + len(times), n, prompt, shape.vocab)
            with turns.turn(2 + 2 * w_index, sum(times)):
                t = time.perf_counter()  # after the turn: waiting for it is not timed
                got = batch(prompts, gen, capture, steer)
                times.append(time.perf_counter() - t)
            cached, nbytes = cached + got["cached"], nbytes + got["bytes"]
            generated += sum(len(x) for x in got["tokens"])
        perf_models.fresh_dir(capture_dir)  # untimed: every workload writes afresh
        tokens = len(times) * n * prompt + generated
        rep = {"batches": len(times), "seconds": sum(times), "batch_s": times, "tokens": tokens,
               "tokens_per_s": tokens / sum(times), "cached_tokens": cached, "capture_bytes": nbytes}
        out["workloads"][name] = {"requests": n, "prompt": prompt, "gen": gen, "warmup_s": warm_s,
                                  "reps": [rep], "median_tokens_per_s": rep["tokens_per_s"]}
    if a.do_p3all and a.config == "capture":
        with turns.turn(99):  # alone on the GPU, after every other process's timed batches
            out["p3all"] = _p3all(a, batch, capture_dir)
    out["process_s"] = time.time() - t_start
    close()
    shutil.rmtree(capture_dir, ignore_errors=True)
    return out


def _p3all(a: argparse.Namespace, batch: Callable[..., dict], capture_dir: Path) -> dict[str, Any]:
    """All layers x all prompt positions, durable: MB/s vs the disk's fsync'd dd rate."""
    (n, prompt, gen), vocab = WORKLOADS[a.device]["prefill"], perf_models.SHAPES[a.shape].vocab
    spec = {"hooks": ["resid_post"], "layers": "all", "positions": "prompt", "layout": "packed"}

    def disk() -> float:  # MB/s of storage.py's `dd conv=fsync`, else its write+fsync loop
        (dd := capture_dir / "dd").mkdir(parents=True, exist_ok=True)
        return storage.dd_rate(dd, DD_MIB[a.device]) or storage.loop_rate(dd, DD_MIB[a.device])
    dd_before = disk()
    batch(_prompts(3_999, max(4, n // 16), prompt, vocab), gen, spec)  # warm-up
    perf_models.fresh_dir(capture_dir)
    times: list[float] = []
    nbytes = 0
    while sum(times) < a.min_seconds or not times:
        # room for one more batch, with margin
        if times and shutil.disk_usage(capture_dir).free < 3 * nbytes / len(times):
            break
        prompts, t = _prompts(3_000 + len(times), n, prompt, vocab), time.perf_counter()
        nbytes += batch(prompts, gen, spec)["bytes"]
        times.append(time.perf_counter() - t)
    perf_models.fresh_dir(capture_dir)
    dd_after = disk()
    disk, rate = max(dd_before, dd_after), nbytes / sum(times) / 1e6
    return {"batches": len(times), "seconds": sum(times), "bytes": nbytes, "mb_s": rate,
            "disk_dd_mb_s": [dd_before, dd_after], "disk_mb_s": disk, "ratio": rate / disk,
            "dd_mib": DD_MIB[a.device], "requests_per_batch": n, "prompt": prompt}


def _pair_agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, float]:
    same = sum(x == y for x, y in zip(a, b, strict=True))
    prefix = [next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), len(x))
              / max(len(x), 1) for x, y in zip(a, b, strict=True)]
    return {"identical": same, "of": len(a), "fraction": same / max(len(a), 1),
            "mean_prefix_fraction": statistics.mean(prefix) if prefix else 1.0}


def summarize(procs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-config/workload statistics, ratios vs vanilla paired by round, verdicts, identity."""
    procs = sorted(procs, key=lambda p: p["slot"])
    stats: dict[str, dict[str, Any]] = {}
    for p in procs:
        for wl, w in p["workloads"].items():
            s = stats.setdefault(p["config"], {}).setdefault(
                wl, {"slots": [], "per_process": [], "rounds": [], "best": []})
            # best: the process's fastest batch (noise on a shared host only ever slows a
            # batch down), reported beside the verdict, never instead of it
            for k, x in (("slots", p["slot"]), ("rounds", p["round"]),
                         ("per_process", w["median_tokens_per_s"]), ("best", max(
                             r["tokens"] / r["batches"] / min(r["batch_s"]) for r in w["reps"]))):
                s[k].append(x)
    for cfg in stats.values():
        for s in cfg.values():
            v = s["per_process"]
            s.update(median=statistics.median(v), min=min(v), max=max(v), processes=len(v),
                     spread_pct=100 * (max(v) - min(v)) / statistics.median(v))
    ratios: dict[str, dict[str, Any]] = {}
    van = stats.get("vanilla", {})
    for cfg, target in TARGETS.items():
        for wl, s in stats.get(cfg, {}).items():
            v = van.get(wl)
            by_round = dict(zip(v["rounds"], v["per_process"], strict=True)) if v else {}
            if not (paired := [x / by_round[r] for r, x in
                               zip(s["rounds"], s["per_process"], strict=True) if r in by_round]):
                continue
            lo, hi = min(paired), max(paired)
            # processes of a round took turns on the GPU: judge by the rounds' ratios
            ratios.setdefault(cfg, {})[wl] = {
                "ratio": statistics.median(paired), "lo": lo, "hi": hi, "method": "paired",
                "samples": len(paired), "target": target,
                # fewer rounds than the method asks for: the spread is not measured
                "verdict": "unresolved" if len(paired) < MIN_PROCESSES else
                perf_models.verdict(lo, hi, target),
                "processes": [s["processes"], v["processes"]],
                "best_batch": {"ratio": statistics.median(s["best"]) / statistics.median(v["best"]),
                               "lo": min(s["best"]) / max(v["best"]),
                               "hi": max(s["best"]) / min(v["best"])},
                "paired_by_round": paired}
    out: dict[str, Any] = {"stats": stats, "ratios": ratios}
    keys: dict[str, Any] = {}
    named = {"plain": "p1_plain", "capture": "p3_capture_one_layer",
             "capture_mlp_post": "p3_capture_mlp_post"}  # the others: <config>_engine
    for key, cfg in ((named.get(c, f"{c}_engine"), c) for c in ("plain", "capture", *MORE_CONFIGS)):
        if per := ratios.get(cfg, {}):  # the min over the workloads; its bounds: the bounds' min
            lo, hi = min(r["lo"] for r in per.values()), min(r["hi"] for r in per.values())
            few = any(r["samples"] < MIN_PROCESSES for r in per.values())
            keys[key] = {"value": min(r["ratio"] for r in per.values()), "lo": lo, "hi": hi,
                         "target": TARGETS[cfg], "method": "paired", "workloads": sorted(per),
                         "verdict": "unresolved" if few else perf_models.verdict(lo, hi, TARGETS[cfg])}
    for wl, r in ratios.get("steer", {}).items():
        keys[f"p2_steer_{wl}"] = {k: r[k] for k in ("lo", "hi", "target", "verdict", "method")} \
            | {"value": r["ratio"]}
    if p3 := [p["p3all"] for p in procs if "p3all" in p]:
        keys["p3_capture_all_vs_disk"] = {"value": p3[0]["ratio"], "target": 0.80,
                                          "verdict": "met" if p3[0]["ratio"] >= 0.8 else "missed",
                                          "mb_s": p3[0]["mb_s"], "disk_mb_s": p3[0]["disk_mb_s"]}
        out["p3all"] = p3
    ident = {p["slot"]: (p["config"], p["identity_tokens"]) for p in procs if "identity_tokens" in p}
    vs, ps = ([s for s, (c, _) in ident.items() if c == name] for name in ("vanilla", "plain"))
    if vs and ps:
        vv = [_pair_agreement(ident[x][1], ident[y][1]) | {"pair": [x, y]}
              for i, x in enumerate(vs) for y in vs[i + 1:]]
        pv = [_pair_agreement(ident[p][1], ident[v][1]) | {"pair": [p, v]} for p in ps for v in vs]
        mean_pv = statistics.mean(r["fraction"] for r in pv)
        mean_vv = statistics.mean(r["fraction"] for r in vv) if vv else None
        keys["plain_identity"] = {
            "value": mean_pv, "vanilla_vs_vanilla": mean_vv, "requests": len(ident[vs[0]][1]),
            "verdict": "unresolved" if mean_vv is None else "met" if mean_pv >= mean_vv else "missed",
            "note": "fraction of requests with identical greedy tokens, mean over process pairs"}
        out["identity"] = {"vanilla_vs_vanilla": vv, "plain_vs_vanilla": pv}
    return out | {"keys": keys}


def print_summary(summary: dict[str, Any]) -> None:
    stats, ratios = summary["stats"], summary["ratios"]
    print(f"\n{'config':18}{'workload':9}{'procs':>6}{'median tok/s':>14}{'min':>12}{'max':>12}"
          f"{'spread%':>9}{'ratio':>8}{'lo':>7}{'hi':>7}{'target':>7}  verdict")
    for cfg in stats:
        for wl, s in stats[cfg].items():
            r = ratios.get(cfg, {}).get(wl)
            tail = (f"{r['ratio']:>8.3f}{r['lo']:>7.3f}{r['hi']:>7.3f}{r['target']!s:>7}  "
                    f"{r['verdict']:11}{r['method']:9}best batch {r['best_batch']['ratio']:.3f} "
                    f"({r['best_batch']['lo']:.3f}-{r['best_batch']['hi']:.3f})") if r else ""
            print(f"{cfg:18}{wl:9}{s['processes']:>6}{s['median']:>14,.0f}{s['min']:>12,.0f}"
                  f"{s['max']:>12,.0f}{s['spread_pct']:>9.1f}{tail}")
    for p in summary.get("p3all", []):
        print(f"P3-all: {p['bytes'] / 1e9:.2f} GB in {p['seconds']:.1f} s = {p['mb_s']:,.0f} MB/s; "
              f"disk dd conv=fsync {p['disk_dd_mb_s'][0]:,.0f} / {p['disk_dd_mb_s'][1]:,.0f} MB/s "
              f"-> ratio {p['ratio']:.2f} (target 0.80)")
    if ident := summary.get("identity"):
        vv, pv = (", ".join(f"{r['pair']}: {r['identical']}/{r['of']}" for r in ident[k])
                  for k in ("vanilla_vs_vanilla", "plain_vs_vanilla"))
        print(f"identity (identical greedy requests) vanilla-vanilla {vv or '-'}; plain-vanilla {pv}")
    print("\nkeys: " + json.dumps({k: round(v["value"], 4) if isinstance(v.get("value"), float)
                                   else v.get("value") for k, v in summary["keys"].items()}))


def load_procs(dirs: Iterable[Path]) -> list[dict[str, Any]]:
    """Every perf-proc-*.json under the given directories, one per slot (latest wins)."""
    found: dict[int, tuple[float, dict[str, Any]]] = {}
    for d in dirs:
        for f in sorted(Path(d).glob("**/perf-proc-*.json")):
            p = json.loads(f.read_text())
            if (stamp := float(p.get("finished_at", 0))) > found.get(p["slot"], (-1.0,))[0]:
                found[p["slot"]] = (stamp, p)
    return [p for _, p in found.values()]


def write_report(procs: list[dict[str, Any]], out: Path, meta: dict[str, Any]) -> Path:
    print_summary(summary := summarize(procs))
    slim = [{k: v for k, v in p.items() if k != "identity_tokens"} for p in procs]
    return perf_models.write_result(out, {**meta, "summary": summary, "procs": slim}, "perf-method")


class _Child:
    """The driver's view of one paired process: its turn requests arrive on a pipe."""

    def __init__(self, a: argparse.Namespace, slot: int, config: str, model: str, logs: Path,
                 p3all: bool, events: queue.Queue) -> None:
        self.slot, self.config, self.started = slot, config, time.time()
        self.result = Path(a.work) / "procs" / a.configs.replace(",", "-") \
            / f"perf-proc-{slot:02d}-{config}.json"
        self.result.unlink(missing_ok=True)
        read_fd, write_fd = os.pipe()
        share = perf_models.MEM[a.device] / len(a.configs.split(","))
        cmd = [sys.executable, __file__, "--one", config, "--slot", str(slot), "--model", model,
               "--device", a.device, "--shape", a.shape, "--min-seconds", str(a.min_seconds),
               "--min-batches", str(a.min_batches), "--work", a.work, "--workloads", a.workloads,
               "--step-tokens", str(a.step_tokens), "--result-file", str(self.result),
               "--configs", a.configs, "--ctl-fd", str(write_fd), "--mem-fraction", f"{share:.4f}",
               *(["--do-p3all"] if p3all else []), *(["--no-identity"] if a.no_identity else [])]
        self.log = logs / f"slot-{slot:02d}-{config}.log"
        self.proc = subprocess.Popen(cmd, stdout=self.log.open("w"), stderr=subprocess.STDOUT,
                                     stdin=subprocess.PIPE, text=True, pass_fds=(write_fd,))
        os.close(write_fd)
        self.want: tuple[int, float] | None = None
        self.busy, self.turns = True, 0  # busy: starting up, or running a turn

        def read() -> None:
            with os.fdopen(read_fd) as fh:
                for line in fh:
                    events.put((self, line.split()))
            events.put((self, ["eof"]))

        threading.Thread(target=read, daemon=True).start()

    def ready(self) -> bool:  # asking for a turn, or exited
        return self.want is not None or self.proc.poll() is not None

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.want, self.busy, self.turns = None, True, self.turns + 1
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()


def _wait_event(children: list[_Child], events: queue.Queue,
                until: Callable[[], bool], deadline: float | None) -> None:
    """Apply turn messages until `until()` holds (a dead process counts as done)."""
    while not until():
        try:
            child, msg = events.get(timeout=0.5)
        except queue.Empty:
            if deadline and time.time() > deadline + 30:
                for c in children:
                    c.proc.kill()
                raise SystemExit("paired round: past the deadline, processes killed") from None
            continue
        if msg[0] == "want":
            child.want = (int(msg[1]), float(msg[2]))
        elif msg[0] in ("done", "eof"):
            child.busy = False
            if msg[0] == "eof":
                child.proc.wait()


def drive_paired(a: argparse.Namespace) -> int:
    """Each round's processes are alive together and take turns batch by batch."""
    configs = a.configs.split(",")
    rounds = sorted({(s - 1) // len(configs) + 1 for s in parse_slots(a.slots, a.rounds * len(configs))})
    out, work = Path(a.out), Path(a.work)
    procs_dir, logs = work / "procs" / a.configs.replace(",", "-"), out / "logs"
    procs_dir.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    model = str(perf_models.write_model(work / a.shape, a.shape, a.device))
    p3all_done = not a.p3all or any("p3all" in p for p in load_procs([procs_dir]))
    failed: list[int] = []
    round_s: list[float] = []  # each round's seconds: the next one's guess
    for r in rounds:
        plan = [((r - 1) * len(configs) + i + 1, c) for i, c in enumerate(configs)]
        # a cold start plus both workloads per process until a round has been timed
        guess = max(round_s) if round_s else len(configs) * (60.0 + 4 * a.min_seconds)
        if a.deadline and time.time() + guess > a.deadline:
            print(f"deadline: not starting round {r} (~{guess:.0f} s); run it with --slots "
                  f"{plan[0][0]}-{plan[-1][0]}", flush=True)
            break
        t_round = time.time()
        events: queue.Queue = queue.Queue()
        children: list[_Child] = []
        for slot, config in plan:  # one start-up at a time: each sizes its KV cache alone
            p3 = config == "capture" and not p3all_done
            p3all_done = p3all_done or p3
            child = _Child(a, slot, config, model, logs, p3, events)
            children.append(child)
            _wait_event(children, events, child.ready, a.deadline)
            print(f"round {r}: slot {slot} {config} up after {time.time() - child.started:.0f} s",
                  flush=True)
        while any(c.proc.poll() is None for c in children):
            _wait_event(children, events, lambda cs=children: all(c.ready() for c in cs),
                        a.deadline)
            waiting = [c for c in children if c.want is not None and c.proc.poll() is None]
            if waiting:
                nxt = min(waiting, key=lambda c: (c.want, c.slot))
                nxt.go()
                _wait_event(children, events, lambda c=nxt: not c.busy, a.deadline)
        for c in children:
            if c.proc.returncode != 0 or not c.result.exists():
                failed.append(c.slot)
                tail = c.log.read_text(errors="replace").splitlines()[-40:]
                print(f"slot {c.slot} {c.config} FAILED (rc {c.proc.returncode}); log tail:\n"
                      + "\n".join(tail), flush=True)
                continue
            p = json.loads(c.result.read_text()) | {"finished_at": time.time(), "turns": c.turns,
                                                    "wall_s": time.time() - c.started}
            c.result.write_text(json.dumps(p))
            (out / c.result.name).write_text(json.dumps(p))
            print(f"slot {c.slot:2} {c.config:8} start-up {p['startup_s']:.0f} s, {c.turns} turns: "
                  + " ".join(f"{k} {v['median_tokens_per_s']:,.0f} tok/s ({v['reps'][0]['batches']}"
                             f" batches, {v['reps'][0]['seconds']:.1f} s)"
                             for k, v in p["workloads"].items()), flush=True)
            lines = c.log.read_text(errors="replace").splitlines()  # logs come back via $OUT
            if len(lines) > 400:  # their tails only
                c.log.write_text("\n".join([f"[{len(lines) - 400} lines cut]", *lines[-400:]]) + "\n")
        round_s.append(time.time() - t_round)
    if procs := load_procs([out, procs_dir]):
        write_report(procs, out, _meta(a))
    return 1 if failed else 0


def _meta(a: argparse.Namespace) -> dict[str, Any]:
    return {**perf_models.meta("perf_method.py", a.device), "paired": True,
            "shape": perf_models.describe(a.shape), "workloads": WORKLOADS[a.device],
            "min_seconds": a.min_seconds, "step_tokens": a.step_tokens, "targets": TARGETS}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help=f"comma list of {', '.join(CONFIGS + MORE_CONFIGS)}")
    ap.add_argument("--slots", help="which slots of the rounds to run, e.g. 1-6")
    ap.add_argument("--min-seconds", type=float, default=None,
                    help="timed wall time per workload (default: 20 on cuda, 1 on cpu)")
    for name, default in (("--rounds", 3), ("--min-batches", 1), ("--deadline", 0.0)):
        ap.add_argument(name, type=type(default), default=default)  # --deadline: epoch s
    ap.add_argument("--step-tokens", type=int, default=None,
                    help="max_num_batched_tokens, the same for every config (default 2048 on "
                         "cuda, 512 on cpu; the recorded P1-P3 figures used 8192)")
    ap.add_argument("--workloads", default="prefill,decode")
    ap.add_argument("--no-p3all", dest="p3all", action="store_false")
    ap.add_argument("--no-identity", action="store_true")
    ap.add_argument("--shape", default=None)
    ap.add_argument("--work", default="/tmp/capsteer-perf", help="work dir")
    ap.add_argument("--out", default=perf_models.default_out())
    ap.add_argument("--summarize", nargs="+", type=Path, help="merge process files in these dirs")
    for hidden, kw in (("--one", {}), ("--model", {}), ("--result-file", {}),
                       ("--slot", {"type": int, "default": 1}), ("--ctl-fd", {"type": int}),
                       ("--mem-fraction", {"type": float}), ("--do-p3all", {"action": "store_true"})):
        ap.add_argument(hidden, help=argparse.SUPPRESS, **kw)
    a = ap.parse_args(argv)
    a.shape = a.shape or SHAPE[a.device]
    if a.min_seconds is None:  # cuda: 20 s resolved P1 and P3 prefill where 10 s did not
        a.min_seconds = 20.0 if a.device == "cuda" else 1.0
    a.step_tokens = a.step_tokens or STEP_TOKENS[a.device]
    if a.summarize:
        if not (procs := load_procs(a.summarize)):
            raise SystemExit("no perf-proc-*.json found")
        a.device, a.shape, a.min_seconds = procs[0]["device"], procs[0]["shape"], procs[0].get("min_seconds")
        a.step_tokens = procs[0]["engine_kwargs"].get("max_num_batched_tokens", a.step_tokens)
        write_report(procs, Path(a.out), _meta(a) | {"device": procs[0].get("device_name", a.device)})
        return 0
    if a.one:
        a.config, a.identity = a.one, not a.no_identity
        Path(a.result_file).parent.mkdir(parents=True, exist_ok=True)
        Path(a.result_file).write_text(json.dumps(run_process(a) | {"device_name": device_name(a.device)}))
        return 0
    return drive_paired(a)


if __name__ == "__main__":
    sys.exit(main())
