"""Capture metrics (names fixed by api.md §6) in a registry of their own.

The writer usually lives in a vLLM worker process while /metrics is served by the
API process, so besides the prometheus_client objects there is `snapshot()` (a
plain JSON-safe dict) and `SnapshotCollector`, which re-exports snapshots taken
in other processes from the server's registry.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

REGISTRY = CollectorRegistry(auto_describe=True)

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

REQUESTS = Counter(
    "capsteer_capture_requests_total",
    "Finished captures by final status (ok, error, dropped, rejected).",
    ["status"],
    registry=REGISTRY,
)
BYTES = Counter(
    "capsteer_capture_bytes_total", "Bytes of published capture data files.", registry=REGISTRY
)
FILES = Counter(
    "capsteer_capture_files_total",
    "Capture data files published (safetensors; manifests not counted).",
    registry=REGISTRY,
)
PUBLISH_SECONDS = Histogram(
    "capsteer_capture_publish_seconds",
    "Request end to capture durable on disk (manifest fsynced).",
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
INFLIGHT_BYTES = Gauge(
    "capsteer_capture_inflight_bytes",
    "Row bytes held in memory by the capture writer (bounded by its budget).",
    registry=REGISTRY,
)
DROPPED = Counter(
    "capsteer_capture_dropped_total",
    "Captures dropped instead of published, by reason.",
    ["reason"],
    registry=REGISTRY,
)
REJECTED = Counter(
    "capsteer_capture_rejected_total",
    "Captures refused up front because the in-flight budget was exhausted.",
    registry=REGISTRY,
)
# Counted by the engine workers (this registry is theirs), not by the API server.
STEERING_REFUSED = Counter(
    "capsteer_steering_refused_total",
    "Steered requests whose hooks a worker could not install (e.g. its steering table was "
    "full): they ran unsteered. Counted by tensor-parallel rank 0 of each pipeline stage.",
    registry=REGISTRY,
)
# Counted by the engine workers that run the readers (TP rank 0 of each pipeline stage).
READOUT_ROWS = Counter(
    "capsteer_readout_rows_total",
    "Tokens read by readout readers (linear probes, SAEs): one per token and readout item.",
    registry=REGISTRY,
)
FSYNC_SECONDS = Histogram(
    "capsteer_fsync_seconds",
    "Duration of each fsync (files and directories) done by the capture writer.",
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)


class SourcedCounters:
    """A counter family whose values an engine keeps in plain numbers, read only when
    metrics are collected: a step pays no lock and no call for them.

    The source is one bound method returning {label value: count}; it is held weakly, so
    a closed engine is not kept alive by its metrics. Without a source (the API server,
    an engine that does not count this) the family is exported empty.
    """

    def __init__(self, name: str, help_text: str, label: str) -> None:
        self.name, self.help, self.label = name, help_text, label
        self._source: weakref.WeakMethod | None = None

    def set_source(self, source: Callable[[], dict[str, float]] | None) -> None:
        """A bound method returning the count per label value (None: an empty family)."""
        self._source = None if source is None else weakref.WeakMethod(source)

    def collect(self) -> Iterable[Metric]:
        family = CounterMetricFamily(self.name, self.help, labels=[self.label])
        source = self._source() if self._source is not None else None
        for value, count in (source() if source is not None else {}).items():
            family.add_metric([value], float(count))
        yield family


GRAPH_REPLAYS = SourcedCounters(
    "capsteer_graph_replays",
    "Forwards replayed from CUDA graphs, by set: plain (recorded without capsteer's taps, "
    "for steps whose requests carry no capture or steering) or hooked. One a step run from "
    "graphs, start-up and dummy forwards included; counted by the first pipeline stage; "
    "empty where one set is recorded.",
    "set")  # source: engine_ext.worker's graph_replay_counts (engine_ext.vllm.graphs.PlainGraphs)
ENGINE_WAITS = SourcedCounters(
    "capsteer_capture_engine_wait_seconds",
    "Seconds an engine worker's threads waited for captured rows to move on, by what they "
    "waited for: harvest_slot (the step thread, for a pinned staging slot the harvester "
    "thread had not emptied: the step, and every request batched in it, waits), "
    "writer_ring (for a writer process to free ring space) and writer_budget (an "
    "in-process writer's budget). Counted by each worker that writes captures.",
    "wait")  # source: engine_ext.worker's capture_wait_seconds
REGISTRY.register(GRAPH_REPLAYS)
REGISTRY.register(ENGINE_WAITS)


def render() -> bytes:
    """Prometheus text exposition of this process's capture metrics."""
    return generate_latest(REGISTRY)


