"""Capture storage throughput next to the disk's own fsync'd sequential write rate.

Measures, in one run on one directory (default: under bench/results/, i.e. the
local disk the repository lives on):
- the disk: `dd if=/dev/zero bs=1M conv=fsync` and an equivalent Python loop
  (1 MiB os.write of non-zero data, then fsync), before and after the writer runs;
- the writer: requests shaped like a real model (default 32 layers x 4096 hidden,
  bf16, 512 prompt positions = 128 MiB per request) pushed through CaptureWriter
  with the `packed` and `per_file` layouts, timed from the first open to the last
  manifest being durable. MB/s counts published data-file bytes.
Prints a table and the writer/disk ratio (target >= 0.8 for packed).
`--digest` picks the files' digest (sha256, blake3); `--digest-compare` first times
one thread publishing files through AtomicFile with no digest, sha256 and blake3,
each hashed inline and on the digest thread (what a durable write spends hashing),
then the packed writer with each digest.

`--paired-rounds N` (P5's method since session 38): N rounds, each measuring the disk and
the packed writer back to back, the order alternating round by round. The disk's figures:
dd conv=fsync, the Python loop, the loop with writeback as written, and since session 39
that loop cut into request-sized files (each fsync'd and renamed, its directory fsync'd,
on as many threads as writer processes) and O_DIRECT writes (what `--direct-io`
publishes through). `--writer-variants` times more writer configurations in every round
(their order rotating), each against the same disk figures. A round's ratio is the
writer's rate over the highest of that round's disk figures, so a disk that drifts between rounds moves both sides of a ratio
alike. Ratio = the rounds' median, spread = their min and max; met where every round
reaches 0.8, missed where none does, else unresolved. Beside it (session 41), the writer
over the wb loop alone and over the files loop (its own file pattern without packing or a
digest): the first single stream, the second what per-request durable files cost.

    python bench/storage.py [--total-mib 2048] [--dir DIR] [--workers N] [--repeat 2] [--diagnose-hash]
        [--digest sha256|blake3] [--digest-compare] [--processes N] [--paired-rounds N]
        [--direct-io] [--writer-variants 2x8,4x4,2x8:blake3,2x8:direct]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from capsteer.capture import (
    CaptureEnd,
    CaptureRequest,
    CaptureWriter,
    find_receipt,
    parse_capture_spec,
    publish,
)
from capsteer.capture.digests import DIGESTS, new_hasher
from capsteer.capture.publish import AtomicFile, FileSystem, fsync_dir
from capsteer.capture.writer.budget import DEFAULT_RING_BYTES, check_ring_bytes
from capsteer.capture.writer.threads import default_workers
from capsteer.config.sizes import parse_size

MIB = 1 << 20
_DIRECT_BLOCK = 8 * MIB
# Where a writer waited over a timed stretch (differences of its stats): the engine side
# for ring space (the children's main threads taking rows out), the children for budget
# (publishing to disk freeing room), the device ring's reservations and refusals (a
# refusal sends rows through the copy ring); and the levels it ended at. throughput.py charges
# each P6 repetition with the same.
WRITER_WAITS = ("ring_waits", "ring_wait_s", "budget_waits", "budget_wait_s", "spilled_bytes",
                "intake_messages", "intake_s", "intake_cpu_s", "device_writes", "device_full")
WRITER_LEVELS = ("peak_bytes", "budget_bytes", "ring_bytes", "inbox_peak_bytes")


def waits_between(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """`after`'s WRITER_WAITS less `before`'s (None where the writer has no such counter),
    and its WRITER_LEVELS."""
    out = {k: (after[k] - (before.get(k) or 0)) if after.get(k) is not None else None
           for k in WRITER_WAITS}
    return out | {k: after.get(k) for k in WRITER_LEVELS}


def dd_rate(directory: Path, mib: int) -> float | None:
    """MB/s of `dd ... conv=fsync` (wall time measured here, dd's own text not parsed)."""
    if shutil.which("dd") is None:
        return None
    target = directory / "dd.bin"
    t0 = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={target}", "bs=1M", f"count={mib}", "conv=fsync"],
        check=True,
        capture_output=True,
    )
    dt = time.perf_counter() - t0
    target.unlink()
    return mib * MIB / dt / 1e6


