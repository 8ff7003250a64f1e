"""The sinks an engine worker's settings ask for: the durable writer (threads, one writer
process or several) and an extraction job's shard writer."""

from __future__ import annotations

import torch

from capsteer.capture.digests import DEFAULT_DIGEST
from capsteer.capture.publish import IO_MODES
from capsteer.capture.sink import CaptureSink
from capsteer.capture.spec import CaptureSpec
from capsteer.capture.writer.budget import (
    check_processes,
    check_ring_bytes,
)
from capsteer.capture.writer.fanout import ProcessWriterPool, auto_processes
from capsteer.capture.writer.local import CaptureWriter
from capsteer.capture.writer.process import ProcessCaptureWriter
from capsteer.capture.writer.shard_sink import ShardedSink
from capsteer.capture.writer.sharded import ShardedWriter
from capsteer.config.server import ServerSettings
from capsteer.config.sizes import parse_size


def _default(setting: str) -> object:
    """The server's default for a setting: the one place capture defaults are written."""
    return ServerSettings.model_fields[setting].default


def durable_writer(config: dict) -> CaptureSink | None:
    """The durable writer pool when a capture root is configured."""
    root = config.get("capture_dir")
    if not root:
        return None
    io = str(config.get("capture_io", _default("capture_io")))
    if io not in IO_MODES:
        raise ValueError(f"capture_io must be one of {', '.join(IO_MODES)}; got {io!r}")
    kwargs = {"budget_bytes": int(config.get("capture_budget", _default("capture_budget"))),
              "policy": str(config.get("capture_overload", _default("capture_overload"))),
              "workers": int(config["capture_workers"]) if "capture_workers" in config else None,
              "digest": str(config.get("capture_digest", _default("capture_digest"))),
              "direct_io": io == "direct"}
    mode = str(config.get("capture_writer", _default("capture_writer")))
    if mode == "process":  # publishing must not hold the engine process's GIL
        processes = config.get("capture_writer_processes",
                               _default("capture_writer_processes"))
        processes = auto_processes(kwargs["policy"]) if processes is None else int(processes)
        check_processes(processes, kwargs["policy"])  # 0, or a split budget under drop/reject
        # The shared-memory ring each writer process takes rows through (and the engine's
        # GPU copies land in): how large a burst leaves the engine before it waits on the
        # children (server flag --capture-ring).
        kwargs["ring_bytes"] = parse_size(config.get("capture_ring_bytes", _default("capture_ring")))
        check_ring_bytes(kwargs["ring_bytes"], "capture_ring_bytes")
        if processes > 1:  # one child's main thread bounds it below a disk's rate
            return ProcessWriterPool(root, processes=processes, **kwargs)
        return ProcessCaptureWriter(root, **kwargs)
    if mode != "threads":
        raise ValueError(f"capture_writer must be process or threads; got {mode!r}")
    return CaptureWriter(root, **kwargs)


def sharded_sink(config: dict, model: str, hidden: int,
                 model_dtype: torch.dtype, hook_widths: dict[str, int] | None = None,
                 ) -> ShardedSink | None:
    """An extraction job's shard writer (many requests per file) when configured."""
    job = config.get("sharded")
    if not job:
        return None
    spec = CaptureSpec.from_dict(job["spec"])
    dtype = model_dtype if spec.dtype == "auto" else getattr(torch, spec.dtype)
    writer = ShardedWriter(job["dir"], keys=spec.keys(), hidden_size=hidden, dtype=dtype,
                           hook_widths=hook_widths,
                           shard_bytes=int(job.get("shard_bytes", 1 << 30)), model=model,
                           spec=spec, job_id=job.get("job_id"),
                           digest=str(job.get("digest", DEFAULT_DIGEST)))
    return ShardedSink(writer)
