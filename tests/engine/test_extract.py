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

from capsteer.capture import open_job
from capsteer.capture.sharded import read_sharded
from capsteer.extraction.local import extract
from capsteer.reference import hf_activations

from .helpers import extraction_records

pytestmark = [pytest.mark.engine, pytest.mark.uses_engine("extract")]
HIDDEN = 128  # the qwen3 demo model's hidden size
D_MLP = 256  # its intermediate size: mlp_post's width
# vLLM's own flags, with vLLM's meanings: --dtype is the model's (a float32 checkpoint
# would run in bfloat16 under vLLM's "auto"). A fixed 256 MiB KV cache, as the engine
# tests' (tests/engine/helpers.py): 0.15 of the host's memory zeroed 3.5 GiB per start.
KV_BYTES = 256 << 20
FLAGS = ["--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory-bytes",
         str(KV_BYTES), "--max-num-seqs", "16"]


def _records(n: int) -> list[dict]:
    return extraction_records(n, spread=9)


def _index(out: Path) -> list[dict]:
    path = out / "index.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines if line.endswith("}")]


@pytest.fixture(scope="module")
def resumed_job(tmp_path_factory, model_dirs, engine_pool):
    """A real CLI job SIGKILLed after >= 8 indexed requests, then resumed through the
    Python API: (job dir, records, ids done before the kill, resume result)."""
    engine_pool.close()  # one engine at a time
    tmp_path = tmp_path_factory.mktemp("extract")
    records = _records(60)
    inp = tmp_path / "prompts.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "job"
    cmd = [sys.executable, "-m", "capsteer.cli", "extract", model_dirs["qwen3"], "--input",
           str(inp), "--output", str(out), "--hooks", "resid_post,mlp_out,mlp_in,mlp_post",
           "--layers", "all",
           "--positions", "prompt", "--shard-size", "16KiB", "--digest", "blake3", "--no-progress",
           *FLAGS]
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

    result = extract(model_dirs["qwen3"], inp, out,
                     hooks=["resid_post", "mlp_out", "mlp_in", "mlp_post"],
                     layers="all", positions="prompt", shard_size=16 << 10, progress=False,
                     digest="blake3",
                     capture_dtype="auto", dtype="float32", max_model_len=512,
                     kv_cache_memory_bytes=KV_BYTES, max_num_seqs=16)
    return out, records, done_before, result


def test_killed_job_resumes_to_exactly_once_and_equals_hf(resumed_job, hf_models):
    out, records, done_before, result = resumed_job
    assert (result.forward_layers, result.model_layers) == (4, 4)  # resid_post(3): every layer
    assert result.skipped == len(done_before)
    assert result.requests == len(records) - len(done_before)

    ids = [e["id"] for e in _index(out)]
    assert sorted(ids) == sorted(r["id"] for r in records), "gaps or duplicates"
    job = read_sharded(out)  # verifies every shard's digest against the job manifest
    assert len(job.manifest["shards"]) > 2
    assert {s.get("digest") for s in job.manifest["shards"]} == {"blake3"}  # --digest blake3
    for shard in job.manifest["shards"]:  # plain safetensors, no capsteer needed
        tensors = load_file(out / shard["name"])
        assert {"positions", "token_ids", "resid_post.0", "mlp_out.3", "mlp_in.2"} <= set(tensors)
        assert tensors["resid_post.0"].dtype == torch.float32  # --dtype float32: the model's
        # mlp_post's rows are d_mlp wide (the manifest says so), the stream's hidden wide
        assert tensors["mlp_post.2"].shape[1] == D_MLP and tensors["mlp_in.2"].shape[1] == HIDDEN
    assert job.manifest["hook_widths"] == {"mlp_post": D_MLP}

    hf = hf_models["qwen3"]
    for rec in records[::7]:
        got = job.request(rec["id"])
        prompt_ids = [int(t) for t in got["token_ids"]]
        assert list(got["positions"]) == list(range(len(prompt_ids)))
        ref = hf_activations(hf, prompt_ids, prompt_len=len(prompt_ids))
        for key in (("resid_post", 0), ("resid_post", 3), ("mlp_out", 1), ("mlp_in", 1),
                    ("mlp_post", 1)):
            torch.testing.assert_close(torch.as_tensor(got[key]).float(), ref[key],
                                       atol=1e-4, rtol=1e-4)


