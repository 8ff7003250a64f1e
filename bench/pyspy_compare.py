"""Two py-spy raw profiles of one thread side by side: where its busy time went.

`bench/gpu_pyspy_window.sh` (IDLE=1) samples a running engine for a fixed window. On a
small model at large steps vLLM's engine-core step thread is the bottleneck, so what
matters is how that thread spends its busy samples. For one thread of each profile
(default: the EngineCore process's MainThread), this prints its busy and idle samples
(idle: stacks through `--idle-frame`, vLLM's wait for work, i.e. the engine had nothing
to run) and, for every function whose file matches a `--files` fragment, the busy
samples whose stack passes through it (inclusive), in both profiles, largest last first.

    python bench/pyspy_compare.py spy-plain.txt.gz spy-capture_durable.txt.gz \
        [--process VLLM::EngineCore] [--thread MainThread] [--files capsteer/ vllm/v1/]
"""

from __future__ import annotations

import argparse
import gzip
import re
from collections import Counter
from pathlib import Path

_PROCESS_SPLIT = re.compile(r';(?=process \d+:")')


def _open(path: Path):
    return gzip.open(path, "rt") if path.suffix == ".gz" else path.open()


def thread_profile(path: Path, process: str, thread: str, files: list[str],
                   idle_frame: str) -> tuple[int, int, Counter[str]]:
    """(busy samples, idle samples, inclusive busy samples by matching function) of the
    named thread of the innermost process whose command line contains `process`."""
    busy = idle = 0
    inclusive: Counter[str] = Counter()
    for line in _open(path):
        stack, _, count = line.rstrip("\n").rpartition(" ")
        # process entries (a command line may hold ';'), then the thread, then its frames
        head, sep, rest = stack.partition(";thread (")
        if not sep or not count.isdigit():
            continue
        owners = _PROCESS_SPLIT.split(head)
        name, _, calls_text = rest.partition(";")
        if process not in owners[-1] or thread not in name:
            continue
        n = int(count)
        calls = calls_text.split(";")
        if any(idle_frame in f for f in calls):
            idle += n
            continue
        busy += n
        seen = set()
        for f in calls:
            name, _, where = f.partition(" (")
            if any(frag in where for frag in files):
                key = f"{name} [{where.split(':')[0].rsplit('/', 1)[-1]}]"
                if key not in seen:
                    seen.add(key)
                    inclusive[key] += n
    return busy, idle, inclusive


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("first", type=Path)
    ap.add_argument("second", type=Path)
    ap.add_argument("--process", default="VLLM::EngineCore")
    ap.add_argument("--thread", default="MainThread")
    ap.add_argument("--files", nargs="+", default=["capsteer/", "engine_ext/", "capture/",
                                                    "vllm/"])
    ap.add_argument("--idle-frame", default="_process_input_queue")
    ap.add_argument("--top", type=int, default=50)
    a = ap.parse_args()
    got = [thread_profile(p, a.process, a.thread, a.files, a.idle_frame)
           for p in (a.first, a.second)]
    for path, (busy, idle, _) in zip((a.first, a.second), got, strict=True):
        total = busy + idle
        print(f"{path.name}: {total} samples, busy {busy} ({100 * busy / max(total, 1):.1f}%), "
              f"idle {idle}")
    (b1, _, c1), (b2, _, c2) = got
    print(f"{'first':>7} {'%busy':>6} {'second':>7} {'%busy':>6}  function [file]")
    for key in sorted(set(c1) | set(c2), key=lambda k: -c2.get(k, 0))[: a.top]:
        n1, n2 = c1.get(key, 0), c2.get(key, 0)
        print(f"{n1:7d} {100 * n1 / max(b1, 1):6.1f} {n2:7d} {100 * n2 / max(b2, 1):6.1f}  {key}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
