"""The durable writer in its own process: same files as the in-process writer, rows that
cross the shared-memory ring (wrapping, waiting, inline), metrics and stats from the
child, and no capture left pending or silently lost when the child dies."""

from __future__ import annotations

import os
import platform
import signal
import socket
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from capture_helpers import feed, make_request, make_spec, reference_rows, temp_files

from capsteer.capture import CaptureWriter, find_receipt, read
from capsteer.capture.layouts import copy_rows
from capsteer.capture.metrics import sample_value
from capsteer.capture.sink import CaptureEnd
from capsteer.capture.writer.process import ProcessCaptureWriter


def wait_receipt(root: Path, cid: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = find_receipt(root, cid)
        if found is not None:
            return found
        time.sleep(0.02)
    raise AssertionError(f"no manifest for {cid} after {timeout}s")


def assert_published(root: Path, refs_by_cid: dict) -> None:
    """Every capture published ok, with exactly its reference rows."""
    for cid, refs in refs_by_cid.items():
        receipt = wait_receipt(root, cid)
        assert receipt.status == "ok", receipt.error
        cap = read(root / receipt.dir)
        for key, rows in refs.items():
            assert torch.equal(cap.tensor(*key), rows), (cid, key)


@pytest.fixture
def proc_writer(root: Path):
    w = ProcessCaptureWriter(root, budget_bytes=64 << 20, workers=2, ring_bytes=1 << 20)
    assert w.ready.wait(60), "the writer process never said it was ready"
    yield w
    w.shutdown(timeout=30)


def publish_both(proc_writer, threads_root: Path, cid: str, spec, **kw):
    dtype = kw.pop("dtype", torch.float32)
    hidden = kw.pop("hidden", 16)
    prompt_len = kw.pop("prompt_len", 6)
    generated = kw.pop("generated", 4)
    req = make_request(cid, spec, prompt_len, hidden=hidden, dtype=dtype)
    end, refs = feed(proc_writer, req, generated, **kw)
    proc_writer.close(end)
    with CaptureWriter(threads_root, workers=1) as ref_writer:
        ref_end, _ = feed(ref_writer, req, generated, **kw)
        ref_writer.close(ref_end)
        ref_receipt = ref_writer.future(cid).result(30)
    return wait_receipt(proc_writer.root, cid), ref_receipt, refs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["packed", "per_file"])
def test_same_capture_as_the_in_process_writer(proc_writer, root, tmp_path, dtype, layout):
    spec = make_spec(hooks={"resid_post": "all", "resid_mid": [0, -1]}, layout=layout)
    cid = f"same-{layout}-{str(dtype).split('.')[-1]}"
    got, ref, refs = publish_both(proc_writer, tmp_path / "ref", cid, spec, dtype=dtype,
                                  prefill_chunk=4, recompute_from=5)
    assert got.status == ref.status == "ok", (got.error, ref.error)
    mine, theirs = read(root / got.dir), read(tmp_path / "ref" / ref.dir)
    assert mine.positions.tolist() == theirs.positions.tolist() == list(range(9))
    assert mine.token_ids.tolist() == theirs.token_ids.tolist()
    for key in spec.keys():
        assert torch.equal(mine.tensor(*key), theirs.tensor(*key))
        assert torch.equal(mine.tensor(*key), refs[key][:9])
    assert mine.manifest["writer"]["pid"] == proc_writer.child_pid != os.getpid()
    assert mine.manifest["writer"]["engine_pid"] == os.getpid()  # whose rows they are
    assert "engine_pid" not in theirs.manifest["writer"]  # the in-process writer
    assert temp_files(root) == []


