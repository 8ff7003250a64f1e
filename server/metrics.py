"""capsteer metrics on vLLM's /metrics: the workers' capture metrics plus the server's own.

Capture metrics are counted where the bytes are written (engine workers) and
summed here from their snapshots (every worker of every data-parallel engine);
steering counts and 429 rejections happen in the API servers. Everything is
rendered once, in Prometheus text format, and appended to vLLM's own exposition.

When vLLM runs several API server processes (`--data-parallel-size N`,
`--api-server-count N`) it sets PROMETHEUS_MULTIPROC_DIR before starting any
process, so every prometheus_client metric of every process, capsteer's included,
lives in that directory's mmap files and vLLM's multiprocess collector exports
them. Two consequences handled here: capsteer families are removed from vLLM's
part (else each family appears twice, the second time with the wrong gauges), and
the API-server counts are read back from those files, summed over the API servers,
under private names that never collide with the workers' families.
"""

from __future__ import annotations

import glob
import os
from typing import Any

from prometheus_client import CollectorRegistry, Counter, generate_latest, values
from prometheus_client.multiprocess import MultiProcessCollector

from capsteer.capture import metrics as capture_metrics

# This API process's own counts (mmap-backed, and so shared, under several API servers).
_LOCAL = CollectorRegistry(auto_describe=True)
STEERING_REQUESTS = Counter(
    "capsteer_api_steering_requests", "Requests served with a steering field (this process).",
    registry=_LOCAL)
_REJECTED = Counter(
    "capsteer_api_capture_rejected", "Captures refused with 429 (this process).",
    registry=_LOCAL)
_STEERING_SAMPLE = "capsteer_api_steering_requests_total"
_REJECTED_SAMPLE = "capsteer_api_capture_rejected_total"
_PREFIX = b"capsteer_"


def count_rejection() -> None:
    _REJECTED.inc()


def _shared_files() -> list[str] | None:
    """The multiprocess counter files, when this process's metrics live in them."""
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not path or values.ValueClass is values.MutexValue:
        return None
    return glob.glob(os.path.join(path, "counter_*.db"))


def api_counts() -> tuple[float, float]:
    """(steering requests, 429 rejections) over every API server process of this server."""
    files = _shared_files()
    metrics = MultiProcessCollector.merge(files) if files is not None else _LOCAL.collect()
    steering = rejected = 0.0
    for metric in metrics:
        for s in metric.samples:
            if s.name == _STEERING_SAMPLE:
                steering += s.value
            elif s.name == _REJECTED_SAMPLE:
                rejected += s.value
    return steering, rejected


def api_snapshot(vectors: int, admitted_bytes: int = 0, readers: int = 0) -> dict[str, Any]:
    """The API servers' part, shaped like capture_metrics.snapshot() so it merges with the
    workers' (a 429 is one capture request with status "rejected"). `admitted_bytes`: what
    the reject policy holds reserved in the API process answering the scrape."""
    steering, rejected = api_counts()

    def one(kind: str, help_text: str, sample: str, value: float, **labels: str) -> dict:
        return {"type": kind, "help": help_text,
                "samples": [{"name": sample, "labels": labels, "value": value}]}
    return {
        "capsteer_steering_requests": one(
            "counter", "Requests served with a steering field.",
            "capsteer_steering_requests_total", steering),
        "capsteer_steering_vectors": one(
            "gauge", "Named vectors in the steering registry.",
            "capsteer_steering_vectors", float(vectors)),
        "capsteer_readers": one(
            "gauge", "Readers (linear probes, SAEs) in the reader registry.",
            "capsteer_readers", float(readers)),
        "capsteer_capture_rejected": one(
            "counter", "Captures refused up front because the in-flight budget was exhausted.",
            "capsteer_capture_rejected_total", rejected),
        "capsteer_capture_requests": one(
            "counter", "Finished captures by final status (ok, error, dropped, rejected).",
            "capsteer_capture_requests_total", rejected, status="rejected"),
        "capsteer_capture_admitted_bytes": one(
            "gauge", "Bytes the reject policy holds reserved for captures not yet final "
            "(the API server process answering this scrape).",
            "capsteer_capture_admitted_bytes", float(admitted_bytes)),
    }


# Every capsteer family the API server adds (the dashboard test reads it without a server).
REGISTRY = CollectorRegistry(auto_describe=False)
# Names and types only: /metrics serves live values through `render`.
REGISTRY.register(capture_metrics.SnapshotCollector(lambda: [api_snapshot(0)]))


def render(worker_snapshots: list[dict], vectors: int, admitted_bytes: int = 0,
           readers: int = 0) -> bytes:
    """Text exposition of the summed worker snapshots and the API servers' counts."""
    merged = CollectorRegistry(auto_describe=False)
    sources = [*worker_snapshots, api_snapshot(vectors, admitted_bytes, readers)]
    merged.register(capture_metrics.SnapshotCollector(lambda: sources))
    return generate_latest(merged)


def strip_capsteer(exposition: bytes) -> bytes:
    """vLLM's exposition without capsteer families (its multiprocess collector picks them
    up from the shared files; capsteer's own block has the right values)."""
    if _PREFIX not in exposition:
        return exposition
    kept = []
    for line in exposition.splitlines(keepends=True):
        name = line.split(b" ", 3)[2] if line.startswith((b"# HELP ", b"# TYPE ")) else line
        if not name.startswith(_PREFIX):
            kept.append(line)
    return b"".join(kept)
