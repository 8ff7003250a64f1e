"""Named steering vectors travel by reference: the payload names the registry entry and its
content sha256, and every worker reads that content from the same directory (kept by its
sha256), never another vector stored under that name meanwhile."""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest
import torch

from capsteer.engine_ext.payload import build_payload
from capsteer.engine_ext.plan import RequestHooks
from capsteer.engine_ext.runtime import HookRuntime
from capsteer.server.errors import exception_body
from capsteer.server.fields import FieldError, ModelShape, parse_hook_fields
from capsteer.steering import registry as reg_mod
from capsteer.steering.readers.registry import ReaderRegistry
from capsteer.steering.registry import VectorChangedError, VectorReader, VectorRegistry
from capsteer.steering.spec import SteeringSpec, parse_steering_spec

LAYERS, HIDDEN = 28, 1024  # Qwen3-0.6B's geometry: the serve harness's shape


def _npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array.astype("<f4"))
    return buf.getvalue()


def _rows(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((LAYERS, HIDDEN)).astype(np.float32)


@pytest.fixture
def registry(tmp_path) -> VectorRegistry:
    reg = VectorRegistry(tmp_path / "vectors", hidden_size=HIDDEN, num_layers=LAYERS)
    reg.put("per-layer", _npy(_rows(1)))
    reg.put("one", _npy(_rows(2)[0]))
    return reg


def _runtime() -> HookRuntime:
    return HookRuntime(LAYERS, HIDDEN, torch.float32, torch.device("cpu"), max_tokens=64,
                       max_entries=256)


def _parse(steering: dict, lookup) -> SteeringSpec:
    spec = parse_steering_spec(steering, num_layers=LAYERS, hidden_size=HIDDEN, lookup=lookup)
    assert spec is not None
    return spec


NAMED = {"vectors": [{"hook": "resid_post", "vector": {"name": "per-layer"}, "scale": 4.0},
                     {"hook": "attn_out", "layer": 3, "op": "ablate", "vector": {"name": "one"}}]}


def _inline(rows: np.ndarray, one: np.ndarray) -> dict:
    """NAMED with the same floats sent inline."""
    return {"vectors": [*({"hook": "resid_post", "layer": i, "vector": rows[i].tolist(),
                           "scale": 4.0} for i in range(LAYERS)),
                        {"hook": "attn_out", "layer": 3, "op": "ablate", "vector": one.tolist()}]}


def test_named_payload_is_small_and_builds_the_inline_entries(registry, tmp_path):
    named = _parse(NAMED, registry.lookup_named)
    inline = _parse(_inline(_rows(1), _rows(2)[0]), registry.lookup)
    by_value = _parse(NAMED, registry.lookup)  # a lookup without digests: floats inline
    payload = build_payload(None, named).extra_args["capsteer"]
    assert len(payload["steering"]) < 4096, len(payload["steering"])  # 28 ops, no floats
    assert len(by_value.wire_text) > 150_000 and "refs" not in by_value.to_dict()
    assert named.to_dict()["refs"] == [
        {"name": "per-layer", "sha256": registry.lookup_named("per-layer").sha256},
        {"name": "one", "sha256": registry.lookup_named("one").sha256}]
    # Content decides sharing (table entries, prefix cache), not how the vector travelled.
    assert named.sharing_key == inline.sharing_key == by_value.sharing_key
    assert named.cache_salt() == inline.cache_salt()
    reader = VectorReader(tmp_path / "vectors", hidden_size=HIDDEN, num_layers=LAYERS)
    back = SteeringSpec.from_wire(named.wire_text, reader)
    for got, want in zip(back.ops, inline.ops, strict=True):
        assert (got.hook, got.layer, got.op, got.scale) == (want.hook, want.layer, want.op,
                                                            want.scale)
        np.testing.assert_array_equal(got.vector, want.vector)  # ablate's unit vector too
    rt, inline_rt = _runtime(), _runtime()
    hooks = RequestHooks.from_payload("a", payload, 4, rt, reader)
    ref = RequestHooks.from_payload("b", build_payload(None, inline).extra_args["capsteer"], 4,
                                    inline_rt)
    assert hooks.entries.keys() == ref.entries.keys()
    for k, e in hooks.entries.items():
        torch.testing.assert_close(rt.w[e], inline_rt.w[ref.entries[k]], rtol=0, atol=0)
        torch.testing.assert_close(rt.u[e], inline_rt.u[ref.entries[k]], rtol=0, atol=0)
    with pytest.raises(ValueError, match="no vector registry"):  # a worker without the dir
        SteeringSpec.from_wire(named.wire_text)


def _ranks(tmp_path) -> list[VectorReader]:
    """Two tensor-parallel ranks' readers of the server's registry directory."""
    return [VectorReader(tmp_path / "vectors", hidden_size=HIDDEN, num_layers=LAYERS)
            for _ in range(2)]


def test_a_vector_replaced_between_two_ranks_loads_steers_both_alike(registry, tmp_path):
    """The race under tensor parallelism: rank 0 reads the request's vectors, the name is
    replaced (then deleted), rank 1 reads them. Both read the content the server checked
    the request against (kept by its sha256), so both steer with it: a rank refusing
    alone would all-gather by itself and hang the engine."""
    spec = _parse(NAMED, registry.lookup_named)
    payload = build_payload(None, spec).extra_args["capsteer"]
    rank0, rank1 = _ranks(tmp_path)
    rt0, rt1 = _runtime(), _runtime()
    first = RequestHooks.from_payload("a", payload, 4, rt0, rank0)
    registry.put("per-layer", _npy(_rows(3)))  # replaced between the two ranks' loads
    registry.delete("one")
    second = RequestHooks.from_payload("a", payload, 4, rt1, rank1)
    checked = _parse(_inline(_rows(1), _rows(2)[0]), None)
    assert first.steering_key == second.steering_key == checked.sharing_key
    for ref in spec.to_dict()["refs"]:  # the very floats, on both ranks
        a, b = rank0(ref["name"], ref["sha256"]), rank1(ref["name"], ref["sha256"])
        for key in (a if isinstance(a, Mapping) else {None: a}):
            np.testing.assert_array_equal(a if key is None else a[key],
                                          b if key is None else b[key])
    # The next request is checked against the new vector and steers with it.
    fresh = _parse({"vectors": NAMED["vectors"][:1]}, registry.lookup_named)
    hooks = RequestHooks.from_payload("b", build_payload(None, fresh).extra_args["capsteer"], 4,
                                      rt1, rank1)
    want = _parse({"vectors": _inline(_rows(3), _rows(2)[0])["vectors"][:LAYERS]}, None)
    assert hooks.steering_key == fresh.sharing_key == want.sharing_key


def test_content_gone_is_refused_alike_by_every_rank(registry, tmp_path):
    """Content no longer kept (removed by hand, or unused past CONTENT_KEEP_SECONDS) is
    refused by every rank with the same error, before anything is registered (request_book
    logs it, counts it in capsteer_steering_refused_total and ends a capture with an
    error receipt); a content file holding other bytes is refused alike too."""
    spec = _parse(NAMED, registry.lookup_named)
    payload = build_payload(None, spec).extra_args["capsteer"]
    sha = spec.to_dict()["refs"][0]["sha256"]
    registry.content_path(sha).unlink()
    errors = []
    for reader in _ranks(tmp_path):
        rt = _runtime()
        free, slots = len(rt.free_entries), len(rt.free_slots)
        with pytest.raises(VectorChangedError, match="is not readable") as info:
            RequestHooks.from_payload("a", payload, 4, rt, reader)
        errors.append(str(info.value))
        # nothing half-registered: no entries, no slot, no shared spec
        assert (len(rt.free_entries), len(rt.free_slots), rt.shared) == (free, slots, {})
    assert errors[0] == errors[1]
    other = registry.lookup_named("one")  # its content file, under another sha256
    registry.content_path(other.sha256).rename(registry.content_path(sha))
    for reader in _ranks(tmp_path):
        with pytest.raises(VectorChangedError, match="holds other content"):
            reader("per-layer", sha)


def test_old_content_goes_at_a_put_once_unused(registry, tmp_path, monkeypatch):
    """Content files no request was checked against for CONTENT_KEEP_SECONDS go at the
    next put or delete; a request's check keeps its content's file."""
    old = registry.lookup_named("per-layer").sha256
    registry.put("per-layer", _npy(_rows(3)))
    assert registry.content_path(old).exists()  # requests checked against it may run
    stale = time.time() - reg_mod.CONTENT_KEEP_SECONDS - 1
    for sha in (old, registry.lookup_named("one").sha256):
        os.utime(registry.content_path(sha), (stale, stale))
    registry._touched.clear()  # this process's memory of touching them
    registry.lookup_named("one")  # checked again: touched, kept
    registry.put("third", _npy(_rows(6)[0]))
    assert not registry.content_path(old).exists()
    assert registry.content_path(registry.lookup_named("one").sha256).exists()
    assert registry.names() == ["one", "per-layer", "third"]


def test_reader_keeps_verified_content_by_sha(registry, tmp_path):
    """Content a worker already read stays usable by its sha256 after the name is replaced
    (the requests checked against it were checked against exactly that): in memory, the
    last `keep`, else from its content file while that is kept."""
    reader = VectorReader(tmp_path / "vectors", hidden_size=HIDDEN, num_layers=LAYERS, keep=1)
    old = registry.lookup_named("per-layer")
    np.testing.assert_array_equal(reader("per-layer", old.sha256)[5], _rows(1)[5])
    registry.put("per-layer", _npy(_rows(4)))
    np.testing.assert_array_equal(reader("per-layer", old.sha256)[5], _rows(1)[5])
    new = registry.lookup_named("per-layer")
    assert new.sha256 != old.sha256
    np.testing.assert_array_equal(reader("per-layer", new.sha256)[5], _rows(4)[5])
    # keep=1: the old content was let go from memory, and is read again from its file
    np.testing.assert_array_equal(reader("per-layer", old.sha256)[5], _rows(1)[5])
    registry.content_path(old.sha256).unlink()
    reader("per-layer", new.sha256)  # the kept one now
    with pytest.raises(VectorChangedError):
        reader("per-layer", old.sha256)


def test_server_reuses_the_parse_of_a_named_field_until_the_vector_changes(registry):
    """The middleware parses a names-only steering field once: the same spec (its wire form
    already built) while the registry holds the same entries, a new parse once one is
    replaced, and the registry's refusal once it is gone."""
    shape = ModelShape(LAYERS, HIDDEN, 4096, 2)

    def parse(steering: dict) -> SteeringSpec:
        body = {"model": "m", "prompt": "x", "steering": steering}
        hooks = parse_hook_fields(body, shape, lookup=registry.lookup_named,
                                  default_layout="packed", capture_default=None)
        assert hooks.steering is not None
        return hooks.steering

    first = parse(NAMED)
    assert parse(NAMED) is first and first.wire_text  # reused, wire form kept
    other = {"vectors": [{**NAMED["vectors"][0], "scale": 2.0}]}
    assert parse(other) is not first  # another field, another spec
    registry.put("per-layer", _npy(_rows(5)))
    replaced = parse(NAMED)
    assert replaced is not first and replaced.sharing_key != first.sharing_key
    inline = _parse(_inline(_rows(5), _rows(2)[0]), None)
    assert replaced.sharing_key == inline.sharing_key
    registry.delete("per-layer")
    with pytest.raises(FieldError, match="unknown vector name"):
        parse(NAMED)
    # Inline floats are parsed per request (no reuse).
    body = _inline(_rows(1), _rows(2)[0])
    assert parse(body) is not parse(body)


def test_server_reuses_the_parse_of_a_gated_field_until_its_reader_changes(registry, tmp_path):
    """A names-only field whose items carry a `when` on a named probe is parsed once too:
    reused while the vector and the reader's content are the same (the reader's tensors
    neither loaded again nor kept by the memo), parsed again (a new gate) once the reader
    is replaced, and refused once it is gone."""
    shape = ModelShape(LAYERS, HIDDEN, 4096, 2)
    readers = ReaderRegistry(tmp_path / "readers", hidden_size=HIDDEN)
    probe = {"weight": [[0.5] * HIDDEN], "bias": [0.25]}
    readers.put("probe", json.dumps(probe).encode(), "json")
    gated = {"vectors": [{**NAMED["vectors"][0], "when": {"reader": {"name": "probe"},
                                                          "index": 0, "above": 0.5}}]}
    loads: list[str] = []

    def tensors(name: str):
        loads.append(name)
        return readers.tensors(name)

    def parse() -> SteeringSpec:
        body = {"model": "m", "prompt": "x", "steering": gated}
        hooks = parse_hook_fields(body, shape, lookup=registry.lookup_named,
                                  default_layout="packed", capture_default=None,
                                  readers=readers.lookup, reader_tensors=tensors)
        assert hooks.steering is not None
        return hooks.steering

    first = parse()
    assert parse() is first and loads == ["probe"]
    fresh = parse_steering_spec(gated, num_layers=LAYERS, hidden_size=HIDDEN,
                                lookup=registry.lookup_named, readers=readers.tensors)
    assert first.sharing_key == fresh.sharing_key  # the memo holds the same parse
    readers.put("probe", json.dumps({**probe, "bias": [-0.75]}).encode(), "json")
    replaced = parse()
    assert replaced is not first and replaced.sharing_key != first.sharing_key
    readers.delete("probe")
    with pytest.raises(FieldError, match="probe"):
        parse()


def test_content_files_are_written_at_the_first_check_where_missing(registry, tmp_path):
    """A directory filled before content files existed (or whose content went unused past
    CONTENT_KEEP_SECONDS): the server's first check of a name writes its content, which
    every rank then reads."""
    shutil.rmtree(tmp_path / "vectors" / reg_mod.CONTENT_DIR)
    server = VectorRegistry(tmp_path / "vectors", hidden_size=HIDDEN, num_layers=LAYERS)
    spec = _parse(NAMED, server.lookup_named)
    for ref in spec.to_dict()["refs"]:
        assert server.content_path(ref["sha256"]).exists()
    payload = build_payload(None, spec).extra_args["capsteer"]
    keys = {RequestHooks.from_payload("a", payload, 4, _runtime(), reader).steering_key
            for reader in _ranks(tmp_path)}
    assert keys == {_parse(_inline(_rows(1), _rows(2)[0]), None).sharing_key}


def test_a_content_write_the_disk_refuses_refuses_the_request(registry, tmp_path, monkeypatch):
    """Content the server cannot write for its workers (a full disk) refuses the request
    with a 503 naming `steering`, never lets it run unsteered; for CONTENT_RETRY_SECONDS
    later requests are refused without touching the disk, then the write is tried again."""
    shutil.rmtree(tmp_path / "vectors" / reg_mod.CONTENT_DIR)
    server = VectorRegistry(tmp_path / "vectors", hidden_size=HIDDEN, num_layers=LAYERS)
    tries: list[Path] = []

    def full_disk(folder, path, write):
        tries.append(path)
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(reg_mod, "publish_atomic", full_disk)
    shape = ModelShape(LAYERS, HIDDEN, 4096, 2)

    def check() -> None:
        parse_hook_fields({"model": "m", "prompt": "x", "steering": NAMED}, shape,
                          lookup=server.lookup_named, default_layout="packed",
                          capture_default=None)
    with pytest.raises(reg_mod.VectorContentError, match="No space left") as refused:
        check()
    status, body = exception_body(refused.value)
    assert status == 503 and json.loads(body)["error"]["param"] == "steering"
    assert len(tries) == 1
    with pytest.raises(reg_mod.VectorContentError):
        check()
    assert len(tries) == 1  # refused again at once, no second write
    monkeypatch.undo()  # the disk has room again, and the retry wait is over
    monkeypatch.setattr(reg_mod, "CONTENT_RETRY_SECONDS", 0.0)
    check()
    assert all(server.content_path(ref["sha256"]).exists()
               for ref in _parse(NAMED, server.lookup_named).to_dict()["refs"])
