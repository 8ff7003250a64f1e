"""Fixtures for the capture tests (helpers live in capture_helpers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "captures"
    r.mkdir()
    return r
