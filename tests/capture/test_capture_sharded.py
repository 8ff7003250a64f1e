"""The sharded layout: many requests per shard, index after durability, resume."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch
from capture_helpers import feed, make_request, make_spec
from safetensors.torch import load_file

from capsteer.capture import read
from capsteer.capture.cli import main as cli_main
from capsteer.capture.sharded import INDEX_FILE, ShardedSink, ShardedWriter

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
