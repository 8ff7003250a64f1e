"""The in-process engine's readout collector: it waits for records that land after
generation returned, gives each item one entry per position it reads below the fed limit
(the server's format, decoded), passes a worker's failure on as the item's error, and
raises on a timeout rather than return part of a result."""

from __future__ import annotations

import json
import threading
import time

import msgspec
import pytest
import torch

from capsteer.capture.spec import parse_positions
from capsteer.steering.readers.collect import Finished, ReadoutCollector, ReadoutValues
from capsteer.steering.readers.kinds import LinearProbe
from capsteer.steering.readers.readout import ReadoutItem
from capsteer.steering.readers.registry import ReaderShape
from capsteer.steering.readers.results import (
    Record,
    ResultsStream,
    error_record,
    probe_record,
    sae_record,
)

pytestmark = pytest.mark.unit
D = 8
PROMPT, OUTPUT = [11, 12, 13, 14], [21, 22, 23]  # fed: 4 prompt + 2 output positions


def _items() -> list[ReadoutItem]:
    probe = LinearProbe(torch.ones(2, D), torch.zeros(2), "sigmoid")
    sae = ReaderShape("sae", "sae", D, 32, "0" * 64)
    return [ReadoutItem(0, ReaderShape(None, "probe", D, 2, None), probe, "resid_post", 1,
                        parse_positions("all"), None, None),
            ReadoutItem(1, sae, None, "mlp_out", 0, parse_positions("generated"), 4, 0.0),
            ReadoutItem(2, sae, None, "resid_pre", 2, parse_positions([0, -1, 5]), 4, 0.0)]


def _records(readout_id: str, first: int, stop: int) -> bytes:
    """The records of positions [first, stop), as a worker writes them step by step."""
    out = []
    for p in range(first, stop):
        out.append(probe_record(readout_id, 0, [p], [[p + 0.5, -p]]))
        if p >= len(PROMPT):
            out.append(sae_record(readout_id, 1, [p], [[(p, 1.5)]]))
        if p in (0, 3, 5):
            out.append(sae_record(readout_id, 2, [p], [[(7, 0.25), (p, 0.125)]]))
    return b"".join(out)


def test_waits_for_records_written_after_generation(tmp_path):
    root = tmp_path / "ro"
    stream = ResultsStream(root)
    collector = ReadoutCollector(root)
    collector.open("ro-a", _items())
    collector.open("ro-b", _items())
    stream.append(_records("ro-a", 0, 4) + _records("ro-b", 0, 6))
    late = threading.Timer(0.2, stream.append, args=(_records("ro-a", 4, 6),))
    late.start()
    started = time.monotonic()
    a, b = collector.collect([Finished("ro-a", _items(), PROMPT, OUTPUT),
                              Finished("ro-b", _items(), PROMPT, OUTPUT)], timeout=10)
    assert time.monotonic() - started >= 0.15  # it waited for the late steps
    late.join()
    assert a == b
    assert [e["positions"] for e in a] == [[0, 1, 2, 3, 4, 5], [4, 5], [0, 3, 5]]
    tokens = PROMPT + OUTPUT
    for entry in a:
        assert entry["token_ids"] == [tokens[p] for p in entry["positions"]]
    assert a[0] == {"item": 0, "reader": None, "hook": "resid_post", "layer": 1,
                    "positions": [0, 1, 2, 3, 4, 5],
                    "token_ids": [11, 12, 13, 14, 21, 22],
                    "scores": [[p + 0.5, -p] for p in range(6)]}
    assert a[1]["features"] == [[[4, 1.5]], [[5, 1.5]]] and a[1]["reader"] == "sae"
    assert a[2]["features"][2] == [[7, 0.25], [5, 0.125]]
    # The records are dropped once collected.
    assert not collector.reader.inboxes
    collector.close()


def test_entries_are_the_servers_json(tmp_path):
    """The engine's entries decode the server's (raw JSON) entries: one format."""
    items = _items()
    values = ReadoutValues(items)
    values.add([msgspec.json.decode(line, type=Record)
                for line in _records("ro-a", 0, 6).splitlines()])
    for item in items:
        server = json.loads(msgspec.json.encode(values.entry(item, PROMPT, OUTPUT, 0, 6)))
        engine = values.entry(item, PROMPT, OUTPUT, 0, 6, msgspec.json.decode)
        assert engine == server


def test_a_workers_failure_is_the_items_error(tmp_path):
    root = tmp_path / "ro"
    stream = ResultsStream(root)
    collector = ReadoutCollector(root)
    collector.open("ro-a", _items())
    stream.append(probe_record("ro-a", 0, list(range(6)), [[0.0, 0.0]] * 6))
    stream.append(b"".join(error_record("ro-a", i, "capsteer: no such reader") for i in (1, 2)))
    entries = collector.collect([Finished("ro-a", _items(), PROMPT, OUTPUT)], timeout=5)[0]
    assert entries[0]["positions"] == list(range(6))
    assert entries[1] == {"item": 1, "reader": "sae", "hook": "mlp_out", "layer": 0,
                          "error": "capsteer: no such reader"}
    assert entries[2]["error"] == "capsteer: no such reader"


def test_missing_positions_raise_after_the_timeout(tmp_path):
    root = tmp_path / "ro"
    stream = ResultsStream(root)
    collector = ReadoutCollector(root)
    collector.open("ro-a", _items())
    stream.append(_records("ro-a", 0, 5))  # the last fed position never comes
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="ro-a item 0 from position 5"):
        collector.collect([Finished("ro-a", _items(), PROMPT, OUTPUT)], timeout=0.3)
    assert 0.3 <= time.monotonic() - started < 3
    assert not collector.reader.inboxes  # nothing left behind for a later batch
