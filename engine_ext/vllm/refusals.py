"""What capsteer refuses to hook, and why: architectures, engine features, data-parallel
layouts and families under pipeline parallelism.

The same checks run twice: in the launching process on vLLM's resolved config (before
any engine starts or weight loads; `refuse_at_vllm_config_step`) and in each worker on
the model it built. A refusal names what is supported: never served with hooks that
silently do nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from capsteer.engine_ext import families
from capsteer.engine_ext.vllm.section import capsteer_config, config_section
from capsteer.engine_ext.vllm.version import UnsupportedError
from capsteer.engine_ext.worker_config import WorkerConfig

log = logging.getLogger(__name__)


def is_transformers_backend(model: nn.Module) -> bool:
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


def architecture_problem(arch: str, reason: str | None,
                         transformers_backend: bool = False) -> str | None:
    """The refusal message for `arch` (None where a family hooks it, or where vLLM's
    Transformers backend runs an architecture without a row: the stream-only layout),
    given the reason its name or vLLM's markers already gave: one wording for the
    engine's parent process, which refuses before any worker starts, and the workers,
    which check the model built."""
    reason = families.refusal_reason(arch) or reason  # the name's reason says more
    if reason is not None:
        return (f"capsteer cannot hook architecture {arch}: {reason}. Refusing to start rather "
                "than serve capture/steering requests with hooks that would never fire.")
    if families.family_for(arch) is None and not transformers_backend:
        return (f"capsteer cannot hook architecture {arch}: no hook layout is known for it "
                f"(supported families: {families.supported_names()}; see docs/engine.md). "
                "Refusing to start rather than serve capture/steering requests with hooks "
                "that would never fire.")
    return None


def check_architecture(model: nn.Module) -> families.Family:
    """The family whose hook layout this model has (the stream-only layout for an
    architecture without a row that the Transformers backend runs), or UnsupportedError
    naming why not."""
    arch = model_architecture(model)
    backend = is_transformers_backend(model)
    problem = architecture_problem(arch, _marker_refusal(model), backend)
    if problem is not None:
        raise UnsupportedError(problem)
    return families.family_for(arch) or families.TRANSFORMERS_STREAM


def served_family(model_config: object) -> families.Family | None:
    """The family the workers will use, from vLLM's resolved model config (None where
    the architecture is refused or not known)."""
    arch = _config_architecture(model_config) or ""
    family = families.family_for(arch)
    if family is None and arch and families.refusal_reason(arch) is None \
            and _uses_transformers_backend(model_config):
        return families.TRANSFORMERS_STREAM
    return family


def hooks_unavailable(model_config: object, tensor_parallel_size: int = 1,
                      gathered: bool = False) -> dict[str, str]:
    """The hooks the served model does not have (or not under this tensor parallelism),
    each with the reason its 400 gives; `gathered`: see shards_gathered."""
    missing = families.unavailable_hooks_of(
        getattr(model_config, "hf_config", None),
        served_family(model_config) is families.TRANSFORMERS_STREAM)
    return {**families.tensor_parallel_reasons(tensor_parallel_size, gathered), **missing}


def shards_gathered(vllm_config: object) -> bool:
    """Whether this engine's workers gather the split columns of mlp_post and attn_z under
    tensor parallelism: host-driven workers (CPU) do, inside the tap; device-driven ones
    (CUDA, worker_access.device_driven) not yet."""
    device = getattr(getattr(vllm_config, "device_config", None), "device_type", "cuda")
    return str(device) != "cuda"


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
    return architecture_problem(arch, reason, _uses_transformers_backend(model_config))


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
        problems = engine_feature_problems(config, WorkerConfig.from_section(config_section(config)),
                                           moe=_config_is_moe(model_config))
        if problems:
            return engine_features_message(problems)
    problem = config_architecture_problem(model_config)
    if problem is not None or parallel is None:
        return problem
    family = served_family(model_config)
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


def engine_feature_problems(cfg: object, worker_config: WorkerConfig,
                            moe: bool | None) -> list[str]:
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
    if int(getattr(par, "pipeline_parallel_size", 1) or 1) > 1 and worker_config.sharded:
        problems.append("pipeline parallelism with an extraction job's shards (each stage "
                        "would write its own shards; run extraction with tensor parallelism)")
    dp = _data_parallel_refusal(par, worker_config, moe)
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
    problems = engine_feature_problems(
        worker.vllm_config, WorkerConfig.from_section(capsteer_config(worker)), moe=True)
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


def _data_parallel_refusal(par: object, worker_config: WorkerConfig,
                           moe: bool | None) -> str | None:
    """The data-parallel layouts capsteer refuses, in the workers' order: DP in the
    in-process engine, a layout `data_parallel_problem` names, then a mixture-of-experts
    model (`moe` None: not known here)."""
    size = int(getattr(par, "data_parallel_size", 1) or 1)
    if size <= 1:
        return None
    if worker_config.frontend != "server":
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


def pipeline_family_problem(family: families.Family, materialized: bool,
                            pipeline_parallel_size: int) -> str | None:
    if materialized and pipeline_parallel_size > 1:
        return (f"capsteer cannot hook the {family.name} family under pipeline parallelism: "
                "its layers add the residual themselves, so a site's sublayer and stream "
                "values can sit on different stages; use tensor parallelism")
    return None


def check_family_features(worker: object, family: families.Family, materialized: bool) -> None:
    """Refuse what a family's layout (find_sites' family and materialized) cannot do yet,
    rather than mislabel rows."""
    par = worker.vllm_config.parallel_config
    problem = pipeline_family_problem(family, materialized,
                                      int(getattr(par, "pipeline_parallel_size", 1) or 1))
    if problem is not None:
        raise UnsupportedError(problem)