def snapshot(registry: CollectorRegistry | None = None) -> dict[str, Any]:
    """All capture metrics (or those of `registry`) as a JSON-safe dict, for export
    from another process.

    Shape: {name: {"type", "help", "samples": [{"name", "labels", "value"}]}}.
    """
    out: dict[str, Any] = {}
    for metric in (registry or REGISTRY).collect():
        out[metric.name] = {
            "type": metric.type,
            "help": metric.documentation,
            "samples": [
                {"name": s.name, "labels": dict(s.labels), "value": float(s.value)}
                for s in metric.samples
                if not s.name.endswith("_created")
            ],
        }
    return out


def sample_value(snap: dict[str, Any], sample: str, **labels: str) -> float:
    """One value from a snapshot (0.0 when absent), e.g. sample_value(s, "x_total", status="ok")."""
    for metric in snap.values():
        for s in metric["samples"]:
            if s["name"] == sample and s["labels"] == labels:
                return float(s["value"])
    return 0.0


def _merged(snapshots: Iterable[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    merged: dict[str, dict[str, Any]] = {}
    for snap in snapshots:
        for name, metric in snap.items():
            entry = merged.setdefault(
                name, {"type": metric["type"], "help": metric["help"], "values": {}}
            )
            for s in metric["samples"]:
                key = (s["name"], tuple(sorted(s["labels"].items())))
                entry["values"][key] = entry["values"].get(key, 0.0) + s["value"]
    return merged


def merge_snapshots(snapshots: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """One snapshot (the `snapshot` shape) whose samples are the sums of the given ones:
    a worker and its writer process answer /metrics as one source."""
    out: dict[str, Any] = {}
    for name, entry in _merged(snapshots).items():
        out[name] = {"type": entry["type"], "help": entry["help"],
                     "samples": [{"name": sname, "labels": dict(labels), "value": value}
                                 for (sname, labels), value in entry["values"].items()]}
    return out


class SnapshotCollector:
    """Exposes the sum of snapshots from other processes (register on the server's registry).

    `source` returns the latest snapshot of each writer process; counters and
    histograms are summed, gauges too (in-flight bytes add up across workers).
    """

    def __init__(self, source: Callable[[], Iterable[dict[str, Any]]]) -> None:
        self._source = source

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        for name, entry in _merged(self._source()).items():
            values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = entry["values"]
            kind = entry["type"]
            if kind == "counter":
                labels = sorted({k for _, lab in values for k, _ in lab})
                fam = CounterMetricFamily(name, entry["help"], labels=labels)
                for (sname, lab), v in values.items():
                    if sname.endswith("_total"):
                        fam.add_metric([dict(lab)[k] for k in labels], v)
                yield fam
            elif kind == "gauge":
                labels = sorted({k for _, lab in values for k, _ in lab})
                fam_g = GaugeMetricFamily(name, entry["help"], labels=labels)
                for (_, lab), v in values.items():
                    fam_g.add_metric([dict(lab)[k] for k in labels], v)
                yield fam_g
            elif kind == "histogram":
                buckets = sorted(
                    ((dict(lab)["le"], v) for (sname, lab), v in values.items() if sname.endswith("_bucket")),
                    key=lambda b: float(b[0]),
                )
                total = sum(v for (sname, _), v in values.items() if sname.endswith("_sum"))
                fam_h = HistogramMetricFamily(name, entry["help"])
                fam_h.add_metric([], buckets, total)
                yield fam_h
