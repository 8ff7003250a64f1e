"""What the API server asks of the engine's workers (vLLM's `collective_rpc`).

- Output lengths: a durable capture of generated positions is published once the
  front end reports how many tokens the response really has (stop strings are
  found here, after the engine may have fed more). Reports are batched: at most
  one call in flight, the rest queue behind it.
  The answer names the captures each worker opened; an aborted one no worker opened
  never reached an engine, and the server publishes its error outcome itself. A
  request vLLM refused with a 4xx never reached an engine (vLLM validates first): the
  server forgets its capture at once. One that failed with a 5xx is reported like an
  abort: if no worker opened its capture there is nothing to publish and the server
  forgets it; if one did, that worker publishes the aborted capture's error receipt,
  and the server keeps it (and its reserved bytes) until then.
- Metrics: the writers run in the workers, so /metrics asks each worker for a
  snapshot of its capture metrics at scrape time (last good one on failure).

Under vLLM's data parallelism both calls go to every worker of every DP engine
(adapter.collective_rpc_all): the engine holding a capture is not known here, and
every engine's metrics count.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from capsteer.engine_ext import adapter

log = logging.getLogger("vllm.capsteer.server")
REPORT_ATTEMPTS = 3
REPORT_RETRY_S = 0.5  # then 1 s: a busy engine core answers utility calls between steps


class EngineLink:
    def __init__(self, engine_client: Any, on_unreached: Callable[[str], Awaitable[None]],
                 on_refused: Callable[[str], None] | None = None, *,
                 rpc_timeout_s: float = 10.0) -> None:
        self.engine = engine_client
        self.rpc_timeout_s = rpc_timeout_s
        self.on_unreached = on_unreached  # an aborted capture no worker opened
        self.on_refused = on_refused  # a refused request's capture no worker opened
        self._refused: set[str] = set()  # reported ends of requests vLLM refused
        self._ends: list[tuple[str, int | None]] = []
        self._flusher: asyncio.Task | None = None
        self._last_metrics: list[dict] = []

    def report_end(self, capture_id: str, num_output_tokens: int | None, *,
                   refused_status: int | None = None) -> None:
        """Queue a capture's final output length (None: the request was aborted;
        `refused_status`: the error status vLLM answered its request with).

        Synchronous so it also works from `finally` blocks of cancelled requests."""
        if refused_status is not None and refused_status < 500:
            if self.on_refused is not None:  # refused before any engine saw it: nothing to
                self.on_refused(capture_id)  # tell the workers, nothing to publish
            return
        if refused_status is not None:
            self._refused.add(capture_id)
        self._ends.append((capture_id, num_output_tokens))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        while self._ends:
            batch, self._ends = self._ends, []
            answers = await self._send_ends(batch)
            if answers is not None:
                await self._settle_unreached(batch, answers)
            self._forget_refused(batch, answers)

    async def _send_ends(self, batch: list[tuple[str, int | None]]) -> list | None:
        """The workers' answers, trying REPORT_ATTEMPTS times: a lost report would leave
        its captures to the workers' end_wait_s fallback (every fed position, published as
        ok, and only once the engine steps again). A report seen twice is harmless: a
        worker acts on a capture's first end only."""
        for attempt in range(REPORT_ATTEMPTS):
            try:
                return await asyncio.wait_for(adapter.collective_rpc_all(
                    self.engine, "capsteer_end_captures", args=(batch,)), self.rpc_timeout_s)
            except Exception:
                last = attempt == REPORT_ATTEMPTS - 1
                log.warning("capsteer: reporting %d capture ends to the engine failed (try %d "
                            "of %d)%s", len(batch), attempt + 1, REPORT_ATTEMPTS,
                            "; the workers publish them after end_wait_s" if last else "",
                            exc_info=last)
                if not last:
                    await asyncio.sleep(REPORT_RETRY_S * 2 ** attempt)
        return None

    async def _settle_unreached(self, batch: list[tuple[str, int | None]],
                                answers: list) -> None:
        """Aborted captures no worker of any engine opened: the request was aborted before
        it reached an engine (vLLM sends the abort ahead of this report, on the same
        channel), so no writer will ever publish them."""
        opened = {cid for answer in answers for cid in (answer or ())}
        for capture_id, num_output in batch:
            if num_output is None and capture_id not in opened \
                    and capture_id not in self._refused:
                try:
                    await self.on_unreached(capture_id)
                except Exception:
                    log.exception("capsteer: publishing the outcome of capture %s, aborted "
                                  "before it reached the engine, failed", capture_id)

    def _forget_refused(self, batch: list[tuple[str, int | None]], answers: list | None) -> None:
        """Refused requests whose capture no worker opened are forgotten (nothing will be
        published). Without an answer the server cannot tell, and forgets them too: a
        refusal almost always comes before the engine, and a capture held for a manifest
        that never comes would hold its reserved bytes for good."""
        opened = {cid for answer in (answers or ()) for cid in (answer or ())}
        for capture_id, _ in batch:
            if capture_id in self._refused:
                self._refused.discard(capture_id)
                if capture_id not in opened and self.on_refused is not None:
                    self.on_refused(capture_id)

    async def drain(self) -> None:
        """Wait until every queued report was sent (tests, shutdown)."""
        while self._flusher is not None and not self._flusher.done():
            await asyncio.shield(self._flusher)

    async def metrics_snapshots(self, timeout_s: float = 5.0) -> list[dict]:
        try:
            self._last_metrics = await asyncio.wait_for(
                adapter.collective_rpc_all(self.engine, "capsteer_metrics"), timeout_s)
        except Exception:
            log.warning("capsteer: workers did not answer the metrics call; "
                        "serving their last snapshot")
        return self._last_metrics
