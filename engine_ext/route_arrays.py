"""A step's capture routes as whole arrays: the device index tables and the harvester's
spans read hundreds of routes a decode step (one per capturing or reading request), so
each reads them in a few list comprehensions and numpy operations rather than a numpy
call or two per route."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


def route_ranks(routes: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]:
    """The rows of `routes` and each one's rank among its route's rows, a later route's
    rank winning where routes share a row (what assigning route by route leaves)."""
    parts = [r.rows for r in routes]
    lens = np.fromiter(map(len, parts), np.int64, len(parts))
    rows = np.concatenate(parts).astype(np.int64, copy=False)
    ranks = np.arange(len(rows), dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
    if len(rows) < 2:
        return rows, ranks
    kept, last = np.unique(rows[::-1], return_index=True)
    return kept, ranks[::-1][last]


def route_starts(routes: Sequence[Any], staging_offset: Mapping[tuple[int, int], int]
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Each route's first staging row and its row count."""
    return _starts(routes, staging_offset), np.fromiter([len(r.positions) for r in routes],
                                                        np.int64, len(routes))


def _starts(routes: Sequence[Any], staging_offset: Mapping[tuple[int, int], int]) -> np.ndarray:
    return np.fromiter([staging_offset[r.point] + r.offset for r in routes], np.int64,
                       len(routes))


def route_entries(routes: Sequence[Any], staging_offset: Mapping[tuple[int, int], int],
                  num_sites: int) -> tuple[np.ndarray, np.ndarray]:
    """The flat [slot, kind, site] entries of the copy table (HookRuntime.point_base) the
    routes set, each once (a later route wins), and their first staging rows."""
    m = len(routes)
    slots = np.fromiter([r.slot for r in routes], np.int64, m)
    points = np.array([r.point for r in routes], np.int64).reshape(m, 2)
    starts = _starts(routes, staging_offset)
    flat = (slots * 2 + points[:, 0]) * num_sites + points[:, 1]
    keys, last = np.unique(flat[::-1], return_index=True)  # each entry's last occurrence
    return keys, starts[::-1][last]
