"""Extraction jobs on Ray Data: N engine replicas, one job directory (issue 14, api.md §5).

Ray Data reads the input (JSONL through `read_text`, Parquet through `read_parquet`) and
`map_batches` it over a fixed pool of N actors, each holding one capsteer `Engine`
(`tensor_parallel_size` GPUs each). Ray schedules; capsteer only writes: each replica
stages its own shards and the driver commits them into the job directory (commit.py
gives the layout and the recovery rules). Ray stays an optional dependency
(`capsteer[ray]`): it is imported only once a job asks for it.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from capsteer.capture.digests import check_digest
from capsteer.capture.publish import ensure_dir
from capsteer.capture.sharded import INDEX_FILE
from capsteer.capture.spec import CaptureSpec, parse_capture_spec
from capsteer.config import errors
from capsteer.engine import Engine
from capsteer.engine_ext.payload import RPC_END_CAPTURES, RPC_FLUSH_SHARDED
from capsteer.extraction.commit import STAGING_DIR, JobCommitter, staging_listing
from capsteer.extraction.job import (
    ExtractResult,
    InputError,
    Record,
    check_job,
    check_recorded_digest,
    check_resumed_ids,
    check_row,
    job_config,
    job_dir_bytes,
    logger,
    model_num_layers,
    model_unavailable_hooks,
    read_records,
    scan_ids,
    shard_files,
    warn_if_narrower,
)
from capsteer.extraction.submit import engine_prompts, submit_capture

FLUSH_TIMEOUT_S = 120.0  # idle replica: finished requests must reach its staging index by then
_INSTALL_HINT = "capsteer extract --ray needs Ray Data: pip install 'capsteer[ray]'"
# Environment the replicas get from the driver (also on a cluster started elsewhere).
_FORWARDED_ENV = ("VLLM_", "CAPSTEER_")


class RayMissing(errors.Unsupported, ImportError):
    """`--ray` without Ray Data installed."""


def require_ray() -> Any:
    """The `ray` module with Ray Data, or RayMissing saying what to install."""
    try:  # optional dependency (capsteer[ray]): imported only when a job asks for Ray
        import ray
        import ray.data
    except ImportError as exc:
        raise RayMissing(f"{_INSTALL_HINT} ({exc})") from exc
    return ray


# --------------------------------------------------------------------------- input
def _normalized(rows: Iterable[tuple[str, object]], skip: frozenset[str]) -> Any:
    """A pyarrow table (id, prompt, messages as JSON) of the rows not in `skip`."""
    import pyarrow as pa  # optional: comes with Ray Data (capsteer[ray])

    ids, prompts, messages = [], [], []
    for where, row in rows:
        rid, prompt, msgs = check_row(where, row)
        if rid is None:  # scan_ids saw an id on every row; the file changed under the job
            raise RuntimeError(f"{where}: no 'id' (was the input file changed during the job?)")
        if rid in skip:
            continue
        ids.append(rid)
        prompts.append(prompt)
        messages.append(None if msgs is None else json.dumps(msgs))
    return pa.table({"id": ids, "prompt": prompts, "messages": messages},
                    schema=pa.schema([("id", pa.string()), ("prompt", pa.string()),
                                      ("messages", pa.string())]))


def _from_text(batch: Any, path: str, skip: frozenset[str]) -> Any:
    """Ray Data step: JSONL lines (read_text) to normalized rows, done ids dropped."""

    def rows() -> Iterator[tuple[str, object]]:
        for line in batch.column("text").to_pylist():
            if line is None or not line.strip():
                continue
            try:
                yield path, json.loads(line)
            except ValueError as exc:
                raise InputError(f"{path}: not JSON ({exc})") from None

    return _normalized(rows(), skip)


def _from_parquet(batch: Any, path: str, skip: frozenset[str]) -> Any:
    """Ray Data step: Parquet rows to normalized rows, done ids dropped."""
    return _normalized(((path, r) for r in batch.to_pylist()), skip)


# ------------------------------------------------------------------------ replicas
@dataclass
class _Ticket:
    """One Ray Data batch inside a replica: done when every id of it is staged."""

    ids: list[str]
    started: float
    remaining: set[str] = field(default_factory=set)
    entries: dict[str, dict[str, Any]] = field(default_factory=dict)
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


def _reported(ids: list[str], replica: str, entries: list[dict[str, Any]],
              started: float) -> Any:
    """A replica's answer for one batch: where each request sits in its staging shards."""
    import pyarrow as pa  # optional: comes with Ray Data (capsteer[ray])

    return pa.table({
        "id": pa.array(ids, pa.string()), "replica": pa.array([replica] * len(ids), pa.string()),
        "shard": pa.array([e["shard"] for e in entries], pa.string()),
        "row_start": pa.array([int(e["row_start"]) for e in entries], pa.int64()),
        "row_count": pa.array([int(e["row_count"]) for e in entries], pa.int64()),
        "prompt_tokens": pa.array([int(e["prompt_tokens"]) for e in entries], pa.int64()),
        "started": pa.array([started] * len(ids), pa.float64())})


