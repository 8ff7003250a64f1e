"""The worker's readout sink: the device path (one pass per point and reader over a step's
staging rows, results cut per request and item) writes what the host path writes, each
position once, and the server-side hub reads the records back whole, across a stream
file's rotation, delivering each to the response waiting for it."""

from __future__ import annotations

import asyncio
import json
import math
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from capsteer.capture.spec import parse_positions
from capsteer.engine_ext.readouts import ReadoutSink, _encode, _Readout, _run
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


def test_a_malformed_line_costs_only_itself_and_never_stops_the_hub(tmp_path, monkeypatch):
    """A line that is not a record (a torn or foreign write) is skipped alone: the records
    around it, in the same read, still arrive; and a read that fails outright leaves the
    hub's task running, so a waiting response still gets its records or its timeout."""
    root = tmp_path / "ro"
    stream = ResultsStream(root)

    async def main() -> tuple[list, list]:
        hub = ResultsHub(root, scan_s=0.0)
        inbox = hub.open("ro-a")
        stream.append(error_record("ro-a", 0, "x") + b'{"r": "ro-a", "i": \n'
                      + error_record("ro-a", 1, "y"))
        await asyncio.wait_for(hub.wait(inbox, 0.5), 5)  # a dead hub task: never woken
        first = [r.i for r in inbox.take()]
        real_pump = hub.pump
        monkeypatch.setattr(hub, "pump", lambda waiting=True: 1 / 0)
        await asyncio.sleep(0.05)  # the task polls, and its pumps fail
        monkeypatch.setattr(hub, "pump", real_pump)
        stream.append(error_record("ro-a", 2, "z"))
        await asyncio.wait_for(hub.wait(inbox, 0.5), 5)
        then = [r.i for r in inbox.take()]
        hub.stop()
        return first, then

    first, then = asyncio.run(main())
    assert first == [0, 1] and then == [2]


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


def _reference_device_path(sink: ReadoutSink, routes, staging) -> None:
    """The device path as it was before its per-step Python was cut (one pass per point
    and reader, each request's rows sliced and encoded on their own): the fast path must
    write these bytes."""
    by_point: dict = {}
    for route, span in routes:
        by_point.setdefault(route.point, []).append((route, span))
    for group in by_point.values():
        uses: dict = {}
        for route, span in group:
            state = sink.live.get(route.capture_id)
            for key in (route.keys if state is not None else ()):
                for item, reader in state.items.get(key, ()):
                    use = uses.setdefault(id(reader), [reader, 1, math.inf, []])
                    if item.top_k is not None:
                        use[1] = max(use[1], item.top_k)
                        use[2] = min(use[2], float(item.threshold or 0.0))
                    use[3].append((state, item, route, span))
        first = min(span.start for _, span in group)
        block = staging[first: max(span.stop for _, span in group)].to(torch.float32)
        for reader, top_k, threshold, items in uses.values():
            host = [t.numpy() for t in _run(reader, block, top_k, threshold)]
            for state, item, route, span in items:
                at = sink._new_positions(state, item, route.positions)
                if not len(at):
                    continue
                base = span.start - first
                if isinstance(at, range):
                    p0 = int(route.positions[0])
                    positions = list(range(p0 + at.start, p0 + at.stop))
                    got = [h[base + at.start: base + at.stop] for h in host]
                else:
                    positions = route.positions[at].tolist()
                    got = [h[base + at] for h in host]
                sink._pending.append(_encode(state.readout_id, item, positions, got))
    sink.end_step()


