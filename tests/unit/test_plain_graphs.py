"""The choice between hooked and plain CUDA graphs (adapter.PlainGraphs), on a stand-in for
vLLM 0.26's V2 CUDA-graph manager: CI has no GPU, so the real graphs are checked on the
lent GPU (bench/gpu_validate.py). What can go wrong here is the choice itself: a step with
hooks must never replay a graph recorded without the taps (its captures would be zeros,
its steering a no-op), and vLLM's capture must fill both sets."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from capsteer.engine_ext import adapter
from capsteer.engine_ext.runtime import HookRuntime, StepPlan

SIZES = (8, 4, 2)


class StandInWrapper:
    """What PlainGraphs touches of a piecewise CUDAGraphWrapper: its entries by batch size."""

    def __init__(self) -> None:
        self.concrete_cudagraph_entries: dict[int, str] = {}


class StandInManager:
    """V2's manager as capsteer sees it: `graphs` (FULL, by descriptor), `capture` (which
    records pieces through `self.run_pw_graph`, as ModelCudaGraphManager's forward_fn does),
    and the two replays."""

    def __init__(self, runtime: HookRuntime, pieces: list[StandInWrapper]) -> None:
        self.runtime = runtime
        self.pieces = pieces
        self.graphs: dict[int, str] = {}
        self.replayed: list[tuple[str, str]] = []

    def needs_capture(self) -> bool:
        return True

    def _label(self) -> str:
        return "taps" if self.runtime.graph_taps else "no-taps"

    def capture(self) -> None:
        for size in SIZES:  # piecewise first, then full, as vLLM does
            self.run_pw_graph(size)
        for size in SIZES:
            assert size not in self.graphs, "graph already captured"
            self.graphs[size] = f"full-{size}-{self._label()}"

    def run_pw_graph(self, size: int) -> None:
        for wrapper in self.pieces:
            entries = wrapper.concrete_cudagraph_entries
            if size not in entries:
                entries[size] = f"piece-{size}-{self._label()}"
            else:
                self.replayed.append(("piece", entries[size]))

    def run_fullgraph(self, size: int) -> None:
        self.replayed.append(("full", self.graphs[size]))


@pytest.fixture
def engine():
    runtime = HookRuntime(2, 32, torch.float32, torch.device("cpu"), max_tokens=16)
    pieces = [StandInWrapper() for _ in range(3)]
    other = StandInWrapper()  # another model's wrapper: filled before, never swapped
    other.concrete_cudagraph_entries = {1: "other"}
    manager = StandInManager(runtime, pieces)
    graphs = adapter.wire_plain_graphs(manager, runtime, lambda: [other, *pieces])
    return runtime, manager, graphs, pieces, other


def test_capture_records_a_hooked_and_a_plain_set(engine):
    runtime, manager, graphs, pieces, other = engine
    manager.capture()
    assert graphs.ready and runtime.graph_taps  # taps are recorded again after the plain pass
    assert graphs.wrappers == pieces  # the other model's wrapper is left alone
    assert other.concrete_cudagraph_entries == {1: "other"}
    hooked, plain = graphs.full
    assert hooked == {s: f"full-{s}-taps" for s in SIZES}
    assert plain == {s: f"full-{s}-no-taps" for s in SIZES}
    for entries in graphs.pieces[adapter.HOOKED]:
        assert entries == {s: f"piece-{s}-taps" for s in SIZES}
    for entries in graphs.pieces[adapter.PLAIN]:
        assert entries == {s: f"piece-{s}-no-taps" for s in SIZES}
    assert manager.replayed == []  # capturing replayed nothing and switched nothing


def _plan(runtime: HookRuntime, sites: frozenset[int] | None) -> None:
    runtime.plan = StepPlan(active_sites=sites)


def test_steps_with_hooks_replay_the_hooked_graphs(engine):
    runtime, manager, graphs, _, _ = engine
    manager.capture()
    _plan(runtime, frozenset({3}))
    manager.run_fullgraph(4)
    manager.run_pw_graph(8)
    _plan(runtime, None)  # every site may be used
    manager.run_fullgraph(2)
    assert manager.replayed == [("full", "full-4-taps")] + [("piece", "piece-8-taps")] * 3 + [
        ("full", "full-2-taps")]
    assert graphs.replays == [3, 0]


def test_plain_steps_replay_the_plain_graphs_and_switch_back(engine):
    runtime, manager, graphs, _, _ = engine
    manager.capture()
    _plan(runtime, frozenset())
    manager.run_fullgraph(4)
    manager.run_pw_graph(2)
    _plan(runtime, frozenset({0, 4}))
    manager.run_fullgraph(4)
    _plan(runtime, frozenset())
    manager.run_fullgraph(8)
    assert manager.replayed == [("full", "full-4-no-taps")] + [("piece", "piece-2-no-taps")] * 3 \
        + [("full", "full-4-taps"), ("full", "full-8-no-taps")]
    assert graphs.replays == [1, 3]


def test_before_both_sets_exist_every_replay_is_hooked(engine):
    runtime, manager, graphs, _, _ = engine
    manager.graphs[4] = "full-4-taps"  # as if only vLLM's own capture had run
    _plan(runtime, frozenset())
    manager.run_fullgraph(4)
    assert manager.replayed == [("full", "full-4-taps")] and not graphs.ready


def test_a_second_capture_records_both_sets_afresh(engine):
    runtime, manager, graphs, _, _ = engine
    manager.capture()
    _plan(runtime, frozenset())
    manager.run_fullgraph(2)  # now on the plain set
    manager.capture()  # e.g. after vLLM cleared its graphs
    assert graphs.full[adapter.HOOKED] == {s: f"full-{s}-taps" for s in SIZES}
    assert graphs.full[adapter.PLAIN] == {s: f"full-{s}-no-taps" for s in SIZES}
    _plan(runtime, frozenset({1}))
    manager.run_fullgraph(2)
    assert manager.replayed[-1] == ("full", "full-2-taps")


def test_the_runtime_needs_taps_only_for_planned_sites():
    runtime = HookRuntime(2, 32, torch.float32, torch.device("cpu"), max_tokens=16,
                          device_driven=True)
    assert not runtime.step_needs_taps()  # start-up: nothing planned
    runtime.set_plan(StepPlan(active_sites=frozenset({2})), 0)
    assert runtime.step_needs_taps()
    runtime.reset_dense()  # after the last hooked request left
    assert not runtime.step_needs_taps()
    runtime.set_plan(StepPlan(active_sites=None), 0)
    assert runtime.step_needs_taps()


def test_tensor_parallel_ranks_choose_the_same_set():
    """A graph's all-reduce reads its peers' buffers of the same recording, so every TP rank
    must replay the same set. Only rank 0 keeps a capture (EngineHooks.before_step drops
    it on the others); the choice must not change with that."""
    from capsteer.capture.spec import parse_capture_spec
    from capsteer.engine_ext.plan import RequestHooks, build_step_plan

    choices = []
    for capture_rank in (True, False):
        runtime = HookRuntime(2, 32, torch.float32, torch.device("cpu"), max_tokens=16,
                              device_driven=True)
        payload = {"capsteer": {"capture": parse_capture_spec(
            {"hooks": ["resid_post"], "layers": [1]}, num_layers=2).to_dict(),
            "capture_id": "cap-a"}}
        hooks = RequestHooks.from_extra_args("a", payload, 4, runtime)
        if not capture_rank:  # as before_step does on TP ranks that do not write
            hooks.capture = None
            hooks.points = {}
        plan = build_step_plan(["plain", "a"], np.array([0, 1, 5]), np.array([9, 0]),
                               {"a": hooks}, None, host_steering=False)
        runtime.plan = plan
        choices.append(runtime.step_needs_taps())
    assert choices == [True, True]
