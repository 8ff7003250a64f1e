"""bench/serve_bench.py's arithmetic: ratios paired by round, the spread over rounds, the
worst shape for a key, verdicts (floors and ceilings), and bench/summary.py taking the keys."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name: str):
    """A bench script as a module (bench/ is scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


sb = _load("serve_bench")


def _row(tput: float, ttft: float) -> dict:
    return {"completed": 8, "failed": 0, "output_throughput": tput, "request_throughput": tput / 10,
            "p50_ttft_ms": ttft, "p99_ttft_ms": ttft, "p50_tpot_ms": 2.0, "p99_tpot_ms": 2.0,
            "p50_itl_ms": 2.0, "p99_itl_ms": 2.0}


def _write(raw: Path, r: int, shape: str, config: str, cases: dict) -> None:
    raw.mkdir(parents=True, exist_ok=True)
    (raw / f"r{r}-{shape}-{config}.json").write_text(json.dumps({
        "kind": "serve-bench-raw", "round": r, "shape": shape, "config": config,
        "device": "NVIDIA H100", "date": "2026-12-07", "command": "c", "workload": {},
        "cases": cases, "failures": {}}))


def test_keys_pair_rounds_and_take_the_worst_shape(tmp_path):
    # shape a: capsteer's plain at 0.99, 1.00, 0.97 of vanilla; shape b at 0.90 in every round
    for r, (fa, fb) in enumerate([(0.99, 0.9), (1.0, 0.9), (0.97, 0.9)], start=1):
        for shape, f in (("a", fa), ("b", fb)):
            base = 100.0 * r  # each round's host speed differs; pairing cancels it
            _write(tmp_path / "raw", r, shape, "vanilla",
                   {"plain": _row(base, 10.0), "short": _row(base, 1.0)})
            _write(tmp_path / "raw", r, shape, "capsteer", {
                "plain": _row(base * f, 10.0 / f), "short": _row(base, 1.0),
                "distinct_1": _row(base, 10.0), "distinct_256": _row(base * 0.95, 10.0)})
    doc = sb.summarize([tmp_path], tmp_path)
    plain = doc["shapes"]["a"]["ratios"]["plain"]["throughput"]
    assert plain["by_round"] == [0.99, 1.0, 0.97] and plain["value"] == 0.99
    key = doc["keys"]["serve_plain"]
    assert (key["value"], key["lo"], key["hi"], key["verdict"]) == (0.9, 0.9, 0.9, "missed")
    ttft = doc["keys"]["serve_ttft_p99_plain"]  # a ceiling: the worst shape is the highest
    assert round(ttft["value"], 4) == round(1 / 0.9, 4) and ttft["verdict"] == "missed"
    d256 = doc["keys"]["serve_distinct_256"]
    assert round(d256["value"], 6) == 0.95 and d256["verdict"] == "met"
    assert "serve_steer_all" not in doc["keys"]  # not measured: no key, never a guess
    summary = _load("summary")
    update = summary.updates_from(tmp_path / "serve-bench.json")
    merged = summary.merge({}, update)
    assert merged["serve_plain"] == 0.9 and merged["provenance"]["serve_plain"]["verdict"] == "missed"


def test_verdicts_need_three_rounds_and_every_round_on_one_side():
    assert sb.verdict(0.99, 1.02, ">= 0.98", 3) == "met"
    assert sb.verdict(0.97, 1.02, ">= 0.98", 3) == "unresolved"
    assert sb.verdict(0.90, 0.97, ">= 0.98", 3) == "missed"
    assert sb.verdict(0.99, 1.02, ">= 0.98", 2) == "unresolved"
    assert sb.verdict(0.99, 1.04, "<= 1.05", 3) == "met"
    assert sb.verdict(1.01, 1.09, "<= 1.05", 3) == "unresolved"
    assert sb.verdict(1.06, 1.09, "<= 1.05", 3) == "missed"


def test_the_managed_capsteer_server_holds_every_distinct_spec_at_once(tmp_path):
    """distinct_256 runs 256 specs of every layer at once: the managed capsteer server's
    steering table is sized for them (the default fills at ~146 28-layer specs, and the
    rest would run unsteered), as `capsteer serve` hands it to the workers; vanilla gets no
    such flag."""
    from capsteer.engine_ext.worker_config import WorkerConfig  # the workers' reading of it
    from capsteer.server.launch import take_additional_config

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 28}))
    a = sb.parse(["--device", "cpu", "--work", str(tmp_path)])
    a.admin_key = "k"
    argv = sb.server_argv("capsteer", model, "demo", a, 8000)
    _, extra = take_additional_config(argv)
    entries = WorkerConfig.from_section(extra["capsteer"]).max_steering_entries
    assert entries >= max(sb.DISTINCT) * 28 > WorkerConfig().max_steering_entries
    assert "--additional-config" not in sb.server_argv("vanilla", model, "demo", a, 8000)


BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass\n"


def _named(comm: str, child_argv_tail: str) -> subprocess.Popen:
    """A process whose name (comm) is `comm`, with one child burning CPU whose command line
    ends with `child_argv_tail`; it leads its own process group."""
    return subprocess.Popen([sys.executable, "-c", (
        "import ctypes, subprocess, sys, time\n"
        f"ctypes.CDLL(None).prctl(15, {comm.encode()!r}, 0, 0, 0)\n"  # PR_SET_NAME
        f"subprocess.Popen([sys.executable, '-c', {BURN + 'time.sleep(30)'!r},"
        f" {child_argv_tail!r}])\n"
        "time.sleep(30)")], start_new_session=True)


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])


@pytest.mark.proc
def test_process_cpu_counts_the_server_tree_by_role():
    """The root is the API; processes named like vLLM's engine core and worker are
    `engine_core` and `worker`; a capture writer (by its command line) is `writer` whoever
    started it (on one GPU the engine core runs the worker and starts the writers); any
    other process, a worker's child too, is `other`. CPU time is seen to grow."""
    core = _named("VLLM::EngineCor", "capsteer.capture.writer.child")  # -m <the writer>
    worker = _named("VllmWorker-0", "not-a-writer")
    try:
        deadline = time.monotonic() + 20
        while (got := sb.process_cpu(os.getpid())).get("writer", 0.0) < 0.3 \
                or got.get("other", 0.0) < 0.3:
            assert time.monotonic() < deadline, f"the children's CPU time never showed: {got}"
            time.sleep(0.05)
        roles = sb.process_cpu(os.getpid(), pids=True)
        assert roles["api"] == os.getpid() and roles["worker"] == worker.pid
        assert roles["engine_core"] == core.pid
        assert _parent(roles["writer"]) == core.pid and _parent(roles["other"]) == worker.pid
        assert sb.process_cpu(None) == {}
    finally:
        for child in (core, worker):
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
