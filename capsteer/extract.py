"""Extraction jobs: prompts in, a `sharded` activation dataset out (api.md §5, §5b).

The engine runs in-process (no HTTP). The worker appends each finished request to
safetensors shards and indexes it only once its shard is durable, so the job
directory's `index.jsonl` is the truth for resuming: re-running the same command
skips every id it lists, and nothing is written twice or left out. The loop keeps
the engine's queue full (a window of requests ahead of what it can batch).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from capsteer.capture.sharded import INDEX_FILE, indexed_ids, read_index
from capsteer.capture.spec import CaptureSpec, parse_capture_spec
from capsteer.engine import Engine, new_capture_id
from capsteer.engine_ext.plan import EXTRA_ARGS_KEY


@dataclass(frozen=True)
class Record:
    """One input line: a completion prompt or chat messages."""

    id: str
    prompt: str | None = None
    messages: list[dict] | None = None


@dataclass
class ExtractResult:
    output: Path
    requests: int  # processed in this run
    skipped: int  # already in the index (resumed)
    tokens: int  # prompt tokens fed in this run
    seconds: float
    bytes_written: int
    shards: list[str] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


class InputError(ValueError):
    """A bad input file: says which line and what is wrong."""


def read_records(path: str | Path) -> list[Record]:
    """JSONL (or Parquet with the same columns): `id` (default: line number) plus `prompt`
    or `messages`. Ids must be unique."""
    path = Path(path)
    rows: list[dict[str, Any]]
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise InputError("reading Parquet needs pyarrow (pip install pyarrow)") from None
        rows = pq.read_table(path).to_pylist()
    else:
        rows = []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except ValueError as exc:
                raise InputError(f"{path}:{n}: not JSON ({exc})") from None
    records, seen = [], set()
    for n, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            raise InputError(f"{path}:{n}: expected an object")
        rid = str(row["id"]) if row.get("id") is not None else str(n)
        if rid in seen:
            raise InputError(f"{path}:{n}: duplicate id {rid!r}")
        seen.add(rid)
        prompt, messages = row.get("prompt"), row.get("messages")
        if (prompt is None) == (messages is None):
            raise InputError(f"{path}:{n}: give exactly one of 'prompt' or 'messages'")
        if prompt is not None and not isinstance(prompt, str):
            raise InputError(f"{path}:{n}: 'prompt' must be a string")
        if messages is not None and not isinstance(messages, list):
            raise InputError(f"{path}:{n}: 'messages' must be a list")
        records.append(Record(rid, prompt, messages))
    return records


def _model_layers(model: str) -> int:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    config = getattr(config, "text_config", None) or config
    return int(config.num_hidden_layers)


def _job_dir_bytes(out: Path) -> int:
    return sum(p.stat().st_size for p in out.glob("shard-*.safetensors"))


def extract(
    model: str, input_path: str | Path, output: str | Path, *,
    hooks: Sequence[str] | str = ("resid_post",), layers: object = "all",
    positions: object = "prompt", dtype: str = "auto", shard_size: int = 1 << 30,
    max_tokens: int = 1, progress: bool = True, window: int | None = None,
    model_dtype: str | None = None, engine: Engine | None = None, **engine_kwargs: Any,
) -> ExtractResult:
    """Run (or resume) an extraction job; returns what this run did.

    `dtype` is the capture dtype, `model_dtype` vLLM's `dtype`; `engine_kwargs` go to
    vLLM (max_model_len, tensor_parallel_size, ...); pass `engine` to reuse one whose
    capsteer config already names this job directory.
    """
    if model_dtype is not None:
        engine_kwargs["dtype"] = model_dtype
    out = Path(output)
    records = read_records(input_path)
    done = indexed_ids(out)
    todo = [r for r in records if r.id not in done]
    spec = parse_capture_spec(
        {"hooks": [hooks] if isinstance(hooks, str) else list(hooks), "layers": layers,
         "positions": positions, "dtype": dtype}, num_layers=_model_layers(model))
    _check_job(out, spec)
    if not todo:
        return ExtractResult(out, 0, len(records), 0, 0.0, 0, _shards(out))
    owns_engine = engine is None
    if engine is None:
        engine = Engine(model, capsteer_config=job_config(out, spec, shard_size, engine_kwargs),
                        **engine_kwargs)
    bytes_before = _job_dir_bytes(out)
    started = time.monotonic()  # throughput excludes engine start-up
    try:
        _run(engine, todo, spec, max_tokens, progress, window, out)
        engine.llm.collective_rpc("capsteer_flush_sharded")
    except KeyboardInterrupt:
        engine.llm.collective_rpc("capsteer_flush_sharded")  # what finished stays
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
    return ExtractResult(out, len(todo), len(records) - len(todo), tokens, elapsed,
                         _job_dir_bytes(out) - bytes_before, _shards(out))


def job_config(out: Path, spec: CaptureSpec, shard_size: int,
               engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The worker config of a job. One step copies (scheduled tokens x captured points)
    rows into a fixed staging buffer on GPUs, so the step size is pinned (2048 tokens
    unless given) and the buffer sized to hold a whole step."""
    from capsteer.engine_ext.runtime import hook_point

    engine_kwargs.setdefault("max_num_batched_tokens", 2048)
    points = {hook_point(hook, layer) for hook, layer in spec.keys()}
    return {"sharded": {"dir": str(out.resolve()), "spec": spec.to_dict(),
                        "shard_bytes": int(shard_size), "job_id": out.name},
            "staging_rows": int(engine_kwargs["max_num_batched_tokens"]) * len(points)}


