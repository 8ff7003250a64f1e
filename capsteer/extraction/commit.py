"""The job directory of a Ray extraction: replicas stage, the driver commits (api.md §5).

Disk layout, the same as a single-engine job's once the run ends:
- Each replica's worker writes an ordinary sharded job of its own into the staging
  directory `DIR/.staging/r-<random>/` (shards, index, manifest; durable as always). A
  replica reports a batch only when every id of it is in its staging index and its
  shards are in its staging manifest.
- The driver is the one writer of `DIR/index.jsonl` and `DIR/manifest.json`. For a
  reported shard it hard-links (where the filesystem cannot: renames) the complete,
  durable staging file to the job's next `shard-NNNNN.safetensors`, fsyncs `DIR`, lists it
  in the manifest, and only then appends (fsync) the index lines and rewrites the manifest's
  counts. So no partial file is ever under a final name, the index names only durable
  shards, as before, and every shard it names is in the manifest.
- Resume (and the end of a run): shards `index.jsonl` does not name are deleted, a torn
  last line is cut, staged work the index lacks (a replica finished it, the driver was
  killed before committing it) is committed from the staging directories, which are then
  removed. Every id is skipped whichever replica did it; `index.jsonl` lists it once.
One driver per job directory at a time.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from capsteer.capture.layouts import MANIFEST_FILE
from capsteer.capture.publish import (
    DEFAULT_FS,
    FileSystem,
    ensure_dir,
    fsync_dir,
    write_json_atomic,
)
from capsteer.capture.sharded import INDEX_FILE, read_index, shard_name
from capsteer.capture.writer.sharded import recover_index
from capsteer.extraction.job import logger, shard_number

STAGING_DIR = ".staging"


def _publish_link(src: Path, dst: Path) -> None:
    """Put a complete, durable file under its final name at once: a hard link (the staging
    directory keeps its own valid manifest), or a rename where links are not supported."""
    try:
        os.link(src, dst)
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK,
                             errno.EXDEV):
            raise
        if dst.exists():
            raise FileExistsError(dst) from exc
        os.rename(src, dst)


@dataclass
class _StagedShard:
    """A staging shard's listing (manifest `shards` and `files` entries)."""

    shard: dict[str, Any]
    file: dict[str, Any]
    header: dict[str, Any]  # the staging manifest without shards/files/index counts


def staging_listing(staging: Path) -> dict[str, _StagedShard]:
    """A staging directory's shards by name, as its own manifest lists them (none yet: {})."""
    manifest_path = staging / MANIFEST_FILE
    if not manifest_path.exists():
        return {}
    manifest = json.loads(manifest_path.read_text())
    header = {k: v for k, v in manifest.items()
              if k not in ("shards", "files", "requests", "rows", "updated_at")}
    files = {f["name"]: f for f in manifest.get("files", [])}
    return {s["name"]: _StagedShard(s, files.get(s["name"], {"name": s["name"]}), header)
            for s in manifest.get("shards", [])}