def test_rows_wrap_the_ring_wait_for_it_and_go_inline_when_large(proc_writer, root, monkeypatch):
    spec = make_spec(layers=[0, 1], positions="all")
    # 1 MiB ring: 64 captures of 2 keys x 40 rows x 1024 floats (160 KiB a write) wrap it
    # many times and make the parent wait for the child to consume.
    cids = [f"wrap-{i}" for i in range(64)]
    refs_by_cid = {}
    for cid in cids:
        req = make_request(cid, spec, 40, hidden=1024)
        end, refs = feed(proc_writer, req, 1)
        proc_writer.close(end)
        refs_by_cid[cid] = refs
    # One write larger than half the ring crosses inline on the socket.
    big = make_request("wrap-big", spec, 300, hidden=1024)
    end, big_refs = feed(proc_writer, big, 1)
    proc_writer.close(end)
    refs_by_cid["wrap-big"] = big_refs
    assert proc_writer.flush(60)
    assert_published(root, refs_by_cid)
    stats = proc_writer.stats()
    assert stats is not None and stats["process"] == proc_writer.child_pid
    assert stats["inline_writes"] == 2  # the big request's two keys
    assert stats["ring_waits"] > 0
    assert stats["ring_wait_s"] > 0
    assert stats["open_captures"] == 0
    # The same wait, read in the engine's process without asking the child (for
    # capsteer_capture_engine_wait_seconds_total).
    assert proc_writer.engine_wait_s() == {"writer_ring": pytest.approx(stats["ring_wait_s"],
                                                                        abs=1e-5)}
    # ... which /metrics renders as a counter by what was waited for.
    from capsteer.capture import metrics
    from capsteer.server import metrics as server_metrics

    monkeypatch.setattr(metrics.ENGINE_WAITS, "_source", None)
    metrics.ENGINE_WAITS.set_source(proc_writer.engine_wait_s)
    text = server_metrics.render([metrics.snapshot()], 0).decode()
    assert "# TYPE capsteer_capture_engine_wait_seconds_total counter" in text
    (line,) = [ln for ln in text.splitlines()
               if ln.startswith("capsteer_capture_engine_wait_seconds_total{")]
    assert line.startswith('capsteer_capture_engine_wait_seconds_total{wait="writer_ring"} ')
    assert float(line.split()[-1]) == pytest.approx(stats["ring_wait_s"], abs=1e-5)


def _resident_bytes(address: int) -> int:
    """Rss of this process's mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("Rss:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


def test_touch_copy_ring_faults_in_the_copy_ring_and_keeps_rows_in_flight(root):
    ring = 8 << 20
    w = ProcessCaptureWriter(root, budget_bytes=64 << 20, workers=2, ring_bytes=ring)
    try:
        assert w.ready.wait(60)
        mapping = w._ring.data_ptr()
        assert _resident_bytes(mapping) < ring // 2  # untouched: only what was written
        spec = make_spec(layers=[0, 1], positions="all")
        refs_by_cid = {}
        os.kill(w.child_pid, signal.SIGSTOP)  # the child takes no rows out meanwhile
        try:
            for i in range(4):
                req = make_request(f"touch-{i}", spec, 40, hidden=1024)
                end, refs_by_cid[f"touch-{i}"] = feed(w, req, 1)
                w.close(end)
            if not w.touch_copy_ring():  # with 1.3 MB of rows in the ring, unconsumed
                pytest.skip("this kernel refuses MADV_POPULATE_WRITE (Linux < 5.14)")
        finally:
            os.kill(w.child_pid, signal.SIGCONT)
        resident = _resident_bytes(mapping)
        assert ring <= resident < 2 * ring  # the copy ring, not the device ring beside it
        assert w.flush(60)
        assert_published(root, refs_by_cid)
    finally:
        w.shutdown(timeout=30)


def test_the_child_freezes_its_imports_out_of_the_collectors_walks(proc_writer, root):
    """torch and numpy's objects (~170k) live as long as the child: frozen, a full
    collection does not walk them while every writer thread waits on the GIL."""
    spec = make_spec(layers=[0, 1])
    req = make_request("gc-0", spec, 8, hidden=64)
    end, refs = feed(proc_writer, req, 2)
    proc_writer.close(end)
    assert proc_writer.flush(30)
    assert_published(root, {"gc-0": refs})
    stats = proc_writer.stats()
    assert stats is not None
    assert stats["gc_frozen_objects"] > 50_000  # torch was imported before the freeze
    assert "gc_full_collections" in stats
    # the open, the rows and the close crossed in messages the main thread handled
    assert stats["intake_messages"] >= 1
    assert 0 < stats["intake_cpu_s"] and 0 < stats["intake_s"]
    assert stats["inbox_peak_bytes"] > 0  # each came through the inbox


def anon_kib(pid: int) -> int:
    """A process's anonymous resident memory (its heap; not the shared rings)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    raise AssertionError(f"no RssAnon for {pid}")


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt and malloc_trim are glibc's")
def test_the_child_keeps_freed_row_memory_while_busy_and_returns_it_when_idle(root):
    """Rows taken out of the ring go into reused heap pages, not freshly faulted ones: the
    child keeps what publishing freed, and hands it back once idle for idle_trim_s."""
    w = ProcessCaptureWriter(root, budget_bytes=256 << 20, workers=2, ring_bytes=64 << 20,
                             idle_trim_s=2.0)
    try:
        assert w.ready.wait(60), "the writer process never said it was ready"
        spec = make_spec(layers=[0, 1, 2, 3])
        req = make_request("heap-0", spec, 256, hidden=16384)  # 4 keys x 16 MiB of rows
        end, refs = feed(w, req, 1, prefill_chunk=64)
        w.close(end)
        assert w.flush(60)
        held = anon_kib(w.child_pid)  # read within idle_trim_s of the last message
        stats = w.stats()
        assert stats is not None and stats["heap_kept"]
        assert stats["heap_trims"] == 0  # published and freed, but kept for the next rows
        assert_published(root, {"heap-0": refs})
        deadline = time.monotonic() + 20
        while w.stats()["heap_trims"] == 0:
            assert time.monotonic() < deadline, "the idle child never trimmed its heap"
            time.sleep(0.1)
        assert anon_kib(w.child_pid) < held - (32 << 10), held
    finally:
        w.shutdown(timeout=30)


def test_metrics_come_from_the_child(proc_writer, root):
    spec = make_spec(layers=[0])
    for i in range(3):
        req = make_request(f"met-{i}", spec, 4)
        end, _ = feed(proc_writer, req, 2)
        proc_writer.close(end)
    req = make_request("met-aborted", spec, 4)
    feed(proc_writer, req, 2)
    proc_writer.abort("met-aborted", "client went away")
    assert proc_writer.flush(30)
    snap = proc_writer.metrics_snapshot()
    assert sample_value(snap, "capsteer_capture_requests_total", status="ok") == 3
    assert sample_value(snap, "capsteer_capture_requests_total", status="error") == 1
    assert wait_receipt(root, "met-aborted").status == "error"


def test_a_dead_writer_process_ends_its_captures_with_errors_and_serving_goes_on(root):
    w = ProcessCaptureWriter(root, budget_bytes=64 << 20, workers=1, ring_bytes=1 << 20)
    try:
        assert w.ready.wait(60)
        spec = make_spec(layers=[0])
        done_req = make_request("dead-done", spec, 4)
        end, _ = feed(w, done_req, 2)
        w.close(end)
        assert w.flush(30)
        open_req = make_request("dead-open", spec, 4)
        feed(w, open_req, 2)  # opened, rows sent, never closed
        os.kill(w.child_pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while w.failure is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert w.failure is not None and "exited" in w.failure
        assert wait_receipt(root, "dead-done").status == "ok"  # kept, not overwritten
        lost = wait_receipt(root, "dead-open")
        assert lost.status == "error" and "writer process" in lost.error
        # New captures are published in this process from now on.
        after = make_request("dead-after", spec, 4)
        end, refs = feed(w, after, 3)
        w.close(end)
        receipt = wait_receipt(root, "dead-after")
        assert receipt.status == "ok", receipt.error
        assert torch.equal(read(root / receipt.dir).tensor("resid_post", 0), refs[("resid_post", 0)])
        assert w.stats()["failure"] == w.failure
    finally:
        w.shutdown(timeout=30)


def test_engine_process_exit_publishes_closed_and_aborts_open(root):
    """The parent going away (EOF on the link) is a shutdown: closed captures are
    published, open ones get an error outcome, and the child exits."""
    w = ProcessCaptureWriter(root, budget_bytes=64 << 20, workers=1, ring_bytes=1 << 20)
    assert w.ready.wait(60)
    spec = make_spec(layers=[0])
    closed = make_request("eof-closed", spec, 4)
    end, _ = feed(w, closed, 2)
    w.close(end)
    feed(w, make_request("eof-open", spec, 4), 2)
    w.end_step()  # the worker ends every step so: what it had is on the link
    w._closing = True  # as if this process had died: no failover here
    socket.socket(fileno=os.dup(w._conn.fileno())).shutdown(socket.SHUT_RDWR)
    assert w.proc.wait(60) == 0
    assert wait_receipt(root, "eof-closed").status == "ok"
    assert wait_receipt(root, "eof-open").status == "error"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_copy_rows_copies_contiguous_rows_by_memmove_and_others_by_torch(dtype):
    """The ring copy is exact for contiguous rows (the memmove path), strided rows and a
    dtype change (torch's copy), and for zero rows."""
    src = torch.randn(6, 40).to(dtype)
    dst = torch.zeros(6, 40, dtype=dtype)
    copy_rows(dst, src)
    assert torch.equal(dst, src)
    strided = torch.randn(40, 6).to(dtype).t()
    copy_rows(dst, strided)
    assert torch.equal(dst, strided)
    wider = torch.zeros(6, 40, dtype=torch.float64)
    copy_rows(wider, src)
    assert torch.equal(wider, src.double())
    copy_rows(dst[:0], src[:0])


class _DeviceRowsSink:
    """Drives a writer the way the engine's step and sink threads do with rows the GPU
    copies: reserve device-ring space, fill it (here the host stands in for the GPU
    copy), hand it over; a refused reservation takes the copy path (`write`)."""

    def __init__(self, writer) -> None:
        self.writer = writer
        self.reserved = self.refused = 0

    def __getattr__(self, name):
        return getattr(self.writer, name)

    def write(self, capture_id, hook, layer, positions, rows) -> None:
        got = self.writer.reserve_rows(capture_id, tuple(rows.shape), rows.dtype)
        if got is None:
            self.refused += 1
            self.writer.write(capture_id, hook, layer, positions, rows)
            return
        self.reserved += 1
        got.rows.copy_(rows)
        rows.fill_(float("nan"))  # the caller's buffer is reused: the ring holds the rows
        self.writer.write_reserved(got, capture_id, hook, layer, positions)
        self.writer.end_step()


@pytest.mark.parametrize("processes", [1, 2])
def test_rows_copied_into_the_device_ring_publish_like_written_ones(root, processes):
    from capsteer.capture.writer.fanout import ProcessWriterPool

    kw = {"budget_bytes": 64 << 20, "workers": 2, "ring_bytes": 1 << 20}
    writer = ProcessWriterPool(root, processes=processes, **kw) if processes > 1 \
        else ProcessCaptureWriter(root, **kw)
    try:
        assert writer.ready.wait(60)
        spec = make_spec(layers=[0, 1], positions="all")
        req = make_request("before-pin", spec, 4, hidden=256)
        writer.open(req)
        assert writer.reserve_rows("before-pin", (4, 256), torch.float32) is None  # not pinned
        writer.abort("before-pin", "test")
        children = writer.writers if processes > 1 else [writer]
        for child in children:  # what pin_device_ring sets once CUDA page-locked the ring
            child._device_rows = True
        sink = _DeviceRowsSink(writer)
        refs_by_cid = {}
        # 48 captures of 2 keys x 40 rows x 1024 floats (160 KiB a write) wrap each 1 MiB
        # device ring many times; a reservation never waits, so some take the copy path.
        for i in range(48):
            cid = f"dev-{i}"
            end, refs = feed(sink, make_request(cid, spec, 40, hidden=1024), 3,
                             prefill_chunk=16)
            writer.close(end)
            refs_by_cid[cid] = refs
        assert writer.flush(60)
        assert_published(root, refs_by_cid)
        stats = writer.stats()
        assert sink.reserved > 100 and stats["device_writes"] == sink.reserved
        assert stats["device_full"] == sink.refused
        assert stats["open_captures"] == 0
    finally:
        writer.shutdown(timeout=30)


@pytest.mark.parametrize("processes", [1, 2])
def test_deferred_sends_wait_for_the_flush_and_go_as_one_message(root, processes):
    """With defer_sends (the engine's harvester thread), opens, rows, closes and aborts
    stay queued, in order, until flush_sends sends them as one message per child; the
    captures then publish exactly as sent one by one."""
    from capsteer.capture.writer.fanout import ProcessWriterPool

    kw = {"budget_bytes": 64 << 20, "workers": 2, "ring_bytes": 1 << 20}
    writer = ProcessWriterPool(root, processes=processes, **kw) if processes > 1 \
        else ProcessCaptureWriter(root, **kw)
    children = writer.writers if processes > 1 else [writer]
    try:
        assert writer.ready.wait(60)
        writer.defer_sends()
        spec = make_spec(layers=[0, 1], positions="all")
        sends_before = sum(c.sends for c in children)
        refs_by_cid = {}
        for i in range(6):
            cid = f"defer-{i}"
            end, refs = feed(writer, make_request(cid, spec, 6), 3, prefill_chunk=4)
            writer.end_step()  # deferred too
            writer.close(end)
            refs_by_cid[cid] = refs
        feed(writer, make_request("defer-aborted", spec, 4), 1)
        writer.abort("defer-aborted", "client went away")
        time.sleep(0.3)
        assert sum(c.sends for c in children) == sends_before  # nothing left the parent
        assert all(find_receipt(root, cid) is None for cid in [*refs_by_cid, "defer-aborted"])
        writer.flush_sends()
        assert sum(c.sends for c in children) == sends_before + processes
        assert writer.flush(60)
        assert_published(root, refs_by_cid)
        assert wait_receipt(root, "defer-aborted").status == "error"
        assert writer.stats()["open_captures"] == 0
    finally:
        writer.shutdown(timeout=30)


def test_a_deferred_close_still_reaches_the_child_before_a_flush_call(proc_writer, root):
    """flush() (and shutdown) send whatever deferral queued first: nothing is stranded."""
    proc_writer.defer_sends()
    spec = make_spec(layers=[0])
    end, refs = feed(proc_writer, make_request("defer-flush", spec, 5), 2)
    proc_writer.close(end)
    assert proc_writer.flush(60)  # no flush_sends: the call itself sends the queue first
    assert_published(root, {"defer-flush": refs})


@pytest.fixture
def device_ring_pool(root):
    """Two writer processes whose device rings take rows as on a GPU (1 MiB each)."""
    from capsteer.capture.writer.fanout import ProcessWriterPool

    pool = ProcessWriterPool(root, processes=2, budget_bytes=64 << 20, workers=2,
                             ring_bytes=1 << 20)
    try:
        assert pool.ready.wait(60)
        for child in pool.writers:
            child._device_rows = True  # what pin_device_ring sets once CUDA pinned the ring
        yield pool
    finally:
        pool.shutdown(timeout=30)


def test_a_steps_rows_reach_each_writer_ring_in_one_copy(root, device_ring_pool):
    """The engine's step copies its captured rows into the writer processes' device rings:
    laid out writer by writer (the plan's groups, `group_of`), the reservations of one
    writer follow each other in its ring and `merge_row_copies` turns a step's 12 copies
    into one per writer (more only where a ring wraps). What each child publishes is the
    rows it was given."""
    from capsteer.engine_ext.delivery import merge_row_copies

    pool = device_ring_pool
    spec = make_spec(layers=[1], positions="all")
    hidden, chunk, prompt = 256, 8, 40
    cids = [f"grp-{i}" for i in range(12)]
    for cid in cids:
        pool.open(make_request(cid, spec, prompt, hidden=hidden))
    groups = {cid: pool.group_of(cid) for cid in cids}
    assert sorted(set(groups.values())) == [0, 1]
    refs = {cid: reference_rows(cid, ("resid_post", 1), prompt, hidden, torch.float32)
            for cid in cids}
    ordered = sorted(cids, key=groups.get)  # the plan's layout: by group, stable
    merged_counts = []
    for lo in range(0, prompt, chunk):
        staging = torch.cat([refs[cid][lo: lo + chunk] for cid in ordered])
        copies, handed = [], []
        for i, cid in enumerate(ordered):
            got = pool.reserve_rows(cid, (chunk, hidden), torch.float32)
            assert got is not None
            copies.append((got.writer, got.rows, staging[i * chunk: (i + 1) * chunk]))
            handed.append((cid, got))
        merged = merge_row_copies(copies)
        merged_counts.append(len(merged))
        for dst, src in merged:
            dst.copy_(src)
        staging.fill_(float("nan"))  # the step's buffer is reused: the rings hold the rows
        for cid, got in handed:
            pool.write_reserved(got, cid, "resid_post", 1, np.arange(lo, lo + chunk))
        pool.end_step()
    for cid in cids:
        pool.close(CaptureEnd(cid, tuple(range(1000, 1000 + prompt)), finish_reason="length"))
    assert pool.flush(60)
    assert_published(root, {cid: {("resid_post", 1): refs[cid]} for cid in cids})
    # 12 x 8 KiB a step into two 1 MiB rings: no wrap within these five steps
    assert merged_counts == [2] * 5


def test_a_span_reservation_publishes_each_writes_rows_and_frees_the_ring_write_by_write(
        root, device_ring_pool):
    """`reserve_span`: one reservation and one copy for a step's rows of several captures
    at one point. Each part hands over its own rows; the parts end where their rows end,
    so 30 steps of two 48 KiB spans a child wrap each 1 MiB ring about three times (a
    full ring waits for its child) and publish exactly what was copied; a span larger
    than half the ring, or of captures in two children, is refused (the engine then
    reserves write by write)."""
    pool = device_ring_pool
    spec = make_spec(layers=[0, 1], positions="all")
    hidden, chunk, prompt = 256, 8, 240
    cids = [f"span-{i}" for i in range(12)]
    for cid in cids:
        pool.open(make_request(cid, spec, prompt, hidden=hidden))
    by_child = {g: [c for c in cids if pool.group_of(c) == g] for g in (0, 1)}
    assert all(by_child.values())
    assert pool.reserve_span([by_child[0][0], by_child[1][0]], [(chunk, hidden)] * 2,
                             torch.float32) is None  # two children
    assert pool.reserve_span(by_child[0], [(100, hidden)] * len(by_child[0]),
                             torch.float32) is None  # larger than half the ring
    keys = [("resid_post", 0), ("resid_post", 1)]
    refs = {cid: {k: reference_rows(cid, k, prompt, hidden, torch.float32) for k in keys}
            for cid in cids}
    for lo in range(0, prompt, chunk):
        writes = []  # handed over after the step's copies, as the harvester does
        for hook, layer in keys:
            for group in by_child.values():
                staging = torch.cat([refs[c][(hook, layer)][lo: lo + chunk] for c in group])
                deadline = time.monotonic() + 30
                # A full ring waits for the child (the engine would reserve write by
                # write then); a ring never freed would end the test here.
                while (got := pool.reserve_span(group, [(chunk, hidden)] * len(group),
                                                torch.float32)) is None:
                    assert time.monotonic() < deadline, "the ring was never freed"
                    pool.end_step()  # sends what is queued, so the child can free it
                    time.sleep(0.01)
                dst, parts = got
                assert dst.shape == staging.shape and len(parts) == len(group)
                dst.copy_(staging)  # the GPU's one copy
                staging.fill_(float("nan"))
                for i, (cid, part) in enumerate(zip(group, parts, strict=True)):
                    assert part.rows.data_ptr() == dst[i * chunk].data_ptr()
                    writes.append((part, cid, hook, layer, np.arange(lo, lo + chunk)))
        for write in writes:
            pool.write_reserved(*write)
        pool.end_step()
    for cid in cids:
        pool.close(CaptureEnd(cid, tuple(range(1000, 1000 + prompt)), finish_reason="length"))
    assert pool.flush(60)
    assert_published(root, refs)
    stats = pool.stats()
    assert stats["device_writes"] == len(cids) * len(keys) * (prompt // chunk)


def test_rows_written_under_two_keys_free_the_ring_only_with_the_last(proc_writer, root):
    """One reservation's rows handed over under two (hook, layer) keys (resid_post at
    layer l is resid_pre at l+1): the first write (`frees=False`) leaves the device ring's
    consumed counter where it was, so the engine cannot copy new rows over them before
    the child took them for the second key; the last write frees them."""
    import struct

    proc_writer._device_rows = True  # what pin_device_ring sets once CUDA pinned the ring
    spec = make_spec(layers=[0, 1], positions="all")
    proc_writer.open(make_request("two-keys", spec, 4, hidden=256))
    ref = reference_rows("two-keys", ("resid_post", 0), 4, 256, torch.float32)
    got = proc_writer.reserve_rows("two-keys", (4, 256), torch.float32)
    got.rows.copy_(ref)

    def consumed() -> int:
        return struct.unpack_from("<Q", proc_writer._mm, 8)[0]

    def handed(write_key: tuple[str, int], frees: bool) -> None:
        taken = proc_writer.stats()["intake_messages"]
        proc_writer.write_reserved(got, "two-keys", *write_key, np.arange(4), frees=frees)
        proc_writer.end_step()
        deadline = time.monotonic() + 30
        while proc_writer.stats()["intake_messages"] == taken:  # the child handled it
            assert time.monotonic() < deadline
            time.sleep(0.01)

    before = consumed()
    handed(("resid_post", 0), frees=False)
    assert consumed() == before < got.end
    handed(("resid_post", 1), frees=True)
    assert consumed() == got.end
    proc_writer.close(CaptureEnd("two-keys", tuple(range(1000, 1004)), finish_reason="length"))
    assert proc_writer.flush(60)
    assert_published(root, {"two-keys": {("resid_post", 0): ref, ("resid_post", 1): ref}})


def test_merge_row_copies_joins_only_copies_that_continue_each_other():
    from capsteer.engine_ext.delivery import merge_row_copies

    staging = torch.arange(80.0).view(20, 4)
    a, b = object(), object()
    # (owner, ring, its rows, staging rows)
    plan = [(a, "a", (0, 3), (0, 3)), (a, "a", (3, 5), (3, 5)),  # joined
            (b, "b", (0, 2), (5, 7)),  # another owner
            (a, "a", (5, 6), (10, 11)),  # the source does not continue
            (a, "a", (8, 9), (11, 12)),  # the destination does not continue
            (b, "a", (9, 10), (12, 13))]  # continues both, but another owner

    def copies_into(rings):
        return [(owner, rings[name][d0:d1], staging[s0:s1])
                for owner, name, (d0, d1), (s0, s1) in plan]

    merged_rings = {"a": torch.zeros(20, 4), "b": torch.zeros(20, 4)}
    merged = merge_row_copies(copies_into(merged_rings))
    ring_a = merged_rings["a"]
    assert [(d.shape[0], d.data_ptr()) for d, _ in merged] == [
        (5, ring_a.data_ptr()), (2, merged_rings["b"].data_ptr()), (1, ring_a[5].data_ptr()),
        (1, ring_a[8].data_ptr()), (1, ring_a[9].data_ptr())]
    for dst, src in merged:
        dst.copy_(src)
    one_by_one = {"a": torch.zeros(20, 4), "b": torch.zeros(20, 4)}
    for _, dst, src in copies_into(one_by_one):
        dst.copy_(src)
    for name in "ab":
        assert torch.equal(merged_rings[name], one_by_one[name])


def test_the_childs_inbox_takes_messages_off_the_link_in_order_within_its_bound():
    """The child reads the link on a thread of its own into a bounded inbox, so the
    engine's sends return while the child is still handling earlier messages. Order is
    kept; a full inbox holds the reader back (and with it the link, as before); one
    message larger than the bound still enters an empty inbox; a closed link ends it."""
    import threading
    from multiprocessing import Pipe

    from capsteer.capture.writer.child import Inbox as _Inbox

    inbox = _Inbox(limit=100)
    assert inbox.get(timeout=0.01) is _Inbox.IDLE
    inbox.put(b"a" * 60, 60)
    held = threading.Thread(target=inbox.put, args=(b"b" * 60, 60), daemon=True)
    held.start()
    held.join(0.3)
    assert held.is_alive()  # 60 + 60 > 100: waits for the handler
    assert inbox.get() == b"a" * 60
    held.join(5)
    assert not held.is_alive() and inbox.get() == b"b" * 60
    inbox.put(b"c" * 500, 500)  # larger than the bound, into an empty inbox
    assert inbox.get() == b"c" * 500 and inbox.bytes == 0 and inbox.peak == 500

    reader_end, engine_end = Pipe(duplex=False)
    inbox = _Inbox(limit=1 << 20)
    reader = threading.Thread(target=inbox.read_from, args=(reader_end,), daemon=True)
    reader.start()
    sent = [bytes([i]) * (1000 * i + 1) for i in range(20)]
    for msg in sent:  # none of these waits for a get: the reader drains the link
        engine_end.send_bytes(msg)
    engine_end.close()
    assert [inbox.get(timeout=10) for _ in sent] == sent
    assert inbox.get(timeout=10) is _Inbox.EOF
    reader.join(5)
    assert not reader.is_alive()
