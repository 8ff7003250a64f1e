"""Captured rows after each step: copied from the GPU straight into writer processes'
rings where a sink offers them, else through the harvester's pinned ring, and handed to
each capture's sink in order."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import numpy as np
import torch

from capsteer.capture.sink import CaptureSink
from capsteer.engine_ext.route_arrays import route_starts
from capsteer.engine_ext.runtime import StepPlan


class Delivery:
    """EngineHooks' after-step delivery (a mixin: the state lives on EngineHooks)."""

    def after_step(self) -> None:
        if not self.planned:
            return
        if self.sync_debug:
            self.sync_checked_steps += 1
            self._no_sync(self._after_step)()
        else:
            self._after_step()

    def _after_step(self) -> None:
        self.planned = False
        plan = self.runtime.plan
        if not self.device_driven:
            captured = self.runtime.take_captured()
            if self.capture_rank:  # other TP ranks copy rows only to gather them (request_book)
                sinks = {r.capture_id: self.sinks[r.capture_id] for r in plan.routes}
                self._deliver(plan, sinks, lambda r: captured[r.point][
                    r.offset: r.offset + len(r.positions)])
            self.runtime.set_plan(StepPlan(), 0)
            self._close_complete_captures()
            return
        sinks = {r.capture_id: self.sinks[r.capture_id] for r in plan.routes}
        if not plan.routes:  # steering only: the index stays valid for a reused plan
            self._close_complete_captures()
            return
        self.runtime.reset_dense()
        self.dense_live = False
        if self.readouts.live:
            plan = self._launch_readouts(plan, sinks)
            if not plan.routes and not plan.token_owners:
                self._close_complete_captures()
                return
        owners = [(self.requests[rid], pos) for rid, pos in plan.token_owners]
        direct, staged = self._copy_to_sinks(plan, sinks) if self.device_rows else ([], plan)
        spans, packed = staged_row_spans(plan, staged.routes)  # the harvester's share

        def deliver(rows: torch.Tensor, tokens: torch.Tensor) -> None:
            start = 0
            for hooks, positions in owners:
                for p, t in zip(positions.tolist(), tokens[start: start + len(positions)].tolist(),
                                strict=True):
                    hooks.tokens[p] = t
                start += len(positions)
            for route, sink, reserved in direct:
                last = len(route.keys) - 1  # only the last key's write frees the ring space
                for i, (hook, layer) in enumerate(route.keys):
                    sink.write_reserved(reserved, route.capture_id, hook, layer, route.positions,
                                        frees=i == last)
            widths = self.runtime.site_widths
            self._deliver(staged, sinks, lambda r: rows[packed[id(r)], :widths[r.point[1]]])

        # Only the columns the routes use cross the bus (the hidden size unless a wider
        # hook, mlp_post, is captured this step).
        cols = max((self.runtime.site_widths[r.point[1]] for r in staged.routes), default=1)
        self.harvester.submit_copy(self.runtime.staging[:, :cols], spans,
                                   self.runtime.token_stage, self.num_tokens_gathered, deliver)
        self._close_complete_captures()

    def _launch_readouts(self, plan: StepPlan, sinks: dict[str, CaptureSink]) -> StepPlan:
        """Readout routes are read on the GPU where the forward left them; only their
        scores cross the bus (engine_ext.readouts). Returns the plan of the other routes."""
        mine = [r for r in plan.routes if sinks[r.capture_id] is self.readouts]
        if not mine:
            return plan
        self.harvester.submit_call(self.readouts.launch(
            [(r, _staging_span(plan, r)) for r in mine], self.runtime.staging,
            self.runtime.site_widths))
        return replace(plan, routes=[r for r in plan.routes
                                     if sinks[r.capture_id] is not self.readouts])

    def _copy_to_sinks(self, plan: StepPlan, sinks: dict[str, CaptureSink]):
        """Enqueue each route's rows GPU -> its sink's page-locked shared memory (on the
        current stream, after the forward; the harvester's event covers them). Returns
        the routes copied that way and a plan of the rest (no space, other sinks), which
        go through the harvester's pinned ring."""
        direct, rest, copies = [], [], []
        staging = self.runtime.staging
        widths = self.runtime.site_widths  # staging is as wide as the widest hook
        # Point by point (stable: writer groups, then batch order, within a point): a
        # writer's rows of one point are one span of staging, and reserving them together
        # makes them one span of its ring. Routes come request by request (a request's
        # points together), which would interleave the points. A run is [key, staging end,
        # routes]: consecutive routes of one sink, child and point (key None: a sink
        # without spans, one route a run).
        runs: list[list] = []
        for route in sorted(plan.routes, key=lambda r: r.point):
            sink = sinks[route.capture_id]
            span = _staging_span(plan, route)
            key = None if not sink.supports_spans else (
                route.point, id(sink), sink.group_of(route.capture_id))
            if key is not None and runs and runs[-1][0] == key and runs[-1][1] == span.start:
                runs[-1][1] = span.stop
                runs[-1][2].append(route)
            else:
                runs.append([key, span.stop, [route]])
        for key, _, run in runs:
            sink = sinks[run[0].capture_id]
            got = None if key is None else sink.reserve_span(
                [r.capture_id for r in run], [(len(r.positions), widths[r.point[1]])
                                              for r in run],
                staging.dtype)
            if got is not None:  # one GPU copy for the whole run
                dst, parts = got
                first = _staging_span(plan, run[0]).start
                copies.append((parts[0].writer, dst, staging[first:first + dst.shape[0],
                                                             :widths[run[0].point[1]]]))
                direct.extend((route, sink, part) for route, part in zip(run, parts, strict=True))
                continue
            for route in run:  # no spans, or a ring too full for one: write by write
                _reserve_one(route, sink, staging[_staging_span(plan, route),
                                                  :widths[route.point[1]]], copies, direct, rest)
        merged = merge_row_copies(copies)
        for dst, src in merged:
            dst.copy_(src, non_blocking=True)
        self.ring_copies += len(merged)
        return direct, (plan if len(rest) == len(plan.routes) else replace(plan, routes=rest))

    @staticmethod
    def _deliver(plan: StepPlan, sinks: dict[str, CaptureSink], rows_for) -> None:
        """Hand each route's rows (views of a buffer reused next step) to its sink: a copy
        of its own unless the sink copies them itself before `write` returns; a sink that
        batches a step's writes is told when the step's rows are all handed over."""
        for route in plan.routes:
            rows = rows_for(route)
            sink = sinks[route.capture_id]
            if not sink.copies_rows:
                rows = rows.clone()
            for hook, layer in route.keys:
                sink.write(route.capture_id, hook, layer, route.positions, rows)
        for sink in {id(s): s for s in sinks.values()}.values():
            sink.end_step()


