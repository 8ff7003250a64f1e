"""An extraction job's input, directory and resume rules (api.md §5, §5b).

What both runners (local.py, ray.py) share: the input format (JSONL or Parquet rows of
`id` plus `prompt` or `messages`; ids default to line numbers and must be unique), the
worker config a job's engine gets, the checks that let a resumed job continue only the
job its directory holds, and how the job's shards are named and counted. The job
directory's `index.jsonl` is the truth for resuming: every id it lists is done.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Container, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from capsteer.capture.digests import entry_digest
from capsteer.capture.spec import CaptureSpec
from capsteer.config import errors
from capsteer.engine_ext import families
from capsteer.engine_ext.runtime import hook_point, layers_needed

# One logger for the whole job, whichever runner drives it (users filter on this name).
logger = logging.getLogger("capsteer.extract")


@dataclass(frozen=True)
class Record:
    """One input line: a completion prompt or chat messages."""

    id: str
    prompt: str | None = None
    messages: list[dict] | None = None


@dataclass
class ExtractResult:
    """What one run of a job did (a resumed run counts only its own work)."""

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


class InputError(errors.InvalidInput, ValueError):
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
        try:  # optional: only Parquet inputs need pyarrow
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


def scan_ids(path: str | Path) -> tuple[list[str], bool]:
    """Every row's id in input order (its row number where a row has none) and whether
    each row named its own; checks the rows as read_records does (unique ids, prompt xor
    messages) without keeping the prompts. The driver needs it for the job's total and
    for what is left to do."""
    ids: list[str] = []
    all_named = True
    for record, named in iter_records(path):
        ids.append(record.id)
        all_named = all_named and named
    return ids, all_named


def model_num_layers(model: str) -> int:
    """The model's decoder layers, read from its config: layer ranges and stop_at_layer need it."""
    from transformers import AutoConfig  # start-up cost (~2 s): Ray's reads never need it

    config = AutoConfig.from_pretrained(model)
    config = getattr(config, "text_config", None) or config
    return int(config.num_hidden_layers)


def model_unavailable_hooks(model: str) -> dict[str, str]:
    """Hooks the model's family row says it lacks (a parallel block's resid_mid), from its
    config: a job asking for one is refused before any engine starts. (A model without a
    row is checked by the engine, which knows whether vLLM's Transformers backend runs it.)"""
    from transformers import AutoConfig  # start-up cost (~2 s): Ray's reads never need it

    return families.unavailable_hooks_of(AutoConfig.from_pretrained(model))


def warn_if_narrower(capture_dtype: str, model_dtype: Any) -> None:
    """Storing fewer bits than the model computes is allowed, and said once per job."""
    if capture_dtype == "auto":
        return
    stored = getattr(torch, capture_dtype)
    if torch.finfo(stored).bits < torch.finfo(model_dtype).bits:
        logger.warning("capsteer extract: the model runs in %s; activations are stored as %s "
                       "(--capture-dtype), which rounds them",
                       str(model_dtype).removeprefix("torch."), capture_dtype)


def job_dir_bytes(out: Path) -> int:
    """Bytes of the job's shards: what a run wrote is the difference."""
    return sum(p.stat().st_size for p in out.glob("shard-*.safetensors"))


def check_recorded_digest(out: Path, digest: str, shards_before: set[str]) -> None:
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
    engine_kwargs.setdefault("max_num_batched_tokens", 2048)
    # Distinct points (resid_post(L) is resid_pre(L+1)'s): any layer count past the
    # deepest captured layer numbers them alike.
    n = num_layers or 1 + max(layer for _, layer in spec.keys())
    points = {hook_point(hook, layer, n) for hook, layer in spec.keys()}
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
    if max_tokens > 1 and spec.positions.kind not in ("prompt", "last_prompt"):
        return None
    return layers_needed(spec.keys(), num_layers)


def shard_files(out: Path) -> list[str]:
    """The job's shard file names, in shard order."""
    return sorted(p.name for p in out.glob("shard-*.safetensors"))


def check_job(out: Path, spec: CaptureSpec) -> None:
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


def check_resumed_ids(out: Path, done: Container[str], ids: set[str]) -> None:
    """A resumed job's done ids must all be the input's: else the input is another one (or
    its rows were numbered otherwise: default ids are line numbers, blank lines counted),
    and resuming would store rows twice under two ids."""
    stray = sorted(d for d in done if d not in ids)
    if stray:
        raise ValueError(f"{out} holds {len(stray)} request id(s) this input does not have "
                         f"(e.g. {stray[0]!r}): it is another job's input, or its rows are "
                         "numbered otherwise (give every row an `id`); use another --output")


def shard_number(name: str) -> int | None:
    """NNNNN of `shard-NNNNN.safetensors` (None for other names): the next shard's number."""
    stem = name.removeprefix("shard-").removesuffix(".safetensors")
    return int(stem) if stem.isdigit() and name.startswith("shard-") else None

