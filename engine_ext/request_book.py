"""Request bookkeeping of a worker's hooks: requests registered as they arrive, their
captures opened on the sink each chose, and closed (or aborted) when the request ends,
when its prompt is fed (prompt-only captures) or when the front end reports its output
length."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace

from capsteer.capture import metrics
from capsteer.capture.sink import CaptureEnd, CaptureRequest, CaptureSink
from capsteer.engine_ext.payload import decode_payload, parse_readout_payload, payload_is_trusted
from capsteer.engine_ext.plan import RequestHooks, shared_site_set
from capsteer.engine_ext.runtime import hook_point
from capsteer.engine_ext.vllm.batch import finished_requests, new_requests
from capsteer.hooks import READOUT

logger = logging.getLogger("vllm.capsteer")  # under vLLM's configured logger
_OPENED_KEPT = 65536  # capture ids remembered for end reports (front ends report within seconds)


class RequestBook:
    """EngineHooks' request bookkeeping (a mixin: the state lives on EngineHooks)."""

    def before_step(self, scheduler_output: object) -> None:
        for req_id in finished_requests(scheduler_output):
            self._finish(req_id)
        if self.awaiting_end:
            self.sweep_endings(time.monotonic())
        for req_id, prompt, extra in new_requests(scheduler_output):
            if req_id in self.requests or req_id in self.detached:
                continue  # resumed after preemption: keep what was captured
            try:
                payload = decode_payload(extra)
            except ValueError:
                logger.exception("capsteer: request %s has an unreadable hook payload; it runs "
                                 "without hooks", req_id)
                continue
            if payload is None:
                continue
            if not payload_is_trusted(payload, self.payload_key):
                logger.warning("capsteer: request %s carries a hook payload this server did not "
                               "write (it reached vLLM around capsteer's checks); it runs "
                               "without hooks", req_id)
                continue
            try:
                hooks = RequestHooks.from_payload(req_id, payload, len(prompt), self.runtime,
                                                  self.vectors)
            except Exception as exc:  # a payload must never stop the engine
                self._hooks_refused(req_id, prompt, payload, exc)
                continue
            missing = self._unavailable_hook(hooks)
            if missing is not None:  # the front ends refuse it first; never a silent no-op
                hooks.release(self.runtime)
                self._hooks_refused(req_id, prompt, payload, ValueError(missing))
                continue
            refusal = self._beyond_stop(hooks)
            if refusal is not None:
                hooks.release(self.runtime)
                logger.error("capsteer: request %s runs without hooks: %s", req_id, refusal)
                self._fail_readout(payload, refusal)
                if hooks.capture is not None and self.capture_rank:
                    self._open_and_abort(req_id, prompt, hooks, refusal)
                continue
            self.requests[req_id] = hooks
            if hooks.readout_id is not None:
                self._start_readout(hooks)
            if hooks.capture is not None and not self.capture_rank:
                # The stream is replicated across TP ranks: rank 0 writes. This rank keeps
                # the points whose columns are split across the ranks, to copy the same rows
                # as rank 0 there and gather them whole for it (runtime.split_columns); it
                # opens no sink and delivers nothing (Delivery._after_step).
                hooks.points = {p: k for p, k in hooks.points.items()
                                if p[1] in self.runtime.shards}
                if not hooks.points:
                    hooks.capture = None
                elif not hooks.needs_output_length:  # dropped when rank 0 closes it early
                    self.closable[req_id] = hooks
                continue
            if hooks.capture is not None:
                if hooks.capture_id in self.sinks:  # e.g. n>1 children share SamplingParams
                    hooks.capture_id = f"{hooks.capture_id}-{len(self.sinks)}"
                    logger.warning("capsteer: capture id reused by request %s; writing it as %s",
                                   req_id, hooks.capture_id)
                self.prompts[req_id] = prompt = tuple(prompt)
                sink = self._sink_for(hooks)
                self.sinks[hooks.capture_id] = sink
                if not hooks.needs_output_length:
                    self.closable[req_id] = hooks
                self.opened[hooks.capture_id] = None
                if len(self.opened) > _OPENED_KEPT:
                    del self.opened[next(iter(self.opened))]
                sink.open(self._capture_request(req_id, prompt, hooks))
                hooks.group = sink.group_of(hooks.capture_id)  # the writer pool's child

    def _start_readout(self, hooks: RequestHooks) -> None:
        """Load the readout's readers and open its results file (on the rank that writes);
        one that cannot start runs without it and the server answers why."""
        readout_id = hooks.readout_id
        if not self.capture_rank:  # the stream is replicated across TP ranks: rank 0 reads
            hooks.readout_id, hooks.readout_points = None, {}
            return
        try:
            self.readouts.start(readout_id, hooks.readout_items, hooks.prompt_len)
        except Exception as exc:  # a reader replaced or unreadable: never stop the engine
            logger.error("capsteer: request %s runs without its readout: %s", hooks.req_id, exc)
            self.readouts.fail(readout_id, f"capsteer: {exc}", len(hooks.readout_items))
            hooks.readout_id, hooks.readout_points = None, {}
            return
        self.sinks[readout_id] = self.readouts

    def _fail_readout(self, payload: Mapping, reason: str) -> None:
        """A refused payload's readout, if any, ends with its reason for the server."""
        if not (self.capture_rank and payload.get("readout")):
            return
        try:
            readout_id, items = parse_readout_payload(payload["readout"])
        except Exception:  # nothing the server could be told about
            logger.exception("capsteer: an unreadable readout payload")
            return
        self.readouts.fail(readout_id, reason, len(items))

    def _unavailable_hook(self, hooks: RequestHooks) -> str | None:
        """Why a request's hooks name a point this model does not have (a parallel
        block's resid_mid), or None."""
        if not self.sites.unavailable:
            return None
        asked = set(hooks.points) | set(hooks.readout_points) | set(hooks.patches) | {
            (kind, site) for kind, site, _ in hooks.entries}
        # A use refused on its own (hooks.hook_use): readouts here; a projection on split
        # columns is refused where its entries are cut (selections.local_map).
        uses = {"": asked, READOUT: set(hooks.readout_points)}
        reasons = []
        for key, reason in self.sites.unavailable:
            hook, _, use = key.partition(":")
            points = uses.get(use, set())
            if any(hook_point(hook, layer, self.sites.num_layers) in points
                   for layer in range(self.sites.num_layers)):
                reasons.append(reason)
        return "; ".join(reasons) or None

    def _hooks_refused(self, req_id: str, prompt, payload: Mapping, exc: Exception) -> None:
        """A payload this worker cannot serve runs without hooks, never silently: logged,
        counted in capsteer_steering_refused_total (operators alert on it; a steered
        response that was not steered looks like any other), and its capture, if any,
        ends with an error receipt."""
        logger.error("capsteer: request %s has a hook payload this worker cannot serve; it "
                     "runs without hooks: %s", req_id, exc, exc_info=exc)
        if self.capture_rank and payload.get("steering"):
            metrics.STEERING_REFUSED.inc()
        self._refuse_capture(req_id, prompt, payload, f"capsteer: {exc}")
        self._fail_readout(payload, f"capsteer: {exc}")

    def _refuse_capture(self, req_id: str, prompt, payload: Mapping, reason: str) -> None:
        """A capture the worker cannot serve (e.g. the steering table is full) still ends,
        with an error receipt naming why: the client's wait and the server's budget are
        released, never left until the capture is forgotten."""
        if not self.capture_rank:
            return
        try:
            hooks = RequestHooks.capture_only(req_id, payload, len(prompt))
            if hooks.capture is not None:
                self._open_and_abort(req_id, prompt, hooks, reason)
        except Exception:  # no capture the worker could name: nothing to answer for
            logger.exception("capsteer: request %s: its capture could not be ended either",
                             req_id)

    def _open_and_abort(self, req_id: str, prompt, hooks: RequestHooks, reason: str) -> None:
        """End a capture that will get no rows: open it, so its sink knows it, then abort
        it on the sink thread (after anything queued before), which writes the error
        receipt that releases the client's wait and the server's reservation."""
        sink = self._sink_for(hooks)
        sink.open(self._capture_request(req_id, prompt, hooks))
        self._run_on_sink_thread(lambda s=sink, c=hooks.capture_id, r=reason: s.abort(c, r))

    def _capture_request(self, req_id: str, prompt, hooks: RequestHooks) -> CaptureRequest:
        return CaptureRequest(
            capture_id=hooks.capture_id, request_id=hooks.record_id or req_id,
            model=self.model_name, spec=hooks.capture, prompt_token_ids=tuple(prompt),
            model_dtype=self.runtime.dtype, hidden_size=self.sites.hidden_size,
            num_layers=self.sites.num_layers, stage=self.stage, num_stages=self.num_stages,
            keys=hooks.local_keys if self.num_stages > 1 else None, dir_time=hooks.dir_time,
            hook_widths=getattr(self.sites, "hook_widths", ()))

    def _sink_for(self, hooks: RequestHooks) -> CaptureSink:
        if hooks.sink == "sharded" and self.sharded is not None:
            return self.sharded
        if hooks.sink in ("durable", "sharded") and self.writer is not None:
            return self.writer
        return self.memory

    def _finish(self, req_id: str) -> None:
        self.detached.discard(req_id)
        self.closable.pop(req_id, None)
        hooks = self.requests.pop(req_id, None)
        if hooks is None:
            return
        hooks.release(self.runtime)
        if hooks.readout_id is not None:
            self.sinks.pop(hooks.readout_id, None)
            self._run_on_sink_thread(lambda rid=hooks.readout_id: self.readouts.finish(rid))
        if hooks.capture is None:
            return
        prompt = self.prompts.pop(req_id, ())
        sink = self.sinks.pop(hooks.capture_id, None)
        if sink is None:
            return
        ending = CaptureEnding(hooks, prompt, sink, time.monotonic() + self.end_wait_s)
        if (hooks.await_end or hooks.sink != "memory") and hooks.fed_len < hooks.prompt_len:
            # Every finished request had its whole prompt fed: this one was aborted (a
            # published capture is whole; an in-memory one is cut by its caller).
            self._run_on_sink_thread(lambda: ending.abort("request ended before its prompt "
                                                          "was processed (aborted)"))
        elif not hooks.await_end or not hooks.needs_output_length:
            self._run_on_sink_thread(lambda: ending.close(None))
        elif hooks.capture_id in self.end_notices:
            self._settle(ending, self.end_notices.pop(hooks.capture_id))
        else:
            self.awaiting_end[hooks.capture_id] = ending

    def _run_on_sink_thread(self, fn) -> None:
        if self.device_driven:
            self.harvester.submit_call(fn)  # after every row of this request is delivered
        else:
            fn()

    def _settle(self, ending: CaptureEnding, num_output: int | None) -> None:
        if num_output is None:
            self._run_on_sink_thread(lambda: ending.abort("request aborted"))
        else:
            self._run_on_sink_thread(lambda: ending.close(num_output))

    def end_captures(self, ends: list[tuple[str, int | None]]) -> list[str]:
        """The front end's final output lengths (None: the request was aborted).

        Returns the ids among `ends` this worker opened a capture for: an aborted capture
        no worker opened never reached an engine, and the front end publishes its error
        outcome. An abort for an id not seen yet is kept, so a request that still
        arrives (its abort lost in a race) ends aborted too."""
        now = time.monotonic()
        for capture_id, num_output in ends:
            ending = self.awaiting_end.pop(capture_id, None)
            if ending is not None:
                self._settle(ending, num_output)
            elif capture_id in self.sinks or num_output is None:
                self.end_notices[capture_id] = num_output  # the worker has not seen the end yet
        self.end_notices = {c: n for c, n in list(self.end_notices.items())[-4096:]}
        self.sweep_endings(now)
        return [capture_id for capture_id, _ in ends if capture_id in self.opened]

    def sweep_endings(self, now: float) -> None:
        """Captures whose end report never came are published with what was fed."""
        for capture_id, ending in list(self.awaiting_end.items()):
            if ending.deadline <= now:
                del self.awaiting_end[capture_id]
                logger.warning("capsteer: capture %s: no output length from the front end "
                               "after %.0f s; publishing every fed position", capture_id,
                               self.end_wait_s)
                self._run_on_sink_thread(lambda e=ending: e.close(None))

    def _close_complete_captures(self) -> None:
        """Close, right after the step that fed the prompt's last token, the captures that
        can get no more rows (all kept positions in the prompt), instead of when the request
        finishes: publishing then overlaps the request's decode, and its decode steps carry
        no capture (no copies, a reusable plan)."""
        if not self.closable:
            return
        done = [h for h in self.closable.values() if h.fed_len >= h.prompt_len]
        endings = []
        for hooks in done:
            del self.closable[hooks.req_id]
            if hooks.capture is None:  # shed (staging overflow): its sink already aborted it
                continue
            sink = self.sinks.pop(hooks.capture_id, None)
            prompt = self.prompts.pop(hooks.req_id, ())
            if sink is not None:
                # A copy: the close runs on the sink thread after this step's rows.
                endings.append(CaptureEnding(replace(hooks), prompt, sink, 0.0))
                self.early_closes += 1
            hooks.capture = None
            hooks.points = {}
            hooks.sites = shared_site_set(frozenset(
                [site for _, site, _ in hooks.entries]
                + [site for _, site in hooks.readout_points]))
            if not hooks.entries and hooks.readout_id is None:  # a plain request from now on
                del self.requests[hooks.req_id]
                hooks.release(self.runtime)
                self.detached.add(hooks.req_id)
        if endings:  # one call for the step's closes (each guarded on its own)
            self._run_on_sink_thread(lambda es=endings: _close_all(es))


