"""Session fixtures shared by every suite: demo models, HF references, and one pool that
keeps at most one engine or server alive at a time (2 cores, 24 GiB).

Tests that need an engine or a server are marked `engine` and `uses_engine(name)`;
they run after the fast suites, grouped by name, so each engine starts once.
"""

from __future__ import annotations

import gc
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from capsteer.demo_model import write_demo_model


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


class LazyDict(dict):
    """Built on first use per key: a session touches only the families its tests run."""

    def __init__(self, build: Callable[[str], object]) -> None:
        super().__init__()
        self.build = build

    def __missing__(self, key: str):
        value = self[key] = self.build(key)
        return value


MODEL_CACHE_ENV = "CAPSTEER_TEST_MODEL_CACHE"


def _demo_model_key(family: str, seed: int) -> str:
    """What a demo model's bytes depend on: its writer's source and the libraries that
    draw and save it."""
    import tokenizers
    import torch
    import transformers

    from capsteer import demo_model

    digest = hashlib.sha256(Path(demo_model.__file__).read_bytes())
    digest.update(f"{family}/{seed}/{torch.__version__}/{transformers.__version__}/"
                  f"{tokenizers.__version__}".encode())
    return f"{family}-{digest.hexdigest()[:16]}"


def stable_demo_model(family: str, seed: int = 7) -> Path:
    """The demo model at a path that stays the same from run to run. vLLM's compile-cache
    key includes the model's path (capsteer's key adds its hook code's hash), so engine
    starts after the first run load compiled graphs instead of compiling them: ~30 s of
    each start on the 2-core CI hosts. Built once into a temporary directory, then
    renamed into place, so a run never sees half a model."""
    root = Path(os.environ.get(MODEL_CACHE_ENV)
                or Path.home() / ".cache" / "capsteer" / "test-models")
    final = root / _demo_model_key(family, seed)
    if (final / "config.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f".{family}-", dir=root))
    try:
        write_demo_model(building, family, seed=seed)
        try:
            building.rename(final)
        except OSError:  # another run put it in place first: theirs is the same bytes
            if not (final / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return final


@pytest.fixture(scope="session")
def model_dirs() -> dict[str, str]:
    """Demo model directory per family (capsteer.demo_model.FAMILIES), seed 7."""
    return LazyDict(lambda family: str(stable_demo_model(family, seed=7)))


@pytest.fixture(scope="session")
def engine_pool():
    pool = EnginePool()
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def hf_models(model_dirs):
    from capsteer.reference import load_hf

    return LazyDict(lambda family: load_hf(model_dirs[family]))


@pytest.fixture(scope="session")
def capture_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("captures"))



# Engines and servers in the order their tests run (one alive at a time).
ENGINE_ORDER = ("qwen3", "qwen3-durable", "qwen3-eager", "llama", "qwen2", "mistral", "gemma",
                "gemma2", "gemma3", "phi3", "olmo2", "granite", "qwen2_moe", "qwen3_moe", "mixtral",
                "olmoe", "vanilla", "qwen3-bf16", "vanilla-bf16", "other", "extract",
                "qwen3-tp2", "qwen3-pp2",
                "server-vanilla", "server", "server-reject", "server-dp2", "quickstart")


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
