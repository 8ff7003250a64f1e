"""Pipeline-stage merging: which keys a stage publishes, and the one manifest made from
every stage's part (see capsteer.capture.writer.local for the protocol)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from capsteer.capture.layouts import MERGE_LOCK_FILE, key_name, part_name
from capsteer.capture.publish import DEFAULT_FS, FileSystem, fsync_dir
from capsteer.capture.sink import CaptureRequest

Key = tuple[str, int]


def stage_keys(request: CaptureRequest) -> list[Key]:
    """The keys this request's writer publishes, in spec order (all of them unless a
    pipeline stage names its own); rejects stage fields that cannot be merged."""
    spec_keys = request.spec.keys()
    if request.num_stages < 1 or not 0 <= request.stage < request.num_stages:
        raise ValueError(
            f"capture {request.capture_id}: stage {request.stage} of {request.num_stages} stages"
        )
    if request.keys is None:
        return spec_keys
    wanted = {(str(h), int(layer)) for h, layer in request.keys}
    unknown = sorted(wanted - set(spec_keys))
    if unknown:
        names = ", ".join(key_name(*k) for k in unknown)
        raise ValueError(f"capture {request.capture_id}: stage keys {names} are not in the spec")
    if request.num_stages == 1 and len(wanted) != len(spec_keys):
        raise ValueError(f"capture {request.capture_id}: a single stage writes every key")
    return [k for k in spec_keys if k in wanted]


def read_parts(path: Path, num_stages: int) -> list[dict[str, Any]] | None:
    """Every stage's part manifest in stage order, or None while any is missing."""
    try:
        present = set(os.listdir(path))
    except FileNotFoundError:
        return None
    names = [part_name(s) for s in range(num_stages)]
    if not all(n in present for n in names):
        return None
    return [json.loads((path / n).read_text()) for n in names]


def take_merge_lock(path: Path, owner: dict[str, Any]) -> bool:
    """True for exactly one caller per capture directory: the merge lock is created
    with O_EXCL and never removed, so a late stage cannot merge a second time."""
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        fd = os.open(path / MERGE_LOCK_FILE, flags, 0o644)
    except FileExistsError:
        return False
    try:
        os.write(fd, json.dumps(owner).encode() + b"\n")
    finally:
        os.close(fd)
    return True


def _preview(value: Any) -> str:
    if isinstance(value, list) and len(value) > 8:
        return json.dumps(value[:8])[:-1] + ",...]"
    return json.dumps(value)


def _disagreements(spec_keys: list[Key], parts: list[dict[str, Any]]) -> list[str]:
    """Why ok parts cannot form one capture: keys that are not split exactly once
    across the stages, or stages that kept different rows."""
    problems: list[str] = []
    owner: dict[str, int] = {}
    wanted = [key_name(*k) for k in spec_keys]
    for s, part in enumerate(parts):
        if part.get("stages") != len(parts) or part.get("stage") != s:
            said = f"{part.get('stage')} of {part.get('stages')}"
            problems.append(f"stage {s}: its part says stage {said}")
        for name in part.get("keys", []):
            if name in owner:
                problems.append(f"stage {s}: {name} was also written by stage {owner[name]}")
            elif name not in wanted:
                problems.append(f"stage {s}: {name} is not in the capture spec")
            else:
                owner[name] = s
    missing = [n for n in wanted if n not in owner]
    if missing:
        problems.append(f"no stage wrote {', '.join(missing)}")
    with_rows = [(s, p) for s, p in enumerate(parts) if p.get("keys")]
    for s, part in with_rows[1:]:
        r, ref = with_rows[0]
        for fld in ("positions", "token_ids", "dtype", "spec"):
            if part.get(fld) != ref.get(fld):
                mine, theirs = _preview(part.get(fld)), _preview(ref.get(fld))
                problems.append(f"stage {s}: {fld} {mine} differ from stage {r}'s {theirs}")
    return problems


def _merged_status(spec_keys: list[Key], parts: list[dict[str, Any]]) -> tuple[str, str | None]:
    """ok only if every stage is ok and they agree; a stage error wins over a drop."""
    said = [(p.get("status"), f"stage {s}: {p.get('error')}") for s, p in enumerate(parts)]
    errors = [msg for status, msg in said if status not in ("ok", "dropped")]
    drops = [msg for status, msg in said if status == "dropped"]
    if errors:
        return "error", "; ".join(errors + drops)
    if drops:
        return "dropped", "; ".join(drops)
    problems = _disagreements(spec_keys, parts)
    return ("error", "; ".join(problems)) if problems else ("ok", None)


def _merged_timings(parts: list[dict[str, Any]], merged_at: float) -> dict[str, float]:
    """Stages publish in parallel: the earliest start, the slowest stage's durations,
    and publish_s from the request end to the merge (each stage's own under stage_parts)."""
    per_stage = [p.get("timings", {}) for p in parts]
    out: dict[str, float] = {}
    for name, pick in (("opened_at", min), ("closed_at", min), ("started_at", min),
                       ("queued_s", max), ("write_s", max), ("fsync_s", max)):
        values = [t[name] for t in per_stage if name in t]
        if values:
            out[name] = pick(values)
    if "closed_at" in out:
        out["publish_s"] = round(merged_at - out["closed_at"], 6)
    out["published_at"] = merged_at
    return out


def merge_parts(
    spec_keys: list[Key], parts: list[dict[str, Any]], merged_at: float, writer: dict[str, Any]
) -> dict[str, Any]:
    """The one manifest of a pipeline-parallel capture, from its parts in stage order.

    Same fields as a single writer's manifest (files and tensors of every stage,
    `keys` the whole spec's), plus `stages` (S) and `stage_parts` (each stage's
    status, keys, files, timings and writer). Not ok: no files are listed, as for a
    single writer's error manifest.
    """
    status, error = _merged_status(spec_keys, parts)
    ref = next((p for p in parts if p.get("keys")), parts[0])
    merged = {k: v for k, v in ref.items() if k not in ("stage", "stages", "timings", "writer")}
    merged["status"], merged["error"] = status, error
    merged["keys"] = [key_name(*k) for k in spec_keys]
    if status == "ok":
        merged["files"] = [f for p in parts for f in p.get("files", [])]
        tensors: dict[str, Any] = {}
        for p in parts:
            tensors.update(p.get("tensors", {}))
        merged["tensors"] = {name: tensors[name] for name in merged["keys"]}
    else:
        merged["positions"], merged["files"] = [], []
        merged.pop("token_ids", None)
        merged.pop("tensors", None)
    merged["timings"] = _merged_timings(parts, merged_at)
    merged["writer"] = writer
    merged["stages"] = len(parts)
    merged["stage_parts"] = [
        {
            "stage": s,
            "status": p.get("status"),
            "error": p.get("error"),
            "keys": p.get("keys", []),
            "files": [f["name"] for f in p.get("files", [])],
            "timings": p.get("timings", {}),
            "writer": p.get("writer"),
        }
        for s, p in enumerate(parts)
    ]
    return merged


def remove_stage_files(path: Path, parts: list[dict[str, Any]], fs: FileSystem = DEFAULT_FS) -> None:
    """Remove the stages' data files once the merged manifest says the capture failed
    (it lists none of them); a crash before this leaves unlisted files, never a lie."""
    names = [f["name"] for p in parts for f in p.get("files", [])]
    for name in names:
        try:
            (path / name).unlink()
        except OSError:
            pass
    if names:
        try:
            fsync_dir(path, fs)
        except OSError:
            pass
