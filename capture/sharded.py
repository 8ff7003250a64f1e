"""The `sharded` layout (api.md §5): many requests per file, for extraction jobs, read back.

`shard-00000.safetensors`, ... hold "{hook}.{layer}" tensors [rows, hidden] plus
`positions` and `token_ids` (one per row) for the requests in that shard, in
order. `index.jsonl` gets one line per request, appended (and fsynced) only
after the shard holding it is durable; the job `manifest.json` lists the shards with
size and digest. `index.jsonl` is the truth for resuming. The writer is
capsteer.capture.writer.sharded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors import safe_open

from capsteer.capture.layouts import key_name, parse_key_name
from capsteer.capture.published import (
    CaptureReadError,
    CorruptCapture,
    load_manifest,
    verify_files,
)
from capsteer.hooks import canonical_hook

INDEX_FILE = "index.jsonl"
SHARDED_FORMAT = "capsteer.sharded"
Key = tuple[str, int]


def shard_name(n: int) -> str:
    return f"shard-{n:05d}.safetensors"


class ShardedCapture:
    """A sharded job directory read back: per-request rows, index, verification."""

    def __init__(self, path: Path, manifest: dict[str, Any]) -> None:
        self.path = path
        self.manifest = manifest
        self.index = read_index(path / INDEX_FILE)
        self._by_id = {str(e["id"]): e for e in self.index}

    def ids(self) -> list[str]:
        return [str(e["id"]) for e in self.index]

    def keys(self) -> list[Key]:
        return [parse_key_name(k) for k in self.manifest.get("keys", [])]

    def request(self, request_id: str) -> dict[str, Any]:
        """{"positions", "token_ids", (hook, layer): tensor} for one request; hooks may be
        named by their aliases (as with a single capture)."""
        e = self._by_id.get(str(request_id))
        if e is None:
            raise KeyError(f"request {request_id!r} is not in the job at {self.path} "
                           f"({len(self._by_id)} requests indexed)")
        lo, hi = e["row_start"], e["row_start"] + e["row_count"]
        out: dict[Any, Any] = _RowsByKey()
        with safe_open(self.path / e["shard"], framework="pt") as fh:
            out["positions"] = fh.get_slice("positions")[lo:hi].numpy()
            out["token_ids"] = fh.get_slice("token_ids")[lo:hi].numpy()
            for key in self.keys():
                out[key] = fh.get_slice(key_name(*key))[lo:hi]
        return out

    def verify(self) -> list[str]:
        problems = verify_files(self.path, self.manifest)
        listed = {s["name"] for s in self.manifest.get("shards", [])}
        for e in self.index:
            if e["shard"] not in listed:
                problems.append(f"index entry {e['id']} points to unlisted {e['shard']}")
        return problems


class _RowsByKey(dict):
    """A request's rows by (hook, layer): an alias of a hook finds its canonical key."""

    def __missing__(self, key: object) -> Any:
        if isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], str):
            try:
                canonical = (canonical_hook(key[0]), key[1])
            except ValueError:  # not a hook name at all
                canonical = key
            if canonical != key and canonical in self:
                return self[canonical]
        captured = ", ".join(key_name(*k) for k in self if isinstance(k, tuple))
        raise KeyError(f"{key!r} was not captured; captured: {captured}")


def read_index(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    raw = path.read_bytes()
    raw = raw[: raw.rfind(b"\n") + 1]
    return [json.loads(line) for line in raw.splitlines() if line.strip()]


def read_sharded(path: str | Path, *, verify: bool = True) -> ShardedCapture:
    directory, manifest = load_manifest(path)
    if manifest.get("format") != SHARDED_FORMAT:
        raise CaptureReadError(f"{directory}: not a sharded job directory")
    job = ShardedCapture(directory, manifest)
    if verify:
        problems = job.verify()
        if problems:
            raise CorruptCapture(f"{directory}: " + "; ".join(problems))
    return job


def indexed_ids(out_dir: str | Path) -> set[str]:
    """Request ids already durable in a job directory (what a resumed job skips)."""
    return {str(e["id"]) for e in read_index(Path(out_dir) / INDEX_FILE)}
