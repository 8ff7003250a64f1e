"""Fork server for the crash test: imports torch once, forks one writer per trial.

Reads "ROOT SEED" lines on stdin; for each, forks a child that publishes captures
into ROOT forever (until the test SIGKILLs it) and prints the child's pid.
Importing torch costs ~2 s, so forking keeps 50+ trials fast. The zygote itself
runs no torch ops before forking (no thread pools to inherit).
"""

from __future__ import annotations

import os
import signal
import sys

import numpy as np
import torch

from capsteer.capture import CaptureEnd, CaptureRequest, CaptureWriter, parse_capture_spec


def child(root: str, seed: int) -> None:
    torch.set_num_threads(1)
    rng = np.random.default_rng(seed)
    budget = int(rng.choice([256 << 10, 8 << 20]))  # small budget: spill files too
    w = CaptureWriter(root, budget_bytes=budget, policy="block", workers=2)
    i = 0
    while True:
        layout = str(rng.choice(["packed", "per_file"]))
        dtype = [torch.float32, torch.bfloat16][int(rng.integers(2))]
        spec = parse_capture_spec(
            {"hooks": ["resid_post", "resid_mid"], "layers": f"0-{int(rng.integers(0, 3))}", "layout": layout},
            num_layers=4,
        )
        prompt = int(rng.integers(16, 400))
        gen = int(rng.integers(1, 6))
        cid = f"c{seed}-{i}"
        w.open(CaptureRequest(cid, cid, "m", spec, tuple(range(prompt)), dtype, 256, 4))
        half = prompt // 2
        for lo, hi in [(0, half), (half, prompt), *[(t, t + 1) for t in range(prompt, prompt + gen - 1)]]:
            for hook, layer in spec.keys():
                rows = torch.randn(hi - lo, 256).to(dtype)
                w.write(cid, hook, layer, np.arange(lo, hi), rows)
        w.close(CaptureEnd(cid, tuple(range(prompt + gen - 1))))
        i += 1


def main() -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped automatically
    print("ready", flush=True)
    for line in sys.stdin:
        root, seed = line.split()
        pid = os.fork()
        if pid == 0:
            try:
                sys.stdin.close()
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, 1)
                child(root, int(seed))
            finally:
                os._exit(1)
        print(pid, flush=True)


if __name__ == "__main__":
    main()
