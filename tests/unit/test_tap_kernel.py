"""The device-mode Triton kernel equals the torch reference (Triton's CPU interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def test_tap_kernel_matches_torch_reference():
    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "tests.unit.tap_kernel_check"], cwd=root,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
