"""The sharded layout: many requests per shard, index after durability, resume;
full shards written on background threads (backpressure, errors, crash at any point)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from capture_helpers import feed, make_request, make_spec, temp_files
from safetensors.torch import load_file

from capsteer.capture import read
from capsteer.capture.cli import main as cli_main
from capsteer.capture.publish import FileSystem
from capsteer.capture.sharded import INDEX_FILE, indexed_ids, read_index, read_sharded
from capsteer.capture.sink import CaptureEnd, MemorySink
from capsteer.capture.writer.shard_sink import ShardedSink
from capsteer.capture.writer.sharded import ShardedWriter

KEYS = [("resid_post", 0), ("resid_mid", 2)]
H = 8


def _req(i: int) -> tuple[str, np.ndarray, np.ndarray, dict]:
    n = 3 + i % 4
    g = torch.Generator().manual_seed(i)
    tensors = {k: torch.randn(n, H, generator=g).to(torch.bfloat16) for k in KEYS}
    return f"r{i}", np.arange(n), np.arange(100 + i, 100 + i + n), tensors


def _writer(d: Path, **kw) -> ShardedWriter:
    return ShardedWriter(d, keys=KEYS, hidden_size=H, dtype=torch.bfloat16, **kw)


def test_shards_index_manifest_and_plain_safetensors(tmp_path):
    d = tmp_path / "job"
    durable: list[str] = []
    w = _writer(d, shard_bytes=200)  # ~2-3 requests per shard
    w.add_done_callback(durable.extend)
    reqs = [_req(i) for i in range(10)]
    for rid, pos, tok, tensors in reqs:
        w.add(rid, pos, tok, tensors, prompt_tokens=len(pos))
    w.close()
    assert durable == [r[0] for r in reqs]
    index = [json.loads(line) for line in (d / INDEX_FILE).read_text().splitlines()]
    assert [e["id"] for e in index] == [r[0] for r in reqs]
    manifest = json.loads((d / "manifest.json").read_text())
    assert len(manifest["shards"]) >= 3 and manifest["requests"] == 10
    for e, (_, pos, tok, tensors) in zip(index, reqs, strict=True):
        shard = load_file(d / e["shard"])  # plain safetensors
        sl = slice(e["row_start"], e["row_start"] + e["row_count"])
        assert shard["positions"][sl].tolist() == pos.tolist()
        assert shard["token_ids"][sl].tolist() == tok.tolist()
        for k in KEYS:
            assert torch.equal(shard[f"{k[0]}.{k[1]}"][sl], tensors[k])
    job = read(d)
    assert job.ids() == [r[0] for r in reqs]
    got = job.request("r5")
    assert torch.equal(got[("resid_mid", 2)], reqs[5][3][("resid_mid", 2)])
    assert torch.equal(got[("post_attn", 2)], got[("resid_mid", 2)])  # an alias, as read() takes
    for missing in (("resid_mid", 9), ("nonsense", 2)):
        with pytest.raises(KeyError, match="was not captured"):
            got[missing]
    with pytest.raises(KeyError, match="not in the job"):
        job.request("r-none")
    assert cli_main(["verify", str(d)]) == 0


def test_resume_skips_done_and_repairs_after_crash(tmp_path):
    d = tmp_path / "job"
    w = _writer(d, shard_bytes=1 << 30)
    for i in range(4):
        rid, pos, tok, tensors = _req(i)
        w.add(rid, pos, tok, tensors, len(pos))
    w.flush()
    # Simulate crashes: an orphan shard (published, never indexed), a torn index line,
    # and a manifest that lags the index.
    orphan = d / "shard-00007.safetensors"
    orphan.write_bytes((d / "shard-00000.safetensors").read_bytes())
    with open(d / INDEX_FILE, "a") as fh:
        fh.write('{"id": "r9", "sha')
    lagging = json.loads((d / "manifest.json").read_text())
    (d / "manifest.json").unlink()
    w2 = _writer(d, shard_bytes=1 << 30)
    assert not orphan.exists()
    assert (d / INDEX_FILE).read_text().endswith("\n")
    assert w2.done_ids == {"r0", "r1", "r2", "r3"}
    rebuilt = json.loads((d / "manifest.json").read_text())
    assert rebuilt["shards"] == lagging["shards"]
    for i in range(6):  # a re-run of the same job: 0-3 skipped, 4-5 added
        rid, pos, tok, tensors = _req(i)
        w2.add(rid, pos, tok, tensors, len(pos))
    w2.close()
    job = read(d)
    assert job.ids() == [f"r{i}" for i in range(6)]
    assert len(job.manifest["shards"]) == 2
    assert not [p for p in os.listdir(d) if p.startswith(".")]


def test_sharded_sink_from_engine_rows(tmp_path):
    spec = make_spec(hooks={"resid_post": [0], "resid_mid": [2]}, positions="all")
    w = ShardedWriter(tmp_path / "sj", keys=spec.keys(), hidden_size=H, dtype=torch.float32)
    sink = ShardedSink(w)
    refs = {}
    for i in range(3):
        req = make_request(f"s{i}", spec, 4 + i, hidden=H)
        end, refs[req.request_id] = feed(sink, req, 3, prefill_chunk=2, recompute_from=3)
        sink.close(end)
    w.close()
    job = read(tmp_path / "sj")
    for rid, ref in refs.items():
        got = job.request(rid)
        for k in spec.keys():
            assert torch.equal(got[k], ref[k])


# --------------------------------------------------------- background flushes
GOLDEN = {  # written by the synchronous writer this one replaced: same bytes, same index
    "index.jsonl": "44149c033685a63f0fa19e337629becf6cd5a468c4cc9c2cf93f23e1c86c2a89",
    "shard-00000.safetensors": "85bdec7f7b419ff0f045618c3ed20b053744a078fdfb7c3f2494d0b1560375ce",
    "shard-00001.safetensors": "1dcb38205e5038dabab355143a0c5be2a1921e5f7f1f9ee65aa35136a9fadd9e",
    "shard-00002.safetensors": "58563643ee038c2bfaf6405fe30aaf668128a396bef52f2ce4e12d221f3218e0",
    "shard-00003.safetensors": "21365045aa8ff18ce4156b83ff1a9885f8e7add05d6f5aa3ba46708c2d4d3f8b",
}


def _det(i: int) -> tuple[str, np.ndarray, np.ndarray, dict]:
    """Deterministic without an RNG, so the golden hashes do not depend on torch's."""
    n = 2 + i % 5
    base = torch.arange(n * H, dtype=torch.float32).reshape(n, H)
    tensors = {k: ((base + 1000 * i + 100 * j) / 64).to(torch.bfloat16) for j, k in enumerate(KEYS)}
    return f"d{i}", np.arange(n) + i, np.arange(n) + 7 * i, tensors


