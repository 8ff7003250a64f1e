"""What the hooks read of vLLM's worker and model runner: the model, its name and
limits, the platform's worker class, dummy forwards, and the step loops' stack room."""

from __future__ import annotations

import torch
from torch import nn

from capsteer.engine_ext import stack_room
from capsteer.engine_ext.vllm.batch import runner_kind


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


def model_dtype(worker: object) -> torch.dtype:
    """The dtype the engine runs the model in."""
    return worker.vllm_config.model_config.dtype


def checkpoint_dtype(worker: object) -> torch.dtype | None:
    """The dtype the checkpoint's config declares (vLLM may run another: `--dtype auto`
    serves a float32 checkpoint in bfloat16)."""
    hf = worker.vllm_config.model_config.hf_config
    declared = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None)
    if isinstance(declared, str):
        declared = getattr(torch, declared, None)
    return declared if isinstance(declared, torch.dtype) else None


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


def eager_embedding(runner: object, num_tokens: int, multiplier: float = 1.0,
                    position_embedding: nn.Module | None = None) -> torch.Tensor:
    """The stream entering layer 0 for the dummy run's input ids, computed outside any
    compiled graph: the model's own embedding (Gemma's sqrt(hidden) scale included)
    times the family's embedding multiplier (Granite scales after embed_input_ids),
    plus the learned position embedding at the dummy run's positions (GPT-2's wpe)."""
    v1 = runner_kind(runner) == "v1"
    ids = runner.input_ids.gpu[:num_tokens] if v1 else runner.input_buffers.input_ids[:num_tokens]
    model = runner.model
    with torch.no_grad():
        embed = getattr(model, "embed_input_ids", None)
        out = embed(ids) if embed is not None else model.model.embed_tokens(ids)
        out = out * multiplier if multiplier != 1.0 else out
        if position_embedding is not None:
            positions = runner.positions if v1 else runner.input_buffers.positions
            positions = getattr(positions, "gpu", positions)[:num_tokens]
            out = out + position_embedding(positions)
        return out


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
