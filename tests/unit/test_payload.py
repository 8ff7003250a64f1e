"""The payload module both sides import (engine_ext/payload.py)."""

from __future__ import annotations


def test_every_rpc_name_is_a_worker_method() -> None:
    """The front ends call the worker by the names in engine_ext.payload."""
    from capsteer.engine_ext.payload import RPC_METHODS
    from capsteer.engine_ext.worker import CapsteerWorker

    assert all(callable(getattr(CapsteerWorker, name, None)) for name in RPC_METHODS)


def test_the_server_does_not_import_the_in_process_engine() -> None:
    """server/ builds payloads from engine_ext.payload, never through capsteer.engine."""
    import ast
    from pathlib import Path

    import capsteer.server

    for path in Path(capsteer.server.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert node.module != "capsteer.engine", path
