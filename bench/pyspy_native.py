"""One thread's py-spy `--native` samples, summarized and compared between two processes.

Session 54 found a capsteer server's plain prompt-chunk steps 1.1-1.4x slower than
vanilla's, with the step thread on the CPU throughout and the same calls under torch's
profiler, each slower. torch's profiler sees torch ops and CUDA API calls only. py-spy
with `--native` samples the C frames as well (the CUDA driver, libtorch, the C library,
the interpreter), so two processes' samples say in which library the extra time goes.
`mixed_latency.py --pyspy-s S` records the EngineCore for S seconds of plain traffic in
each server; this module turns a raw profile into:
- the thread's samples;
- self samples by the innermost frame's library or Python file ("where");
- self samples by innermost frame;
- inclusive samples by frame (a frame counted once a sample however deep it recurs).

    python bench/pyspy_native.py spy-vanilla-r1.txt.gz spy-capsteer-r1.txt.gz [--thread MainThread]

Counts are compared per 1,000 samples of the thread, so two windows of unequal length
compare; py-spy keeps only samples where the thread was not idle.
"""

from __future__ import annotations

import argparse
import gzip
import re
from collections import Counter
from pathlib import Path
from typing import Any

_LINE = re.compile(r":\d+\)$")


def _open(path: Path):
    return gzip.open(path, "rt") if path.suffix == ".gz" else path.open()


def frame_key(frame: str) -> tuple[str, str]:
    """(name, where) of a raw frame: `fn (file.py:12)` -> (fn, file.py); a native frame
    `sym (libx.so.1)` -> (sym, libx.so.1); an unnamed address -> ("?", its library)."""
    name, _, where = _LINE.sub(")", frame).partition(" (")
    where = where.rstrip(")").rsplit("/", 1)[-1]
    if name.startswith("0x"):
        name = "?"
    return name, where


def summarize(path: Path, thread: str = "MainThread", top: int = 60) -> dict[str, Any]:
    """The named thread's samples (of the raw profile's first process): totals and the
    `top` entries of each table."""
    samples = 0
    self_where: Counter[str] = Counter()
    self_frame: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    for line in _open(path):
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not count.isdigit() or not stack.startswith("thread ("):
            continue
        head, _, frames_text = stack.partition(";")
        if head.partition("): ")[2] != thread or not frames_text:
            continue
        n = int(count)
        samples += n
        frames = [frame_key(f) for f in frames_text.split(";")]
        name, where = frames[-1]
        self_where[where] += n
        self_frame[f"{name} [{where}]"] += n
        for key in {f"{name} [{where}]" for name, where in frames}:
            inclusive[key] += n
    return {"thread": thread, "samples": samples,
            "self_by_where": dict(self_where.most_common(top)),
            "self_by_frame": dict(self_frame.most_common(top)),
            "inclusive": dict(inclusive.most_common(top))}


def compare_lines(a: dict[str, Any], b: dict[str, Any], labels: tuple[str, str],
                  rows: int = 25) -> list[str]:
    """Per table, the entries whose share of the thread's samples differs most (per mille
    of each profile's samples), largest difference first."""
    na, nb = max(a["samples"], 1), max(b["samples"], 1)
    out = [f"    py-spy --native, {a['thread']}: {labels[0]} {a['samples']} samples, "
           f"{labels[1]} {b['samples']} (per mille of each)"]
    for table in ("self_by_where", "self_by_frame", "inclusive"):
        ta, tb = a[table], b[table]
        keys = sorted(set(ta) | set(tb),
                      key=lambda k: -abs(tb.get(k, 0) / nb - ta.get(k, 0) / na))[:rows]
        out.append(f"      {table}: {labels[0]:>8} {labels[1]:>8}")
        out += [f"        {1000 * ta.get(k, 0) / na:8.1f} {1000 * tb.get(k, 0) / nb:8.1f}  {k}"
                for k in keys]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("first", type=Path)
    ap.add_argument("second", type=Path)
    ap.add_argument("--thread", default="MainThread")
    ap.add_argument("--rows", type=int, default=25)
    a = ap.parse_args()
    got = [summarize(p, a.thread, top=10_000) for p in (a.first, a.second)]
    for line in compare_lines(*got, (a.first.name, a.second.name), a.rows):
        print(line)


if __name__ == "__main__":
    main()
