"""Host cost of handing a step's captured rows to the writer processes' device rings, per
route (one capture at one point): reserving ring space and merging the GPU copies on the
engine's step thread, and handing the writes over on the harvester thread (wall time,
which includes blocking sends to the children, and the thread's CPU time). Compares
per-route reservations (`reserve_rows` + `merge_row_copies`: the engine before session 47)
with one span per writer and point (`reserve_span`: the engine now). CPU only: the rings stand in for page-locked ones (nothing
is copied by a GPU; the costs measured are the host's).

    python bench/reserve_cost.py [--requests 48] [--step-requests 16] [--layers 36]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def run(mode: str, args: argparse.Namespace, root: Path) -> dict[str, float]:
    from capsteer.capture.sink import CaptureEnd, CaptureRequest
    from capsteer.capture.spec import parse_capture_spec
    from capsteer.capture.writer.fanout import ProcessWriterPool
    from capsteer.engine_ext.worker import merge_row_copies

    hidden, prompt, layers = args.hidden, args.prompt, args.layers
    pool = ProcessWriterPool(root, processes=2, budget_bytes=4 << 30, workers=2,
                             ring_bytes=1 << 30)
    assert pool.ready.wait(120)
    for child in pool.writers:
        child._device_rows = True  # what pin_device_ring sets once CUDA pinned the ring
    spec = parse_capture_spec({"hooks": ["resid_post"], "layers": list(range(layers)),
                               "positions": "all"}, num_layers=layers)
    staging = torch.zeros(args.step_requests * prompt * layers, hidden, dtype=torch.bfloat16)
    times = {"reserve": 0.0, "merge": 0.0, "hand_over": 0.0, "hand_over_cpu": 0.0}
    routes = copies_n = 0
    positions = np.arange(prompt)
    for s in range(0, args.requests, args.step_requests):
        group = [f"{mode}-{i}" for i in range(s, min(s + args.step_requests, args.requests))]
        for cid in group:
            pool.open(CaptureRequest(cid, f"req-{cid}", "bench", spec,
                                     tuple(range(1000, 1000 + prompt)), torch.bfloat16,
                                     hidden, layers))
        by_child = [[c for c in group if pool.group_of(c) == g] for g in (0, 1)]
        t0 = time.perf_counter()
        copies, handed, row = [], [], 0
        for layer in range(layers):
            for ids in by_child:
                if mode != "route":
                    dst, parts = pool.reserve_span(ids, [(prompt, hidden)] * len(ids),
                                                   torch.bfloat16)
                    copies.append((parts[0].writer, dst,
                                   staging[row * prompt:(row + len(ids)) * prompt]))
                    handed += [(cid, layer, part) for cid, part in zip(ids, parts, strict=True)]
                    row += len(ids)
                    continue
                for cid in ids:
                    got = pool.reserve_rows(cid, (prompt, hidden), torch.bfloat16)
                    copies.append((got.writer, got.rows, staging[row * prompt:(row + 1) * prompt]))
                    handed.append((cid, layer, got))
                    row += 1
        t1 = time.perf_counter()
        merged = merge_row_copies(copies)
        t2, c2 = time.perf_counter(), time.thread_time()
        for cid, layer, got in handed:
            pool.write_reserved(got, cid, "resid_post", layer, positions)
        pool.end_step()
        t3, c3 = time.perf_counter(), time.thread_time()
        times["hand_over_cpu"] += c3 - c2  # this thread's CPU: without waits on the sends
        times["reserve"] += t1 - t0
        times["merge"] += t2 - t1
        times["hand_over"] += t3 - t2
        routes += len(handed)
        copies_n += len(merged)
        for cid in group:
            pool.close(CaptureEnd(cid, tuple(range(1000, 1000 + prompt)), finish_reason="length"))
        assert pool.flush(300)
    pool.shutdown(timeout=60)
    return {"routes": routes, "copies": copies_n,
            **{f"{k}_us_per_route": round(v / routes * 1e6, 2) for k, v in times.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--step-requests", type=int, default=16)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=2, help="route, span, route, span, ...")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="capsteer-reserve-"))
    try:
        for r in range(args.rounds):
            for mode in ("route", "span"):
                root = work / f"{mode}-{r}"
                root.mkdir()
                got = run(mode, args, root)
                print(f"{mode:9s} round {r + 1}: {got}", flush=True)
                shutil.rmtree(root, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
