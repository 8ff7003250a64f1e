"""The step plan fed to the hook runtime before each forward: built from the batch layout,
reused while a steady batch of steering-only requests decodes, and shed of the largest
captures when a step's captured rows outgrow the staging buffer."""

from __future__ import annotations

import logging

import numpy as np

from capsteer.engine_ext.plan import build_step_plan
from capsteer.engine_ext.runtime import StepPlan
from capsteer.engine_ext.vllm.batch import BatchLayout

logger = logging.getLogger("vllm.capsteer")  # under vLLM's configured logger


class StepFeed:
    """EngineHooks' per-step planning (a mixin: the state lives on EngineHooks)."""

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

        Reusable: no capture or patch anywhere in the batch (their rows change every
        step) and every hooked row already generated (a prompt row's position class can
        change on the next step). With the same requests in the same rows, the next
        step's rows are then in the same class with the same slots and entries. A uniform
        plan (every request steered through one shared row, whatever the class) holds for
        the same requests in the same rows: steady decode of a uniformly steered batch
        checks the batch instead of rebuilding (~25 us a step alone, more in the engine)."""
        if not plan.uniform_slot:
            if plan.routes or plan.batch_hooks is None or not plan.all_generated:
                return None
            if any(self.requests[r].capture is not None or self.requests[r].patches
                   for r in layout.req_ids if r in self.requests):
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
