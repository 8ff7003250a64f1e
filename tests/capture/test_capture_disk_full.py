"""Disk full on a real, small tmpfs: error receipts, no partial files, recovery.

Mounting needs root (CAP_SYS_ADMIN); elsewhere the test is skipped, saying why.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from capture_helpers import all_files, make_request, make_spec, temp_files

import capsteer.capture.metrics as metrics
from capsteer.capture import CaptureEnd, CaptureWriter, read
from capsteer.capture.metrics import sample_value
from capsteer.capture.published import verify_files
from capsteer.capture.writer.process import ProcessCaptureWriter
from capsteer.capture.writer.unwritten import RETRY_EVERY_S

MIB = 1 << 20


@pytest.fixture
def small_fs(tmp_path: Path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root; run as root to exercise ENOSPC")
    mnt = tmp_path / "small"
    mnt.mkdir()
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if res.returncode != 0:
        pytest.skip(f"cannot mount tmpfs here (no CAP_SYS_ADMIN?): {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _capture(w: CaptureWriter, cid: str, layout: str, rows: int, policy_spill: bool = False):
    spec = make_spec(layers=[0, 1], layout=layout)
    w.open(make_request(cid, spec, rows, hidden=256))
    for layer in (0, 1):
        w.write(cid, "resid_post", layer, np.arange(rows), torch.full((rows, 256), float(layer + 1)))
    w.close(CaptureEnd(cid, tuple(range(rows + 1))))
    return w.future(cid).result(30)


def _assert_nothing_partial(root: Path) -> None:
    assert temp_files(root) == []
    for path in all_files(root):
        if path.name == "manifest.json":
            continue
        manifest = path.parent / "manifest.json"
        assert manifest.exists(), f"{path} is a data file no manifest lists"
        listed = {f["name"] for f in json.loads(manifest.read_text())["files"]}
        assert path.name in listed, f"{path} is not listed by its manifest"
    for manifest in root.rglob("manifest.json"):
        assert verify_files(manifest.parent, json.loads(manifest.read_text())) == []


@pytest.mark.parametrize("layout", ["packed", "per_file"])
def test_enospc_gives_error_receipts_and_recovers(small_fs, layout):
    root = small_fs / "captures"
    w = CaptureWriter(root, budget_bytes=64 * MIB, workers=2)
    ok = _capture(w, "fits", layout, 1024)  # 2 MiB of rows
    assert ok.status == "ok"
    filler = small_fs / "filler"
    free = os.statvfs(small_fs).f_bavail * os.statvfs(small_fs).f_frsize
    filler.write_bytes(b"\0" * max(0, free - 3 * MIB // 2))  # per_file: 1st file fits, 2nd not
    bad = [_capture(w, f"full-{i}", layout, 1024) for i in range(3)]
    for r in bad:
        assert r.status == "error"
        assert "No space left" in r.error or "ENOSPC" in r.error or "28" in r.error, r.error
    _assert_nothing_partial(root)
    assert w.budget.inflight == 0
    filler.unlink()
    again = _capture(w, "after", layout, 1024)
    assert again.status == "ok", again.error
    cap = read(root / again.dir)
    assert torch.equal(cap.tensor("resid_post", 1), torch.full((1024, 256), 2.0))
    read(root / ok.dir)
    _assert_nothing_partial(root)
    w.shutdown()


def test_enospc_while_spilling_is_an_error_receipt(small_fs):
    root = small_fs / "captures"
    w = CaptureWriter(root, budget_bytes=256 * 1024, policy="block", workers=1)
    filler = small_fs / "filler"
    free = os.statvfs(small_fs).f_bavail * os.statvfs(small_fs).f_frsize
    filler.write_bytes(b"\0" * max(0, free - 512 * 1024))
    spec = make_spec(layers=[0])
    w.open(make_request("spill-full", spec, 4096, hidden=256))
    for lo in range(0, 4096, 256):  # 4 MiB through a 256 KiB budget: spills, then ENOSPC
        w.write("spill-full", "resid_post", 0, np.arange(lo, lo + 256), torch.ones(256, 256))
    w.close(CaptureEnd("spill-full", tuple(range(4097))))
    r = w.future("spill-full").result(30)
    assert r.status == "error" and "spill" in r.error
    assert w.budget.inflight == 0
    filler.unlink()
    _assert_nothing_partial(root)
    assert _capture(w, "after-spill", "packed", 512).status == "ok"
    w.shutdown()


def _fill(fs_root: Path) -> Path:
    """Fill the filesystem to the last page: even a manifest cannot be written."""
    filler = fs_root / "filler"
    free = os.statvfs(fs_root).f_bavail * os.statvfs(fs_root).f_frsize
    filler.write_bytes(b"\0" * free)
    n = 0
    try:
        while True:  # whatever the first write left
            (fs_root / f"crumb-{n}").write_bytes(b"\0" * 4096)
            n += 1
    except OSError:
        pass
    return filler


def _free(fs_root: Path) -> None:
    for path in fs_root.iterdir():
        if path.is_file():
            path.unlink()


def _send_capture(w, cid: str, rows: int = 256) -> None:
    spec = make_spec(layers=[0])
    w.open(make_request(cid, spec, rows, hidden=256))
    w.write(cid, "resid_post", 0, np.arange(rows), torch.ones(rows, 256))
    w.close(CaptureEnd(cid, tuple(range(rows + 1))))


def _wait_unwritten(w, cid: str, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = w.unwritten_receipts([cid])
        if cid in got:
            return got[cid]
        time.sleep(0.05)
    raise AssertionError(f"{cid}: no unwritten receipt after {timeout} s")


@pytest.mark.parametrize("kind", ["threads", "process"])
def test_a_full_disk_keeps_the_outcome_and_writes_it_later(small_fs, kind):
    """Issue 60 item 2: when even the error manifest fails, the writer keeps the final
    receipt (the server asks for it), and writes the manifest once space is back."""
    root = small_fs / "captures"
    root.mkdir()
    w = (CaptureWriter(root, budget_bytes=64 * MIB, workers=1) if kind == "threads" else
         ProcessCaptureWriter(root, budget_bytes=64 * MIB, workers=1, ring_bytes=1 << 20))
    def errors() -> float:
        snap = w.metrics_snapshot() if kind == "process" else metrics.snapshot()
        return sample_value(snap, "capsteer_capture_requests_total", status="error") or 0.0
    try:
        errors_before = errors()
        _fill(small_fs)
        _send_capture(w, "no-room")
        r = _wait_unwritten(w, "no-room")
        assert r.status == "error" and r.manifest is None
        assert "could not be written" in r.error and "No space left" in r.error, r.error
        assert not list(root.rglob("manifest.json"))
        assert errors() == errors_before + 1  # the metric and the receipt agree
        _free(small_fs)
        time.sleep(RETRY_EVERY_S + 0.1)
        _send_capture(w, "room-again")  # its publish retries the kept manifest first
        assert w.flush(30)
        manifests = {json.loads(p.read_text())["capture_id"]: json.loads(p.read_text())
                     for p in root.rglob("manifest.json")}
        assert manifests["room-again"]["status"] == "ok"
        assert manifests["no-room"]["status"] == "error"
        assert "No space left" in manifests["no-room"]["error"]
        _assert_nothing_partial(root)
    finally:
        w.shutdown(30)
