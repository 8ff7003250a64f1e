"""The shared memory a writer process takes rows through: a header, then two rings.

The copy ring takes rows `ProcessCaptureWriter.write` copies in (the sink thread's
memmove). The device ring, page-locked for CUDA, takes rows the engine's GPU copies into
it directly (`reserve_rows` on the step thread, then `write_reserved` on the sink thread
once the copy landed). The header's first two 8-byte words hold how far the child has
consumed each ring (copy ring at 0, device ring at 8): the child copies a write's rows
out and only then advances it; the parent reuses ring bytes only below it (x86 store
order is enough). Each ring has one producer thread, so its entries reach the child in
reservation order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

HEADER = 4096  # the consumed counters (copy ring at 0, device ring at 8), then the rings
PAGE = 4096
ALIGN = 64


def align(n: int) -> int:
    """`n` rounded up to a ring entry's alignment."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def place(head: int, n: int, ring_bytes: int) -> tuple[int, int]:
    """(physical offset, logical end) of n ring bytes from logical `head`: a write never
    wraps inside itself, so one that would is placed at the ring's start (the tail is
    skipped)."""
    phys = head % ring_bytes
    if phys + n > ring_bytes:
        head += ring_bytes - phys
        phys = 0
    return phys, head + n


class RingOwner(Protocol):
    """What a reservation needs of the writer whose device ring it is in."""

    ring_bytes: int
    device_ring: torch.Tensor


@dataclass
class DeviceRows:
    """Device-ring space reserved for one write's rows (`ProcessCaptureWriter.reserve_rows`,
    or one write's part of `reserve_span`): `rows` is the page-locked host view the
    engine's GPU copy fills. Handing it over needs only the numbers (no tensor view)."""

    writer: RingOwner
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int  # from the start of the shared memory (what a ring write names)
    end: int  # logical end, for the child's consumed counter

    @property
    def rows(self) -> torch.Tensor:
        start = self.offset - HEADER - self.writer.ring_bytes
        nbytes = math.prod(self.shape) * self.dtype.itemsize
        return self.writer.device_ring[start:start + nbytes].view(self.dtype).view(self.shape)
