"""Extraction jobs: a job killed mid-run and resumed holds every request exactly once,
in shards plain safetensors can read, with values equal to HF transformers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from capsteer.capture.sharded import read_sharded
from capsteer.extract import extract
from capsteer.reference import hf_activations

pytestmark = [pytest.mark.engine, pytest.mark.uses_engine("extract")]
WORDS = "the quick brown fox jumps over a lazy dog while seven small birds sing loudly".split()
# vLLM's own flags, with vLLM's meanings: --dtype is the model's (a float32 checkpoint
# would run in bfloat16 under vLLM's "auto").
FLAGS = ["--dtype", "float32", "--max-model-len", "512", "--gpu-memory-utilization", "0.15",
         "--max-num-seqs", "16"]


def _records(n: int) -> list[dict]:
    out = []
    for i in range(n):
        text = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(4 + i % 9))
        if i % 3 == 2:
            out.append({"id": f"chat-{i}", "messages": [{"role": "user", "content": text}]})
        else:
            out.append({"id": f"req-{i}", "prompt": text})
    return out


def _index(out: Path) -> list[dict]:
    path = out / "index.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines if line.endswith("}")]


def test_killed_job_resumes_to_exactly_once_and_equals_hf(tmp_path, model_dirs, hf_models,
                                                          engine_pool):
    engine_pool.close()  # one engine at a time
    records = _records(60)
    inp = tmp_path / "prompts.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "job"
    cmd = [sys.executable, "-m", "capsteer.cli", "extract", model_dirs["qwen3"], "--input",
           str(inp), "--output", str(out), "--hooks", "resid_post,mlp_out", "--layers", "all",
           "--positions", "prompt", "--shard-size", "16KiB", "--no-progress", *FLAGS]
    log = open(tmp_path / "killed.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 300
    while len(_index(out)) < 8:
        assert proc.poll() is None, (tmp_path / "killed.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "no shard was indexed in time"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
    log.close()
    done_before = {e["id"] for e in _index(out)}
    assert 8 <= len(done_before) < len(records), "the job was not killed mid-run"

    result = extract(model_dirs["qwen3"], inp, out, hooks=["resid_post", "mlp_out"],
                     layers="all", positions="prompt", shard_size=16 << 10, progress=False,
                     capture_dtype="auto", dtype="float32", max_model_len=512,
                     gpu_memory_utilization=0.15, max_num_seqs=16)
    assert result.skipped == len(done_before)
    assert result.requests == len(records) - len(done_before)

    ids = [e["id"] for e in _index(out)]
    assert sorted(ids) == sorted(r["id"] for r in records), "gaps or duplicates"
    job = read_sharded(out)  # verifies every shard's sha256 against the job manifest
    assert len(job.manifest["shards"]) > 2
    for shard in job.manifest["shards"]:  # plain safetensors, no capsteer needed
        tensors = load_file(out / shard["name"])
        assert {"positions", "token_ids", "resid_post.0", "mlp_out.3"} <= set(tensors)
        assert tensors["resid_post.0"].dtype == torch.float32  # --dtype float32: the model's

    hf = hf_models["qwen3"]
    for rec in records[::7]:
        got = job.request(rec["id"])
        prompt_ids = [int(t) for t in got["token_ids"]]
        assert list(got["positions"]) == list(range(len(prompt_ids)))
        ref = hf_activations(hf, prompt_ids, prompt_len=len(prompt_ids))
        for key in (("resid_post", 0), ("resid_post", 3), ("mlp_out", 1)):
            torch.testing.assert_close(torch.as_tensor(got[key]).float(), ref[key],
                                       atol=1e-4, rtol=1e-4)
