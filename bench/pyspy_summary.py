"""Per-thread summary of a py-spy raw profile of the engine and its writer process.

`bench/stack_sampler.py` sees only the process it runs in; the P3-all question is where
the engine's harvester and the writer process's main thread wait (both are mostly off
the CPU, bench/results/h100-2026-11-25-session26.md). py-spy samples both processes
from outside, waiting threads included (`--idle`), or only the GIL's holder (`--gil`):

    pip download py-spy --no-deps -d .gpu/pyspy        # here; carry .gpu/pyspy there
    pip install --target /tmp/pyspy .gpu/pyspy/*.whl   # on the GPU host
    /tmp/pyspy/bin/py-spy record --subprocesses --threads --idle -r 200 -f raw \
        -o $OUT/idle.txt -- python3 bench/capture_phases.py --one capture_all ...
    python3 bench/pyspy_summary.py $OUT/idle.txt [--top 12] [--json]    # or a .txt.gz

For each (process, thread): its share of the samples, the innermost frames where it sat
("self"), and the frames most often on its stack ("total").
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from collections import Counter, defaultdict
from pathlib import Path

_PROCESS = re.compile(r'process (\d+):"')


def parse(path: Path) -> dict[tuple[str, str], dict[str, Counter[str]]]:
    """(process, thread) -> {"samples", "self", "total"} counters from py-spy's raw
    format: one line per distinct stack, frames joined by ';', then its sample count."""
    out: dict[tuple[str, str], dict[str, Counter[str]]] = defaultdict(
        lambda: {"samples": Counter(), "self": Counter(), "total": Counter()})
    text = gzip.open(path, "rt").read() if path.suffix == ".gz" else path.read_text()
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        # Process labels hold command lines, which may hold ';' themselves: split at the
        # thread frame, which every --threads stack has once.
        head, sep, rest = stack.partition(";thread (")
        pids = list(_PROCESS.finditer(head))
        if pids:  # the innermost process wins (a child's frames)
            last = pids[-1]
            cmd = head[last.end():].strip('"')
            name = "writer process" if "writer_process" in cmd else (cmd[:48] or "launched")
            process = f"{last.group(1)} {name}"
        else:
            process = "?"
        if sep:
            label, _, tail = rest.partition(";")
            thread = "thread (" + label
            frames = tail.split(";") if tail else []
        else:
            thread, frames = "?", head.split(";")[1:]
        entry = out[(process, thread)]
        entry["samples"]["all"] += n
        entry["self"][frames[-1] if frames else "(no Python frame)"] += n
        for frame in set(frames):
            entry["total"][frame] += n
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("raw", nargs="+", type=Path, help="py-spy record -f raw output")
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--min-share", type=float, default=0.01, help="skip quieter threads")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    report = []
    for path in args.raw:
        threads = parse(path)
        total = sum(e["samples"]["all"] for e in threads.values()) or 1
        for (process, thread), e in sorted(threads.items(), key=lambda kv: -kv[1]["samples"]["all"]):
            n = e["samples"]["all"]
            if n / total < args.min_share:
                continue
            report.append({"file": str(path), "process": process, "thread": thread, "samples": n,
                           "share": round(n / total, 4),
                           "self": e["self"].most_common(args.top),
                           "total": e["total"].most_common(args.top)})
    if args.json:
        print(json.dumps(report, indent=1))
        return
    for r in report:
        print(f"\n== {r['process']} / {r['thread']}: {r['samples']} samples ({r['share']:.1%})")
        for label in ("self", "total"):
            print(f"  {label}:")
            for frame, n in r[label]:
                print(f"    {n / r['samples']:6.1%}  {frame}")


if __name__ == "__main__":
    main()
