"""How long the engine's side of a capture burst holds its thread while one writer child
is busy: the engine's calls (ring copies, sends) against the time until the child has
made it all durable, with a ring large enough to hold the burst, through the real
ProcessCaptureWriter (copy path, as on CPU engines and for rows past a GPU's device
ring). Before the child read its link on a thread of its own (its inbox), the engine's
send waited for the child to handle every earlier message, so the engine side took
about as long as the child's intake even with ring space free.

    .venv/bin/python bench/writer_sends.py [--captures 480] [--ring-mib 1536] [--rounds 2]

A round is a fresh writer child; the figures are per round (no ratio: compare the
engine side with the durable total, and with another commit's run of the same command).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from capsteer.capture.sink import CaptureEnd, CaptureRequest
from capsteer.capture.spec import parse_capture_spec
from capsteer.capture.writer.process import ProcessCaptureWriter

LAYERS = 4
BATCH = 8  # captures a step, as an engine step of eight prompts


def one_round(captures: int, ring_mib: int, hidden: int, prompt: int, root: Path) -> dict:
    writer = ProcessCaptureWriter(root, budget_bytes=4 << 30, workers=2,
                                  ring_bytes=ring_mib << 20)
    writer.ready.wait(60)
    writer.touch_copy_ring()  # a serving writer has faulted its ring in long ago
    spec = parse_capture_spec({"hooks": ["resid_post"], "layers": "all", "positions": "all"},
                              num_layers=LAYERS)
    prompt_ids = tuple(range(1000, 1000 + prompt))
    requests = [CaptureRequest(f"c{i}", f"req-c{i}", "bench-model", spec, prompt_ids,
                               torch.bfloat16, hidden, LAYERS) for i in range(captures)]
    rows = torch.randn(prompt, hidden).to(torch.bfloat16)
    positions = np.arange(prompt)
    started = time.perf_counter()
    for request in requests:
        writer.open(request)
    for step in range(0, captures, BATCH):
        batch = requests[step:step + BATCH]
        for request in batch:
            for layer in range(LAYERS):
                writer.write(request.capture_id, "resid_post", layer, positions, rows)
        writer.end_step()
        for request in batch:
            writer.close(CaptureEnd(request.capture_id, prompt_ids, "length"))
    engine_s = time.perf_counter() - started
    writer.flush(600)
    durable_s = time.perf_counter() - started
    stats = writer.stats() or {}
    writer.shutdown(60)
    return {"bytes": captures * LAYERS * prompt * hidden * 2, "engine_side_s": round(engine_s, 3),
            "durable_s": round(durable_s, 3), "send_s": stats.get("send_s"),
            "copy_s": stats.get("copy_s"), "ring_wait_s": stats.get("ring_wait_s"),
            "sends": stats.get("sends"), "intake_s": stats.get("intake_s"),
            "inbox_peak_bytes": stats.get("inbox_peak_bytes")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--captures", type=int, default=480)
    ap.add_argument("--ring-mib", type=int, default=1536)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dir", default=None, help="capture root's parent (default: a temp dir)")
    args = ap.parse_args()
    for n in range(args.rounds):
        root = Path(tempfile.mkdtemp(prefix="capsteer-sends-", dir=args.dir))
        try:
            row = one_round(args.captures, args.ring_mib, args.hidden, args.prompt, root)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        print(f"round {n + 1}: {row['bytes'] / 1e6:,.0f} MB; engine side {row['engine_side_s']:.2f} s "
              f"(sends {row['send_s']:.2f} s, ring copies {row['copy_s']:.2f} s, ring waits "
              f"{row['ring_wait_s']:.2f} s); durable after {row['durable_s']:.2f} s; the child's inbox "
              f"held up to {(row['inbox_peak_bytes'] or 0) / 2**20:.1f} MiB", flush=True)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
