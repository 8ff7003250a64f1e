"""The vLLM worker that carries capsteer's hooks.

Enabled with `worker_cls="capsteer.engine_ext.worker.CapsteerWorker"` (the
in-process engine and `capsteer serve` set it). It extends the platform's own
worker: after the model is loaded (before vLLM compiles it) it installs the hook
op on every site, then runs the start-up canary; each step it registers new
requests, builds the plan, and after the forward hands copied rows to the sink.
"""

from __future__ import annotations

import logging
import time

from capsteer.capture.sink import CaptureEnd, CaptureRequest, CaptureSink, MemorySink
from capsteer.engine_ext import adapter
from capsteer.engine_ext.plan import CaptureRoute, RequestHooks, build_step_plan
from capsteer.engine_ext.runtime import HookRuntime, StepPlan, install_runtime

logger = logging.getLogger("capsteer.engine_ext")


class EngineHooks:
    """Hook state of one worker: runtime buffers, live requests, the sink."""

    def __init__(self, worker: object) -> None:
        adapter.check_vllm_version()
        self.worker = worker
        self.config = adapter.capsteer_config(worker)
        model = adapter.model_of(worker)
        self.sites = adapter.find_sites(model)
        dtype = worker.vllm_config.model_config.dtype
        self.device_driven = adapter.uses_cuda_graphs(worker)
        max_tokens = adapter.max_num_batched_tokens(worker)
        self.runtime = HookRuntime(
            self.sites.num_layers, self.sites.hidden_size, dtype, worker.device,
            max_tokens=max_tokens,
            max_entries=int(self.config.get("max_steering_entries", 1024)),
            staging_rows=int(self.config.get("staging_rows", max_tokens * 4)),
            device_driven=self.device_driven,
        )
        self.model_name = adapter.model_name(worker)
        self.sink: CaptureSink = MemorySink()
        self.requests: dict[str, RequestHooks] = {}
        self.prompts: dict[str, tuple[int, ...]] = {}
        self.routes: list[CaptureRoute] = []
        self.planned = False
        for site, norm in enumerate(self.sites.norms):
            adapter.hook_norm(norm, site)
        install_runtime(self.runtime)
        adapter.install_pre_forward(worker.model_runner, self._before_forward)
        logger.info("capsteer: hooked %d sites on %d layers (%s mode)", len(self.sites.norms),
                    self.sites.num_layers, "device" if self.device_driven else "host")

    # ---- step hooks ----
    def before_step(self, scheduler_output: object) -> None:
        for req_id in adapter.finished_requests(scheduler_output):
            self._finish(req_id)
        for req_id, prompt, extra in adapter.new_requests(scheduler_output):
            if req_id in self.requests:
                continue  # resumed after preemption: keep what was captured
            hooks = RequestHooks.from_extra_args(req_id, extra, len(prompt), self.runtime)
            if hooks is None:
                continue
            self.requests[req_id] = hooks
            if hooks.capture is not None:
                self.prompts[req_id] = tuple(prompt)
                self.sink.open(CaptureRequest(
                    capture_id=hooks.capture_id, request_id=req_id, model=self.model_name,
                    spec=hooks.capture, prompt_token_ids=tuple(prompt),
                    model_dtype=self.runtime.dtype, hidden_size=self.sites.hidden_size,
                    num_layers=self.sites.num_layers))

    def _before_forward(self, layout: adapter.BatchLayout) -> None:
        if not self.requests:
            self.routes = []
            self.planned = False
            return
        plan, self.routes = build_step_plan(
            layout.req_ids, layout.query_start_loc, layout.start_positions, self.requests,
            layout.input_ids_host)
        self.runtime.set_plan(plan, layout.num_tokens_padded)
        self.planned = True

    def after_step(self) -> None:
        if not self.planned:
            return
        captured = self.runtime.take_captured()
        for route in self.routes:
            rows = captured[route.point][route.offset: route.offset + len(route.positions)]
            for hook, layer in route.keys:
                self.sink.write(route.capture_id, hook, layer, route.positions, rows)
        self.routes = []
        self.planned = False
        self.runtime.set_plan(StepPlan(), 0)

    def _finish(self, req_id: str) -> None:
        hooks = self.requests.pop(req_id, None)
        if hooks is None:
            return
        hooks.release(self.runtime)
        if hooks.capture is None:
            return
        prompt = self.prompts.pop(req_id)
        tokens = list(prompt[: hooks.fed_len]) + [
            hooks.tokens.get(p, -1) for p in range(len(prompt), hooks.fed_len)]
        self.sink.close(CaptureEnd(hooks.capture_id, tuple(tokens)))


class CapsteerWorker(adapter.platform_worker_base()):  # type: ignore[misc]
    """The platform worker plus capsteer hooks (see module docstring)."""

    capsteer: EngineHooks

    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        started = time.perf_counter()
        self.capsteer = EngineHooks(self)
        logger.info("capsteer: hooks installed in %.3f s", time.perf_counter() - started)

    def execute_model(self, scheduler_output, *args, **kwargs):
        self.capsteer.before_step(scheduler_output)
        out = super().execute_model(scheduler_output, *args, **kwargs)
        self.capsteer.after_step()
        return out

    # ---- collective_rpc surface ----
    def capsteer_take_captures(self, capture_ids: list[str]) -> dict:
        """Finished in-memory captures (the in-process engine polls this)."""
        sink = self.capsteer.sink
        if not isinstance(sink, MemorySink):
            return {}
        return {cid: cap.to_wire() for cid, cap in sink.take(capture_ids).items()}

    def capsteer_sites_fired(self) -> list[int]:
        return list(self.capsteer.runtime.fired)

