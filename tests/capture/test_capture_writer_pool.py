"""Several writer processes behind one sink: each capture is published whole by one child,
the same files as the in-process writer, the budget split, the children's stats and
metrics added up, and a dead child costs only its own open captures."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from capture_helpers import feed, make_request, make_spec, temp_files
from test_capture_writer_process import wait_receipt

from capsteer.capture import CaptureWriter, read
from capsteer.capture.metrics import sample_value
from capsteer.capture.writer.fanout import ProcessWriterPool, auto_processes


@pytest.fixture
def pool(root: Path):
    p = ProcessWriterPool(root, processes=2, budget_bytes=64 << 20, workers=1, ring_bytes=1 << 20)
    assert p.ready.wait(60), "a writer process never said it was ready"
    yield p
    p.shutdown(timeout=30)


def test_captures_spread_over_the_children_and_match_the_in_process_writer(pool, root, tmp_path):
    spec = make_spec(hooks={"resid_post": "all", "resid_mid": [0, -1]})
    cids = [f"pool-{i}" for i in range(6)]
    refs_by_cid = {}
    for i, cid in enumerate(cids):
        req = make_request(cid, spec, 5 + i, hidden=64, dtype=torch.bfloat16)
        end, refs = feed(pool, req, 3, prefill_chunk=4)
        pool.close(end)
        refs_by_cid[cid] = (req, refs)
    assert pool.flush(60)
    publishers = set()
    with CaptureWriter(tmp_path / "ref", workers=1) as ref_writer:
        for cid, (req, refs) in refs_by_cid.items():
            got = wait_receipt(root, cid)
            assert got.status == "ok", got.error
            mine = read(root / got.dir)
            end, _ = feed(ref_writer, req, 3, prefill_chunk=4)
            ref_writer.close(end)
            ref = ref_writer.future(cid).result(30)
            theirs = read(tmp_path / "ref" / ref.dir)
            assert mine.positions.tolist() == theirs.positions.tolist()
            for key in spec.keys():
                assert torch.equal(mine.tensor(*key), theirs.tensor(*key))
                assert torch.equal(mine.tensor(*key), refs[key][: len(mine.positions)])
            publishers.add(mine.manifest["writer"]["pid"])
    assert publishers == set(pool.child_pids)  # both children published, none other
    assert os.getpid() not in publishers
    assert temp_files(root) == []
    stats = pool.stats()
    assert stats["budget_bytes"] == 64 << 20  # the shares add up to the budget
    assert [s["budget_bytes"] for s in stats["processes"]] == [32 << 20, 32 << 20]
    assert stats["open_captures"] == 0
    assert sorted(s["process"] for s in stats["processes"]) == sorted(pool.child_pids)
    snap = pool.metrics_snapshot()  # one source: the children's counters added
    assert sample_value(snap, "capsteer_capture_requests_total", status="ok") == len(cids)


def test_a_capture_larger_than_its_share_spills_and_is_kept(root):
    """Block policy: the split budget holds less per child; a capture above the share
    spills rows to disk rather than being lost."""
    pool = ProcessWriterPool(root, processes=2, budget_bytes=96 << 10, workers=1,
                             ring_bytes=1 << 20)
    try:
        assert pool.ready.wait(60)
        spec = make_spec(layers=[0, 1], positions="all")
        req = make_request("pool-big", spec, 40, hidden=512)  # 2 x 40 x 512 x 4 = 160 KiB
        end, refs = feed(pool, req, 1)
        pool.close(end)
        got = wait_receipt(root, "pool-big")
        assert got.status == "ok", got.error
        cap = read(root / got.dir)
        for key, rows in refs.items():
            assert torch.equal(cap.tensor(*key), rows)
        assert pool.stats()["spilled_bytes"] > 0
    finally:
        pool.shutdown(timeout=30)


def test_a_dead_child_ends_only_its_open_captures(pool, root):
    spec = make_spec(layers=[0])
    first, second = make_request("pool-a", spec, 4), make_request("pool-b", spec, 4)
    feed(pool, first, 2)
    feed(pool, second, 2)
    victim = pool._route["pool-a"]
    assert pool._route["pool-b"] is not victim  # the fewest in flight: the other child
    os.kill(victim.child_pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while pool.failure is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert pool.failure is not None and "exited" in pool.failure
    lost = wait_receipt(root, "pool-a")
    assert lost.status == "error" and "writer process" in lost.error
    end, refs = feed(pool, second, 2)
    pool.close(end)  # the surviving child publishes its capture
    kept = wait_receipt(root, "pool-b")
    assert kept.status == "ok", kept.error
    survivor = next(w for w in pool.writers if w is not victim)
    for i in range(3):  # new captures go to the surviving child, not to this process
        req = make_request(f"pool-after-{i}", spec, 4)
        end, refs = feed(pool, req, 2)
        pool.close(end)
        got = wait_receipt(root, req.capture_id)
        assert got.status == "ok", got.error
        cap = read(root / got.dir)
        assert torch.equal(cap.tensor("resid_post", 0), refs[("resid_post", 0)])
        assert cap.manifest["writer"]["pid"] == survivor.child_pid


@pytest.mark.parametrize("policy", ["drop", "reject"])
def test_policies_that_would_lose_a_capture_above_one_share_refuse_a_pool(root, policy):
    with pytest.raises(ValueError, match="split the budget"):
        ProcessWriterPool(root, processes=2, policy=policy)


def test_auto_processes_follows_the_policy_and_the_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert auto_processes("block") == 2
    assert auto_processes("drop") == auto_processes("reject") == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert auto_processes("block") == 1


def test_the_workers_config_sizes_every_childs_ring(tmp_path):
    """`capture_ring_bytes` (the worker config's key; server flag --capture-ring) reaches
    every writer process's ring; below 1 MiB it is refused by name."""
    from capsteer.capture.writer.factory import durable_writer as _durable_writer

    config = {"capture_dir": str(tmp_path / "c"), "capture_writer_processes": 2,
              "capture_workers": 1, "capture_ring_bytes": 3 << 20}
    pool = _durable_writer(config)
    try:
        assert isinstance(pool, ProcessWriterPool)
        assert pool.ready.wait(60), "a writer process never said it was ready"
        assert [w.ring_bytes for w in pool.writers] == [3 << 20, 3 << 20]
        assert [s["ring_bytes"] for s in pool.stats()["processes"]] == [3 << 20, 3 << 20]
    finally:
        pool.shutdown(timeout=30)
    with pytest.raises(ValueError, match="capture_ring_bytes"):
        _durable_writer({**config, "capture_ring_bytes": 4096})
