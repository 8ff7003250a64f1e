"""Steering arithmetic for hooks of any width, with selections as data.

A steering entry is y = keep * x + alpha * (src . u) u + w, applied where its gate
passes. `keep` is a per-entry row of the runtime's tables: all ones (the usual entry),
or zeros at the neurons or heads a selection ablates or clamps (`"neurons": [..]` on
mlp_post), so a selection costs no branch in the forward. The tables are as wide as
the widest hook (runtime.HookRuntime.width); a site of width d reads each row's first d
columns. An entry's flags (the runtime's `gated`) say what it holds beyond w: bit 0 a
gate, bit 1 a keep row that is not all ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from capsteer.engine_ext.families import INNER_HOOKS, inner_site, site_count
from capsteer.hooks import WIDE_HOOKS

HookRuntime = Any  # engine_ext.runtime's (which imports this module)

GATED, MASKED = 1, 2  # flag bits of an entry


def site_widths(hook_widths: Mapping[str, int], num_layers: int, hidden: int) -> list[int]:
    """Each site's width: hidden_size, but an inner hook's own width at its sites."""
    widths = [hidden] * site_count(num_layers)
    for hook in INNER_HOOKS:
        for layer in range(num_layers):
            widths[inner_site(hook, layer, num_layers)] = int(hook_widths.get(hook, hidden))
    return widths


def column_shards(hook_widths: Mapping[str, int], num_layers: int, rank: int,
                  size: int) -> dict[int, slice]:
    """Under tensor parallelism, the columns of the full row this rank holds at each site
    whose columns are split across the ranks (mlp_post: vLLM's MergedColumnParallelLinear
    gives rank r the r-th contiguous block of d_mlp; attn_z: QKVParallelLinear gives it the
    r-th block of the query heads, so of heads * d_head). Both are the input of a
    RowParallelLinear, which keeps block r of its input on rank r."""
    if size <= 1:
        return {}
    shards = {}
    for hook in WIDE_HOOKS:
        width = hook_widths.get(hook)
        if width is None:
            continue
        if width % size:
            raise ValueError(f"{hook}'s width {width} does not split into "
                             f"{size} tensor-parallel ranks")
        local = width // size
        for layer in range(num_layers):
            shards[inner_site(hook, layer, num_layers)] = slice(rank * local, (rank + 1) * local)
    return shards


def local_map(mapping: tuple, columns: slice | None) -> tuple:
    """A composed map (u, alpha, w, gate, keep; plan.compose_entries) cut to the columns
    this rank holds (None: all of them). Each rank steers its own columns with its slice;
    a projection or gate needs every rank's columns, so it is refused (the front ends refuse
    it first, by name)."""
    if columns is None:
        return mapping
    u, alpha, w, gate, keep = mapping
    if alpha != 0.0 or gate is not None:
        raise ValueError("an ablate/clamp along a vector or a `when` gate on a hook whose "
                         "columns are split across the tensor-parallel ranks (mlp_post, "
                         "attn_z) needs all of them; only add and selections are offered")
    return u[columns], alpha, w[columns], None, None if keep is None else keep[columns]


def same_map(a: tuple, b: tuple) -> bool:
    """Whether two composed maps (u, alpha, w, gate, keep) are equal (then they share an
    entry)."""
    (u, alpha, w, gate, keep), (u2, alpha2, w2, gate2, keep2) = a, b
    same_gate = gate is gate2 or (gate is not None and gate2 is not None and
                                  gate[1] == gate2[1] and torch.equal(gate[0], gate2[0]))
    same_keep = keep is keep2 or (keep is not None and keep2 is not None
                                  and torch.equal(keep, keep2))
    return same_gate and same_keep and alpha == alpha2 and torch.equal(u, u2) \
        and torch.equal(w, w2)


def pad_row(vec: torch.Tensor, width: int, fill: float = 0.0) -> torch.Tensor:
    """`vec` (float32) padded with `fill` to the tables' width."""
    vec = vec.float().reshape(-1)
    if vec.shape[0] > width:
        raise ValueError(f"a steering row of width {vec.shape[0]} exceeds the tables' "
                         f"width {width}")
    if vec.shape[0] == width:
        return vec
    return torch.cat([vec, torch.full((width - vec.shape[0],), fill, dtype=torch.float32)])


def steer_rows(rt: HookRuntime, xs: torch.Tensor, src: torch.Tensor, entries: torch.Tensor,
               masked: bool = True) -> torch.Tensor:
    """Each row's entry applied to float32 rows `xs` (src: what the projection reads),
    ungated; `masked` False skips the keep rows (host mode while no entry has one)."""
    d = xs.shape[-1]
    u = rt.u[entries, :d]
    proj = (src * u).sum(-1, keepdim=True)
    kept = xs * rt.keep[entries, :d] if masked else xs
    return kept + rt.alpha[entries].unsqueeze(1) * proj * u + rt.w[entries, :d]


def passes(rt: HookRuntime, src: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
    """[k, 1]: each row's entry is ungated or gate_b + src . gate > 0 (as the kernel)."""
    d = src.shape[-1]
    score = rt.gate_b[entries] + (src * rt.gate[entries, :d]).sum(-1)
    return (((rt.gated[entries] & GATED) == 0) | (score > 0)).unsqueeze(1)
