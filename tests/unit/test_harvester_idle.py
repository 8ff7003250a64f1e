"""The harvester calls its idle hook once it runs out of work: a burst of calls (a step's
deliveries and closes) ends with one flush of the sinks' deferred sends, not one each."""

from __future__ import annotations

import threading
import time

import torch

from capsteer.engine_ext.harvest import Harvester


def test_idle_hook_runs_after_a_burst_not_after_each_call():
    harvester = Harvester(rows=4, hidden=8, dtype=torch.float32, ring=0)  # calls only: no CUDA
    seen: list[str] = []
    gate = threading.Event()
    idle = threading.Event()

    def on_idle() -> None:
        seen.append("idle")
        idle.set()

    harvester.submit_call(gate.wait)  # holds the thread while the burst is queued
    harvester.on_idle = on_idle
    for i in range(5):
        harvester.submit_call(lambda i=i: seen.append(f"call{i}"))
    gate.set()
    assert idle.wait(10)
    harvester.drain()
    assert seen[:6] == ["call0", "call1", "call2", "call3", "call4", "idle"]
    assert "idle" not in seen[:5]


def test_a_failing_idle_hook_is_recorded_and_harvesting_goes_on():
    harvester = Harvester(rows=4, hidden=8, dtype=torch.float32, ring=0)
    calls = []

    def broken() -> None:
        raise OSError("link gone")

    harvester.on_idle = broken
    harvester.submit_call(lambda: calls.append(1))
    harvester.drain()
    deadline = time.monotonic() + 10  # the hook runs once the drain's call left the queue
    while not harvester.errors and time.monotonic() < deadline:
        time.sleep(0.01)
    assert any(isinstance(e, OSError) for e in harvester.errors)
    harvester.submit_call(lambda: calls.append(2))  # the thread is still serving
    harvester.drain()
    assert calls == [1, 2]
