"""The step loop's room on CPython's frame stack (engine_ext/stack_room.py, vllm/worker_access.py).

A call that crosses the end of one of CPython's 16 KiB frame-stack chunks maps a chunk when
it starts and unmaps it when it returns; its first touch is a page fault, which
getrusage counts. Run from `with_room`, the same calls stay in one chunk.
"""

from __future__ import annotations

import resource
import sys
import types

import pytest

from capsteer.engine_ext import stack_room
from capsteer.engine_ext.vllm import worker_access

SHIFTS = range(0, 2200, 100)  # words of frame below the calls: more than one chunk (2,048)


def _descend(depth: int) -> int:
    return _descend(depth - 1) if depth else 0


def _faults_of_calls(shift: int, calls: int = 500) -> int:
    """Page faults of `calls` calls 30 frames deep, made from under a frame of `shift`
    words (which moves where the chunk ends fall)."""

    def calls_here() -> int:
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        for _ in range(calls):
            _descend(30)
        return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before

    return stack_room._roomy_caller(shift)(calls_here, (), {}) if shift else calls_here()


@pytest.mark.skipif(not stack_room.chunked_frames(), reason="frames on a chunked stack: CPython 3.11+")
def test_calls_crossing_a_chunk_end_fault_each_time_but_not_with_room() -> None:
    plain = {shift: _faults_of_calls(shift) for shift in SHIFTS}
    crossing = [shift for shift, faults in plain.items() if faults >= 500]
    if not crossing:
        pytest.skip(f"this interpreter ({sys.version.split()[0]}) keeps its frame-stack chunks")
    roomy = stack_room.with_room(lambda: {s: _faults_of_calls(s) for s in SHIFTS}, "test")()
    assert max(roomy.values()) < 10, roomy  # the same calls, one chunk under them all
    assert "test" in stack_room.loops_with_room()


def test_with_room_runs_the_loop_once_and_nested_loops_as_they_are() -> None:
    seen = []

    def inner(x: int) -> int:
        seen.append(("inner", x))
        return x + 1

    wrapped_inner = stack_room.with_room(inner, "inner")

    def outer(x: int, *, y: int) -> int:
        seen.append(("outer", x, y))
        return wrapped_inner(x) * y

    before = len(stack_room.loops_with_room())
    assert stack_room.with_room(outer, "outer")(2, y=5) == 15
    assert seen == [("outer", 2, 5), ("inner", 2)]
    entered = stack_room.loops_with_room()[before:]
    assert entered == (["outer"] if stack_room.chunked_frames() else [])
    assert wrapped_inner(1) == 2  # outside any roomy loop again: a loop of its own


def test_step_loops_of_imported_modules_are_wrapped_once(monkeypatch: pytest.MonkeyPatch) -> None:
    class Core:
        def run_busy_loop(self) -> str:
            return "core"

    class DataParallelCore(Core):
        def run_busy_loop(self) -> str:
            return "dp:" + super().run_busy_loop()

    class ActorCore(Core):  # inherits the loop: wrapped through Core
        pass

    module = types.ModuleType("fake_engine_core")
    module.Core = Core
    monkeypatch.setitem(sys.modules, "fake_engine_core", module)
    monkeypatch.setattr(worker_access, "STEP_LOOPS", (("fake_engine_core", "Core", "run_busy_loop"),
                                                ("not_imported_here", "Worker", "busy_loop")))
    assert worker_access.give_step_loops_stack_room() == ["Core.run_busy_loop",
                                                    "DataParallelCore.run_busy_loop"]
    assert worker_access.give_step_loops_stack_room() == []  # already wrapped
    assert Core().run_busy_loop() == "core" and ActorCore().run_busy_loop() == "core"
    before = len(stack_room.loops_with_room())
    assert DataParallelCore().run_busy_loop() == "dp:core"  # the override's super() inside
    assert stack_room.loops_with_room()[before:] == (
        ["DataParallelCore.run_busy_loop"] if stack_room.chunked_frames() else [])
    assert "not_imported_here" not in sys.modules
