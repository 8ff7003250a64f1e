"""Byte sizes as people write them (512MiB, 2GB).

Its own module, free of pydantic: `capsteer extract` and the benchmarks parse sizes on
machines that carry only vLLM's dependencies.
"""

from __future__ import annotations

import re

_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1000, "M": 1000**2, "G": 1000**3, "T": 1000**4,
          "KI": 1 << 10, "MI": 1 << 20, "GI": 1 << 30, "TI": 1 << 40}


def parse_size(text: str | int | float) -> int:
    """Bytes from '512MiB', '2GB', '1048576' or an int (binary units with an i)."""
    if isinstance(text, bool):  # bool is an int; `capture_budget: yes` is a mistake
        raise ValueError(f"not a size: {text!r} (examples: 512MiB, 2GiB, 1000000)")
    if isinstance(text, int):
        return text
    if isinstance(text, float) and text.is_integer():
        return int(text)
    m = _SIZE_RE.fullmatch(str(text))
    if not m:
        raise ValueError(f"not a size: {text!r} (examples: 512MiB, 2GiB, 1000000)")
    unit = (m.group(2) or "").upper().removesuffix("B")
    return int(float(m.group(1)) * _UNITS[unit])
