"""capsteer metrics on vLLM's /metrics: the workers' capture metrics plus the server's own.

Capture metrics are counted where the bytes are written (engine workers) and
summed here from their snapshots; steering counts and 429 rejections happen in
the API server. Everything is rendered once, in Prometheus text format, and
appended to vLLM's own exposition.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from capsteer.capture import metrics as capture_metrics

REGISTRY = CollectorRegistry(auto_describe=True)
STEERING_REQUESTS = Counter(
    "capsteer_steering_requests_total", "Requests served with a steering field.",
    registry=REGISTRY)
STEERING_VECTORS = Gauge(
    "capsteer_steering_vectors", "Named vectors in the steering registry.", registry=REGISTRY)
REJECTED = Counter(
    "capsteer_capture_rejected_total",
    "Captures refused up front because the in-flight budget was exhausted.", registry=REGISTRY)
REQUESTS = Counter(
    "capsteer_capture_requests_total",
    "Finished captures by final status (ok, error, dropped, rejected).", ["status"],
    registry=REGISTRY)


def count_rejection() -> None:
    REJECTED.inc()
    REQUESTS.labels(status="rejected").inc()


def render(worker_snapshots: list[dict], vectors: int) -> bytes:
    """Text exposition of the summed worker snapshots and the server's counters."""
    STEERING_VECTORS.set(vectors)
    merged = CollectorRegistry(auto_describe=False)
    sources = [*worker_snapshots, capture_metrics.snapshot(REGISTRY)]
    merged.register(capture_metrics.SnapshotCollector(lambda: sources))
    return generate_latest(merged)