def _shards(out: Path) -> list[str]:
    return sorted(p.name for p in out.glob("shard-*.safetensors"))


def _check_job(out: Path, spec: CaptureSpec) -> None:
    """A resumed job must ask for what the directory already holds."""
    manifest = out / "manifest.json"
    if not manifest.exists():
        return
    held = json.loads(manifest.read_text()).get("spec")
    if held is not None and held.get("hooks") != spec.to_dict()["hooks"]:
        raise ValueError(f"{out} holds a job capturing {held.get('hooks')}; this run asks for "
                         f"{spec.to_dict()['hooks']} (use another --output)")


def _prompts(engine: Engine, records: list[Record]) -> Iterator[tuple[Record, dict]]:
    for rec in records:
        if rec.messages is not None:
            ids = engine.tokenizer.apply_chat_template(
                rec.messages, add_generation_prompt=True, tokenize=True)
            if not isinstance(ids, list):  # newer tokenizers return a BatchEncoding
                ids = ids["input_ids"]
            yield rec, {"prompt_token_ids": list(ids)}
        else:
            yield rec, {"prompt": rec.prompt}


def _run(engine: Engine, todo: list[Record], spec: CaptureSpec, max_tokens: int,
         progress: bool, window: int | None, out: Path) -> int:
    from vllm import SamplingParams

    llm_engine = engine.llm.llm_engine
    limit = window or 4 * int(engine.llm.llm_engine.vllm_config.scheduler_config.max_num_seqs)
    bar = _progress(len(todo), progress)
    pending = iter(_prompts(engine, todo))
    live: dict[str, tuple[Record, str]] = {}  # vLLM request id -> (record, capture id)
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
            capture_id = new_capture_id()
            payload = {"capture": spec.to_dict(), "capture_id": capture_id, "sink": "sharded",
                       "record_id": rec.id, "await_end": True}
            prompt["cache_salt"] = f"capsteer-capture-{capture_id}"  # every position is fed
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                    extra_args={EXTRA_ARGS_KEY: payload})
            request_id = llm_engine.add_request(capture_id, prompt, params) or capture_id
            live[request_id] = (rec, capture_id)
        if not llm_engine.has_unfinished_requests():
            break
        for output in llm_engine.step():
            if not output.finished:
                continue
            entry = live.pop(output.request_id, None)
            if entry is None:
                continue
            capture_id = entry[1]
            finished += 1
            tokens += len(output.prompt_token_ids or ())
            ends.append((capture_id, len(output.outputs[0].token_ids)))
        if ends:
            engine.llm.collective_rpc("capsteer_end_captures", args=(ends,))
            ends = []
        if bar is not None and (time.monotonic() - shown > 0.5 or not live):
            shown = time.monotonic()
            elapsed = max(shown - started, 1e-9)
            bar.n = finished
            bar.set_postfix_str(f"{tokens / elapsed:,.0f} tok/s, "
                                f"{_job_dir_bytes(out) / 2**20:,.1f} MiB on disk", refresh=False)
            bar.refresh()
    if bar is not None:
        bar.n = finished
        bar.refresh()
        bar.close()
    return tokens


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="req", desc="extract", smoothing=0.1)