def test_export_to_sae_lens_holds_exactly_the_job_rows(resumed_job, tmp_path):
    """`capsteer export --to sae-lens` (the real CLI): `datasets.load_from_disk` gives
    SAELens's columns, and their rows are the job's rows in index order, token ids too."""
    import datasets

    out, _, _, _ = resumed_job
    target = tmp_path / "sae-cache"
    run = subprocess.run([sys.executable, "-m", "capsteer.cli", "export", str(out), "--to",
                          "sae-lens", str(target), "--hooks", "resid_post", "--layers", "1,3",
                          "--context-size", "16", "--rows-per-file", "5", "--no-progress"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "SAELens:" in run.stdout
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temp dir left"

    ds = datasets.load_from_disk(str(target))
    columns = ["blocks.1.hook_resid_post", "blocks.3.hook_resid_post", "token_ids"]
    assert sorted(ds.column_names) == sorted(columns)
    assert ds.features["blocks.1.hook_resid_post"].shape == (16, HIDDEN)
    info = json.loads((target / "capsteer_export.json").read_text())
    assert len(list(target.glob("data-*.arrow"))) > 1
    ds.set_format("torch", columns=columns)
    rows = ds[0:len(ds)]
    for layer in (1, 3):
        job_rows = open_job(out, "resid_post", layer)
        n = len(ds) * 16
        assert len(job_rows) == n + info["dropped_rows"] and info["dropped_rows"] < 16
        want = torch.stack([job_rows[i]["activation"] for i in range(n)])
        got = rows[f"blocks.{layer}.hook_resid_post"].reshape(n, HIDDEN)
        assert torch.equal(got, want)
        tokens = torch.tensor([job_rows[i]["token_id"] for i in range(n)])
        assert torch.equal(rows["token_ids"].reshape(n).long(), tokens)


def test_sae_lens_trains_an_sae_from_the_export(resumed_job, tmp_path):
    """A real SAELens SAE trains from the export alone: SAELens's own ActivationsStore
    reads the cached activations (no model, no text dataset) and its SAETrainer fits."""
    from sae_lens import (
        LanguageModelSAERunnerConfig,
        LoggingConfig,
        StandardTrainingSAEConfig,
        TrainingSAE,
    )
    from sae_lens.training.activations_store import ActivationsStore
    from sae_lens.training.sae_trainer import SAETrainer

    from capsteer.capture.export import export_sae_lens

    out, _, _, _ = resumed_job
    export = export_sae_lens(out, tmp_path / "cache", keys=[("resid_post", 2)],
                             context_size=16, progress=False)
    hook = "blocks.2.hook_resid_post"
    cfg = LanguageModelSAERunnerConfig(
        sae=StandardTrainingSAEConfig(d_in=HIDDEN, d_sae=2 * HIDDEN, l1_coefficient=1e-3),
        hook_name=hook, context_size=16, lr=3e-3, training_tokens=16 * 4 * 40,
        train_batch_size_tokens=64, store_batch_size_prompts=4, n_batches_in_buffer=4,
        use_cached_activations=True, cached_activations_path=str(export.path),
        device="cpu", act_store_device="cpu", dtype="float32",
        logger=LoggingConfig(log_to_wandb=False), n_checkpoints=0, output_path=None)
    store = ActivationsStore(
        model=None, dataset=None, streaming=False, hook_name=hook, hook_head_index=None,
        context_size=16, d_in=HIDDEN, n_batches_in_buffer=4,
        total_training_tokens=cfg.training_tokens, store_batch_size_prompts=4,
        train_batch_size_tokens=64, prepend_bos=False, normalize_activations="none",
        device=torch.device("cpu"), dtype="float32", cached_activations_path=str(export.path))
    sae = TrainingSAE.from_dict(cfg.get_training_sae_cfg_dict())
    held_out = torch.stack([r["activation"] for r in open_job(out, "resid_post", 2)][:256])

    def mse() -> float:
        with torch.no_grad():
            return float(((sae.decode(sae.encode(held_out)) - held_out) ** 2).mean())

    before = mse()
    trainer = SAETrainer(cfg=cfg.to_sae_trainer_config(), sae=sae, data_provider=store)
    trained = trainer.fit()
    assert trainer.n_training_steps >= 30
    assert trainer.n_training_samples == cfg.training_tokens
    assert trained is sae
    after = mse()
    assert after < 0.8 * before, (before, after)  # seen: 6.35 -> 2.96


def test_a_transcoder_trains_from_one_jobs_mlp_in_and_mlp_out(resumed_job, hf_models,
                                                              tmp_path):
    """The transcoder's pair from one job: mlp_in (the MLP's normalized input, TL's
    ln2.hook_normalized) and mlp_out of the same tokens, exported as two aligned columns
    of one SAELens dataset. The pairs are the MLP's own (HF's layer-2 MLP maps each
    mlp_in row to its mlp_out row), and SAELens's Transcoder fits them (a few hundred
    rows: the fit, not generalisation, is what is checked). SAELens 6.x trains
    one hook from cached activations (its multi-hook store needs the live model), so
    the fit is a plain torch loop over the exported columns."""
    import datasets
    from sae_lens.saes.transcoder import Transcoder, TranscoderConfig

    from capsteer.capture.export import export_sae_lens

    out, _, _, _ = resumed_job
    export = export_sae_lens(out, tmp_path / "pairs", keys=[("mlp_in", 2), ("mlp_out", 2)],
                             context_size=16, progress=False)
    src, dst = "blocks.2.ln2.hook_normalized", "blocks.2.hook_mlp_out"
    assert list(export.columns) == [src, dst]
    ds = datasets.load_from_disk(str(export.path))
    ds.set_format("torch", columns=[src, dst, "token_ids"])
    rows = ds[0:len(ds)]
    x, y = rows[src].reshape(-1, HIDDEN), rows[dst].reshape(-1, HIDDEN)
    with torch.no_grad():  # the pairs are the MLP's input and output, row for row
        mlp = hf_models["qwen3"].model.layers[2].mlp
        torch.testing.assert_close(mlp(x[:512]), y[:512], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(x[:256], torch.stack(
        [r["activation"] for r in open_job(out, "mlp_in", 2)][:256]))
    torch.manual_seed(0)
    tc = Transcoder(TranscoderConfig(d_in=HIDDEN, d_sae=4 * HIDDEN, d_out=HIDDEN,
                                     apply_b_dec_to_input=False, dtype="float32",
                                     device="cpu"))

    def unexplained() -> float:  # the fraction of mlp_out's variance the transcoder misses
        with torch.no_grad():
            return float(((tc(x) - y) ** 2).sum() / ((y - y.mean(0)) ** 2).sum())

    before = unexplained()
    opt = torch.optim.Adam(tc.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        idx = torch.randint(0, len(x), (64,), generator=gen)
        pred, acts = tc.forward_with_activations(x[idx])
        loss = ((pred - y[idx]) ** 2).mean() + 1e-4 * acts.abs().sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = unexplained()
    assert after < 0.3 < before, (before, after)  # seen (HF's rows): 2.28 -> 0.09


def test_an_export_holds_mlp_post_at_its_own_width(resumed_job, hf_models, tmp_path):
    """mlp_post (TL's mlp.hook_post, d_mlp wide) beside mlp_out in one SAELens export:
    each column has its own d_in, and the rows are the MLP's own (its output projection
    maps each mlp_post row to its mlp_out row)."""
    import datasets

    from capsteer.capture.export import export_sae_lens

    out, _, _, _ = resumed_job
    export = export_sae_lens(out, tmp_path / "post", keys=[("mlp_post", 2), ("mlp_out", 2)],
                             context_size=16, progress=False)
    src, dst = "blocks.2.mlp.hook_post", "blocks.2.hook_mlp_out"
    assert list(export.columns) == [src, dst]
    assert export.d_ins == {src: D_MLP, dst: HIDDEN}
    assert export.sae_lens_config(src)["d_in"] == D_MLP
    assert export.sae_lens_config(dst)["d_in"] == HIDDEN
    ds = datasets.load_from_disk(str(export.path))
    assert ds.features[src].shape == (16, D_MLP)
    ds.set_format("torch", columns=[src, dst])
    rows = ds[0:len(ds)]
    x, y = rows[src].reshape(-1, D_MLP), rows[dst].reshape(-1, HIDDEN)
    with torch.no_grad():
        down = hf_models["qwen3"].model.layers[2].mlp.down_proj
        torch.testing.assert_close(down(x[:512]), y[:512], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(x[:64], torch.stack(
        [r["activation"] for r in open_job(out, "mlp_post", 2)][:64]))


STOPPED_HOOKS = ["resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out", "mlp_in",
                 "mlp_post", "attn_z"]


@pytest.fixture(scope="module", params=["qwen3", "granite", "gpt2"])
def stopped_job(request, tmp_path_factory, model_dirs, engine_pool):
    """A job of every hook at layer 1 of the 4-layer demo model, whose forward therefore
    stops after layer 1 (qwen3: vLLM's fused add+norm layout; granite: layers that add
    their residual themselves; gpt2: its decoder at `transformer.h`, final norm `ln_f`), run on an engine the test then asks about itself:
    (family, job dir, records, worker stats, a request capturing beyond the stop)."""
    from capsteer.capture.spec import parse_capture_spec
    from capsteer.engine import Engine, Request
    from capsteer.extraction.job import job_config

    family = request.param
    engine_pool.close()  # one engine at a time
    tmp_path = tmp_path_factory.mktemp(f"stopped-{family}")
    records = _records(24)
    inp = tmp_path / "prompts.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "job"
    spec = parse_capture_spec({"hooks": STOPPED_HOOKS, "layers": [1], "positions": "prompt"},
                              num_layers=4)
    kw = dict(dtype="float32", max_model_len=512, kv_cache_memory_bytes=KV_BYTES,
              max_num_seqs=16)
    config = job_config(out, spec, 16 << 10, kw, num_layers=4)
    assert config["stop_at_layer"] == 2
    engine = Engine(model_dirs[family], capsteer_config=config, **kw)
    try:
        result = extract(model_dirs[family], inp, out, hooks=STOPPED_HOOKS, layers=[1],
                         positions="prompt", shard_size=16 << 10, progress=False, engine=engine)
        (stats,) = engine.llm.collective_rpc("capsteer_stats")
        (beyond,) = engine.generate([Request(
            prompt="model layer stream", sampling={"max_tokens": 1, "temperature": 0},
            capture={"hooks": ["resid_post"], "layers": [3], "positions": "all"})])
    finally:
        engine.close()
    return family, out, records, stats, beyond, result


def test_a_job_stops_the_forward_after_its_deepest_layer_and_equals_hf(stopped_job, hf_models):
    """The engine ran two of four layers (vLLM's own slice the forward loops over), passed
    its start-up canary with the final norm reading resid_pre(2), and every hook at
    layer 1 still equals HF transformers' full forward."""
    family, out, records, stats, _, result = stopped_job
    # The CPU backend's worker process runs its steps from vLLM's worker loop, which capsteer
    # started with room on the frame stack (engine_ext/stack_room.py): the captures below
    # come from that loop.
    assert stats["stack_room"] == ["WorkerProc.worker_busy_loop"]
    assert stats["stop_at_layer"] == 2
    assert stats["forward_layers"] == 2
    assert (result.forward_layers, result.model_layers) == (2, 4)
    job = read_sharded(out)
    assert sorted(e["id"] for e in job.index) == sorted(r["id"] for r in records)
    hf = hf_models[family]
    for rec in records[::5]:
        got = job.request(rec["id"])
        prompt_ids = [int(t) for t in got["token_ids"]]
        ref = hf_activations(hf, prompt_ids, prompt_len=len(prompt_ids))
        for hook in STOPPED_HOOKS:
            torch.testing.assert_close(torch.as_tensor(got[(hook, 1)]).float(), ref[(hook, 1)],
                                       atol=1e-4, rtol=1e-4)


def test_a_stopped_forward_refuses_captures_beyond_its_stop(stopped_job):
    """A request for a layer the stopped forward never reaches gets an error naming why,
    not rows of the wrong layer and not silence."""
    _, _, _, _, beyond, _ = stopped_job
    assert beyond.captures is not None
    assert beyond.captures.error is not None
    assert "stop_at_layer" in beyond.captures.error and "resid_post(3)" in beyond.captures.error
    assert not beyond.captures.tensors
