"""Run under TRITON_INTERPRET=1 (see test_tap_kernel.py): the Triton tap kernel against
the torch reference on one mixed plan (steered, captured, plain rows; bf16 and fp32)."""

from __future__ import annotations

import functools
import sys

import numpy as np
import torch

from capsteer.engine_ext import tap_kernel
from capsteer.engine_ext.families import STREAM_BIT, SUB_BIT, inner_site
from capsteer.engine_ext.plan import build_step_plan
from capsteer.engine_ext.runtime import HookRuntime
from tests.unit.helpers import HIDDEN, LAYERS, hooks_for, patch_source, probe_readers


def run(dtype: torch.dtype, layout: str, device: str = "cpu") -> None:
    """`deferred`: one call per site carries both kinds (sublayer output + residual, as
    before vLLM's fused add+norm); `materialized`: one call per kind, no residual.
    `device` cuda: the compiled kernel, launched by the JIT and then directly (the same
    specialisation at later sites), on the lent GPU (tests/gpu/gpu_tap_gate_check.py)."""
    results = []
    for use_kernel in (True, False):
        rt = HookRuntime(LAYERS, HIDDEN, dtype, torch.device(device), max_tokens=64,
                         staging_rows=256, device_driven=True)
        reqs = {
            "a": hooks_for("a", 3, rt=rt, capture={"hooks": ["resid_mid", "attn_out"],
                                                   "positions": "all"},
                           steering={"vectors": [{"hook": "attn_out", "layer": 1,
                                                  "vector": [0.3] * HIDDEN, "scale": 2.0}]}),
            "b": hooks_for("b", 2, rt=rt, steering={"vectors": [
                {"hook": "resid_mid", "layer": 1, "vector": [1.0] + [0.0] * (HIDDEN - 1),
                 "op": "clamp", "value": 4.0}]}),
            "c": hooks_for("c", 4, rt=rt, capture={"hooks": ["resid_pre", "resid_post"],
                                                   "layers": "all"}),
            # A projection of a sublayer output and an add to the stream at the same site,
            # with copies of both.
            "d": hooks_for("d", 2, rt=rt, capture={"hooks": ["mlp_out", "resid_post"],
                                                   "layers": [0], "positions": "all"},
                           steering={"vectors": [
                               {"hook": "mlp_out", "layer": 0, "op": "ablate",
                                "vector": [0.0, 1.0] + [0.0] * (HIDDEN - 2)},
                               {"hook": "resid_post", "layer": 0, "vector": [0.5] * HIDDEN}]}),
            # `when` gates: a projection of a sublayer output and an add to the stream,
            # each applied only at the rows whose probe score passes, with copies.
            "e": hooks_for("e", 3, rt=rt, readers=probe_readers(4), capture={
                "hooks": ["attn_out", "resid_post"], "layers": [1], "positions": "all"},
                steering={"vectors": [
                    {"hook": "attn_out", "layer": 1, "op": "clamp", "value": 3.0,
                     "vector": [1.0] * HIDDEN,
                     "when": {"reader": {"name": "probe"}, "index": 0, "above": 0.0}},
                    {"hook": "resid_post", "layer": 1, "vector": [0.7] * HIDDEN, "scale": 2.0,
                     "when": {"reader": {"name": "probe"}, "index": 1, "below": 0.1}}]}),
            # The MLP's input (an inner site after the stream's): clamped at one layer,
            # added to at another, copied at every layer.
            "f": hooks_for("f", 1, rt=rt, capture={"hooks": ["mlp_in", "mlp_out"],
                                                   "positions": "all"},
                           steering={"vectors": [
                               {"hook": "mlp_in", "layer": 0, "op": "clamp", "value": 3.0,
                                "vector": [0.0, 0.0, 1.0] + [0.0] * (HIDDEN - 3)},
                               {"hook": "mlp_in", "layer": 2, "vector": [0.25] * HIDDEN}]}),
            # Patches (op: patch): the stream at resid_post 0 after an add there, and the
            # MLP's output at layer 1, at some of its rows (positions 3-6), with a copy.
            "g": hooks_for("g", 5, rt=rt, patches=patch_source(), capture={
                "hooks": ["resid_post"], "layers": [0], "positions": "all"}, steering={
                "vectors": [
                    {"hook": "resid_post", "layer": 0, "vector": [0.5] * HIDDEN},
                    {"op": "patch", "hook": "resid_post", "layer": 0,
                     "source": {"capture_id": "cap-src", "positions": [4, 6, 9]}},
                    {"op": "patch", "hook": "mlp_out", "layer": 1,
                     "source": {"capture_id": "cap-src", "positions": [3, 5]}}]}),
        }
        plan = build_step_plan(["a", "plain", "b", "c", "d", "e", "f", "g"],
                               np.array([0, 3, 5, 9, 12, 15, 23, 24, 28]),
                               np.array([2, 0, 0, 1, 0, 0, 0, 3]), reqs, None,
                               host_steering=False)
        assert plan.patch_ranks is not None
        rt.set_plan(plan, 28)
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(28, HIDDEN, generator=gen).to(dtype)
        res = torch.randn(28, HIDDEN, generator=gen).to(dtype)
        stream = torch.randn(28, HIDDEN, generator=gen).to(dtype)
        normed = torch.randn(28, HIDDEN, generator=gen).to(dtype)
        # e's first gate reads its rows' unsteered sublayer output: some pass, some not.
        probe = probe_readers(4)("probe")
        passes = (x[15:23].float() @ probe.weight[0] + probe.bias[0]) > 0
        assert 0 < int(passes.sum()) < 8, passes
        x, res, stream, normed = x.to(device), res.to(device), stream.to(device), normed.to(device)
        tap = functools.partial(tap_kernel.tap, rt) if use_kernel else rt._tap_dense_torch
        for site in range(2 * LAYERS + 1):
            if layout == "deferred":
                tap(x, None if site == 0 else res, site)
                continue
            for t, kinds in ((x, SUB_BIT), (stream, STREAM_BIT)):
                tap(t, None, site, kinds)
        before = normed.clone()
        for layer in range(LAYERS):  # mlp_in: one call per layer, its own tensor
            tap(normed, None, inner_site("mlp_in", layer, LAYERS), SUB_BIT)
        # Only f's row (23) is steered: clamped to 3 along e_2, then 0.25 added.
        assert torch.equal(normed[:23], before[:23]) and torch.equal(normed[24:], before[24:])
        if layout == "materialized":  # g's patched rows hold the capture's values (nothing
            # of g acts at later sites of the same kind)
            rows, close = patch_source().rows, dict(atol=2e-2, rtol=2e-2)  # bf16's rounding
            torch.testing.assert_close(x[[24, 26]].cpu().float(), rows[("mlp_out", 1)][[3, 5]],
                                       **close)
            torch.testing.assert_close(stream[[25, 27]].cpu().float(),
                                       rows[("resid_post", 0)][[4, 6]], **close)
        assert abs(float(normed[23, 2]) - 3.25) < 1e-2, normed[23]
        results.append((x.cpu(), stream.cpu(), normed.cpu(),
                        rt.staging[: plan.staging_rows].cpu()))
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for got, want in zip(results[0], results[1], strict=True):
        torch.testing.assert_close(got, want, **tol)
    assert results[0][3].abs().sum() > 0


