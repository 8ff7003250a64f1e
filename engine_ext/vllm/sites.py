"""Where each site is read on vLLM's module tree (the family's taps resolved on the
model), the forward stopped after its first layers, and the tap op routed through each
module's forward."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from capsteer.engine_ext import families
from capsteer.engine_ext.tap_op import new_site_key
from capsteer.engine_ext.vllm.refusals import (
    check_architecture,
    is_transformers_backend,
    model_architecture,
)
from capsteer.engine_ext.vllm.version import UnsupportedError


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
    parallel: bool = False  # parallel block: no stream at 2L+1 (families.unavailable_hooks)
    # Hooks this checkpoint does not have -> the reason a request naming one is refused.
    unavailable: tuple[tuple[str, str], ...] = ()
    # Added to the token embedding by position before layer 0 (GPT-2's wpe), else None.
    position_embedding: nn.Module | None = None
    # Widths of the hooks not hidden_size wide (families.hook_widths: mlp_post's d_mlp).
    hook_widths: tuple[tuple[str, int], ...] = ()

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


def _text_config(model: nn.Module) -> object:
    config = getattr(model, "config", None)
    return getattr(config, "text_config", None) or config


def _config_float(model: nn.Module, name: str | None) -> float:
    if name is None:
        return 1.0
    return float(getattr(_text_config(model), name))


def inner_model(model: nn.Module) -> nn.Module | None:
    """The decoder under the causal-LM wrapper: the family's attribute in vLLM's native
    class (GPT-2: `transformer`), `model` in the Transformers backend (HF's base model)."""
    family = families.family_for(model_architecture(model))
    name = "model" if family is None or is_transformers_backend(model) else family.inner
    return getattr(model, name, None)


def stop_forward_problem(model: nn.Module) -> str | None:
    """Why this model's forward cannot stop after its first layers, or None.

    vLLM's native decoders run `islice(self.layers, self.start_layer, self.end_layer)`
    (the pipeline-parallel slice) and then the final norm; lowering `end_layer` before
    the model is compiled makes the compiled forward (and its CUDA graphs) stop there.
    The Transformers backend loops over every layer, so it cannot."""
    inner = inner_model(model)
    if inner is None or not isinstance(getattr(inner, "end_layer", None), int):
        return f"{model_architecture(model)} has no end_layer on its decoder"
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
    inner = inner_model(model)
    assert inner is not None  # stop_forward_problem found it
    if not 0 < stop_at_layer <= inner.end_layer or inner.start_layer != 0:
        raise ValueError(f"cannot stop at layer {stop_at_layer} of layers "
                         f"[{inner.start_layer}, {inner.end_layer})")
    inner.end_layer = stop_at_layer


def forward_layers(model: nn.Module) -> int | None:
    """How many decoder layers this worker's forward runs (vLLM's pipeline slice, which
    stop_forward_at lowers), or None where the model keeps no such slice."""
    inner = inner_model(model)
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
    backend = is_transformers_backend(model)
    materialized = backend or family.deferred_mid_norm is None
    config = _text_config(model)
    parallel = families.is_parallel(family, config)
    inner = inner_model(model)
    layers = getattr(inner, family.layers, None)
    final = getattr(inner, family.final_norm, None)
    arch = model_architecture(model)
    stop = len(layers) if layers is not None and stop_at_layer is None else stop_at_layer
    if family is families.TRANSFORMERS_STREAM:  # resid_post(last) is the last layer's output
        _check_stream_layers(arch, layers)
        final = layers[stop - 1]
    if layers is None or final is None:
        raise UnsupportedError(f"{arch}: no decoder layers ({family.layers}) or final norm "
                               f"({family.final_norm}) found where the {family.name} "
                               "family keeps them")
    position = None
    if family.position_embedding is not None:
        position = getattr(inner, family.position_embedding, None)
        if position is None:
            raise UnsupportedError(f"{arch}: no position embedding "
                                   f"{family.position_embedding!r}, which resid_pre(0) adds")
    taps: list[tuple[int, nn.Module, families.Tap]] = []
    for i, layer in enumerate(layers):
        if _missing(layer) or i >= stop:
            continue  # another pipeline stage runs this layer, or the forward stops before
        for tap in families.layer_taps(family, materialized, parallel, backend):
            module = _submodule(layer, tap.module)
            if module is None:
                raise UnsupportedError(
                    f"layer {i} of {arch} has no module {tap.module!r}, where the "
                    f"{family.name} family's hooks are read")
            taps.append((tap.site(i, len(layers)), module, tap))
    if not _missing(final):
        taps.append((2 * stop, final, families.final_tap(family, materialized)))
    if not taps:
        raise UnsupportedError(f"{arch}: this worker holds no decoder layer")
    hidden = int(getattr(config, "hidden_size", 0))
    return ModelSites(tuple(taps), len(layers), hidden, family, materialized,
                      residual_multiplier=_config_float(model, family.residual_multiplier),
                      embedding_multiplier=_config_float(model, family.embedding_multiplier),
                      parallel=parallel,
                      unavailable=tuple({
                          **families.tensor_parallel_reasons(
                              _tensor_parallel_size(), _host_driven(model)),
                          **families.unavailable_hooks(
                              family, model.config if family is families.TRANSFORMERS_STREAM
                              else config)}.items()),
                      position_embedding=position,
                      hook_widths=tuple(families.hook_widths(config).items()))


def _tensor_parallel_size() -> int:
    """This worker's tensor-parallel group size (1 outside vLLM's distributed setup)."""
    try:  # vLLM's groups exist only inside a worker
        from vllm.distributed import get_tensor_model_parallel_world_size
        return int(get_tensor_model_parallel_world_size())
    except (ImportError, AssertionError, RuntimeError):
        return 1


def _host_driven(model: nn.Module) -> bool:
    """Whether this worker's hooks are host-driven (not on CUDA: worker_access.device_driven),
    whose taps gather the columns tensor parallelism splits (runtime.split_columns)."""
    param = next(model.parameters(), None)
    return param is None or param.device.type != "cuda"


def _check_stream_layers(arch: str, layers: object) -> None:
    """Refuse (UnsupportedError) a stream-only model whose decoder layers are not an
    `nn.ModuleList` at `model.layers` taking the stream first as `hidden_states`."""
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise UnsupportedError(
            f"capsteer cannot hook architecture {arch}: it has no capsteer family row and "
            "its HF model keeps no decoder layers at model.layers, where the stream-only "
            "layout (resid_pre / resid_post) reads them")
    for layer in layers:
        if _missing(layer):
            continue
        params = [p.name for p in inspect.signature(layer.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if params[:1] != ["hidden_states"]:
            raise UnsupportedError(
                f"capsteer cannot hook architecture {arch}: it has no capsteer family row "
                f"and its decoder layer {type(layer).__name__}.forward does not take the "
                "stream as its first argument, hidden_states")


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
    stream tensor (which a materialized layer's residual aliases) or mlp_in's (the norm's
    output, which nothing else reads after the MLP), for an output the module's returned
    tensor. The site travels as a key tensor, a non-persistent buffer
    of the module: a graph input like its weights, so every layer compiles to the same
    piece (see tap_op._SITE_BY_KEY). `residual_is_graph_input`: this pair tap's residual
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
