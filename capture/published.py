"""What every reader needs of a published directory: its manifest loaded, its files
checked against the digests the manifest records, and the errors readers raise."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from capsteer.capture.digests import DigestError, check_digest, entry_digest, new_hasher
from capsteer.capture.layouts import MANIFEST_FILE

_HASH_BLOCK = 4 << 20


class CaptureReadError(RuntimeError):
    """The path is not a readable, complete capture (missing or bad manifest, bad status)."""


class CorruptCapture(CaptureReadError):
    """A file listed in the manifest is missing, has the wrong size or digest, or names a
    digest this version cannot check."""


def file_digest(path: Path, digest: str) -> str:
    """Hex digest of a file with a named algorithm (publish.DIGESTS)."""
    h = new_hasher(digest)
    with open(path, "rb", buffering=0) as fh:
        while True:
            block = fh.read(_HASH_BLOCK)
            if not block:
                return h.hexdigest()
            h.update(memoryview(block))


def sha256_file(path: Path) -> str:
    return file_digest(path, "sha256")


def load_manifest(path: str | Path) -> tuple[Path, dict[str, Any]]:
    """(capture directory, manifest dict) for a capture directory or its manifest path."""
    p = Path(path)
    directory = p.parent if p.name == MANIFEST_FILE else p
    mpath = directory / MANIFEST_FILE
    try:
        manifest = json.loads(mpath.read_text())
    except FileNotFoundError:
        raise CaptureReadError(f"{directory}: no {MANIFEST_FILE} (not a capture, or not published)") from None
    except ValueError as exc:
        raise CorruptCapture(f"{mpath}: unreadable manifest: {exc}") from None
    if not isinstance(manifest, dict) or "files" not in manifest:
        raise CorruptCapture(f"{mpath}: not a capsteer manifest")
    return directory, manifest


def verify_files(directory: Path, manifest: dict[str, Any]) -> list[str]:
    """Problems with the files a manifest lists (empty list when all verify). Each entry
    is checked with the digest it names (`digest`; none: sha256); a name this version
    does not know, or a missing value, is a problem, never a pass."""
    problems: list[str] = []
    for entry in manifest.get("files", []):
        name = entry.get("name", "")
        if not name or "/" in name or name.startswith("."):
            problems.append(f"{name!r}: bad file name in manifest")
            continue
        path = directory / name
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            problems.append(f"{name}: missing")
            continue
        if size != entry.get("bytes"):
            problems.append(f"{name}: {size} bytes, manifest says {entry.get('bytes')}")
            continue
        algorithm, expected = entry_digest(entry)
        try:
            algorithm = check_digest(algorithm)
            if not isinstance(expected, str) or not expected:
                problems.append(f"{name}: manifest records no {algorithm} value")
                continue
            actual = file_digest(path, algorithm)
        except DigestError as exc:
            problems.append(f"{name}: cannot verify: {exc}")
            continue
        if actual != expected:
            problems.append(f"{name}: {algorithm} {actual[:16]}… does not match manifest")
    return problems


def digests_of(manifest: dict[str, Any]) -> set[str]:
    """The digest names a manifest's files use (for reports)."""
    return {str(entry_digest(e)[0]) for e in manifest.get("files", [])}
