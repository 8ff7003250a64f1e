"""/metrics: capsteer's metrics sit beside vLLM's and move with what was really written."""

from __future__ import annotations

from pathlib import Path

import pytest

from .helpers import PROMPT, capture_dir, metric_value, scrape

pytestmark = [pytest.mark.server, pytest.mark.uses_engine("server")]
CAPTURE_METRICS = ("capsteer_capture_requests_total", "capsteer_capture_bytes_total",
                   "capsteer_capture_files_total", "capsteer_capture_publish_seconds",
                   "capsteer_capture_inflight_bytes", "capsteer_capture_dropped_total",
                   "capsteer_capture_rejected_total", "capsteer_fsync_seconds",
                   "capsteer_steering_requests_total", "capsteer_steering_vectors",
                   "capsteer_readout_rows_total", "capsteer_readers",
                   "capsteer_steering_refused_total", "capsteer_graph_replays_total",
                   "capsteer_capture_engine_wait_seconds_total")


def test_metrics_follow_the_bytes_and_files_on_disk(server, client, http):
    before = scrape(server.url)
    for name in CAPTURE_METRICS:
        assert f"# TYPE {name}" in before, name
    assert "vllm:prompt_tokens_total" in before  # vLLM's own metrics are still there
    specs = [
        {"hooks": ["resid_post"], "layers": "all", "positions": "all"},
        {"hooks": {"mlp_out": [0, 2]}, "positions": "prompt", "layout": "per_file"},
        {"hooks": ["resid_pre", "attn_out"], "layers": [1], "positions": "last"},
    ]
    receipts = []
    for spec in specs:
        resp = client.completions.create(model="demo", prompt=PROMPT, max_tokens=4, temperature=0,
                                         extra_body={"capture": spec, "capture_wait": True})
        receipts.append(resp.model_extra["capture_results"])
    steering = {"vectors": [{"hook": "resid_post", "layer": 0, "vector": [0.5] * 128}]}
    for _ in range(2):
        client.completions.create(model="demo", prompt=PROMPT, max_tokens=2,
                                  extra_body={"steering": steering})
    after = scrape(server.url)

    def delta(name: str, **labels: str) -> float:
        return metric_value(after, name, **labels) - metric_value(before, name, **labels)

    on_disk_bytes = sum(
        (capture_dir(server, r) / f).stat().st_size for r in receipts for f in r["files"])
    assert on_disk_bytes == sum(r["bytes"] for r in receipts)
    assert delta("capsteer_capture_bytes_total") == on_disk_bytes
    assert delta("capsteer_capture_files_total") == sum(len(r["files"]) for r in receipts) == 4
    assert delta("capsteer_capture_requests_total", status="ok") == 3
    assert delta("capsteer_capture_publish_seconds_count") == 3
    assert delta("capsteer_fsync_seconds_count") >= 3
    assert delta("capsteer_steering_requests_total") == 2
    assert metric_value(after, "capsteer_capture_inflight_bytes") == 0
    # The worker's waits for its writer processes' rings are counted, labelled by what
    # was waited for (none of these small captures fills a 1 GiB ring).
    assert 'capsteer_capture_engine_wait_seconds_total{wait="writer_ring"}' in after
    assert delta("capsteer_capture_engine_wait_seconds_total", wait="writer_ring") >= 0
    vectors = len(http.get("/v1/steering/vectors").json()["data"])
    assert metric_value(after, "capsteer_steering_vectors") == vectors


def test_every_dashboard_metric_exists_on_a_live_server(server, client):
    """The Grafana dashboard in deploy/ only plots what this server exports."""
    from tests.deploy_metrics import dashboard_metric_names

    client.completions.create(model="demo", prompt=PROMPT, max_tokens=2)  # vLLM's histograms fill
    text = scrape(server.url)
    dashboard = Path(__file__).resolve().parents[2] / "deploy/grafana/dashboards/capsteer.json"
    names = dashboard_metric_names(dashboard)
    assert len(names) >= 10
    missing = [n for n in sorted(names) if f"# TYPE {n} " not in text
               and f"# TYPE {n.removesuffix('_total')} " not in text]
    assert not missing, missing
