"""P5: capture write rate vs the disk's own fsync'd sequential rate, by paired rounds.

Each round measures the disk and the packed writer back to back, the order alternating.
The disk: `dd if=/dev/zero bs=1M conv=fsync`; a loop of 1 MiB writes then one fsync, also
with writeback started per write, and cut into request-sized files published as the writer
does (as many threads as writer processes); O_DIRECT writes. The writer: requests shaped
like a real model (default 32 layers x 4096 hidden, bf16, 512 positions = 128 MiB), in this
process or `--processes N` writer processes, timed from the first open to the last manifest
durable; MB/s counts published data bytes. A round's ratio: the writer's rate over the
round's best disk figure (a drifting disk moves both alike); ratio = the rounds' median,
spread = min-max, met where every round reaches 0.8, missed where none does. Beside it: the
writer over the writeback loop and over the files loop.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import perf_models  # bench/ is on the path: this script's own directory
import psutil
import torch

from capsteer.capture import CaptureEnd, CaptureRequest, CaptureWriter, find_receipt
from capsteer.capture.digests import DIGESTS
from capsteer.capture.publish import FileSystem, fsync_dir
from capsteer.capture.spec import parse_capture_spec
from capsteer.capture.writer.budget import DEFAULT_RING_BYTES, check_ring_bytes
from capsteer.capture.writer.threads import default_workers
from capsteer.config.sizes import parse_size

MIB = 1 << 20
_DIRECT_BLOCK = 8 * MIB


def dd_rate(directory: Path, mib: int) -> float | None:
    """MB/s of `dd ... conv=fsync` (wall time measured here, dd's own text not parsed)."""
    if shutil.which("dd") is None:
        return None
    target, t0 = directory / "dd.bin", time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=1M", f"count={mib}", "conv=fsync"],
                   check=True, capture_output=True)
    dt = time.perf_counter() - t0
    target.unlink()
    return mib * MIB / dt / 1e6


def loop_rate(directory: Path, mib: int, writeback: bool = False) -> float:
    """MB/s of 1 MiB random writes, then one fsync (`writeback`: per block, as the writer does)."""
    block, target, t0 = os.urandom(MIB), directory / "loop.bin", time.perf_counter()
    _write_fsynced(target, block, mib, FileSystem() if writeback else None)
    dt = time.perf_counter() - t0
    target.unlink()
    return mib * MIB / dt / 1e6