def loop_rate(directory: Path, mib: int, writeback: bool = False) -> float:
    """MB/s of a Python loop writing 1 MiB blocks of random bytes, then one fsync.

    `writeback`: start each block's writeback as it is written, as the writer does
    (FileSystem.start_writeback), so the disk figure is not one the writer can beat
    only by overlapping what dd leaves to the final fsync."""
    block = os.urandom(MIB)
    target = directory / "loop.bin"
    t0 = time.perf_counter()
    _write_fsynced(target, block, mib, FileSystem() if writeback else None)
    dt = time.perf_counter() - t0
    target.unlink()
    return mib * MIB / dt / 1e6


def _write_fsynced(path: Path, block: bytes, count: int, writeback: FileSystem | None) -> None:
    """`count` 1 MiB writes of `block` to a new `path`, then its fsync; with `writeback`,
    each block's writeback started as it is written (as the writer does)."""
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
    """MB/s of O_DIRECT writes of 8 MiB from an aligned block, one file, then one fsync:
    the disk without the page cache (what `--direct-io` writes through); None where the
    filesystem refuses O_DIRECT."""
    import mmap

    block = mmap.mmap(-1, _DIRECT_BLOCK)
    block.write(os.urandom(_DIRECT_BLOCK))
    view = memoryview(block)
    count = max(1, mib * MIB // _DIRECT_BLOCK)
    target = directory / "direct.bin"
    t0 = time.perf_counter()
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    except OSError:
        view.release()
        block.close()
        with contextlib.suppress(OSError):
            target.unlink()  # a filesystem refusing O_DIRECT may have created it
        return None
    try:
        for _ in range(count):
            os.write(fd, view)
        os.fsync(fd)
    finally:
        os.close(fd)
        view.release()
        block.close()
    dt = time.perf_counter() - t0
    target.unlink()
    return count * _DIRECT_BLOCK / dt / 1e6


def files_rate(directory: Path, mib: int, file_mib: int, streams: int = 1) -> float:
    """MB/s of the loop with writeback as written, cut into files of `file_mib` (the
    writer's request size) on `streams` threads, each file fsync'd, renamed to its final
    name and its directory fsync'd, as the writer publishes: the disk's own price of
    durability per file, beside the one-file loop's single fsync."""
    block = os.urandom(MIB)
    target = directory / "files"
    target.mkdir(exist_ok=True)
    fs = FileSystem()
    n_files = max(1, mib // file_mib)
    claimed = iter(range(n_files))
    lock = threading.Lock()

    def stream() -> None:
        while True:
            with lock:
                i = next(claimed, None)
            if i is None:
                return
            tmp, final = target / f".{i}.tmp", target / f"{i}.bin"
            _write_fsynced(tmp, block, file_mib, fs)
            os.replace(tmp, final)
            fsync_dir(target, fs)

    pool = [threading.Thread(target=stream) for _ in range(max(1, streams))]
    t0 = time.perf_counter()
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    dt = time.perf_counter() - t0
    shutil.rmtree(target)
    return n_files * file_mib * MIB / dt / 1e6


def sha256_rate(threads: int, mib: int = 512, digest: str = "sha256") -> float:
    """MB/s of a digest (default sha256) over in-memory data, `threads` threads in parallel.

    The manifest needs every file's digest, so this bounds the writer on CPU-poor
    machines; printed so the ratio can be read against it.
    """
    data = os.urandom(64 * MIB)
    rounds = max(1, mib // 64 // threads)

    def work() -> None:
        for _ in range(rounds):
            h = hashlib.sha256() if digest == "sha256" else new_hasher(digest)
            h.update(memoryview(data))
            h.hexdigest()

    pool = [threading.Thread(target=work) for _ in range(threads)]
    t0 = time.perf_counter()
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return threads * rounds * 64 * MIB / (time.perf_counter() - t0) / 1e6


@contextlib.contextmanager
def _hashing(overlap: bool) -> Iterator[None]:
    """overlap=False: every piece hashed inline on the writing thread, as before issue 12."""
    saved = publish._OVERLAP_MIN
    publish._OVERLAP_MIN = saved if overlap else 1 << 62
    try:
        yield
    finally:
        publish._OVERLAP_MIN = saved


def publish_breakdown(directory: Path, digest: str | None, overlap: bool, files: int, file_mib: int,
                      piece_mib: int = 4) -> dict[str, float]:
    """One thread publishing `files` files of `file_mib` MiB through AtomicFile (pieces of
    `piece_mib` MiB, as the writer streams them): MB/s, and the thread's wall and CPU
    seconds. overlap=False hashes inline on the writing thread (the pre-issue-12 path)."""
    src = memoryview(os.urandom(64 * MIB))
    pieces = file_mib // piece_mib
    os.sync()  # start clean: no dirty pages left by the previous configuration
    with _hashing(overlap):
        t0, c0 = time.perf_counter(), time.thread_time()
        for i in range(files):
            f = AtomicFile(directory, f"bench-{i}.bin", digest=digest)
            for k in range(pieces):
                off = (k * piece_mib * MIB) % len(src)
                f.write(src[off: off + piece_mib * MIB])
            f.commit()
            if digest is not None:
                f.hexdigest  # noqa: B018 (waits for the last piece)
        fsync_dir(directory)
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    for i in range(files):
        (directory / f"bench-{i}.bin").unlink()
    nbytes = files * pieces * piece_mib * MIB
    return {"mb_s": nbytes / wall / 1e6, "wall_s": wall, "thread_cpu_s": cpu, "bytes": nbytes}


def digest_compare(directory: Path, repeat: int, files: int = 6, file_mib: int = 128) -> dict[str, object]:
    """publish_breakdown for every digest, inline and overlapped, interleaved `repeat`
    times in a rotating order; prints medians (this box's disk and neighbours are noisy)."""
    configs: list[tuple[str | None, bool]] = [(None, False)]
    configs += [(d, o) for d in DIGESTS for o in (False, True)]
    runs: dict[str, list[dict[str, float]]] = {}
    for r in range(repeat):
        for digest, overlap in configs[r % len(configs):] + configs[:r % len(configs)]:
            label = "none" if digest is None else f"{digest} {'overlapped' if overlap else 'inline'}"
            runs.setdefault(label, []).append(
                publish_breakdown(directory, digest, overlap, files, file_mib))
    print(f"one thread publishing {files} x {file_mib} MiB files (4 MiB pieces), "
          f"median of {repeat}:")
    print(f"{'digest':<22}{'MB/s':>8}{'wall s':>9}{'thread cpu s':>14}")
    out: dict[str, object] = {}
    for label, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("mb_s", "wall_s", "thread_cpu_s")}
        print(f"{label:<22}{med['mb_s']:>8.0f}{med['wall_s']:>9.2f}{med['thread_cpu_s']:>14.2f}")
        out[label] = {**med, "all_mb_s": [round(r["mb_s"]) for r in rs]}
    return out


def writer_rate(
    directory: Path, layout: str, total_mib: int, layers: int, hidden: int, prompt: int, workers: int,
    digest: str = "sha256", processes: int = 0, direct_io: bool = False,
    ring_bytes: int = DEFAULT_RING_BYTES, touch_rings: bool = True,
) -> dict[str, float]:
    """The writer's publish rate; `processes` >= 1 publishes through that many writer
    processes (the engine's path: rows cross a ring of `ring_bytes` into each child), 0
    in this process. `touch_rings` faults the rings' pages
    in before the clock starts, as a server's writer has them after its first ring of rows
    (False times a fresh writer's first pass, page faults included)."""
    spec = parse_capture_spec(
        {"hooks": ["resid_post"], "layers": "all", "positions": "all", "layout": layout}, num_layers=layers
    )
    per_request = layers * prompt * hidden * 2
    n_requests = max(1, total_mib * MIB // per_request)
    # Rows are made once and handed over again for every request (the engine would
    # hand fresh copies); generating them is not what is measured here.
    rows = [torch.randn(prompt, hidden).to(torch.bfloat16) for _ in range(layers)]
    positions = np.arange(prompt, dtype=np.int64)
    token_ids = tuple(range(prompt))
    root = directory / f"captures-{layout}"
    budget = max(4 * per_request, 1 << 30)
    w: Any
    if processes >= 1:
        from capsteer.capture.writer.fanout import ProcessWriterPool
        from capsteer.capture.writer.process import ProcessCaptureWriter

        kw = {"budget_bytes": budget * processes, "workers": workers, "digest": digest,
              "direct_io": direct_io, "ring_bytes": ring_bytes}
        w = (ProcessWriterPool(root, processes=processes, **kw) if processes > 1
             else ProcessCaptureWriter(root, **kw))
        if not w.ready.wait(60):
            raise SystemExit("the writer processes did not start")
    else:
        w = CaptureWriter(root, budget_bytes=budget, workers=workers, digest=digest,
                          direct_io=direct_io)
    def publish(cid: str) -> None:
        w.open(CaptureRequest(cid, cid, "bench", spec, token_ids, torch.bfloat16, hidden, layers))
        for layer in range(layers):
            w.write(cid, "resid_post", layer, positions, rows[layer])
        w.close(CaptureEnd(cid, (*token_ids, 0)))

    if processes >= 1:  # each child's first capture imports and warms its path: untimed
        for i in range(processes):
            publish(f"warm-{layout}-{i}")
        w.flush()
        touched = touch_rings and w.touch_copy_ring()
        if touch_rings and not touched:
            print("warning: the rings could not be faulted in (no MADV_POPULATE_WRITE); "
                  "this measurement includes their first pass", file=sys.stderr, flush=True)
    before = w.stats() or {}  # the timed publishes' waits, not the warm-up's
    t0, c0, k0 = time.perf_counter(), time.process_time(), _children_cpu_s()
    for i in range(n_requests):
        publish(f"bench-{layout}-{i}")
    w.flush()
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    child_cpu = _children_cpu_s() - k0
    receipts = [find_receipt(root, f"bench-{layout}-{i}") for i in range(n_requests)]
    waits = waits_between(before, w.stats() or {})
    w.shutdown()
    bad = [r for r in receipts if r is None or r.status != "ok"]
    if bad:
        raise SystemExit(f"{layout}: {len(bad)} captures failed: {bad[0]}")
    data = sum(r.bytes for r in receipts if r is not None)
    files = sum(len(r.files) for r in receipts if r is not None)
    publish = statistics.median(r.timings["publish_s"] for r in receipts if r is not None)
    shutil.rmtree(root)
    return {"mb_s": data / dt / 1e6, "bytes": data, "files": files, "seconds": dt, "median_publish_s": publish,
            "cpu_s_per_gb": cpu / (data / 1e9), "child_cpu_s_per_gb": child_cpu / (data / 1e9),
            "waits": waits, **({"rings_touched": touched} if processes >= 1 else {})}


def _children_cpu_s() -> float:
    """User + system CPU seconds of this process's live descendants (the writer
    processes): `cpu_s_per_gb` counts only this process, where rows are copied into the
    rings; the children hash and write."""
    import psutil

    total = 0.0
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            t = child.cpu_times()
            total += t.user + t.system
    return total


def _without_sha256(fn: Callable[[], dict[str, float]]) -> dict[str, float]:
    """Run fn with the publisher's hasher (any digest) replaced by a no-op (diagnostic only)."""

    class _NoHash:
        def update(self, data: object) -> None:
            pass

        def hexdigest(self) -> str:
            return "0" * 64

    saved = publish.new_hasher
    publish.new_hasher = lambda name: _NoHash()  # type: ignore[assignment]
    try:
        return fn()
    finally:
        publish.new_hasher = saved


def _writer_label(args: argparse.Namespace) -> str:
    """How the headline writer publishes, for the printed headers."""
    if not args.processes:
        return "in-process writer"
    return (f"{args.processes} writer process(es), {args.ring_bytes / MIB:.0f} MiB rings"
            f"{' (cold)' if args.cold_rings else ''}")


def _ring_size(text: str, where: str) -> int:
    """A writer process's ring size as the server's `--capture-ring` reads it."""
    try:
        size = parse_size(text)
        check_ring_bytes(size, where)
    except ValueError as exc:
        raise SystemExit(f"{where}: {exc}") from None
    return size


def parse_variants(text: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """`--writer-variants 2x8,4x4:blake3,2x8:direct,2x8:ring=128MiB,2x8:cold`: writer
    configurations timed in every paired round beside the main one (PROCESSESxTHREADS, then
    optional `:blake3`/`:sha256`, `:direct`, `:ring=SIZE` and `:cold`, rings not faulted in
    before the clock), so each meets the same round's disk figures."""
    variants = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        shape, *opts = item.split(":")
        try:
            processes, workers = (int(x) for x in shape.split("x"))
        except ValueError:
            raise SystemExit(f"--writer-variants: {item!r} is not "
                             "PROCESSESxTHREADS[:digest][:direct][:ring=SIZE][:cold]") from None
        digest, direct_io, ring_bytes, touch = args.digest, False, args.ring_bytes, not args.cold_rings
        for opt in opts:
            if opt == "direct":
                direct_io = True
            elif opt == "cold" or opt.startswith("ring="):
                if processes == 0:
                    raise SystemExit(f"--writer-variants {item!r}: :{opt} needs writer processes "
                                     "(the in-process writer has no ring)")
                if opt == "cold":
                    touch = False
                else:
                    ring_bytes = _ring_size(opt[len("ring="):], f"--writer-variants {item!r}")
            elif opt in DIGESTS:
                digest = opt
            else:
                raise SystemExit(f"--writer-variants: unknown option {opt!r} in {item!r}")
        if processes < 0 or workers < 1:
            raise SystemExit(f"--writer-variants: {item!r} needs processes >= 0 and threads >= 1")
        if any(v["label"] == item for v in variants):
            raise SystemExit(f"--writer-variants: {item!r} is listed twice")
        variants.append({"label": item, "processes": processes, "workers": workers,
                         "digest": digest, "direct_io": direct_io, "ring_bytes": ring_bytes,
                         "touch_rings": touch})
    return variants


def _variant_cell(got: dict[str, Any], width: int) -> str:
    """A variant's MB/s and ratio in the round's row, or that it failed."""
    if "mb_s" not in got:
        return f"{'failed':>{width}}"
    return f"{got['mb_s']:>{width - 6}.0f} {got['ratio']:.3f}"


def paired_rounds(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """P5 by rounds: each round's writer rate over the best disk figure of the same round."""
    rounds: list[dict[str, Any]] = []
    variants = parse_variants(args.writer_variants, args)
    widths = {v["label"]: max(16, len(v["label"]) + 1) for v in variants}
    print(f"directory: {work.parent}; {args.total_mib} MiB per measurement; packed writer"
          f"{' (direct I/O)' if args.direct_io else ''}, "
          f"{args.workers} threads, digest {args.digest}, {_writer_label(args)}")
    file_mib = max(1, args.layers * args.prompt * args.hidden * 2 // MIB)  # one request's file
    streams = max(1, args.processes)
    print(f"{'round':>5} {'order':<13}{'dd':>7}{'loop':>7}{'wb loop':>8}{'files':>7}{'direct':>7}"
          f"{'writer':>8}"
          f"{'ratio':>7}{'vs dd':>7}{'cpu s/GB':>12}"
          + "".join(f"{v['label']:>{widths[v['label']]}}" for v in variants)
          + f"   (files: the wb loop as {file_mib} MiB files, each fsync'd "
          f"and renamed, {streams} stream(s); cpu: this process + the writer processes"
          + ("; variants: MB/s ratio" if variants else "") + ")")
    started = time.perf_counter()
    for r in range(args.paired_rounds):
        elapsed = time.perf_counter() - started
        if args.max_seconds and r and elapsed + elapsed / r > args.max_seconds:
            print(f"--max-seconds {args.max_seconds:.0f}: round {r + 1} would not finish; "
                  f"stopping after {r} rounds")
            break
        disk_first = r % 2 == 0
        entry: dict[str, Any] = {"round": r + 1, "order": "disk, writer" if disk_first
                                 else "writer, disk"}

        def disk(e: dict[str, Any] = entry) -> None:
            e["dd_mb_s"] = dd_rate(work, args.total_mib)
            e["loop_mb_s"] = loop_rate(work, args.total_mib)
            e["writeback_mb_s"] = loop_rate(work, args.total_mib, writeback=True)
            e["files_mb_s"] = files_rate(work, args.total_mib, file_mib, streams)
            e["direct_mb_s"] = direct_rate(work, args.total_mib)

        def writer(e: dict[str, Any] = entry, r: int = r) -> None:
            headline = {"label": None, "processes": args.processes, "workers": args.workers,
                        "digest": args.digest, "direct_io": args.direct_io,
                        "ring_bytes": args.ring_bytes, "touch_rings": not args.cold_rings}
            order = [headline, *variants]
            # The configurations' order turns every two rounds (the disk's side alternates
            # every round), so each one in turn runs next to the disk's measurements.
            shift = (r // 2) % len(order)
            for v in order[shift:] + order[:shift]:
                os.sync()
                try:
                    got = writer_rate(work, "packed", args.total_mib, args.layers, args.hidden,
                                      args.prompt, v["workers"], v["digest"], v["processes"],
                                      direct_io=v["direct_io"], ring_bytes=v["ring_bytes"],
                                      touch_rings=v["touch_rings"])
                except (Exception, SystemExit) as exc:
                    if v["label"] is None:
                        raise  # the headline writer failing ends the run
                    got = {"error": f"{type(exc).__name__}: {exc}"}  # a variant's is recorded
                if v["label"] is None:
                    e["writer"] = got
                else:
                    e.setdefault("variants", {})[v["label"]] = got

        for step in ((disk, writer) if disk_first else (writer, disk)):
            step()
        best = max(x for x in (entry["dd_mb_s"], entry["loop_mb_s"], entry["writeback_mb_s"],
                               entry["files_mb_s"], entry["direct_mb_s"]) if x is not None)
        entry["disk_mb_s"] = best
        entry["ratio"] = entry["writer"]["mb_s"] / best
        entry["ratio_vs_dd"] = (entry["writer"]["mb_s"] / entry["dd_mb_s"]
                                if entry["dd_mb_s"] else None)
        # Beside the verdict's best-of-five: the one fsync'd stream alone, and the writer's
        # own file pattern (no packing, no digest), which say how much of the gap is the
        # per-file durability and how much the writer.
        entry["ratio_vs_writeback"] = entry["writer"]["mb_s"] / entry["writeback_mb_s"]
        entry["ratio_vs_files"] = entry["writer"]["mb_s"] / entry["files_mb_s"]
        for got in entry.get("variants", {}).values():
            if "mb_s" in got:
                got["ratio"] = got["mb_s"] / best
        rounds.append(entry)
        dd = entry["dd_mb_s"]
        print(f"{r + 1:>5} {entry['order']:<13}{dd or 0:>7.0f}{entry['loop_mb_s']:>7.0f}"
              f"{entry['writeback_mb_s']:>8.0f}{entry['files_mb_s']:>7.0f}"
              f"{entry['direct_mb_s'] or 0:>7.0f}"
              f"{entry['writer']['mb_s']:>8.0f}{entry['ratio']:>7.3f}"
              f"{entry['ratio_vs_dd'] or 0:>7.3f}"
              f"{entry['writer']['cpu_s_per_gb']:>6.2f}+{entry['writer']['child_cpu_s_per_gb']:<5.2f}"
              + "".join(_variant_cell(entry["variants"][v["label"]], widths[v["label"]])
                        for v in variants),
              flush=True)
    ratios = [e["ratio"] for e in rounds]
    lo, hi, med = min(ratios), max(ratios), statistics.median(ratios)
    verdict = "met" if lo >= 0.8 else "missed" if hi < 0.8 else "unresolved"
    print(f"packed / disk, {len(ratios)} paired rounds: median {med:.3f} ({lo:.3f}-{hi:.3f}), "
          f"target 0.8: {verdict}")
    beside = {}
    for key, what in (("ratio_vs_writeback", "the wb loop alone"),
                      ("ratio_vs_files", "its own file pattern (files)")):
        got = [e[key] for e in rounds]
        beside[key] = {"median": statistics.median(got), "lo": min(got), "hi": max(got)}
        print(f"  packed / {what}: median {statistics.median(got):.3f} "
              f"({min(got):.3f}-{max(got):.3f})")
    summaries = {}
    for v in variants:
        vr = [e["variants"][v["label"]]["ratio"] for e in rounds if "ratio" in e["variants"][v["label"]]]
        failed = len(rounds) - len(vr)
        about = (f"  variant {v['label']:<14} ({v['processes']} process(es) x {v['workers']} threads, "
                 f"{v['digest']}{', direct I/O' if v['direct_io'] else ''}, "
                 f"{v['ring_bytes'] / MIB:.0f} MiB rings{'' if v['touch_rings'] else ', cold'}): ")
        if not vr:
            summaries[v["label"]] = {**v, "ratio": None, "failed_rounds": failed}
            print(about + f"failed in every round ({rounds[0]['variants'][v['label']]['error']})")
            continue
        summaries[v["label"]] = {**v, "ratio": statistics.median(vr), "lo": min(vr), "hi": max(vr),
                                 "failed_rounds": failed}
        print(about + f"median {statistics.median(vr):.3f} ({min(vr):.3f}-{max(vr):.3f})"
              + (f", failed in {failed} round(s)" if failed else ""))
    return {"method": "paired", "rounds": rounds, "ratio": med, "lo": lo, "hi": hi,
            "verdict": verdict, "variants": summaries, **beside}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=None, help="directory on the disk to measure")
    ap.add_argument("--total-mib", type=int, default=2048, help="data per measurement")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--workers", type=int, default=None,
                    help="writer threads (default: the writer's own default on this machine, "
                         "what a server uses)")
    ap.add_argument("--repeat", type=int, default=2, help="runs per measurement (best kept)")
    ap.add_argument("--json", action="store_true", help="also print the figures as JSON")
    ap.add_argument(
        "--diagnose-hash",
        action="store_true",
        help="also time packed with the digest stubbed out (NOT a valid configuration: shows what hashing costs)",
    )
    ap.add_argument("--digest", choices=DIGESTS, default="sha256", help="the writer's file digest")
    ap.add_argument("--processes", type=int, default=0,
                    help="publish through N writer processes (the engine's path: 1 one child, "
                         "2 the default pool on 8+ CPUs); 0 (default) in this process")
    ap.add_argument("--direct-io", action="store_true",
                    help="the writer's data files through O_DIRECT (capture_io: direct)")
    ap.add_argument("--digest-compare", action="store_true",
                    help="also time each digest: one thread's durable writes, then the packed writer")
    ap.add_argument("--paired-rounds", type=int, default=0,
                    help="P5 paired: N rounds of disk then writer (order alternating), ratio per "
                         "round; replaces the best-of --repeat table")
    ap.add_argument("--writer-variants", default="",
                    help="with --paired-rounds: more writer configurations timed in every round "
                         "against the same disk figures, e.g. 2x8,4x4,2x8:blake3,2x8:direct,"
                         "2x8:ring=128MiB,2x8:cold (PROCESSESxTHREADS[:digest][:direct][:ring=SIZE]"
                         "[:cold]); the ratio and verdict stay the main writer's")
    ap.add_argument("--cold-rings", action="store_true",
                    help="time writer processes with their rings not yet faulted in past the "
                         "untimed warm-up (one request's rows each, 128 MiB at the defaults): "
                         "a fresh writer's first pass; by default they are touched first, as "
                         "a running server's are")
    ap.add_argument("--ring", default=None, metavar="SIZE",
                    help="each writer process's ring, as the server's --capture-ring "
                         "(default: the server's default)")
    ap.add_argument("--max-seconds", type=float, default=0.0,
                    help="with --paired-rounds: start no round that would end past this many "
                         "seconds (judged by the rounds so far), so a time-limited run still "
                         "prints its verdict")
    args = ap.parse_args(argv)
    if args.writer_variants and not args.paired_rounds:
        ap.error("--writer-variants needs --paired-rounds")
    if not args.processes and (args.ring is not None or args.cold_rings):
        ap.error("--ring and --cold-rings need --processes (the in-process writer has no ring)")
    if args.workers is None:
        args.workers = default_workers()
    args.ring_bytes = (_ring_size(args.ring, "--ring") if args.ring is not None
                       else DEFAULT_RING_BYTES)

    base = args.dir or Path(__file__).parent / "results"
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="storage-", suffix=".tmp", dir=base))
    torch.set_num_threads(1)
    try:
        result: dict[str, object] = {"digest": args.digest, "processes": args.processes,
                                     "ring_bytes": args.ring_bytes, "touch_rings": not args.cold_rings}
        if args.paired_rounds:
            result.update(paired_rounds(work, args))
            if args.json:
                print(json.dumps(result))
            return 0
        if args.digest_compare:
            result["publish_breakdown"] = digest_compare(work, max(3, args.repeat))
        disk_dd: list[float] = []
        disk_loop: list[float] = []
        disk_writeback: list[float] = []
        runs: dict[str, list[dict[str, float]]] = {"packed": [], "per_file": []}
        for _ in range(args.repeat):
            rate = dd_rate(work, args.total_mib)
            if rate is not None:
                disk_dd.append(rate)
            disk_loop.append(loop_rate(work, args.total_mib))
            disk_writeback.append(loop_rate(work, args.total_mib, writeback=True))
            for layout in runs:
                runs[layout].append(
                    writer_rate(work, layout, args.total_mib, args.layers, args.hidden, args.prompt, args.workers,
                                args.digest, args.processes, direct_io=args.direct_io,
                                ring_bytes=args.ring_bytes, touch_rings=not args.cold_rings)
                )
        disk = max(disk_dd + disk_loop + disk_writeback)
        print(f"directory: {work.parent} ({args.total_mib} MiB per measurement, best of {args.repeat})")
        print(f"request shape: {args.layers} layers x {args.hidden} hidden x {args.prompt} positions, bf16 "
              f"= {args.layers * args.hidden * args.prompt * 2 / MIB:.0f} MiB; {args.workers} writer threads; "
              f"digest {args.digest}; {_writer_label(args)}")
        print(f"{'measurement':<34}{'MB/s':>9}{'ratio':>8}")
        if disk_dd:
            print(f"{'disk: dd bs=1M conv=fsync':<34}{max(disk_dd):>9.0f}{max(disk_dd) / disk:>8.2f}")
        print(f"{'disk: python 1 MiB writes + fsync':<34}{max(disk_loop):>9.0f}{max(disk_loop) / disk:>8.2f}")
        print(f"{'disk: ... + writeback as written':<34}{max(disk_writeback):>9.0f}"
              f"{max(disk_writeback) / disk:>8.2f}")
        result.update({"disk_dd_mb_s": disk_dd, "disk_loop_mb_s": disk_loop,
                       "disk_writeback_mb_s": disk_writeback, "disk_mb_s": disk})
        for layout, rs in runs.items():
            best = max(rs, key=lambda r: r["mb_s"])
            label = f"writer: {layout} ({best['files']:.0f} files)"
            print(f"{label:<34}{best['mb_s']:>9.0f}{best['mb_s'] / disk:>8.2f}"
                  f"   median publish {best['median_publish_s']:.2f}s, {best['cpu_s_per_gb']:.2f} cpu s/GB here + "
                  f"{best['child_cpu_s_per_gb']:.2f} in writer processes")
            result[layout] = {**best, "ratio": best["mb_s"] / disk, "all_mb_s": [r["mb_s"] for r in rs]}
        for name in DIGESTS:
            rates = {n: sha256_rate(n, digest=name) for n in (1, args.workers)}
            print(f"context: {name} alone runs at {rates[1]:.0f} MB/s on 1 thread, "
                  f"{rates[args.workers]:.0f} MB/s on {args.workers} threads (every published byte is hashed)")
            result[f"{name}_mb_s"] = rates
        if args.digest_compare:
            cases = [("sha256", False), *((name, True) for name in DIGESTS)]
            packed: dict[str, list[dict[str, float]]] = {}
            for r in range(max(3, args.repeat)):  # interleaved, rotating: the disk drifts
                for name, overlap in cases[r % 3:] + cases[:r % 3]:
                    label = f"{name} {'overlapped' if overlap else 'inline'}"
                    os.sync()
                    with _hashing(overlap):
                        packed.setdefault(label, []).append(writer_rate(
                            work, "packed", args.total_mib, args.layers, args.hidden, args.prompt,
                            args.workers, name))
            for label, rs in packed.items():
                mb = statistics.median(r["mb_s"] for r in rs)
                cpu = statistics.median(r["cpu_s_per_gb"] for r in rs)
                print(f"packed writer, {label:<18} median {mb:6.0f} MB/s ({mb / disk:.2f} of disk), "
                      f"{cpu:.2f} process cpu s/GB; runs {[round(r['mb_s']) for r in rs]}")
                result[f"packed {label}"] = {"median_mb_s": mb, "cpu_s_per_gb": cpu,
                                             "all_mb_s": [r["mb_s"] for r in rs]}
        if args.diagnose_hash:
            nohash = _without_sha256(
                lambda: writer_rate(work, "packed", args.total_mib, args.layers, args.hidden, args.prompt, args.workers)
            )
            print(f"diagnostic: packed with the digest stubbed out: {nohash['mb_s']:.0f} MB/s "
                  f"({nohash['mb_s'] / disk:.2f} of disk; manifests then carry bogus hashes)")
            result["packed_no_sha256_diagnostic"] = nohash
        ratio = result["packed"]["ratio"]  # type: ignore[index]
        verdict = "meets" if ratio >= 0.8 else "misses"
        print(f"packed / disk = {ratio:.2f} ({verdict} the 0.8 target)")
        if args.json:
            print(json.dumps(result))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
