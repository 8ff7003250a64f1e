"""Named steering vectors travel by reference: the payload names the registry entry and its
content sha256, a worker reads it from the same directory, and never steers with another
vector stored under that name meanwhile."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from capsteer.engine_ext.payload import build_payload
from capsteer.engine_ext.plan import RequestHooks
from capsteer.engine_ext.runtime import HookRuntime
from capsteer.server.fields import FieldError, ModelShape, parse_hook_fields
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


def test_a_replaced_vector_is_refused_never_used(registry, tmp_path):
    """The vector changes between the server's check and the worker's read: the worker
    refuses the request's hooks (request_book logs it, counts it in
    capsteer_steering_refused_total and ends a capture with an error receipt)."""
    spec = _parse(NAMED, registry.lookup_named)
    payload = build_payload(None, spec).extra_args["capsteer"]
    registry.put("per-layer", _npy(_rows(3)))  # replaced after the check
    reader = VectorReader(tmp_path / "vectors", hidden_size=HIDDEN, num_layers=LAYERS)
    rt = _runtime()
    free, slots = len(rt.free_entries), len(rt.free_slots)
    with pytest.raises(VectorChangedError, match="replaced after the request was checked"):
        RequestHooks.from_payload("a", payload, 4, rt, reader)
    # nothing half-registered: no entries, no slot, no shared spec
    assert (len(rt.free_entries), len(rt.free_slots), rt.shared) == (free, slots, {})
    registry.delete("one")
    with pytest.raises(VectorChangedError, match="not readable"):
        reader("one", spec.to_dict()["refs"][1]["sha256"])
    # The next request is checked against the new vector and steers with it.
    first = {"vectors": NAMED["vectors"][:1]}
    fresh = _parse(first, registry.lookup_named)
    hooks = RequestHooks.from_payload("b", build_payload(None, fresh).extra_args["capsteer"], 4,
                                      rt, reader)
    want = _parse({"vectors": _inline(_rows(3), _rows(2)[0])["vectors"][:LAYERS]}, None)
    assert hooks.steering_key == fresh.sharing_key == want.sharing_key
    assert _parse(first, registry.lookup).sharing_key == want.sharing_key


def test_reader_keeps_verified_content_by_sha(registry, tmp_path):
    """Content a worker already verified stays usable by its sha256 after the name is
    replaced (the requests checked against it were checked against exactly that)."""
    reader = VectorReader(tmp_path / "vectors", hidden_size=HIDDEN, num_layers=LAYERS, keep=1)
    old = registry.lookup_named("per-layer")
    np.testing.assert_array_equal(reader("per-layer", old.sha256)[5], _rows(1)[5])
    registry.put("per-layer", _npy(_rows(4)))
    np.testing.assert_array_equal(reader("per-layer", old.sha256)[5], _rows(1)[5])
    new = registry.lookup_named("per-layer")
    assert new.sha256 != old.sha256
    np.testing.assert_array_equal(reader("per-layer", new.sha256)[5], _rows(4)[5])
    with pytest.raises(VectorChangedError):  # keep=1: the old content was let go
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