def test_device_records_are_the_reference_bytes_and_the_host_values(tmp_path):
    """A mixed run (prefill chunks, decode rows, two rows at once, a recompute from an
    earlier position, positions a list keeps apart; probes and SAE items with different
    top_k and threshold, two keys sharing one point): the device path writes the bytes of
    the reference encoding, record for record, and the values the host path writes."""
    registry = _registry(tmp_path / "readers")
    sae = registry.lookup("sae")
    probe = LinearProbe(torch.randn(3, D, generator=torch.Generator().manual_seed(1)),
                        torch.arange(3.0), "sigmoid")
    inline = ReaderShape(None, "probe", D, 3, None)
    spec = [(0, "probe", "resid_post", 0, "all", None, None),
            (1, "sae", "resid_post", 0, "generated", 5, 0.0),
            (2, "sae", "resid_post", 0, [0, 2, 7], 2, 0.3),
            (3, "sae", "resid_pre", 1, "prompt", 3, 0.25),
            (4, "probe", "resid_pre", 1, "generated", None, None)]
    items = [ReadoutItem(i, inline if kind == "probe" else sae,
                         probe if kind == "probe" else None, hook, layer,
                         parse_positions(pos), k, thr)
             for i, kind, hook, layer, pos, k, thr in spec]
    sinks = {name: ReadoutSink(str(tmp_path / name), str(tmp_path / "readers"), D, "cpu")
             for name in ("host", "dev", "ref")}
    asked = {"ro-a": items, "ro-b": items[1:4], "ro-c": items, "ro-d": [items[2]]}
    for sink in sinks.values():
        for rid, its in asked.items():
            sink.start(rid, its, prompt_len=4)
    keys = (("resid_post", 0), ("resid_pre", 1))  # one point: one route reads both
    steps = [{"ro-a": [0, 1, 2, 3], "ro-b": [0, 1], "ro-c": [0, 1, 2, 3], "ro-d": [0, 2]},
             {"ro-a": [4], "ro-b": [2, 3], "ro-c": [4], "ro-d": [7]},
             {"ro-a": [5], "ro-b": [4], "ro-c": [2, 3, 4, 5]},  # c recomputes from 2
             {"ro-a": [6, 7], "ro-b": [5], "ro-c": [6]},
             {"ro-a": [8], "ro-b": [3, 4, 5, 6], "ro-c": [7], "ro-d": [2, 7]}]
    gen = torch.Generator().manual_seed(3)
    for step in steps:
        routes, at = [], 1
        for rid, pos in step.items():
            route = SimpleNamespace(capture_id=rid, point=(1, 2), keys=keys,
                                    positions=np.array(pos))
            routes.append((route, slice(at, at + len(pos))))
            at += len(pos) + 1  # a gap: another request's rows
        staging = torch.randn(at + 2, D, generator=gen)
        for route, span in routes:
            for hook, layer in route.keys:
                sinks["host"].write(route.capture_id, hook, layer, route.positions,
                                    staging[span])
        sinks["host"].end_step()
        sinks["dev"].launch(routes, staging)()
        _reference_device_path(sinks["ref"], routes, staging)
    got, want = _stream_bytes(tmp_path / "dev"), _stream_bytes(tmp_path / "ref")
    assert got == want and got.count(b"\n") > 30
    for rid in asked:
        on_host, on_dev = _records(tmp_path / "host", rid), _records(tmp_path / "dev", rid)
        assert on_dev.keys() == on_host.keys()
        for i in on_host:
            assert on_dev[i].keys() == on_host[i].keys()
            for p, want_row in on_host[i].items():
                row = on_dev[i][p]
                assert len(row) == len(want_row)
                if items[i].top_k is not None:  # the same features, values to rounding
                    assert [f for f, _ in row] == [f for f, _ in want_row]
                    row, want_row = [v for _, v in row], [v for _, v in want_row]
                assert np.allclose(row, want_row, atol=1e-6)
    assert sorted(_records(tmp_path / "dev", "ro-c")[0]) == list(range(8))  # each once
    assert sorted(_records(tmp_path / "dev", "ro-d")[2]) == [0, 2, 7]


def test_sae_rows_keep_what_the_encoder_keeps_at_the_edges(tmp_path):
    """An SAE pass's results cut to an item's top_k and threshold: a value equal to the
    threshold in float32 but above it in float64, a NaN, ids of -1 between kept ones,
    rows of one position and runs: the device path's bytes are `_encode`'s."""
    sink = ReadoutSink(str(tmp_path / "out"), None, D, "cpu")
    shape = ReaderShape("sae", "sae", D, 8, "0" * 64)
    ids = np.array([[5, 3, -1, 2], [1, -1, 4, 6], [7, 0, 2, -1], [3, 1, 0, 2]], np.int64)
    values = np.array([[0.9, np.float32(0.3), 0.0, 0.2], [np.nan, 0.0, 0.5, 0.31],
                       [2.0, 1.0, 0.4, 0.0], [0.3, 0.3, 0.29, 0.1]], np.float32)
    want = []
    jobs = []
    for n, (k, thr) in enumerate([(4, 0.3), (2, 0.0), (3, 0.25), (4, -1.0)]):
        item = ReadoutItem(0, shape, None, "resid_post", 0, parse_positions("all"), k, thr)
        state = _Readout(f"ro-{n}", {("resid_post", 0): [(item, object())]}, prompt_len=2)
        head = state.reads_of((("resid_post", 0),))[0][2]
        assert head is not None
        for rows in ([0], [1], [2], [3], [0, 1, 2, 3]):
            route = SimpleNamespace(positions=np.array(rows) + 10 * len(want))
            want.append(_encode(state.readout_id, item, route.positions.tolist(),
                                [ids[rows], values[rows]]))
            jobs.append((state, item, head, route, slice(rows[0], rows[-1] + 1)))
    sink._write_job(0, [ids, values], jobs)
    assert b"".join(sink._pending) == b"".join(want)


def _stream_bytes(root) -> bytes:
    return b"".join(path.read_bytes() for path in sorted(root.glob("w-*.jsonl")))
