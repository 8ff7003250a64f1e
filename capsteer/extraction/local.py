"""Extraction jobs on one in-process engine: prompts in, a `sharded` dataset out (api.md §5).

The engine runs in-process (no HTTP). The worker appends each finished request to
safetensors shards and indexes it only once its shard is durable, so the job
directory's `index.jsonl` is the truth for resuming: re-running the same command
skips every id it lists, and nothing is written twice or left out. The loop keeps
the engine's queue full (a window of requests ahead of what it can batch).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from capsteer.capture.publish import check_digest
from capsteer.capture.sharded import INDEX_FILE, indexed_ids, read_index
from capsteer.capture.spec import CaptureSpec, parse_capture_spec
from capsteer.engine import Engine
from capsteer.engine_ext.payload import RPC_END_CAPTURES, RPC_FLUSH_SHARDED, RPC_STATS
from capsteer.extraction.job import (
    ExtractResult,
    Record,
    check_job,
    check_recorded_digest,
    check_resumed_ids,
    job_config,
    job_dir_bytes,
    model_num_layers,
    model_unavailable_hooks,
    read_records,
    shard_files,
    warn_if_narrower,
)
from capsteer.extraction.ray import extract_on_ray
from capsteer.extraction.submit import engine_prompts, submit_capture


def extract(
    model: str, input_path: str | Path, output: str | Path, *,
    hooks: Sequence[str] | str = ("resid_post",), layers: object = "all",
    positions: object = "prompt", capture_dtype: str = "auto", shard_size: int = 1 << 30,
    digest: str = "sha256",
    max_tokens: int = 1, full_forward: bool = False, progress: bool = True,
    window: int | None = None,
    engine: Engine | None = None, ray: bool = False, num_replicas: int | None = None,
    ray_address: str | None = None, ray_batch_size: int | None = None,
    **engine_kwargs: Any,
) -> ExtractResult:
    """Run (or resume) an extraction job; returns what this run did.

    `engine_kwargs` are vLLM's engine arguments with vLLM's meanings (`dtype` is the
    model's dtype, as in `vllm serve`; max_model_len, tensor_parallel_size, ...).
    `capture_dtype` is the stored activations' dtype ("auto": the model's); `digest` the
    shards' digest in the manifest (sha256, or blake3: faster to write and verify). The
    forward stops after the deepest captured layer (TransformerLens's stop_at_layer;
    the values are the same) unless `full_forward` or generated positions are kept. Pass
    `engine` to reuse one whose capsteer config already names this job directory.
    `ray=True` runs `num_replicas` engines on Ray Data instead (capsteer.extraction.ray;
    `ray_address`: an existing cluster; `ray_batch_size`: prompts per Ray Data batch).
    """
    out = Path(output)
    if ray or (num_replicas, ray_address, ray_batch_size) != (None, None, None):
        return extract_on_ray(
            model, input_path, out, ray=ray, engine=engine, hooks=hooks, layers=layers,
            positions=positions, capture_dtype=capture_dtype, shard_size=shard_size,
            max_tokens=max_tokens, full_forward=full_forward, progress=progress, window=window,
            num_replicas=num_replicas, ray_address=ray_address, ray_batch_size=ray_batch_size,
            engine_kwargs=engine_kwargs, digest=digest)
    records = read_records(input_path)
    done = indexed_ids(out)
    check_resumed_ids(out, done, {r.id for r in records})
    todo = [r for r in records if r.id not in done]
    num_layers = model_num_layers(model)
    spec = parse_capture_spec(
        {"hooks": [hooks] if isinstance(hooks, str) else list(hooks), "layers": layers,
         "positions": positions, "dtype": capture_dtype}, num_layers=num_layers,
        unavailable=model_unavailable_hooks(model))
    check_job(out, spec)
    check_digest(digest)
    if not todo:
        return ExtractResult(out, 0, len(records), 0, 0.0, 0, shard_files(out))
    owns_engine = engine is None
    if engine is None:
        engine = Engine(model, capsteer_config=job_config(
            out, spec, shard_size, engine_kwargs, digest=digest, num_layers=num_layers,
            max_tokens=max_tokens, full_forward=full_forward), **engine_kwargs)
    warn_if_narrower(spec.dtype, engine.dtype)
    bytes_before, shards_before = job_dir_bytes(out), set(shard_files(out))
    started = time.monotonic()  # throughput excludes engine start-up
    try:
        _run(engine, todo, spec, max_tokens, progress, window, out)
        engine.llm.collective_rpc(RPC_FLUSH_SHARDED)
        forward_layers = engine.llm.collective_rpc(RPC_STATS)[0]["forward_layers"]
    except KeyboardInterrupt:
        engine.llm.collective_rpc(RPC_FLUSH_SHARDED)  # what finished stays
        raise
    finally:
        if owns_engine:
            engine.close()
    elapsed = time.monotonic() - started
    todo_ids = {r.id for r in todo}
    index = read_index(out / INDEX_FILE)
    missing = todo_ids - {str(e["id"]) for e in index}
    tokens = sum(int(e["prompt_tokens"]) for e in index if str(e["id"]) in todo_ids)
    if missing:
        raise RuntimeError(f"{len(missing)} requests finished but are not in {out / INDEX_FILE} "
                           f"(e.g. {sorted(missing)[:3]}); see the engine log; re-run to resume")
    check_recorded_digest(out, digest, shards_before)
    return ExtractResult(out, len(todo), len(records) - len(todo), tokens, elapsed,
                         job_dir_bytes(out) - bytes_before, shard_files(out),
                         forward_layers=forward_layers, model_layers=num_layers)


def _run(engine: Engine, todo: list[Record], spec: CaptureSpec, max_tokens: int,
         progress: bool, window: int | None, out: Path) -> int:
    """Feed `todo` to the engine, a window ahead of what it batches; returns prompt tokens."""
    llm_engine = engine.llm.llm_engine
    limit = window or 4 * int(engine.llm.llm_engine.vllm_config.scheduler_config.max_num_seqs)
    bar = _progress(len(todo), progress)
    pending = iter(engine_prompts(engine, todo))
    spec_text = spec.to_json()  # text: vLLM deep-copies each request's params (a str by reference)
    live: set[str] = set()  # capture ids in flight (each is its vLLM request id)
    awaited: set[str] = set()  # of them, those whose output length the workers wait for
    ends: list[tuple[str, int]] = []
    tokens = finished = 0
    started = time.monotonic()
    exhausted = False
    shown = 0.0
    while True:
        while not exhausted and len(live) < limit:
            try:
                rec, prompt = next(pending)
            except StopIteration:
                exhausted = True
                break
            capture_id, reports = submit_capture(llm_engine, rec, prompt, spec, spec_text,
                                                 max_tokens)
            if reports:
                awaited.add(capture_id)
            live.add(capture_id)
        if not llm_engine.has_unfinished_requests():
            break
        for output in llm_engine.step():
            if not output.finished:
                continue
            capture_id = output.request_id
            if capture_id not in live:
                continue
            live.discard(capture_id)
            finished += 1
            tokens += len(output.prompt_token_ids or ())
            if capture_id in awaited:
                awaited.discard(capture_id)
                ends.append((capture_id, len(output.outputs[0].token_ids)))
        if ends:
            engine.llm.collective_rpc(RPC_END_CAPTURES, args=(ends,))
            ends = []
        if bar is not None and (time.monotonic() - shown > 0.5 or not live):
            shown = time.monotonic()
            elapsed = max(shown - started, 1e-9)
            bar.n = finished
            bar.set_postfix_str(f"{tokens / elapsed:,.0f} tok/s, "
                                f"{job_dir_bytes(out) / 2**20:,.1f} MiB on disk", refresh=False)
            bar.refresh()
    if bar is not None:
        bar.n = finished
        bar.refresh()
        bar.close()
    return tokens


def _progress(total: int, enabled: bool) -> tqdm | None:
    """The job's progress bar, or None when the caller asked for quiet."""
    if not enabled:
        return None
    return tqdm(total=total, unit="req", desc="extract", smoothing=0.1)

