"""Room on CPython's frame stack for a step loop, so its deep calls never map memory.

CPython 3.11+ keeps a thread's Python frames on a stack of 16 KiB chunks. A call whose
frame does not fit in the current chunk maps a new chunk (mmap), and the return from that
call unmaps it at once (munmap). A call made once per layer whose frame happens to cross a
chunk's end therefore maps, faults in and unmaps a chunk for every layer of every step.
On an H200 (2026-11-29, 8B shape, 36 layers) capsteer's engine did this 36 times in each
plain prompt-chunk step and 110-147 times in each larger step: 0.4-1.7 ms of kernel time
a step, where vanilla vLLM's step thread, whose frames end elsewhere, did it never. Where
a chunk's end falls depends on every frame below the call, so no frame layout of
capsteer's avoids it for every model and version.

`with_room(loop)` runs a step loop from a frame so large that it opens a fresh chunk with
ROOM_WORDS words (128 KiB) of room after it. The loop and everything it calls then stay
in that one chunk for the life of the loop: nothing is mapped or unmapped per step. It
costs one 256 KiB chunk per process. Other interpreters (and CPython before 3.11, whose
frames are heap objects) run the loop unchanged.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable
from typing import Any

ROOM_WORDS = 16384  # the roomy frame's locals; its chunk is the next power of two above

_entered: list[str] = []  # the loops that ran with room in this process, outermost first
_local = threading.local()


def chunked_frames() -> bool:
    """Whether this interpreter keeps frames on a chunked stack (CPython 3.11 or later)."""
    return sys.implementation.name == "cpython" and sys.version_info >= (3, 11)


@functools.cache
def _roomy_caller(words: int) -> Callable[..., Any]:
    """fn(*args, **kwargs) from a frame with `words` local slots: the locals are only named
    (in a branch that never runs), which is enough for the frame to reserve them."""
    names = " = ".join(f"_{i}" for i in range(words))
    source = (f"def call_with_room(fn, args, kwargs):\n"
              f"    if fn is None:\n        {names} = None\n"
              f"    return fn(*args, **kwargs)\n")
    namespace: dict[str, Any] = {}
    exec(compile(source, "<capsteer stack room>", "exec"), namespace)
    return namespace["call_with_room"]


def with_room(loop: Callable[..., Any], name: str,
              words: int = ROOM_WORDS) -> Callable[..., Any]:
    """`loop` run with `words` words of fresh frame stack under it (once per thread: a loop
    that calls another wrapped loop runs it as it is)."""

    @functools.wraps(loop)
    def run_with_room(*args: Any, **kwargs: Any) -> Any:
        if getattr(_local, "inside", False) or not chunked_frames():
            return loop(*args, **kwargs)
        _local.inside = True
        _entered.append(name)
        try:
            return _roomy_caller(words)(loop, args, kwargs)
        finally:
            _local.inside = False

    run_with_room.__capsteer_stack_room__ = True  # type: ignore[attr-defined]
    return run_with_room


def loops_with_room() -> list[str]:
    """The step loops this process runs (or ran) with room, outermost first."""
    return list(_entered)
