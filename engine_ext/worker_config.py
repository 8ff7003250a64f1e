"""The worker's settings: capsteer's section of vLLM's `additional_config`, read once into
a frozen record whose defaults are the server's (config.server.ServerSettings), so the
server and the in-process engine cannot drift apart on a default."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from capsteer.config.server import ServerSettings


def _server_default(name: str) -> Any:
    """ServerSettings' default for `name` (the one place these defaults are written)."""
    return ServerSettings.model_fields[name].default


def _optional(kind: type, value: Any) -> Any:
    return None if value is None else kind(value)


@dataclass(frozen=True)
class WorkerConfig:
    """What one worker was asked to do (engine_ext.vllm.section reads the section)."""

    capture_dir: str | None = None  # no durable captures without one (the in-process engine)
    readers_dir: str | None = None  # the server's registered readers (probes, SAEs)
    readout_dir: str | None = None  # where readout results go to the server
    # The server's vector registry: requests name its vectors instead of carrying them.
    steering_dir: str | None = None
    capture_budget: int = _server_default("capture_budget")
    capture_overload: str = _server_default("capture_overload")
    capture_workers: int | None = None
    capture_digest: str = _server_default("capture_digest")
    capture_io: str = _server_default("capture_io")
    capture_writer: str = _server_default("capture_writer")
    capture_writer_processes: int | None = _server_default("capture_writer_processes")
    capture_ring_bytes: int | str = _server_default("capture_ring")
    staging_rows: int | None = _server_default("capture_staging_rows")  # None: 4 x max tokens
    plain_graphs: bool | None = None  # None: on, except in an extraction job (sharded)
    stack_room: bool = _server_default("stack_room")
    max_steering_entries: int = 4096
    patch_rows: int = 2048  # device mode's patch table (rows of hidden floats, float32)
    end_wait_s: float = 60.0  # how long a finished capture waits for its end report
    sync_debug: bool = False
    canary: str | None = None  # "warn": a failed canary is logged, never refused (diagnostics)
    frontend: str | None = None  # "server" under `capsteer serve`
    sharded: Mapping[str, Any] | None = None  # an extraction job's shard writer settings
    stop_at_layer: int | None = None
    hooks_code: str | None = None
    # The section as given: the capture sink factory reads its writer keys from it.
    section: Mapping[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_section(cls, section: Mapping[str, Any]) -> WorkerConfig:
        """Unknown keys are ignored, as the worker always did."""
        known = {f.name for f in fields(cls)} - {"section"}
        given = {k: v for k, v in section.items() if k in known}
        for name in ("capture_budget", "max_steering_entries", "patch_rows"):
            if name in given:
                given[name] = int(given[name])
        for name in ("capture_workers", "capture_writer_processes", "staging_rows",
                     "stop_at_layer"):
            if name in given:
                given[name] = _optional(int, given[name])
        for name in ("capture_overload", "capture_digest", "capture_io", "capture_writer"):
            if name in given:
                given[name] = str(given[name])
        if "end_wait_s" in given:
            given["end_wait_s"] = float(given["end_wait_s"])
        for name in ("stack_room", "sync_debug"):
            if name in given:
                given[name] = bool(given[name])
        return cls(**given, section=dict(section))

    @property
    def uses_plain_graphs(self) -> bool:
        """Plain CUDA graphs unless turned off; an extraction job's every request has hooks,
        so there they are off unless asked for."""
        return bool(self.plain_graphs) if self.plain_graphs is not None else not self.sharded
