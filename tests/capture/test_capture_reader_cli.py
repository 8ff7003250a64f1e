"""Reader errors on corruption; inspect/verify tables and exit codes; metrics export."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from capture_helpers import feed, make_request, make_spec
from prometheus_client import CollectorRegistry, generate_latest

from capsteer.capture import CaptureEnd, CaptureWriter, CorruptCapture, read
from capsteer.capture import metrics as m
from capsteer.capture.cli import add_commands, main
from capsteer.capture.published import CaptureReadError


@pytest.fixture
def published(root: Path) -> tuple[Path, list[Path]]:
    w = CaptureWriter(root)
    dirs = []
    for i, layout in enumerate(["packed", "per_file"]):
        spec = make_spec(layers=[0, 1], layout=layout, tag="t")
        end, _ = feed(w, make_request(f"cli-{i}", spec, 8, hidden=32), 3)
        w.close(end)
        dirs.append(root / w.future(f"cli-{i}").result(10).dir)
    w.shutdown()
    return root, dirs


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "capsteer.capture.cli", *args], capture_output=True, text=True, timeout=60
    )


def test_verify_and_inspect_clean_tree(published):
    root, dirs = published
    res = _cli("verify", str(root))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "cli-0" in res.stdout and "cli-1" in res.stdout
    assert "2 manifest(s), 0 corrupt; sha256 verified" in res.stdout
    res = _cli("inspect", str(dirs[0]))
    assert res.returncode == 0
    assert "resid_post.1" in res.stdout and "10x32" in res.stdout  # tensor table, 8 + 3 - 1 rows


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "manifest"])
def test_corruption_is_detected(published, damage, capsys):
    root, dirs = published
    target = dirs[1]  # per_file
    victim = target / "resid_post.1.safetensors"
    if damage == "flip":
        data = bytearray(victim.read_bytes())
        data[-5] ^= 0xFF
        victim.write_bytes(bytes(data))
    elif damage == "truncate":
        victim.write_bytes(victim.read_bytes()[:-4])
    elif damage == "delete":
        victim.unlink()
    else:
        (target / "manifest.json").write_text('{"capture_id": ')
    with pytest.raises(CorruptCapture):
        read(target)
    assert main(["verify", str(root)]) == 1
    out = capsys.readouterr().out
    assert "CORRUPT" in out and "1 corrupt" in out
    if damage != "flip":  # sizes are enough for the rest: inspect fails too
        assert main(["inspect", str(root)]) == 1
    # The damaged capture on its own: reported and counted, never a traceback.
    assert main(["verify", str(target)]) == 1
    assert "1 manifest(s), 1 corrupt" in capsys.readouterr().out
    read(dirs[0])  # the other capture is untouched
    if damage == "flip":  # same size: only the checksum can tell, and read(verify=False) skips it
        assert read(target, verify=False).status == "ok"


def test_incomplete_and_temp_files_are_reported_not_corrupt(published, capsys):
    root, _dirs = published
    crashed = root / "2026-01-01" / "default" / "crashed"
    crashed.mkdir(parents=True)
    (crashed / "activations.safetensors").write_bytes(b"x")
    (crashed / ".activations.safetensors.123.0011aabb.capsteer-tmp").write_bytes(b"x")
    assert main(["verify", str(root)]) == 0
    out = capsys.readouterr().out
    assert "incomplete publish" in out and "temp file" in out


def test_reader_errors(root, published):
    _, dirs = published
    with pytest.raises(CaptureReadError):
        read(root)  # not a capture directory
    cap = read(dirs[0] / "manifest.json")
    assert ("resid_post", 1) in cap and ("resid_post", 3) not in cap
    with pytest.raises(KeyError):
        cap.tensor("resid_post", 3)
    with pytest.raises(ValueError):
        cap.tensor("post_mlp", 0)
    w = CaptureWriter(root)
    spec = make_spec(layers=[0])
    w.open(make_request("aborted", spec, 2))
    w.abort("aborted", "test")
    r = w.future("aborted").result(10)
    w.shutdown()
    with pytest.raises(CaptureReadError, match="status error"):
        read(root / r.dir)


def test_add_commands_registers_func():
    import argparse

    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(["verify", "/x"])
    assert callable(args.func) and args.dir == "/x"


def test_metric_names_match_api_and_export(root):
    names = {
        "capsteer_capture_requests_total",
        "capsteer_capture_bytes_total",
        "capsteer_capture_files_total",
        "capsteer_capture_publish_seconds",
        "capsteer_capture_inflight_bytes",
        "capsteer_capture_dropped_total",
        "capsteer_capture_rejected_total",
        "capsteer_fsync_seconds",
    }
    before = m.snapshot()
    w = CaptureWriter(root)
    spec = make_spec(layers=[0, 1], layout="per_file")
    w.open(make_request("met", spec, 4, hidden=8))
    for layer in (0, 1):
        w.write("met", "resid_post", layer, np.arange(4), torch.zeros(4, 8))
    w.close(CaptureEnd("met", (1, 2, 3, 4)))
    r = w.future("met").result(10)
    w.shutdown()
    after = m.snapshot()
    assert json.loads(json.dumps(after)) == after
    text = m.render().decode()
    for name in names:
        assert f"# TYPE {name} " in text, name
    def delta(sample: str, **labels: str) -> float:
        return m.sample_value(after, sample, **labels) - m.sample_value(before, sample, **labels)
    assert delta("capsteer_capture_requests_total", status="ok") == 1
    assert delta("capsteer_capture_files_total") == 2
    assert delta("capsteer_capture_bytes_total") == r.bytes
    assert delta("capsteer_capture_publish_seconds_count") == 1
    assert delta("capsteer_fsync_seconds_count") >= 4
    assert m.sample_value(after, "capsteer_capture_inflight_bytes") == 0
    # Another process's snapshots, re-exported (summed) from a server registry.
    reg = CollectorRegistry()
    reg.register(m.SnapshotCollector(lambda: [after, after]))
    exported = generate_latest(reg).decode()
    ok_line = next(line for line in exported.splitlines() if line.startswith('capsteer_capture_requests_total{status="ok"}'))
    assert float(ok_line.split()[-1]) == 2 * m.sample_value(after, "capsteer_capture_requests_total", status="ok")
    assert "capsteer_capture_publish_seconds_bucket" in exported


def test_read_from_a_receipt_an_sdk_response_or_an_id(root, published, monkeypatch):
    """Server users on the same filesystem go from a response to tensors in one call."""
    from openai.types import Completion

    from capsteer.capture import find_receipt
    from capsteer.capture.spec import SpecError

    _, dirs = published
    by_path = read(dirs[0])
    receipt = find_receipt(root, by_path.capture_id)
    response = Completion.model_validate({  # the SDK's own type, as a client receives it
        "id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m", "choices": [],
        "capture_results": receipt.to_dict()})
    sources = [receipt, receipt.to_dict(), {"capture_results": receipt.to_dict()}, response,
               by_path.capture_id]
    for source in sources:
        cap = read(source, root=root)
        assert cap.path.resolve() == by_path.path.resolve()
        torch.testing.assert_close(cap.tensor("resid_post", 1), by_path.tensor("resid_post", 1))
    monkeypatch.setenv("CAPSTEER_CAPTURE_DIR", str(root))  # the server's --capture-dir
    assert read(response).path.resolve() == by_path.path.resolve()
    monkeypatch.delenv("CAPSTEER_CAPTURE_DIR")
    with pytest.raises(CaptureReadError, match="root="):
        read(receipt)
    with pytest.raises(CaptureReadError, match="status dropped"):
        read({"capture_id": "cap-x", "status": "dropped", "error": "overload"}, root=root)
    with pytest.raises(CaptureReadError, match="not published"):
        read({"capture_id": "cap-nothere", "status": "pending"}, root=root)
    with pytest.raises(SpecError):
        read({"capture_id": "cap-x", "status": "ok", "dir": "../../etc"}, root=root)


def test_export_refuses_plain_mistakes_by_name(root, published, tmp_path):
    """`capsteer export` on something that is not a job, or with layers it cannot read:
    one line naming the problem (exit status 1), no traceback; ranges are read."""
    from capsteer.capture.export import _parse_keys

    assert _parse_keys("resid_post", "0-2,5") == [("resid_post", layer) for layer in (0, 1, 2, 5)]
    _, dirs = published
    for job, extra in ((dirs[0], []), (tmp_path / "missing", []),
                       (dirs[0], ["--hooks", "resid_post", "--layers", "x-1"])):
        res = subprocess.run([sys.executable, "-m", "capsteer.cli", "export", str(job), "--to",
                              "sae-lens", str(tmp_path / "out"), *extra],
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 1, res.stderr
        assert res.stderr.startswith("capsteer export:") and "Traceback" not in res.stderr, \
            res.stderr
