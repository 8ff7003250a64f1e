"""The durable writer end to end: layouts, dtypes, positions, receipts, paths, sweep."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from capture_helpers import NUM_LAYERS, feed, make_request, make_spec, temp_files
from safetensors import safe_open
from safetensors.torch import load_file

from capsteer.capture import (
    CaptureEnd,
    CaptureWriter,
    MemorySink,
    Receipt,
    SpecError,
    find_receipt,
    read,
    wait_for_receipt,
)
from capsteer.capture.manifest import publish_unreached
from capsteer.capture.publish import temp_name
from capsteer.capture.published import sha256_file

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@pytest.fixture
def writer(root: Path):
    w = CaptureWriter(root, budget_bytes=64 << 20, workers=2)
    yield w
    w.shutdown(timeout=30)


def publish(writer: CaptureWriter, cid: str, spec, prompt_len=6, generated=4, **kw):
    dtype = kw.pop("dtype", torch.float32)
    hidden = kw.pop("hidden", 16)
    req = make_request(cid, spec, prompt_len, hidden=hidden, dtype=dtype)
    end, refs = feed(writer, req, generated, **kw)
    writer.close(end)
    receipt = writer.future(cid).result(timeout=30)
    return receipt, refs, end


@pytest.mark.parametrize("layout", ["packed", "per_file"])
@pytest.mark.parametrize("model_dtype", ["float32", "bfloat16", "float16"])
def test_round_trip_exact_and_plain_safetensors(writer, root, layout, model_dtype):
    spec = make_spec(hooks={"resid_post": "all", "resid_mid": [0, -1]}, layout=layout)
    dtype = DTYPES[model_dtype]
    receipt, refs, end = publish(writer, f"rt-{layout}-{model_dtype}", spec, dtype=dtype, prefill_chunk=4)
    assert receipt.status == "ok", receipt.error
    cap_dir = root / receipt.dir
    manifest = json.loads((cap_dir / "manifest.json").read_text())
    assert manifest["dtype"] == model_dtype
    fed = len(end.token_ids)
    assert manifest["positions"] == list(range(fed))
    assert manifest["token_ids"] == list(end.token_ids)
    # Plain safetensors, no capsteer code: every tensor, positions and token ids.
    seen = {}
    for entry in manifest["files"]:
        path = cap_dir / entry["name"]
        assert os.path.getsize(path) == entry["bytes"]
        assert sha256_file(path) == entry["sha256"]
        loaded = load_file(path)
        assert loaded["positions"].dtype == torch.int64
        assert loaded["positions"].tolist() == list(range(fed))
        assert loaded["token_ids"].tolist() == list(end.token_ids)
        seen.update({k: v for k, v in loaded.items() if k not in ("positions", "token_ids")})
    expected_names = {f"{h}.{layer}" for h, layer in spec.keys()}
    assert set(seen) == expected_names
    if layout == "per_file":
        assert sorted(receipt.files) == sorted(f"{n}.safetensors" for n in expected_names)
    else:
        assert receipt.files == ("activations.safetensors",)
    cap = read(cap_dir)
    for key, ref in refs.items():
        name = f"{key[0]}.{key[1]}"
        assert seen[name].dtype == dtype
        assert torch.equal(seen[name], ref), name
        assert torch.equal(cap.tensor(*key), ref)
    # numpy view (bf16 widened to float32, exact)
    arr = cap.numpy("resid_mid", -1)
    assert np.array_equal(arr, refs[("resid_mid", NUM_LAYERS - 1)].float().numpy())
    assert torch.equal(cap["post_attn", 0], refs[("resid_mid", 0)])
    assert receipt.bytes == sum(f["bytes"] for f in manifest["files"])
    assert receipt.positions == fed


def test_numpy_framework_opens_fp16_file(writer, root):
    spec = make_spec(layers=[1])
    receipt, refs, _ = publish(writer, "np-1", spec, dtype=torch.float16)
    with safe_open(root / receipt.dir / "activations.safetensors", framework="np") as fh:
        arr = fh.get_tensor("resid_post.1")
    assert arr.dtype == np.float16
    assert np.array_equal(arr, refs[("resid_post", 1)].numpy())


@pytest.mark.parametrize(("model_dtype", "out"), [("bfloat16", "float32"), ("float32", "bfloat16"), ("float32", "float16")])
def test_dtype_conversion_on_request(writer, root, model_dtype, out):
    spec = make_spec(dtype=out, layers=[0, 2])
    receipt, refs, _ = publish(writer, f"conv-{model_dtype}-{out}", spec, dtype=DTYPES[model_dtype])
    cap = read(root / receipt.dir)
    assert cap.dtype == out
    for key, ref in refs.items():
        got = cap.tensor(*key)
        assert got.dtype == DTYPES[out]
        assert torch.equal(got, ref.to(DTYPES[out]))


@pytest.mark.parametrize(
    ("positions", "expected"),
    [
        ("prompt", list(range(6))),
        ("generated", [6, 7, 8]),
        ("last_prompt", [5]),
        ("last", [8]),
        ([0, -1, 7, 40], [0, 5, 7]),
    ],
)
def test_position_kinds_end_to_end(writer, root, positions, expected):
    spec = make_spec(positions=positions, layers=[0, 3])
    receipt, refs, end = publish(writer, f"pos-{abs(hash(str(positions)))}", spec, prompt_len=6, generated=4)
    cap = read(root / receipt.dir)
    assert cap.positions.tolist() == expected
    assert cap.token_ids.tolist() == [end.token_ids[p] for p in expected]
    for key, ref in refs.items():
        assert torch.equal(cap.tensor(*key), ref[expected])


def test_preemption_recompute_keeps_each_position_once_last_write_wins(writer, root):
    spec = make_spec(layers=[1, 2])
    receipt, refs, _ = publish(
        writer, "preempt", spec, prompt_len=10, generated=8, prefill_chunk=3, recompute_from=4
    )
    cap = read(root / receipt.dir)
    assert cap.positions.tolist() == list(range(17))
    for key, ref in refs.items():
        assert torch.equal(cap.tensor(*key), ref)


def test_last_keeps_one_row_in_memory(root):
    w = CaptureWriter(root, budget_bytes=1 << 20)
    try:
        spec = make_spec(positions="last", layers=[0])
        req = make_request("last-mem", spec, 4, hidden=64)
        w.open(req)
        for t in range(3, 200):
            w.write("last-mem", "resid_post", 0, np.array([t]), torch.full((1, 64), float(t)))
            assert w.budget.open_bytes == 64 * 4
        w.close(CaptureEnd("last-mem", tuple(range(200))))
        r = w.future("last-mem").result(10)
        cap = read(root / r.dir)
        assert cap.positions.tolist() == [199]
        assert cap.tensor("resid_post", 0)[0, 0].item() == 199.0
    finally:
        w.shutdown()


def test_matches_memory_sink(writer, root):
    spec = make_spec(hooks={"attn_out": [0, 1], "mlp_out": [3]}, positions="all")
    req = make_request("vs-mem", spec, 5, hidden=8)
    mem = MemorySink()
    end, _refs = feed(mem, req, 3, prefill_chunk=2, recompute_from=2)
    mem.close(end)
    got = mem.take(["vs-mem"])["vs-mem"]
    end2, _ = feed(writer, req, 3, prefill_chunk=2, recompute_from=2)
    writer.close(end2)
    r = writer.future("vs-mem").result(10)
    cap = read(root / r.dir)
    assert cap.positions.tolist() == got.positions.tolist()
    for key, t in got.tensors.items():
        assert torch.equal(cap.tensor(*key), t)


def test_empty_selection_publishes_zero_rows(writer, root):
    spec = make_spec(positions="generated", layers=[0])
    receipt, _, _ = publish(writer, "empty-gen", spec, prompt_len=5, generated=1)
    assert receipt.status == "ok"
    loaded = load_file(root / receipt.dir / "activations.safetensors")
    assert loaded["resid_post.0"].shape == (0, 16)
    assert read(root / receipt.dir).positions.tolist() == []


def test_receipts_callback_future_asyncio_and_disk(root):
    w = CaptureWriter(root)
    spec = make_spec(layers=[0], tag="run-7")
    got: list[Receipt] = []
    done = threading.Event()
    w.add_done_callback("rc-1", lambda r: (got.append(r), done.set()))  # before open
    req = make_request("rc-1", spec, 3)
    end, _ = feed(w, req, 2)
    assert w.receipt("rc-1").status == "pending"

    async def await_it() -> Receipt:
        task = asyncio.ensure_future(w.wait("rc-1", timeout=10))
        await asyncio.sleep(0.01)
        w.close(end)
        return await task

    r = asyncio.run(await_it())
    assert done.wait(10) and got[0] == r
    assert r.status == "ok" and r.dir.split("/")[1:] == ["run-7", "rc-1"]
    assert w.receipt("rc-1") == r
    late: list[Receipt] = []
    w.add_done_callback("rc-1", late.append)  # already final: called at once
    assert late == [r]
    w.shutdown()
    # A fresh process (here: a fresh writer, or no writer at all) reads it from disk.
    w2 = CaptureWriter(root)
    from_disk = w2.receipt("rc-1")
    w2.shutdown()
    assert from_disk is not None
    assert (from_disk.status, from_disk.dir, from_disk.files, from_disk.bytes) == (r.status, r.dir, r.files, r.bytes)
    assert find_receipt(root, "rc-1") == from_disk
    assert asyncio.run(wait_for_receipt(root, "rc-1", timeout=1)) == from_disk
    timed_out = asyncio.run(wait_for_receipt(root, "never", timeout=0.1))
    assert timed_out.status == "pending" and "0.1" in timed_out.error
    assert find_receipt(root, "never") is None


def test_wait_timeout_gives_pending_not_exception(writer):
    r = asyncio.run(writer.wait("nobody", timeout=0.05))
    assert r.status == "pending" and r.error


def test_abort_gives_error_receipt_and_no_data(writer, root):
    spec = make_spec(layers=[0])
    req = make_request("ab-1", spec, 4)
    feed(writer, req, 3)
    writer.abort("ab-1", "client disconnected")
    r = writer.future("ab-1").result(10)
    assert r.status == "error" and "client disconnected" in r.error
    assert writer.budget.inflight == 0
    files = sorted(p.name for p in (root / r.dir).iterdir())
    assert files == ["manifest.json"]
    assert find_receipt(root, "ab-1").status == "error"


def test_unreached_capture_gets_an_error_manifest_unless_one_exists(writer, root):
    """An abort before any engine opened the capture: the server publishes its outcome;
    a writer that published first (or later) keeps its own."""
    spec = make_spec(layers=[0, 1])
    receipt = publish_unreached(root, "never-1", spec=spec, model="m", reason="aborted: early")
    assert receipt.status == "error" and receipt.error == "aborted: early"
    assert receipt.files == () and receipt.positions == 0
    assert find_receipt(root, "never-1") == receipt
    assert sorted(p.name for p in (root / receipt.dir).iterdir()) == ["manifest.json"]
    manifest = json.loads((root / receipt.dir / "manifest.json").read_text())
    assert manifest["spec"] == spec.to_dict() and manifest["capture_id"] == "never-1"

    first, _, _ = publish(writer, "raced-1", spec)
    again = publish_unreached(root, "raced-1", spec=spec, model="m", reason="aborted: late")
    assert first.status == "ok" and again == find_receipt(root, "raced-1")
    assert again.status == "ok"

    late = make_request("never-1", spec, 4)  # the request arrives after all: no clobbering
    feed(writer, late, 2)
    writer.abort("never-1", "request aborted")
    assert writer.future("never-1").result(10).status == "error"
    assert find_receipt(root, "never-1").error == "aborted: early"


@pytest.mark.parametrize("cid", ["../x", "a/b", ".hidden", "", "x" * 200, "a b", "..", "*"])
def test_capture_id_cannot_escape_root(writer, cid):
    spec = make_spec(layers=[0])
    with pytest.raises(SpecError) as info:
        writer.open(make_request(cid, spec, 2))
    assert info.value.field == "capture_id"
    with pytest.raises(ValueError):
        find_receipt(writer.root, cid)


def test_duplicate_capture_id_does_not_clobber(writer, root):
    spec = make_spec(layers=[0])
    first, refs, _ = publish(writer, "dup", spec)
    second, _, _ = publish(writer, "dup", spec, prompt_len=3)
    assert first.status == "ok"
    assert second.status == "error" and "already" in second.error
    cap = read(root / first.dir)
    assert torch.equal(cap.tensor("resid_post", 0), refs[("resid_post", 0)])


def test_inconsistent_positions_across_keys_is_an_error(writer, root):
    spec = make_spec(layers=[0, 1])
    req = make_request("incons", spec, 4)
    writer.open(req)
    writer.write("incons", "resid_post", 0, np.arange(4), torch.zeros(4, 16))
    writer.write("incons", "resid_post", 1, np.arange(3), torch.zeros(3, 16))
    writer.close(CaptureEnd("incons", (1, 2, 3, 4)))
    r = writer.future("incons").result(10)
    assert r.status == "error" and "positions" in r.error
    assert not list((root / r.dir).glob("*.safetensors"))


def test_startup_sweeps_dead_writers_temp_files_only(root):
    d = root / "2026-01-01" / "default" / "c1"
    d.mkdir(parents=True)
    dead = d / ".activations.safetensors.999999999.0123abcd.capsteer-tmp"
    dead.write_bytes(b"partial")
    mine_name = temp_name("activations.safetensors")  # this (live) process's pid
    (d / mine_name).write_bytes(b"live writer")
    keep = d / "notes.txt"
    keep.write_text("user file")
    w = CaptureWriter(root)
    w.shutdown()
    assert not dead.exists()
    assert (d / mine_name).exists() and keep.exists()
    assert w.swept == [dead]
    (d / mine_name).unlink()
    assert temp_files(root) == []


def test_no_temp_files_left_after_normal_operation(writer, root):
    spec = make_spec(layout="per_file")
    for i in range(5):
        publish(writer, f"clean-{i}", spec)
    assert temp_files(root) == []


def test_rejects_rows_not_matching_positions(writer):
    spec = make_spec(layers=[0])
    writer.open(make_request("shape", spec, 2))
    with pytest.raises(ValueError):
        writer.write("shape", "resid_post", 0, np.arange(3), torch.zeros(2, 16))


def test_resolve_inside_refuses_escapes(root):
    from capsteer.capture.paths import relative_dir, resolve_inside

    rel = relative_dir("cap-1", "tag", 0.0)
    assert rel == "1970-01-01/tag/cap-1"
    assert resolve_inside(root, rel) == root.resolve() / rel
    for bad in ("../x", "a/../../x", "/etc"):
        with pytest.raises(SpecError):
            resolve_inside(root, bad)
    with pytest.raises(SpecError):
        relative_dir("cap-1", "../t", 0.0)


def test_inference_mode_rows_from_engine(writer, root):
    """vLLM runs the model under inference_mode: rows arrive as inference tensors."""
    spec = make_spec(layers=[0], positions="last")
    writer.open(make_request("inf", spec, 4, dtype=torch.bfloat16))
    with torch.inference_mode():
        big = torch.randn(6, 16).to(torch.bfloat16)
        writer.write("inf", "resid_post", 0, np.arange(4), big[:4])  # a view of a larger buffer
        writer.write("inf", "resid_post", 0, np.array([4]), big[4:5])
    writer.close(CaptureEnd("inf", tuple(range(5))))
    r = writer.future("inf").result(10)
    assert r.status == "ok", r.error
    assert torch.equal(read(root / r.dir).tensor("resid_post", 0), big[4:5])


def test_dated_receipts_are_read_where_the_payload_put_them(writer, root):
    """A request's payload dates its directory; the in-process engine and the server's
    tracker read that one manifest instead of searching the root, and an outcome dated
    elsewhere is still found by the tracker's slow search once it has waited long."""
    from dataclasses import replace

    from capsteer.capture.paths import relative_dir
    from capsteer.capture.receipts import receipt_at
    from capsteer.server.tracker import SEARCH_AFTER_S, CaptureTracker

    spec = make_spec(layers=[0], tag="dated")
    day = 1_600_000_000.0  # 2020-09-13, not today: only the payload's date finds it
    req = replace(make_request("dated-1", spec, 5), dir_time=day)
    end, _ = feed(writer, req, 2)
    writer.close(end)
    published = writer.future("dated-1").result(timeout=30)
    rel = relative_dir("dated-1", "dated", day)
    assert published.dir == rel and rel.startswith("2020-09-13/dated/")
    on_disk = receipt_at(root, rel)
    assert on_disk == find_receipt(root, "dated-1")
    assert (on_disk.status, on_disk.dir, on_disk.files) == ("ok", rel, published.files)
    assert receipt_at(root, relative_dir("dated-1", "dated", day + 86400)) is None

    unreached = publish_unreached(root, "never-dated", spec=spec, model="m",
                                  reason="aborted: early", dir_time=day)
    assert unreached.dir == relative_dir("never-dated", "dated", day)

    async def scans() -> None:  # the tracker lives on an event loop (its poller task)
        tracker = CaptureTracker(root, 1 << 20)
        now = time.monotonic()
        tracker.track("dated-1", spec, dir_time=day)
        tracker.track("elsewhere", spec, dir_time=day)  # not published under that date
        other = publish_unreached(root, "elsewhere", spec=spec, model="m", reason="x",
                                  dir_time=day + 86400)
        where = {c: (CaptureTracker._rel_dir(c, e), e.since)
                 for c, e in tracker._tracked.items()}
        assert tracker._scan(where) == {"dated-1": on_disk}  # fresh: no search of the root
        where["elsewhere"] = (where["elsewhere"][0], now - SEARCH_AFTER_S - 1)
        tracker._searched_at = 0.0
        assert tracker._scan(where) == {"dated-1": on_disk, "elsewhere": other}

    asyncio.run(scans())


