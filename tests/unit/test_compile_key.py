"""vLLM's compile-cache key sees only the worker settings that shape the compiled graph:
a new capture directory, extraction job or writer setting must not compile the model
again, while hook code, steering table size, staging rows and stop_at_layer must."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from vllm.config import VllmConfig

from capsteer.capture.spec import parse_capture_spec
from capsteer.config.server import ServerSettings
from capsteer.engine_ext.vllm.section import RUNTIME_KEYS, capsteer_config, take_runtime_config
from capsteer.engine_ext.worker_config import WorkerConfig
from capsteer.extraction.job import job_config

GRAPH = {"hooks_code": "0123abcd", "max_steering_entries": 4096, "staging_rows": 8192}


def _worker(section: dict) -> SimpleNamespace:
    """The one attribute engine_ext.vllm.section reads of a worker: a real VllmConfig."""
    return SimpleNamespace(vllm_config=VllmConfig(additional_config={"capsteer": dict(section),
                                                                     "other": {"x": 1}}))


def _key_after_take(section: dict) -> tuple[str, dict]:
    worker = _worker(section)
    taken = take_runtime_config(worker)
    assert taken == section
    assert capsteer_config(worker) == section  # the worker still reads it whole
    return worker.vllm_config.compute_hash(), worker.vllm_config.additional_config


@pytest.mark.parametrize("runtime", [
    {"capture_dir": "/data/a"},
    {"capture_dir": "/data/b", "capture_budget": 4 << 30, "capture_ring_bytes": 1 << 28,
     "capture_writer_processes": 3, "capture_io": "direct", "capture_digest": "blake3",
     "capture_overload": "reject", "frontend": "server", "end_wait_s": 5.0},
    {"sharded": {"dir": "/jobs/run-7", "spec": {"x": 1}, "job_id": "run-7"}},
])
def test_runtime_settings_leave_the_compile_key_alone(runtime: dict) -> None:
    plain, extra = _key_after_take(GRAPH)
    assert _key_after_take({**GRAPH, **runtime})[0] == plain
    assert extra == {"capsteer": GRAPH, "other": {"x": 1}}  # vLLM's other keys untouched


@pytest.mark.parametrize("change", [
    {"hooks_code": "ffff0000"}, {"max_steering_entries": 16}, {"staging_rows": 64},
    {"stop_at_layer": 3}, {"a_key_not_yet_known": 1},
])
def test_graph_settings_still_key_the_cache(change: dict) -> None:
    assert _key_after_take({**GRAPH, **change})[0] != _key_after_take(GRAPH)[0]


def test_before_the_take_the_key_differs_by_capture_dir() -> None:
    """The premise: vLLM hashes additional_config whole, so the take is what shares it."""
    a = _worker({**GRAPH, "capture_dir": "/data/a"}).vllm_config.compute_hash()
    b = _worker({**GRAPH, "capture_dir": "/data/b"}).vllm_config.compute_hash()
    assert a != b


def test_every_server_and_job_key_is_classified(tmp_path: Path) -> None:
    """What the launcher and an extraction job put in the section: runtime keys, or the
    graph keys they mean to (a new setting must be placed deliberately)."""
    processes = ServerSettings(capture_dir=str(tmp_path), capture_digest="blake3",
                               capture_writer_processes=1, capture_io="direct",
                               capture_ring=1 << 27, capture_staging_rows=512)
    threads = ServerSettings(capture_dir=str(tmp_path), capture_writer="threads")
    server_keys = set(processes.worker_config()) | set(threads.worker_config())
    assert server_keys - RUNTIME_KEYS == {"staging_rows"}
    spec = parse_capture_spec({"hooks": ["resid_post"], "layers": [1]}, num_layers=4)
    job = job_config(tmp_path / "job", spec, 1 << 20, {}, num_layers=4)
    assert set(job) - RUNTIME_KEYS == {"staging_rows", "stop_at_layer"}


def test_the_worker_reads_every_key_with_the_servers_defaults(tmp_path: Path) -> None:
    """WorkerConfig knows every key the launcher and an extraction job write, and a key left
    out means what it means to the server."""
    settings = ServerSettings(capture_dir=str(tmp_path), capture_digest="blake3",
                              capture_writer_processes=1, capture_io="direct",
                              capture_ring=1 << 27, capture_staging_rows=512,
                              plain_graphs=False, stack_room=False)
    spec = parse_capture_spec({"hooks": ["resid_post"], "layers": [1]}, num_layers=4)
    job = job_config(tmp_path / "job", spec, 1 << 20, {}, num_layers=4)
    fields = set(WorkerConfig.__dataclass_fields__)
    assert set(settings.worker_config()) | set(job) <= fields
    given = WorkerConfig.from_section(settings.worker_config())
    assert (given.capture_digest, given.capture_io, given.capture_ring_bytes,
            given.staging_rows, given.plain_graphs, given.stack_room) == (
        "blake3", "direct", 1 << 27, 512, False, False)
    plain, defaults = WorkerConfig(), ServerSettings(capture_dir=str(tmp_path))
    assert (plain.capture_budget, plain.capture_overload, plain.capture_digest,
            plain.capture_io, plain.capture_writer, plain.capture_writer_processes,
            plain.capture_ring_bytes, plain.staging_rows, plain.stack_room) == (
        defaults.capture_budget, defaults.capture_overload, defaults.capture_digest,
        defaults.capture_io, defaults.capture_writer, defaults.capture_writer_processes,
        defaults.capture_ring, defaults.capture_staging_rows, defaults.stack_room)
    assert plain.uses_plain_graphs and not WorkerConfig.from_section(job).uses_plain_graphs

