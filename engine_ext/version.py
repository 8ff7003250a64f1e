"""A fingerprint of the hook code, folded into vLLM's compile-cache key.

vLLM hashes `additional_config` into its cache key, so a compiled graph built
without capsteer's hooks (vanilla vLLM) or with other hook code is never reused.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

_HOOK_SOURCES = ("runtime.py", "adapter.py", "worker.py", "plan.py", "families.py", "tap_kernel.py")


@functools.cache
def hooks_code_hash() -> str:
    digest = hashlib.sha256()
    here = Path(__file__).parent
    for name in _HOOK_SOURCES:
        digest.update((here / name).read_bytes())
    # A graph compiled with a site deliberately left unhooked must never be reused.
    digest.update(os.environ.get("CAPSTEER_FAULT_INJECT", "").encode())
    return digest.hexdigest()[:16]
