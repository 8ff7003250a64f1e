"""The hook op and the persistent buffers it reads.

Each tapped module calls `torch.ops.capsteer.tap(x, residual, key, kinds)` (see
engine_ext/families.py for where); `key` is a small tensor of that tap's own, which
names its site (engine_ext.tap_op.new_site_key). In vLLM's deferred layout the tap sits before a
fused add+norm: `x` is the sublayer output (attention or MLP) about to be added into
the residual stream, so `x + residual` is the stream itself. In a materialized
layout a call carries one kind: the stream (residual None) or a sublayer output.
`kinds` is a bit mask of the kinds the call carries. The op steers by mutating `x`
in place (so the add and the next module both see the steered value) and copies
captured rows.

Per-request behaviour is data: steering entries live in persistent tables and
each step only rewrites index buffers. Two modes read the same plan:
- host mode (CPU, no graphs): the op touches only the rows the plan lists;
- device mode (CUDA graphs): dense per-token index buffers at fixed addresses,
  no host reads of device values and no allocation of persistent memory per step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from capsteer.capture.layouts import copy_rows
from capsteer.engine_ext import patches, tap_kernel
from capsteer.engine_ext.families import (  # hook_point, layers_needed: re-exported
    BOTH,
    STREAM,
    SUB,
    hook_point,  # noqa: F401
    layers_needed,  # noqa: F401
    site_count,
)
from capsteer.engine_ext.route_arrays import route_entries, route_ranks
from capsteer.engine_ext.selections import (
    GATED,
    MASKED,
    local_map,
    pad_row,
    passes,
    same_map,
    site_widths,
    steer_rows,
)

KINDS = (SUB, STREAM)


@dataclass
class StepPlan:
    """What the op does this step. Host-mode fields index rows of this step's batch."""

    # (kind, site) -> (rows, entries) for steering; rows int64 [k], entries int64 [k]
    steer: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # (kind, site) -> rows int64 [k] whose values are copied
    capture: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    # (kind, site) -> (rows int64 [k], values float32 [k, hidden]) set there (patches.py);
    # device mode: (rows, ranks) of this step's patched rows, None when there are none
    patch: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    patch_ranks: list[tuple[np.ndarray, np.ndarray]] | None = None
    # (kind, site) -> offset of its rows in the staging buffer (device mode)
    staging_offset: dict[tuple[int, int], int] = field(default_factory=dict)
    staging_rows: int = 0
    routes: list[Any] = field(default_factory=list)  # plan.CaptureRoute, per request and point
    # The batch's requests with hooks, per request (not per row): their batch indices,
    # slots, and the first row of each that is a generated token (a row r of request b
    # is generated when r >= that row). Device mode expands them to per-row indices on
    # the device (`_expand_rows`); the host builds nothing per row for steering.
    batch_hooks: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    query_ends: np.ndarray | None = None  # every batch request's end row (query_start_loc[1:])
    all_generated: bool = False  # every row of a request with hooks is a generated token
    # Device mode: every request of the batch steers through this one shared row, the same
    # at prompt and generated positions (HookRuntime.uniform_slots); 0: per-row index.
    uniform_slot: int = 0
    token_rows: torch.Tensor | None = None  # rows whose input ids the device must gather
    token_owners: list[tuple[str, np.ndarray]] = field(default_factory=list)
    # Sites where some hooked request of this step steers or copies (None: every site).
    # Outside CUDA-graph replay the op returns at once elsewhere: an eager step (a large
    # prefill) then pays no kernel launch at sites nobody uses.
    active_sites: frozenset[int] | None = None

    @property
    def empty(self) -> bool:
        return not self.steer and not self.capture and not self.patch


def _pinned_copy(host: torch.Tensor) -> torch.Tensor:
    """`host` in a pinned block, copied on this thread (`copy_rows`): torch's own copy
    splits a large tensor over its OpenMP team, whose threads then spin on their cores
    after every step (measured on an H100, 2026-11-25)."""
    pinned = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
    copy_rows(pinned, host)
    return pinned


