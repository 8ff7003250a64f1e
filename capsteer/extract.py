"""Extraction jobs: prompts in, a `sharded` activation dataset out (api.md §5, §5b).

The engine runs in-process (no HTTP). The worker appends each finished request to
safetensors shards and indexes it only once its shard is durable, so the job
directory's `index.jsonl` is the truth for resuming: re-running the same command
skips every id it lists, and nothing is written twice or left out. The loop keeps
the engine's queue full (a window of requests ahead of what it can batch).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Container, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from capsteer.capture.digests import DIGESTS, check_digest, entry_digest
from capsteer.capture.sharded import INDEX_FILE, indexed_ids, read_index
from capsteer.capture.spec import DTYPES, CaptureSpec, parse_capture_spec
from capsteer.engine import Engine
from capsteer.engine_ext.payload import (
    EXTRA_ARGS_KEY,
    needs_end_report,
    new_capture_id,
    sign_payload,
)

logger = logging.getLogger("capsteer.extract")


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
    # Decoder layers each request's forward ran, of the model's (None: not known here,
    # e.g. on Ray replicas): fewer where the forward stopped after the deepest hook.
    forward_layers: int | None = None
    model_layers: int | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


class InputError(ValueError):
    """A bad input file: says which line and what is wrong."""


def check_row(where: str, row: object) -> tuple[str | None, str | None, list | None]:
    """(id or None, prompt, messages) of one input row: an object with exactly one of a
    string `prompt` or a list `messages`; `where` names the row in errors."""
    if not isinstance(row, dict):
        raise InputError(f"{where}: expected an object")
    prompt, messages = row.get("prompt"), row.get("messages")
    if (prompt is None) == (messages is None):
        raise InputError(f"{where}: give exactly one of 'prompt' or 'messages'")
    if prompt is not None and not isinstance(prompt, str):
        raise InputError(f"{where}: 'prompt' must be a string")
    if messages is not None and not isinstance(messages, list):
        raise InputError(f"{where}: 'messages' must be a list")
    rid = str(row["id"]) if row.get("id") is not None else None
    return rid, prompt, messages


def iter_input_rows(path: Path) -> Iterator[tuple[int, str, object]]:
    """(number, where, row) for every input row, streamed: JSONL (its line number; blank
    lines skipped but counted, as an editor counts them) or Parquet (its row number)."""
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise InputError("reading Parquet needs pyarrow (pip install pyarrow)") from None
        n = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=8192):
            for row in batch.to_pylist():
                n += 1
                yield n, f"{path}:{n}", row
        return
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                yield lineno, f"{path}:{lineno}", json.loads(line)
            except ValueError as exc:
                raise InputError(f"{path}:{lineno}: not JSON ({exc})") from None


def iter_records(path: str | Path) -> Iterator[tuple[Record, bool]]:
    """(record, whether the row named its own id) for every row, checked and streamed:
    `id` defaults to the line number (Parquet: row number); ids must be unique."""
    seen: set[str] = set()
    for n, where, row in iter_input_rows(Path(path)):
        rid, prompt, messages = check_row(where, row)
        named = rid is not None
        rid = rid if named else str(n)
        if rid in seen:
            raise InputError(f"{where}: duplicate id {rid!r}")
        seen.add(rid)
        yield Record(rid, prompt, messages), named


def read_records(path: str | Path) -> list[Record]:
    """JSONL (or Parquet with the same columns): `id` (default: line number) plus `prompt`
    or `messages`. Ids must be unique."""
    return [record for record, _ in iter_records(path)]


def _model_layers(model: str) -> int:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    config = getattr(config, "text_config", None) or config
    return int(config.num_hidden_layers)


def _warn_if_narrower(capture_dtype: str, model_dtype: Any) -> None:
    """Storing fewer bits than the model computes is allowed, and said once per job."""
    import torch

    if capture_dtype == "auto":
        return
    stored = getattr(torch, capture_dtype)
    if torch.finfo(stored).bits < torch.finfo(model_dtype).bits:
        logger.warning("capsteer extract: the model runs in %s; activations are stored as %s "
                       "(--capture-dtype), which rounds them",
                       str(model_dtype).removeprefix("torch."), capture_dtype)


def _job_dir_bytes(out: Path) -> int:
    return sum(p.stat().st_size for p in out.glob("shard-*.safetensors"))


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
    `ray=True` runs `num_replicas` engines on Ray Data instead (capsteer.extract_ray;
    `ray_address`: an existing cluster; `ray_batch_size`: prompts per Ray Data batch).
    """
    out = Path(output)
    if ray or (num_replicas, ray_address, ray_batch_size) != (None, None, None):
        from capsteer.extract_ray import extract_on_ray

        return extract_on_ray(
            model, input_path, out, ray=ray, engine=engine, hooks=hooks, layers=layers,
            positions=positions, capture_dtype=capture_dtype, shard_size=shard_size,
            max_tokens=max_tokens, full_forward=full_forward, progress=progress, window=window,
            num_replicas=num_replicas, ray_address=ray_address, ray_batch_size=ray_batch_size,
            engine_kwargs=engine_kwargs, digest=digest)
    records = read_records(input_path)
    done = indexed_ids(out)
    _check_resumed_ids(out, done, {r.id for r in records})
    todo = [r for r in records if r.id not in done]
    num_layers = _model_layers(model)
    spec = parse_capture_spec(
        {"hooks": [hooks] if isinstance(hooks, str) else list(hooks), "layers": layers,
         "positions": positions, "dtype": capture_dtype}, num_layers=num_layers)
    _check_job(out, spec)
    check_digest(digest)
    if not todo:
        return ExtractResult(out, 0, len(records), 0, 0.0, 0, _shards(out))
    owns_engine = engine is None
    if engine is None:
        engine = Engine(model, capsteer_config=job_config(
            out, spec, shard_size, engine_kwargs, digest=digest, num_layers=num_layers,
            max_tokens=max_tokens, full_forward=full_forward), **engine_kwargs)
    _warn_if_narrower(spec.dtype, engine.dtype)
    bytes_before, shards_before = _job_dir_bytes(out), set(_shards(out))
    started = time.monotonic()  # throughput excludes engine start-up
    try:
        _run(engine, todo, spec, max_tokens, progress, window, out)
        engine.llm.collective_rpc("capsteer_flush_sharded")
        forward_layers = engine.llm.collective_rpc("capsteer_stats")[0]["forward_layers"]
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
    _check_digest(out, digest, shards_before)
    return ExtractResult(out, len(todo), len(records) - len(todo), tokens, elapsed,
                         _job_dir_bytes(out) - bytes_before, _shards(out),
                         forward_layers=forward_layers, model_layers=num_layers)


