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
- Unwritten outcomes: a capture whose manifest a full disk refused has its outcome
  only in the worker's writer; the tracker asks for those (see tracker.py).
- Metrics: the writers run in the workers, so /metrics asks each worker for a
  snapshot of its capture metrics at scrape time (last good one on failure).

Under vLLM's data parallelism both calls go to every worker of every DP engine
(collective_rpc_all): the engine holding a capture is not known here, and
every engine's metrics count.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from capsteer.capture.receipts import Receipt
from capsteer.engine_ext.payload import RPC_END_CAPTURES, RPC_METRICS, RPC_UNWRITTEN
from capsteer.engine_ext.vllm.topology import collective_rpc_all

log = logging.getLogger("vllm.capsteer.server")
REPORT_ATTEMPTS = 3
REPORT_RETRY_S = 0.5  # then 1 s: a busy engine core answers utility calls between steps


class EngineLink:
    def __init__(self, engine_client: Any, on_unreached: Callable[[str], Awaitable[None]],
                 on_refused: Callable[[str], None] | None = None, *,
                 on_end: Callable[[str], None] | None = None,
                 rpc_timeout_s: float = 10.0) -> None:
        self.engine = engine_client
        self.rpc_timeout_s = rpc_timeout_s
        self.on_unreached = on_unreached  # an aborted capture no worker opened
        self.on_refused = on_refused  # a refused request's capture no worker opened
        self.on_end = on_end  # every reported end, first of all
        self._ends: list[tuple[str, int | None, bool]] = []  # (id, output length, 5xx)
        self._flusher: asyncio.Task | None = None
        self._last_metrics: list[dict] = []

    def report_end(self, capture_id: str, num_output_tokens: int | None, *,
                   refused_status: int | None = None) -> None:
        """Queue a capture's final output length (None: the request was aborted;
        `refused_status`: the error status vLLM answered its request with).

        Synchronous so it also works from `finally` blocks of cancelled requests."""
        if self.on_end is not None:
            self.on_end(capture_id)
        if refused_status is not None and refused_status < 500:
            if self.on_refused is not None:  # refused before any engine saw it: nothing to
                self.on_refused(capture_id)  # tell the workers, nothing to publish
            return
        self._ends.append((capture_id, num_output_tokens, refused_status is not None))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        while self._ends:
            batch, self._ends = self._ends, []
            answers = await self._send_ends([(cid, n) for cid, n, _ in batch])
            await self._settle(batch, answers)

    async def _send_ends(self, batch: list[tuple[str, int | None]]) -> list | None:
        """The workers' answers, trying REPORT_ATTEMPTS times: a lost report would leave
        its captures to the workers' end_wait_s fallback (every fed position, published as
        ok, and only once the engine steps again). A report seen twice is harmless: a
        worker acts on a capture's first end only."""
        for attempt in range(REPORT_ATTEMPTS):
            try:
                return await asyncio.wait_for(collective_rpc_all(
                    self.engine, RPC_END_CAPTURES, args=(batch,)), self.rpc_timeout_s)
            except Exception:
                last = attempt == REPORT_ATTEMPTS - 1
                log.warning("capsteer: reporting %d capture ends to the engine failed (try %d "
                            "of %d)%s", len(batch), attempt + 1, REPORT_ATTEMPTS,
                            "; the workers publish them after end_wait_s" if last else "",
                            exc_info=last)
                if not last:
                    await asyncio.sleep(REPORT_RETRY_S * 2 ** attempt)
        return None

    async def _settle(self, batch: list[tuple[str, int | None, bool]],
                      answers: list | None) -> None:
        """Captures no worker of any engine opened (`answers` names those they did):
        - an aborted one never reached an engine (vLLM sends the abort ahead of this
          report, on the same channel), so no writer will ever publish it: the server
          publishes its error outcome;
        - a failed one (5xx) is forgotten: nothing will be published. Without an answer
          the server cannot tell, and forgets it too: a capture held for a manifest that
          never comes would hold its reserved bytes for good."""
        opened = None if answers is None else {cid for a in answers for cid in (a or ())}
        for capture_id, num_output, failed in batch:
            if opened is not None and capture_id in opened:
                continue
            if failed:
                if self.on_refused is not None:
                    self.on_refused(capture_id)
            elif opened is not None and num_output is None:
                try:
                    await self.on_unreached(capture_id)
                except Exception:
                    log.exception("capsteer: publishing the outcome of capture %s, aborted "
                                  "before it reached the engine, failed", capture_id)

    async def drain(self) -> None:
        """Wait until every queued report was sent (tests, shutdown)."""
        while self._flusher is not None and not self._flusher.done():
            await asyncio.shield(self._flusher)

    async def unwritten_receipts(self, capture_ids: Sequence[str]) -> dict[str, Receipt]:
        """Final outcomes the workers reached but could not write to disk (full disk)."""
        answers = await collective_rpc_all(self.engine, RPC_UNWRITTEN, args=(list(capture_ids),))
        return {cid: Receipt.from_dict(d) for a in answers for cid, d in (a or {}).items()}

    async def metrics_snapshots(self, timeout_s: float = 5.0) -> list[dict]:
        try:
            self._last_metrics = await asyncio.wait_for(
                collective_rpc_all(self.engine, RPC_METRICS), timeout_s)
        except Exception:
            log.warning("capsteer: workers did not answer the metrics call; "
                        "serving their last snapshot")
        return self._last_metrics
