"""Pipeline parallelism: one writer per stage on one root, one merged manifest.

Each stage's `CaptureWriter` holds only its own (hook, layer) keys, publishes its
files and a part manifest, and the last stage to finish merges the parts. Closing
in either order, or at once from two threads, must give exactly one manifest that
lists every file; a failed or inconsistent stage must give one error manifest.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from capture_helpers import (
    NUM_LAYERS,
    all_files,
    make_request,
    make_spec,
    reference_rows,
    temp_files,
)

from capsteer.capture import (
    CaptureEnd,
    CaptureRequest,
    CaptureWriter,
    CorruptCapture,
    Receipt,
    find_receipt,
    read,
)
from capsteer.capture.cli import run as cli_run
from capsteer.capture.layouts import MANIFEST_FILE, MERGE_LOCK_FILE, part_name
from capsteer.capture.published import sha256_file
from capsteer.capture.spec import CaptureSpec
from capsteer.capture.writer.stages import take_merge_lock

Key = tuple[str, int]
HOOKS = {"resid_pre": "all", "resid_post": "all"}
PROMPT, GENERATED = 7, 5


def split_by_layer(spec: CaptureSpec, layers_per_stage: list[list[int]]) -> list[tuple[Key, ...]]:
    """Each stage's keys: every hook at the stage's layers (how PP splits a model)."""
    return [tuple(k for k in spec.keys() if k[1] in layers) for layers in layers_per_stage]


def stage_requests(cid: str, spec: CaptureSpec, keys: list[tuple[Key, ...]], **kw: object) -> list[CaptureRequest]:
    base = make_request(cid, spec, PROMPT)
    return [
        dataclasses.replace(base, stage=s, num_stages=len(keys), keys=k, **kw)  # type: ignore[arg-type]
        for s, k in enumerate(keys)
    ]


def steps(prompt: int, fed: int, chunk: int = 3) -> list[tuple[int, int]]:
    """Chunked prefill then one position per decode step, as the engine schedules them."""
    return [(lo, min(prompt, lo + chunk)) for lo in range(0, prompt, chunk)] + [(t, t + 1) for t in range(prompt, fed)]


def drive(
    stages: list[tuple[CaptureWriter, CaptureRequest]], *, skip_last_step: frozenset[int] = frozenset()
) -> tuple[CaptureEnd, dict[Key, torch.Tensor]]:
    """Feed every stage its keys' rows, step by step, alternating which stage goes first
    (the rows of the stages arrive interleaved, as from concurrent workers)."""
    req = stages[0][1]
    fed = PROMPT + GENERATED - 1
    refs = {k: reference_rows(req.capture_id, k, fed, req.hidden_size, req.model_dtype) for k in req.spec.keys()}
    for w, r in stages:
        w.open(r)
    plan = steps(PROMPT, fed)
    for i, (lo, hi) in enumerate(plan):
        order = stages if i % 2 == 0 else stages[::-1]
        for w, r in order:
            if r.stage in skip_last_step and i == len(plan) - 1:
                continue
            for hook, layer in r.keys or r.spec.keys():
                w.write(r.capture_id, hook, layer, np.arange(lo, hi), refs[(hook, layer)][lo:hi].clone())
    token_ids = tuple(req.prompt_token_ids) + tuple(range(5000, 5000 + GENERATED - 1))
    return CaptureEnd(req.capture_id, token_ids, finish_reason="length"), refs


@pytest.fixture
def writers(root: Path) -> Iterator[list[CaptureWriter]]:
    ws = [CaptureWriter(root, budget_bytes=64 << 20, workers=2) for _ in range(2)]
    yield ws
    for w in ws:
        w.shutdown(timeout=30)


def manifests(root: Path) -> list[Path]:
    return [p for p in all_files(root) if p.name == MANIFEST_FILE]


def stage_receipts(ws: list[CaptureWriter], cid: str) -> list[Receipt]:
    return [w.future(cid).result(timeout=30) for w in ws]


def expected_files(spec: CaptureSpec, layout: str, n_stages: int) -> set[str]:
    if layout == "packed":
        return {f"activations-stage{s}.safetensors" for s in range(n_stages)}
    return {f"{h}.{layer}.safetensors" for h, layer in spec.keys()}


def assert_merged_ok(root: Path, cid: str, spec: CaptureSpec, refs: dict[Key, torch.Tensor], end: CaptureEnd) -> dict:
    """One manifest, listing every file (size and sha256 right), every key readable and exact."""
    found = [p for p in manifests(root) if p.parent.name == cid]
    assert len(found) == 1, found
    cap_dir = found[0].parent
    manifest = json.loads(found[0].read_text())
    assert manifest["status"] == "ok", manifest["error"]
    assert manifest["stages"] == 2 and len(manifest["stage_parts"]) == 2
    assert manifest["keys"] == [f"{h}.{layer}" for h, layer in spec.keys()]
    assert {f["name"] for f in manifest["files"]} == expected_files(spec, spec.layout, 2)
    for entry in manifest["files"]:
        path = cap_dir / entry["name"]
        assert os.path.getsize(path) == entry["bytes"] and sha256_file(path) == entry["sha256"]
    fed = len(end.token_ids)
    assert manifest["positions"] == list(range(fed))
    assert manifest["token_ids"] == list(end.token_ids)
    cap = read(cap_dir)
    assert cap.stages == 2 and cap.verify() == []
    assert sorted(cap.keys()) == sorted(refs)
    for key, ref in refs.items():
        assert torch.equal(cap.tensor(*key), ref), key
    # Only final names and the hidden sidecars: no temp or partial files.
    names = {p.name for p in cap_dir.iterdir()}
    assert names == expected_files(spec, spec.layout, 2) | {MANIFEST_FILE, MERGE_LOCK_FILE, part_name(0), part_name(1)}
    assert temp_files(root) == []
    assert find_receipt(root, cid) == Receipt.from_manifest(manifest, cap_dir.relative_to(root).as_posix())
    return manifest


@pytest.mark.parametrize("layout", ["packed", "per_file"])
@pytest.mark.parametrize("first", [0, 1])
def test_stages_closed_in_either_order_merge_into_one_manifest(writers, root, layout, first):
    spec = make_spec(hooks=HOOKS, layout=layout)
    cid = f"pp-{layout}-{first}"
    reqs = stage_requests(cid, spec, split_by_layer(spec, [[0, 1], [2, 3]]))
    end, refs = drive(list(zip(writers, reqs, strict=True)))
    writers[first].close(end)
    alone = writers[first].future(cid).result(timeout=30)
    # One stage done: its files and part are durable, but there is no capture yet.
    assert alone.status == "ok" and alone.manifest == part_name(first)
    assert manifests(root) == [] and find_receipt(root, cid) is None
    out = io.StringIO()
    assert cli_run(root, deep=True, out=out) == 0
    assert "without manifest.json" in out.getvalue()
    writers[1 - first].close(end)
    receipts = stage_receipts(writers, cid)
    manifest = assert_merged_ok(root, cid, spec, refs, end)
    stage_timings = [p["timings"] for p in manifest["stage_parts"]]
    assert manifest["timings"]["published_at"] >= max(t["published_at"] for t in stage_timings)
    assert manifest["timings"]["closed_at"] == min(t["closed_at"] for t in stage_timings)
    # Each writer's receipt is its own stage's outcome (its files only).
    for s, r in enumerate(receipts):
        assert r.status == "ok" and r.manifest == part_name(s)
        assert set(r.files) == set(manifest["stage_parts"][s]["files"])
    assert sorted(f for r in receipts for f in r.files) == sorted(f["name"] for f in manifest["files"])
    out = io.StringIO()
    assert cli_run(root, deep=True, out=out) == 0
    assert "1 manifest(s), 0 corrupt" in out.getvalue()


@pytest.mark.parametrize("layout", ["packed", "per_file"])
def test_concurrent_closes_never_merge_twice_or_miss(writers, root, layout):
    spec = make_spec(hooks=HOOKS, layout=layout)
    keys = split_by_layer(spec, [[0, 1], [2, 3]])
    for i in range(20):
        cid = f"race-{layout}-{i}"
        reqs = stage_requests(cid, spec, keys)
        end, refs = drive(list(zip(writers, reqs, strict=True)))
        gate = threading.Barrier(2)

        def close(w: CaptureWriter, end: CaptureEnd = end, gate: threading.Barrier = gate) -> None:
            gate.wait()
            w.close(end)

        threads = [threading.Thread(target=close, args=(w,)) for w in writers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [r.status for r in stage_receipts(writers, cid)] == ["ok", "ok"]
        assert_merged_ok(root, cid, spec, refs, end)
    assert len(manifests(root)) == 20


def test_merge_lock_has_exactly_one_winner(tmp_path):
    wins: list[bool] = []
    gate = threading.Barrier(8)

    def contend() -> None:
        gate.wait()
        wins.append(take_merge_lock(tmp_path, {"pid": os.getpid()}))

    threads = [threading.Thread(target=contend) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(wins) == [False] * 7 + [True]
    assert not take_merge_lock(tmp_path, {})  # never released: a late stage cannot merge again


@pytest.mark.parametrize("failing", [0, 1])
def test_aborted_stage_gives_one_error_manifest_naming_it(writers, root, failing):
    spec = make_spec(hooks=HOOKS, layout="per_file")
    cid = f"pp-abort-{failing}"
    reqs = stage_requests(cid, spec, split_by_layer(spec, [[0, 1], [2, 3]]))
    end, _ = drive(list(zip(writers, reqs, strict=True)))
    writers[failing].abort(cid, "client disconnected")
    writers[1 - failing].close(end)
    receipts = stage_receipts(writers, cid)
    assert receipts[failing].status == "error" and receipts[1 - failing].status == "ok"
    (mpath,) = manifests(root)
    manifest = json.loads(mpath.read_text())
    assert manifest["status"] == "error"
    assert f"stage {failing}: aborted: client disconnected" in manifest["error"]
    assert manifest["files"] == [] and "tensors" not in manifest
    assert not list(mpath.parent.glob("*.safetensors"))  # the ok stage's files went with it
    assert find_receipt(root, cid).status == "error"
    assert temp_files(root) == []


def test_dropped_stage_makes_the_capture_dropped(root):
    spec = make_spec(hooks=HOOKS)
    ws = [CaptureWriter(root, budget_bytes=64 << 20), CaptureWriter(root, budget_bytes=64, policy="drop")]
    try:
        reqs = stage_requests("pp-drop", spec, split_by_layer(spec, [[0, 1], [2, 3]]))
        end, _ = drive(list(zip(ws, reqs, strict=True)))
        for w in ws:
            w.close(end)
        assert [r.status for r in stage_receipts(ws, "pp-drop")] == ["ok", "dropped"]
    finally:
        for w in ws:
            w.shutdown(timeout=30)
    manifest = json.loads(manifests(root)[0].read_text())
    assert manifest["status"] == "dropped" and manifest["error"] == "stage 1: dropped: budget"


def test_stages_with_different_positions_are_an_error(writers, root):
    spec = make_spec(hooks=HOOKS)
    reqs = stage_requests("pp-pos", spec, split_by_layer(spec, [[0, 1], [2, 3]]))
    end, _ = drive(list(zip(writers, reqs, strict=True)), skip_last_step=frozenset({1}))
    for w in writers:
        w.close(end)
    # Each stage alone is consistent; together they are not.
    assert [r.status for r in stage_receipts(writers, "pp-pos")] == ["ok", "ok"]
    (mpath,) = manifests(root)
    manifest = json.loads(mpath.read_text())
    assert manifest["status"] == "error"
    assert manifest["error"].startswith("stage 1: positions") and "stage 0's" in manifest["error"]
    assert manifest["files"] == [] and not list(mpath.parent.glob("*.safetensors"))


def test_stages_with_different_token_ids_are_an_error(writers, root):
    spec = make_spec(hooks=HOOKS)
    reqs = stage_requests("pp-tok", spec, split_by_layer(spec, [[0, 1], [2, 3]]))
    end, _ = drive(list(zip(writers, reqs, strict=True)))
    writers[0].close(end)
    writers[1].close(dataclasses.replace(end, token_ids=(*end.token_ids[:-1], 7)))
    stage_receipts(writers, "pp-tok")
    manifest = json.loads(manifests(root)[0].read_text())
    assert manifest["status"] == "error" and "stage 1: token_ids" in manifest["error"]


def test_a_key_no_stage_wrote_is_an_error(writers, root):
    spec = make_spec(hooks=HOOKS)
    reqs = stage_requests("pp-gap", spec, split_by_layer(spec, [[0, 1], [2]]))
    end, _ = drive(list(zip(writers, reqs, strict=True)))
    for w in writers:
        w.close(end)
    stage_receipts(writers, "pp-gap")
    manifest = json.loads(manifests(root)[0].read_text())
    assert manifest["status"] == "error"
    assert manifest["error"] == "no stage wrote resid_post.3, resid_pre.3"


def test_stage_without_keys_writes_no_data_file(root):
    spec = make_spec(hooks=HOOKS, layout="packed")
    ws = [CaptureWriter(root, workers=2) for _ in range(3)]
    try:
        keys = [*split_by_layer(spec, [[0, 1], [2, 3]]), ()]
        reqs = stage_requests("pp-empty", spec, keys)
        end, refs = drive(list(zip(ws, reqs, strict=True)))
        for w in reversed(ws):
            w.close(end)
        receipts = stage_receipts(ws, "pp-empty")
    finally:
        for w in ws:
            w.shutdown(timeout=30)
    assert [r.status for r in receipts] == ["ok", "ok", "ok"] and receipts[2].files == ()
    (mpath,) = manifests(root)
    manifest = json.loads(mpath.read_text())
    assert manifest["status"] == "ok" and manifest["stages"] == 3
    assert [f["name"] for f in manifest["files"]] == [f"activations-stage{s}.safetensors" for s in (0, 1)]
    assert manifest["stage_parts"][2]["files"] == [] and manifest["stage_parts"][2]["keys"] == []
    cap = read(mpath.parent)
    for key, ref in refs.items():
        assert torch.equal(cap.tensor(*key), ref)


def test_merged_capture_corruption_is_detected(writers, root):
    spec = make_spec(hooks=HOOKS)
    reqs = stage_requests("pp-bad", spec, split_by_layer(spec, [[0, 1], [2, 3]]))
    end, _ = drive(list(zip(writers, reqs, strict=True)))
    for w in writers:
        w.close(end)
    stage_receipts(writers, "pp-bad")
    cap_dir = manifests(root)[0].parent
    victim = cap_dir / "activations-stage1.safetensors"
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(CorruptCapture, match="activations-stage1"):
        read(cap_dir)
    out = io.StringIO()
    assert cli_run(root, deep=True, out=out) == 1
    assert "CORRUPT activations-stage1.safetensors" in out.getvalue()


def test_republishing_a_merged_capture_is_refused(writers, root):
    spec = make_spec(hooks=HOOKS, layout="per_file")
    keys = split_by_layer(spec, [[0, 1], [2, 3]])
    end, refs = drive(list(zip(writers, stage_requests("pp-dup", spec, keys), strict=True)))
    for w in writers:
        w.close(end)
    stage_receipts(writers, "pp-dup")
    end2, _ = drive(list(zip(writers, stage_requests("pp-dup", spec, keys), strict=True)))
    for w in writers:
        w.close(end2)
    again = stage_receipts(writers, "pp-dup")
    assert all(r.status == "error" and "already" in r.error for r in again)
    assert_merged_ok(root, "pp-dup", spec, refs, end)


def test_dir_time_keeps_stages_in_one_directory_across_midnight(root):
    spec = make_spec(hooks=HOOKS)
    midnight = 86400.0  # 1970-01-02 00:00 UTC
    ws = [CaptureWriter(root, clock=lambda: midnight - 0.5), CaptureWriter(root, clock=lambda: midnight + 0.5)]
    try:
        reqs = stage_requests("pp-late", spec, split_by_layer(spec, [[0, 1], [2, 3]]), dir_time=midnight - 1)
        end, refs = drive(list(zip(ws, reqs, strict=True)))
        for w in ws:
            w.close(end)
        receipts = stage_receipts(ws, "pp-late")
    finally:
        for w in ws:
            w.shutdown(timeout=30)
    assert {r.dir for r in receipts} == {"1970-01-01/default/pp-late"}
    assert_merged_ok(root, "pp-late", spec, refs, end)


def test_single_stage_is_laid_out_as_before(root):
    """S=1 with explicit stage fields is byte-for-byte the default request's capture."""
    spec = make_spec(hooks=HOOKS, layout="packed")
    dirs: list[Path] = []
    variants: list[dict[str, object]] = [{}, {"stage": 0, "num_stages": 1, "keys": tuple(spec.keys())}]
    for i, fields in enumerate(variants):
        sub = root / f"w{i}"
        w = CaptureWriter(sub, clock=lambda: 1000.0)
        try:
            req = dataclasses.replace(make_request("single", spec, PROMPT), **fields)  # type: ignore[arg-type]
            end, refs = drive([(w, req)])
            w.close(end)
            r = w.future("single").result(timeout=30)
        finally:
            w.shutdown(timeout=30)
        assert r.status == "ok" and r.manifest == MANIFEST_FILE
        dirs.append(sub / r.dir)
    for d in dirs:
        assert sorted(p.name for p in d.iterdir()) == ["activations.safetensors", "manifest.json"]
    a, b = (d / "activations.safetensors" for d in dirs)
    assert a.read_bytes() == b.read_bytes()
    ma, mb = (json.loads((d / MANIFEST_FILE).read_text()) for d in dirs)
    for m in (ma, mb):
        assert "stages" not in m and "stage" not in m and "stage_parts" not in m
        m.pop("timings"), m.pop("writer")
    assert ma == mb
    assert list(ma)[:3] == ["format", "format_version", "capture_id"]
    cap = read(dirs[0])
    assert cap.stages == 1
    for key, ref in refs.items():
        assert torch.equal(cap.tensor(*key), ref)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"stage": 2, "num_stages": 2}, "stage 2 of 2"),
        ({"stage": 0, "num_stages": 0}, "stage 0 of 0"),
        ({"stage": 0, "num_stages": 2, "keys": (("resid_post", NUM_LAYERS),)}, "not in the spec"),
        ({"keys": (("resid_post", 0),)}, "single stage writes every key"),
    ],
)
def test_open_refuses_stage_fields_that_cannot_merge(writers, fields, message):
    spec = make_spec(hooks=HOOKS)
    req = dataclasses.replace(make_request("bad-stage", spec, PROMPT), **fields)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=message):
        writers[0].open(req)
