"""Test helpers that play the engine's part: open, per-step row chunks, close.

A uniquely named module (not conftest) so other test folders cannot shadow it.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from capsteer.capture.publish import temp_owner
from capsteer.capture.sink import CaptureEnd, CaptureRequest
from capsteer.capture.spec import CaptureSpec, parse_capture_spec

NUM_LAYERS = 4


def make_spec(**fields: object) -> CaptureSpec:
    obj: dict[str, object] = {"hooks": ["resid_post"], "positions": "all", **fields}
    if not isinstance(obj["hooks"], dict):
        obj.setdefault("layers", "all")
    return parse_capture_spec(obj, num_layers=NUM_LAYERS)


def make_request(
    capture_id: str,
    spec: CaptureSpec,
    prompt_len: int,
    *,
    hidden: int = 16,
    dtype: torch.dtype = torch.float32,
) -> CaptureRequest:
    prompt = tuple(range(1000, 1000 + prompt_len))
    return CaptureRequest(capture_id, f"req-{capture_id}", "test-model", spec, prompt, dtype, hidden, NUM_LAYERS)


def reference_rows(capture_id: str, key: tuple[str, int], n: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    """Deterministic rows for (capture, key): what the model 'produced' at positions 0..n-1."""
    seed = zlib.crc32(f"{capture_id}/{key[0]}.{key[1]}".encode())
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, hidden, generator=g) * 3).to(dtype)


def feed(
    sink: object,
    req: CaptureRequest,
    generated: int,
    *,
    prefill_chunk: int | None = None,
    recompute_from: int | None = None,
    corrupt_before_recompute: bool = True,
) -> tuple[CaptureEnd, dict[tuple[str, int], torch.Tensor]]:
    """Drive a sink like the engine: chunked prefill, decode steps, optional preemption.

    Returns the CaptureEnd and the full [fed_len, hidden] reference rows per key.
    With `recompute_from`, positions from there on are first sent with wrong values,
    then re-sent correctly (a preemption followed by recompute): last write must win.
    """
    spec = req.spec
    p = len(req.prompt_token_ids)
    fed_len = p + max(0, generated - 1)
    refs = {
        k: reference_rows(req.capture_id, k, fed_len, req.width(k[0]), req.model_dtype)
        for k in spec.keys()
    }

    def send(lo: int, hi: int, wrong: bool = False) -> None:
        pos = np.arange(lo, hi, dtype=np.int64)
        mask = spec.positions.candidate(pos, p)
        if not mask.any():
            return
        for k in spec.keys():
            rows = refs[k][lo:hi][torch.from_numpy(mask)].clone()
            if wrong:
                stale = torch.from_numpy(pos[mask] >= (recompute_from or 0)).unsqueeze(1)
                rows = torch.where(stale, rows + 1000, rows)
            sink.write(req.capture_id, k[0], k[1], pos[mask], rows)  # type: ignore[attr-defined]

    sink.open(req)  # type: ignore[attr-defined]
    steps: list[tuple[int, int]] = []
    chunk = prefill_chunk or max(1, p)
    steps += [(lo, min(p, lo + chunk)) for lo in range(0, p, chunk)]
    steps += [(t, t + 1) for t in range(p, fed_len)]
    for lo, hi in steps:
        send(lo, hi, wrong=recompute_from is not None and corrupt_before_recompute and hi > recompute_from)
    if recompute_from is not None:
        for lo in range(recompute_from, fed_len, 3):
            send(lo, min(fed_len, lo + 3))
    gen_ids = tuple(range(5000, 5000 + generated))
    token_ids = tuple(req.prompt_token_ids) + gen_ids[: max(0, generated - 1)]
    end = CaptureEnd(req.capture_id, token_ids, finish_reason="length")
    return end, refs


def temp_files(root: Path) -> list[Path]:
    return [Path(d) / f for d, _, files in os.walk(root) for f in files if temp_owner(f) is not None]


def all_files(root: Path) -> Iterator[Path]:
    for d, _, files in os.walk(root):
        for f in files:
            yield Path(d) / f
