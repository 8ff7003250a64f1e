"""Slow storage: fsync latency injected through the writer's filesystem wrapper.

The wrapper calls the real os.fsync after sleeping, so files are still really
durable; it shows up in the publish-latency histogram and must not reach the
engine thread (write/close stay fast) unless the policy says to block.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from capture_helpers import make_request, make_spec

from capsteer.capture import CaptureEnd, CaptureWriter, read
from capsteer.capture import metrics as m
from capsteer.capture.publish import FileSystem

DELAY = 0.1


class SlowFS(FileSystem):
    def __init__(self) -> None:
        self.calls = 0

    def fsync(self, fd: int) -> None:
        self.calls += 1
        time.sleep(DELAY)
        super().fsync(fd)


def _hist(name: str) -> dict[str, float]:
    snap = m.snapshot()
    return {
        "count": m.sample_value(snap, f"{name}_count"),
        "sum": m.sample_value(snap, f"{name}_sum"),
        "le_0.25": m.sample_value(snap, f"{name}_bucket", le="0.25"),
        "inf": m.sample_value(snap, f"{name}_bucket", le="+Inf"),
    }


def _drive(w: CaptureWriter, ids: list[str], rows: int = 64) -> float:
    """Open/write/close like an engine; returns the slowest single call in seconds."""
    spec = make_spec(layers=[0, 1])
    worst = 0.0
    for cid in ids:
        t = time.perf_counter()
        w.open(make_request(cid, spec, rows, hidden=256))
        for layer in (0, 1):
            w.write(cid, "resid_post", layer, np.arange(rows), torch.full((rows, 256), float(layer)))
        w.close(CaptureEnd(cid, tuple(range(rows + 1))))
        worst = max(worst, time.perf_counter() - t)
    return worst


def test_fsync_latency_shows_in_histograms_not_in_submitters(root):
    fs = SlowFS()
    w = CaptureWriter(root, budget_bytes=64 << 20, workers=2, fs=fs, sweep=False)
    pub0, fsync0 = _hist("capsteer_capture_publish_seconds"), _hist("capsteer_fsync_seconds")
    ids = [f"slow-{i}" for i in range(6)]
    worst = _drive(w, ids)
    assert worst < DELAY / 2, f"a submitter call took {worst:.3f}s"
    assert w.flush(60)
    receipts = [w.receipt(c) for c in ids]
    assert all(r.status == "ok" for r in receipts)
    pub1, fsync1 = _hist("capsteer_capture_publish_seconds"), _hist("capsteer_fsync_seconds")
    # Each publish does >= 4 fsyncs (data file, dir, manifest, dir): >= 0.4 s each.
    assert pub1["count"] - pub0["count"] == 6
    assert pub1["le_0.25"] - pub0["le_0.25"] == 0
    assert pub1["sum"] - pub0["sum"] >= 6 * 4 * DELAY
    assert fsync1["count"] - fsync0["count"] >= 6 * 4
    assert fsync1["sum"] - fsync0["sum"] >= 6 * 4 * DELAY * 0.95
    # Each observation is one fsync (~DELAY), not a publish (>= 4 x DELAY). On a loaded
    # 2-core host a few run late (CI once saw 2 of 32 past 0.25 s): the mean and the bulk
    # are checked, not every one.
    n = fsync1["count"] - fsync0["count"]
    assert (fsync1["sum"] - fsync0["sum"]) / n < 2 * DELAY
    assert fsync1["le_0.25"] - fsync0["le_0.25"] >= 0.75 * n
    assert all(r.timings["fsync_s"] >= 2 * DELAY for r in receipts)
    for r in receipts:
        read(root / r.dir)
    w.shutdown()


def test_drop_policy_never_waits_for_slow_storage(root):
    fs = SlowFS()
    # Room for ~2 requests in memory while publishing crawls: the rest are dropped, not waited on.
    w = CaptureWriter(root, budget_bytes=300 << 10, policy="drop", workers=1, fs=fs, sweep=False)
    ids = [f"sd-{i}" for i in range(8)]
    worst = _drive(w, ids)
    assert worst < DELAY / 2, f"a submitter call took {worst:.3f}s"
    assert w.flush(60)
    statuses = [w.receipt(c).status for c in ids]
    assert "dropped" in statuses and "ok" in statuses
    w.shutdown()


def test_block_policy_waits_only_when_budget_is_exhausted(root):
    fs = SlowFS()
    w = CaptureWriter(root, budget_bytes=300 << 10, policy="block", workers=1, fs=fs, sweep=False)
    t0 = time.perf_counter()
    _drive(w, [f"sb-{i}" for i in range(4)])
    submit_s = time.perf_counter() - t0
    assert w.flush(60)
    assert all(w.receipt(f"sb-{i}").status == "ok" for i in range(4))
    assert w.budget.peak <= 300 << 10
    # Blocking happened (the budget holds ~2 requests) but nothing was lost.
    assert submit_s >= DELAY
    w.shutdown()
