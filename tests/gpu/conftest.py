"""The `gpu` tier: correctness checks that need a CUDA device, run by hand on the lent GPU.

`pytest -m gpu tests/gpu` there; on a machine without CUDA every test here skips, so the
default suite and CI never start them.
"""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    """Registers the marker here because pyproject.toml belongs to the packaging owner."""
    config.addinivalue_line("markers", "gpu: needs a CUDA device (run by hand on the lent GPU)")
    config.addinivalue_line("markers", "multi_gpu: needs two CUDA devices (nvidia-h100-x2 kind)")


def cuda_devices() -> int:
    """How many CUDA devices torch sees; 0 where torch or a driver is missing."""
    try:
        import torch
    except ImportError:  # the check tier is optional; torch is imported only to count GPUs
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skips gpu tests without CUDA, and multi-GPU ones with fewer than two devices."""
    n = None
    for item in items:
        if "gpu" not in item.keywords:
            continue
        n = cuda_devices() if n is None else n
        need = 2 if "multi_gpu" in item.keywords else 1
        if n < need:
            item.add_marker(pytest.mark.skip(reason=f"needs {need} CUDA device(s), found {n}"))
