"""The batch as vLLM's model runner lays it out: which request each row belongs to
(read before the forward), and which requests a scheduler output starts or finishes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch


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
