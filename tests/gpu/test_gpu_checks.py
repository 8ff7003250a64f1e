"""GPU correctness checks, each a script beside this file run in its own process.

Each script starts its own engines or servers (and sets its own CUDA environment), so a
test runs it as a child and asserts its exit status and the verdict it writes; the
scripts print their full tables, which pytest shows with `-s`. Run on the lent GPU:

    pytest -m gpu tests/gpu -s            # one H100/H200; multi_gpu tests need 2 GPUs
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.gpu


def run_check(script: str, *args: str, cwd: Path, timeout: float = 1800
              ) -> subprocess.CompletedProcess:
    """Runs one check script and fails the test on a non-zero exit. Not from the checkout:
    its `capsteer/` source folder would shadow the installed package for Ray's workers."""
    proc = subprocess.run([sys.executable, str(HERE / script), *args], cwd=cwd,
                          timeout=timeout, text=True, capture_output=True)
    sys.stdout.write(proc.stdout[-20_000:])
    assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{proc.stderr[-6000:]}"
    return proc


def test_validate_captures_and_steering_vs_hf(tmp_path: Path) -> None:
    """Captures and steering vs HF in bf16, sync debug, batched = alone."""
    run_check("gpu_validate.py", "--layers", "8", "--out", str(tmp_path), cwd=tmp_path)


def test_families_vs_hf(tmp_path: Path) -> None:
    """Gemma-2 and Qwen3-MoE shapes: captures vs HF, steering, sync debug."""
    run_check("gpu_families.py", "--out", str(tmp_path), cwd=tmp_path)
    for report in tmp_path.glob("*.json"):
        for model in json.loads(report.read_text())["models"]:
            assert "error" not in model, model


def test_refusals_on_this_vllm(tmp_path: Path) -> None:
    """What `capsteer serve` refuses and accepts at vLLM's config step."""
    run_check("gpu_refusal_check.py", "--out", str(tmp_path), cwd=tmp_path)
    assert json.loads((tmp_path / "refusal_check.json").read_text())["all_ok"]


def test_uniform_plan_equals_per_row_plans(tmp_path: Path) -> None:
    """One uniform steering slot gives bitwise the tokens and log-probs of per-row plans."""
    run_check("gpu_uniform_check.py", "--out", str(tmp_path), cwd=tmp_path)


def test_stopped_forward_changes_no_captured_value(tmp_path: Path) -> None:
    """Extraction with the forward stopped after the deepest layer vs the full forward."""
    run_check("stop_at_layer_check.py", "--device", "cuda", "--out", str(tmp_path),
              "--work", str(tmp_path / "work"), cwd=tmp_path)


def test_steering_through_chat_vs_hf_hook(tmp_path: Path) -> None:
    """Issue 11's case: steering through the chat endpoint vs an HF forward hook."""
    run_check("steering_repro.py", "--out", str(tmp_path),
              "--model-dir", str(tmp_path / "model"), cwd=tmp_path)


@pytest.mark.multi_gpu
def test_tensor_and_pipeline_parallel_vs_tp1(tmp_path: Path) -> None:
    """TP=2 and PP=2 vs TP=1: one receipt, files once, values, steering."""
    run_check("gpu_parallel.py", "--layers", "8", "--out", str(tmp_path), cwd=tmp_path)


@pytest.mark.multi_gpu
def test_server_under_data_parallelism(tmp_path: Path) -> None:
    """`capsteer serve --data-parallel-size 2`: receipts, files, metrics, both ranks."""
    run_check("gpu_dp_server.py", "--dp", "2", "--out", str(tmp_path), cwd=tmp_path)


@pytest.mark.multi_gpu
def test_ray_extraction_two_replicas(tmp_path: Path) -> None:
    """Ray Data extraction over two replicas: both jobs verified, rows compared."""
    run_check("gpu_ray_extract.py", "--out", str(tmp_path), cwd=tmp_path)


def test_tap_kernel_with_gates_equals_torch_on_cuda(tmp_path: Path) -> None:
    """The compiled tap kernel, gated entries included, equals the torch reference."""
    proc = run_check("gpu_tap_gate_check.py", cwd=tmp_path, timeout=600)
    assert "ok" in proc.stdout
