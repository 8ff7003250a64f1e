"""Capture spec parsing: every accepted form, and errors that name the field."""

from __future__ import annotations

import json

import numpy as np
import pytest

from capsteer.capture.spec import (
    CaptureSpec,
    PositionSpec,
    SpecError,
    parse_capture_spec,
    validate_slug,
)

N = 32


def parse(obj, **kw):
    return parse_capture_spec(obj, num_layers=N, **kw)


def test_true_means_default_spec():
    spec = parse(True)
    assert spec.hooks == {"resid_post": tuple(range(N))}
    assert spec.positions == PositionSpec("all")
    assert (spec.layout, spec.dtype, spec.tag) == ("packed", "auto", None)
    server_default = {"hooks": ["resid_mid"], "layers": [0, -1], "positions": "last"}
    spec = parse(True, default=server_default, default_layout="per_file")
    assert spec.hooks == {"resid_mid": (0, N - 1)}
    assert spec.positions.kind == "last"
    assert spec.layout == "per_file"


def test_missing_fields_come_from_default():
    spec = parse({"positions": "prompt"}, default={"hooks": ["attn_out"], "layers": "0-1"})
    assert spec.hooks == {"attn_out": (0, 1)}
    assert spec.positions.kind == "prompt"


@pytest.mark.parametrize(
    ("layers", "expected"),
    [
        ("all", tuple(range(N))),
        ([3, -1, 3], (3, N - 1)),
        (5, (5,)),
        ("7", (7,)),
        ("2-4", (2, 3, 4)),
        ("-3--1", (N - 3, N - 2, N - 1)),
        ("2:5", (2, 3, 4)),
        (":2", (0, 1)),
        ("-2:", (N - 2, N - 1)),
        (["0-1", 10], (0, 1, 10)),
    ],
)
def test_layer_forms(layers, expected):
    assert parse({"hooks": ["resid_pre"], "layers": layers}).hooks == {"resid_pre": expected}


@pytest.mark.parametrize(
    ("layers", "needle"),
    [
        (40, "layer 40 out of range"),
        ([0, -33], "layer -33 out of range"),
        ("5-2", "empty range"),
        ("3:3", "empty slice"),
        ("0:99", "out of range"),
        ("everything", "cannot parse"),
        ([], "empty list"),
        (True, "expected"),
        ([1.5], "expected an integer"),
    ],
)
def test_layer_errors_name_the_field(layers, needle):
    with pytest.raises(SpecError) as info:
        parse({"hooks": ["resid_post"], "layers": layers})
    assert info.value.field == "capture.layers"
    assert needle in info.value.reason
    assert str(info.value).startswith("capture.layers: ")


def test_hooks_as_dict_aliases_merge_and_per_hook_field():
    spec = parse({"hooks": {"resid_post": [0], "post_block": "2-3", "pre_attn": "all", "post_attn": [-1]}})
    assert spec.hooks == {
        "resid_post": (0, 2, 3),
        "resid_pre": tuple(range(N)),
        "resid_mid": (N - 1,),
    }
    assert spec.keys()[0] == ("resid_mid", N - 1)
    with pytest.raises(SpecError) as info:
        parse({"hooks": {"resid_mid": [3, 99]}})
    assert info.value.field == "capture.hooks.resid_mid"
    with pytest.raises(SpecError) as info:
        parse({"hooks": {"resid_mid": [3]}, "layers": "all"})
    assert info.value.field == "capture.layers"


@pytest.mark.parametrize("bad", ["post_mlp", "resid", "blocks.0.hook_resid_post", 7])
def test_bad_hooks(bad):
    with pytest.raises(SpecError) as info:
        parse({"hooks": [bad]})
    assert info.value.field == "capture.hooks"
    if bad == "post_mlp":
        assert "not accepted" in info.value.reason
    else:
        assert "accepted:" in info.value.reason


def test_unknown_key_is_named():
    with pytest.raises(SpecError) as info:
        parse({"hooks": ["resid_post"], "layer": 3})
    assert info.value.field == "capture.layer"
    with pytest.raises(SpecError) as info:
        parse("yes")
    assert info.value.field == "capture"


@pytest.mark.parametrize(
    ("value", "kind", "explicit"),
    [
        ("all", "all", ()),
        ("PROMPT", "prompt", ()),
        ("generated", "generated", ()),
        ("last_prompt", "last_prompt", ()),
        ("last", "last", ()),
        ([5, -1, 5, 0], "explicit", (-1, 0, 5)),
        (3, "explicit", (3,)),
    ],
)
def test_position_forms(value, kind, explicit):
    spec = parse({"positions": value})
    assert spec.positions == PositionSpec(kind, explicit)