class Replica:
    """A Ray Data actor: one capsteer Engine writing its own staging job.

    Batches arrive on up to `max_concurrent_calls_per_actor` threads and are queued to a
    single engine thread that keeps the engine's queue full across batches (no drain
    between them); a call returns once all its ids are durable in the staging directory.
    The partly filled shard is flushed only when the engine has nothing else to do."""

    def __init__(self, model: str, output: str, spec: dict[str, Any], shard_size: int,
                 max_tokens: int, window: int | None, engine_kwargs: dict[str, Any],
                 digest: str, num_layers: int | None = None, full_forward: bool = False) -> None:
        self.name = "r-" + uuid.uuid4().hex[:12]
        out = Path(output)
        self.dir = out / STAGING_DIR / self.name
        self.spec = CaptureSpec.from_dict(spec)
        self.max_tokens = max_tokens
        kwargs = dict(engine_kwargs)
        config = job_config(self.dir, self.spec, shard_size, kwargs, digest=digest,
                            num_layers=num_layers, max_tokens=max_tokens,
                            full_forward=full_forward)
        config["sharded"]["job_id"] = out.name  # shard metadata names the job, not the stage
        self.engine = Engine(model, capsteer_config=config, **kwargs)
        warn_if_narrower(self.spec.dtype, self.engine.dtype)
        self.limit = window or 4 * int(
            self.engine.llm.llm_engine.vllm_config.scheduler_config.max_num_seqs)
        self._inbox: queue.Queue[tuple[list[Any], _Ticket] | None] = queue.Queue()
        self._error: BaseException | None = None
        self._owner: dict[str, _Ticket] = {}  # id -> its ticket (engine thread only)
        self._staged: dict[str, dict[str, Any]] = {}
        self._listed: set[str] = set()
        self._index_offset = 0
        self._thread = threading.Thread(target=self._loop, name="capsteer-replica", daemon=True)
        self._thread.start()

    def __call__(self, batch: Any) -> Any:
        started = time.time()
        if self._error is not None:
            raise RuntimeError(f"replica {self.name} failed earlier: {self._error!r}")
        rows = batch.to_pylist()
        records = [Record(str(r["id"]), r["prompt"],
                          None if r["messages"] is None else json.loads(r["messages"]))
                   for r in rows]
        ticket = _Ticket([r.id for r in records], started, {r.id for r in records})
        if records:
            self._inbox.put((records, ticket))
            ticket.done.wait()
        if ticket.error is not None:
            raise RuntimeError(f"replica {self.name}: {ticket.error!r}") from ticket.error
        entries = [ticket.entries[i] for i in ticket.ids]
        return _reported(ticket.ids, self.name, entries, started)

    # ---- the engine thread
    def _loop(self) -> None:
        try:
            self._drive()
        except BaseException as exc:  # every waiting call fails with it, none hangs
            self._error = exc
            logger.exception("capsteer replica %s failed", self.name)
            for ticket in {id(t): t for t in self._owner.values()}.values():
                ticket.error = exc
                ticket.done.set()
            while True:
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[1].error = exc
                    item[1].done.set()

    def _drive(self) -> None:
        llm = self.engine.llm
        llm_engine = llm.llm_engine
        pending: deque[Any] = deque()
        live: set[str] = set()  # request ids given to vLLM (capture ids)
        capture_of: dict[str, str] = {}  # capture id -> record id
        unflushed: set[str] = set()  # finished ids not yet seen durable
        payload_spec = self.spec.to_json()  # text: vLLM deep-copies each request's params
        awaited: set[str] = set()  # captures whose output length the workers wait for
        stuck_since: float | None = None
        while True:
            idle = not pending and not live
            try:
                item = self._inbox.get(timeout=0.05) if idle and not unflushed \
                    else self._inbox.get_nowait()
                while True:
                    if item is None:
                        return
                    records, ticket = item
                    for rec in records:
                        self._owner[rec.id] = ticket
                        pending.append(rec)
                    item = self._inbox.get_nowait()
            except queue.Empty:
                pass
            while pending and len(live) < self.limit:
                rec = pending.popleft()
                _, prompt = next(engine_prompts(self.engine, [rec]))
                capture_id, reports = submit_capture(llm_engine, rec, prompt, self.spec,
                                                     payload_spec, self.max_tokens)
                if reports:
                    awaited.add(capture_id)
                live.add(capture_id)
                capture_of[capture_id] = rec.id
            if llm_engine.has_unfinished_requests():
                ends = []
                for output in llm_engine.step():
                    if output.finished and output.request_id in live:
                        live.discard(output.request_id)
                        unflushed.add(capture_of.pop(output.request_id))
                        if output.request_id in awaited:
                            awaited.discard(output.request_id)
                            ends.append((output.request_id, len(output.outputs[0].token_ids)))
                if ends:
                    llm.collective_rpc(RPC_END_CAPTURES, args=(ends,))
            elif live:  # never spin on requests the engine no longer has
                raise RuntimeError(f"the engine finished {len(live)} requests without a final "
                                   f"output (e.g. {sorted(live)[:3]})")
            elif unflushed and not pending and self._inbox.empty():
                llm.collective_rpc(RPC_FLUSH_SHARDED)  # idle: publish the partial shard
                self._poll_staging(unflushed)
                if not unflushed:
                    stuck_since = None
                    continue
                # The workers close a capture when they see its request finish, on the engine
                # core's next (possibly empty) step, which can come after this flush: retry.
                stuck_since = stuck_since or time.monotonic()
                if time.monotonic() - stuck_since > FLUSH_TIMEOUT_S:
                    raise RuntimeError(f"{len(unflushed)} requests finished but are not in "
                                       f"{self.dir / INDEX_FILE} after {FLUSH_TIMEOUT_S:.0f} s "
                                       f"(e.g. {sorted(unflushed)[:3]}); see the engine log")
                time.sleep(0.02)
                continue
            self._poll_staging(unflushed)

    def _poll_staging(self, unflushed: set[str]) -> None:
        """Read index lines the worker appended since the last poll; finish tickets whose ids
        are all in the staging index and whose shards are in the staging manifest."""
        path = self.dir / INDEX_FILE
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return
        if size > self._index_offset:
            with open(path, "rb") as fh:
                fh.seek(self._index_offset)
                raw = fh.read(size - self._index_offset)
            cut = raw.rfind(b"\n") + 1
            self._index_offset += cut
            for line in raw[:cut].splitlines():
                if line.strip():
                    e = json.loads(line)
                    self._staged[str(e["id"])] = e
        if not self._staged:
            return
        if any(e["shard"] not in self._listed for e in self._staged.values()):
            self._listed = set(staging_listing(self.dir))
        for rid in [r for r, e in self._staged.items() if e["shard"] in self._listed]:
            e = self._staged.pop(rid)
            unflushed.discard(rid)
            ticket = self._owner.pop(rid, None)
            if ticket is None:
                continue
            ticket.entries[rid] = e
            ticket.remaining.discard(rid)
            if not ticket.remaining:
                ticket.done.set()


