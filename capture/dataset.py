"""Rows of an extraction job as a PyTorch dataset, for SAE and probe training loops.

A job directory (`capsteer extract`) holds many requests per shard; `index.jsonl` says
which rows are durable. `open_job` reads exactly those rows of one (hook, layer): each
item is one token's activation with its token id, absolute position and request id.
Rows are read through safetensors' memory-mapped slices, so a shuffled pass across
shards touches only the rows it yields.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

from capsteer.capture.layouts import key_name
from capsteer.capture.sharded import ShardedCapture, read_sharded
from capsteer.hooks import canonical_hook

_OPEN_SHARDS = 32  # memory-mapped shard handles kept open


class JobRows(torch.utils.data.Dataset):
    """Map-style dataset over every indexed row of one (hook, layer); iterating it goes
    in index order, or in one seeded permutation across all shards when `shuffle`."""

    def __init__(self, job: ShardedCapture, key: tuple[str, int], *, shuffle: bool = False,
                 seed: int = 0) -> None:
        self.job, self.key, self.shuffle, self.seed = job, key, shuffle, seed
        self.tensor_name = key_name(*key)
        self._spans = [(e["shard"], int(e["row_start"]), str(e["id"])) for e in job.index]
        counts = [int(e["row_count"]) for e in job.index]
        self._starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        self._handles: OrderedDict[str, Any] = OrderedDict()

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _shard(self, name: str) -> Any:
        handle = self._handles.pop(name, None)
        if handle is None:
            handle = safe_open(self.job.path / name, framework="pt")
            if len(self._handles) >= _OPEN_SHARDS:
                self._handles.popitem(last=False)
        self._handles[name] = handle
        return handle

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        index %= len(self)
        span = int(np.searchsorted(self._starts, index, side="right")) - 1
        shard, row_start, request_id = self._spans[span]
        row = row_start + index - int(self._starts[span])
        fh = self._shard(shard)
        return {"activation": fh.get_slice(self.tensor_name)[row:row + 1][0],
                "token_id": int(fh.get_slice("token_ids")[row:row + 1][0]),
                "position": int(fh.get_slice("positions")[row:row + 1][0]),
                "id": request_id}

    def __iter__(self) -> Iterator[dict[str, Any]]:
        order = (np.random.default_rng(self.seed).permutation(len(self)) if self.shuffle
                 else range(len(self)))
        for index in order:
            yield self[int(index)]

    def __getstate__(self) -> dict[str, Any]:  # DataLoader workers reopen their own handles
        return {**self.__dict__, "_handles": OrderedDict()}


def open_job(path: str | Path, hook: str | None = None, layer: int | None = None, *,
             shuffle: bool = False, seed: int = 0, verify: bool = True) -> JobRows:
    """The rows of one (hook, layer) of an extraction job; `hook`/`layer` may be left out
    when the job holds one key. `verify` checks every shard's sha256 first."""
    job = read_sharded(path, verify=verify)
    keys = job.keys()
    if hook is None and layer is None and len(keys) == 1:
        (key,) = keys
    else:
        if hook is None or layer is None:
            raise ValueError(f"this job holds {len(keys)} (hook, layer) keys {keys}: name one "
                             "with hook= and layer=")
        key = (canonical_hook(hook), int(layer))
        if key not in keys:
            raise KeyError(f"{key} is not in this job; it holds {keys}")
    return JobRows(job, key, shuffle=shuffle, seed=seed)