def _shard_of(fd: int) -> bool:
    return ".shard-" in os.readlink(f"/proc/self/fd/{fd}")


class GateFS(FileSystem):
    """Shard writes wait until `gate` is set (a disk that is slower than the caller)."""

    def __init__(self) -> None:
        self.gate = threading.Event()

    def write(self, fd: int, data: memoryview) -> int:
        if _shard_of(fd):
            assert self.gate.wait(30), "test never opened the gate"
        return os.write(fd, data)

    def writev(self, fd: int, buffers: list[memoryview]) -> int:
        if _shard_of(fd):
            assert self.gate.wait(30), "test never opened the gate"
        return os.writev(fd, buffers)


class FailFS(FileSystem):
    """ENOSPC on shard writes / index fsyncs / manifest fsyncs while `fail` names it."""

    def __init__(self, fail: str | None = None) -> None:
        self.fail = fail
        self.failures = 0

    def _maybe_fail(self, where: str) -> None:
        if self.fail == where:
            self.failures += 1
            raise OSError(errno.ENOSPC, f"injected: no space ({where})")

    def write(self, fd: int, data: memoryview) -> int:
        if _shard_of(fd):
            self._maybe_fail("shard_write")
        return os.write(fd, data)

    def writev(self, fd: int, buffers: list[memoryview]) -> int:
        if _shard_of(fd):
            self._maybe_fail("shard_write")
        return os.writev(fd, buffers)

    def fsync(self, fd: int) -> None:
        target = os.readlink(f"/proc/self/fd/{fd}")
        if target.endswith(INDEX_FILE):
            self._maybe_fail("index_fsync")
        if ".manifest.json." in target:
            self._maybe_fail("manifest_fsync")
        os.fsync(fd)


def _hashes(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.iterdir()) if p.name != "manifest.json"}