def _check_digest(out: Path, digest: str, shards_before: set[str]) -> None:
    """The shards this run wrote must carry the asked digest (an engine whose writer
    ignored it would otherwise leave the flag a silent no-op)."""
    shards = json.loads((out / "manifest.json").read_text()).get("shards", [])
    wrong = [f"{s['name']}: {entry_digest(s)[0]}" for s in shards
             if s["name"] not in shards_before and entry_digest(s)[0] != digest]
    if wrong:
        raise RuntimeError(f"digest {digest} was asked for, but the engine's shard writer recorded "
                           f"{', '.join(wrong[:3])} (its worker does not pass the job's digest)")


def job_config(out: Path, spec: CaptureSpec, shard_size: int,
               engine_kwargs: dict[str, Any], digest: str = "sha256", *,
               num_layers: int | None = None, max_tokens: int = 1,
               full_forward: bool = False) -> dict[str, Any]:
    """The worker config of a job. One step copies (scheduled tokens x captured points)
    rows into a fixed staging buffer on GPUs, so the step size is pinned (2048 tokens
    unless given) and the buffer sized to hold a whole step. The forward stops after
    the deepest captured layer (`stop_at_layer`) unless `full_forward` (or the model's
    `num_layers` is not given)."""
    from capsteer.engine_ext.runtime import hook_point

    engine_kwargs.setdefault("max_num_batched_tokens", 2048)
    points = {hook_point(hook, layer) for hook, layer in spec.keys()}
    config: dict[str, Any] = {
        "sharded": {"dir": str(out.resolve()), "spec": spec.to_dict(),
                    "shard_bytes": int(shard_size), "job_id": out.name, "digest": digest},
        "staging_rows": int(engine_kwargs["max_num_batched_tokens"]) * len(points)}
    stop = None if full_forward or num_layers is None else stop_at_layer(spec, num_layers,
                                                                          max_tokens)
    if stop is not None:
        config["stop_at_layer"] = stop
    return config


def stop_at_layer(spec: CaptureSpec, num_layers: int, max_tokens: int) -> int | None:
    """Where a job's forward may stop (TransformerLens's stop_at_layer), or None.

    Layers after the deepest captured one change no captured value, as long as every
    captured position is fed from the prompt: a prompt's activations never depend on
    later tokens, but a generated token comes from the last layer's logits. So only
    when the job generates a single token (never fed back) or keeps prompt positions."""
    from capsteer.engine_ext.runtime import layers_needed

    if max_tokens > 1 and spec.positions.kind not in ("prompt", "last_prompt"):
        return None
    return layers_needed(spec.keys(), num_layers)


def _shards(out: Path) -> list[str]:
    return sorted(p.name for p in out.glob("shard-*.safetensors"))


