"""bench/serve_bench.py end to end on the demo model with tiny counts, so the harness the
lead runs on the GPU never rots. It attaches to the shared test servers (no start of its
own): the vanilla half while "server-vanilla" is up, the capsteer half on "server"; the
second run summarizes both. Every case must give vLLM client figures, and
serve-bench.json every serve_* key the issue names."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from .helpers import ADMIN_KEY, main_server, start_server

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--device", "cpu", "--shapes", "demo", "--prompt", "16", "--output-len", "4",
        "--num-prompts", "4", "--concurrency", "4", "--short-prompts", "8",
        "--short-concurrency", "4", "--client-timeout", "240"]
VANILLA_CASES = {"plain", "short"}
CAPSTEER_CASES = {"plain", "short", "steer_all", "distinct_1", "distinct_32", "distinct_256",
                  "capture", "capture_wait", "readout_probe", "readout_sae16k",
                  "steer_conditional"}
KEYS = {"serve_plain", "serve_steer_all", "serve_distinct_256", "serve_capture_one_layer",
        "serve_capture_one_layer_wait", "serve_short_rps", "serve_ttft_p99_plain",
        "serve_tpot_p99_plain", "readout_probe", "readout_sae16k", "steer_conditional"}


@pytest.fixture(scope="session")
def bench_out(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("serve-bench")


def _harness(out: Path, model_dir: str, attach: str, *extra: str) -> None:
    cmd = [sys.executable, str(ROOT / "bench" / "serve_bench.py"), *TINY, "--attach", attach,
           "--model-dir", model_dir, "--served-model-name", "demo", "--work", str(out / "work"),
           "--out", str(out), *extra]
    got = subprocess.run(cmd, capture_output=True, text=True, timeout=360, cwd=out)
    assert got.returncode == 0, got.stdout[-4000:] + got.stderr[-4000:]


def _raw(out: Path, config: str) -> dict:
    return json.loads((out / "raw" / f"r1-demo-{config}.json").read_text())


def _vanilla_half(engine_pool, model_dirs, server_root, out: Path) -> None:
    vanilla = start_server(engine_pool, model_dirs, server_root, "server-vanilla", ["--vanilla"])
    _harness(out, model_dirs["qwen3"], f"vanilla={vanilla.url}")


@pytest.mark.server
@pytest.mark.uses_engine("server-vanilla")
def test_serve_bench_vanilla_half(engine_pool, model_dirs, server_root, bench_out):
    _vanilla_half(engine_pool, model_dirs, server_root, bench_out)
    raw = _raw(bench_out, "vanilla")
    assert raw["failures"] == {}
    assert set(raw["cases"]) == VANILLA_CASES
    for row in raw["cases"].values():
        assert row["completed"] >= 4 and row["request_throughput"] > 0 and row["p99_ttft_ms"] > 0


@pytest.mark.server
@pytest.mark.uses_engine("server")
def test_serve_bench_every_case_and_key(engine_pool, model_dirs, server_root, bench_out):
    if not (bench_out / "raw" / "r1-demo-vanilla.json").exists():  # run alone (-k): its own
        _vanilla_half(engine_pool, model_dirs, server_root, bench_out)
    capsteer = main_server(engine_pool, model_dirs, server_root)
    _harness(bench_out, model_dirs["qwen3"], f"capsteer={capsteer.url}", "--admin-key", ADMIN_KEY,
             "--readers-dir", str(server_root / "server" / "readers"))
    # the shared server's registry as the other tests know it
    assert httpx.delete(capsteer.url + "/v1/steering/vectors/serve-bench",
                        headers={"X-Admin-Key": ADMIN_KEY}, timeout=30).status_code == 200
    raw = _raw(bench_out, "capsteer")
    assert raw["failures"] == {}
    assert set(raw["cases"]) == CAPSTEER_CASES
    for name, row in raw["cases"].items():
        assert row["completed"] >= 4 and row["output_throughput"] > 0, name
        assert row["p99_ttft_ms"] > 0 and row["p99_itl_ms"] is not None, name
        counts = row["capsteer_counts"]
        steered = counts.get("capsteer_steering_requests_total", 0)
        ok = counts.get("capsteer_capture_requests_total{status=ok}", 0)
        # every timed request (and vLLM's test request) carried its fields, or none did
        assert steered >= (4 if name.startswith(("steer", "distinct")) else 0) and (
            steered == 0 or name.startswith(("steer", "distinct"))), (name, counts)
        assert ok >= (4 if name.startswith("capture") else 0), (name, counts)
    doc = json.loads((bench_out / "serve-bench.json").read_text())
    assert doc["failures"] == {}
    shape = doc["shapes"]["demo"]
    assert shape["rounds"] == [1]
    assert set(shape["cases"]) == ({f"vanilla/{c}" for c in VANILLA_CASES}
                                   | {f"capsteer/{c}" for c in CAPSTEER_CASES})
    assert set(doc["keys"]) == KEYS
    for key, v in doc["keys"].items():
        assert v["value"] > 0 and v["lo"] <= v["value"] <= v["hi"], key
        assert v["verdict"] == "unresolved", key  # one round is too few to judge
    if importlib.util.find_spec("matplotlib") is not None:  # the PNG is optional without it
        assert (bench_out / "serve-bench.png").stat().st_size > 0
