"""Server settings: one typed record, its defaults, and how it travels to the API process.

`capsteer serve` parses the capsteer flags into `ServerSettings`; vLLM then builds its
own app in the same process (or in several API processes), and the capsteer
middleware reads the settings back from the environment (`from_env`), so every
API process sees the same values.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from capsteer.capture.spec import DEFAULT_SPEC, LAYOUTS

ENV_VAR = "CAPSTEER_SERVER_SETTINGS"
OVERLOAD_POLICIES = ("block", "drop", "reject")
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1000, "M": 1000**2, "G": 1000**3, "T": 1000**4,
          "KI": 1 << 10, "MI": 1 << 20, "GI": 1 << 30, "TI": 1 << 40}


def parse_size(text: str | int) -> int:
    """Bytes from '512MiB', '2GB', '1048576' (binary units with an i)."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.fullmatch(str(text))
    if not m:
        raise ValueError(f"not a size: {text!r} (examples: 512MiB, 2GiB, 1000000)")
    unit = (m.group(2) or "").upper().removesuffix("B")
    return int(float(m.group(1)) * _UNITS[unit])


@dataclass(frozen=True)
class ServerSettings:
    """Everything the capsteer layer of the API server needs (defaults live here)."""

    capture_dir: str = "captures"
    capture_layout: str = "packed"
    capture_overload: str = "block"
    capture_budget: int = 1 << 30  # bytes of capture rows in flight (engine memory)
    capture_wait_timeout: float = 60.0  # seconds a capture_wait response may be held
    steering_dir: str = "steering-vectors"
    admin_key: str | None = None  # required for registry mutations when set
    capture_default: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_SPEC))

    def __post_init__(self) -> None:
        if self.capture_layout not in LAYOUTS:
            raise ValueError(f"capture_layout must be one of {LAYOUTS}, got {self.capture_layout!r}")
        if self.capture_overload not in OVERLOAD_POLICIES:
            raise ValueError(f"capture_overload must be one of {OVERLOAD_POLICIES}, "
                             f"got {self.capture_overload!r}")
        if self.capture_budget <= 0:
            raise ValueError("capture_budget must be positive")
        if self.capture_wait_timeout <= 0:
            raise ValueError("capture_wait_timeout must be positive")

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls) -> ServerSettings:
        raw = os.environ.get(ENV_VAR)
        if not raw:
            return cls()
        data = json.loads(raw)
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def worker_config(self) -> dict[str, Any]:
        """The part the engine workers need (passed through vLLM's additional_config)."""
        return {"capture_dir": os.path.abspath(self.capture_dir),
                "capture_budget": self.capture_budget,
                "capture_overload": self.capture_overload}