# -------------------------------------------------------------------------- driver
DEFAULT_BATCH_SIZE = 64  # prompts per Ray Data batch
IN_FLIGHT_PER_REPLICA = 8  # batches queued inside each replica (keeps its engine fed)
WAIT_FOR_REPLICAS_S = 3600  # unless DataContext.wait_for_min_actors_s says otherwise


@dataclass
class _Job:
    """What the driver needs to run one job (all paths resolved, spec parsed)."""

    model: str
    path: Path
    out: Path
    spec: Any
    shard_size: int
    max_tokens: int
    progress: bool
    window: int | None
    num_replicas: int
    batch_size: int
    engine_kwargs: dict[str, Any]
    digest: str
    num_layers: int | None = None  # None: the replicas' forwards run every layer
    full_forward: bool = False


def _replica_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(_FORWARDED_ENV)}


def extract_on_ray(
    model: str, input_path: str | Path, output: str | Path, *, ray: bool, engine: Any,
    hooks: Any, layers: object, positions: object, capture_dtype: str, shard_size: int,
    max_tokens: int, progress: bool, window: int | None, num_replicas: int | None,
    ray_address: str | None, ray_batch_size: int | None, engine_kwargs: dict[str, Any],
    digest: str = "sha256", full_forward: bool = False,
) -> ExtractResult:
    """`extract(..., ray=True)`: run (or resume) a job on engine replicas through Ray Data."""
    if not ray:
        raise ValueError("num_replicas, ray_address and ray_batch_size need ray=True (--ray)")
    if engine is not None:
        raise ValueError("ray=True starts one engine per replica; do not pass engine=")
    replicas = 1 if num_replicas is None else int(num_replicas)
    batch_size = DEFAULT_BATCH_SIZE if ray_batch_size is None else int(ray_batch_size)
    if replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {replicas}")
    if batch_size < 1:
        raise ValueError(f"ray_batch_size must be >= 1, got {batch_size}")
    for name in ("pipeline_parallel_size", "data_parallel_size"):
        if int(engine_kwargs.get(name) or 1) > 1:
            raise ValueError(f"--{name.replace('_', '-')} > 1 is not supported with --ray: each "
                             "replica is one engine of --tensor-parallel-size GPUs, and the "
                             "replicas are the data parallelism (--num-replicas)")
    check_digest(digest)
    ray_module = require_ray()
    out = Path(output)
    num_layers = model_num_layers(model)
    spec = parse_capture_spec(
        {"hooks": [hooks] if isinstance(hooks, str) else list(hooks), "layers": layers,
         "positions": positions, "dtype": capture_dtype}, num_layers=num_layers,
        unavailable=model_unavailable_hooks(model))
    check_job(out, spec)
    if Path(model).exists():  # replicas may run elsewhere (another cwd, another node)
        model = str(Path(model).resolve())
    job = _Job(model, Path(input_path).resolve(), out, spec, int(shard_size), int(max_tokens),
               progress, window, replicas, batch_size, dict(engine_kwargs), digest, num_layers,
               full_forward)
    ids, all_named = scan_ids(job.path)
    committer = JobCommitter(out)
    recovered = committer.merge_staging()
    if recovered:
        logger.warning("capsteer extract: committed %d requests that replicas had made durable "
                       "before the last run stopped", recovered)
    check_resumed_ids(out, committer.done, set(ids))
    todo = [i for i in ids if i not in committer.done]
    if not todo:
        return ExtractResult(out, 0, len(ids), 0, 0.0, 0, shard_files(out))
    started_ray = local = False
    if ray_module.is_initialized():
        if ray_address is not None:
            raise ValueError("Ray is already initialized in this process; leave ray_address "
                             "unset to use its cluster")
    else:
        address = ray_address or os.environ.get("RAY_ADDRESS") or None
        init: dict[str, Any] = {"address": address}
        if address is None:  # a local cluster: logical CPUs for the replicas and the reads
            init.update(num_cpus=max(os.cpu_count() or 1, replicas + 2), include_dashboard=False)
            local = True
        ray_module.init(**init)
        started_ray = True
    try:
        return _execute(ray_module, job, ids, todo, all_named, committer, local)
    finally:
        if started_ray:
            ray_module.shutdown()


