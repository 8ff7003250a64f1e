"""Extraction on Ray Data (issue 14): two engine replicas write one job directory whose rows
equal a single-engine run of the same input; a job killed mid-run and resumed holds every
id exactly once. Also the driver's commit/recovery of replicas' staging directories, with
real shard writers and no engine, and the refusals."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

from capsteer.capture import open_job
from capsteer.capture.digests import entry_digest
from capsteer.capture.sharded import read_index, read_sharded
from capsteer.capture.writer.sharded import ShardedWriter
from capsteer.extract import extract
from capsteer.extract_ray import STAGING_DIR, JobCommitter, RayMissing

from .helpers import extraction_records

# Eager engines start in seconds instead of ~60 s of compilation on this CPU; the Ray path
# is the same either way (compiled captures are covered by the other engine tests).
# An explicit KV size: a memory fraction (vLLM CPU: fraction x node memory minus the
# process's own RSS) left these small engines a margin the RSS could exceed (CI: -0.15 GiB).
KV_BYTES = 128 << 20
ENGINE = dict(dtype="float32", max_model_len=512, kv_cache_memory_bytes=KV_BYTES,
              max_num_seqs=8, enforce_eager=True)
FLAGS = ["--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory-bytes",
         str(KV_BYTES), "--max-num-seqs", "8", "--enforce-eager"]
# Layers 0-2 of the demo model's 4: the replicas' forwards stop after layer 2.
JOB = dict(hooks=["resid_post", "mlp_out"], layers="0-2", positions="prompt",
           shard_size=16 << 10, progress=False)


def _records(n: int) -> list[dict]:
    return extraction_records(n, spread=11)


def _index_ids(out: Path) -> list[str]:
    return [str(e["id"]) for e in read_index(out / "index.jsonl")]


# ---------------------------------------------------------------- no engine needed
def _staged(out: Path, replica: str, requests: dict[str, int], shard_bytes: int) -> None:
    """A replica's staging job written by a real ShardedWriter: request `rid` holds `n`
    rows filled with its number."""
    with ShardedWriter(out / STAGING_DIR / replica, keys=[("resid_post", 0)], hidden_size=4,
                       dtype=torch.float32, shard_bytes=shard_bytes, job_id=out.name) as w:
        for rid, n in requests.items():
            value = float(int(rid[1:]))
            w.add(rid, np.arange(n), np.arange(n) + 100, {("resid_post", 0):
                                                           torch.full((n, 4), value)}, n)


def _staging_rows(out: Path, replica: str) -> list[dict]:
    return [{**e, "replica": replica} for e in read_index(out / STAGING_DIR / replica /
                                                              "index.jsonl")]


def test_driver_recovers_staged_work_exactly_once(tmp_path):
    """Killed between a link (listed in the manifest) and its index append, with a torn
    index line and a shard only partly indexed: reopening deletes the unindexed link and
    relists, cuts the line, and commits the staged rest under the shard's existing job
    name; a request staged twice (redone after an earlier kill) is indexed once."""
    out = tmp_path / "job"
    _staged(out, "r-a", {"a1": 2, "a2": 3, "a3": 1}, shard_bytes=1 << 20)  # one shard
    _staged(out, "r-b", {"a3": 1, "b4": 2, "b5": 4}, shard_bytes=1)  # a shard each
    committer = JobCommitter(out)
    a_rows = _staging_rows(out, "r-a")
    assert committer.commit(a_rows[:1]) == 1  # a1 only, as if killed right after
    assert committer.commit(a_rows[:1]) == 0  # reported again: indexed once
    committer._link("r-b", "shard-00000.safetensors")  # linked and listed, then killed
    committer._write_manifest()
    assert "shard-00001.safetensors" in {f["name"] for f in read_sharded(out).manifest["files"]}
    with open(out / "index.jsonl", "ab") as fh:
        fh.write(b'{"id":"b4","shard":"shard-00001.safet')  # torn by the kill

    reopened = JobCommitter(out)
    assert not (out / "shard-00001.safetensors").exists(), "unindexed link kept"
    assert read_sharded(out).manifest["requests"] == 1  # relisted without it, and verifies
    assert reopened.merge_staging() == 4  # a2, a3, b4, b5
    assert not (out / STAGING_DIR).exists()

    ids = _index_ids(out)
    assert sorted(ids) == ["a1", "a2", "a3", "b4", "b5"]
    by_id = {e["id"]: e for e in read_index(out / "index.jsonl")}
    assert by_id["a2"]["shard"] == by_id["a1"]["shard"] == "shard-00000.safetensors"
    job = read_sharded(out)  # every listed shard verifies
    assert job.manifest["requests"] == 5 and job.manifest["format"] == "capsteer.sharded"
    assert job.manifest["job_id"] == "job"
    for rid in ids:
        got = job.request(rid)
        n = {"a1": 2, "a2": 3, "a3": 1, "b4": 2, "b5": 4}[rid]
        assert torch.equal(got[("resid_post", 0)], torch.full((n, 4), float(int(rid[1:]))))
        assert list(got["positions"]) == list(range(n))
        assert list(got["token_ids"]) == list(range(100, 100 + n))
    assert len(open_job(out)) == 12


def test_ray_and_single_engine_jobs_resume_each_other(tmp_path):
    """A job begun by one engine's writer and continued by the Ray driver, then by a
    single-engine writer again, stays one job: ids once, shards numbered on, verifying."""
    out = tmp_path / "job"
    keys = [("resid_post", 0)]
    with ShardedWriter(out, keys=keys, hidden_size=4, dtype=torch.float32, shard_bytes=1) as w:
        w.add("s1", np.arange(2), np.arange(2), {keys[0]: torch.full((2, 4), 1.0)}, 2)
    _staged(out, "r-a", {"a2": 3}, shard_bytes=1)
    committer = JobCommitter(out)
    assert committer.merge_staging() == 1
    with ShardedWriter(out, keys=keys, hidden_size=4, dtype=torch.float32, shard_bytes=1) as w:
        assert w.done_ids == {"s1", "a2"}
        w.add("s3", np.arange(1), np.arange(1), {keys[0]: torch.full((1, 4), 3.0)}, 1)
    job = read_sharded(out)
    assert job.ids() == ["s1", "a2", "s3"]
    assert [s["name"] for s in job.manifest["shards"]] == [
        "shard-00000.safetensors", "shard-00001.safetensors", "shard-00002.safetensors"]
    assert torch.equal(job.request("a2")[keys[0]], torch.full((3, 4), 2.0))


def test_ray_data_reads_the_records_read_records_reads(tmp_path):
    """JSONL (read_text), Parquet (read_parquet) and JSONL without ids (numbered by the
    driver) reach the replicas as the records a single-engine job reads, done ids left out."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import ray

    from capsteer.extract import read_records
    from capsteer.extract_ray import _dataset, _Job, scan_ids

    records = _records(12)
    records[2]["messages"].append({"role": "assistant", "content": "ok", "name": "x"})
    named = tmp_path / "named.jsonl"
    named.write_text("".join(json.dumps(r) + "\n" + ("\n" if i == 3 else "")
                             for i, r in enumerate(records)))
    parquet = tmp_path / "named.parquet"
    message = pa.struct([("role", pa.string()), ("content", pa.string()), ("name", pa.string())])
    schema = pa.schema([("id", pa.string()), ("prompt", pa.string()),
                        ("messages", pa.list_(message))])
    pq.write_table(pa.Table.from_pylist(records, schema=schema), parquet)
    unnamed = tmp_path / "unnamed.jsonl"
    unnamed.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "id"}) + "\n"
                               for r in records))
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        for path in (named, parquet, unnamed):
            ids, all_named = scan_ids(path)
            assert all_named == (path != unnamed)
            want = read_records(path)
            assert ids == [r.id for r in want]
            skip = frozenset(ids[:3])
            job = _Job("m", path, tmp_path / "job", None, 1, 1, False, None, 1, 4, {}, "sha256")
            got = sorted(_dataset(ray, job, skip, all_named).take_all(), key=lambda r: r["id"])
            assert [r["id"] for r in got] == sorted(ids[3:])
            by_id = {r.id: r for r in want}
            for row in got:
                rec = by_id[row["id"]]
                assert row["prompt"] == rec.prompt
                messages = None if row["messages"] is None else json.loads(row["messages"])
                assert messages == rec.messages, (path.name, row["id"])
    finally:
        ray.shutdown()


