"""The manifest schema: the fields a capture's manifest.json holds, in reading order,
and the error outcome the API server publishes for a capture no writer opened.

Writers and the server import this; the on-disk format is docs/capture-format.md."""

from __future__ import annotations

import functools
import os
import socket
import time
from pathlib import Path
from typing import Any

from capsteer.capture.layouts import MANIFEST_FILE
from capsteer.capture.paths import relative_dir
from capsteer.capture.publish import DEFAULT_FS, FileSystem, ensure_dir, write_json_atomic
from capsteer.capture.receipts import Receipt, find_receipt
from capsteer.capture.spec import CaptureSpec
from capsteer.hooks import HOOK_SEMANTICS_VERSION

FORMAT_VERSION = 1


@functools.cache
def _hostname() -> str:
    return socket.gethostname()


ENGINE_PID_ENV = "CAPSTEER_ENGINE_PID"  # set for a writer process: whose rows it publishes


def writer_info() -> dict[str, Any]:
    """Who wrote a manifest (or took a merge lock): host and pid, and for a writer process
    (capsteer.capture.writer.child) the engine worker whose captures it publishes."""
    info: dict[str, Any] = {"host": _hostname(), "pid": os.getpid()}
    engine_pid = os.environ.get(ENGINE_PID_ENV)
    if engine_pid:
        info["engine_pid"] = int(engine_pid)
    return info


def outcome_manifest(capture_id: str, request_id: str | None, status: str, error: str | None,
                     model: str, spec: CaptureSpec, keys: list[str], *,
                     timings: dict[str, Any], dtype: str | None = None,
                     model_shape: dict[str, Any] | None = None,
                     fields: dict[str, Any] | None = None) -> dict[str, Any]:
    """A manifest's fields in reading order, for a writer's outcome and for the server's
    outcome of a capture no writer opened; `model_shape` and `fields` are what only a
    writer knows."""
    manifest: dict[str, Any] = {
        "format": "capsteer.capture",
        "format_version": FORMAT_VERSION,
        "capture_id": capture_id,
        "request_id": request_id,
        "status": status,
        "error": error,
        "model": model,
        "hook_semantics_version": HOOK_SEMANTICS_VERSION,
        "layout": spec.layout,
        "dtype": dtype,
        **(model_shape or {}),
        "spec": spec.to_dict(),
        "keys": keys,
        **(fields or {}),
    }
    manifest.setdefault("positions", [])
    manifest.setdefault("files", [])
    manifest["timings"] = timings
    manifest["writer"] = writer_info()
    return manifest


def publish_unreached(root: str | Path, capture_id: str, *, spec: CaptureSpec, model: str,
                      reason: str, fs: FileSystem = DEFAULT_FS,
                      dir_time: float | None = None) -> Receipt:
    """The error manifest of a capture whose request was aborted before any engine saw it.

    No writer ever opened it, so none will publish: without this manifest its receipt
    would stay pending. The API server writes it, like a writer's error outcome
    (same fields, no data files). An outcome already on disk wins and is returned.
    `dir_time` dates its directory as the request's payload would have (default: now)."""
    root = Path(root)
    found = find_receipt(root, capture_id)
    if found is not None:
        return found
    now = time.time()
    rel_dir = relative_dir(capture_id, spec.tag, now if dir_time is None else dir_time)
    manifest = outcome_manifest(capture_id, None, "error", reason, model, spec, [],
                                timings={"opened_at": None, "closed_at": now})
    path = root / rel_dir
    ensure_dir(path, fs)
    write_json_atomic(path, MANIFEST_FILE, manifest, fs)
    return Receipt.from_manifest(manifest, rel_dir)