WIDE = 2 * HIDDEN + 8  # mlp_post's width here: the tables' rows are wider than the stream's


def run_wide(dtype: torch.dtype, device: str = "cpu") -> None:
    """A hook wider than the stream (mlp_post, d_mlp) with neuron selections, beside stream
    sites, in tables as wide as the widest hook: the kernel equals the torch reference,
    clamps and ablates only the selected neurons, adds only at the selected ones, and
    copies each site's own width."""
    results = []
    widths = {"mlp_post": WIDE}
    picked = [0, 5, WIDE - 1]
    for use_kernel in (True, False):
        rt = HookRuntime(LAYERS, HIDDEN, dtype, torch.device(device), max_tokens=64,
                         staging_rows=256, device_driven=True, hook_widths=widths)
        assert rt.width == WIDE and rt.u.shape[1] == WIDE
        reqs = {
            "g": hooks_for("g", 2, rt=rt, widths=widths, capture={
                "hooks": ["mlp_post", "resid_pre"], "layers": [1], "positions": "all"},
                steering={"vectors": [
                    {"hook": "mlp_post", "layer": 1, "op": "clamp", "value": 2.0,
                     "neurons": picked},
                    {"hook": "mlp_post", "layer": 1, "vector": [0.5] * WIDE, "neurons": [7]},
                    {"hook": "resid_pre", "layer": 1, "vector": [0.25] * HIDDEN},
                    {"hook": "mlp_post", "layer": 2, "op": "ablate",
                     "vector": [0.0, 0.0, 0.0, 1.0] + [0.0] * (WIDE - 4)}]}),
            "h": hooks_for("h", 3, rt=rt, widths=widths, capture={
                "hooks": ["mlp_post"], "layers": [1, 2], "positions": "all"}),
        }
        plan = build_step_plan(["plain", "g", "h"], np.array([0, 2, 4, 7]),
                               np.array([0, 0, 0]), reqs, None, host_steering=False)
        rt.set_plan(plan, 7)
        gen = torch.Generator().manual_seed(2)
        stream = torch.randn(7, HIDDEN, generator=gen).to(dtype).to(device)
        hid = [torch.randn(7, WIDE, generator=gen).to(dtype).to(device) for _ in range(LAYERS)]
        before = [h.clone() for h in hid]
        tap = functools.partial(tap_kernel.tap, rt) if use_kernel else rt._tap_dense_torch
        for site in range(2 * LAYERS + 1):
            tap(stream, None, site, STREAM_BIT)
        for layer in range(LAYERS):
            tap(hid[layer], None, inner_site("mlp_post", layer, LAYERS), SUB_BIT)
        g = slice(2, 4)
        others = [i for i in range(WIDE) if i not in picked and i != 7]
        assert torch.equal(hid[1][:2], before[1][:2]) and torch.equal(hid[1][4:], before[1][4:])
        assert torch.equal(hid[1][g][:, others], before[1][g][:, others])
        assert torch.allclose(hid[1][g][:, picked].float(), torch.full((2, 3), 2.0))
        assert torch.allclose(hid[1][g][:, 7].float(), before[1][g][:, 7].float() + 0.5,
                              atol=2e-2)
        assert torch.equal(hid[2][g][:, 3], torch.zeros_like(hid[2][g][:, 3]))
        assert torch.equal(hid[2][g][:, 4:], before[2][g][:, 4:])
        post1 = inner_site("mlp_post", 1, LAYERS)
        off = plan.staging_offset[(0, post1)]
        # g's two rows then h's three, each the whole d_mlp row as steered
        torch.testing.assert_close(rt.staging[off: off + 5, :WIDE].cpu(), hid[1][2:7].cpu())
        results.append((stream.cpu(), *[h.cpu() for h in hid],
                        rt.staging[: plan.staging_rows].cpu()))
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for got, want in zip(results[0], results[1], strict=True):
        torch.testing.assert_close(got, want, **tol)


