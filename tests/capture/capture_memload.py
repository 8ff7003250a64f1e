"""Subprocess workload for the peak-memory test: prints one JSON line.

Runs with MALLOC_MMAP_THRESHOLD_ set so freed tensors go back to the OS at once,
then measures the rise of peak RSS (VmHWM, reset through /proc/self/clear_refs)
while many concurrently open requests push more rows than the budget holds.
Usage: python memload.py ROOT BUDGET_BYTES POLICY
"""

from __future__ import annotations

import gc
import json
import sys
import time

import numpy as np
import torch

from capsteer.capture import CaptureEnd, CaptureRequest, CaptureWriter, parse_capture_spec, read
from capsteer.capture.publish import FileSystem

HIDDEN = 1024  # 4 KiB per fp32 row
REQUESTS = 8
KEYS = 4
PROMPT = 384  # rows per key per request: 1.5 MiB; 6 MiB per request, 48 MiB in all
CHUNK = 64  # rows per write (256 KiB)


def _kib(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


class SlowFS(FileSystem):
    """fsync latency so that publishing lags and the budget is actually contended."""

    def fsync(self, fd: int) -> None:
        time.sleep(0.01)
        super().fsync(fd)


def rows(r: int, k: int, lo: int, hi: int) -> torch.Tensor:
    base = float(r * 100_000 + k * 10_000)
    col = torch.arange(lo, hi, dtype=torch.float32).unsqueeze(1) + base
    return col.expand(hi - lo, HIDDEN).contiguous()


def main() -> None:
    root, budget, policy = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    w = CaptureWriter(root, budget_bytes=budget, policy=policy, workers=1, fs=SlowFS())
    spec = parse_capture_spec(
        {"hooks": ["resid_post"], "layers": "all", "positions": "all"}, num_layers=KEYS
    )
    prompt = tuple(range(PROMPT))
    # Warm-up: first torch ops and the first publish touch library code pages (RSS too).
    w.open(CaptureRequest("warm", "warm", "m", spec, prompt[:4], torch.float32, HIDDEN, KEYS))
    for k in range(KEYS):
        w.write("warm", "resid_post", k, np.arange(4), rows(9, k, 0, 4))
    w.close(CaptureEnd("warm", prompt[:5]))
    w.flush()
    gc.collect()
    open("/proc/self/clear_refs", "w").write("5")
    base = _kib("VmRSS")
    t0 = time.perf_counter()
    for r in range(REQUESTS):
        w.open(CaptureRequest(f"m{r}", f"m{r}", "m", spec, prompt, torch.float32, HIDDEN, KEYS))
    for lo in range(0, PROMPT, CHUNK):  # one engine step: every open request gets a chunk
        for r in range(REQUESTS):
            for k in range(KEYS):
                w.write(f"m{r}", "resid_post", k, np.arange(lo, lo + CHUNK), rows(r, k, lo, lo + CHUNK))
    for r in range(REQUESTS):
        w.close(CaptureEnd(f"m{r}", (*prompt, 7)))
    w.flush()
    elapsed = time.perf_counter() - t0
    peak = _kib("VmHWM")
    statuses = []
    for r in range(REQUESTS):
        rec = w.receipt(f"m{r}")
        statuses.append(rec.status if rec else "missing")
    verified = 0
    for r in range(REQUESTS):
        rec = w.receipt(f"m{r}")
        if rec is None or rec.status != "ok":
            continue
        cap = read(f"{root}/{rec.dir}")
        for k in range(KEYS):
            assert torch.equal(cap.tensor("resid_post", k), rows(r, k, 0, PROMPT)), (r, k)
        verified += 1
    stats = w.stats()
    w.shutdown()
    print(
        json.dumps(
            {
                "peak_delta": (peak - base) * 1024,
                "budget_peak": stats["peak_bytes"],
                "spilled": stats["spilled_bytes"],
                "statuses": statuses,
                "verified": verified,
                "elapsed": elapsed,
                "total_bytes": REQUESTS * KEYS * PROMPT * HIDDEN * 4,
            }
        )
    )


if __name__ == "__main__":
    main()
