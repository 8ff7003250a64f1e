"""The worker's readout sink: the device path (one pass per point and reader over a step's
staging rows, results cut per request and item) writes what the host path writes, each
position once, and the server-side hub reads the records back whole, across a stream
file's rotation, delivering each to the response waiting for it."""

from __future__ import annotations

import asyncio
import json
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from capsteer.capture.spec import parse_positions
from capsteer.engine_ext.readouts import ReadoutSink, _Readout
from capsteer.steering.readers.kinds import LinearProbe
from capsteer.steering.readers.readout import ReadoutItem
from capsteer.steering.readers.registry import ReaderRegistry, ReaderShape
from capsteer.steering.readers.results import ResultsHub, ResultsStream, error_record

pytestmark = pytest.mark.unit
D, D_SAE = 16, 40


def _registry(root) -> ReaderRegistry:
    gen = torch.Generator().manual_seed(0)
    sae_dir = root / "sae"
    sae_dir.mkdir(parents=True)
    save_file({"W_enc": torch.randn(D, D_SAE, generator=gen),
               "b_enc": torch.randn(D_SAE, generator=gen) * 0.1,
               "W_dec": torch.randn(D_SAE, D, generator=gen),
               "b_dec": torch.randn(D, generator=gen) * 0.1}, str(sae_dir / "sae_weights.safetensors"))
    (sae_dir / "cfg.json").write_text(json.dumps({"architecture": "standard", "d_in": D,
                                                  "d_sae": D_SAE, "sae_lens_version": "6.5.0"}))
    return ReaderRegistry(root, hidden_size=D)


def _items(registry: ReaderRegistry) -> list[ReadoutItem]:
    probe = LinearProbe(torch.randn(3, D, generator=torch.Generator().manual_seed(1)),
                        torch.arange(3.0), "sigmoid")
    inline = ReaderShape(None, "probe", D, 3, None)
    sae = registry.lookup("sae")
    return [ReadoutItem(0, inline, probe, "resid_post", 0, parse_positions("all"), None, None),
            ReadoutItem(1, sae, None, "resid_post", 0, parse_positions("generated"), 5, 0.0),
            ReadoutItem(2, sae, None, "resid_post", 0, parse_positions([1, 2]), 2, 0.3)]


def _stream_records(root) -> list[dict]:
    """Every record of every stream file under `root`, in file order."""
    out = []
    for path in sorted(root.glob("w-*.jsonl")):
        out += [json.loads(line) for line in path.read_bytes().splitlines() if line]
    return out


def _records(root, readout_id: str) -> dict[int, dict[int, object]]:
    out: dict[int, dict[int, object]] = {}
    for rec in _stream_records(root):
        if rec.get("r") != readout_id:
            continue
        values = rec.get("s", rec.get("f"))
        for p, v in zip(rec["p"], values, strict=True):
            assert p not in out.setdefault(rec["i"], {}), "a position sent twice"
            out[rec["i"]][p] = v
    return out


def test_device_path_equals_host_path(tmp_path):
    registry = _registry(tmp_path / "readers")
    items = _items(registry)
    host = ReadoutSink(str(tmp_path / "host"), str(tmp_path / "readers"), D, "cpu")
    dev = ReadoutSink(str(tmp_path / "dev"), str(tmp_path / "readers"), D, "cpu")
    staging = torch.randn(20, D, generator=torch.Generator().manual_seed(2))
    # Two requests at one point, steps of prompt (positions 0-3, prompt_len 4) then decode,
    # the second step repeating position 3 (a recompute): sent once.
    steps = [{"ro-a": (np.arange(0, 4), slice(0, 4)), "ro-b": (np.arange(0, 4), slice(6, 10))},
             {"ro-a": (np.array([3, 4]), slice(11, 13)), "ro-b": (np.array([4]), slice(13, 14))}]
    for sink in (host, dev):
        for rid in ("ro-a", "ro-b"):
            sink.start(rid, items, prompt_len=4)
    for step in steps:
        routes = [(SimpleNamespace(capture_id=rid, point=(1, 2), keys=(("resid_post", 0),),
                                   positions=pos), span) for rid, (pos, span) in step.items()]
        for route, span in routes:
            host.write(route.capture_id, "resid_post", 0, route.positions, staging[span])
        host.end_step()
        dev.launch(routes, staging)()
    for rid in ("ro-a", "ro-b"):
        for sink in (host, dev):
            sink.finish(rid)
        want, got = _records(tmp_path / "host", rid), _records(tmp_path / "dev", rid)
        assert got.keys() == want.keys() == {0, 1, 2}
        for i in want:
            assert got[i].keys() == want[i].keys()
            for p in want[i]:
                assert np.allclose(np.asarray(got[i][p], dtype=float),
                                   np.asarray(want[i][p], dtype=float), atol=1e-6)
        assert sorted(want[1]) == [4]  # generated only
        assert sorted(want[2]) == [1, 2] and all(len(v) <= 2 for v in want[2].values())
        assert all(v > 0.3 for row in want[2].values() for _, v in row)
    assert sorted(_records(tmp_path / "host", "ro-a")[0]) == [0, 1, 2, 3, 4]