def add_command(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "extract", help="extract activations for many prompts into a sharded dataset",
        description="Run the engine in-process over a JSONL/Parquet file of prompts and write "
                    "safetensors shards + index.jsonl; re-running resumes.")
    p.add_argument("model")
    p.add_argument("--input", required=True, help="JSONL or Parquet: id, prompt | messages")
    p.add_argument("--output", required=True, help="job directory (created; resumable)")
    p.add_argument("--hooks", default="resid_post", help="comma-separated hook names")
    p.add_argument("--layers", default="all", help='"all", "a-b", "a:b" or ints joined by commas')
    p.add_argument("--positions", default="prompt",
                   help="all | prompt | generated | last_prompt | last | ints joined by commas")
    p.add_argument("--dtype", default="auto", help="capture dtype: auto | float32 | bfloat16 | float16")
    p.add_argument("--shard-size", default="1GiB", help="bytes per shard, e.g. 512MiB")
    p.add_argument("--max-tokens", type=int, default=1,
                   help="tokens generated per request (1: the prompt only is fed)")
    p.add_argument("--model-dtype", default=None, help="vLLM --dtype for the model weights")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--tensor-parallel-size", type=int, default=None)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_run_cli)


def _split(text: str) -> object:
    parts = [t.strip() for t in text.split(",") if t.strip()]
    if len(parts) == 1:
        return parts[0]
    return [int(t) if t.lstrip("-").isdigit() else t for t in parts]


def _run_cli(args: Any) -> int:
    from capsteer.config.server import parse_size

    engine_kwargs = {k: v for k, v in {
        "model_dtype": args.model_dtype, "max_model_len": args.max_model_len,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "tensor_parallel_size": args.tensor_parallel_size}.items() if v is not None}
    if args.enforce_eager:
        engine_kwargs["enforce_eager"] = True
    positions = _split(args.positions)
    try:
        result = extract(
            args.model, args.input, args.output, hooks=args.hooks.split(","),
            layers=_split(args.layers), positions=positions if isinstance(positions, list)
            or not positions.lstrip("-").isdigit() else [int(positions)],
            dtype=args.dtype, shard_size=parse_size(args.shard_size), max_tokens=args.max_tokens,
            progress=not args.no_progress, **engine_kwargs)
    except KeyboardInterrupt:
        print(f"\ninterrupted: finished requests are in {args.output}; run the same command "
              "again to resume", flush=True)
        return 130
    except (InputError, ValueError) as exc:
        print(f"capsteer extract: {exc}", flush=True)
        return 2
    print(f"{result.requests} requests extracted ({result.skipped} already done), "
          f"{result.tokens} tokens in {result.seconds:.1f} s ({result.tokens_per_s:,.0f} tok/s), "
          f"{result.bytes_written / 2**20:,.1f} MiB in {len(result.shards)} shards under {result.output}",
          flush=True)
    return 0
