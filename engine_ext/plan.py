"""Per-request hook state and the per-step plan built from the batch layout.

Every step, each batch row belongs to (request, absolute position). That mapping
comes from the runner's own host arrays (see vllm.batch.BatchLayout), so it stays
right under continuous batching, chunked prefill, preemption/recompute (positions
restart and the sink keeps each position once) and prefix caching (cached tokens
are never fed, and captured requests never hit the cache: their salt is unique).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Container, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from capsteer.capture.paths import validate_capture_id
from capsteer.capture.spec import RANGE_KINDS, CaptureSpec, PositionSpec, range_bounds
from capsteer.engine_ext import patches as patching
from capsteer.engine_ext.payload import decode_payload, parse_readout_payload
from capsteer.engine_ext.runtime import STREAM, SUB, HookRuntime, StepPlan, hook_point
from capsteer.steering.readers.readout import ReadoutItem
from capsteer.steering.spec import SteeringSpec, VectorResolve

PROMPT, GENERATED = 0, 1


@dataclass(slots=True)  # hundreds a step: no __dict__ each
class CaptureRoute:
    """Where one request's rows for one (kind, site) sit in this step's staging copy:
    rows `staging_offset[point] + offset` onwards, one per entry of `positions`."""

    capture_id: str
    point: tuple[int, int]
    keys: tuple[tuple[str, int], ...]
    offset: int
    positions: np.ndarray
    rows: np.ndarray  # batch rows they were copied from
    slot: int = 0


@dataclass
class RequestHooks:
    """What one request asks of the hooks; built once when the request first appears."""

    req_id: str
    prompt_len: int
    capture_id: str | None = None
    capture: CaptureSpec | None = None
    points: dict[tuple[int, int], tuple[tuple[str, int], ...]] = field(default_factory=dict)
    # (kind, site, position class) -> steering table entry
    entries: dict[tuple[int, int, int], int] = field(default_factory=dict)
    fed_len: int = 0
    tokens: dict[int, int] = field(default_factory=dict)
    durable: bool = False  # publish through the durable writer rather than keep in memory
    # The front end reports the output length once it is final (stop strings and async
    # scheduling can feed tokens past the output); a durable capture of generated
    # positions waits for that report before it is published.
    await_end: bool = False
    sink: str = "memory"  # "memory" | "durable" | "sharded"
    record_id: str | None = None  # the job's own id for this request (sharded index)
    dir_time: float | None = None  # the front end's clock: dates the capture directory
    slot: int = 0  # device mode: row of the per-request tables (0 = no hooks)
    shared_slot: bool = False  # the row is its steering key's, shared (steering only)
    steering_key: str | None = None  # requests with the same steering share table entries
    sites: frozenset[int] = frozenset()  # sites this request steers or copies at
    group: int = 0  # the writer process its capture goes to: a step's rows are laid out by it
    # Kept positions can lie past the prompt (see needs_output_length); decided on arrival,
    # where a payload the engine cannot use is refused without stopping the engine.
    reaches_output: bool = False
    # A readout: its id (the results file's name), items, and the points its rows are
    # copied from (routed like a capture's, to the worker's ReadoutSink).
    readout_id: str | None = None
    readout_items: tuple[ReadoutItem, ...] = ()
    readout_points: dict[tuple[int, int], tuple[tuple[str, int], ...]] = field(
        default_factory=dict)
    # Activation patches by point (engine_ext/patches.py): host mode indexes them per step.
    patches: patching.Patches = field(default_factory=dict)
    patch_positions: np.ndarray | None = None  # their union (device mode ranks rows by it)

    @classmethod
    def capture_only(cls, req_id: str, payload: Mapping, prompt_len: int) -> RequestHooks:
        """The capture fields of a payload, nothing allocated: enough to open and end
        the capture (also to answer for one the worker cannot serve)."""
        hooks = cls(req_id=req_id, prompt_len=prompt_len)
        if payload.get("capture"):
            # JSON text (cheap for vLLM's per-request copy; parsed once per distinct text)
            hooks.capture = CaptureSpec.from_wire(payload["capture"])
            hooks.capture_id = validate_capture_id(payload["capture_id"])
            hooks.durable = bool(payload.get("durable", False))
            hooks.await_end = bool(payload.get("await_end", False))
            hooks.sink = str(payload.get("sink") or ("durable" if hooks.durable else "memory"))
            hooks.record_id = payload.get("record_id")
            hooks.dir_time = payload.get("dir_time")
            hooks.reaches_output = hooks.capture.positions.reaches_past_prompt(prompt_len)
        return hooks

    @classmethod
    def from_extra_args(
        cls, req_id: str, extra_args: Mapping | None, prompt_len: int, runtime: HookRuntime,
        vectors: VectorResolve | None = None,
    ) -> RequestHooks | None:
        payload = decode_payload(extra_args)
        return None if not payload else cls.from_payload(req_id, payload, prompt_len, runtime,
                                                         vectors)

    @classmethod
    def from_payload(
        cls, req_id: str, payload: Mapping, prompt_len: int, runtime: HookRuntime,
        vectors: VectorResolve | None = None,
    ) -> RequestHooks:
        """`vectors` reads the registry vectors a spec names (the server's workers); a
        vector it cannot read as the front end saw it refuses the request's hooks."""
        hooks = cls.capture_only(req_id, payload, prompt_len)
        if hooks.capture is not None:
            points: dict[tuple[int, int], list[tuple[str, int]]] = defaultdict(list)
            for hook, layer in hooks.capture.keys():
                point = hook_point(hook, layer, runtime.num_layers)
                if point[1] in runtime.local_sites:  # other pipeline stages copy the rest
                    points[point].append((hook, layer))
            hooks.points = {p: tuple(keys) for p, keys in points.items()}
        if payload.get("readout"):
            hooks.readout_id, items = parse_readout_payload(payload["readout"])
            hooks.readout_items = tuple(items)
            hooks.readout_points = _local_points(((i.hook, i.layer) for i in items), runtime)
        try:
            wire = payload.get("steering")
            if wire:
                # A spec already live in the tables is not decoded again: the front end
                # sends its content key (hundreds of requests share one spec), beside the
                # spec's JSON text or inside its mapping form.
                key = payload.get("steering_key") if isinstance(wire, str) else \
                    SteeringSpec.key_of(wire)
                if not isinstance(key, str):
                    key = SteeringSpec.from_wire(wire, vectors).sharing_key
                hooks.entries = runtime.acquire_entries(key, lambda: compose_entries(
                    SteeringSpec.from_wire(wire, vectors), runtime.hidden_size,
                    runtime.num_layers))
                hooks.steering_key = key
                hooks.patches = patching.decode(wire, lambda h, la: hook_point(
                    h, la, runtime.num_layers), runtime.device, vectors)
                hooks.patch_positions = patching.union(hooks.patches)
            hooks.shared_slot = hooks.capture is None and hooks.readout_id is None \
                and bool(hooks.entries) and not hooks.patches
            hooks.slot = runtime.alloc_slot(hooks.entries, hooks.steering_key,
                                            shared=hooks.shared_slot)
            if hooks.patches and runtime.device_driven:
                runtime.patch_table.attach(hooks.slot, hooks.patches, runtime._upload_into)
        except Exception:
            hooks.release(runtime)  # nothing half-registered stays behind
            raise
        hooks.sites = shared_site_set(frozenset([site for _, site, _ in hooks.entries]
                                                 + [site for _, site in hooks.points]
                                                 + [site for _, site in hooks.readout_points]
                                                 + [site for _, site in hooks.patches]))
        return hooks

    @property
    def local_keys(self) -> tuple[tuple[str, int], ...]:
        """The captured keys this worker copies (all of them unless pipeline-parallel)."""
        return tuple(key for keys in self.points.values() for key in keys)

    @property
    def needs_output_length(self) -> bool:
        """Whether the kept positions depend on the output length (generated tokens)."""
        return self.capture is not None and self.reaches_output

    def release(self, runtime: HookRuntime) -> None:
        if self.patches and runtime.device_driven:
            runtime.patch_table.detach(self.slot)
        runtime.free_slot(self.slot, self.steering_key if self.shared_slot else None)
        self.slot, self.shared_slot = 0, False
        if self.steering_key is not None:
            runtime.release_entries(self.steering_key)
        self.entries = {}
        self.steering_key = None


def _local_points(keys, runtime: HookRuntime) -> dict[tuple[int, int], tuple[tuple[str, int], ...]]:
    """(kind, site) -> the (hook, layer) keys read there, for this worker's own sites (other
    pipeline stages copy the rest)."""
    points: dict[tuple[int, int], list[tuple[str, int]]] = defaultdict(list)
    for hook, layer in keys:
        point = hook_point(hook, layer, runtime.num_layers)
        if point[1] in runtime.local_sites and (hook, layer) not in points[point]:
            points[point].append((hook, layer))
    return {p: tuple(k) for p, k in points.items() if k}


_SITE_SETS: dict[frozenset[int], frozenset[int]] = {}


def shared_site_set(sites: frozenset[int]) -> frozenset[int]:
    """One object per distinct site set: each step collects the batch's site sets, and a set
    compares an equal but distinct frozenset element by element (~0.5 us for 28 sites, a
    hundred us a step at 256 requests), the same object by identity."""
    if len(_SITE_SETS) > 4096:  # requests steering many different layer subsets
        _SITE_SETS.clear()
    return _SITE_SETS.setdefault(sites, sites)


Gate = tuple[torch.Tensor, float] | None  # (g, b): applies where src . g + b > 0


def compose_entries(
    spec: SteeringSpec, hidden: int, num_layers: int
) -> dict[tuple[int, int, int], tuple[torch.Tensor, float, torch.Tensor, Gate,
                                      torch.Tensor | None]]:
    """Fold a request's ops into one affine map per (kind, site, position class).

    Each map is y = keep * x + alpha * (src . u) u + w (keep: ones, or zeros at the
    slices a selection ablates or clamps; hidden: the width of ops without a vector of
    another width, mlp_post's d_mlp), applied to the sublayer output
    (kind SUB, src = x) or to the stream (kind STREAM, src = x + residual), at tokens
    where its gate passes (src . g + b > 0, src before the map; no gate: every token).
    Ops compose in request order; the parser allows one projection per point, and one
    gate (the same `when` on every op there, or none).
    """
    maps: dict[tuple[int, int, int], list] = {}
    gates: dict[tuple[int, int, int], Gate] = {}
    keeps: dict[tuple[int, int, int], torch.Tensor] = {}
    for op in spec.ops:
        kind, site = hook_point(op.hook, op.layer, num_layers)
        classes = (PROMPT, GENERATED) if op.positions == "all" else (
            (PROMPT,) if op.positions == "prompt" else (GENERATED,))
        vec = torch.from_numpy(op.vector.copy())
        gate = None if op.gate is None else (torch.from_numpy(op.gate.copy()), op.gate_bias)
        width = len(vec)
        select = None if op.select is None else torch.from_numpy(op.select.copy())
        for cls in classes:
            gates[(kind, site, cls)] = gate
            u, alpha, w = maps.setdefault(
                (kind, site, cls), [torch.zeros(width), 0.0, torch.zeros(width)])
            if select is not None and op.op != "add":  # zero the selected slices, then set
                keep = keeps.get((kind, site, cls), torch.ones(width)) * (1 - select)
                keeps[(kind, site, cls)] = keep
                w = w * keep + (op.value * select if op.op == "clamp" else 0.0)
            elif op.op == "add":
                w = w + op.scale * (vec if select is None else vec * select)
            else:  # ablate / clamp: project out of everything so far, then set the value
                u, alpha = vec, -1.0
                w = w - (w @ u) * u
                if op.op == "clamp":
                    w = w + op.value * u
            maps[(kind, site, cls)] = [u, alpha, w]
    return {k: (u, alpha, w, gates[k], keeps.get(k)) for k, (u, alpha, w) in maps.items()}


def build_step_plan(
    batch_req_ids: list[str],
    query_start_loc: np.ndarray,
    start_positions: np.ndarray,
    requests: Mapping[str, RequestHooks],
    input_ids: torch.Tensor | None,
    host_steering: bool = True,
    uniform_slots: Container[int] = (),
) -> StepPlan:
    """Map this step's rows to steering entries and capture copies.

    `input_ids` is the host copy of this step's tokens when the runner has one;
    without it the plan lists `token_rows` for a device-side gather. Device mode
    (`host_steering=False`) finds each row's request, slot and position class on the
    device from per-request arrays (`StepPlan.batch_hooks`): it skips the per-row lists
    only host mode needs, so a step whose requests only steer builds nothing per row. When
    every request of the batch steers through one of `uniform_slots` (a shared row, the
    same at prompt and generated positions: a server steering all its traffic alike), the
    plan is that slot alone, with no per-request arrays either."""
    steer_rows: dict[tuple[int, int], list[np.ndarray]] = defaultdict(list)
    steer_ents: dict[tuple[int, int], list[np.ndarray]] = defaultdict(list)
    cap_rows: dict[tuple[int, int], list[np.ndarray]] = defaultdict(list)
    cap_count: dict[tuple[int, int], int] = defaultdict(int)
    routes: list[CaptureRoute] = []
    token_rows: list[np.ndarray] = []
    token_owners: list[tuple[str, np.ndarray]] = []
    patch_parts: dict[tuple[int, int], list] = {}
    patch_ranks: list[tuple[np.ndarray, np.ndarray]] = []
    # The hooked requests of the batch (hundreds a step, so comprehensions rather than one
    # loop of appends: this runs on the engine's step thread every step): their batch
    # indices, prompt lengths and slots for the whole-batch array ops below, the sites
    # they use, and the few that need a loop of their own (captures, host-mode steering).
    found = [(i, h) for i, h in enumerate(map(requests.get, batch_req_ids)) if h is not None]
    if uniform_slots and found and len(found) == len(batch_req_ids):
        slot = found[0][1].slot
        if slot in uniform_slots and all(h.slot == slot for _, h in found):
            # A shared row is only ever a steering-only request's: nothing is copied.
            return StepPlan(active_sites=found[0][1].sites, uniform_slot=slot)
    looped = [(i, h) for i, h in found if h.capture is not None or h.readout_id is not None
              or (host_steering and h.entries) or h.patches]
    if any(h.group for _, h in looped):
        # Each writer's rows of a point next to each other in the staging buffer: one GPU
        # copy into that writer's ring instead of one per request (stable: batch order within).
        looped.sort(key=lambda item: item[1].group)
    plan = StepPlan(active_sites=frozenset().union(*{h.sites for _, h in found}))
    if found:
        m = len(found)
        starts = query_start_loc[:-1].astype(np.int64)
        idx = np.fromiter([i for i, _ in found], np.int64, m)
        prompt_lens = np.fromiter([h.prompt_len for _, h in found], np.int64, m)
        fed = start_positions[idx].astype(np.int64)
        plan.batch_hooks = (idx, np.fromiter([h.slot for _, h in found], np.int64, m),
                            starts[idx] + prompt_lens - fed)
        plan.query_ends = query_start_loc[1:].astype(np.int64)
        plan.all_generated = bool((fed >= prompt_lens).all())
    if looped:  # rows and positions, flat, of the requests that need a loop of their own
        lens = np.diff(query_start_loc)
        at = np.array([i for i, _ in looped], np.int64)
        n_rows = lens[at].astype(np.int64)
        total = int(n_rows.sum())
        first = np.cumsum(n_rows) - n_rows  # each request's first entry in the flat arrays
        offset_in_req = np.arange(total, dtype=np.int64) - np.repeat(first, n_rows)
        all_rows = np.repeat(query_start_loc[at].astype(np.int64), n_rows) + offset_in_req
        all_pos = np.repeat(start_positions[at].astype(np.int64), n_rows) + offset_in_req
        all_gen = all_pos >= np.repeat(  # position classes: host-mode steering only
            np.array([h.prompt_len for _, h in looped], np.int64), n_rows) \
            if host_steering else None
        # Python ints, converted once: hundreds of requests read them every step.
        n_list, first_list = n_rows.tolist(), first.tolist()
        pos0_list = start_positions[at].tolist()
    for j, (i, hooks) in enumerate(looped):
        k = n_list[j]
        if k <= 0:
            continue
        a = first_list[j]
        pos0, prompt_len = pos0_list[j], hooks.prompt_len
        if (host_steering and hooks.entries) or hooks.patches:
            rows, pos = all_rows[a: a + k], all_pos[a: a + k]
            for (kind, site, cls), entry in (hooks.entries.items() if host_steering else ()):
                generated = all_gen[a: a + k]
                sel = rows[generated] if cls == GENERATED else rows[~generated]
                if len(sel):
                    steer_rows[(kind, site)].append(sel)
                    steer_ents[(kind, site)].append(np.full(len(sel), entry, dtype=np.int64))
            if hooks.patches and host_steering:
                patching.step_rows(hooks.patches, rows, pos, patch_parts)
            elif hooks.patches:
                patching.step_ranks(hooks.patch_positions, rows, pos, patch_ranks)
        # A request's rows are consecutive positions; `first_gen` is the index of its
        # first generated one (k: none), so the usual position kinds need no mask: their
        # rows are one slice of the flat arrays (two numpy views a request and step).
        first_gen = min(max(prompt_len - pos0, 0), k)
        if hooks.readout_id is not None:
            # One row set for all the request's items (device mode ranks rows per request);
            # each item keeps its own positions in the sink.
            items = hooks.readout_items
            kind = items[0].positions.kind if len(items) == 1 else None
            if kind in RANGE_KINDS:
                lo, hi = range_bounds(kind, first_gen, 0, k)
                sel_rows, sel_pos = (all_rows[a + lo: a + hi], all_pos[a + lo: a + hi]) \
                    if hi > lo else (None, None)
            else:
                pos = all_pos[a: a + k]
                sel = _kept(items[0].positions, pos, prompt_len) \
                    if kind is not None else _kept_any([item.positions for item in items], pos,
                                                       prompt_len)
                sel_rows, sel_pos = (None, None) if sel is None else \
                    (all_rows[a: a + k][sel], pos[sel])
            if sel_rows is not None:
                n_sel = len(sel_rows)
                for point, keys in hooks.readout_points.items():
                    at = cap_count[point]
                    routes.append(CaptureRoute(hooks.readout_id, point, keys, at, sel_pos,
                                               sel_rows, hooks.slot))
                    if host_steering:
                        cap_rows[point].append(sel_rows)
                    cap_count[point] = at + n_sel
        if hooks.capture is None:
            continue
        hooks.fed_len = max(hooks.fed_len, pos0 + k)
        kind = hooks.capture.positions.kind
        if kind in RANGE_KINDS:
            lo, hi = range_bounds(kind, first_gen, 0, k)
            if hi <= lo:
                continue
            sel_rows, sel_pos = all_rows[a + lo: a + hi], all_pos[a + lo: a + hi]
            # Only generated tokens need recording: the prompt's are known (a prefill chunk
            # of thousands of rows would otherwise be a per-token Python loop every step).
            if pos0 + hi > prompt_len:
                g = max(first_gen, lo)  # lo: every kept row (decode), no new views
                gen_rows, gen_pos = (sel_rows, sel_pos) if g == lo else \
                    (all_rows[a + g: a + hi], all_pos[a + g: a + hi])
            else:
                gen_rows = None
        else:
            pos = all_pos[a: a + k]
            sel = _kept(hooks.capture.positions, pos, prompt_len)
            if sel is None:
                continue
            sel_rows, sel_pos = all_rows[a: a + k][sel], pos[sel]
            gen_rows = None
            if int(sel_pos[-1]) >= prompt_len:
                fed_gen = sel_pos >= prompt_len if int(sel_pos[0]) < prompt_len \
                    else slice(None)
                gen_rows, gen_pos = sel_rows[fed_gen], sel_pos[fed_gen]
        if gen_rows is not None:
            if input_ids is not None:
                for p, t in zip(gen_pos.tolist(), input_ids[gen_rows].tolist(), strict=True):
                    hooks.tokens[p] = t
            else:  # tokens are gathered on the device and arrive with the rows
                token_rows.append(gen_rows)
                token_owners.append((batch_req_ids[i], gen_pos))
        n_sel = len(sel_rows)
        for point, keys in hooks.points.items():
            at = cap_count[point]
            routes.append(CaptureRoute(hooks.capture_id, point, keys, at, sel_pos, sel_rows,
                                       hooks.slot))
            if host_steering:
                cap_rows[point].append(sel_rows)
            cap_count[point] = at + n_sel
    plan.routes = routes
    plan.patch = patching.finish(patch_parts)
    plan.patch_ranks = patch_ranks or None
    if token_rows:
        plan.token_rows = torch.from_numpy(np.concatenate(token_rows))
        plan.token_owners = token_owners
    for key, parts in steer_rows.items():
        plan.steer[key] = (torch.from_numpy(np.concatenate(parts)),
                           torch.from_numpy(np.concatenate(steer_ents[key])))
    offset = 0
    for key, count in cap_count.items():  # points in order of first use
        if host_steering:  # host mode's op indexes these rows; device mode uses ranks
            plan.capture[key] = torch.from_numpy(np.concatenate(cap_rows[key]))
        plan.staging_offset[key] = offset
        offset += count
    plan.staging_rows = offset
    return plan


def _kept(positions: PositionSpec, pos: np.ndarray, prompt_len: int) -> np.ndarray | None:
    """Which of a request's positions `pos` a position spec of no range kind keeps (the
    range kinds take a slice: `range_bounds`), as a mask; None when it keeps none."""
    mask = positions.candidate(pos, prompt_len)
    return mask if mask.any() else None


def _kept_any(specs: list[PositionSpec], pos: np.ndarray, prompt_len: int) -> np.ndarray | None:
    """The positions any of `specs` keeps, as a mask (None: none)."""
    mask = np.zeros(len(pos), dtype=bool)
    for spec in specs:
        mask |= spec.candidate(pos, prompt_len)
    return mask if mask.any() else None


__all__ = ["STREAM", "SUB", "CaptureRoute", "RequestHooks", "build_step_plan", "compose_entries",
           "shared_site_set"]
