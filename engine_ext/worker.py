"""The vLLM worker that carries capsteer's hooks.

Enabled with `worker_cls="capsteer.engine_ext.worker.CapsteerWorker"` (the
in-process engine and `capsteer serve` set it). It extends the platform's own
worker: after the model is loaded (before vLLM compiles it) it installs the hook
op on every site, then runs the start-up canary; each step it registers new
requests, builds the plan, and after the forward hands copied rows to the sink.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np
import torch

from capsteer.capture.publish import IO_MODES
from capsteer.capture.sink import CaptureEnd, CaptureRequest, CaptureSink, MemorySink
from capsteer.engine_ext import stack_room
from capsteer.engine_ext.canary import CanaryFailed, faulty_site, run_canary
from capsteer.engine_ext.harvest import Harvester
from capsteer.engine_ext.lifeline import watch_launcher
from capsteer.engine_ext.payload import PAYLOAD_KEY_ENV, decode_payload, payload_is_trusted
from capsteer.engine_ext.plan import RequestHooks, build_step_plan, shared_site_set
from capsteer.engine_ext.runtime import HookRuntime, StepPlan, hook_point
from capsteer.engine_ext.tap_op import install_runtime
from capsteer.engine_ext.vllm.batch import (
    BatchLayout,
    finished_requests,
    install_pre_forward,
    new_requests,
)
from capsteer.engine_ext.vllm.graphs import (
    GraphSet,
    PlainGraphs,
    install_plain_graphs,
    wrap_forward_calls,
)
from capsteer.engine_ext.vllm.refusals import check_engine_features, check_family_features
from capsteer.engine_ext.vllm.section import capsteer_config, take_runtime_config
from capsteer.engine_ext.vllm.sites import (
    find_sites,
    forward_layers,
    install_tap,
    residual_crosses_split,
    stop_forward_at,
    stop_forward_problem,
)
from capsteer.engine_ext.vllm.topology import is_capture_rank, pipeline_stage
from capsteer.engine_ext.vllm.version import check_vllm_version
from capsteer.engine_ext.vllm.worker_access import (
    checkpoint_dtype,
    device_driven,
    give_step_loops_stack_room,
    max_num_batched_tokens,
    max_num_seqs,
    model_name,
    model_of,
    platform_worker_base,
)
from capsteer.engine_ext.worker_config import WorkerConfig

logger = logging.getLogger("vllm.capsteer")  # under vLLM's configured logger
_OPENED_KEPT = 65536  # capture ids remembered for end reports (front ends report within seconds)


class EngineHooks:
    """Hook state of one worker: runtime buffers, live requests, the sink."""

    def __init__(self, worker: object) -> None:
        check_vllm_version()
        check_engine_features(worker)
        self.worker = worker
        self.config = WorkerConfig.from_section(capsteer_config(worker))
        model = model_of(worker)
        self.stage, self.num_stages = pipeline_stage()
        self.sites = find_sites(model)
        check_family_features(worker, self.sites.family, self.sites.materialized)
        # An extraction job whose deepest hook lies before the last layer stops the
        # forward there (TransformerLens's stop_at_layer): None = every layer runs.
        self.stop_at_layer = self._stop_forward(model, self.config.stop_at_layer)
        if self.stop_at_layer is not None:
            self.sites = find_sites(model, self.stop_at_layer)
        dtype = worker.vllm_config.model_config.dtype
        declared = checkpoint_dtype(worker)
        if declared == torch.float32 and dtype != torch.float32:
            logger.warning("capsteer: the checkpoint is float32 but the engine runs %s (vLLM's "
                           "--dtype auto downcasts float32); captures and steering are %s. "
                           "Pass --dtype float32 to compare with an fp32 reference.",
                           str(dtype).removeprefix("torch."), str(dtype).removeprefix("torch."))
        self.device_driven = device_driven(worker)
        max_tokens = max_num_batched_tokens(worker)
        self.runtime = HookRuntime(
            self.sites.num_layers, self.sites.hidden_size, dtype, worker.device,
            max_tokens=max_tokens,
            max_entries=self.config.max_steering_entries,
            # running plus preempted requests keep their slot until they finish
            max_requests=2 * max_num_seqs(worker),
            staging_rows=max_tokens * 4 if self.config.staging_rows is None
            else self.config.staging_rows,
            device_driven=self.device_driven,
            local_sites=self.sites.local_sites,
        )
        self.model_name = model_name(worker)
        self.capture_rank = is_capture_rank()
        # A server's payload key (payload.PAYLOAD_KEY_ENV); None in the in-process engine
        self.payload_key = os.environ.get(PAYLOAD_KEY_ENV) or None
        self.memory = MemorySink(final_positions=False)  # capsteer.engine finalizes
        # Only the rank that writes captures starts writer processes (each holds its rings,
        # on a GPU page-locked): the other TP ranks of a stage never publish.
        self.writer: CaptureSink | None = _durable_writer(self.config.section) \
            if self.capture_rank else None
        self.sharded = _sharded_sink(self.config.section, self.model_name, self.sites.hidden_size, dtype) \
            if self.capture_rank else None
        self.sinks: dict[str, CaptureSink] = {}  # capture_id -> the sink its request chose
        self.requests: dict[str, RequestHooks] = {}
        self.prompts: dict[str, tuple[int, ...]] = {}
        self.awaiting_end: dict[str, _Ending] = {}  # capture_id -> finished, output length due
        self.end_notices: dict[str, int | None] = {}  # reports that came before the finish
        self.opened: dict[str, None] = {}  # recent capture ids this worker opened (ordered)
        # Requests whose capture closed before they finished and that have no other hooks:
        # a resumed (preempted) one must not open its capture again.
        self.detached: set[str] = set()
        # Live captures whose kept positions all lie in the prompt (see _close_complete_captures).
        self.closable: dict[str, RequestHooks] = {}
        self.early_closes = 0
        self.end_wait_s = self.config.end_wait_s
        self.planned = False
        self.dense_live = False  # device index buffers hold a plan's rows
        self.reuse: tuple | None = None  # see _reuse_key
        self.runtime_plan_kept = StepPlan()
        self.plan_builds = 0
        self.plan_reuses = 0
        self.plan_uniform = 0  # builds that were one shared steering row (no per-row index)
        self.ring_copies = 0  # GPU copies into writer processes' device rings, after merging
        # Host seconds the step thread spent in the hooks' own per-step work (diagnostics:
        # what capture and steering add to a step beyond the forward itself).
        self.host_s = {"before_step": 0.0, "before_forward": 0.0, "after_step": 0.0}
        # The same phases' CPU time of the step thread: host_s - host_cpu_s is time it
        # spent off its CPU in them (waiting for the GIL, blocked in a call).
        self.host_cpu_s = dict.fromkeys(self.host_s, 0.0)
        self.pinned_plan = False  # the canary sets its own plan; real steps must not replace it
        self.plain_graphs: PlainGraphs | None = None  # see install_plain_graphs
        self.num_tokens_gathered = 0
        self.harvester = Harvester(self.runtime.staging.shape[0], self.sites.hidden_size, dtype) \
            if self.device_driven else None
        # Durable rows go from the GPU straight into the writer processes' shared memory:
        # no host copy in this process (whose GIL the step thread needs); else via the
        # harvester's pinned ring and a copy on its thread.
        self.device_rows = bool(self.device_driven and self.writer is not None
                                and self.writer.pin_device_ring())
        # Every call into the writer processes' link then runs on the harvester thread,
        # which sends what a burst queued (a step's writes, its closes) as one message
        # when it runs out of work.
        if self.harvester is not None and self.writer is not None \
                and self.writer.defer_sends():
            self.harvester.on_idle = self.writer.flush_sends
        if self.capture_rank:
            from capsteer.capture import metrics

            metrics.ENGINE_WAITS.set_source(self.capture_wait_seconds)
        skipped = faulty_site()
        # The mid norm's residual (pair tap at offset 1) crossed the split at attention.
        split_residual = residual_crosses_split(worker)
        for site, module, tap in self.sites.taps:
            if site != skipped:
                install_tap(module, tap, site, worker.device,
                                    residual_is_graph_input=split_residual and tap.offset == 1
                                    and tap.read == "pair")
        install_runtime(self.runtime)
        # Diagnostic: torch's sync debug mode "error" over the hook code and the forward of
        # every step with hooks; any host sync there raises (GPU validation uses it).
        self.sync_debug = self.config.sync_debug and self.device_driven
        self.sync_checked_steps = 0
        before = self._no_sync(self._before_forward) if self.sync_debug else self._before_forward
        before = functools.partial(self.timed, "before_forward", before)
        install_pre_forward(worker.model_runner, before, self._wants_layout)
        if self.sync_debug:
            wrap_forward_calls(worker.model_runner, self._no_sync)
        logger.info("capsteer: %s family (%s layout): hooked %d of %d sites (pipeline stage "
                    "%d of %d; %s mode)", self.sites.family.name,
                    "materialized" if self.sites.materialized else "deferred",
                    len(self.sites.local_sites), self.runtime.num_sites, self.stage,
                    self.num_stages, "device" if self.device_driven else "host")

    def install_plain_graphs(self) -> None:
        """A tap-free set of CUDA graphs for steps without hooks (PlainGraphs).

        On by default where a server serves plain traffic beside hooked requests; off
        (`plain_graphs: false`) in extraction jobs, whose every request has hooks, and
        wherever recording every graph twice at start-up is not worth it."""
        if not self.device_driven or not self.config.uses_plain_graphs:
            return
        result = install_plain_graphs(self.worker.model_runner, self.runtime)
        if isinstance(result, str):
            logger.info("capsteer: one set of CUDA graphs (steps without hooks run the taps' "
                        "empty kernels too): %s", result)
            return
        self.plain_graphs = result
        if self.stage == 0:  # one count per engine step, however many stages replay
            from capsteer.capture import metrics

            metrics.GRAPH_REPLAYS.set_source(self.graph_replay_counts)

    def log_plain_graphs(self) -> None:
        graphs = self.plain_graphs
        if graphs is not None and graphs.ready:
            logger.info("capsteer: CUDA graphs recorded twice, with the taps and without (for "
                        "steps without hooks); the set without took %.2f GiB of GPU memory "
                        "beyond vLLM's KV-cache budget (--plain-graphs off records one set)",
                        graphs.plain_bytes / (1 << 30))

    def capture_wait_seconds(self) -> dict[str, float]:
        """Seconds this worker's threads waited for captured rows to move on, by what they
        waited for (capsteer_capture_engine_wait_seconds_total): plain numbers the waits
        add to, read here only when metrics are collected."""
        waits = {"harvest_slot": self.harvester.wait_s} if self.harvester is not None else {}
        return {**waits, **(self.writer.engine_wait_s() if self.writer is not None else {})}

    def graph_replay_counts(self) -> dict[str, int]:
        """Replays per set, for capsteer_graph_replays_total ({}: one set)."""
        graphs = self.plain_graphs
        if graphs is None:
            return {}
        return {"plain": graphs.replays[GraphSet.PLAIN],
                "hooked": graphs.replays[GraphSet.HOOKED]}

    def graph_replays(self) -> dict | None:
        """CUDA-graph replays per set since start-up (None: one set, the hooked graphs)."""
        graphs = self.plain_graphs
        if graphs is None:
            return None
        return {**self.graph_replay_counts(), "ready": graphs.ready,
                "force_hooked": graphs.force_hooked}

    def _stop_forward(self, model, asked: object) -> int | None:
        """Stop the forward after layer `asked` - 1 where the model allows it; the
        outcome is logged either way (the captures are the same, only speed differs)."""
        if asked is None or int(asked) >= self.sites.num_layers:
            return None
        stop = int(asked)
        problem = (f"pipeline parallelism ({self.num_stages} stages)" if self.num_stages > 1
                   else stop_forward_problem(model))
        if problem is not None:
            logger.warning("capsteer: the forward runs all %d layers although only the first "
                           "%d are needed: %s", self.sites.num_layers, stop, problem)
            return None
        stop_forward_at(model, stop)
        logger.info("capsteer: the forward runs layers 0-%d of %d and stops (stop_at_layer=%d): "
                    "no hook of this engine needs a later one", stop - 1, self.sites.num_layers,
                    stop)
        return stop

    def _beyond_stop(self, hooks: RequestHooks) -> str | None:
        """Why a request needs a site the stopped forward never reaches, or None."""
        if self.stop_at_layer is None:
            return None
        last = 2 * self.stop_at_layer
        keys = hooks.capture.keys() if hooks.capture is not None else ()
        beyond = sorted({f"{hook}({layer})" for hook, layer in keys
                         if hook_point(hook, layer)[1] > last}
                        | {f"steering at site {site}" for _, site, _ in hooks.entries
                           if site > last})
        if not beyond:
            return None
        return (f"this engine's forward stops at layer {self.stop_at_layer} (stop_at_layer, "
                f"set for an extraction job); {', '.join(beyond[:4])} lie beyond it")

    def timed(self, phase: str, fn, *args, **kwargs):
        """fn(*args, **kwargs), its wall and the step thread's CPU time added to `phase`."""
        start, cpu_start = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            self.host_s[phase] += time.perf_counter() - start
            self.host_cpu_s[phase] += time.thread_time() - cpu_start

    def _no_sync(self, fn):
        def wrapped(*args, **kwargs):
            if not self.requests:
                return fn(*args, **kwargs)
            torch.cuda.set_sync_debug_mode("error")
            try:
                return fn(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return wrapped

    # ---- step hooks ----
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
                hooks = RequestHooks.from_payload(req_id, payload, len(prompt), self.runtime)
            except Exception as exc:  # a payload must never stop the engine
                self._hooks_refused(req_id, prompt, payload, exc)
                continue
            refusal = self._beyond_stop(hooks)
            if refusal is not None:
                hooks.release(self.runtime)
                logger.error("capsteer: request %s runs without hooks: %s", req_id, refusal)
                if hooks.capture is not None and self.capture_rank:
                    self._open_and_abort(req_id, prompt, hooks, refusal)
                continue
            self.requests[req_id] = hooks
            if hooks.capture is not None and not self.capture_rank:
                hooks.capture = None  # the stream is replicated across TP ranks: rank 0 writes
                hooks.points = {}
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

    def _hooks_refused(self, req_id: str, prompt, payload: Mapping, exc: Exception) -> None:
        """A payload this worker cannot serve runs without hooks, never silently: logged,
        counted in capsteer_steering_refused_total (operators alert on it; a steered
        response that was not steered looks like any other), and its capture, if any,
        ends with an error receipt."""
        logger.error("capsteer: request %s has a hook payload this worker cannot serve; it "
                     "runs without hooks: %s", req_id, exc, exc_info=exc)
        if self.capture_rank and payload.get("steering"):
            from capsteer.capture import metrics

            metrics.STEERING_REFUSED.inc()
        self._refuse_capture(req_id, prompt, payload, f"capsteer: {exc}")

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
            keys=hooks.local_keys if self.num_stages > 1 else None, dir_time=hooks.dir_time)

    def _sink_for(self, hooks: RequestHooks) -> CaptureSink:
        if hooks.sink == "sharded" and self.sharded is not None:
            return self.sharded
        if hooks.sink in ("durable", "sharded") and self.writer is not None:
            return self.writer
        return self.memory

    def _wants_layout(self) -> bool:
        """Whether this step calls `_before_forward`: a request with hooks is live, or an
        earlier hooked step left device index rows, a reuse key or a plan to clear. Steps
        of plain traffic skip it, the batch layout's copies included (every decode step of
        a server without fields)."""
        return bool(self.requests) or self.dense_live or self.reuse is not None \
            or self.planned

    def _before_forward(self, layout: BatchLayout) -> None:
        if self.pinned_plan:
            return
        if not self.requests:
            if self.dense_live:  # a kept plan must not steer rows of later requests
                self.runtime.reset_dense()
                self.dense_live = False
            self.reuse = None
            self.planned = False
            return
        if self._same_steady_batch(layout):
            # Steady decode of steering-only requests: the plan (and, on the device, the
            # per-token index already uploaded) is the last step's, unchanged.
            self.plan_reuses += 1
            if not self.device_driven:
                self.runtime.set_plan(self.runtime_plan_kept, layout.num_tokens_padded)
            self.num_tokens_gathered = 0
            self.planned = True
            return
        plan = build_step_plan(layout.req_ids, layout.query_start_loc, layout.start_positions,
                               self.requests, layout.input_ids_host,
                               host_steering=not self.device_driven,
                               uniform_slots=self.runtime.uniform_slots)
        if self.device_driven and plan.staging_rows > self.runtime.trash_row:
            plan = self._shed_captures(plan, layout)
        self.runtime.set_plan(plan, layout.num_tokens_padded)
        self.plan_builds += 1
        self.plan_uniform += bool(plan.uniform_slot)
        self.dense_live = self.device_driven
        self.num_tokens_gathered = 0
        if plan.token_rows is not None and layout.input_ids is not None:
            self.num_tokens_gathered = self.runtime.gather_tokens(layout.input_ids)
        self.reuse = self._reuse_key(plan, layout)
        self.runtime_plan_kept = plan
        self.planned = True

    def _reuse_key(self, plan: StepPlan, layout: BatchLayout) -> tuple | None:
        """What a later step must match to reuse `plan`, or None when it may not be reused.

        Reusable: no capture anywhere in the batch (captured rows and tokens change every
        step) and every hooked row already generated (a prompt row's position class can
        change on the next step). With the same requests in the same rows, the next
        step's rows are then in the same class with the same slots and entries. A uniform
        plan (every request steered through one shared row, whatever the class) holds for
        the same requests in the same rows: steady decode of a uniformly steered batch
        checks the batch instead of rebuilding (~25 us a step alone, more in the engine)."""
        if not plan.uniform_slot:
            if plan.routes or plan.batch_hooks is None or not plan.all_generated:
                return None
            if any(self.requests[r].capture is not None for r in layout.req_ids
                   if r in self.requests):
                return None
        return (list(layout.req_ids), layout.query_start_loc.copy(), layout.num_tokens_padded)

    def _same_steady_batch(self, layout: BatchLayout) -> bool:
        key = self.reuse
        return (key is not None and layout.num_tokens_padded == key[2]
                and np.array_equal(layout.query_start_loc, key[1])
                and layout.req_ids == key[0])

    def _shed_captures(self, plan: StepPlan, layout: BatchLayout) -> StepPlan:
        """A step whose captured rows exceed the staging buffer: fail the largest captures
        (error receipt naming the limit) until it fits; the engine keeps serving."""
        need: dict[str, int] = {}
        for route in plan.routes:
            need[route.capture_id] = need.get(route.capture_id, 0) + len(route.positions)
        by_id = {h.capture_id: h for h in self.requests.values() if h.capture is not None}
        total = plan.staging_rows
        for capture_id, rows in sorted(need.items(), key=lambda kv: -kv[1]):
            if total <= self.runtime.trash_row:
                break
            hooks = by_id[capture_id]
            reason = (f"a step needed {plan.staging_rows} capture rows (this request "
                      f"{rows}), more than the staging buffer's {self.runtime.trash_row}; "
                      "capture fewer hooks/layers, lower --max-num-batched-tokens or raise "
                      "--capture-staging-rows (worker config staging_rows)")
            logger.error("capsteer: capture %s failed: %s", capture_id, reason)
            sink = self.sinks.pop(capture_id)
            if self.harvester is not None:
                self.harvester.submit_call(lambda s=sink, c=capture_id, r=reason: s.abort(c, r))
            self.prompts.pop(hooks.req_id, None)
            hooks.capture = None
            hooks.points = {}
            total -= rows
        return build_step_plan(layout.req_ids, layout.query_start_loc, layout.start_positions,
                               self.requests, layout.input_ids_host,
                               host_steering=not self.device_driven)

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
        sinks = {r.capture_id: self.sinks[r.capture_id] for r in plan.routes}
        if not self.device_driven:
            captured = self.runtime.take_captured()
            self._deliver(plan, sinks, lambda r: captured[r.point][
                r.offset: r.offset + len(r.positions)])
            self.runtime.set_plan(StepPlan(), 0)
            self._close_complete_captures()
            return
        if not plan.routes:  # steering only: the index stays valid for a reused plan
            self._close_complete_captures()
            return
        self.runtime.reset_dense()
        self.dense_live = False
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
            self._deliver(staged, sinks, lambda r: rows[packed[id(r)]])

        self.harvester.submit_copy(self.runtime.staging, spans, self.runtime.token_stage,
                                   self.num_tokens_gathered, deliver)
        self._close_complete_captures()

    def _copy_to_sinks(self, plan: StepPlan, sinks: dict[str, CaptureSink]):
        """Enqueue each route's rows GPU -> its sink's page-locked shared memory (on the
        current stream, after the forward; the harvester's event covers them). Returns
        the routes copied that way and a plan of the rest (no space, other sinks), which
        go through the harvester's pinned ring."""
        direct, rest, copies = [], [], []
        staging = self.runtime.staging
        hidden = tuple(staging.shape[1:])
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
                [r.capture_id for r in run], [(len(r.positions), *hidden) for r in run],
                staging.dtype)
            if got is not None:  # one GPU copy for the whole run
                dst, parts = got
                first = _staging_span(plan, run[0]).start
                copies.append((parts[0].writer, dst, staging[first:first + dst.shape[0]]))
                direct.extend((route, sink, part) for route, part in zip(run, parts, strict=True))
                continue
            for route in run:  # no spans, or a ring too full for one: write by write
                _reserve_one(route, sink, staging[_staging_span(plan, route)], copies, direct,
                             rest)
        merged = merge_row_copies(copies)
        for dst, src in merged:
            dst.copy_(src, non_blocking=True)
        self.ring_copies += len(merged)
        return direct, (plan if len(rest) == len(plan.routes) else replace(plan, routes=rest))

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
                endings.append(_Ending(replace(hooks), prompt, sink, 0.0))
                self.early_closes += 1
            hooks.capture = None
            hooks.points = {}
            hooks.sites = shared_site_set(frozenset(site for _, site, _ in hooks.entries))
            if not hooks.entries:  # nothing left to do for it: a plain request from now on
                del self.requests[hooks.req_id]
                hooks.release(self.runtime)
                self.detached.add(hooks.req_id)
        if endings:  # one call for the step's closes (each guarded on its own)
            self._run_on_sink_thread(lambda es=endings: _close_all(es))

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

    def _finish(self, req_id: str) -> None:
        self.detached.discard(req_id)
        self.closable.pop(req_id, None)
        hooks = self.requests.pop(req_id, None)
        if hooks is None:
            return
        hooks.release(self.runtime)
        if hooks.capture is None:
            return
        prompt = self.prompts.pop(req_id, ())
        sink = self.sinks.pop(hooks.capture_id, None)
        if sink is None:
            return
        ending = _Ending(hooks, prompt, sink, time.monotonic() + self.end_wait_s)
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

    def _settle(self, ending: _Ending, num_output: int | None) -> None:
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