def _check_job(d: Path, reqs: list) -> None:
    """Every request exactly once, rows equal to what was added, manifest == index."""
    job = read_sharded(d)  # verifies sizes and sha256 of every listed shard
    assert sorted(job.ids()) == sorted(r[0] for r in reqs)
    assert len(job.ids()) == len(set(job.ids()))
    assert {e["shard"] for e in job.index} == {s["name"] for s in job.manifest["shards"]}
    for rid, pos, tok, tensors in reqs:
        got = job.request(rid)
        assert got["positions"].tolist() == pos.tolist()
        assert got["token_ids"].tolist() == tok.tolist()
        for k in KEYS:
            assert torch.equal(got[k], tensors[k])
    assert not temp_files(d)


@pytest.mark.parametrize("threads,pending", [(1, 1), (2, 2), (3, 4)])
def test_background_flush_writes_the_same_bytes(tmp_path, threads, pending):
    d = tmp_path / "job"
    w = _writer(d, shard_bytes=300, flush_threads=threads, max_pending=pending)
    durable: list[str] = []
    w.add_done_callback(durable.extend)
    reqs = [_det(i) for i in range(11)]
    for rid, pos, tok, tensors in reqs:
        w.add(rid, pos, tok, tensors, prompt_tokens=len(pos) + 1)
    w.flush()
    assert durable == [r[0] for r in reqs]  # indexed in hand-off order
    assert w.done_ids == {r[0] for r in reqs}
    assert _hashes(d) == GOLDEN
    index = [json.loads(line) for line in (d / INDEX_FILE).read_text().splitlines()]
    for e in index:  # plain safetensors reader, too
        rid, pos, tok, tensors = reqs[int(e["id"][1:])]
        shard = load_file(d / e["shard"])
        sl = slice(e["row_start"], e["row_start"] + e["row_count"])
        assert shard["positions"][sl].tolist() == pos.tolist()
        assert torch.equal(shard["resid_mid.2"][sl], tensors[("resid_mid", 2)])
    _check_job(d, reqs)
    w.close()


def _run_in_thread(fn) -> threading.Event:
    done = threading.Event()

    def run() -> None:
        fn()
        done.set()

    threading.Thread(target=run, daemon=True).start()
    return done


def test_add_returns_during_slow_flush_and_blocks_at_max_pending(tmp_path):
    fs = GateFS()
    w = _writer(tmp_path / "job", shard_bytes=1, fs=fs, flush_threads=2, max_pending=2)
    reqs = [_req(i) for i in range(3)]  # shard_bytes=1: every request fills a shard
    try:
        two = _run_in_thread(lambda: [w.add(r, p, t, x, len(p)) for r, p, t, x in reqs[:2]])
        assert two.wait(10), "add waited for a shard write"
        assert indexed_ids(tmp_path / "job") == set()  # both shards are still being written
        third = _run_in_thread(lambda: w.add(*reqs[2][:4], len(reqs[2][1])))
        assert not third.wait(0.5), "add did not wait with max_pending shards in flight"
    finally:
        fs.gate.set()
    assert third.wait(10)
    w.close()
    assert indexed_ids(tmp_path / "job") == {"r0", "r1", "r2"}
    assert len(json.loads((tmp_path / "job" / "manifest.json").read_text())["shards"]) == 3
    _check_job(tmp_path / "job", reqs)


@pytest.mark.parametrize("where", ["shard_write", "index_fsync"])
def test_background_write_error_surfaces_and_data_is_kept(tmp_path, where):
    d = tmp_path / "job"
    fs = FailFS(where)
    w = _writer(d, shard_bytes=200, fs=fs)
    reqs = [_req(i) for i in range(8)]
    for rid, pos, tok, tensors in reqs[:3]:  # the third add hands off a shard
        w.add(rid, pos, tok, tensors, len(pos))
    deadline = time.monotonic() + 10
    with pytest.raises(OSError) as raised:  # the failure reaches the caller's thread
        while time.monotonic() < deadline:
            w.add(*reqs[0][:4], len(reqs[0][1]))  # a duplicate: only reports errors
            time.sleep(0.01)
    assert raised.value.errno == errno.ENOSPC and fs.failures >= 1
    assert indexed_ids(d) == set()
    for rid, pos, tok, tensors in reqs[3:]:  # the caller keeps going; retries fail too
        try:
            w.add(rid, pos, tok, tensors, len(pos))
        except OSError:
            pass
    with pytest.raises(OSError):
        w.flush()  # flush raises when anything failed
    assert indexed_ids(d) == set()
    fs.fail = None  # space again: the kept batches are written by the next flush
    w.flush()
    assert indexed_ids(d) == {r[0] for r in reqs}
    names = sorted(p.name for p in d.glob("shard-*.safetensors"))
    assert names == [f"shard-{n:05d}.safetensors" for n in range(len(names))]  # numbers kept
    _check_job(d, reqs)
    lines = (d / INDEX_FILE).read_text().splitlines()
    assert len(lines) == len(reqs)  # no torn or repeated line from the failed appends
    w.close()


