"""capsteer's section of vLLM's `additional_config`: how the worker reads it, and which
of its keys are kept out of vLLM's compile-cache key."""

from __future__ import annotations

# Keys of capsteer's worker section that say where captures go and how they are written:
# nothing in the compiled graph or in the device buffers depends on them. vLLM hashes
# `additional_config` into its compile-cache key, so while they sit there every new capture
# directory, extraction job or writer setting compiles the model again (minutes for a large
# model on a GPU). Every other key (hooks_code, max_steering_entries, staging_rows,
# stop_at_layer, a key this list does not know) stays in the key.
RUNTIME_KEYS = frozenset({
    "capture_dir", "capture_budget", "capture_overload", "capture_workers", "capture_digest",
    "capture_io", "capture_writer", "capture_writer_processes", "capture_ring_bytes",
    "sharded", "end_wait_s", "frontend", "canary", "plain_graphs", "stack_room",
    "readers_dir", "readout_dir", "steering_dir"})


def capsteer_config(worker: object) -> dict:
    """capsteer's worker section, as given (`take_runtime_config` keeps it on the worker)."""
    kept = getattr(worker, "_capsteer_section", None)
    if kept is not None:
        return dict(kept)
    return config_section(worker.vllm_config)


def config_section(vllm_config: object) -> dict:
    """capsteer's section of a vLLM config's `additional_config` (a copy; {} if absent)."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    section = extra.get("capsteer", {}) if isinstance(extra, dict) else {}
    return dict(section) if isinstance(section, dict) else {}


def take_runtime_config(worker: object) -> dict:
    """Keep capsteer's whole section on the worker and leave in vLLM's additional_config only
    the keys that shape the compiled graph, so that the compile cache (keyed when the model
    first runs, after this) is shared by every capture directory and writer setting.
    The worker's config is its own copy (or the in-process engine core's, which reads no
    capsteer key)."""
    section = capsteer_config(worker)
    worker._capsteer_section = section
    extra = worker.vllm_config.additional_config
    if isinstance(extra, dict) and isinstance(extra.get("capsteer"), dict):
        extra["capsteer"] = graph_section(section)
    return dict(section)


def graph_section(section: dict) -> dict:
    """The part of capsteer's worker section that vLLM's compile-cache key should see."""
    return {k: v for k, v in section.items() if k not in RUNTIME_KEYS}