@pytest.mark.parametrize("value", ["first", [], ["x"], [True], 2.0, [2**63], -(2**31), 2**31,
                                   str(2**64), [0, "9" * 30]])
def test_position_errors(value):
    with pytest.raises(SpecError) as info:
        parse({"positions": value})
    assert info.value.field == "capture.positions"


def test_layout_dtype_and_aliases():
    spec = parse({"layout": "per_file", "dtype": "bf16"})
    assert (spec.layout, spec.dtype) == ("per_file", "bfloat16")
    assert parse({"dtype": "fp16"}).dtype == "float16"
    for key, value in (("layout", "sharded"), ("dtype", "int8"), ("dtype", 16)):
        with pytest.raises(SpecError) as info:
            parse({key: value})
        assert info.value.field == f"capture.{key}"


@pytest.mark.parametrize("tag", ["my-run-1", "a", "A.b_c-9", "x" * 64, "..."])
def test_good_tags(tag):
    assert parse({"tag": tag}).tag == tag


@pytest.mark.parametrize("tag", ["", ".", "..", "a/b", "../x", "x" * 65, "a b", "é", 5, "a\x00"])
def test_bad_tags(tag):
    with pytest.raises(SpecError) as info:
        parse({"tag": tag})
    assert info.value.field == "capture.tag"
    with pytest.raises(SpecError):
        validate_slug(tag, "capture.tag")


def test_round_trip_and_hash():
    spec = parse(
        {"hooks": {"mlp_out": "0:3", "resid_pre": [-1]}, "positions": [-1, 4], "dtype": "float32", "tag": "t"}
    )
    d = spec.to_dict()
    assert json.loads(json.dumps(d)) == d
    again = CaptureSpec.from_dict(d)
    assert again == spec
    assert hash(again) == hash(spec)
    assert again.to_json() == spec.to_json()
    assert {spec: 1}[again] == 1
    assert spec.row_bytes(hidden_size=8, itemsize=2) == 4 * 8 * 2


P = 5  # prompt length in the position tests; fed sequence length 9


@pytest.mark.parametrize(
    ("kind", "explicit", "cand", "final"),
    [
        ("all", (), list(range(10)), list(range(9))),
        ("prompt", (), [0, 1, 2, 3, 4], [0, 1, 2, 3, 4]),
        ("generated", (), [5, 6, 7, 8, 9], [5, 6, 7, 8]),
        ("last_prompt", (), [4], [4]),
        ("last", (), [4, 5, 6, 7, 8, 9], [8]),
        ("explicit", (0, -1, 7, -9, 12), [0, 4, 7], [0, 4, 7]),
    ],
)
def test_candidate_and_finalize(kind, explicit, cand, final):
    ps = PositionSpec(kind, explicit)
    positions = np.arange(10, dtype=np.int64)
    assert np.flatnonzero(ps.candidate(positions, P)).tolist() == cand
    captured = positions[ps.candidate(positions, P)]
    kept = ps.finalize(captured, P, fed_len=9)
    assert kept.dtype == np.int64
    assert kept.tolist() == final


def test_last_when_cut_short_and_empty():
    ps = PositionSpec("last")
    assert ps.finalize(np.array([4, 5], np.int64), P, fed_len=9).tolist() == [5]
    assert ps.finalize(np.array([], np.int64), P, fed_len=9).tolist() == []
    assert PositionSpec("generated").finalize(np.array([], np.int64), P, 5).tolist() == []


def test_position_spec_rejects_inconsistent():
    with pytest.raises(SpecError):
        PositionSpec("explicit")
    with pytest.raises(SpecError):
        PositionSpec("nope")


def test_wire_positions_out_of_range_are_refused_before_the_engine_uses_them():
    """A payload that skipped the front end (the workers parse the wire form) must not
    reach numpy's int64 on the step thread: from_wire refuses it by name."""
    spec = parse({"positions": [2**31 - 1, -(2**31 - 1)]})
    assert spec.positions.reaches_past_prompt(10)
    wire = json.loads(spec.to_json())
    wire["positions"] = [2**63]
    with pytest.raises(SpecError) as info:
        CaptureSpec.from_wire(json.dumps(wire))
    assert info.value.field == "capture.positions"
