"""Safetensors files written as a stream, and which tensors go in which file.

The header (shapes and offsets) is known once positions are finalized, so a file
can be written front to back from row runs without first concatenating each
tensor in memory. The output is plain safetensors: any safetensors reader opens it.
"""

from __future__ import annotations

import ctypes
import json
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

PACKED_FILE = "activations.safetensors"
MANIFEST_FILE = "manifest.json"
# Pipeline parallelism: each stage publishes a part manifest; one stage merges them
# into MANIFEST_FILE after winning the (never removed) merge lock. Both are hidden
# sidecars: readers only ever look at MANIFEST_FILE.
PART_PREFIX = ".stage-"
PART_SUFFIX = ".json"
MERGE_LOCK_FILE = ".merge.lock"

ST_DTYPE: dict[torch.dtype, str] = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
}
TORCH_DTYPE: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
DTYPE_NAME: dict[torch.dtype, str] = {v: k for k, v in TORCH_DTYPE.items()}


def key_name(hook: str, layer: int) -> str:
    """Tensor name of a (hook, layer) pair: "{hook}.{layer}"."""
    return f"{hook}.{layer}"


def parse_key_name(name: str) -> tuple[str, int]:
    hook, _, layer = name.rpartition(".")
    return hook, int(layer)


def per_file_name(hook: str, layer: int) -> str:
    return f"{key_name(hook, layer)}.safetensors"


def packed_name(stage: int | None = None) -> str:
    """The packed file of one capture, or of one pipeline stage's share of it."""
    return PACKED_FILE if stage is None else f"activations-stage{stage}.safetensors"


def part_name(stage: int) -> str:
    """A pipeline stage's part manifest (merged into MANIFEST_FILE)."""
    return f"{PART_PREFIX}{stage}{PART_SUFFIX}"


def part_stage(name: str) -> int | None:
    """The stage a part manifest name belongs to, or None for any other name."""
    if not (name.startswith(PART_PREFIX) and name.endswith(PART_SUFFIX)):
        return None
    digits = name[len(PART_PREFIX) : -len(PART_SUFFIX)]
    return int(digits) if digits.isdigit() else None


def files_for(
    layout: str, keys: list[tuple[str, int]], stage: int | None = None
) -> dict[str, list[tuple[str, int]]]:
    """Data file name -> the (hook, layer) keys it holds, for a single-request layout.

    `stage` (pipeline parallelism) names the packed file per stage and writes no
    file for a stage without keys; None is the single-writer layout.
    """
    if stage is not None and not keys:
        return {}
    if layout == "packed":
        return {packed_name(stage): list(keys)}
    if layout == "per_file":
        return {per_file_name(h, layer): [(h, layer)] for h, layer in keys}
    raise ValueError(f"unknown layout {layout!r}")


def as_bytes(t: torch.Tensor) -> memoryview:
    """Zero-copy little-endian bytes of a contiguous CPU tensor (bf16 included)."""
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def copy_rows(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[...] = src for host tensors of one shape and dtype. Contiguous rows go by one
    memmove on the calling thread (ctypes releases the GIL for it) rather than torch's
    copy, which splits large copies over the intra-op OpenMP team (its threads then spin
    on other cores); other layouts, dtype changes and device tensors take torch's copy."""
    if (src.device.type == "cpu" and src.dtype == dst.dtype and src.shape == dst.shape
            and src.is_contiguous() and dst.is_contiguous()):
        nbytes = src.numel() * src.element_size()
        if nbytes:
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)
        return
    dst.copy_(src)


@dataclass
class TensorPlan:
    """One tensor of a file: its header entry plus a source of its bytes in order."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: Callable[[], Iterable[memoryview | bytes]]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def tensor_plan(name: str, t: torch.Tensor) -> TensorPlan:
    """A plan for a tensor already in memory (positions, token ids, small tensors)."""
    return TensorPlan(name, t.dtype, tuple(t.shape), lambda: [as_bytes(t)])


def header_bytes(plans: list[TensorPlan], metadata: dict[str, str] | None) -> bytes:
    """The safetensors prefix: u64 length, then JSON padded with spaces to 8 bytes."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for p in plans:
        header[p.name] = {
            "dtype": ST_DTYPE[p.dtype],
            "shape": list(p.shape),
            "data_offsets": [offset, offset + p.nbytes],
        }
        offset += p.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def stream_safetensors(
    plans: list[TensorPlan], metadata: dict[str, str] | None = None
) -> Iterator[memoryview | bytes]:
    """Yield a whole safetensors file as byte pieces, checking each tensor's length."""
    yield header_bytes(plans, metadata)
    for p in plans:
        written = 0
        for piece in p.chunks():
            written += len(memoryview(piece).cast("B"))
            yield piece
        if written != p.nbytes:
            raise ValueError(f"tensor {p.name}: produced {written} bytes, header says {p.nbytes}")
