"""The choice between hooked and plain CUDA graphs (PlainGraphs), on a stand-in for
vLLM 0.26's V2 CUDA-graph manager: CI has no GPU, so the real graphs are checked on the
lent GPU (tests/gpu/gpu_validate.py). What can go wrong here is the choice itself: a step with
hooks must never replay a graph recorded without the taps (its captures would be zeros,
its steering a no-op), and vLLM's capture must fill both sets."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from capsteer.engine_ext.runtime import HookRuntime, StepPlan
from capsteer.engine_ext.vllm.graphs import (
    GraphSet,
    PlainGraphs,
    install_plain_graphs,
    wire_plain_graphs,
)

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
    graphs = wire_plain_graphs(manager, runtime, lambda: [other, *pieces])
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
    for entries in graphs.pieces[GraphSet.HOOKED]:
        assert entries == {s: f"piece-{s}-taps" for s in SIZES}
    for entries in graphs.pieces[GraphSet.PLAIN]:
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
    assert graphs.full[GraphSet.HOOKED] == {s: f"full-{s}-taps" for s in SIZES}
    assert graphs.full[GraphSet.PLAIN] == {s: f"full-{s}-no-taps" for s in SIZES}
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


class _V2Runner:
    """A stand-in whose module says "vLLM's V2 GPU runner" (batch.runner_kind)."""

    def __init__(self, tp: int = 1, manager: object | None = None) -> None:
        self.vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(
            tensor_parallel_size=tp))
        self.cudagraph_manager = manager


_V2Runner.__module__ = "vllm.v1.worker.gpu.model_runner"


@pytest.mark.parametrize(("runner", "why"), [
    (SimpleNamespace(), "V2 model runner"),
    (_V2Runner(tp=2), "tensor-parallel"),
    (_V2Runner(manager=None), "no CUDA graphs"),
    (_V2Runner(manager=SimpleNamespace(needs_capture=lambda: False)), "no CUDA graphs"),
    (_V2Runner(manager=SimpleNamespace(needs_capture=lambda: True, use_breakable_cg=True)),
     "breakable"),
])
def test_one_set_where_the_sets_cannot_be_swapped_safely(runner, why):
    """Tensor-parallel ranks must replay the same set (a graph's all-reduce works on its
    peers' buffers of the same recording), but only rank 0 closes a prompt-only capture
    early, so their plans can differ: those engines keep one set."""
    runtime = HookRuntime(2, 32, torch.float32, torch.device("cpu"), max_tokens=16)
    result = install_plain_graphs(runner, runtime, vllm_version="0.26.0")
    assert isinstance(result, str) and why in result


def test_a_single_gpu_v2_runner_gets_both_sets_on_the_vllm_it_was_written_for():
    runtime = HookRuntime(2, 32, torch.float32, torch.device("cpu"), max_tokens=16)
    manager = StandInManager(runtime, [])
    later = install_plain_graphs(_V2Runner(manager=manager), runtime,
                                         vllm_version="0.32.0")
    assert isinstance(later, str) and "0.32.0" in later
    graphs = install_plain_graphs(_V2Runner(manager=manager), runtime,
                                          vllm_version="0.26.0")
    assert isinstance(graphs, PlainGraphs)
    manager.capture()
    assert graphs.ready and set(graphs.full[GraphSet.PLAIN]) == set(SIZES)


class LabelledManager(StandInManager):
    """vLLM 0.26's capture takes a progress-bar label; the plain pass names itself."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.labels: list[str] = []

    def capture(self, progress_bar_desc: str = "Capturing CUDA graphs") -> None:
        self.labels.append(progress_bar_desc)
        super().capture()


def test_the_plain_pass_names_itself_in_the_progress_bar():
    runtime = HookRuntime(2, 32, torch.float32, torch.device("cpu"), max_tokens=16)
    manager = LabelledManager(runtime, [StandInWrapper()])
    wire_plain_graphs(manager, runtime, lambda: manager.pieces)
    manager.capture()
    assert manager.labels[0] == "Capturing CUDA graphs"
    assert "without capsteer's taps" in manager.labels[1]


class FailingManager(StandInManager):
    """A plain pass that fails halfway (e.g. out of GPU memory)."""

    def capture(self) -> None:
        if not self.runtime.graph_taps:
            self.run_pw_graph(SIZES[0])
            raise RuntimeError("out of memory")
        super().capture()


def test_a_failed_plain_pass_leaves_the_hooked_set_in_place():
    runtime = HookRuntime(2, 32, torch.float32, torch.device("cpu"), max_tokens=16)
    pieces = [StandInWrapper()]
    manager = FailingManager(runtime, pieces)
    graphs = wire_plain_graphs(manager, runtime, lambda: pieces)
    with pytest.raises(RuntimeError, match="out of memory"):
        manager.capture()
    assert runtime.graph_taps and not graphs.ready and not graphs.capturing
    assert manager.graphs is graphs.full[GraphSet.HOOKED]
    _plan(runtime, frozenset())
    manager.run_fullgraph(4)
    assert manager.replayed == [("full", "full-4-taps")]


@pytest.mark.parametrize(("active", "graph_taps", "capturing", "runs"), [
    (frozenset(), True, True, True),  # a hooked graph records every site
    (frozenset(), False, True, False),  # the plain set records none
    (frozenset({1}), False, True, False),
    (frozenset({1}), True, False, True),  # a step without graphs: the sites in use
    (frozenset({2}), True, False, False),  # ... and no other
    (frozenset(), True, False, False),
    (None, True, False, True),  # every site may be used
    (frozenset({1}), False, False, True),  # graph_taps only matters while recording
])
def test_the_tap_runs_where_a_graph_or_a_step_needs_it(monkeypatch, active, graph_taps,
                                                        capturing, runs):
    runtime = HookRuntime(2, 32, torch.float32, torch.device("cpu"), max_tokens=16,
                          device_driven=True)
    ran = []
    monkeypatch.setattr(runtime, "_capturing", lambda: capturing)
    monkeypatch.setattr(runtime, "_tap_dense", lambda *args: ran.append(args[2]))
    runtime.plan = StepPlan(active_sites=active)
    runtime.graph_taps = graph_taps
    runtime.tap(torch.zeros(4, 32), None, 1)
    assert ran == ([1] if runs else [])


def test_benches_can_hold_every_step_on_the_hooked_set(engine):
    runtime, manager, graphs, _, _ = engine
    manager.capture()
    _plan(runtime, frozenset())
    graphs.force_hooked = True
    manager.run_fullgraph(4)
    graphs.force_hooked = False
    manager.run_fullgraph(4)
    assert manager.replayed == [("full", "full-4-taps"), ("full", "full-4-no-taps")]


def _hooks_with(graphs: PlainGraphs, stage: int, monkeypatch):
    """An EngineHooks with only what install_plain_graphs reads, wired to `graphs`."""
    from capsteer.engine_ext import worker
    from capsteer.engine_ext.worker import EngineHooks
    from capsteer.engine_ext.worker_config import WorkerConfig

    monkeypatch.setattr(worker, "install_plain_graphs", lambda runner, runtime: graphs)
    hooks = EngineHooks.__new__(EngineHooks)  # no engine: only the fields used here
    hooks.device_driven, hooks.config, hooks.stage = True, WorkerConfig(), stage
    hooks.worker, hooks.runtime, hooks.plain_graphs = SimpleNamespace(model_runner=None), None, None
    hooks.install_plain_graphs()
    assert hooks.plain_graphs is graphs
    return hooks


def test_replays_per_set_reach_the_servers_metrics(engine, monkeypatch):
    import gc

    from capsteer.capture import metrics as capture_metrics
    from capsteer.server import metrics as server_metrics

    def replay_lines() -> list[str]:
        text = server_metrics.render([capture_metrics.snapshot()], 0).decode()
        assert "# TYPE capsteer_graph_replays_total counter" in text
        return sorted(line for line in text.splitlines()
                      if line.startswith("capsteer_graph_replays_total{"))

    replays = capture_metrics.GRAPH_REPLAYS
    monkeypatch.setattr(replays, "_source", None)
    assert replay_lines() == []  # one set recorded: the family is there, empty
    runtime, manager, graphs, _, _ = engine
    later_stage = _hooks_with(graphs, 1, monkeypatch)  # one count per step: stage 0's
    assert replays._source is None
    hooks = _hooks_with(graphs, 0, monkeypatch)
    manager.capture()
    _plan(runtime, frozenset())
    for size in (4, 8, 2):
        manager.run_fullgraph(size)
    _plan(runtime, frozenset({1}))
    manager.run_fullgraph(4)
    assert replay_lines() == ['capsteer_graph_replays_total{set="hooked"} 1.0',
                              'capsteer_graph_replays_total{set="plain"} 3.0']
    del hooks, later_stage  # a closed engine's metrics hold nothing of it
    gc.collect()
    assert replay_lines() == []