def _next_rows(last: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether `src`'s rows continue `last`'s in one buffer, row stride alike (a narrower
    hook's rows are a column slice of the staging buffer: rows strided, columns not)."""
    return (src.dim() == last.dim() == 2 and src.stride() == last.stride()
            and src.stride(1) == 1
            and src.data_ptr() == last.data_ptr() + last.shape[0] * last.stride(0)
            * last.element_size())


def merge_row_copies(copies: list[tuple[object, torch.Tensor, torch.Tensor]]
                     ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(owner, dst, src) row copies, in order, as fewer (dst, src) copies: a copy whose
    destination and source both continue the previous one's (same owner, the next bytes of
    each) joins it. A writer's reservations of a step follow each other in its ring and the
    plan lays its rows out together, so a step needs about one GPU copy per writer process
    and captured point instead of one per request (each copy ~30 us of host time)."""
    merged: list[tuple[object, torch.Tensor, torch.Tensor]] = []
    for owner, dst, src in copies:
        if merged:
            last_owner, last_dst, last_src = merged[-1]
            if (owner is last_owner and dst.dtype == last_dst.dtype == src.dtype
                    and dst.untyped_storage().data_ptr() == last_dst.untyped_storage().data_ptr()
                    and src.untyped_storage().data_ptr() == last_src.untyped_storage().data_ptr()
                    and dst.shape[1:] == last_dst.shape[1:] == src.shape[1:]
                    and dst.is_contiguous() and last_dst.is_contiguous()
                    and _next_rows(last_src, src)
                    and dst.data_ptr() == last_dst.data_ptr() + last_dst.nbytes):
                rows = last_dst.shape[0] + dst.shape[0]
                merged[-1] = (owner,
                              last_dst.as_strided((rows, *dst.shape[1:]), last_dst.stride()),
                              last_src.as_strided((rows, *src.shape[1:]), last_src.stride()))
                continue
        merged.append((owner, dst, src))
    return [(dst, src) for _, dst, src in merged]


def _reserve_one(route, sink: CaptureSink, src: torch.Tensor, copies: list, direct: list,
                 rest: list) -> None:
    """One route's ring space on its own (a sink without spans, or a span that did not
    fit): its copy joins `copies`, or the route joins `rest` (the harvester's path)."""
    reserved = sink.reserve_rows(route.capture_id, tuple(src.shape), src.dtype)
    if reserved is None:
        rest.append(route)
        return
    copies.append((reserved.writer, reserved.rows, src))
    direct.append((route, sink, reserved))


# Copies the step thread enqueues into a harvest slot, at most (each is a launch of a
# few µs on that thread): past it, the staged routes' rows go as one copy of the staging
# range around them, gaps included.
MAX_SLOT_COPIES = 256


def staged_row_spans(plan: StepPlan, routes) -> tuple[list[tuple[int, int]], Mapping[int, slice]]:
    """The staging rows of `routes` (those the harvester carries) as merged [start, stop)
    spans, and where each route's rows land once the spans are packed back to back in the
    harvester's slot (keyed by id(route)). Routes that share or touch rows share a span;
    more than MAX_SLOT_COPIES spans become one. Whole arrays (hundreds of routes a decode
    step); the per-route slices are made where they are read, on the harvester's thread."""
    if not routes:
        return [], {}
    starts, lens = route_starts(routes, plan.staging_offset)
    order = np.argsort(starts, kind="stable")
    begin, end = starts[order], starts[order] + lens[order]
    # A route opens a span unless it starts at or before the end of every route before it.
    opens = np.empty(len(begin), bool)
    opens[0] = True
    np.greater(begin[1:], np.maximum.accumulate(end)[:-1], out=opens[1:])
    first = np.flatnonzero(opens)
    span_begin, span_end = begin[first], np.maximum.reduceat(end, first)
    if len(first) > MAX_SLOT_COPIES:  # one copy over the gaps beats a launch per span
        span_begin, span_end = span_begin[:1], span_end[-1:]
        opens[1:] = False
    shift = np.cumsum(span_end - span_begin) - span_end  # slot row = staging row + shift
    routed = shift[np.cumsum(opens) - 1]
    ids = [id(routes[i]) for i in order.tolist()]
    return (list(zip(span_begin.tolist(), span_end.tolist(), strict=True)),
            _PackedRows(ids, (begin + routed).tolist(), (end + routed).tolist()))


class _PackedRows(Mapping[int, slice]):
    """id(route) -> its rows in the harvester's packed slot, built on first use."""

    def __init__(self, ids: list[int], starts: list[int], stops: list[int]) -> None:
        self._parts: tuple | None = (ids, starts, stops)
        self._where: dict[int, slice] = {}

    def _built(self) -> dict[int, slice]:
        if self._parts is not None:
            ids, starts, stops = self._parts
            self._where = {rid: slice(b, e) for rid, b, e in zip(ids, starts, stops, strict=True)}
            self._parts = None
        return self._where

    def __getitem__(self, rid: int) -> slice:
        return self._built()[rid]

    def __iter__(self):
        return iter(self._built())

    def __len__(self) -> int:
        return len(self._built())


def _staging_span(plan: StepPlan, route) -> slice:
    """A route's rows in the step's staging buffer (and in the harvester's copy of it)."""
    start = plan.staging_offset[route.point] + route.offset
    return slice(start, start + len(route.positions))
