"""Where this process sits in the deployment: tensor/pipeline ranks in the workers, and
the model, data-parallel engines and API servers behind an API server."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from capsteer.engine_ext import families
from capsteer.engine_ext.vllm.refusals import (
    data_parallel_problem,
    hooks_unavailable,
    served_family,
    shards_gathered,
)
from capsteer.engine_ext.vllm.version import UnsupportedError


def is_capture_rank() -> bool:
    """Captures are written by tensor-parallel rank 0 of each pipeline stage only (the
    stream is replicated across the TP ranks of a stage)."""
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank() == 0
    except (ImportError, AssertionError, RuntimeError):
        return True


def tensor_parallel_rank() -> tuple[int, int]:
    """(this worker's tensor-parallel rank, the group's size); (0, 1) outside vLLM's
    distributed setup."""
    try:
        from vllm.distributed import get_tp_group

        group = get_tp_group()
        return int(group.rank_in_group), int(group.world_size)
    except (ImportError, AssertionError, RuntimeError):
        return 0, 1


def gather_columns(rows: torch.Tensor) -> torch.Tensor:
    """`rows` [k, d/tp] of every tensor-parallel rank side by side, [k, d], rank 0's
    columns first: vLLM's own all-gather over the TP group (a collective: every rank calls
    it with the same k)."""
    from vllm.distributed import tensor_model_parallel_all_gather  # inside a worker only

    return tensor_model_parallel_all_gather(rows.contiguous(), dim=-1)


def pipeline_stage() -> tuple[int, int]:
    """(this worker's pipeline stage, number of stages)."""
    try:
        from vllm.distributed import get_pp_group

        group = get_pp_group()
        return int(group.rank_in_group), int(group.world_size)
    except (ImportError, AssertionError, RuntimeError):
        return 0, 1


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
    # Hooks this checkpoint does not have (a parallel block's resid_mid) -> why: a 400.
    unavailable: Mapping[str, str] = field(default_factory=dict)
    # Widths of the hooks that are not hidden_size wide (mlp_post: d_mlp).
    hook_widths: Mapping[str, int] = field(default_factory=dict)


def served_model(engine_client: object) -> ServedModel:
    config = engine_client.model_config
    hf = config.hf_text_config if hasattr(config, "hf_text_config") else config.hf_config
    arch = (list(getattr(config, "architectures", None) or ())
            or list(getattr(config.hf_config, "architectures", None) or ()) or [""])[0]
    return ServedModel(name=str(config.served_model_name or config.model),
                       num_layers=int(hf.num_hidden_layers), hidden_size=int(hf.hidden_size),
                       max_model_len=int(config.max_model_len), dtype=config.dtype,
                       architecture=arch, family=served_family(config),
                       unavailable=hooks_unavailable(
                           config, _tensor_parallel(engine_client),
                           shards_gathered(getattr(engine_client, "vllm_config", None))),
                       hook_widths=families.hook_widths(hf))


def _tensor_parallel(engine_client: object) -> int:
    """The engine's tensor_parallel_size (1 where it does not say)."""
    parallel = getattr(getattr(engine_client, "vllm_config", None), "parallel_config", None)
    return int(getattr(parallel, "tensor_parallel_size", 1) or 1)


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