@dataclass
class CaptureEnding:
    """A finished request's capture, ready to close once its output length is known."""

    hooks: RequestHooks
    prompt: tuple[int, ...]
    sink: CaptureSink
    deadline: float

    def close(self, num_output: int | None) -> None:
        try:
            self._close(num_output)
        except Exception as exc:  # a sink failure must never stop the engine
            logger.exception("capsteer: closing capture %s failed", self.hooks.capture_id)
            self.sink.abort(self.hooks.capture_id, f"{type(exc).__name__}: {exc}")

    def _close(self, num_output: int | None) -> None:
        hooks, prompt = self.hooks, self.prompt
        fed = hooks.fed_len
        if num_output is not None:  # only the prompt and the output but its last were fed
            fed = min(fed, len(prompt) + max(num_output - 1, 0))
        tokens = list(prompt[:fed]) + [hooks.tokens.get(p, -1) for p in range(len(prompt), fed)]
        self.sink.close(CaptureEnd(hooks.capture_id, tuple(tokens)))

    def abort(self, reason: str) -> None:
        self.sink.abort(self.hooks.capture_id, reason)


def _close_all(endings: list[CaptureEnding]) -> None:
    """Close prompt-only captures whose prompt was fed (each guards its own failure)."""
    for ending in endings:
        ending.close(None)