def _check_job(out: Path, spec: CaptureSpec) -> None:
    """A resumed job must ask for what the directory already holds: the same keys, the
    same positions and the same stored dtype, else its rows would mix two kinds under one
    manifest (which names only the last run's)."""
    manifest = out / "manifest.json"
    if not manifest.exists():
        return
    job = json.loads(manifest.read_text())
    held = job.get("spec")
    if held is None:
        return
    want = spec.to_dict()
    flags = {"hooks": "--hooks/--layers", "positions": "--positions"}
    for name, flag in flags.items():
        if held.get(name) != want[name]:
            raise ValueError(f"{out} holds a job capturing {name} {held.get(name)}; this run "
                             f"asks for {want[name]} ({flag}; use another --output for a "
                             "different job)")
    # "auto" stores the model's dtype, known only once the engine runs: a resumed job
    # names the dtype the directory holds, or asks "auto" again as the job did.
    stored = job.get("dtype")
    asked = want["dtype"]
    if asked != held.get("dtype") and asked != stored:
        raise ValueError(f"{out} holds {stored} rows (--capture-dtype {held.get('dtype')}); "
                         f"this run asks for --capture-dtype {asked} (use another --output "
                         "for a different job)")


def _check_resumed_ids(out: Path, done: Container[str], ids: set[str]) -> None:
    """A resumed job's done ids must all be the input's: else the input is another one (or
    its rows were numbered otherwise: default ids are line numbers, blank lines counted),
    and resuming would store rows twice under two ids."""
    stray = sorted(d for d in done if d not in ids)
    if stray:
        raise ValueError(f"{out} holds {len(stray)} request id(s) this input does not have "
                         f"(e.g. {stray[0]!r}): it is another job's input, or its rows are "
                         "numbered otherwise (give every row an `id`); use another --output")


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


def submit_capture(llm_engine: Any, rec: Record, prompt: dict[str, Any], spec: CaptureSpec,
                   spec_text: str, max_tokens: int) -> tuple[str, bool]:
    """Hand one record to vLLM as a sharded capture request (the in-process and the Ray
    driver loops both submit this way). Returns its capture id, which is also the request
    id its outputs carry, and whether the workers wait for its end report: a prompt-only
    capture closes in the worker, so it gets none."""
    from vllm import SamplingParams

    capture_id = new_capture_id()
    ids = prompt.get("prompt_token_ids")
    reports = needs_end_report(spec, None if ids is None else len(ids))
    payload = {"capture": spec_text, "capture_id": capture_id, "sink": "sharded",
               "record_id": rec.id, "await_end": reports}
    prompt["cache_salt"] = f"capsteer-capture-{capture_id}"  # every position is fed
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0,
                            extra_args={EXTRA_ARGS_KEY: sign_payload(payload)})
    # outputs carry the id given here; add_request returns vLLM's internal one
    llm_engine.add_request(capture_id, prompt, params)
    return capture_id, reports


def _run(engine: Engine, todo: list[Record], spec: CaptureSpec, max_tokens: int,
         progress: bool, window: int | None, out: Path) -> int:
    llm_engine = engine.llm.llm_engine
    limit = window or 4 * int(engine.llm.llm_engine.vllm_config.scheduler_config.max_num_seqs)
    bar = _progress(len(todo), progress)
    pending = iter(_prompts(engine, todo))
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


DESCRIPTION = (
    "Run the engine in-process over a JSONL/Parquet file of prompts and write safetensors "
    "shards + index.jsonl; re-running resumes. Every vLLM engine flag is accepted with "
    "vLLM's meaning, as `vllm serve` takes it: --dtype is the MODEL's dtype (vLLM's 'auto' "
    "runs a float32 checkpoint in bfloat16 on many devices); --capture-dtype is the dtype "
    "the activations are stored in (default: the model's dtype).")


def add_command(subparsers: Any) -> None:
    """Register `capsteer extract` for `capsteer --help`; its own parser (with every vLLM
    engine flag, which costs a vLLM import) is built by `main` when it runs."""
    p = subparsers.add_parser("extract", add_help=False, help="extract activations for many "
                              "prompts into a sharded dataset (capsteer extract --help)")
    p.set_defaults(func=lambda args: main(["--help"]))


