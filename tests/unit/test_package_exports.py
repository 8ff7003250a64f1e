"""`import capsteer` is cheap (no torch, no vLLM) and still hands out what a user imports."""

from __future__ import annotations

import subprocess
import sys

import pytest

import capsteer


@pytest.mark.proc  # a fresh interpreter, so nothing imported before counts
def test_import_capsteer_loads_neither_torch_nor_vllm():
    code = ("import sys, capsteer; "
            "print(sorted(m for m in ('torch', 'vllm', 'transformers') if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "[]"


def test_the_exports_resolve_to_their_defining_objects():
    from capsteer.capture import open_job, read
    from capsteer.engine import Engine
    from capsteer.extraction.local import extract

    assert capsteer.Engine is Engine
    assert capsteer.extract is extract
    assert capsteer.read is read
    assert capsteer.open_job is open_job
    assert {"Engine", "extract", "open_job", "read"} <= set(capsteer.__all__)
    assert {"Engine", "extract", "open_job", "read"} <= set(dir(capsteer))


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = capsteer.nope  # type: ignore[attr-defined]