def test_manifest_error_surfaces_and_flush_rewrites_it(tmp_path):
    d = tmp_path / "job"
    fs = FailFS("manifest_fsync")
    w = _writer(d, shard_bytes=1 << 30, fs=fs)
    reqs = [_req(i) for i in range(3)]
    for rid, pos, tok, tensors in reqs:
        w.add(rid, pos, tok, tensors, len(pos))
    with pytest.raises(OSError):
        w.flush()
    assert indexed_ids(d) == {"r0", "r1", "r2"}  # the index is the truth: durable
    fs.fail = None
    w.flush()
    _check_job(d, reqs)


def test_sink_hands_the_writer_views_not_copies(tmp_path):
    spec = make_spec(hooks={"resid_post": [0], "resid_mid": [2]}, positions="all")
    w = ShardedWriter(tmp_path / "v", keys=spec.keys(), hidden_size=H, dtype=torch.float32)
    sink = ShardedSink(w)
    req = make_request("v0", spec, 6, hidden=H)
    sink.open(req)
    sent = {}
    for k in spec.keys():
        sent[k] = torch.randn(6, H)
        sink.write("v0", k[0], k[1], np.arange(6), sent[k])
    sink.close(CaptureEnd("v0", tuple(range(6))))
    (buffered,) = w._buf
    for k in spec.keys():
        (piece,) = buffered.pieces[k]
        assert piece.data_ptr() == sent[k].data_ptr()  # no per-request copy on the caller
    w.close()
    assert torch.equal(read(tmp_path / "v").request("req-v0")[spec.keys()[0]], sent[spec.keys()[0]])


@pytest.mark.parametrize("positions", ["all", "prompt", "generated", "last", [0, 3, 4, 9]])
def test_sharded_sink_matches_memory_sink(tmp_path, positions):
    """Against MemorySink (RowsByPosition): repeats, chunked prefill, decode, dtype cast."""
    spec = make_spec(hooks={"resid_post": [0], "resid_mid": [2]}, positions=positions)
    w = ShardedWriter(tmp_path / "m", keys=spec.keys(), hidden_size=H, dtype=torch.bfloat16,
                      shard_bytes=2000)
    sink, mem = ShardedSink(w), MemorySink()
    for i, (prompt, generated) in enumerate([(7, 3), (5, 30), (12, 1), (4, 20)]):
        req = make_request(f"m{i}", spec, prompt, hidden=H)  # float32 rows, bf16 shards
        for s in (sink, mem):
            end, _ = feed(s, req, generated, prefill_chunk=3, recompute_from=prompt - 2)
            s.close(end)
    w.close()
    job = read(tmp_path / "m")
    for cid, want in mem.take([f"m{i}" for i in range(4)]).items():
        got = job.request(f"req-{cid}")
        assert got["positions"].tolist() == want.positions.tolist()
        assert got["token_ids"].tolist() == want.token_ids.tolist()
        for k in spec.keys():  # MemorySink has no tensor for a key that kept no row
            ref = want.tensors.get(k, torch.zeros(0, H)).to(torch.bfloat16)
            assert torch.equal(got[k], ref), (cid, k)


# ----------------------------------------------------------------- crash sweep
def _write_job(d: Path, reqs: list, crash_at: int | None = None) -> int:
    """Write `reqs`; with `crash_at`, the process dies (os._exit) right after its
    `crash_at`-th fsync: a crash between any two durable steps. Returns the fsyncs done."""
    count = 0

    class CrashFS(FileSystem):
        def fsync(self, fd: int) -> None:
            nonlocal count
            os.fsync(fd)
            count += 1
            if count == crash_at:
                os._exit(17)

    w = _writer(d, shard_bytes=250, fs=CrashFS())
    for rid, pos, tok, tensors in reqs:
        w.add(rid, pos, tok, tensors, len(pos))
    w.close()
    return count