class JobCommitter:
    """The one writer of a job's `index.jsonl` and `manifest.json` under Ray (the driver).

    Opening recovers the directory as ShardedWriter does (torn line cut, unindexed
    `shard-*` files deleted); `commit` publishes replica-reported rows; `merge_staging`
    commits what replicas made durable but the driver never committed, then removes the
    staging directories."""

    def __init__(self, out: str | Path, fs: FileSystem = DEFAULT_FS) -> None:
        self.dir = Path(out)
        self.fs = fs
        ensure_dir(self.dir, fs)
        self.index_path = self.dir / INDEX_FILE
        self.index, self._index_size, referenced = recover_index(self.dir, fs)
        self.done: set[str] = {str(e["id"]) for e in self.index}
        manifest: dict[str, Any] = {}
        if (self.dir / MANIFEST_FILE).exists():
            manifest = json.loads((self.dir / MANIFEST_FILE).read_text())
        self.header: dict[str, Any] | None = {
            k: v for k, v in manifest.items()
            if k not in ("shards", "files", "requests", "rows", "updated_at")} or None
        self.shards = {s["name"]: s for s in manifest.get("shards", []) if s["name"] in referenced}
        self.files = {f["name"]: f for f in manifest.get("files", []) if f["name"] in referenced}
        missing = referenced - set(self.shards)
        if missing:  # a single-engine writer's manifest lagged its index; it rebuilds those
            raise RuntimeError(f"{self.dir}: shards {sorted(missing)[:3]} are indexed but not in "
                               f"{MANIFEST_FILE}; run the job once without --ray to rebuild it")
        numbers = [n for n in map(shard_number, referenced) if n is not None]
        self.next_shard = 1 + max(numbers, default=-1)
        if self.header is not None and (len(manifest.get("shards", [])) != len(self.shards)
                                        or manifest.get("requests") != len(self.index)):
            self._write_manifest()  # killed between a listing and the index append it preceded
        self.linked: dict[tuple[str, str], str] = {}  # (replica, staging shard) -> job shard
        self.tokens = 0  # prompt tokens committed by this committer
        self.committed = 0
        self.per_replica: Counter[str] = Counter()  # requests committed, by staging directory
        self._listings: dict[str, dict[str, _StagedShard]] = {}

    # ------------------------------------------------------------------ commit
    def commit(self, rows: Iterable[dict[str, Any]]) -> int:
        """Publish reported rows (id, replica, shard, row_start, row_count, prompt_tokens);
        returns how many were new. Ids already indexed are skipped with a warning."""
        groups: OrderedDict[tuple[str, str], list[dict[str, Any]]] = OrderedDict()
        for r in rows:
            groups.setdefault((str(r["replica"]), str(r["shard"])), []).append(r)
        entries: list[dict[str, Any]] = []
        linked_any = False
        seen: set[str] = set()
        for key, group in groups.items():
            fresh = []
            for r in group:
                rid = str(r["id"])
                if rid in self.done or rid in seen:
                    logger.warning("capsteer extract: %s reported twice; indexed once", rid)
                    continue
                seen.add(rid)
                fresh.append(r)
            if not fresh:
                continue
            name = self.linked.get(key)
            if name is None:
                name = self._link(*key)
                linked_any = True
            entries += [{"id": str(r["id"]), "shard": name, "row_start": int(r["row_start"]),
                         "row_count": int(r["row_count"]),
                         "prompt_tokens": int(r["prompt_tokens"])} for r in fresh]
            self.per_replica[key[0]] += len(fresh)
        if linked_any:  # the new names are durable and listed before the index says so,
            fsync_dir(self.dir, self.fs)  # so an indexed shard is always in the manifest
            self._write_manifest()
        if entries:
            self._append_index(entries)
            self._write_manifest()
        return len(entries)

    def _link(self, replica: str, staged_name: str) -> str:
        listing = self._listings.get(replica)
        if listing is None or staged_name not in listing:
            listing = self._listings[replica] = staging_listing(self._staging(replica))
        staged = listing.get(staged_name)
        if staged is None:
            raise RuntimeError(f"{replica}: {staged_name} was reported but is not in its "
                               f"staging {MANIFEST_FILE}")
        self._check_header(staged.header, replica)
        name = shard_name(self.next_shard)
        self.next_shard += 1
        _publish_link(self._staging(replica) / staged_name, self.dir / name)
        self.linked[(replica, staged_name)] = name
        self.shards[name] = {**staged.shard, "name": name}
        self.files[name] = {**staged.file, "name": name}
        return name

    def _check_header(self, header: dict[str, Any], replica: str) -> None:
        """Every replica (and a job resumed with --ray) must write the same kind of rows."""
        if self.header is None:
            self.header = dict(header)
            return
        for key in ("format", "dtype", "hidden_size", "keys"):
            if self.header.get(key) != header.get(key):
                raise ValueError(f"{self.dir}: replica {replica} writes {key}="
                                 f"{header.get(key)!r}, the job holds {self.header.get(key)!r}")

    def _staging(self, replica: str) -> Path:
        return self.dir / STAGING_DIR / replica

    def _append_index(self, entries: list[dict[str, Any]]) -> None:
        """Append + fsync the lines; on failure cut the file back to its last good size."""
        data = "".join(json.dumps(e, separators=(",", ":")) + "\n" for e in entries).encode()
        fd = os.open(self.index_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC,
                     0o644)
        try:
            if os.fstat(fd).st_size != self._index_size:
                os.ftruncate(fd, self._index_size)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                self.fs.fsync(fd)
                fsync_dir(self.dir, self.fs)
            except BaseException:
                try:
                    os.ftruncate(fd, self._index_size)
                except OSError:
                    pass
                raise
            self._index_size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        self.index += entries
        self.done.update(e["id"] for e in entries)
        self.tokens += sum(e["prompt_tokens"] for e in entries)
        self.committed += len(entries)

    def _write_manifest(self) -> None:
        shards = [self.shards[n] for n in sorted(self.shards)]
        manifest = {**(self.header or {}), "requests": len(self.index),
                    "rows": sum(int(s["rows"]) for s in shards), "index": INDEX_FILE,
                    "shards": shards, "files": [self.files[n] for n in sorted(self.files)],
                    "updated_at": time.time()}
        write_json_atomic(self.dir, MANIFEST_FILE, manifest, self.fs)

    # ----------------------------------------------------------------- recovery
    def merge_staging(self) -> int:
        """Commit what any replica made durable (staging index + manifest) and the job index
        lacks, then delete the staging directories; returns the requests recovered. Run it
        only while no replica of this job is alive."""
        root = self.dir / STAGING_DIR
        if not root.is_dir():
            return 0
        by_id = {str(e["id"]): e for e in self.index}
        recovered = 0
        for staging in sorted(p for p in root.iterdir() if p.is_dir()):
            replica = staging.name
            listing = self._listings[replica] = staging_listing(staging)
            entries = read_index(staging / INDEX_FILE)
            for e in entries:  # a shard partly indexed before the kill keeps its job name
                job = by_id.get(str(e["id"]))
                key = (replica, e["shard"])
                if job is None or key in self.linked or e["shard"] not in listing:
                    continue
                src, dst = staging / e["shard"], self.dir / job["shard"]
                if src.exists() and dst.exists() and os.path.samefile(src, dst):
                    self.linked[key] = job["shard"]
            rows = [{**e, "replica": replica} for e in entries
                    if e["shard"] in listing and (staging / e["shard"]).exists()
                    and str(e["id"]) not in self.done]
            recovered += self.commit(rows)
        shutil.rmtree(root)
        fsync_dir(self.dir, self.fs)
        self._listings.clear()
        return recovered

