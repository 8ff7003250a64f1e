"""Reading captures back: `read(path)` -> tensors or arrays by (hook, layer).

The manifest is the source of truth: a directory without one is not a capture
(it may be a crashed publish, or a pipeline-parallel capture whose stages have not
all published). Checksums are verified before any data is served, so a researcher
never silently trains on a corrupted file. Each tensor is read from the file the
manifest's `tensors` map names, so one reader serves packed, per_file and merged
pipeline-stage captures (one packed file per stage) alike.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

from capsteer.capture.layouts import key_name, parse_key_name
from capsteer.capture.paths import find_capture_dirs, resolve_inside
from capsteer.capture.published import (
    CaptureReadError,
    CorruptCapture,
    load_manifest,
    verify_files,
)
from capsteer.capture.receipts import Receipt
from capsteer.capture.sharded import SHARDED_FORMAT, read_sharded
from capsteer.hooks import canonical_hook, resolve_layer


@dataclass
class Capture:
    """One published capture. Index with (hook, layer); aliases and negative layers work."""

    path: Path
    manifest: dict[str, Any]

    @property
    def capture_id(self) -> str:
        return str(self.manifest["capture_id"])

    @property
    def status(self) -> str:
        return str(self.manifest.get("status", "ok"))

    @property
    def dtype(self) -> str:
        return str(self.manifest.get("dtype", ""))

    @property
    def positions(self) -> np.ndarray:
        """Absolute positions (prompt then generated), one per row, int64."""
        return np.asarray(self.manifest.get("positions", []), dtype=np.int64)

    @property
    def token_ids(self) -> np.ndarray:
        """Input token id at each captured position, int64."""
        return np.asarray(self.manifest.get("token_ids", []), dtype=np.int64)

    @property
    def stages(self) -> int:
        """Pipeline stages that wrote this capture (1 for a single writer)."""
        return int(self.manifest.get("stages", 1))

    def keys(self) -> list[tuple[str, int]]:
        return [parse_key_name(k) for k in self.manifest.get("keys", [])]

    def _resolve(self, hook: str, layer: int) -> tuple[str, str]:
        h = canonical_hook(hook)
        n_layers = int(self.manifest.get("num_layers") or 0)
        resolved = resolve_layer(int(layer), n_layers) if n_layers else int(layer)
        name = key_name(h, resolved)
        entry = self.manifest.get("tensors", {}).get(name)
        if entry is None:
            raise KeyError(f"{name} was not captured; captured: {', '.join(self.manifest.get('keys', []))}")
        return name, str(entry["file"])

    def tensor(self, hook: str, layer: int) -> torch.Tensor:
        """[n_positions, hidden] torch tensor in the stored dtype (bf16 stays bf16)."""
        name, fname = self._resolve(hook, layer)
        with safe_open(self.path / fname, framework="pt") as fh:
            return fh.get_tensor(name)

    def numpy(self, hook: str, layer: int) -> np.ndarray:
        """[n_positions, hidden] numpy array; bf16 (which numpy lacks) comes as float32."""
        t = self.tensor(hook, layer)
        return (t.float() if t.dtype == torch.bfloat16 else t).numpy()

    def tensors(self) -> dict[tuple[str, int], torch.Tensor]:
        return {k: self.tensor(*k) for k in self.keys()}

    def __getitem__(self, key: tuple[str, int]) -> torch.Tensor:
        return self.tensor(*key)

    def __contains__(self, key: object) -> bool:
        try:
            self._resolve(*key)  # type: ignore[misc]
        except (KeyError, ValueError, TypeError):
            return False
        return True

    def verify(self) -> list[str]:
        """Checksums and tensor metadata against the manifest; empty list when sound."""
        problems = verify_files(self.path, self.manifest)
        if problems:
            return problems
        tensors = self.manifest.get("tensors", {})
        listed = {str(e.get("name")) for e in self.manifest.get("files", [])}
        keys = self.manifest.get("keys", [])
        problems += [f"{k}: no tensor entry in manifest" for k in keys if k not in tensors]
        for fname in sorted({e["file"] for e in tensors.values()}):
            if fname not in listed:
                problems.append(f"{fname}: holds tensors but is not listed in the manifest's files")
                continue
            try:
                with safe_open(self.path / fname, framework="pt") as fh:
                    pos = fh.get_tensor("positions")
                    if pos.tolist() != self.manifest.get("positions"):
                        problems.append(f"{fname}: positions differ from manifest")
                    token_ids = self.manifest.get("token_ids")
                    if token_ids is not None and fh.get_tensor("token_ids").tolist() != token_ids:
                        problems.append(f"{fname}: token ids differ from manifest")
                    names = set(fh.keys())
                    for name, entry in self.manifest["tensors"].items():
                        if entry["file"] == fname and name not in names:
                            problems.append(f"{fname}: tensor {name} missing")
            except Exception as exc:
                problems.append(f"{fname}: unreadable safetensors: {exc}")
        return problems


ROOT_ENV = "CAPSTEER_CAPTURE_DIR"  # the server's --capture-dir, as its settings read it


def _receipt_of(source: Any) -> Mapping[str, Any] | None:
    """The `capture_results` object in whatever the user holds: the dict itself, a
    Receipt, or an OpenAI SDK response (its `model_extra`)."""
    if isinstance(source, Receipt):
        return source.to_dict()
    extra = getattr(source, "model_extra", None)
    if isinstance(extra, Mapping):
        source = extra.get("capture_results", extra)
    if isinstance(source, Mapping):
        return source.get("capture_results", source)
    return None


def locate(source: Any, root: str | Path | None = None) -> Path:
    """The capture directory for a path, a receipt (`capture_results`, Receipt, SDK
    response) or a capture id. Receipts and ids are found under `root`, the server's
    capture root (default: $CAPSTEER_CAPTURE_DIR); nothing resolves outside it."""
    receipt = _receipt_of(source)
    root = root if root is not None else os.environ.get(ROOT_ENV)
    is_id = (isinstance(source, str) and "/" not in source and not Path(source).exists()
             and root is not None)
    if receipt is None and not is_id:
        return Path(source)
    if root is None:
        raise CaptureReadError(f"a receipt or capture id is found under the capture root: pass "
                               f"root=... (the server's --capture-dir) or set ${ROOT_ENV}")
    root = Path(root)
    if receipt is None:
        capture_id = str(source)
    else:
        status = receipt.get("status")
        capture_id = str(receipt.get("capture_id") or "")
        if status != "ok" and status != "pending":
            raise CaptureReadError(f"capture {capture_id or '?'}: status {status}: "
                                   f"{receipt.get('error')}")
        if receipt.get("dir"):
            return resolve_inside(root, str(receipt["dir"]))
    found = find_capture_dirs(root, capture_id)
    if not found:
        raise CaptureReadError(f"capture {capture_id} is not published under {root} (yet: a "
                               "pending capture appears once durable; capture_wait waits)")
    return found[0]


def read(source: Any, *, root: str | Path | None = None, verify: bool = True) -> Any:
    """Open a published capture -> Capture.

    `source` is a capture directory or its manifest.json, a receipt (the response's
    `capture_results` object, a Receipt, or the OpenAI SDK response itself), or a
    capture id; receipts and ids are looked up under `root` (the server's capture root;
    default $CAPSTEER_CAPTURE_DIR). A sharded job directory gives a `ShardedCapture`.
    Raises CaptureReadError when there is no ok manifest and CorruptCapture when
    `verify` finds a file that does not match it.
    """
    path = locate(source, root)
    directory, manifest = load_manifest(path)
    if manifest.get("format") == SHARDED_FORMAT:
        return read_sharded(directory, verify=verify)
    cap = Capture(directory, manifest)
    if cap.status != "ok":
        raise CaptureReadError(f"{directory}: capture status {cap.status}: {manifest.get('error')}")
    if verify:
        problems = cap.verify()
        if problems:
            raise CorruptCapture(f"{directory}: " + "; ".join(problems))
    return cap
