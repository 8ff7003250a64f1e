"""capsteer: per-request activation capture and steering on stock vLLM.

What a user imports: `Engine` (the in-process engine), `extract` (run or resume an
extraction job), `read` (one capture directory) and `open_job` (an extraction job's
rows as a torch Dataset). They load on first use, so `import capsteer` stays cheap:
no torch or vLLM until one of them is touched.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from capsteer.capture import open_job, read
    from capsteer.engine import Engine
    from capsteer.extraction.local import extract

# name -> the module that defines it
_EXPORTS = {
    "Engine": "capsteer.engine",
    "extract": "capsteer.extraction.local",
    "open_job": "capsteer.capture",
    "read": "capsteer.capture",
}

__all__ = ["Engine", "__version__", "extract", "open_job", "read"]


def __getattr__(name: str) -> Any:
    """Import an export on first access (PEP 562), then keep it as a plain attribute."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'capsteer' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