@dataclass
class _Ending:
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


def _close_all(endings: list[_Ending]) -> None:
    """Close prompt-only captures whose prompt was fed (each guards its own failure)."""
    for ending in endings:
        ending.close(None)


def _durable_writer(config: dict) -> CaptureSink | None:
    """The durable writer pool when a capture root is configured."""
    root = config.get("capture_dir")
    if not root:
        return None
    io = str(config.get("capture_io", "buffered"))
    if io not in IO_MODES:
        raise ValueError(f"capture_io must be one of {', '.join(IO_MODES)}; got {io!r}")
    from capsteer.capture.pool import (
        DEFAULT_BUDGET_BYTES,
        DEFAULT_RING_BYTES,
        check_processes,
        check_ring_bytes,
    )

    kwargs = {"budget_bytes": int(config.get("capture_budget", DEFAULT_BUDGET_BYTES)),
              "policy": str(config.get("capture_overload", "block")),
              "workers": int(config["capture_workers"]) if "capture_workers" in config else None,
              "digest": str(config.get("capture_digest", "sha256")),
              "direct_io": io == "direct"}
    mode = str(config.get("capture_writer", "process"))
    if mode == "process":  # publishing must not hold this process's GIL (writer_process.py)
        from capsteer.capture.writer_pool import ProcessWriterPool, auto_processes
        from capsteer.capture.writer_process import ProcessCaptureWriter
        from capsteer.config.sizes import parse_size

        processes = config.get("capture_writer_processes")
        processes = auto_processes(kwargs["policy"]) if processes is None else int(processes)
        check_processes(processes, kwargs["policy"])  # 0, or a split budget under drop/reject
        # The shared-memory ring each writer process takes rows through (and the engine's
        # GPU copies land in): how large a burst leaves the engine before it waits on the
        # children (server flag --capture-ring).
        kwargs["ring_bytes"] = parse_size(config.get("capture_ring_bytes", DEFAULT_RING_BYTES))
        check_ring_bytes(kwargs["ring_bytes"], "capture_ring_bytes")
        if processes > 1:  # one child's main thread bounds it below a disk's rate
            return ProcessWriterPool(root, processes=processes, **kwargs)
        return ProcessCaptureWriter(root, **kwargs)
    if mode != "threads":
        raise ValueError(f"capture_writer must be process or threads; got {mode!r}")
    from capsteer.capture.writer import CaptureWriter

    return CaptureWriter(root, **kwargs)


