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

import torch

from capsteer.capture import metrics
from capsteer.capture.sink import CaptureSink, MemorySink
from capsteer.capture.writer.factory import durable_writer, sharded_sink
from capsteer.engine_ext import stack_room
from capsteer.engine_ext.canary import CanaryFailed, faulty_site, run_canary
from capsteer.engine_ext.delivery import Delivery
from capsteer.engine_ext.families import site_layers
from capsteer.engine_ext.harvest import Harvester
from capsteer.engine_ext.lifeline import watch_launcher
from capsteer.engine_ext.payload import PAYLOAD_KEY_ENV
from capsteer.engine_ext.plan import RequestHooks
from capsteer.engine_ext.readouts import ReadoutSink
from capsteer.engine_ext.request_book import CaptureEnding, RequestBook
from capsteer.engine_ext.runtime import HookRuntime, StepPlan, hook_point
from capsteer.engine_ext.selections import column_shards
from capsteer.engine_ext.step_feed import StepFeed
from capsteer.engine_ext.tap_op import install_runtime
from capsteer.engine_ext.vllm.batch import (
    install_pre_forward,
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
from capsteer.engine_ext.vllm.topology import (
    gather_columns,
    is_capture_rank,
    pipeline_stage,
    tensor_parallel_rank,
)
from capsteer.engine_ext.vllm.version import check_vllm_version
from capsteer.engine_ext.vllm.worker_access import (
    checkpoint_dtype,
    device_driven,
    give_step_loops_stack_room,
    max_num_batched_tokens,
    max_num_seqs,
    model_dtype,
    model_name,
    model_of,
    platform_worker_base,
)
from capsteer.engine_ext.worker_config import WorkerConfig
from capsteer.steering.registry import VectorReader

logger = logging.getLogger("vllm.capsteer")  # under vLLM's configured logger


class EngineHooks(RequestBook, StepFeed, Delivery):
    """Hook state of one worker: runtime buffers, live requests, the sinks. Its step work
    is split by concern: request bookkeeping (RequestBook), the plan fed before each
    forward (StepFeed) and the captured rows handed on after it (Delivery)."""

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
        dtype = model_dtype(worker)
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
            hook_widths=dict(self.sites.hook_widths),
            patch_rows=self.config.patch_rows,
        )
        rank, size = tensor_parallel_rank()
        if size > 1 and not self.device_driven:  # mlp_post's and attn_z's columns are split
            self.runtime.split_columns(
                column_shards({h: w for h, w in self.sites.hook_widths
                               if h not in dict(self.sites.unavailable)},
                              self.sites.num_layers, rank, size),
                gather_columns)
        self.model_name = model_name(worker)
        # The server's registry, for the vectors its requests name (None: all inline)
        self.vectors = None if self.config.steering_dir is None else VectorReader(
            self.config.steering_dir, hidden_size=self.sites.hidden_size,
            num_layers=self.sites.num_layers, hook_widths=dict(self.sites.hook_widths))
        self.capture_rank = is_capture_rank()
        # A server's payload key (payload.PAYLOAD_KEY_ENV); None in the in-process engine
        self.payload_key = os.environ.get(PAYLOAD_KEY_ENV) or None
        self.memory = MemorySink(final_positions=False)  # capsteer.engine finalizes
        # Only the rank that writes captures starts writer processes (each holds its rings,
        # on a GPU page-locked): the other TP ranks of a stage never publish.
        self.writer: CaptureSink | None = durable_writer(self.config.section) \
            if self.capture_rank else None
        self.sharded = sharded_sink(self.config.section, self.model_name,
                                    self.sites.hidden_size, dtype, dict(self.sites.hook_widths)) \
            if self.capture_rank else None
        # Readouts' rows go to their readers, the scores to the server (engine_ext.readouts).
        self.readouts = ReadoutSink(self.config.readout_dir, self.config.readers_dir,
                                    self.sites.hidden_size, worker.device,
                                    dict(self.sites.hook_widths))
        self.sinks: dict[str, CaptureSink] = {}  # capture_id -> the sink its request chose
        self.requests: dict[str, RequestHooks] = {}
        self.prompts: dict[str, tuple[int, ...]] = {}
        self.awaiting_end: dict[str, CaptureEnding] = {}  # capture_id -> finished, output length due
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
        self.harvester = Harvester(self.runtime.staging.shape[0], self.runtime.width, dtype) \
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
        stop, n = self.stop_at_layer, self.sites.num_layers
        keys = hooks.capture.keys() if hooks.capture is not None else ()
        beyond = sorted({f"{hook}({layer})" for hook, layer in keys
                         if site_layers(hook_point(hook, layer, n)[1], n) > stop}
                        | {f"steering at site {site}" for _, site, _ in hooks.entries
                           if site_layers(site, n) > stop})
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
        self.capsteer.sweep_endings(time.monotonic())
        own = metrics.snapshot()
        writer = self.capsteer.writer
        child = writer.metrics_snapshot() if writer is not None else None
        return own if child is None else metrics.merge_snapshots([own, child])

    def capsteer_unwritten_receipts(self, capture_ids: list[str]) -> dict[str, dict]:
        """Final receipts of these captures whose manifest the disk refused (the server's
        tracker asks for captures pending too long)."""
        writer = self.capsteer.writer
        if writer is None:
            return {}
        return {c: r.to_dict() for c, r in writer.unwritten_receipts(capture_ids).items()}

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

