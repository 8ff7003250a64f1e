"""A step's routes as the plan builds them (slices of its flat arrays for the range
position kinds, masks otherwise) hold exactly each request's kept positions and rows, and
the whole-array tables built from them equal what route-by-route assignment leaves."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from capsteer.capture.spec import parse_positions
from capsteer.engine_ext.plan import RequestHooks, build_step_plan
from capsteer.engine_ext.route_arrays import route_entries, route_ranks
from capsteer.engine_ext.runtime import HookRuntime, hook_point
from capsteer.steering.readers.readout import ReadoutItem
from tests.unit.helpers import HIDDEN, LAYERS, hooks_for

pytestmark = pytest.mark.unit
POSITIONS = ("all", "prompt", "generated", "last_prompt", "last", [1, 4, 6])


def _mixed_step(dense: bool):
    """A batch of every position kind: prefill chunks crossing the prompt's end, decode
    rows, a recompute from position 0 after decoding, a plain request, readouts of one and
    two items, and a request with hooks that finished (in the book, not in the batch)."""
    rt = HookRuntime(LAYERS, HIDDEN, torch.float32, torch.device("cpu"), max_tokens=128,
                     max_requests=64, staging_rows=256, device_driven=dense)
    reqs, ids, lens, starts = {}, [], [], []
    for i, positions in enumerate(POSITIONS):
        for n, start in ((4, 2), (1, 7), (5, 0)):  # chunk over the prompt's end, decode, recompute
            rid = f"c{i}-{start}"
            reqs[rid] = hooks_for(rid, 5, rt=rt, capture={
                "hooks": ["resid_post", "attn_out"], "layers": [1], "positions": positions})
            reqs[rid].fed_len = 8 if start == 0 else 0
            ids.append(rid), lens.append(n), starts.append(start)
            ro = RequestHooks(req_id="r" + rid, prompt_len=5)
            other = POSITIONS[(i + 1) % len(POSITIONS)]
            ro.readout_items = tuple(
                ReadoutItem(j, None, None, "resid_post", 0, parse_positions(p), None, None)
                for j, p in enumerate([positions] if start else [positions, other]))
            ro.readout_id = "ro-" + rid
            ro.readout_points = {hook_point("resid_post", 0, LAYERS): (("resid_post", 0),)}
            ro.slot = rt.alloc_slot({}) if dense else 0
            reqs[ro.req_id] = ro
            ids.append(ro.req_id), lens.append(n), starts.append(start)
    ids.insert(3, "plain"), lens.insert(3, 2), starts.insert(3, 0)
    reqs["gone"] = hooks_for("gone", 5, rt=rt, capture={"hooks": ["resid_post"], "layers": [1]})
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    return rt, reqs, ids, qsl, np.array(starts, np.int32)


@pytest.mark.parametrize("dense", [False, True])
def test_routes_hold_each_requests_kept_positions_and_rows(dense):
    _, reqs, ids, qsl, starts = _mixed_step(dense)
    ids_host = None if dense else torch.arange(1000, 1000 + int(qsl[-1]))
    plan = build_step_plan(ids, qsl, starts, reqs, ids_host, host_steering=not dense)
    want, counts, tokens = [], {}, {}
    for b, rid in enumerate(ids):
        h = reqs.get(rid)
        if h is None:
            continue
        pos = np.arange(starts[b], starts[b] + qsl[b + 1] - qsl[b])
        rows = np.arange(qsl[b], qsl[b + 1])
        if h.readout_id is not None:
            keep = np.zeros(len(pos), bool)
            for item in h.readout_items:
                keep |= item.positions.candidate(pos, h.prompt_len)
            if keep.any():
                want += [(h.readout_id, p, k, pos[keep], rows[keep], h.slot)
                         for p, k in h.readout_points.items()]
        if h.capture is not None:
            keep = h.capture.positions.candidate(pos, h.prompt_len)
            if keep.any():
                want += [(h.capture_id, p, k, pos[keep], rows[keep], h.slot)
                         for p, k in h.points.items()]
                gen = keep & (pos >= h.prompt_len)
                if gen.any():
                    tokens[rid] = (pos[gen], rows[gen])
    assert len(plan.routes) == len(want) > 20
    for route, (cid, point, keys, pos, rows, slot) in zip(plan.routes, want, strict=True):
        assert (route.capture_id, route.point, route.keys, route.slot) == (cid, point, keys, slot)
        assert route.positions.tolist() == pos.tolist() and route.rows.tolist() == rows.tolist()
        assert route.offset == counts.get(point, 0)  # each point's rows back to back
        counts[point] = route.offset + len(pos)
    assert plan.staging_rows == sum(counts.values())
    if dense:
        assert [(r, p.tolist()) for r, p in plan.token_owners] == [
            (r, p.tolist()) for r, (p, _) in tokens.items()]
        assert plan.token_rows.tolist() == [x for _, rs in tokens.values() for x in rs.tolist()]
    else:
        for rid, (pos, rows) in tokens.items():
            assert reqs[rid].tokens == dict(zip(pos.tolist(), (rows + 1000).tolist(),
                                                strict=True))
        for point, rows in plan.capture.items():
            assert rows.tolist() == [x for r in plan.routes if r.point == point
                                     for x in r.rows.tolist()]
    for b, rid in enumerate(ids):  # past its last row fed; a recompute keeps what it had
        if rid.startswith("c"):
            end = int(starts[b] + qsl[b + 1] - qsl[b])
            assert reqs[rid].fed_len == (8 if starts[b] == 0 else end)
    assert reqs["gone"].fed_len == 0

def test_route_tables_equal_route_by_route_assignment():
    """Ranks and copy-table entries: a later route wins a shared row or entry, as when
    each route was assigned in turn (a readout and a capture of one request)."""
    rt, reqs, ids, qsl, starts = _mixed_step(True)
    for rid in ids:  # captures that read out too: their rows and entries collide
        if rid.startswith("c") and not rid.endswith("-0"):
            h = reqs[rid]
            h.readout_items = (ReadoutItem(0, None, None, "resid_post", 1,
                                           parse_positions("prompt"), None, None),)
            h.readout_id = "ro-own-" + rid
            h.readout_points = {hook_point("resid_post", 1, LAYERS): (("resid_post", 1),)}
    plan = build_step_plan(ids, qsl, starts, reqs, None, host_steering=False)
    n = int(qsl[-1])
    want = np.full(n, -1, np.int64)
    entries = {}
    for route in plan.routes:
        want[route.rows] = np.arange(len(route.rows))
        kind, site = route.point
        entries[(route.slot * 2 + kind) * rt.num_sites + site] = \
            plan.staging_offset[route.point] + route.offset
    got = np.full(n, -1, np.int64)
    rows, ranks = route_ranks(plan.routes)
    got[rows] = ranks
    assert got.tolist() == want.tolist() and (want >= 0).sum() > 20
    keys, values = route_entries(plan.routes, plan.staging_offset, rt.num_sites)
    assert dict(zip(keys.tolist(), values.tolist(), strict=True)) == entries
    assert len(keys) == len(entries) < len(plan.routes)