def test_a_reader_that_cannot_start_reports_why(tmp_path):
    registry = _registry(tmp_path / "readers")
    items = _items(registry)
    sink = ReadoutSink(str(tmp_path / "out"), str(tmp_path / "readers"), D, "cpu")
    (tmp_path / "readers" / "sae" / "cfg.json").write_text(json.dumps(
        {"architecture": "standard", "d_in": D, "d_sae": D_SAE, "apply_b_dec_to_input": False,
         "sae_lens_version": "6.5.0"}))  # replaced after the request was checked
    with pytest.raises(Exception, match="replaced"):
        sink.start("ro-x", items, prompt_len=4)
    sink.fail("ro-x", "capsteer: replaced", len(items))
    recs = _stream_records(tmp_path / "out")
    assert [r["i"] for r in recs] == [0, 1, 2] and all("replaced" in r["error"] for r in recs)


def test_the_hub_delivers_each_record_once_across_rotations(tmp_path):
    root = tmp_path / "ro"
    stream = ResultsStream(root, rotate_bytes=200)  # a new file every few records
    other = ResultsStream(root)  # a second worker

    async def main() -> tuple[dict, dict, list]:
        hub = ResultsHub(root, scan_s=0.0)
        a, b = hub.open("ro-a"), hub.open("ro-b")
        for i in range(30):
            stream.append(error_record("ro-a", i, "x" * 20))
            other.append(error_record("ro-b", i, "y"))
            if i % 7 == 0:
                hub.pump()
        await hub.wait(a, 0.5)
        hub.pump()
        files = sorted(p.name for p in root.glob("w-*.jsonl"))
        hub.stop()
        return a.take(), b.take(), files

    got_a, got_b, files = asyncio.run(main())
    assert [r.i for r in got_a] == list(range(30))
    assert [r.i for r in got_b] == list(range(30))
    # Files replaced by their writer are deleted once read; the live ones stay.
    assert len(files) == 2 and all(str(os.getpid()) in f for f in files)


def test_the_hub_sweeps_stream_files_of_dead_writers(tmp_path):
    root = tmp_path / "ro"
    root.mkdir()
    dead = root / "w-999999999-abc-000000.jsonl"
    dead.write_bytes(b"")
    live = ResultsStream(root)
    live.append(error_record("ro-a", 0, "x"))
    ResultsHub(root)
    assert not dead.exists() and len(list(root.glob("w-*.jsonl"))) == 1


@pytest.mark.parametrize("kind", ["all", "prompt", "generated"])
def test_new_positions_of_a_run_equal_the_mask_rule(kind):
    """Runs of consecutive positions take an arithmetic path; it keeps what the
    position rule and the sent mark keep, through recomputes from earlier positions."""
    item = ReadoutItem(0, ReaderShape(None, "probe", D, 1, None), None, "resid_post", 0,
                       parse_positions(kind), None, None)
    rng = np.random.default_rng(0)
    fast, ref = _Readout("ro", {}, prompt_len=7), 0
    start = 0
    for _ in range(200):
        n = int(rng.integers(1, 6))
        positions = np.arange(start, start + n)
        got = ReadoutSink._new_positions(fast, item, positions)
        keep = item.positions.candidate(positions, 7) & (positions >= ref)
        want = np.flatnonzero(keep)
        assert list(got) == want.tolist()
        if len(want):
            ref = int(positions[want[-1]]) + 1
        start = max(0, start + n - int(rng.integers(0, 4)))  # sometimes a recompute