def _dataset(ray: Any, job: _Job, skip: frozenset[str], all_named: bool) -> Any:
    """The input as normalized rows (id, prompt, messages as JSON), done ids dropped."""
    if all_named:
        parquet = job.path.suffix == ".parquet"
        read = ray.data.read_parquet if parquet else ray.data.read_text
        return read(str(job.path)).map_batches(
            _from_parquet if parquet else _from_text,
            fn_kwargs={"path": str(job.path), "skip": skip}, batch_format="pyarrow")
    # ids default to line numbers, which only a reader of the whole file knows
    logger.warning("capsteer extract: %s has rows without an 'id'; the driver reads the whole "
                   "file to number them (give every row an id to let Ray Data read it)", job.path)
    return ray.data.from_items([
        {"id": r.id, "prompt": r.prompt,
         "messages": None if r.messages is None else json.dumps(r.messages)}
        for r in read_records(job.path) if r.id not in skip])


def _execute(ray: Any, job: _Job, ids: list[str], todo: list[str], all_named: bool,
             committer: JobCommitter, local: bool) -> ExtractResult:
    from ray.data import ActorPoolStrategy, DataContext  # optional: require_ray checked it

    tp = int(job.engine_kwargs.get("tensor_parallel_size") or 1)
    cluster_gpus = float(ray.cluster_resources().get("GPU", 0))
    gpus = tp if cluster_gpus > 0 else 0
    if gpus and cluster_gpus < job.num_replicas * tp:
        message = (f"{job.num_replicas} replicas x {tp} GPUs need {job.num_replicas * tp} GPUs; "
                   f"the Ray cluster has {cluster_gpus:g}")
        if local:  # no autoscaler will add any
            raise ValueError(message)
        logger.warning("capsteer extract: %s (waiting for the autoscaler)", message)
    kwargs = dict(job.engine_kwargs)
    if tp > 1:  # the engine's workers live inside the replica's GPUs, not in Ray tasks
        kwargs.setdefault("distributed_executor_backend", "mp")
    ctx = DataContext.get_current()
    ctx.enable_progress_bars = False  # the job's bar counts everything
    if ctx.wait_for_min_actors_s <= 0:  # all replicas up before the first batch: the work is
        ctx.wait_for_min_actors_s = WAIT_FOR_REPLICAS_S  # spread and the timing fair
    ensure_dir(job.out / STAGING_DIR)
    # One block per batch: a replica takes a block at a time, so blocks of the reader's size
    # (1/8 of a small file) would hand a resume's contiguous leftover ids to one replica.
    rows = _dataset(ray, job, frozenset(committer.done), all_named).repartition(
        target_num_rows_per_block=job.batch_size)
    ds = rows.map_batches(
        Replica, batch_size=job.batch_size, batch_format="pyarrow",
        fn_constructor_kwargs={"model": job.model, "output": str(job.out.resolve()),
                               "spec": job.spec.to_dict(), "shard_size": job.shard_size,
                               "max_tokens": job.max_tokens, "window": job.window,
                               "engine_kwargs": kwargs, "digest": job.digest,
                               "num_layers": job.num_layers, "full_forward": job.full_forward},
        compute=ActorPoolStrategy(size=job.num_replicas,
                                  max_tasks_in_flight_per_actor=IN_FLIGHT_PER_REPLICA,
                                  max_concurrent_calls_per_actor=IN_FLIGHT_PER_REPLICA,
                                  enable_true_multi_threading=True),
        num_cpus=1, num_gpus=gpus or None, runtime_env={"env_vars": _replica_env()})

    bar = None
    if job.progress:
        bar = tqdm(total=len(ids), initial=len(ids) - len(todo), unit="req", smoothing=0.1,
                   desc=f"extract (ray, {job.num_replicas} replicas)")
    bytes_before, shards_before = job_dir_bytes(job.out), set(shard_files(job.out))
    first_start: float | None = None
    last_commit = time.time()
    shown = 0.0
    try:
        for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
            rows = batch.to_pylist()
            if not rows:
                continue
            committer.commit(rows)
            last_commit = time.time()
            start = min(float(r["started"]) for r in rows)
            first_start = start if first_start is None else min(first_start, start)
            if bar is not None:
                bar.n = len(ids) - len(todo) + committer.committed
                if time.monotonic() - shown > 0.5 or bar.n == len(ids):
                    shown = time.monotonic()
                    elapsed = max(last_commit - first_start, 1e-9)
                    bar.set_postfix_str(f"{committer.tokens / elapsed:,.0f} tok/s, "
                                        f"{job_dir_bytes(job.out) / 2**20:,.1f} MiB on disk",
                                        refresh=False)
                bar.refresh()
    finally:
        if bar is not None:
            bar.close()
    leftover = committer.merge_staging()  # none, unless a replica died between staging and return
    if leftover:
        logger.warning("capsteer extract: committed %d staged requests at the end", leftover)
    missing = set(todo) - committer.done
    if missing:
        raise RuntimeError(f"{len(missing)} requests are not in {job.out / INDEX_FILE} after the "
                           f"run (e.g. {sorted(missing)[:3]}); see the replicas' logs; re-run to "
                           "resume")
    check_recorded_digest(job.out, job.digest, shards_before)
    logger.info("capsteer extract: requests per replica: %s",
                ", ".join(f"{k}={v}" for k, v in sorted(committer.per_replica.items())))
    seconds = last_commit - first_start if first_start is not None else 0.0
    return ExtractResult(job.out, len(todo), len(ids) - len(todo), committer.tokens, seconds,
                         job_dir_bytes(job.out) - bytes_before, shard_files(job.out))
