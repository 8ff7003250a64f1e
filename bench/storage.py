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

    python bench/storage.py [--total-mib 2048] [--dir DIR] [--workers 2] [--repeat 2] [--diagnose-hash]
"""

from __future__ import annotations

import argparse
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
import types
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from capsteer.capture import CaptureEnd, CaptureRequest, CaptureWriter, parse_capture_spec, publish

MIB = 1 << 20


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


def loop_rate(directory: Path, mib: int) -> float:
    """MB/s of a Python loop writing 1 MiB blocks of random bytes, then one fsync."""
    block = os.urandom(MIB)
    target = directory / "loop.bin"
    t0 = time.perf_counter()
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for _ in range(mib):
            os.write(fd, block)
        os.fsync(fd)
    finally:
        os.close(fd)
    dt = time.perf_counter() - t0
    target.unlink()
    return mib * MIB / dt / 1e6


def sha256_rate(threads: int, mib: int = 512) -> float:
    """MB/s of hashlib.sha256 over in-memory data with `threads` threads in parallel.

    The manifest needs every file's sha256, so this bounds the writer on CPU-poor
    machines; printed so the ratio can be read against it.
    """
    data = os.urandom(64 * MIB)
    rounds = max(1, mib // 64 // threads)

    def work() -> None:
        for _ in range(rounds):
            hashlib.sha256(data).digest()

    pool = [threading.Thread(target=work) for _ in range(threads)]
    t0 = time.perf_counter()
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return threads * rounds * 64 * MIB / (time.perf_counter() - t0) / 1e6


def writer_rate(
    directory: Path, layout: str, total_mib: int, layers: int, hidden: int, prompt: int, workers: int
) -> dict[str, float]:
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
    w = CaptureWriter(root, budget_bytes=max(4 * per_request, 1 << 30), workers=workers)
    t0 = time.perf_counter()
    for i in range(n_requests):
        cid = f"bench-{layout}-{i}"
        w.open(CaptureRequest(cid, cid, "bench", spec, token_ids, torch.bfloat16, hidden, layers))
        for layer in range(layers):
            w.write(cid, "resid_post", layer, positions, rows[layer])
        w.close(CaptureEnd(cid, (*token_ids, 0)))
    w.flush()
    dt = time.perf_counter() - t0
    receipts = [w.receipt(f"bench-{layout}-{i}") for i in range(n_requests)]
    w.shutdown()
    bad = [r for r in receipts if r is None or r.status != "ok"]
    if bad:
        raise SystemExit(f"{layout}: {len(bad)} captures failed: {bad[0]}")
    data = sum(r.bytes for r in receipts if r is not None)
    files = sum(len(r.files) for r in receipts if r is not None)
    publish = statistics.median(r.timings["publish_s"] for r in receipts if r is not None)
    shutil.rmtree(root)
    return {"mb_s": data / dt / 1e6, "bytes": data, "files": files, "seconds": dt, "median_publish_s": publish}


def _without_sha256(fn: Callable[[], dict[str, float]]) -> dict[str, float]:
    """Run fn with the publisher's sha256 replaced by a no-op (diagnostic only)."""

    class _NoHash:
        def update(self, data: object) -> None:
            pass

        def hexdigest(self) -> str:
            return "0" * 64

    saved = publish.hashlib
    publish.hashlib = types.SimpleNamespace(sha256=_NoHash)  # type: ignore[assignment]
    try:
        return fn()
    finally:
        publish.hashlib = saved


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=None, help="directory on the disk to measure")
    ap.add_argument("--total-mib", type=int, default=2048, help="data per measurement")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2, help="runs per measurement (best kept)")
    ap.add_argument("--json", action="store_true", help="also print the figures as JSON")
    ap.add_argument(
        "--diagnose-hash",
        action="store_true",
        help="also time packed with sha256 stubbed out (NOT a valid configuration: shows what hashing costs)",
    )
    args = ap.parse_args(argv)

    base = args.dir or Path(__file__).parent / "results"
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="storage-", suffix=".tmp", dir=base))
    torch.set_num_threads(1)
    try:
        disk_dd: list[float] = []
        disk_loop: list[float] = []
        runs: dict[str, list[dict[str, float]]] = {"packed": [], "per_file": []}
        for _ in range(args.repeat):
            rate = dd_rate(work, args.total_mib)
            if rate is not None:
                disk_dd.append(rate)
            disk_loop.append(loop_rate(work, args.total_mib))
            for layout in runs:
                runs[layout].append(
                    writer_rate(work, layout, args.total_mib, args.layers, args.hidden, args.prompt, args.workers)
                )
        disk = max(disk_dd + disk_loop)
        print(f"directory: {work.parent} ({args.total_mib} MiB per measurement, best of {args.repeat})")
        print(f"request shape: {args.layers} layers x {args.hidden} hidden x {args.prompt} positions, bf16 "
              f"= {args.layers * args.hidden * args.prompt * 2 / MIB:.0f} MiB; {args.workers} writer threads")
        print(f"{'measurement':<34}{'MB/s':>9}{'ratio':>8}")
        if disk_dd:
            print(f"{'disk: dd bs=1M conv=fsync':<34}{max(disk_dd):>9.0f}{max(disk_dd) / disk:>8.2f}")
        print(f"{'disk: python 1 MiB writes + fsync':<34}{max(disk_loop):>9.0f}{max(disk_loop) / disk:>8.2f}")
        result: dict[str, object] = {"disk_dd_mb_s": disk_dd, "disk_loop_mb_s": disk_loop, "disk_mb_s": disk}
        for layout, rs in runs.items():
            best = max(rs, key=lambda r: r["mb_s"])
            label = f"writer: {layout} ({best['files']:.0f} files)"
            print(f"{label:<34}{best['mb_s']:>9.0f}{best['mb_s'] / disk:>8.2f}"
                  f"   median publish {best['median_publish_s']:.2f}s")
            result[layout] = {**best, "ratio": best["mb_s"] / disk, "all_mb_s": [r["mb_s"] for r in rs]}
        sha = {n: sha256_rate(n) for n in (1, args.workers)}
        print(f"context: sha256 alone runs at {sha[1]:.0f} MB/s on 1 thread, "
              f"{sha[args.workers]:.0f} MB/s on {args.workers} threads (every published byte is hashed)")
        result["sha256_mb_s"] = sha
        if args.diagnose_hash:
            nohash = _without_sha256(
                lambda: writer_rate(work, "packed", args.total_mib, args.layers, args.hidden, args.prompt, args.workers)
            )
            print(f"diagnostic: packed with sha256 stubbed out: {nohash['mb_s']:.0f} MB/s "
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
