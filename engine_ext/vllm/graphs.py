"""CUDA-graph sets of vLLM's V2 runner: a hooked and a tap-free set, swapped before each
replay, and the wrapping of whatever launches the forward."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from enum import IntEnum
from typing import Any, Protocol

import torch

from capsteer.engine_ext.vllm.batch import runner_kind


class GraphSet(IntEnum):
    """The two sets of PlainGraphs (indices into its per-set lists)."""

    HOOKED = 0
    PLAIN = 1


class TapSwitch(Protocol):
    """What PlainGraphs needs of the hook runtime (engine_ext.runtime.HookRuntime)."""

    graph_taps: bool

    def step_needs_taps(self) -> bool: ...


class PlainGraphs:
    """Two sets of CUDA graphs for one V2 model runner, swapped before each replay.

    A hooked graph records every site's tap kernel: which rows steer or copy is data the
    kernel reads, so one graph serves any mix of requests. In a step without hooks each
    kernel returns at once, yet each is still a node of the graph: about 1 us each on an
    H200, 69 us a decode step for the 73 of the 8B shape
    (measured 2026-11-29). The plain set is recorded with the taps
    skipped, so a step whose requests carry no fields replays graphs without them (the
    compiled code around them stays capsteer's: +14 us a step on the 8B shape).
    The choice is host data the step thread already has (the step's plan), made before
    the replay, as vLLM picks a graph by batch size: never a read of a device value.
    """

    def __init__(self, manager: Any, runtime: TapSwitch,
                 all_wrappers: Callable[[], list[Any]]) -> None:
        self.manager = manager
        self.runtime = runtime
        self.all_wrappers = all_wrappers  # every piecewise CUDAGraphWrapper of the process
        # FULL graphs per set: BatchExecutionDescriptor -> torch.cuda.CUDAGraph
        self.full: list[dict[Any, Any]] = [{}, {}]
        self.wrappers: list[Any] = []  # piecewise CUDAGraphWrappers of this model
        self.pieces: list[list[dict[Any, Any]]] = [[], []]  # their entries per set
        self.current = GraphSet.HOOKED
        self.ready = False  # both sets recorded: until then every replay is hooked
        self.capturing = False  # vLLM's capture runs its forwards through run_pw_graph too
        self.force_hooked = False  # benches: every step on the hooked set, as before
        self.replays = [0, 0]  # graph replays per set (capsteer_stats)
        self.plain_bytes = 0  # GPU memory the plain set took when recorded

    def use(self, which: GraphSet) -> None:
        self.manager.graphs = self.full[which]
        for wrapper, entries in zip(self.wrappers, self.pieces[which], strict=True):
            wrapper.concrete_cudagraph_entries = entries
        self.current = which

    def select(self) -> None:
        """Point the runner at the set this step needs (a no-op while it stays the same)."""
        if self.capturing:
            return
        plain = self.ready and not self.force_hooked and not self.runtime.step_needs_taps()
        which = GraphSet.PLAIN if plain else GraphSet.HOOKED
        if which != self.current:
            self.use(which)
        self.replays[which] += 1

    def capture(self, original: Callable[..., None], *args: Any, **kwargs: Any) -> None:
        """vLLM's capture twice: hooked, then plain (taps skipped) into separate sets."""
        self.capturing = True
        try:
            self._capture_both(original, *args, **kwargs)
        finally:
            self.capturing = False

    def _capture_both(self, original: Callable[..., None], *args: Any, **kwargs: Any) -> None:
        self.ready = False
        self.current = GraphSet.HOOKED
        self.manager.graphs = self.full[GraphSet.HOOKED] = {}
        for wrapper in self.wrappers:  # a capture after a clear starts both sets afresh
            wrapper.concrete_cudagraph_entries = {}
        before = {id(w): len(w.concrete_cudagraph_entries) for w in self.all_wrappers()}
        original(*args, **kwargs)
        # This model's pieces: the wrappers the hooked pass filled
        self.wrappers = [w for w in self.all_wrappers()
                         if len(w.concrete_cudagraph_entries) > before.get(id(w), 0)]
        self.full[GraphSet.HOOKED] = self.manager.graphs
        self.pieces = [[w.concrete_cudagraph_entries for w in self.wrappers],
                       [{} for _ in self.wrappers]]
        self.full[GraphSet.PLAIN] = {}
        self.use(GraphSet.PLAIN)
        if "progress_bar_desc" in _parameters(original):
            kwargs = {**kwargs, "progress_bar_desc": "Capturing CUDA graphs without "
                      "capsteer's taps, for steps without hooks"}
        free_before = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 0
        self.runtime.graph_taps = False
        try:
            original(*args, **kwargs)
        except BaseException:
            self.use(GraphSet.HOOKED)  # the hooked set is whole; start-up fails anyway
            raise
        finally:
            self.runtime.graph_taps = True
        # Approximate: the driver-level growth; pool blocks the first pass freed are reused
        if torch.cuda.is_available():
            self.plain_bytes = max(0, free_before - torch.cuda.mem_get_info()[0])
        self.ready = True


def _parameters(fn: Callable[..., Any]) -> Sequence[str]:
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # not introspectable: pass nothing extra
        return []


PLAIN_GRAPHS_VLLM = "0.26."  # the graph manager PlainGraphs was written against


def install_plain_graphs(runner: Any, runtime: TapSwitch,
                         vllm_version: str | None = None) -> PlainGraphs | str:
    """Record a second, tap-free set of the runner's CUDA graphs for steps without hooks
    (PlainGraphs); call before vLLM captures. Returns the PlainGraphs, or why not (then
    every step replays the hooked graphs: slower for plain requests, never wrong)."""
    if vllm_version is None:
        import vllm

        vllm_version = vllm.__version__
    if not vllm_version.startswith(PLAIN_GRAPHS_VLLM):
        # Later releases clear and record graphs in more places (release_graphs clears
        # only the set in use): check them before swapping their sets.
        return (f"written against vLLM {PLAIN_GRAPHS_VLLM}x's CUDA-graph manager; this is "
                f"vLLM {vllm_version}")
    if runner_kind(runner) != "v2":
        return "only vLLM's V2 model runner keeps its FULL graphs where capsteer can swap them"
    parallel = runner.vllm_config.parallel_config
    if int(getattr(parallel, "tensor_parallel_size", 1) or 1) > 1:
        # A graph's all-reduce works on buffers its peers recorded in the same pass, so
        # every rank must replay the same set, and their plans can differ: rank 0 alone
        # closes a prompt-only capture early (EngineHooks._close_complete_captures).
        return ("tensor-parallel ranks could choose different sets, and their graphs' "
                "all-reduces must match")
    manager = getattr(runner, "cudagraph_manager", None)
    if manager is None or not manager.needs_capture():
        return "this engine records no CUDA graphs"
    if getattr(manager, "use_breakable_cg", False):
        return "breakable CUDA graphs are recorded by a wrapper capsteer does not swap"
    try:
        from vllm.compilation.cuda_graph import CUDAGraphWrapper
    except ImportError:
        return "vLLM's CUDAGraphWrapper is not where vLLM 0.26 keeps it"
    if not isinstance(getattr(manager, "graphs", None), dict) or not hasattr(
            CUDAGraphWrapper, "_all_instances"):
        return "vLLM's CUDA-graph manager does not keep its graphs as vLLM 0.26 does"
    return wire_plain_graphs(manager, runtime, lambda: list(CUDAGraphWrapper._all_instances))


def wire_plain_graphs(manager: Any, runtime: TapSwitch,
                      all_wrappers: Callable[[], list[Any]]) -> PlainGraphs:
    """Route a V2 CUDA-graph manager's capture and replays through a PlainGraphs."""
    graphs = PlainGraphs(manager, runtime, all_wrappers)
    capture, run_fullgraph, run_pw_graph = (manager.capture, manager.run_fullgraph,
                                            manager.run_pw_graph)

    def capture_both(*args: Any, **kwargs: Any) -> None:
        graphs.capture(capture, *args, **kwargs)

    def replay_full(*args: Any, **kwargs: Any) -> Any:
        graphs.select()
        return run_fullgraph(*args, **kwargs)

    def replay_pieces(*args: Any, **kwargs: Any) -> Any:
        graphs.select()
        return run_pw_graph(*args, **kwargs)

    manager.capture, manager.run_fullgraph, manager.run_pw_graph = (
        capture_both, replay_full, replay_pieces)
    return graphs


def wrap_forward_calls(runner: object, around: Callable[[Callable], Callable]) -> None:
    """Wrap whatever launches the model forward (eager call or CUDA-graph replay), so a
    diagnostic (sync debug mode) covers exactly the forward and nothing of vLLM's own."""
    if runner_kind(runner) == "v1":
        runner._model_forward = around(runner._model_forward)
        return
    manager = getattr(runner, "cudagraph_manager", None)
    for name in ("run_fullgraph", "run_pw_graph"):
        if manager is not None and hasattr(manager, name):
            setattr(manager, name, around(getattr(manager, name)))
    runner.model.forward = around(runner.model.forward)
