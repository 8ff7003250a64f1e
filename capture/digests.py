"""The digests a capture's files are recorded with: names, hashers, manifest fields.

Every data file's digest is recorded in the manifest under the algorithm's name:
`{"sha256": hex}` for sha256 (the default, api.md §5), `{"digest": "blake3", "blake3":
hex}` otherwise, so a manifest that predates the choice reads as sha256. Writers and
readers both import this module.
"""

from __future__ import annotations

import hashlib
from typing import Any, Protocol

DIGESTS = ("sha256", "blake3")  # names as recorded in manifests
DEFAULT_DIGEST = "sha256"  # api.md §5 names sha256; blake3 is opt-in (docs/capture-format.md)


class DigestError(ValueError):
    """An unknown digest name, or one whose library is not installed."""


class Hasher(Protocol):
    def update(self, data: memoryview, /) -> object: ...

    def hexdigest(self) -> str: ...


def check_digest(name: object) -> str:
    """`name` if it is a digest this version writes and verifies; DigestError otherwise."""
    if name not in DIGESTS:
        raise DigestError(f"unknown digest {name!r}; known: {', '.join(DIGESTS)}")
    return str(name)


def new_hasher(name: str) -> Hasher:
    """A fresh incremental hasher for a digest named in DIGESTS.

    blake3 is single-threaded per file on purpose: one thread already hashes faster
    than a disk writes (bench/README.md), and writers run several files at once."""
    if check_digest(name) == "sha256":
        return hashlib.sha256()
    try:  # optional: only the blake3 digest needs the package
        from blake3 import blake3
    except ImportError:
        raise DigestError("the blake3 digest needs the blake3 package (a vLLM dependency; "
                          "pip install blake3)") from None
    return blake3()


def digest_fields(name: str, hexdigest: str) -> dict[str, str]:
    """The manifest fields recording a file's digest; sha256 keeps its pre-choice form."""
    if check_digest(name) == "sha256":
        return {"sha256": hexdigest}
    return {"digest": name, name: hexdigest}


def entry_digest(entry: dict[str, Any]) -> tuple[object, object]:
    """(algorithm, recorded hex) of a manifest file entry, as given (check the name with
    `check_digest`); an entry without a `digest` field is sha256."""
    name = entry.get("digest", "sha256")
    return name, entry.get(name) if isinstance(name, str) else None
