"""ShardedSink + ShardedWriter throughput under an extraction-job-like load.

The engine's harvester thread calls the sink; whatever time it spends inside
`write`/`close` is time the GPU step loop may wait (two-slot pinned ring). So
next to wall-clock rows/s and MB/s (first call to last shard durable) this
prints the *caller-thread* time: seconds spent inside sink calls, the MB/s that
would allow, and the calls that stalled (> 10 ms). The producer here is not
paced by a GPU, so once the disk is the limit the writer's backpressure shows
up as stalls (by design); `--max-pending 64` takes it away to show the bare
per-request cost.

Load (defaults ~ the GPU job scaled down): requests of ~143 prompt positions,
28 keys (resid_post at every layer), hidden 1024, bf16; each engine step packs
`--batch-tokens` tokens with chunked prefill; per step and key every request in
the step gets `sink.write(capture_id, hook, layer, positions, rows)` with rows a
fresh tensor (a clone, as the worker makes), then finished requests get
`sink.close(CaptureEnd(...))`.

    .venv/bin/python bench/sharded_writer_bench.py [--requests 192] [--shard-mib 256]
        [--batch-tokens 2048] [--flush-threads 2] [--max-pending 2] [--repeat 3]
        [--digest sha256|blake3] [--impl OLD_SHARDED_PY] [--dir DIR]

`--digest` picks the shards' digest (default: the writer's, sha256); `--inline-hash`
hashes on the flush thread itself, as before issue 12 (no digest threads). The summary
also gives the process CPU seconds per GB of shards (hashing included).

`--impl` times another copy of capture/sharded.py on the same machine, e.g.
`git show REV:capture/sharded.py > /tmp/sharded_old.py; ... --impl /tmp/sharded_old.py`.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import numpy as np
import torch

from capsteer.capture.sink import CaptureEnd, CaptureRequest
from capsteer.capture.spec import parse_capture_spec


def load_impl(path: str | None) -> ModuleType:
    if path is None:
        from capsteer.capture.writer import shard_sink as sharded

        return sharded
    spec = importlib.util.spec_from_file_location("sharded_under_test", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=192)
    ap.add_argument("--positions", type=int, default=143, help="mean prompt length")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch-tokens", type=int, default=2048,
                    help="tokens per engine step (capsteer extract pins 2048)")
    ap.add_argument("--shard-mib", type=int, default=256)
    ap.add_argument("--flush-threads", type=int, default=None)
    ap.add_argument("--max-pending", type=int, default=None)
    ap.add_argument("--digest", default=None, help="shard digest: sha256 or blake3 (writer default)")
    ap.add_argument("--inline-hash", action="store_true",
                    help="hash on the writing thread (the pre-issue-12 path) instead of digest threads")
    ap.add_argument("--impl", default=None, help="path of another capture/sharded.py to time")
    ap.add_argument("--dir", default=None, help="parent directory for the job (default: $TMPDIR)")
    ap.add_argument("--repeat", type=int, default=1, help="runs; the median run is summarized")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="torch intra-op threads (1: OpenMP spinning on a small shared box "
                         "makes the bench's own row clones erratic)")
    return ap.parse_args()


STALL_S = 0.010  # a sink call longer than this is a stall (backpressure or lock wait)


def run_once(args: argparse.Namespace, mod: ModuleType, kw: dict) -> dict:
    dtype = getattr(torch, args.dtype)
    rng = np.random.default_rng(args.seed)
    lo, hi = max(1, args.positions * 2 // 3), args.positions * 4 // 3
    lengths = rng.integers(lo, hi + 1, size=args.requests).tolist()
    spec = parse_capture_spec({"hooks": ["resid_post"], "layers": "all", "positions": "prompt"},
                              num_layers=args.layers)
    keys = spec.keys()
    # A source to clone rows from (the worker clones a slice of its pinned ring).
    source = (torch.randn(args.batch_tokens + len(keys), args.hidden) * 3).to(dtype)
    parent = Path(args.dir) if args.dir else None
    tmp = Path(tempfile.mkdtemp(prefix="sharded-bench-", dir=parent))
    try:
        writer = mod.ShardedWriter(tmp / "job", keys=keys, hidden_size=args.hidden, dtype=dtype,
                                   shard_bytes=args.shard_mib << 20, model="bench", spec=spec, **kw)
        sink = mod.ShardedSink(writer)
        queue = list(range(args.requests))  # requests waiting or in prefill, in order
        done = [0] * args.requests  # positions fed so far
        durations: list[float] = []  # every sink call, seconds
        clone_s = 0.0
        t_start, cpu_start = time.perf_counter(), time.process_time()
        for i in range(args.requests):
            t0 = time.perf_counter()
            sink.open(CaptureRequest(f"c{i}", f"r{i}", "bench", spec,
                                     tuple(range(lengths[i])), dtype, args.hidden, args.layers))
            durations.append(time.perf_counter() - t0)
        while queue:  # one engine step per iteration: chunked prefill of `batch_tokens`
            budget = args.batch_tokens
            finished = []
            for i in queue:
                if budget == 0:
                    break
                n = min(budget, lengths[i] - done[i])
                pos = np.arange(done[i], done[i] + n, dtype=np.int64)
                for j, (hook, layer) in enumerate(keys):
                    t0 = time.perf_counter()
                    rows = source[j: j + n].clone()
                    t1 = time.perf_counter()
                    sink.write(f"c{i}", hook, layer, pos, rows)
                    durations.append(time.perf_counter() - t1)
                    clone_s += t1 - t0
                done[i] += n
                budget -= n
                if done[i] == lengths[i]:
                    finished.append(i)
            for i in finished:
                queue.remove(i)
                t0 = time.perf_counter()
                sink.close(CaptureEnd(f"c{i}", tuple(range(lengths[i])), "length"))
                durations.append(time.perf_counter() - t0)
        t_fed = time.perf_counter()
        writer.close()
        t_end, cpu_s = time.perf_counter(), time.process_time() - cpu_start
        assert len(writer.done_ids) == args.requests, len(writer.done_ids)
        rows = sum(lengths)
        stalls = [d for d in durations if d > STALL_S]
        return {
            "rows": rows, "keys": len(keys),
            "bytes": rows * len(keys) * args.hidden * source.element_size(),
            "shard_bytes": sum(p.stat().st_size for p in (tmp / "job").glob("shard-*.safetensors")),
            "wall_s": t_end - t_start, "caller_s": sum(durations), "drain_s": t_end - t_fed,
            "calls": len(durations), "worst_s": max(durations), "stalls": len(stalls),
            "stall_s": sum(stalls), "clone_s": clone_s, "cpu_s": cpu_s,
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def report(r: dict, label: str) -> None:
    rows, nbytes = r["rows"], r["bytes"]
    print(f"{label}wall {r['wall_s']:5.2f} s = {rows / r['wall_s']:6.0f} rows/s "
          f"{nbytes / r['wall_s'] / 1e6:5.0f} MB/s | caller thread {r['caller_s']:5.2f} s = "
          f"{rows / r['caller_s']:7.0f} rows/s {nbytes / r['caller_s'] / 1e6:6.0f} MB/s, "
          f"{r['stalls']} calls > {STALL_S * 1e3:.0f} ms ({r['stall_s']:.2f} s), "
          f"slowest {r['worst_s'] * 1e3:4.0f} ms | drain {r['drain_s']:4.2f} s | "
          f"bench clones {r['clone_s']:4.2f} s")


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.torch_threads)
    mod = load_impl(args.impl)
    if args.inline_hash:
        from capsteer.capture import publish

        publish._OVERLAP_MIN = 1 << 62
    kw = {}
    params = inspect.signature(mod.ShardedWriter).parameters
    for name in ("flush_threads", "max_pending", "digest"):
        if getattr(args, name) is not None:
            if name not in params:
                raise SystemExit(f"{args.impl or 'sharded.py'} has no {name} argument")
            kw[name] = getattr(args, name)
    runs = []
    for n in range(args.repeat):
        runs.append(run_once(args, mod, kw))
        report(runs[-1], f"run {n + 1}: ")
    r = sorted(runs, key=lambda r: r["wall_s"])[len(runs) // 2]
    print(f"impl: {args.impl or 'capture/sharded.py'}  writer kwargs: {kw or 'defaults'}"
          f"{'  (hash inline)' if args.inline_hash else ''}")
    print(f"load: {args.requests} requests, {r['rows']} rows x {r['keys']} keys x {args.hidden} "
          f"{args.dtype} = {r['bytes'] / 1e9:.2f} GB of rows ({r['shard_bytes'] / 1e9:.2f} GB "
          f"of shards), shard {args.shard_mib} MiB, {args.batch_tokens} tokens per step")
    print(f"wall (first call -> last shard durable): {r['wall_s']:6.2f} s  "
          f"{r['rows'] / r['wall_s']:8.0f} rows/s  {r['bytes'] / r['wall_s'] / 1e6:6.0f} MB/s")
    print(f"caller thread (inside write/close):      {r['caller_s']:6.2f} s  "
          f"{r['rows'] / r['caller_s']:8.0f} rows/s  {r['bytes'] / r['caller_s'] / 1e6:6.0f} MB/s"
          f"  ({r['stalls']} of {r['calls']} calls > {STALL_S * 1e3:.0f} ms: {r['stall_s']:.2f} s;"
          f" slowest {r['worst_s'] * 1e3:.0f} ms)")
    print(f"final writer.close() (drain):            {r['drain_s']:6.2f} s")
    print(f"bench's own row clones (not counted):    {r['clone_s']:6.2f} s")
    print(f"process cpu (all threads, clones incl.): {r['cpu_s']:6.2f} s  "
          f"{r['cpu_s'] / (r['shard_bytes'] / 1e9):6.2f} s per GB of shards")
    if args.repeat > 1:
        print(f"(median of {args.repeat} runs by wall time)")


if __name__ == "__main__":
    main()
