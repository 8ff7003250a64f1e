"""Device-to-host copy bandwidth into the capture ring's kind of memory (issue 12).

Captured rows reach the writer processes through a shared-memory ring (a memfd mapping,
page-locked with cudaHostRegister) that the GPU copies into directly, on the engine's
compute stream after the forward. If those copies run slower than into ordinary pinned
memory, every capturing step pays for it before the next forward starts. This times the
same copies into both kinds of memory, in the chunk sizes the engine issues (one point's
rows of one request, up to one step's rows of every layer), and a GPU-to-GPU copy of the
same bytes for scale. Needs only torch and a CUDA device.

    python bench/d2h_ring.py --mib 2048 --out $OUT/d2h.json
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import time
from pathlib import Path

import torch

_MADV_POPULATE_WRITE = 23


def memfd_ring(nbytes: int, populate: bool) -> tuple[mmap.mmap, torch.Tensor]:
    fd = os.memfd_create("d2h-ring", os.MFD_CLOEXEC)
    os.ftruncate(fd, nbytes)
    mm = mmap.mmap(fd, nbytes)
    os.close(fd)
    if populate:
        mm.madvise(_MADV_POPULATE_WRITE, 0, nbytes)
    return mm, torch.frombuffer(mm, dtype=torch.uint8, count=nbytes)


def register(t: torch.Tensor) -> None:
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0)
    if int(getattr(err, "value", err)) != 0:
        raise RuntimeError(f"cudaHostRegister failed: {err}")


def unregister(t: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


def timed_copies(dst: torch.Tensor, src: torch.Tensor, chunk: int, reps: int) -> float:
    """GB/s of `reps` passes copying src into dst in `chunk`-byte copies, one stream."""
    n = src.numel()
    stream = torch.cuda.current_stream()
    for _ in range(2):  # warm: first touches, driver mappings
        for off in range(0, n, chunk):
            dst[off:off + chunk].copy_(src[off:off + chunk], non_blocking=True)
    stream.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        for off in range(0, n, chunk):
            dst[off:off + chunk].copy_(src[off:off + chunk], non_blocking=True)
    end.record()
    end.synchronize()
    return reps * n / (start.elapsed_time(end) / 1000) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=2048, help="bytes a pass (the default ring is 2 GiB)")
    ap.add_argument("--chunks-kib", default="1024,8192,65536,614400",
                    help="copy sizes (1 MiB: one request's 128 rows of one layer; 600 MiB: "
                    "one 2048-token step at 36 layers); 0 = one copy")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    n = args.mib << 20
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    targets: dict[str, torch.Tensor] = {}
    t0 = time.perf_counter()
    targets["pinned (cudaHostAlloc)"] = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    alloc_s = time.perf_counter() - t0
    keep = []
    for populate in (True, False):
        mm, ring = memfd_ring(n, populate)
        t0 = time.perf_counter()
        register(ring)
        reg_s = time.perf_counter() - t0
        keep.append((mm, ring))
        targets[f"memfd + cudaHostRegister ({'populated' if populate else 'not populated'}, "
                   f"register {reg_s:.2f} s)"] = ring
    targets["device (GPU to GPU)"] = torch.empty(n, dtype=torch.uint8, device="cuda")
    rows = []
    for name, dst in targets.items():
        for kib in (int(x) for x in args.chunks_kib.split(",")):
            chunk = (kib << 10) or n
            gbs = timed_copies(dst, src, chunk, args.reps)
            rows.append({"target": name, "chunk_bytes": chunk, "gb_s": gbs})
            print(f"{name:<62} chunk {chunk >> 10:>9} KiB  {gbs:8.2f} GB/s", flush=True)
    for _, ring in keep:
        unregister(ring)
    result = {"device": torch.cuda.get_device_name(), "bytes": n, "reps": args.reps,
              "pinned_alloc_s": alloc_s, "rows": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
