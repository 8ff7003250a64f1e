"""`Engine.generate` reads durable captures' manifests on a thread from the batch's start."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from capsteer.engine import _ReceiptPoller


def publish(root: Path, rel: str, capture_id: str) -> None:
    """A manifest appears atomically under its final name, as the writer publishes it."""
    d = root / rel
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / ".manifest.json.tmp"
    tmp.write_text(json.dumps({"capture_id": capture_id, "status": "ok",
                               "files": [{"name": "a.safetensors", "bytes": 10}],
                               "positions": [0, 1, 2]}))
    tmp.rename(d / "manifest.json")


def test_receipts_published_during_and_after_the_batch_are_all_returned(tmp_path):
    rel = {f"cap-{i}": f"t/2026-11-26/cap-{i}" for i in range(3)}
    publish(tmp_path, rel["cap-0"], "cap-0")  # published before the batch ends
    poller = _ReceiptPoller(str(tmp_path), rel, interval_s=0.01)
    deadline = time.monotonic() + 5
    while "cap-0" not in poller.found and time.monotonic() < deadline:
        time.sleep(0.01)
    assert set(poller.found) == {"cap-0"}  # read while the batch still runs
    late = threading.Timer(0.1, lambda: [publish(tmp_path, rel[c], c) for c in ("cap-1", "cap-2")])
    late.start()
    receipts = poller.wait(timeout=5)
    assert sorted(receipts) == sorted(rel)
    assert receipts["cap-2"].dir == rel["cap-2"] and receipts["cap-2"].bytes == 10
    assert receipts["cap-1"].positions == 3 and receipts["cap-1"].status == "ok"


def test_a_capture_never_published_times_out_naming_it(tmp_path):
    rel = {"cap-a": "t/d/cap-a", "cap-b": "t/d/cap-b"}
    publish(tmp_path, rel["cap-a"], "cap-a")
    poller = _ReceiptPoller(str(tmp_path), rel, interval_s=0.01)
    with pytest.raises(TimeoutError, match="cap-b"):
        poller.wait(timeout=0.3)
    assert poller._thread is not None and not poller._thread.is_alive()  # stopped


def test_no_durable_capture_starts_no_thread(tmp_path):
    poller = _ReceiptPoller(str(tmp_path), {})
    assert poller._thread is None and poller.wait(1) == {}