def _write_fsynced(path: Path, block: bytes, count: int, writeback: FileSystem | None) -> None:
    """`count` writes of `block` to a new `path` (`writeback` started per write), then fsync."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for i in range(count):
            os.write(fd, block)
            if writeback is not None:
                writeback.start_writeback(fd, i * MIB, MIB)
        os.fsync(fd)
    finally:
        os.close(fd)


def direct_rate(directory: Path, mib: int) -> float | None:
    """MB/s of O_DIRECT 8 MiB writes and one fsync (`--direct-io`'s path); None: refused."""
    block = mmap.mmap(-1, _DIRECT_BLOCK)
    block.write(os.urandom(_DIRECT_BLOCK))
    view, count = memoryview(block), max(1, mib * MIB // _DIRECT_BLOCK)
    target, t0, fd = directory / "direct.bin", time.perf_counter(), None
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        for _ in range(count):
            os.write(fd, view)
        os.fsync(fd)
    except OSError:
        if fd is not None:  # a write failed, not the open: not a refusal of O_DIRECT
            raise
    finally:
        if fd is not None:
            os.close(fd)
        view.release()
        block.close()
    dt = time.perf_counter() - t0
    with contextlib.suppress(OSError):
        target.unlink()  # a filesystem refusing O_DIRECT may have created it
    return count * _DIRECT_BLOCK / dt / 1e6 if fd is not None else None


def files_rate(directory: Path, mib: int, file_mib: int, streams: int = 1) -> float:
    """MB/s of the writeback loop as `file_mib` files on `streams` threads, published as the
    writer does (fsync, rename, directory fsync): the disk's own price of durability."""
    block, target, fs = os.urandom(MIB), directory / "files", FileSystem()
    target.mkdir(exist_ok=True)
    n_files = max(1, mib // file_mib)

    def one(i: int) -> None:
        _write_fsynced(target / f".{i}.tmp", block, file_mib, fs)
        os.replace(target / f".{i}.tmp", target / f"{i}.bin")
        fsync_dir(target, fs)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max(1, streams)) as pool:
        list(pool.map(one, range(n_files)))
    dt = time.perf_counter() - t0
    shutil.rmtree(target)
    return n_files * file_mib * MIB / dt / 1e6


def writer_rate(directory: Path, a: argparse.Namespace) -> dict[str, float]:
    """The packed writer's publish rate, here or in `--processes` children (the engine's path)."""
    layers, hidden, prompt, processes = a.layers, a.hidden, a.prompt, a.processes
    spec = parse_capture_spec({"hooks": ["resid_post"], "layers": "all", "positions": "all",
                               "layout": "packed"}, num_layers=layers)
    per_request = layers * prompt * hidden * 2
    n_requests = max(1, a.total_mib * MIB // per_request)
    # Rows made once, handed over for every request: generating them is not what is measured.
    rows = [torch.randn(prompt, hidden).to(torch.bfloat16) for _ in range(layers)]
    positions, token_ids = np.arange(prompt, dtype=np.int64), tuple(range(prompt))
    root, budget = directory / "captures-packed", max(4 * per_request, 1 << 30)
    w: Any
    if processes >= 1:
        from capsteer.capture.writer.fanout import ProcessWriterPool
        from capsteer.capture.writer.process import ProcessCaptureWriter

        kw = {"budget_bytes": budget * processes, "workers": a.workers, "digest": a.digest,
              "direct_io": a.direct_io, "ring_bytes": a.ring_bytes}
        w = (ProcessWriterPool(root, processes=processes, **kw) if processes > 1
             else ProcessCaptureWriter(root, **kw))
        if not w.ready.wait(60):
            raise SystemExit("the writer processes did not start")
    else:
        w = CaptureWriter(root, budget_bytes=budget, workers=a.workers, digest=a.digest,
                          direct_io=a.direct_io)

    def publish(cid: str) -> None:
        w.open(CaptureRequest(cid, cid, "bench", spec, token_ids, torch.bfloat16, hidden, layers))
        for layer in range(layers):
            w.write(cid, "resid_post", layer, positions, rows[layer])
        w.close(CaptureEnd(cid, (*token_ids, 0)))

    if processes >= 1:  # each child's first capture imports and warms its path: untimed
        for i in range(processes):
            publish(f"warm-packed-{i}")
        w.flush()
        touched = not a.cold_rings and w.touch_copy_ring()
        if not a.cold_rings and not touched:
            print("warning: the rings could not be faulted in (no MADV_POPULATE_WRITE); "
                  "this measurement includes their first pass", file=sys.stderr, flush=True)
    t0, c0, k0 = time.perf_counter(), time.process_time(), _children_cpu_s()
    for i in range(n_requests):
        publish(f"bench-packed-{i}")
    w.flush()
    dt, cpu, child_cpu = time.perf_counter() - t0, time.process_time() - c0, _children_cpu_s() - k0
    receipts = [find_receipt(root, f"bench-packed-{i}") for i in range(n_requests)]
    w.shutdown()
    if bad := [r for r in receipts if r is None or r.status != "ok"]:
        raise SystemExit(f"packed: {len(bad)} captures failed: {bad[0]}")
    data = sum(r.bytes for r in receipts if r is not None)
    shutil.rmtree(root)
    return {"mb_s": data / dt / 1e6, "bytes": data, "seconds": dt,
            "files": sum(len(r.files) for r in receipts if r is not None),
            "median_publish_s": statistics.median(r.timings["publish_s"] for r in receipts if r),
            "cpu_s_per_gb": cpu / (data / 1e9), "child_cpu_s_per_gb": child_cpu / (data / 1e9),
            **({"rings_touched": touched} if processes >= 1 else {})}


def _children_cpu_s() -> float:
    """CPU seconds of this process's live descendants: the writer processes (hash and write)."""
    total = 0.0
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            t = child.cpu_times()
            total += t.user + t.system
    return total


def paired_rounds(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """P5 by rounds: each round's writer rate over the best disk figure of the same round."""
    rounds: list[dict[str, Any]] = []
    print(f"directory: {work.parent}; {args.total_mib} MiB per measurement; packed writer, "
          f"{args.workers} threads, digest {args.digest}, " + (
              f"{args.processes} writer process(es), {args.ring_bytes / MIB:.0f} MiB rings"
              f"{' (cold)' if args.cold_rings else ''}" if args.processes else "in-process writer"))
    file_mib = max(1, args.layers * args.prompt * args.hidden * 2 // MIB)  # one request's file
    n, streams = args.total_mib, max(1, args.processes)
    print(f"{'round':>5} {'order':<13}{'dd':>7}{'loop':>7}{'wb loop':>8}{'files':>7}{'direct':>7}"
          f"{'writer':>8}{'ratio':>7}{'vs dd':>7}{'cpu s/GB':>12}"
          f"   (files: the wb loop as {file_mib} MiB files, each fsync'd and renamed, "
          f"{streams} stream(s); cpu: this process + the writer processes)")
    started = time.perf_counter()
    for r in range(args.rounds):
        elapsed = time.perf_counter() - started
        if args.max_seconds and r and elapsed + elapsed / r > args.max_seconds:
            print(f"--max-seconds {args.max_seconds:.0f}: round {r + 1} would not finish; "
                  f"stopping after {r} rounds")
            break
        e: dict[str, Any] = {"round": r + 1, "order": "writer, disk" if r % 2 else "disk, writer"}

        def disk(e: dict[str, Any] = e) -> None:
            e.update(dd_mb_s=dd_rate(work, n), loop_mb_s=loop_rate(work, n),
                     writeback_mb_s=loop_rate(work, n, writeback=True),
                     files_mb_s=files_rate(work, n, file_mib, streams),
                     direct_mb_s=direct_rate(work, n))

        def writer(e: dict[str, Any] = e) -> None:
            os.sync()
            e["writer"] = writer_rate(work, args)

        for step in ((writer, disk) if r % 2 else (disk, writer)):
            step()
        rate = e["writer"]["mb_s"]
        best = max(x for x in (e["dd_mb_s"], e["loop_mb_s"], e["writeback_mb_s"],
                               e["files_mb_s"], e["direct_mb_s"]) if x is not None)
        # beside the verdict: the one fsync'd stream alone, and the writer's own file pattern
        e.update(disk_mb_s=best, ratio=rate / best,
                 ratio_vs_dd=rate / e["dd_mb_s"] if e["dd_mb_s"] else None,
                 ratio_vs_writeback=rate / e["writeback_mb_s"], ratio_vs_files=rate / e["files_mb_s"])
        rounds.append(e)
        print(f"{r + 1:>5} {e['order']:<13}{e['dd_mb_s'] or 0:>7.0f}{e['loop_mb_s']:>7.0f}"
              f"{e['writeback_mb_s']:>8.0f}{e['files_mb_s']:>7.0f}{e['direct_mb_s'] or 0:>7.0f}"
              f"{e['writer']['mb_s']:>8.0f}{e['ratio']:>7.3f}{e['ratio_vs_dd'] or 0:>7.3f}"
              f"{e['writer']['cpu_s_per_gb']:>6.2f}+{e['writer']['child_cpu_s_per_gb']:<5.2f}",
              flush=True)
    ratios = [e["ratio"] for e in rounds]
    lo, hi, med = min(ratios), max(ratios), statistics.median(ratios)
    verdict = perf_models.verdict(lo, hi, 0.8)
    print(f"packed / disk, {len(ratios)} paired rounds: median {med:.3f} ({lo:.3f}-{hi:.3f}), "
          f"target 0.8: {verdict}")
    beside = {}
    for key, what in (("ratio_vs_writeback", "the wb loop alone"),
                      ("ratio_vs_files", "its own file pattern (files)")):
        got = [e[key] for e in rounds]
        b = beside[key] = {"median": statistics.median(got), "lo": min(got), "hi": max(got)}
        print(f"  packed / {what}: median {b['median']:.3f} ({b['lo']:.3f}-{b['hi']:.3f})")
    return {"method": "paired", "rounds": rounds, "ratio": med, "lo": lo, "hi": hi,
            "verdict": verdict, **beside}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=None, help="directory on the disk to measure")
    # --total-mib: data per measurement; --processes: publish through N writer processes (the
    # engine's path: 1 one child, 2 the default pool on 8+ CPUs; 0, the default: this one)
    for name, default in (("--total-mib", 2048), ("--layers", 32), ("--hidden", 4096),
                          ("--prompt", 512), ("--processes", 0)):
        ap.add_argument(name, type=int, default=default)
    ap.add_argument("--workers", type=int, default=None,
                    help="writer threads (default: the writer's own, as a server's)")
    ap.add_argument("--rounds", "--paired-rounds", type=int, default=3,
                    help="paired rounds of disk and writer (order alternating)")
    ap.add_argument("--json", action="store_true", help="also print the figures as JSON")
    ap.add_argument("--out", type=Path, default=None, help="for <device>-<date>-storage.json")
    ap.add_argument("--digest", choices=DIGESTS, default="sha256", help="the writer's file digest")
    ap.add_argument("--direct-io", action="store_true",
                    help="the writer's data files through O_DIRECT (capture_io: direct)")
    ap.add_argument("--cold-rings", action="store_true", help="time writer processes with "
                    "rings not yet faulted in (default: touched first, as a server's are)")
    ap.add_argument("--ring", default=None, metavar="SIZE",
                    help="each writer process's ring, as the server's --capture-ring")
    ap.add_argument("--max-seconds", type=float, default=0.0, help="start no round that "
                    "would end past this (judged by the rounds so far): a verdict in time")
    args = ap.parse_args(argv)
    if not args.processes and (args.ring is not None or args.cold_rings):
        ap.error("--ring and --cold-rings need --processes (the in-process writer has no ring)")
    args.workers = args.workers or default_workers()
    try:  # the ring size as the server's `--capture-ring` reads it
        args.ring_bytes = parse_size(args.ring) if args.ring is not None else DEFAULT_RING_BYTES
        check_ring_bytes(args.ring_bytes, "--ring")
    except ValueError as exc:
        ap.error(f"--ring: {exc}")
    base = args.dir or perf_models.RESULTS  # the disk the checkout is on
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="storage-", suffix=".tmp", dir=base))
    torch.set_num_threads(1)
    try:
        result = {"digest": args.digest, "processes": args.processes,
                  "ring_bytes": args.ring_bytes, "touch_rings": not args.cold_rings,
                  **paired_rounds(work, args)}
        if args.json:
            print(json.dumps(result))
        if args.out is not None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
            doc = {"kind": "storage", **perf_models.meta("storage.py", device), "result": result}
            perf_models.write_result(args.out, doc, "storage")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
