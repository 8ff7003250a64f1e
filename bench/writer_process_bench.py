"""ProcessCaptureWriter throughput under the P3-all load, without an engine.

P3-all (every layer x every prompt position, durable) is bounded by the path rows take
after the GPU: the engine's sink thread copies each step's rows into the shared-memory
ring, the writer process takes them out and its writer threads publish them. This
drives that path alone, as the sink thread does: per engine step of `--batch-tokens`
tokens (chunked prefill), one `write` per request in the step and key, a view of a
source buffer as rows, then `end_step`; finished requests are closed. It prints the
publish rate (first write to everything durable), the seconds the producer spent in
`write` (the engine's sink thread would spend them), ring waits, and the CPU seconds of
each of the writer process's threads, so a serial stage shows up as one busy thread.

    .venv/bin/python bench/writer_process_bench.py [--requests 64] [--positions 512]
        [--layers 28] [--batch-tokens 8192] [--dir DIR] [--repeat 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stack_sampler import thread_cpu

from capsteer.capture.layouts import MANIFEST_FILE
from capsteer.capture.sink import CaptureEnd, CaptureRequest
from capsteer.capture.spec import parse_capture_spec
from capsteer.capture.writer.fanout import ProcessWriterPool
from capsteer.capture.writer.local import CaptureWriter
from capsteer.capture.writer.process import ProcessCaptureWriter


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--positions", type=int, default=512, help="prompt length of every request")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--batch-tokens", type=int, default=8192, help="tokens per engine step")
    ap.add_argument("--ring-mib", type=int, default=None, help="ring size (default: the writer's)")
    ap.add_argument("--workers", type=int, default=None, help="writer threads (default: the writer's)")
    ap.add_argument("--processes", type=int, default=1,
                    help="writer processes (ProcessWriterPool; the engine's capture_writer_processes)")
    ap.add_argument("--in-process", action="store_true",
                    help="publish through an in-process CaptureWriter (no ring, no child): "
                         "the writer's own rate at this load")
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval for an --in-process writer (Python's default 0.005)")
    ap.add_argument("--inline-hash", action="store_true",
                    help="an --in-process writer hashes every piece on its writing thread "
                         "(no digest-thread hand-off)")
    ap.add_argument("--per-piece", action="store_true",
                    help="an --in-process writer writes each piece by itself (AtomicFile.write "
                         "per piece, as before write_pieces batched them)")
    ap.add_argument("--busy-step", type=float, default=0.0,
                    help="run a thread beside the producer that holds the GIL in pure Python "
                         "for this many ms, then sleeps as long (the engine's step thread)")
    ap.add_argument("--hold-gil-copy", action="store_true",
                    help="experiment: the producer's ring copy keeps the GIL (PyDLL memmove)")
    ap.add_argument("--defer", action="store_true",
                    help="defer the link's sends (defer_sends) and flush them once a step, as "
                         "the engine's harvester does: one message a step instead of one per "
                         "open, write batch and close")
    ap.add_argument("--dir", default=None, help="parent directory of the capture root")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--start-at", type=float, default=None,
                    help="wall-clock time (epoch s) the first run starts at: several instances "
                         "started together measure writers that share nothing (bench/gpu_writer_scaling.sh)")
    ap.add_argument("--json", action="store_true", help="print the runs as JSON too")
    return ap.parse_args()


def manifest_timings(root: Path) -> dict:
    """Seconds the writer threads spent per phase, summed over the published manifests
    (queued: closed until a thread took it; write: data files written; fsync: of them)."""
    sums = {"captures": 0, "queued_s": 0.0, "write_s": 0.0, "fsync_s": 0.0}
    publish = []
    for path in root.rglob(MANIFEST_FILE):
        timings = json.loads(path.read_text()).get("timings", {})
        sums["captures"] += 1
        for k in ("queued_s", "write_s", "fsync_s"):
            sums[k] += float(timings.get(k, 0.0))
        publish.append(float(timings.get("publish_s", 0.0)))
    sums["median_publish_s"] = statistics.median(publish) if publish else None
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in sums.items()}


def run_once(args: argparse.Namespace, writer: Any, run: int, root: Path) -> dict:
    dtype = torch.bfloat16
    spec = parse_capture_spec({"hooks": ["resid_post"], "layers": "all", "positions": "prompt"},
                              num_layers=args.layers)
    keys = spec.keys()
    source = torch.randn(args.batch_tokens, args.hidden).to(dtype)  # the harvester's staging
    prompt = tuple(range(args.positions))
    ids = [f"r{run}x{i}" for i in range(args.requests)]
    done = [0] * args.requests
    pending = list(range(args.requests))
    # The writer's processes (a pool's children); [None]: the writer runs in this process.
    children = list(getattr(writer, "child_pids", None) or [getattr(writer, "child_pid", None)])
    child = children[0]
    links = list(getattr(writer, "writers", None) or [writer])
    sends0 = sum(getattr(w, "sends", 0) for w in links)
    send_s0 = sum(getattr(w, "send_s", 0.0) for w in links)
    waits0 = getattr(writer, "ring_waits", 0)
    wait_s0 = getattr(writer, "ring_wait_s", 0.0)
    cpu0 = {k: v for pid in children for k, v in thread_cpu(pid).items()}
    write_s = 0.0
    if run == 0 and args.start_at is not None:
        time.sleep(max(0.0, args.start_at - time.time()))
    epoch0 = time.time()
    t0 = time.perf_counter()
    for cid in ids:
        writer.open(CaptureRequest(cid, cid, "bench", spec, prompt, dtype, args.hidden, args.layers))
    while pending:
        budget, finished, row = args.batch_tokens, [], 0
        for i in pending:
            if budget == 0:
                break
            n = min(budget, args.positions - done[i])
            pos = np.arange(done[i], done[i] + n, dtype=np.int64)
            t = time.perf_counter()
            for hook, layer in keys:
                writer.write(ids[i], hook, layer, pos, source[row:row + n])
            write_s += time.perf_counter() - t
            done[i] += n
            budget -= n
            row += n
            if done[i] == args.positions:
                finished.append(i)
        if child is not None:
            writer.end_step()
        for i in finished:
            pending.remove(i)
            writer.close(CaptureEnd(ids[i], prompt, "length"))
        if args.defer:
            writer.flush_sends()
    t_fed = time.perf_counter()
    ok = writer.flush(600)
    t_end = time.perf_counter()
    epoch1 = time.time()
    cpu1 = {k: v for pid in children for k, v in thread_cpu(pid).items()}
    nbytes = args.requests * args.positions * len(keys) * args.hidden * 2
    by_name: dict[str, float] = {}
    for tid, (name, cpu) in cpu1.items():
        delta = cpu - cpu0.get(tid, (name, 0.0))[1]
        key = "main" if tid in (*children, os.getpid()) else name
        by_name[key] = by_name.get(key, 0.0) + delta
    return {
        "flushed": ok,
        "bytes": nbytes,
        "seconds": t_end - t0,
        "mb_s": nbytes / (t_end - t0) / 1e6,
        "fed_s": t_fed - t0,
        "epoch": [epoch0, epoch1],
        "producer_write_s": write_s,
        "ring_waits": getattr(writer, "ring_waits", 0) - waits0,
        # messages to the writer processes, and the producer's seconds pickling and sending
        "sends": sum(getattr(w, "sends", 0) for w in links) - sends0,
        "send_s": round(sum(getattr(w, "send_s", 0.0) for w in links) - send_s0, 4),
        "ring_wait_s": round(getattr(writer, "ring_wait_s", 0.0) - wait_s0, 3),
        "writer_timings": manifest_timings(root),
        "child_cpu_s": {k: round(v, 3) for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])},
    }


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    parent = Path(args.dir) if args.dir else None
    tmp = Path(tempfile.mkdtemp(prefix="writer-process-bench-", dir=parent))
    kw = {} if args.ring_mib is None else {"ring_bytes": args.ring_mib << 20}
    if args.switch_interval is not None or args.inline_hash or args.per_piece:
        if not args.in_process:
            raise SystemExit("--switch-interval, --inline-hash and --per-piece apply to --in-process")
        if args.per_piece:
            from capsteer.capture.publish import AtomicFile

            def one_by_one(self: Any, pieces: Any) -> None:
                for piece in pieces:
                    self.write(piece)

            AtomicFile.write_pieces = one_by_one
        if args.switch_interval is not None:
            sys.setswitchinterval(args.switch_interval)
        if args.inline_hash:
            from capsteer.capture import publish

            publish._OVERLAP_MIN = 1 << 62
    if args.in_process:
        writer: Any = CaptureWriter(tmp / "root", workers=args.workers)
    else:
        if args.processes > 1:
            writer = ProcessWriterPool(tmp / "root", processes=args.processes,
                                       workers=args.workers, **kw)
        else:
            writer = ProcessCaptureWriter(tmp / "root", workers=args.workers, **kw)
        if not writer.ready.wait(60):
            raise SystemExit("the writer process did not start")
        if args.defer:
            writer.defer_sends()
    stop = threading.Event()
    if args.busy_step > 0:
        def step_thread() -> None:
            x = 0
            while not stop.is_set():
                end = time.perf_counter() + args.busy_step / 1e3
                while time.perf_counter() < end:
                    x += 1
                time.sleep(args.busy_step / 1e3)

        threading.Thread(target=step_thread, daemon=True).start()
    if args.hold_gil_copy:
        import ctypes

        from capsteer.capture.writer import process as writer_process

        libc = ctypes.PyDLL(None)
        libc.memmove.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        libc.memmove.restype = ctypes.c_void_p

        def hold(dst: torch.Tensor, src: torch.Tensor) -> None:
            libc.memmove(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size())

        writer_process.copy_rows = hold
    try:
        runs = []
        for r in range(args.repeat):
            got = run_once(args, writer, r, tmp / "root")
            runs.append(got)
            print(f"run {r}: {got['mb_s']:.0f} MB/s ({got['bytes'] / 1e9:.2f} GB in {got['seconds']:.2f} s; "
                  f"fed in {got['fed_s']:.2f} s, producer in write {got['producer_write_s']:.2f} s, "
                  f"ring waits {got['ring_waits']}, {got['ring_wait_s']:.2f} s; "
                  f"{got['sends']} sends, {got['send_s']:.3f} s); writer CPU s {got['child_cpu_s']}; "
                  f"manifest timings {got['writer_timings']}", flush=True)
            shutil.rmtree(tmp / "root", ignore_errors=True)
            (tmp / "root").mkdir()
        print(f"median {statistics.median(r['mb_s'] for r in runs):.0f} MB/s")
        if args.json:
            print(json.dumps({"args": vars(args), "runs": runs}))
    finally:
        stop.set()
        writer.shutdown(60)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
