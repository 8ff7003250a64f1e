"""The writer process's malloc tuning: keep freed heap for reuse, trim it when idle."""

from __future__ import annotations

import ctypes
import functools
from typing import Any

from capsteer.capture.publish import libc_function

# glibc malloc's mallopt parameters (malloc.h) and its ceiling on the mmap threshold
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_MAX = 32 << 20
HEAP = {"heap_kept": False, "heap_trims": 0}


@functools.cache
def _malloc_calls() -> tuple[Any, Any]:
    """glibc's mallopt and malloc_trim (each None where the C library has none)."""
    return (libc_function("mallopt", [ctypes.c_int, ctypes.c_int]),
            libc_function("malloc_trim", [ctypes.c_size_t]))


def keep_freed_heap() -> bool:
    """Keep freed memory in the heap, to be reused, instead of giving it back to the
    system at each free. The main thread copies every write's rows out of the ring into a
    fresh tensor; with glibc's defaults those copies often land in newly faulted pages,
    zeroed by the kernel: 550-1,300 us a 1 MiB copy against 93-160 us into reused pages
    (measured on a 2-core CPU machine: docs/performance.md). Rows up to 32 MiB (glibc's ceiling) then come
    from the heap; the heap is trimmed when the child goes idle (`trim_heap`). False
    where the C library has no mallopt (not glibc) or refuses these values: its defaults
    stay."""
    mallopt = _malloc_calls()[0]
    if mallopt is None:
        return False
    kept = (mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) == 1
            and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1)
    HEAP["heap_kept"] = kept
    return kept


def trim_heap() -> None:
    """Give the heap's free pages back to the system: an idle writer holds no more
    memory than its open captures need."""
    trim = _malloc_calls()[1]
    if trim is not None:
        trim(0)
        HEAP["heap_trims"] += 1
