"""The writer process's memory over repeated bursts of concurrent captures (issue 60).

A server that takes burst after burst must not creep up: what one burst of 500 captures
leaves behind in the writer process is what three leave, and once idle the process hands
its free heap back. The child's memory is read from /proc in its parts: RssAnon (its own
heap, Python objects and row copies) and RssShmem (the pages of the shared ring the rows
cross in, resident at most the ring's size however many bytes went through it)."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from capture_helpers import make_request, make_spec

from capsteer.capture import read
from capsteer.capture.layouts import MANIFEST_FILE
from capsteer.capture.sink import CaptureEnd
from capsteer.capture.writer.process import ProcessCaptureWriter
from capsteer.capture.writer.ring import HEADER

CAPTURES = 500  # a burst: all open at once, as a server's 500 concurrent requests
PROMPT, GENERATED, HIDDEN = 14, 4, 128  # 2 keys x 17 rows x 512 B: 8.5 MiB of rows a burst
RING = 4 << 20  # smaller than one burst's rows: every burst wraps it


def memory_kib(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "RssAnon", "RssShmem"):
            fields[name] = int(value.split()[0])
    return fields


def rows_of(load: int, i: int, layer: int, lo: int, hi: int) -> torch.Tensor:
    """Rows that name their capture, key and position (checked after publishing)."""
    base = float(load * 1_000_000 + i * 1_000 + layer * 100)
    return (torch.arange(lo, hi, dtype=torch.float32) + base).unsqueeze(1).expand(hi - lo, HIDDEN)


def burst(w: ProcessCaptureWriter, load: int, spec) -> None:
    """CAPTURES requests open together; each engine step writes every one's rows."""
    reqs = [make_request(f"rss-{load}-{i}", spec, PROMPT, hidden=HIDDEN) for i in range(CAPTURES)]
    for req in reqs:
        w.open(req)
    steps = [(0, PROMPT)] + [(p, p + 1) for p in range(PROMPT, PROMPT + GENERATED - 1)]
    for lo, hi in steps:
        for i, req in enumerate(reqs):
            for hook, layer in spec.keys():
                w.write(req.capture_id, hook, layer, np.arange(lo, hi), rows_of(load, i, layer, lo, hi))
        w.end_step()
    for req in reqs:
        fed = (*req.prompt_token_ids, *range(5000, 5000 + GENERATED - 1))
        w.close(CaptureEnd(req.capture_id, fed, finish_reason="length"))
    assert w.flush(120), "the burst was not published within 120 s"


def manifests(root: Path) -> dict[str, Path]:
    found = {}
    for directory, _, files in os.walk(root):
        if MANIFEST_FILE in files:
            manifest = json.loads((Path(directory) / MANIFEST_FILE).read_text())
            assert manifest["status"] == "ok", manifest.get("error")
            found[manifest["capture_id"]] = Path(directory)
    return found


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                    reason="reads /proc; the idle trim is glibc's malloc_trim")
def test_writer_process_memory_is_flat_over_bursts_and_shrinks_when_idle(root):
    w = ProcessCaptureWriter(root, budget_bytes=256 << 10, policy="block", workers=2,
                             ring_bytes=RING, idle_trim_s=2.0)
    try:
        assert w.ready.wait(60), "the writer process never said it was ready"
        pid = w.child_pid
        spec = make_spec(layers=[0, 1])
        start = memory_kib(pid)
        after = []
        for load in range(3):
            burst(w, load, spec)
            after.append(memory_kib(pid))
        trims = w.stats()["heap_trims"]
        deadline = time.monotonic() + 30
        while w.stats()["heap_trims"] == trims:  # idle_trim_s after the last message
            assert time.monotonic() < deadline, "the idle child never trimmed its heap"
            time.sleep(0.2)
        while w.ring_releases == 0:  # the parent punches the idle ring's pages out
            assert time.monotonic() < deadline, "the idle ring's pages were never released"
            time.sleep(0.2)
        idle = memory_kib(pid)
        published = manifests(root)
        assert len(published) == 3 * CAPTURES  # every capture ok (block spilled, lost none)
        for load, i in [(0, 0), (1, 250), (2, CAPTURES - 1)]:
            cap = read(published[f"rss-{load}-{i}"])  # digests verified
            for layer in (0, 1):
                want = rows_of(load, i, layer, 0, PROMPT + GENERATED - 1)
                assert torch.equal(cap.tensor("resid_post", layer), want)
        report = f"start {start}, after bursts {after}, idle {idle}"
        print(report)  # pytest -s shows the figures (docs/performance.md)
        # Three bursts hold what one does: the must-show of issue 60 (within 10%), and the
        # heap alone within 8 MiB (1,000 captures leaving 8 KiB each behind would fail it).
        assert after[2]["VmRSS"] <= 1.10 * after[0]["VmRSS"], report
        assert after[2]["RssAnon"] - after[0]["RssAnon"] <= 8 << 10, report
        # The ring's pages are resident at most once, however many bytes crossed it
        # (25 MiB here, through a 4 MiB ring).
        assert after[2]["RssShmem"] <= (HEADER + RING) // 1024 + 64, report
        # Idle, the child hands its free heap back: below what the bursts left, and near
        # where it started (what stays is the first burst's high water in Python's small-
        # object arenas: 10-12% of the heap on a 2-core CPU machine).
        assert idle["RssAnon"] < after[2]["RssAnon"], report
        assert idle["RssAnon"] <= 1.20 * start["RssAnon"], report
        assert idle["RssShmem"] < 1024, report  # and the ring's pages went back
    finally:
        w.shutdown(timeout=30)