def test_ray_options_are_refused_when_misused(tmp_path, monkeypatch):
    inp = tmp_path / "p.jsonl"
    inp.write_text('{"id": "x", "prompt": "hello"}\n')
    with pytest.raises(ValueError, match="need ray=True"):
        extract("unused", inp, tmp_path / "job", num_replicas=2)
    with pytest.raises(ValueError, match="do not pass engine"):
        extract("unused", inp, tmp_path / "job", ray=True, engine=object())
    with pytest.raises(ValueError, match="pipeline-parallel-size"):
        extract("unused", inp, tmp_path / "job", ray=True, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="num_replicas must be >= 1"):
        extract("unused", inp, tmp_path / "job", ray=True, num_replicas=0)
    monkeypatch.setitem(sys.modules, "ray", None)  # as if capsteer[ray] were not installed
    with pytest.raises(RayMissing, match=r"pip install 'capsteer\[ray\]'"):
        extract("unused", inp, tmp_path / "job", ray=True, num_replicas=2)
    assert not (tmp_path / "job").exists()


def test_cli_without_ray_installed_says_what_to_install(tmp_path):
    inp = tmp_path / "p.jsonl"
    inp.write_text('{"id": "x", "prompt": "hello"}\n')
    code = ("import sys; sys.modules['ray'] = None; from capsteer.extract import main; "
            f"sys.exit(main(['unused', '--input', {str(inp)!r}, '--output', "
            f"{str(tmp_path / 'job')!r}, '--ray', '--num-replicas', '2']))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 2, run.stderr[-2000:]
    assert "capsteer extract --ray needs Ray Data: pip install 'capsteer[ray]'" in run.stdout


# ------------------------------------------------------------- real engines, real Ray
def _wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return alive


@pytest.fixture(scope="module")
def ray_jobs(tmp_path_factory, model_dirs, engine_pool):
    """(records, single-engine job, Ray job killed then resumed, ids indexed at the kill,
    replicas staged at the kill, resume result, resume log)."""
    engine_pool.close()  # one engine at a time in this process; the replicas are their own
    tmp = tmp_path_factory.mktemp("extract-ray")
    model = model_dirs["qwen3"]
    records = _records(200)
    inp = tmp / "prompts.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in records))
    single = tmp / "single"
    extract(model, inp, single, full_forward=True, **JOB, **ENGINE)  # every layer runs

    out = tmp / "ray-job"
    cmd = [sys.executable, "-m", "capsteer.cli", "extract", model, "--input", str(inp),
           "--output", str(out), "--hooks", "resid_post,mlp_out", "--layers", "0-2",
           "--positions", "prompt", "--shard-size", "16KiB", "--no-progress", "--ray",
           "--num-replicas", "2", "--ray-batch-size", "4", *FLAGS]
    log_path = tmp / "killed.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        deadline = time.monotonic() + 480
        while len(_index_ids(out)) < 8:
            assert proc.poll() is None, log_path.read_text()[-4000:]
            assert time.monotonic() < deadline, "no request was indexed in time"
            time.sleep(0.02)
        family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        os.killpg(proc.pid, signal.SIGKILL)  # the driver, its Ray cluster, replicas, engines
        proc.wait(30)
    killed_log = log_path.read_text(errors="replace")
    stragglers = _wait_gone(family, 60)
    assert not stragglers, f"still running after the kill: {[p.pid for p in stragglers]}"
    done_before = set(_index_ids(out))
    staged_at_kill = sorted(p.name for p in (out / STAGING_DIR).iterdir())

    import ray

    ray.init(num_cpus=4, include_dashboard=False)  # a local cluster inside the test
    logger = logging.getLogger("capsteer.extract")
    records_log: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda rec: records_log.append(rec.getMessage())  # type: ignore[method-assign]
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        result = extract(model, inp, out, ray=True, num_replicas=2, ray_batch_size=4,
                         digest="blake3", **JOB, **ENGINE)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
        ray.shutdown()
    return records, single, out, done_before, staged_at_kill, result, records_log, killed_log


@pytest.mark.engine
@pytest.mark.uses_engine("extract")
def test_killed_ray_job_resumes_to_exactly_once(ray_jobs):
    records, _, out, done_before, staged_at_kill, result, log, _ = ray_jobs
    assert 8 <= len(done_before) < len(records), "the job was not killed mid-run"
    assert len(staged_at_kill) == 2, staged_at_kill  # both replicas had started writing
    assert result.skipped >= len(done_before)  # indexed ones, plus staged ones recovered
    assert result.requests + result.skipped == len(records)
    ids = _index_ids(out)
    assert len(ids) == len(set(ids)) == len(records), "gaps or duplicates"
    assert set(ids) == {r["id"] for r in records}
    assert not (out / STAGING_DIR).exists()
    per_replica = next(m for m in log if m.startswith("capsteer extract: requests per replica"))
    counts = dict(part.split("=") for part in per_replica.split(": ")[-1].split(", "))
    new = {k: int(v) for k, v in counts.items() if k not in staged_at_kill}  # not recovered
    assert len(new) == 2 and min(new.values()) > 0, per_replica  # the resume used both
    assert sum(int(v) for v in counts.values()) == len(records) - len(done_before)
    digests = {entry_digest(s)[0] for s in read_sharded(out).manifest["shards"]}
    assert digests == {"sha256", "blake3"}  # the killed run's, then the resume's --digest
    verify = subprocess.run([sys.executable, "-m", "capsteer.capture.cli", "verify", str(out)],
                            capture_output=True, text=True, timeout=300)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert "0 corrupt" in verify.stdout


@pytest.mark.engine
@pytest.mark.uses_engine("extract")
def test_ray_job_rows_equal_a_single_engine_run(ray_jobs):
    """The replicas' forwards stopped after the job's deepest layer (their engines say so
    in the log Ray forwards), the single engine ran every layer: the rows are the same."""
    records, single, out, _, _, _, _, killed_log = ray_jobs
    assert "the forward runs layers 0-2 of 4 and stops (stop_at_layer=3)" in killed_log
    a, b = read_sharded(single), read_sharded(out)  # both verify every shard's digest
    assert b.keys() == a.keys()
    assert {k: b.manifest[k] for k in ("dtype", "hidden_size", "keys", "spec", "format")} == \
        {k: a.manifest[k] for k in ("dtype", "hidden_size", "keys", "spec", "format")}
    assert b.manifest["requests"] == len(records)
    assert b.manifest["rows"] == a.manifest["rows"]
    for rec in records:
        want, got = a.request(rec["id"]), b.request(rec["id"])
        assert np.array_equal(got["positions"], want["positions"]), rec["id"]
        assert np.array_equal(got["token_ids"], want["token_ids"]), rec["id"]
        for key in a.keys():
            torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=1e-5)
    rows_a, rows_b = open_job(single, "resid_post", 2), open_job(out, "resid_post", 2)
    assert len(rows_a) == len(rows_b)
    assert sorted(r["id"] for r in rows_a) == sorted(r["id"] for r in rows_b)