def check_expand() -> None:
    """The one-launch row expansion equals searchsorted + gather (what the runtime's torch
    path runs) on random batches (requests ending on the same row, padding rows, more rows
    than one block)."""
    rng = np.random.default_rng(3)
    for _ in range(20):
        m = int(rng.integers(1, 40))
        ends = np.cumsum(rng.integers(0, 80, m)).astype(np.int64)
        n = int(ends[-1]) + int(rng.integers(0, 50))
        slots = torch.from_numpy(rng.integers(0, 5, m + 1))
        slots[m] = 0
        first_gen = torch.from_numpy(rng.integers(0, n + 1, m + 1))
        ends_t = torch.from_numpy(ends)
        batch = torch.searchsorted(ends_t, torch.arange(n), right=True)
        want_slot = slots[batch]
        want_gen = (torch.arange(n) >= first_gen[batch]).long()
        slot_out = torch.full((n,), -7, dtype=torch.int64)
        gen_out = torch.full((n,), -7, dtype=torch.int64)
        index = torch.cat([ends_t, slots, first_gen, torch.full((5,), -9)])  # spare room
        tap_kernel.expand_rows(index, m, slot_out, gen_out, max_rows=4096)
        assert torch.equal(slot_out, want_slot) and torch.equal(gen_out, want_gen)


if __name__ == "__main__":
    assert tap_kernel.triton is not None
    for dt in (torch.float32, torch.bfloat16):
        for layout in ("deferred", "materialized"):
            run(dt, layout)
        run_wide(dt)
    check_expand()
    print("ok")
    sys.exit(0)
