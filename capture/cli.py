"""`capsteer inspect DIR` and `capsteer verify DIR`: table summaries, non-zero on corruption.

DIR may be one capture directory, a sharded job directory, or any directory above
them (the capture root, a date, a tag): every manifest below it is examined.
Directories holding data files but no manifest are reported as incomplete (a
publish that never finished), stale temp files as such; only corruption (a
listed file missing, resized or with the wrong digest, a digest this version
cannot check, an unreadable manifest) makes the exit status non-zero. Each file
is checked with the digest its manifest entry names (sha256 or blake3).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from capsteer.capture.digests import DIGESTS
from capsteer.capture.layouts import MANIFEST_FILE
from capsteer.capture.publish import temp_owner
from capsteer.capture.published import (
    CaptureReadError,
    digests_of,
    load_manifest,
    verify_files,
)
from capsteer.capture.reader import Capture
from capsteer.capture.sharded import ShardedCapture

EXIT_OK = 0
EXIT_CORRUPT = 1
EXIT_USAGE = 2


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))
    out = [line.rstrip(), "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(out)


def _walk(top: Path) -> Iterator[tuple[Path, list[str]]]:
    for dirpath, dirs, files in os.walk(top):
        dirs.sort()
        yield Path(dirpath), files


def _check(directory: Path, deep: bool) -> tuple[str, dict[str, Any] | None, list[str]]:
    """(state, manifest, problems); state is ok / corrupt / <status> (error, dropped)."""
    try:
        _, manifest = load_manifest(directory)
    except CaptureReadError as exc:
        return "corrupt", None, [str(exc)]
    if deep:
        if manifest.get("format") == "capsteer.sharded":
            problems = ShardedCapture(directory, manifest).verify()
        elif manifest.get("status", "ok") == "ok":
            problems = Capture(directory, manifest).verify()
        else:
            problems = verify_files(directory, manifest)
    else:
        problems = []
        for entry in manifest.get("files", []):
            p = directory / str(entry.get("name", ""))
            if not p.is_file():
                problems.append(f"{entry.get('name')}: missing")
            elif p.stat().st_size != entry.get("bytes"):
                problems.append(f"{entry.get('name')}: size differs from manifest")
    if problems:
        return "corrupt", manifest, problems
    return str(manifest.get("status", "ok")), manifest, []


def scan(
    top: Path, deep: bool, digests: set[str] | None = None
) -> tuple[list[list[str]], list[str], int]:
    """Rows of the summary table, notes, and the number of corrupt captures; adds the
    digest names the manifests use to `digests` when given."""
    rows: list[list[str]] = []
    notes: list[str] = []
    corrupt = 0
    for directory, files in _walk(top):
        rel = directory.relative_to(top).as_posix() if directory != top else "."
        temps = [f for f in files if temp_owner(f) is not None]
        if temps:
            notes.append(f"{rel}: {len(temps)} temp file(s) from an unfinished write (swept on writer start)")
        if MANIFEST_FILE not in files:
            if any(f.endswith(".safetensors") and not f.startswith(".") for f in files):
                notes.append(f"{rel}: data files without {MANIFEST_FILE} (incomplete publish)")
            continue
        state, m, problems = _check(directory, deep)
        if state == "corrupt":
            corrupt += 1
            notes.extend(f"{rel}: CORRUPT {p}" for p in problems)
        m = m or {}
        if digests is not None:
            digests.update(digests_of(m))
        is_job = m.get("format") == "capsteer.sharded"
        n_pos = m.get("rows") if is_job else len(m.get("positions", []))
        rows.append(
            [
                rel,
                str(m.get("job_id" if is_job else "capture_id", "?")),
                state,
                "sharded" if is_job else str(m.get("layout", "?")),
                str(m.get("dtype") or "-"),
                str(n_pos if n_pos is not None else "-"),
                str(len(m.get("keys", []))),
                str(len(m.get("files", []))),
                _human(sum(int(f.get("bytes", 0)) for f in m.get("files", []))),
            ]
        )
    return rows, notes, corrupt


def _tensor_table(directory: Path, manifest: dict[str, Any]) -> str:
    rows = [
        [name, "x".join(str(s) for s in e.get("shape", [])), str(e.get("dtype")), str(e.get("file"))]
        for name, e in manifest.get("tensors", {}).items()
    ]
    return _table(["tensor", "shape", "dtype", "file"], rows)


def run(top: str | Path, *, deep: bool, out: Any = None) -> int:
    """Print the summary for `top`; return the exit status."""
    out = out or sys.stdout
    top = Path(top)
    if not top.is_dir():
        print(f"error: {top} is not a directory", file=sys.stderr)
        return EXIT_USAGE
    digests: set[str] = set()
    rows, notes, corrupt = scan(top, deep, digests)
    if not rows and not notes:
        print(f"no captures under {top}", file=out)
        return EXIT_OK
    headers = ["dir", "id", "status", "layout", "dtype", "positions", "keys", "files", "bytes"]
    print(_table(headers, rows), file=out)
    if len(rows) == 1 and (top / MANIFEST_FILE).is_file() and not corrupt:
        _, manifest = load_manifest(top)
        if manifest.get("tensors"):
            print("", file=out)
            print(_tensor_table(top, manifest), file=out)
    for note in notes:
        print(note, file=out)
    names = "/".join(sorted(digests & set(DIGESTS))) or "sha256"  # unknown ones are CORRUPT notes
    checked = f"{names} verified" if deep else f"sizes checked (use verify for {names})"
    print(f"{len(rows)} manifest(s), {corrupt} corrupt; {checked}", file=out)
    return EXIT_CORRUPT if corrupt else EXIT_OK


def _inspect(args: argparse.Namespace) -> int:
    return run(args.dir, deep=False)


def _verify(args: argparse.Namespace) -> int:
    return run(args.dir, deep=True)


def add_commands(subparsers: Any) -> None:
    """Register `inspect` and `verify` on an argparse subparsers object (each sets func)."""
    p = subparsers.add_parser("inspect", help="summarize captures under DIR (sizes checked)")
    p.add_argument("dir", metavar="DIR")
    p.set_defaults(func=_inspect)
    p = subparsers.add_parser("verify", help="verify every capture under DIR (each file's sha256 or blake3, "
                              "as its manifest names); exit 1 on corruption")
    p.add_argument("dir", metavar="DIR")
    p.set_defaults(func=_verify)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="capsteer-capture")
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