def build_parser():
    """capsteer's job flags plus vLLM's own engine flags (EngineArgs.add_cli_args)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    p = FlexibleArgumentParser(prog="capsteer extract", description=DESCRIPTION)
    p.add_argument("model_tag", nargs="?", help="model directory or name (or --model)")
    job = p.add_argument_group("ExtractionJob", "capsteer: the extraction job (see also --help=ModelConfig for --dtype)")
    job.add_argument("--input", required=True, help="JSONL or Parquet: id, prompt | messages")
    job.add_argument("--output", required=True, help="job directory (created; resumable)")
    job.add_argument("--hooks", default="resid_post", help="comma-separated hook names")
    job.add_argument("--layers", default="all",
                     help='"all", "a-b", "a:b" or ints joined by commas')
    job.add_argument("--positions", default="prompt",
                     help="all | prompt | generated | last_prompt | last | ints joined by commas")
    job.add_argument("--capture-dtype", default="auto", choices=DTYPES,
                     help="dtype the activations are stored in; auto = the model's --dtype. "
                          "Narrower than the model's is allowed and logged.")
    job.add_argument("--shard-size", default="1GiB", help="bytes per shard, e.g. 512MiB")
    job.add_argument("--digest", default="sha256", choices=DIGESTS,
                     help="shard digest recorded in the manifest (blake3: ~3x faster to hash; "
                          "see docs/capture-format.md)")
    job.add_argument("--max-tokens", type=int, default=1,
                     help="tokens generated per request (1: the prompt only is fed)")
    job.add_argument("--full-forward", action="store_true",
                     help="run every layer; by default the forward stops after the deepest "
                          "captured layer (as TransformerLens's stop_at_layer), which changes "
                          "no captured value and saves the later layers' time")
    job.add_argument("--no-progress", action="store_true")
    ray = p.add_argument_group("Ray", "capsteer: run the job on engine replicas through Ray "
                               "Data (needs capsteer[ray]; docs/scale-out.md)")
    ray.add_argument("--ray", action="store_true",
                     help="one engine per replica, each writing its own shards into --output")
    ray.add_argument("--num-replicas", type=int, default=None,
                     help="engine replicas, --tensor-parallel-size GPUs each (1 when not given)")
    ray.add_argument("--ray-address", default=None,
                     help="an existing Ray cluster (e.g. auto, ray://head:10001); default: "
                          "start a local one. Every node and this process must see --output")
    ray.add_argument("--ray-batch-size", type=int, default=None,
                     help="prompts per Ray Data batch (64 when not given; 8 batches are queued per "
                          "replica)")
    EngineArgs.add_cli_args(p)
    return p


def engine_args(args: Any, parser: Any) -> dict[str, Any]:
    """The vLLM engine arguments the command line set (the others keep vLLM's defaults)."""
    from vllm.engine.arg_utils import EngineArgs

    names = {f.name for f in dataclasses.fields(EngineArgs)} - {"model"}
    return {n: getattr(args, n) for n in sorted(names)
            if hasattr(args, n) and getattr(args, n) != parser.get_default(n)}


def _split(text: str) -> object:
    parts = [t.strip() for t in text.split(",") if t.strip()]
    if len(parts) == 1:
        return parts[0]
    return [int(t) if t.lstrip("-").isdigit() else t for t in parts]


def main(argv: list[str]) -> int:
    """`capsteer extract ARGV`."""
    from capsteer.config.sizes import parse_size
    from capsteer.engine_ext.vllm.version import UnsupportedError
    from capsteer.extract_ray import RayMissing

    parser = build_parser()
    args = parser.parse_args(argv)
    model = args.model_tag or (args.model if args.model != parser.get_default("model") else None)
    if not model:
        parser.error("give the model: capsteer extract MODEL --input ... --output ...")
    kwargs = engine_args(args, parser)
    if not Path(args.input).is_file():
        parser.error(f"--input {args.input}: no such file")
    if "worker_cls" in kwargs:  # capsteer.engine sets its own; vLLM would run only one
        parser.error("--worker-cls: capsteer extract runs capsteer's worker, which installs "
                     "the hooks; a worker of your own cannot run beside it")
    positions = _split(args.positions)
    try:
        result = extract(
            model, args.input, args.output, hooks=args.hooks.split(","),
            layers=_split(args.layers), positions=positions if isinstance(positions, list)
            or not positions.lstrip("-").isdigit() else [int(positions)],
            capture_dtype=args.capture_dtype, shard_size=parse_size(args.shard_size),
            digest=args.digest,
            max_tokens=args.max_tokens, full_forward=args.full_forward,
            progress=not args.no_progress, ray=args.ray,
            num_replicas=args.num_replicas, ray_address=args.ray_address,
            ray_batch_size=args.ray_batch_size, **kwargs)
    except KeyboardInterrupt:
        print(f"\ninterrupted: finished requests are in {args.output}; run the same command "
              "again to resume", flush=True)
        return 130
    except (InputError, ValueError, RayMissing, UnsupportedError) as exc:
        print(f"capsteer extract: {exc}", flush=True)  # one line, not a stack
        return 2
    print(f"{result.requests} requests extracted ({result.skipped} already done), "
          f"{result.tokens} tokens in {result.seconds:.1f} s ({result.tokens_per_s:,.0f} tok/s), "
          f"{result.bytes_written / 2**20:,.1f} MiB in {len(result.shards)} shards under {result.output}"
          + (f"; the forward ran {result.forward_layers} of {result.model_layers} layers"
             if result.forward_layers is not None else ""), flush=True)
    return 0