def _crash_run(d: Path, reqs: list, crash_at: int) -> None:
    """_write_job in a forked child, so the crash kills only the child."""
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        code = 1
        try:
            _write_job(d, reqs, crash_at)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 17, status


def test_resume_after_a_crash_at_any_point(tmp_path):
    reqs = [_req(i) for i in range(9)]
    total = _write_job(tmp_path / "clean", reqs)
    assert total >= 12
    orphans = 0
    for crash_at in range(1, total + 1):
        d = tmp_path / f"crash{crash_at}"
        _crash_run(d, reqs, crash_at)
        indexed = {e["shard"] for e in read_index(d / INDEX_FILE)}
        orphans += any(p.name not in indexed for p in d.glob("shard-*.safetensors"))
        w = _writer(d, shard_bytes=250)  # a re-run of the job: skips what is indexed
        for rid, pos, tok, tensors in reqs:
            w.add(rid, pos, tok, tensors, len(pos))
        w.close()
        _check_job(d, reqs)
    assert orphans, "no crash point fell between a shard's commit and its index append"


def test_open_job_yields_exactly_the_indexed_rows(tmp_path):
    """The training-loop loader: every indexed row once (count, values, token ids,
    positions), in index order or shuffled across shards; a DataLoader batches it."""
    from capsteer.capture import open_job

    d = tmp_path / "job"
    w = _writer(d, shard_bytes=200)
    reqs = [_req(i) for i in range(12)]
    for rid, pos, tok, tensors in reqs:
        w.add(rid, pos, tok, tensors, prompt_tokens=len(pos))
    w.close()
    assert len(read_sharded(d).manifest["shards"]) > 3
    want = [(rid, int(p), int(t), tensors[("resid_mid", 2)][k])
            for rid, pos, tok, tensors in reqs for k, (p, t) in enumerate(zip(pos, tok, strict=True))]

    rows = open_job(d, "resid_mid", 2)
    assert len(rows) == len(want)
    for got, (rid, p, t, value) in zip(rows, want, strict=True):
        assert (got["id"], got["position"], got["token_id"]) == (rid, p, t)
        assert torch.equal(got["activation"], value)

    shuffled = list(open_job(d, "post_attn", 2, shuffle=True, seed=3))
    assert [r["id"] for r in shuffled] != [w_[0] for w_ in want]
    assert sorted((r["id"], r["position"]) for r in shuffled) == sorted((r, p) for r, p, _, _ in want)
    first = {r["id"] for r in shuffled[: len(shuffled) // 4]}
    assert len(first) > 3  # the permutation spans requests in many shards

    batch = next(iter(torch.utils.data.DataLoader(rows, batch_size=5, shuffle=True)))
    assert batch["activation"].shape == (5, H) and batch["activation"].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="name one"):
        open_job(d)  # two keys: which one?
    with pytest.raises(KeyError):
        open_job(d, "resid_post", 1)


def test_large_rows_go_out_by_writev_and_its_errors_surface_too(tmp_path):
    """Pieces of 1 MiB and more are batched into writev calls (AtomicFile.write_pieces):
    a failure there reaches the caller as a small write's does, the batch is kept, and
    the next flush writes shards that read back exactly."""
    hidden, n = 2048, 300  # 1.2 MiB of bf16 rows per request and key
    d = tmp_path / "job"

    class FailWritev(FailFS):  # single writes (the buffered header) go through
        def write(self, fd: int, data: memoryview) -> int:
            return os.write(fd, data)

    fs = FailWritev("shard_write")
    w = ShardedWriter(d, keys=KEYS, hidden_size=hidden, dtype=torch.bfloat16,
                      shard_bytes=4 << 20, fs=fs)
    reqs = []
    for i in range(4):
        g = torch.Generator().manual_seed(i)
        tensors = {k: torch.randn(n, hidden, generator=g).to(torch.bfloat16) for k in KEYS}
        reqs.append((f"big{i}", np.arange(n), np.arange(n) + i, tensors))
    for rid, pos, tok, tensors in reqs:
        try:
            w.add(rid, pos, tok, tensors, n)
        except OSError:
            pass
    with pytest.raises(OSError) as raised:
        w.flush()
    assert raised.value.errno == errno.ENOSPC and fs.failures >= 1  # from writev only
    fs.fail = None
    w.flush()
    w.close()
    _check_job(d, reqs)