def _sharded_sink(config: dict, model: str, hidden: int, model_dtype: torch.dtype):
    """An extraction job's shard writer (many requests per file) when configured."""
    job = config.get("sharded")
    if not job:
        return None
    from capsteer.capture.sharded import ShardedSink, ShardedWriter
    from capsteer.capture.spec import CaptureSpec

    spec = CaptureSpec.from_dict(job["spec"])
    dtype = model_dtype if spec.dtype == "auto" else getattr(torch, spec.dtype)
    writer = ShardedWriter(job["dir"], keys=spec.keys(), hidden_size=hidden, dtype=dtype,
                           shard_bytes=int(job.get("shard_bytes", 1 << 30)), model=model,
                           spec=spec, job_id=job.get("job_id"),
                           digest=str(job.get("digest", "sha256")))
    return ShardedSink(writer)


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
                    and src.is_contiguous() and last_src.is_contiguous()
                    and dst.data_ptr() == last_dst.data_ptr() + last_dst.nbytes
                    and src.data_ptr() == last_src.data_ptr() + last_src.nbytes):
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


def staged_row_spans(plan: StepPlan, routes) -> tuple[list[tuple[int, int]], dict[int, slice]]:
    """The staging rows of `routes` (those the harvester carries) as merged [start, stop)
    spans, and where each route's rows land once the spans are packed back to back in the
    harvester's slot (keyed by id(route)). Routes that share or touch rows share a span;
    more than MAX_SLOT_COPIES spans become one."""
    spans: list[list[int]] = []
    placed: list[tuple[int, slice, int]] = []  # (id, staging span, index of its merged span)
    for span, rid in sorted(((_staging_span(plan, r), id(r)) for r in routes),
                            key=lambda pair: pair[0].start):
        if spans and span.start <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], span.stop)
        else:
            spans.append([span.start, span.stop])
        placed.append((rid, span, len(spans) - 1))
    if len(spans) > MAX_SLOT_COPIES:  # one copy over the gaps beats a launch per span
        spans = [[spans[0][0], spans[-1][1]]]
        placed = [(rid, span, 0) for rid, span, _ in placed]
    packed_at, total = [], 0
    for begin, end in spans:
        packed_at.append(total - begin)  # slot row = staging row + this shift
        total += end - begin
    where = {rid: slice(span.start + packed_at[i], span.stop + packed_at[i])
             for rid, span, i in placed}
    return [(b, e) for b, e in spans], where