class HookRuntime:
    """Per-worker persistent state: steering tables, index buffers, captured rows."""

    def __init__(
        self,
        num_layers: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        *,
        max_tokens: int,
        max_entries: int = 1024,
        max_requests: int = 256,
        staging_rows: int = 0,
        device_driven: bool = False,
        local_sites: frozenset[int] | None = None,
        hook_widths: Mapping[str, int] | None = None,
        patch_rows: int = 2048,
    ) -> None:
        self.num_layers = num_layers
        self.num_sites = site_count(num_layers)
        # Sites whose norm this worker runs (a pipeline stage runs only its own layers):
        # copies are routed only from these.
        self.local_sites = frozenset(range(self.num_sites)) if local_sites is None else local_sites
        self.hidden_size = hidden_size
        # Each site's width (hook_widths: the hooks not hidden_size wide, mlp_post's d_mlp);
        # the tables and staging are as wide as the widest (engine_ext.selections).
        self.site_widths = site_widths(hook_widths or {}, num_layers, hidden_size)
        self.width = max(self.site_widths)
        self.dtype = dtype
        self.device = device
        self.shards: dict[int, slice] = {}  # TP: site -> this rank's columns (split_columns)
        self.gather_columns: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.device_driven = device_driven
        self.max_tokens = max_tokens
        # Entry 0 is the identity (alpha 0, u 0, w 0). y = x + alpha * (src . u) u + w where
        # the entry is ungated (gated 0) or src . gate + gate_b > 0 (a `when`), src before it.
        self.u = torch.zeros(max_entries, self.width, dtype=torch.float32, device=device)
        self.w = torch.zeros_like(self.u)
        self.keep = torch.ones_like(self.u)  # engine_ext.selections: 0 where one selects
        self.masked_entries = 0  # host mode skips the keep rows while none has zeros
        self.alpha = torch.zeros(max_entries, dtype=torch.float32, device=device)
        self.gate = torch.zeros_like(self.u)
        self.gate_b = torch.ones(max_entries, dtype=torch.float32, device=device)
        self.gated = torch.zeros(max_entries, dtype=torch.int32, device=device)
        self.gated_entries = 0  # host mode skips the gate's arithmetic while none is gated
        self.free_entries = list(range(max_entries - 1, 0, -1))
        # Identical steering specs share entries: key -> (entries, refcount)
        self.shared: dict[str, tuple[dict, int]] = {}
        # Specs no live request uses, oldest first: their entries stay until needed.
        self.idle: OrderedDict[str, dict] = OrderedDict()
        self.plan = StepPlan(active_sites=frozenset())
        # Whether a CUDA graph recorded now holds the tap kernels (False while the plain
        # graphs, for steps without hooks, are recorded).
        self.graph_taps = True
        self.captured: dict[tuple[int, int], torch.Tensor] = {}
        self.fired = [0] * self.num_sites  # host mode: sites reached this step (canary)
        # Slot 0 means "no hooks": its steering entries are the identity, it captures nothing.
        self.free_slots = list(range(max_requests, 0, -1))
        # Slots whose device row holds steering entries; every other row is all zeros
        # (the identity), so a capture-only request needs no upload when it arrives and
        # no clearing when it leaves (two launches per request otherwise).
        self.steered_slots: set[int] = set()
        self.slot_tables: dict[str | None, np.ndarray] = {}  # steering key -> host table
        # slot -> its new row (None: all zeros), written by the next flush_slot_writes
        self.slot_writes: dict[int, np.ndarray | None] = {}
        # steering key -> (row shared by its steering-only requests, requests holding it)
        self.key_slots: dict[str, tuple[int, int]] = {}
        # Shared rows whose entries are the same for prompt and generated positions: a
        # step whose every row belongs to one of them needs no per-row index (`uniform_slot`)
        self.uniform_slots: set[int] = set()
        self.filled_slot = 0  # device mode: nonzero when every row of tok_slot holds it
        if device_driven:
            long = dict(dtype=torch.int64, device=device)
            # Per token: slot, position class (0 prompt / 1 generated), rank among the
            # request's captured rows (-1: none). Slot and class are expanded on the device
            # from per-request arrays each step (`_expand_rows`); ranks are uploaded only
            # for steps that copy rows, and are -1 again after them (`reset_dense`).
            self.tok_slot = torch.zeros(max_tokens, **long)
            self.tok_gen = torch.zeros(max_tokens, **long)
            self.tok_rank = torch.full((max_tokens,), -1, **long)
            self.tok_request = torch.zeros(max_tokens, **long)  # row -> batch index
            self.row_ids = torch.arange(max_tokens, **long)
            self.ranks_set = False  # tok_rank holds a copying step's ranks
            # Per batch index (a batch has at most one request per row): the upload of
            # `_expand_rows`, [query ends | slots | first generated rows], one copy a step.
            self.batch_index = torch.zeros(3 * max_tokens + 2, **long)
            # [slot, position class, kind, site] -> steering entry
            self.slot_entry = torch.zeros(max_requests + 1, 2, 2, self.num_sites, **long)
            # Device side of flush_slot_writes: slot ids, then their rows.
            self.slot_updates = torch.zeros((max_requests + 1) * (1 + 4 * self.num_sites),
                                            **long)
            # [slot, kind, site] -> first staging row of that request's copy, or -1
            self.point_base = torch.full((max_requests + 1, 2, self.num_sites), -1, **long)
            # Flat entries of point_base not -1 now (the last routed step's); a step
            # uploads only its changes (a few entries), never the whole table.
            self.point_base_set = np.zeros(0, np.int64)
            self.point_updates = torch.zeros(2 * self.point_base.numel(), **long)
            self.trash_row = staging_rows
            self.use_kernel = tap_kernel.available(torch.device(device))
            # Compiled tap kernels launched without Triton's JIT (tap_kernel.tap), per
            # specialisation; they hold this runtime's buffer addresses.
            self.tap_direct = self.use_kernel and tap_kernel.direct_launch_supported()
            self.tap_launchers: dict[tuple, tuple] = {}
            self.staging = torch.zeros(staging_rows + 1, self.width, dtype=dtype, device=device)
            self.patch_table = patches.DeviceTable(patch_rows, hidden_size, self.num_sites,
                                                   max_requests, max_tokens, device)
            self.token_stage = torch.zeros(max(staging_rows, 1), **long)

    def split_columns(self, shards: dict[int, slice],
                      gather: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Tensor parallelism (host mode): tables at `shards`' sites hold this rank's columns
        and captured rows there are gathered whole (every rank copies the same rows)."""
        if self.device_driven and shards:
            raise ValueError("device-driven runtimes do not gather split columns yet")
        self.shards, self.gather_columns = shards, gather

    def _upload(self, host: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cuda":  # else without a host sync: pinned + async copy
            return host
        return _pinned_copy(host).to(self.device, non_blocking=True)

    def _upload_into(self, dst: torch.Tensor, host: np.ndarray) -> None:
        """dst[...] = host without a host sync or a device temporary: one async copy from
        a pinned block (the cached allocator reuses it only after this copy's event)."""
        if self.device.type != "cuda":
            dst.copy_(torch.from_numpy(host))
            return
        dst.copy_(_pinned_copy(torch.from_numpy(host)), non_blocking=True)

    # ---- steering tables (written when a request arrives, not per step) ----
    def alloc_entry(self, u: torch.Tensor, alpha: float, w: torch.Tensor,
                    gate: tuple[torch.Tensor, float] | None = None,
                    keep: torch.Tensor | None = None) -> int:
        while not self.free_entries and self.idle:  # room from the longest-idle spec
            self._free_spec(*self.idle.popitem(last=False))
        if not self.free_entries:
            raise RuntimeError("capsteer: steering table full (raise max_entries)")
        idx = self.free_entries.pop()
        rows = [pad_row(u, self.width), pad_row(w, self.width),
                pad_row(torch.zeros(0) if gate is None else gate[0], self.width),
                pad_row(torch.ones(0) if keep is None else keep, self.width, 1.0)]
        row = self._upload(torch.stack(rows).cpu())
        self.u[idx].copy_(row[0])
        self.w[idx].copy_(row[1])
        self.alpha[idx] = alpha
        if gate is not None:
            self.gate[idx].copy_(row[2])
            self.gate_b[idx] = gate[1]
            self.gated[idx] |= GATED
            self.gated_entries += 1
        if keep is not None:
            self.keep[idx].copy_(row[3])
            self.gated[idx] |= MASKED
            self.masked_entries += 1
        return idx

    def acquire_entries(self, key: str, build) -> dict:
        """Entries for a steering spec, shared by every live request with the same spec.
        A spec whose last request left keeps its entries while the table has room
        (`idle`): batches of one spec, or a spec that comes back, upload nothing again."""
        found = self.shared.get(key)
        if found is not None:
            self.shared[key] = (found[0], found[1] + 1)
            return found[0]
        entries = self.idle.pop(key, None)
        if entries is None:
            entries = {}
            # (kind, site) -> its maps so far: a point steered alike at prompt and generated
            # positions (the usual `positions: all`) holds one entry for both classes, so
            # its slot row does not depend on the class (`uniform_slots`) and the table
            # holds twice as many specs.
            made: dict[tuple[int, int], list[tuple[tuple, int]]] = {}
            try:
                for k, mapping in build().items():
                    same = [i for m2, i in made.get(k[:2], ()) if same_map(m2, mapping)]
                    entries[k] = same[0] if same else self.alloc_entry(
                        *local_map(mapping, self.shards.get(k[1])))
                    made.setdefault(k[:2], []).append((mapping, entries[k]))
            except Exception:
                for idx in set(entries.values()):
                    self.free_entry(idx)
                raise
        self.shared[key] = (entries, 1)
        return entries

    def release_entries(self, key: str) -> None:
        entries, count = self.shared[key]
        if count > 1:
            self.shared[key] = (entries, count - 1)
            return
        del self.shared[key]
        self.idle[key] = entries  # no row refers to them now; freed when room is needed

    def live_entries(self) -> int:  # entries held by specs some live request uses
        return sum(len(set(entries.values())) for entries, _ in self.shared.values())

    def _free_spec(self, key: str, entries: dict) -> None:
        self.slot_tables.pop(key, None)
        for idx in set(entries.values()):  # classes may share an entry
            self.free_entry(idx)

    def free_entry(self, idx: int) -> None:
        self.u[idx].zero_()
        self.w[idx].zero_()
        self.alpha[idx] = 0.0
        flags = int(self.gated[idx])
        if flags & GATED:
            self.gate[idx].zero_()
            self.gate_b[idx] = 1.0
            self.gated_entries -= 1
        if flags & MASKED:
            self.keep[idx].fill_(1.0)
            self.masked_entries -= 1
        self.gated[idx] = 0
        self.free_entries.append(idx)

    def alloc_slot(self, entries: dict[tuple[int, int, int], int], key: str | None = None,
                   shared: bool = False) -> int:
        """A table row for a request; device mode writes the request's entries into it
        before the next forward (`flush_slot_writes`). `shared`: a request that only
        steers takes the row of every live request with its steering `key` (hundreds of
        requests often share one spec: one row written when the spec arrives, cleared
        when its last request leaves, no device work per request); a capturing request
        needs its own row (`point_base` routes its copies)."""
        if not self.device_driven:
            return 0
        shared = shared and bool(entries) and key is not None
        found = self.key_slots.get(key) if shared else None
        if found is not None:
            self.key_slots[key] = (found[0], found[1] + 1)
            return found[0]
        if not self.free_slots:
            raise RuntimeError("capsteer: more live requests with hooks than max_requests")
        slot = self.free_slots.pop()
        if not entries:
            return slot  # its row is zero, or its clearing is already queued
        table = self.slot_tables.get(key)
        if table is None:
            table = np.zeros((2, 2, self.num_sites), np.int64)
            for (kind, site, cls), entry in entries.items():
                table[cls, kind, site] = entry
            # Kept while the spec's entries are (live or idle): bounded by the table.
            self.slot_tables[key] = table
        self.slot_writes[slot] = table
        self.steered_slots.add(slot)
        if shared:
            self.key_slots[key] = (slot, 1)
            if np.array_equal(table[0], table[1]):
                self.uniform_slots.add(slot)
        return slot

    def free_slot(self, slot: int, shared_key: str | None = None) -> None:
        """Give a request's row back (slot 0, never allocated, is a no-op); a row shared
        by `shared_key` goes back with the last request holding it."""
        if not (self.device_driven and slot):
            return
        if shared_key is not None:
            held_slot, count = self.key_slots[shared_key]
            if count > 1:
                self.key_slots[shared_key] = (held_slot, count - 1)
                return
            del self.key_slots[shared_key]
            self.uniform_slots.discard(slot)
        if slot in self.steered_slots:
            self.slot_writes[slot] = None  # cleared before the next forward
            self.steered_slots.discard(slot)
        self.free_slots.append(slot)

    def flush_slot_writes(self) -> None:
        """Write the rows of slots taken or left since the last step: one upload and one
        kernel a step, however many requests arrived or left (a copy on arrival and a
        clearing launch on leaving cost ~25 us of CUDA calls a request on an H200 host,
        and a step can bring hundreds)."""
        if not self.slot_writes:
            return
        k, width = len(self.slot_writes), 4 * self.num_sites
        host = np.zeros(k * (1 + width), np.int64)  # k slot ids, then k rows
        host[:k] = np.fromiter(self.slot_writes, np.int64, k)
        rows = host[k:].reshape(k, width)
        for i, table in enumerate(self.slot_writes.values()):
            if table is not None:
                rows[i] = table.reshape(-1)
        self.slot_writes = {}
        dev = self.slot_updates[: len(host)]
        self._upload_into(dev, host)
        self.slot_entry.index_copy_(0, dev[:k], dev[k:].view(k, 2, 2, self.num_sites))

    # ---- per step ----
    def set_plan(self, plan: StepPlan, num_tokens_padded: int) -> None:
        self.plan = plan
        self.captured = {}
        self.fired = [0] * self.num_sites
        if self.device_driven:
            self.flush_slot_writes()  # a request new this step has its row before the forward
            if num_tokens_padded:
                self._write_dense(plan, num_tokens_padded)

    def _write_dense(self, plan: StepPlan, n: int) -> None:
        """This step's per-row indices: slot and class expanded on the device from the
        plan's per-request arrays, and the ranks of copied rows, uploaded only when the
        step copies some."""
        if plan.staging_rows > self.trash_row:
            raise RuntimeError("capsteer: capture staging buffer too small for this step "
                               f"({plan.staging_rows} rows > {self.trash_row}); raise "
                               "--capture-staging-rows (worker config staging_rows)")
        if plan.uniform_slot:
            # Every row of the step is steered by one shared, class-free row: the whole
            # index is that slot (padding rows too: their outputs are dropped), written
            # once while such steps follow each other (no upload, no expansion).
            if self.filled_slot != plan.uniform_slot:
                self.tok_slot.fill_(plan.uniform_slot)
                self.filled_slot = plan.uniform_slot
        else:
            self._expand_rows(plan, n)
        if plan.routes:
            rank = np.full(n, -1, np.int64)
            rows, ranks = route_ranks(plan.routes)
            rank[rows] = ranks
            self._upload_into(self.tok_rank[:n], rank)
            self.ranks_set = True
        elif self.ranks_set:  # a copying step that was not reset (its forward failed)
            self.tok_rank.fill_(-1)
            self.ranks_set = False
        if plan.routes or len(self.point_base_set):  # steering-only steps skip this table
            self._update_point_base(plan)
        self.patch_table.write_ranks(plan.patch_ranks, n, self._upload_into)

    def warm_kernels(self) -> None:
        """Compile `_expand` now, at start-up. Its first launch is otherwise the first step
        with hooks: the canary's (after vLLM's warm-up, whose JIT monitor then reports a
        compile "during inference"), or, were the canary skipped, a user's request. The
        tap kernels compile earlier, inside vLLM's own warm-up forwards."""
        if not (self.device_driven and self.use_kernel):  # host mode, or no Triton
            return
        self.batch_index[:2].zero_()  # no requests: every row gets slot 0 (the padding's)
        tap_kernel.expand_rows(self.batch_index, 0, self.tok_slot[:1], self.tok_gen[:1],
                               self.max_tokens)
        self.tok_slot[:1].zero_()
        self.tok_gen[:1].zero_()

    def _expand_rows(self, plan: StepPlan, n: int) -> None:
        """tok_slot[:n] and tok_gen[:n] from a few numbers per request, on the device: a
        row's batch index is the number of requests ending at or before it (rows past the
        batch's tokens, padding, get the index past the last request, whose slot is 0), its
        slot that request's, and it is generated from the request's first generated row
        on. One small upload and one kernel a step (four torch ops without Triton),
        whatever the number of rows; the host builds nothing per row (a prefill step has
        thousands)."""
        self.filled_slot = 0
        if plan.batch_hooks is None:
            self.tok_slot[:n].zero_()
            return
        idx, slots, first_gen = plan.batch_hooks
        ends = plan.query_ends
        m = len(ends)  # requests in the batch; index m is the padding's
        host = np.zeros(3 * m + 2, np.int64)  # [ends (m) | slots (m + 1) | first gen (m + 1)]
        host[:m] = ends
        host[m + idx] = slots
        host[2 * m + 1 + idx] = first_gen
        dev = self.batch_index[: len(host)]
        self._upload_into(dev, host)
        if self.use_kernel:  # one launch
            tap_kernel.expand_rows(self.batch_index, m, self.tok_slot[:n], self.tok_gen[:n],
                                   self.max_tokens)
            return
        ends, slots, first_gen = dev[:m], dev[m: 2 * m + 1], dev[2 * m + 1:]
        rows, batch = self.row_ids[:n], self.tok_request[:n]
        torch.searchsorted(ends, rows, right=True, out=batch)
        torch.index_select(slots, 0, batch, out=self.tok_slot[:n])
        torch.index_select(first_gen, 0, batch, out=self.tok_gen[:n])
        torch.ge(rows, self.tok_gen[:n], out=self.tok_gen[:n])

    def _update_point_base(self, plan: StepPlan) -> None:
        """point_base = this step's routes, -1 elsewhere, by scattering only the entries
        that change: the routes' (value: first staging row) and the last step's that no
        route of this step sets again (value: -1)."""
        keys, values = route_entries(plan.routes, plan.staging_offset, self.num_sites)
        stale = np.setdiff1d(self.point_base_set, keys)
        k = len(stale) + len(keys)
        update = np.empty((2, k), np.int64)
        update[0, :len(stale)] = stale
        update[0, len(stale):] = keys
        update[1, :len(stale)] = -1
        update[1, len(stale):] = values
        dev = self.point_updates[:2 * k].view(2, k)  # contiguous: one plain async copy
        self._upload_into(dev, update)
        self.point_base.view(-1).scatter_(0, dev[0], dev[1])
        self.point_base_set = keys

    def reset_dense(self) -> None:
        """After a hooked step: rows of later steps map to slot 0 (no hooks) until re-planned."""
        self.tok_slot.zero_()
        self.filled_slot = 0
        self.tok_rank.fill_(-1)
        self.ranks_set = False
        self.patch_table.write_ranks(None, 0, self._upload_into)
        self.plan = StepPlan(active_sites=frozenset())

    def gather_tokens(self, input_ids: torch.Tensor) -> int:
        """Copy the input ids of captured rows next to the activations (device mode)."""
        rows = self.plan.token_rows
        if rows is None:
            return 0
        idx = self._upload(rows)
        k = len(rows)
        self.token_stage[:k].copy_(input_ids[idx])
        return k

    def tap(self, x: torch.Tensor, residual: torch.Tensor | None, site: int,
            kinds: int = BOTH) -> None:
        if self.device_driven:
            active = self.plan.active_sites
            if active is not None and site not in active:
                if not (self.graph_taps and self._capturing()):
                    return  # no request uses this site this step (a hooked graph records it)
            elif not self.graph_taps and self._capturing():
                return  # the plain graphs: replayed only in steps without hooks
            self._tap_dense(x, residual, site, kinds)
        else:
            self._tap_host(x, residual, site, kinds)

    def _capturing(self) -> bool:
        """Whether a CUDA graph is being recorded (a hooked graph holds every site's kernel:
        which sites a later replay's requests use is data)."""
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def step_needs_taps(self) -> bool:
        """Whether this step's forward must run the tap kernels (`active_sites` None: every
        site may). Read by the CUDA-graph choice before each replay (vllm.graphs.PlainGraphs):
        a step of plain requests replays graphs recorded without the taps."""
        active = self.plan.active_sites
        return active is None or bool(active)

    def _tap_host(self, x: torch.Tensor, residual: torch.Tensor | None, site: int,
                  kinds: int) -> None:
        self.fired[site] += 1
        plan = self.plan
        if plan.empty:
            return
        for kind in KINDS:
            if not kinds >> kind & 1:
                continue
            steer = plan.steer.get((kind, site))
            if steer is not None:
                rows, entries = steer
                xs = x[rows].float()
                src = xs if kind == SUB or residual is None else xs + residual[rows].float()
                # Host mode has no graphs: host branches on the tables' contents are fine.
                steered = steer_rows(self, xs, src, entries, self.masked_entries > 0)
                if self.gated_entries:
                    steered = torch.where(passes(self, src, entries), steered, xs)
                x[rows] = steered.to(x.dtype)
            if (kind, site) in plan.patch:  # after the steering, before the copies
                patches.apply(x, residual, kind, *plan.patch[(kind, site)])
            rows = plan.capture.get((kind, site))
            if rows is not None:
                val = x[rows]  # advanced indexing copies: later in-place kernels cannot touch it
                if kind == STREAM and residual is not None:  # residual may be an fp32 copy
                    val = (val + residual[rows]).to(x.dtype)
                if site in self.shards:  # every rank's plan copies these rows (request_book)
                    val = self.gather_columns(val)
                self.captured[(kind, site)] = val

    def _tap_dense(self, x: torch.Tensor, residual: torch.Tensor | None, site: int,
                   kinds: int) -> None:
        if self.use_kernel and x.stride(-1) == 1 and (residual is None or residual.stride(-1) == 1):
            tap_kernel.tap(self, x, residual, site, kinds)
            return
        self._tap_dense_torch(x, residual, site, kinds)

    def _tap_dense_torch(self, x: torch.Tensor, residual: torch.Tensor | None, site: int,
                         kinds: int = BOTH) -> None:
        """Reference: the same arithmetic as full-tensor torch ops (every row, every site)."""
        n = x.shape[0]
        slot, gen, rank = self.tok_slot[:n], self.tok_gen[:n], self.tok_rank[:n]
        for kind in KINDS:
            if not kinds >> kind & 1:
                continue
            entries = self.slot_entry[slot, gen, kind, site]
            xf = x.float()
            src = xf if kind == SUB or residual is None else xf + residual.float()
            steered = steer_rows(self, xf, src, entries)
            # Always evaluated (a graph recorded now replays with later requests' gates).
            x.copy_(torch.where(passes(self, src, entries), steered, xf).to(x.dtype))
            self.patch_table.apply_dense(x, residual, slot, kind, site)
            val = x if kind == SUB or residual is None else (x + residual).to(x.dtype)
            base = self.point_base[slot, kind, site]
            dst = torch.where((base >= 0) & (rank >= 0), base + rank,
                              torch.full_like(base, self.trash_row))
            self.staging[:, :x.shape[-1]].index_copy_(0, dst, val)

    def take_captured(self) -> dict[tuple[int, int], torch.Tensor]:
        out, self.captured = self.captured, {}  # host mode: this step's copies, in plan order
        return out
