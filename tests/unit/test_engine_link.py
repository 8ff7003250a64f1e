"""End reports reach the workers through transient failures (server/engine_link.py)."""

from __future__ import annotations

import asyncio

from capsteer.server import engine_link
from capsteer.server.engine_link import EngineLink


class FlakyEngine:
    """An engine client whose first `fail` collective_rpc calls raise, as a busy or
    restarting engine core's utility calls can."""

    def __init__(self, fail: int) -> None:
        self.fail = fail
        self.calls: list[tuple] = []

    async def collective_rpc(self, method, timeout=None, args=()):
        self.calls.append((method, args))
        if len(self.calls) <= self.fail:
            raise TimeoutError("engine core busy")
        (ends,) = args
        return [[capture_id for capture_id, _ in ends]]  # one worker opened them all


def _report(fail: int) -> tuple[FlakyEngine, list[str]]:
    unreached: list[str] = []

    async def on_unreached(capture_id: str) -> None:
        unreached.append(capture_id)

    async def run() -> FlakyEngine:
        engine = FlakyEngine(fail)
        link = EngineLink(engine, on_unreached, rpc_timeout_s=5)
        link.report_end("cap-1", 7)
        link.report_end("cap-2", None)
        await link.drain()
        return engine

    return asyncio.run(run()), unreached


def test_a_failed_report_is_sent_again(monkeypatch):
    monkeypatch.setattr(engine_link, "REPORT_RETRY_S", 0.01)
    engine, unreached = _report(fail=engine_link.REPORT_ATTEMPTS - 1)
    assert len(engine.calls) == engine_link.REPORT_ATTEMPTS
    assert all(args == engine.calls[-1][1] for _, args in engine.calls)  # the same batch
    assert unreached == []  # the answer named both as opened


def test_a_report_that_never_arrives_is_given_up_after_the_attempts(monkeypatch):
    monkeypatch.setattr(engine_link, "REPORT_RETRY_S", 0.01)
    engine, unreached = _report(fail=99)
    assert len(engine.calls) == engine_link.REPORT_ATTEMPTS and unreached == []


class OpeningEngine:
    """An engine client whose one worker answers that it opened the captures in `opened`."""

    def __init__(self, opened: set[str], fail: bool = False) -> None:
        self.opened, self.fail = opened, fail

    async def collective_rpc(self, method, timeout=None, args=()):
        if self.fail:
            raise TimeoutError("engine core gone")
        (ends,) = args
        return [[capture_id for capture_id, _ in ends if capture_id in self.opened]]


def _refusals(engine) -> tuple[list[str], list[str]]:
    """(captures forgotten as refused, captures settled as unreached) after reporting a
    failed (5xx) request opened by a worker, one no worker opened, a plain abort and a
    request vLLM refused (4xx)."""
    forgotten: list[str] = []
    unreached: list[str] = []

    async def on_unreached(capture_id: str) -> None:
        unreached.append(capture_id)

    async def run() -> None:
        link = EngineLink(engine, on_unreached, forgotten.append, rpc_timeout_s=5)
        link.report_end("failed-opened", None, refused_status=500)
        link.report_end("failed-unopened", None, refused_status=503)
        link.report_end("aborted-unopened", None)
        link.report_end("refused-400", None, refused_status=400)
        assert forgotten == ["refused-400"]  # vLLM validates before any engine: at once
        await link.drain()
        assert link._ends == []  # nothing kept once answered (or given up)

    asyncio.run(run())
    return forgotten, unreached


def test_a_failed_request_whose_capture_a_worker_opened_stays_tracked():
    """vLLM answered with a 5xx: a capture no worker opened is forgotten (its reservation
    freed, no error manifest written); one a worker opened is left to that worker's error
    receipt, which frees it when it appears. A 4xx is forgotten at once."""
    forgotten, unreached = _refusals(OpeningEngine({"failed-opened"}))
    assert forgotten == ["refused-400", "failed-unopened"]
    assert unreached == ["aborted-unopened"]  # a plain abort still gets its error outcome


def test_refusals_are_forgotten_when_the_workers_never_answer(monkeypatch):
    monkeypatch.setattr(engine_link, "REPORT_RETRY_S", 0.01)
    forgotten, unreached = _refusals(OpeningEngine(set(), fail=True))
    assert forgotten == ["refused-400", "failed-opened", "failed-unopened"]
    assert unreached == []
