"""The pre-forward hook (engine_ext/vllm/batch.py) on a stand-in for vLLM's V1 runner (the real one runs in
the engine tests): plain steps skip the hook and never build the batch layout."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from capsteer.engine_ext.vllm import batch


class _Unreadable:
    """A batch field the layout would read: touching it fails the test."""

    def __getattr__(self, name):
        raise AssertionError(f"the layout was built (read {name})")


def test_steps_the_hooks_do_not_want_skip_the_layout():
    forwarded = []
    runner = SimpleNamespace(_model_forward=lambda *a, **kw: forwarded.append(kw) or "out")
    seen = []
    wanted = [False]
    batch.install_pre_forward(runner, seen.append, lambda: wanted[0])
    runner.input_batch = _Unreadable()
    assert runner._model_forward(input_ids=torch.zeros(3, dtype=torch.long)) == "out"
    assert seen == [] and len(forwarded) == 1

    runner.input_batch = SimpleNamespace(num_reqs=2, req_ids=["a", "b", "gone"],
                                         num_computed_tokens_cpu=np.array([0, 5, 9]))
    runner.query_start_loc = SimpleNamespace(np=np.array([0, 2, 3, 7]))
    runner.input_ids = SimpleNamespace(cpu=torch.arange(4))
    wanted[0] = True
    assert runner._model_forward(input_ids=torch.zeros(4, dtype=torch.long)) == "out"
    (layout,) = seen
    assert layout.req_ids == ["a", "b"] and layout.num_tokens_padded == 4
    assert layout.query_start_loc.tolist() == [0, 2, 3]
    assert layout.start_positions.tolist() == [0, 5] and len(forwarded) == 2
