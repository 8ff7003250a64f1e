"""Crash safety: a writer process SIGKILLed at random moments, 60 trials.

After every kill: nothing partial is visible under a final name, every visible
manifest verifies, and a restarted writer sweeps the temp files the dead one left.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from capture_helpers import all_files, temp_files
from safetensors import safe_open

from capsteer.capture import CaptureWriter, read
from capsteer.capture.published import verify_files

HERE = Path(__file__).parent
TRIALS = 60


def _complete_safetensors(path: Path) -> None:
    """A file under a final name must be a whole safetensors file (checked without capsteer)."""
    data = path.read_bytes()
    assert len(data) >= 8, f"{path}: truncated"
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    assert len(data) == 8 + n + end, f"{path}: {len(data)} bytes, header implies {8 + n + end}"
    with safe_open(path, framework="pt") as fh:
        for name in fh.keys():
            fh.get_tensor(name)


def _check_visible(root: Path) -> tuple[int, int]:
    manifests = orphans = 0
    for path in all_files(root):
        if path.name.startswith("."):
            continue  # temp names: invisible by construction, checked by the sweep
        if path.name == "manifest.json":
            manifest = json.loads(path.read_text())  # never torn
            assert verify_files(path.parent, manifest) == [], path
            if manifest["status"] == "ok":
                read(path.parent)  # checksums + tensor metadata
            manifests += 1
        else:
            assert path.suffix == ".safetensors", path
            _complete_safetensors(path)
            if not (path.parent / "manifest.json").exists():
                orphans += 1
    return manifests, orphans


def _wait_gone(pid: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return
        except (FileNotFoundError, ProcessLookupError):
            return
        time.sleep(0.005)
    raise AssertionError(f"writer {pid} did not die")


@pytest.fixture
def zygote():
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "capture_zygote.py")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    yield proc
    proc.stdin.close()  # type: ignore[union-attr]
    proc.wait(timeout=10)


def test_sigkill_at_random_moments(zygote, tmp_path):
    rng = random.Random(20261121)
    killed_mid_write = published = orphans_seen = 0
    for trial in range(TRIALS):
        root = tmp_path / f"trial-{trial}"
        zygote.stdin.write(f"{root} {trial}\n")
        zygote.stdin.flush()
        pid = int(zygote.stdout.readline())
        time.sleep(rng.uniform(0.03, 0.35))
        os.kill(pid, signal.SIGKILL)
        _wait_gone(pid)
        stale = temp_files(root)
        killed_mid_write += bool(stale)
        manifests, orphans = _check_visible(root)
        published += manifests
        orphans_seen += orphans
        # Restart: a new writer on the same root sweeps what the dead one left.
        w = CaptureWriter(root, workers=1)
        w.shutdown()
        assert sorted(w.swept) == sorted(stale)
        assert temp_files(root) == []
        _check_visible(root)  # the sweep removed nothing that was visible
        shutil.rmtree(root)
    print(f"{TRIALS} kills: {killed_mid_write} mid-write, {published} manifests verified, "
          f"{orphans_seen} complete files without manifest")
    # The kills really landed inside publishes, and publishes really happened.
    assert killed_mid_write >= TRIALS // 4
    assert published >= TRIALS
