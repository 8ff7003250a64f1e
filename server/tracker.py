"""Captures the API server has sent to the engine and not yet seen durable.

The writers run in engine processes; the manifest on disk is the source of truth
for the outcome. One poller task looks for the manifests of every tracked capture
(one thread hop per tick, however many are pending) and resolves the waiters.
The same table is the server's in-flight account for the `reject` policy: a
capture reserves its estimated bytes at admission and frees them when its outcome is
known (or the request never reached the engine).

When a full disk refuses even a capture's error manifest, the outcome lives only in
the writer that reached it: for captures whose request ended ASK_AFTER_S ago and
still have no manifest, the poller asks the engine's workers (at most once per
ASK_AFTER_S) and resolves them from the answer, so every receipt is final within
about 2 × ASK_AFTER_S of the writer giving up. Those receipts are kept here for
`GET /v1/captures/{id}` until the writer manages to write them to disk. Under several
API server processes each has its own table and budget; `peers` lets a receipt lookup in one
see captures pending in another.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from capsteer.capture.layouts import MANIFEST_FILE
from capsteer.capture.manifest import publish_unreached
from capsteer.capture.paths import relative_dir
from capsteer.capture.receipts import Receipt, find_receipt, pending, receipt_at
from capsteer.capture.spec import CaptureSpec
from capsteer.capture.writer.unwritten import UnwrittenOutcomes
from capsteer.server.peers import PeerBoard

log = logging.getLogger("vllm.capsteer.server")
SEARCH_AFTER_S = 10.0
ASK_AFTER_S = 1.0
# Captures whose request has not ended are looked for this often, not every tick: their
# manifest rarely exists yet, and hundreds in flight cost a file open each per tick.
SWEEP_S = 0.25
AskUnwritten = Callable[[Sequence[str]], Awaitable[dict[str, Receipt]]]
# A capture whose manifest exists, found for its reservation (its receipt was not read).
_DURABLE = pending("", "durable; receipt not read")


@dataclass
class _Tracked:
    reserved: int
    since: float
    spec: CaptureSpec
    dir_time: float | None = None  # the payload's date for its directory (None: unknown)
    ended: float | None = None  # when the front end reported the request's end
    waiters: list[asyncio.Future] = field(default_factory=list)
    rel: str | None = None  # its directory under the root, from dir_time (computed once)


class CaptureTracker:
    """Reservations and receipt waits for captures in flight (asyncio, one event loop)."""

    def __init__(self, root: str | Path, budget_bytes: int, *, poll_s: float = 0.02,
                 idle_poll_s: float = 0.1, forget_after_s: float = 3600.0,
                 peers: PeerBoard | None = None, model: str = "") -> None:
        self.root = Path(root)
        self.model = model
        self.budget = budget_bytes
        # Ticks every poll_s while a client waits for a receipt, else every idle_poll_s:
        # then only the reservation waits, and fewer ticks find more manifests each.
        self.poll_s, self.idle_poll_s = poll_s, idle_poll_s
        self.forget_after_s = forget_after_s
        self._tracked: dict[str, _Tracked] = {}
        self._task: asyncio.Task | None = None
        self.reserved_bytes = 0
        self.peers = peers
        self._searched_at = 0.0
        self.ask_unwritten: AskUnwritten | None = None  # set once the engine link exists
        self._asked_at = 0.0
        self._swept_at = 0.0
        self._unwritten = UnwrittenOutcomes()  # the workers' answers, for receipt lookups

    # ---- admission ----
    def try_reserve(self, capture_id: str, spec: CaptureSpec, nbytes: int,
                    dir_time: float | None = None) -> bool:
        """Reserve for the reject policy: False when the budget cannot take it now."""
        if self.reserved_bytes + nbytes > self.budget and self.reserved_bytes > 0:
            return False
        self.track(capture_id, spec, nbytes, dir_time=dir_time)
        return True

    def track(self, capture_id: str, spec: CaptureSpec, nbytes: int = 0,
              dir_time: float | None = None) -> None:
        """`dir_time`: the time the request's payload dates its directory with (the poller
        then reads that one manifest instead of searching the root)."""
        entry = _Tracked(nbytes, time.monotonic(), spec, dir_time)
        entry.rel = self._rel_dir(capture_id, entry)
        self._tracked[capture_id] = entry
        self.reserved_bytes += nbytes
        if self.peers is not None:
            self.peers.add(capture_id)
        self._ensure_poller()

    def untrack(self, capture_id: str) -> None:
        """The request never produced a capture (vLLM refused it): free its reservation."""
        entry = self._tracked.pop(capture_id, None)
        if entry is not None:
            self.reserved_bytes -= entry.reserved
            if self.peers is not None:
                self.peers.remove(capture_id)
            for fut in entry.waiters:
                if not fut.done():
                    fut.set_result(Receipt(capture_id, "error", error="the request failed before "
                                           "reaching the engine; nothing was captured"))

    async def settle_unreached(self, capture_id: str) -> None:
        """Publish the error outcome of a capture aborted before any engine opened it (see
        EngineLink); the poller then finds its manifest like any other."""
        entry = self._tracked.get(capture_id)
        if entry is None:  # refused by vLLM, or already durable
            return
        await asyncio.to_thread(
            publish_unreached, self.root, capture_id, spec=entry.spec, model=self.model,
            reason="aborted: the request was aborted before the engine ran it; "
                   "nothing was captured", dir_time=entry.dir_time)

    def note_end(self, capture_id: str) -> None:
        """The request ended: from ASK_AFTER_S on, the poller may ask the engine."""
        entry = self._tracked.get(capture_id)
        if entry is not None and entry.ended is None:
            entry.ended = time.monotonic()

    def unwritten(self, capture_id: str) -> Receipt | None:
        """A final receipt the engine reported whose manifest is not on disk (yet)."""
        return self._unwritten.get([capture_id]).get(capture_id)

    def is_tracked(self, capture_id: str) -> bool:
        """In flight here or, under several API servers, in another one."""
        return capture_id in self._tracked or (
            self.peers is not None and self.peers.holds(capture_id))

    # ---- receipts ----
    async def wait(self, capture_id: str, timeout: float) -> Receipt:
        """The final receipt, or a pending one naming the bound when `timeout` passes."""
        entry = self._tracked.get(capture_id)
        if entry is None:
            found = await asyncio.to_thread(find_receipt, self.root, capture_id)
            return found or self.unwritten(capture_id) or pending(
                capture_id, "capture not known to this server")
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        entry.waiters.append(fut)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except asyncio.TimeoutError:
            return pending(capture_id, f"capture not durable after {timeout:g} s "
                           f"(--capture-wait-timeout); fetch GET /v1/captures/{capture_id}")

    def _ensure_poller(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._poll())

    def poll_targets(self) -> dict[str, tuple[str | None, float]]:
        """The captures this tick looks for, each with its directory and tracking time: those
        whose request ended or that someone waits for, and every SWEEP_S all of them."""
        now = time.monotonic()
        if now - self._swept_at >= SWEEP_S:
            self._swept_at = now
            return {c: (e.rel, e.since) for c, e in self._tracked.items()}
        return {c: (e.rel, e.since) for c, e in self._tracked.items()
                if e.ended is not None or e.waiters}

    async def _poll(self) -> None:
        while self._tracked:
            where = self.poll_targets()
            ids = list(where)
            read = {c for c in ids if self._tracked[c].waiters}
            try:
                found = await asyncio.to_thread(self._scan, where, read) if where else {}
            except Exception:  # keep polling; a broken root shows up in receipts' timeouts
                log.exception("capsteer: scanning the capture root failed")
                found = {}
            now = time.monotonic()
            found.update(await self._ask_engine(found, now))
            for capture_id in ids + [c for c in found if c not in where]:
                receipt = found.get(capture_id)
                entry = self._tracked.get(capture_id)
                if entry is None:
                    continue
                if (receipt is None and now - entry.since < self.forget_after_s) or \
                        (receipt is _DURABLE and entry.waiters):  # a waiter came: read it next
                    continue
                if receipt is None:
                    log.warning("capsteer: capture %s not durable after %.0f s; no longer tracked",
                                capture_id, self.forget_after_s)
                    receipt = pending(capture_id, "no manifest yet")
                del self._tracked[capture_id]
                self.reserved_bytes -= entry.reserved
                if self.peers is not None:
                    self.peers.remove(capture_id)
                for fut in entry.waiters:
                    if not fut.done():
                        fut.set_result(receipt)
            waited = any(entry.waiters for entry in self._tracked.values())
            await asyncio.sleep(self.poll_s if waited else self.idle_poll_s)

    async def _ask_engine(self, found: dict[str, Receipt], now: float) -> dict[str, Receipt]:
        """Outcomes the workers hold because the disk refused their manifests."""
        if self.ask_unwritten is None or now - self._asked_at < ASK_AFTER_S:
            return {}
        overdue = [c for c, e in self._tracked.items() if c not in found
                   and e.ended is not None and now - e.ended >= ASK_AFTER_S]
        if not overdue:
            return {}
        self._asked_at = now
        try:
            got = await asyncio.wait_for(self.ask_unwritten(overdue), 5.0)
        except Exception:  # the poll goes on; the next round asks again
            log.warning("capsteer: asking the workers for unwritten capture outcomes failed",
                        exc_info=True)
            return {}
        for capture_id, receipt in got.items():
            log.warning("capsteer: capture %s ended %s but its manifest could not be written: "
                        "%s", capture_id, receipt.status, receipt.error)
        self._unwritten.merge(got.values())
        return got

    @staticmethod
    def _rel_dir(capture_id: str, entry: _Tracked) -> str | None:
        if entry.dir_time is None:
            return None
        return relative_dir(capture_id, entry.spec.tag, entry.dir_time)

    def _scan(self, where: dict[str, tuple[str | None, float]],
              read: set[str] | None = None) -> dict[str, Receipt]:
        """Each capture's manifest where its payload put it (one file read; for a capture
        not in `read`, when given, only whether it exists: nobody waits for its receipt).
        The root is searched for captures not dated here, and, at most once a second, for
        those pending longer than SEARCH_AFTER_S (an outcome that landed elsewhere)."""
        now = time.monotonic()
        search = now - self._searched_at >= 1.0
        if search:
            self._searched_at = now
        out = {}
        for capture_id, (rel, since) in where.items():
            if rel and read is not None and capture_id not in read:
                receipt = _DURABLE if (self.root / rel / MANIFEST_FILE).exists() else None
            else:
                receipt = receipt_at(self.root, rel) if rel else None
            if receipt is None and (rel is None or (search and now - since > SEARCH_AFTER_S)):
                receipt = find_receipt(self.root, capture_id)
            if receipt is not None:
                out[capture_id] = receipt
        return out
