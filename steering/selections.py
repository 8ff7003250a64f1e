"""Selections on a steering item: which neurons (mlp_post) or heads (attn_z) an op acts on.

A selection is a 0/1 mask over the hook's width (1: selected; a head is its d_head
columns of attn_z's [heads * d_head]), carried beside the op's
vector. `ablate` zeroes the selected slices, `clamp` sets them to `value`, `add` adds
scale * vector there only; the engine applies it as data (engine_ext/selections.py).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from capsteer.config import errors
from capsteer.hooks import SELECTIONS

SELECTION_FIELDS = frozenset(SELECTIONS.values())


def parse_selection(item: Mapping, field: str, hook: str, width: int,
                    heads: int | None = None) -> np.ndarray | None:
    """The mask an item's selection field gives (None: it has none); raises
    SelectionError (field, reason) for a selection the hook does not take or a bad index.
    `heads`: attn_z's head count (its width is heads * d_head)."""
    given = [name for name in sorted(SELECTION_FIELDS) if name in item]
    if not given:
        return None
    name = given[0]
    if len(given) > 1 or SELECTIONS.get(hook) != name:
        takes = ", ".join(f"{v} on {h}" for h, v in SELECTIONS.items())
        raise SelectionError(f"{field}.{name}", f"{hook} takes no `{name}` selection "
                             f"(selections: {takes})")
    raw = item[name]
    if not isinstance(raw, list) or not raw or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in raw):
        raise SelectionError(f"{field}.{name}", "must be a non-empty list of integers")
    units = width if name == "neurons" else int(heads or 0)
    if units <= 0 or width % units:
        raise SelectionError(f"{field}.{name}", f"this model's {hook} has no {name} to select")
    bad = [i for i in raw if not 0 <= i < units]
    if bad:
        raise SelectionError(f"{field}.{name}", f"{bad[0]} is out of range: {hook} has "
                             f"{units} {name} (0..{units - 1})")
    if len(set(raw)) != len(raw):
        raise SelectionError(f"{field}.{name}", "lists an index twice")
    mask = np.zeros((units, width // units), np.float32)
    mask[np.asarray(raw, np.int64)] = 1.0
    return mask.reshape(-1)


class SelectionError(errors.InvalidInput, ValueError):
    """A bad selection: `field` names the request field, `reason` says why."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason
