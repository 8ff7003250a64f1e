"""Activation patching (api.md §7, `op: patch`) without an engine: the item's checks
against its capture, the wire form, the plan's rows and the tap op's replacement, and the
server's capture lookup (pending, failed, missing)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from capsteer.capture.manifest import publish_unreached
from capsteer.capture.spec import parse_capture_spec
from capsteer.engine_ext.plan import RequestHooks, build_step_plan
from capsteer.engine_ext.runtime import STREAM, SUB, HookRuntime, hook_point
from capsteer.hooks import ALIASES, HOOKS
from capsteer.server.patch_sources import CaptureSources
from capsteer.server.tracker import CaptureTracker
from capsteer.steering import patches as patch_mod
from capsteer.steering.patches import PatchSource, PatchSourceError
from capsteer.steering.spec import SteeringSpec, SteeringSpecError, parse_steering_spec
from tests.unit.helpers import HIDDEN, LAYERS, runtime

CAPTURED = np.arange(10, dtype=np.int64)  # positions 0..9
ROWS = {(hook, layer): np.random.default_rng(layer * 7 + len(hook)).standard_normal(
    (10, HIDDEN)).astype(np.float32) for hook in ("resid_post", "mlp_out") for layer in (0, 1)}


def _source(capture_id: str, rows=None, positions=CAPTURED) -> PatchSource:
    if capture_id == "cap-pending":
        raise PatchSourceError("capture cap-pending is still pending")
    if capture_id != "cap-a":
        raise KeyError(capture_id)
    return PatchSource.of_tensors(capture_id, "demo", positions, rows or ROWS)


def _item(**kw) -> dict:
    source = {"capture_id": kw.pop("capture_id", "cap-a"), "positions": kw.pop("positions", [2, 5])}
    where = {} if "layers" in kw else {"layer": 1}
    return {"op": "patch", "hook": "resid_post", **where, "source": source, **kw}


def _parse(*items, getter=_source):
    return parse_steering_spec({"vectors": list(items)}, num_layers=LAYERS, hidden_size=HIDDEN,
                               patches=getter)


def test_a_patch_carries_the_captured_rows_at_its_positions():
    spec = _parse(_item(positions=[5, 2]), _item(hook="mlp_out", layers=[0, 1], positions=[9]))
    assert spec is not None and spec.ops == () and not spec.is_noop
    first, *mlp = spec.patches
    assert first.positions.tolist() == [2, 5]  # sorted
    assert np.array_equal(first.values, ROWS[("resid_post", 1)][[2, 5]])
    assert [(p.hook, p.layer) for p in mlp] == [("mlp_out", 0), ("mlp_out", 1)]
    assert np.array_equal(mlp[1].values, ROWS[("mlp_out", 1)][[9]])


def test_the_wire_form_keeps_the_patches_and_the_key_hashes_them():
    spec = _parse(_item(), {"hook": "resid_post", "layer": 0, "vector": [0.5] * HIDDEN})
    for wire in (spec.wire_text, spec.to_dict()):
        back = SteeringSpec.from_wire(wire)
        assert len(back.patches) == 1 and len(back.ops) == 1
        assert np.array_equal(back.patches[0].values, spec.patches[0].values)
        assert back.patches[0].positions.tolist() == [2, 5]
    other = _parse(_item(positions=[2, 6]), {"hook": "resid_post", "layer": 0,
                                             "vector": [0.5] * HIDDEN})
    assert other.sharing_key != spec.sharing_key
    assert other.cache_salt() != spec.cache_salt()
    assert _parse(_item()).sharing_key == _parse(_item()).sharing_key


WIDE = {k: np.zeros((10, HIDDEN + 1), np.float32) for k in ROWS}
NAN = {k: np.full((10, HIDDEN), np.nan, np.float32) for k in ROWS}
BAD = [
    ("missing capture", [_item(capture_id="cap-gone")], "steering.vectors[0].source.capture_id",
     _source),
    ("pending capture", [_item(capture_id="cap-pending")],
     "steering.vectors[0].source.capture_id", _source),
    ("hook not captured", [_item(hook="resid_mid")], "steering.vectors[0].hook", _source),
    ("layer not captured", [_item(layer=2)], "steering.vectors[0].layer", _source),
    ("position not captured", [_item(positions=[3, 12])],
     "steering.vectors[0].source.positions", _source),
    ("width mismatch", [_item()], "steering.vectors[0].source.capture_id",
     lambda cid: _source(cid, WIDE)),
    ("non-finite rows", [_item()], "steering.vectors[0].source.capture_id",
     lambda cid: _source(cid, NAN)),
    ("negative position", [_item(positions=[-1])], "steering.vectors[0].source.positions",
     _source),
    ("position past int64", [_item(positions=[2**70])], "steering.vectors[0].source.positions",
     _source),
    ("position twice", [_item(positions=[2, 2])], "steering.vectors[0].source.positions",
     _source),
    ("positions not a list", [_item(positions="prompt")],
     "steering.vectors[0].source.positions", _source),
    ("bool position", [_item(positions=[True])], "steering.vectors[0].source.positions",
     _source),
    ("capture id not a string", [_item(capture_id=7)], "steering.vectors[0].source.capture_id",
     _source),
    ("no source", [{"op": "patch", "hook": "resid_post", "layer": 1}],
     "steering.vectors[0].source", _source),
    ("no layer", [{"op": "patch", "source": {"capture_id": "cap-a", "positions": [1]}}],
     "steering.vectors[0].layer", _source),
    ("unknown source field", [{**_item(), "source": {"capture_id": "cap-a", "positions": [1],
                                                     "path": "/tmp"}}],
     "steering.vectors[0].source", _source),
    ("a scale on a patch", [_item(scale=2.0)], "steering.vectors[0]", _source),
    ("no captures here", [_item()], "steering.vectors[0].source.capture_id", None),
    ("patched twice at one point", [_item(positions=[2, 3]), _item(positions=[3])],
     "steering.vectors", _source),
    ("resid_post L is resid_pre L+1", [_item(layer=0, positions=[4]),
                                       _item(hook="resid_pre", layer=1, positions=[4])],
     "steering.vectors", lambda cid: _source(cid, {**ROWS, ("resid_pre", 1): ROWS[
         ("resid_post", 0)]})),
]


@pytest.mark.parametrize(("items", "field", "getter"), [b[1:] for b in BAD],
                         ids=[b[0] for b in BAD])
def test_bad_patches_name_the_field(items, field, getter):
    with pytest.raises(SteeringSpecError) as info:
        _parse(*items, getter=getter)
    assert info.value.field == field, info.value


def test_patch_floats_are_bounded(monkeypatch):
    monkeypatch.setattr(patch_mod, "MAX_PATCH_FLOATS", 3 * HIDDEN)
    _parse(_item(positions=[1, 2, 3]))
    with pytest.raises(SteeringSpecError) as info:
        _parse(_item(positions=[1, 2, 3, 4]))
    assert info.value.field == "steering.vectors" and "floats" in info.value.reason


def _hooks(req_id: str, spec: SteeringSpec, prompt_len: int, rt: HookRuntime) -> RequestHooks:
    return RequestHooks.from_extra_args(req_id, {"capsteer": {"steering": spec.wire_text,
                                                              "steering_key": spec.sharing_key}},
                                        prompt_len, rt)


def test_the_tap_sets_the_patched_rows_and_nothing_else():
    """Two requests in one step (one patched, chunked: rows 0-3 are its positions 4-7), a
    stream point in the deferred layout (the stream is x + residual) and a sublayer point;
    a capture at the patched point records the patched values."""
    rt = runtime()
    spec = _parse(_item(layer=0, positions=[5, 7, 9]), _item(hook="mlp_out", layer=1,
                                                              positions=[4]))
    patched = _hooks("p", spec, 8, rt)
    capture = parse_capture_spec({"hooks": ["resid_post"], "layers": [0], "positions": "all"},
                                 num_layers=LAYERS)
    patched.capture, patched.capture_id = capture, "cap-p"
    patched.points = {hook_point("resid_post", 0, LAYERS): (("resid_post", 0),)}
    plain = RequestHooks("q", 3)
    plan = build_step_plan(["p", "q"], np.array([0, 4, 7]), np.array([4, 0]),
                           {"p": patched, "q": plain}, None)
    rt.set_plan(plan, 7)
    stream_site = hook_point("resid_post", 0, LAYERS)[1]
    x, residual = torch.randn(7, HIDDEN), torch.randn(7, HIDDEN)
    x0 = x.clone()
    rt.tap(x, residual, stream_site)
    stream = x + residual
    rows = ROWS[("resid_post", 0)]
    assert torch.allclose(stream[[1, 3]], torch.from_numpy(rows[[5, 7]]), atol=1e-6)
    assert torch.equal(x[[0, 2, 4, 5, 6]], x0[[0, 2, 4, 5, 6]])  # position 9 is not fed yet
    copied = rt.take_captured()[(STREAM, stream_site)]
    assert torch.allclose(copied[[1, 3]], torch.from_numpy(rows[[5, 7]]), atol=1e-6)
    sub_site = hook_point("mlp_out", 1, LAYERS)[1]
    out = torch.randn(7, HIDDEN)
    out0 = out.clone()
    rt.tap(out, torch.randn(7, HIDDEN), sub_site)
    assert torch.equal(out[0], torch.from_numpy(ROWS[("mlp_out", 1)][4]))
    assert torch.equal(out[1:], out0[1:])
    assert (SUB, sub_site) in plan.patch and stream_site in patched.sites


def test_device_mode_patches_as_host_mode_and_gives_its_rows_back():
    """The graph-safe path (fixed table, per-row ranks; the torch reference of the kernel,
    which tests/unit/tap_kernel_check.py compares with Triton) sets the same values as
    host mode; a request that leaves frees its rows, and a later step patches nothing."""
    spec = _parse(_item(layer=0, positions=[5, 7, 9]), _item(hook="mlp_out", layer=1,
                                                              positions=[4]))
    gen = torch.Generator().manual_seed(5)
    x0, residual, out0 = (torch.randn(7, HIDDEN, generator=gen) for _ in range(3))
    stream_site = hook_point("resid_post", 0, LAYERS)[1]
    sub_site = hook_point("mlp_out", 1, LAYERS)[1]
    results = []
    for dense in (False, True):
        rt = HookRuntime(LAYERS, HIDDEN, torch.float32, torch.device("cpu"), max_tokens=64,
                         device_driven=dense, staging_rows=8, patch_rows=8)
        hooks = {"p": _hooks("p", spec, 8, rt), "q": RequestHooks("q", 3)}
        plan = build_step_plan(["p", "q"], np.array([0, 4, 7]), np.array([4, 0]), hooks, None,
                               host_steering=not dense)
        rt.set_plan(plan, 7)
        x, out = x0.clone(), out0.clone()
        rt.tap(x, residual, stream_site)
        rt.tap(out, residual, sub_site)
        results.append((x, out))
        if dense:
            table = rt.patch_table
            assert table.free == []  # a block per point for the union of 4 positions
            with pytest.raises(RuntimeError, match="patch table full"):
                _hooks("r", spec, 8, rt)
            assert rt.free_slots[-1] == 2  # the refused request's slot came back
            hooks["p"].release(rt)
            assert table.free == [(0, 8)] and int((table.base >= 0).sum()) == 0
            rt.set_plan(build_step_plan(["q"], np.array([0, 3]), np.array([3]), hooks, None,
                                        host_steering=False), 3)
            assert int((table.rank >= 0).sum()) == 0
    (hx, hout), (dx, dout) = results
    assert torch.equal(hx, dx) and torch.equal(hout, dout)
    assert torch.allclose((dx + residual)[[1, 3]],
                          torch.from_numpy(ROWS[("resid_post", 0)][[5, 7]]), atol=1e-6)
    assert not torch.equal(dx, x0)


def test_the_servers_lookup_tells_pending_failed_and_missing_apart(tmp_path):
    spec = parse_capture_spec({"hooks": ["resid_post"]}, num_layers=LAYERS)

    async def scenario() -> None:
        tracker = CaptureTracker(tmp_path, 1 << 20, model="demo")
        sources = CaptureSources(tmp_path, tracker, "demo")
        tracker.track("cap-flying", spec)
        with pytest.raises(PatchSourceError, match="pending"):
            sources("cap-flying")
        with pytest.raises(KeyError):
            sources("cap-unknown")
        with pytest.raises(KeyError):
            sources("../escape")
        publish_unreached(tmp_path, "cap-failed", spec=spec, model="demo", reason="aborted")
        with pytest.raises(PatchSourceError, match="status error"):
            sources("cap-failed")
        tracker.untrack("cap-flying")
    asyncio.run(scenario())



_UNKNOWN = f"unknown hook 'nope'; accepted: {', '.join((*HOOKS, *ALIASES))}"
_GONE = {"resid_mid": "this model's blocks are parallel: it has no resid_mid"}
HOOK_REFUSALS = [
    ("unknown hook, steered", {"hook": "nope", "layer": 0, "vector": [1.0] * HIDDEN},
     _UNKNOWN),
    ("unknown hook, patched", _item(hook="nope"), _UNKNOWN),
    ("unavailable hook, steered", {"hook": "post_attn", "layer": 0, "vector": [1.0] * HIDDEN},
     _GONE["resid_mid"]),
    ("unavailable hook, patched", _item(hook="resid_mid"), _GONE["resid_mid"]),
    ("read-only hook, steered", {"hook": "router_logits", "layer": 0, "vector": [1.0]},
     "router_logits is read only (capture and readout): steering it is not offered"),
    ("read-only hook, patched", _item(hook="router_logits"),
     "op patch acts on hooks of the model's hidden size for now, not on router_logits"),
    ("wide hook, patched", _item(hook="mlp.hook_post"),
     "op patch acts on hooks of the model's hidden size for now, not on mlp_post"),
]


@pytest.mark.parametrize(("item", "reason"), [r[1:] for r in HOOK_REFUSALS],
                         ids=[r[0] for r in HOOK_REFUSALS])
def test_hook_refusals_read_alike_for_steered_and_patched_items(item, reason):
    """Both item kinds parse their hook in one function (hooks.parse_item_hook): the
    field and the reason each 400 gives stay exactly these."""
    with pytest.raises(SteeringSpecError) as info:
        parse_steering_spec({"vectors": [{"hook": "resid_post", "layer": 0,
                                          "vector": [0.0] * HIDDEN}, item]},
                            num_layers=LAYERS, hidden_size=HIDDEN, patches=_source,
                            unavailable=_GONE)
    assert info.value.field == "steering.vectors[1].hook"
    assert info.value.reason == reason