def _staging_span(plan: StepPlan, route) -> slice:
    """A route's rows in the step's staging buffer (and in the harvester's copy of it)."""
    start = plan.staging_offset[route.point] + route.offset
    return slice(start, start + len(route.positions))


class CapsteerWorker(platform_worker_base()):  # type: ignore[misc]
    """The platform worker plus capsteer hooks (see module docstring)."""

    capsteer: EngineHooks

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # Before the model first runs, which is when vLLM keys its compile cache.
        config = WorkerConfig.from_section(take_runtime_config(self))
        watch_launcher()  # an orphaned engine exits instead of holding the GPU for nobody
        if config.stack_room:  # before this process's step loop starts
            loops = give_step_loops_stack_room()
            logger.info("capsteer: step loop%s with %d KiB of frame stack room: %s",
                        "s" if len(loops) != 1 else "", stack_room.ROOM_WORDS * 8 // 1024,
                        ", ".join(loops) or "none here (no vLLM step loop in this process)")

    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        started = time.perf_counter()
        self.capsteer = EngineHooks(self)
        logger.info("capsteer: hooks installed in %.3f s", time.perf_counter() - started)

    def compile_or_warm_up_model(self, *args, **kwargs):
        self.capsteer.install_plain_graphs()  # before vLLM records its CUDA graphs
        self.capsteer.runtime.warm_kernels()  # before vLLM's warm-up and its JIT monitor
        out = super().compile_or_warm_up_model(*args, **kwargs)
        self.capsteer.log_plain_graphs()
        started = time.perf_counter()
        try:
            run_canary(self.capsteer)
        except CanaryFailed as exc:
            if self.capsteer.config.canary == "warn":  # diagnostics only, never serving
                logger.error("capsteer start-up canary failed (canary=warn): %s", exc)
                return out
            raise CanaryFailed(f"capsteer start-up canary failed, refusing to start: {exc}") from None
        logger.info("capsteer: start-up canary passed in %.3f s", time.perf_counter() - started)
        return out

    def execute_model(self, scheduler_output, *args, **kwargs):
        hooks = self.capsteer
        hooks.timed("before_step", hooks.before_step, scheduler_output)
        out = super().execute_model(scheduler_output, *args, **kwargs)
        hooks.timed("after_step", hooks.after_step)
        return out

    # ---- collective_rpc surface ----
    def capsteer_take_captures(self, capture_ids: list[str]) -> dict:
        """Finished in-memory captures (the in-process engine polls this)."""
        return {cid: cap.to_wire() for cid, cap in self.capsteer.memory.take(capture_ids).items()}

    def capsteer_end_captures(self, ends: list) -> list[str]:
        """Output lengths from the front end (server, in-process engine); None = aborted.
        Answers which of the ids this worker opened a capture for."""
        return self.capsteer.end_captures(
            [(str(c), None if n is None else int(n)) for c, n in ends])

    def capsteer_metrics(self) -> dict:
        """This process's capture metrics (the server merges every worker's into /metrics)."""
        from capsteer.capture import metrics

        self.capsteer.sweep_endings(time.monotonic())
        own = metrics.snapshot()
        writer = self.capsteer.writer
        child = writer.metrics_snapshot() if writer is not None else None
        return own if child is None else metrics.merge_snapshots([own, child])

    def capsteer_writer_stats(self) -> dict | None:
        writer = self.capsteer.writer
        return writer.stats() if writer is not None else None

    def capsteer_flush_sharded(self) -> int:
        """Publish the partly filled shard (end of job, Ctrl-C); returns indexed requests."""
        sharded = self.capsteer.sharded
        if sharded is None:
            return 0
        if self.capsteer.harvester is not None:
            self.capsteer.harvester.drain()  # every delivered row is in the sink first
        sharded.writer.flush()
        return len(sharded.writer.done_ids)

    def capsteer_plain_graphs(self, on: bool) -> bool | None:
        """Benches: let plain steps replay the plain CUDA graphs (on, the default) or hold
        every step on the hooked ones, as before plain graphs existed (off). None where
        this engine recorded one set."""
        graphs = self.capsteer.plain_graphs
        if graphs is None:
            return None
        graphs.force_hooked = not on
        return on

    def capsteer_stats(self) -> dict:
        """Diagnostics: steps checked under sync debug mode, harvester errors, live requests."""
        hooks = self.capsteer
        return {"sync_checked_steps": hooks.sync_checked_steps,
                "harvest_errors": [repr(e) for e in (hooks.harvester.errors if hooks.harvester else [])],
                "live_requests": len(hooks.requests), "mode": "device" if hooks.device_driven else "host",
                "plan_builds": hooks.plan_builds, "plan_reuses": hooks.plan_reuses,
                "plan_uniform": hooks.plan_uniform, "ring_copies": hooks.ring_copies,
                "early_closes": hooks.early_closes, "stop_at_layer": hooks.stop_at_layer,
                "forward_layers": forward_layers(model_of(self)),
                "host_s": {k: round(v, 6) for k, v in hooks.host_s.items()},
                "host_cpu_s": {k: round(v, 6) for k, v in hooks.host_cpu_s.items()},
                "harvest": hooks.harvester.stats() if hooks.harvester else None,
                "graph_replays": hooks.graph_replays(),
                "engine_wait_s": {k: round(v, 6) for k, v in hooks.capture_wait_seconds().items()},
                "stack_room": stack_room.loops_with_room()}