def test_a_hook_wider_than_the_stream_is_published_at_its_own_width(writer, root):
    """mlp_post's rows are d_mlp wide (the request's hook_widths), the stream's hidden
    wide: each tensor and the manifest say so, and the rows round-trip exactly."""
    import dataclasses

    spec = make_spec(hooks={"mlp_post": [1], "resid_post": [1]}, layout="packed")
    req = dataclasses.replace(make_request("wide", spec, 5),
                              hook_widths=(("mlp_post", 40), ("attn_z", 16)))
    end, refs = feed(writer, req, 3)
    writer.close(end)
    receipt = writer.future("wide").result(timeout=30)
    assert receipt.status == "ok", receipt.error
    cap_dir = root / receipt.dir
    manifest = json.loads((cap_dir / "manifest.json").read_text())
    assert manifest["hook_widths"] == {"mlp_post": 40, "attn_z": 16}
    loaded = {}
    for entry in manifest["files"]:
        loaded.update(load_file(cap_dir / entry["name"]))
    assert loaded["mlp_post.1"].shape == (len(end.token_ids), 40)
    assert loaded["resid_post.1"].shape == (len(end.token_ids), 16)
    torch.testing.assert_close(loaded["mlp_post.1"], refs[("mlp_post", 1)], rtol=0, atol=0)
