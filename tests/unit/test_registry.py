"""Steering-vector registry and upload formats (pure units, no engine)."""

from __future__ import annotations

import io
import json
import os
import pickle
import struct
import time

import numpy as np
import pytest
from safetensors.numpy import save as st_save

from capsteer.steering import formats
from capsteer.steering.formats import (
    VectorFormatError,
    VectorTooLargeError,
    decode_vectors,
    encode_gguf_control_vector,
    read_gguf,
    sniff_format,
)
from capsteer.steering.registry import (
    VectorNameError,
    VectorNotFoundError,
    VectorRegistry,
    VectorRegistryError,
)
from capsteer.steering.spec import SteeringSpecError, parse_steering_spec

HIDDEN, LAYERS = 8, 4
RNG = np.random.default_rng(0)
VEC = RNG.standard_normal(HIDDEN).astype(np.float32)
STACK = RNG.standard_normal((LAYERS, HIDDEN)).astype(np.float32)


def decode(data: bytes, fmt: str | None = None):
    return decode_vectors(data, hidden_size=HIDDEN, num_layers=LAYERS, fmt=fmt)


@pytest.fixture
def reg(tmp_path):
    return VectorRegistry(tmp_path / "vectors", hidden_size=HIDDEN, num_layers=LAYERS)


# --- payload builders ----------------------------------------------------------------

def npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


def pt(obj: object, legacy: bool = False) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf, _use_new_zipfile_serialization=not legacy)
    return buf.getvalue()


def tensor(arr: np.ndarray):
    import torch

    return torch.from_numpy(np.array(arr))


def gstr(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def gguf_file(kvs: list[bytes], tensors: list[tuple[str, np.ndarray, int]], *,
              version: int = 3, alignment: int = 32) -> bytes:
    """A GGUF built by hand from the spec (ggml docs/gguf.md), independent of the encoder."""
    blobs, infos, offset = [], [], 0
    for name, arr, ggml_type in tensors:
        raw = arr.astype("<f4" if ggml_type == 0 else "<f2").tobytes()
        infos.append(gstr(name) + struct.pack("<I", arr.ndim)
                     + b"".join(struct.pack("<Q", d) for d in arr.shape[::-1])
                     + struct.pack("<IQ", ggml_type, offset))
        blobs.append(raw + b"\0" * (-len(raw) % alignment))
        offset += len(blobs[-1])
    out = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kvs)) + b"".join(kvs)
    out += b"".join(infos)
    out += b"\0" * (-len(out) % alignment)
    return out + b"".join(blobs)


def kv(key: str, vtype: int, payload: bytes) -> bytes:
    return gstr(key) + struct.pack("<I", vtype) + payload


# --- round trips ---------------------------------------------------------------------

SINGLE_CASES = {
    "safetensors": lambda: st_save({"vector": VEC}),
    "safetensors_f16": lambda: st_save({"v": VEC.astype(np.float16)}),
    "pt": lambda: pt(tensor(VEC)),
    "pt_legacy": lambda: pt(tensor(VEC), legacy=True),
    "pt_dict": lambda: pt({"vector": tensor(VEC)}),
    "npy": lambda: npy(VEC),
    "npy_bigendian_f64": lambda: npy(VEC.astype(">f8")),
    "json_list": lambda: json.dumps(VEC.tolist()).encode(),
    "json_vector": lambda: ("  \n" + json.dumps({"vector": VEC.tolist()})).encode(),
}

PER_LAYER_CASES = {
    # name -> (payload, expected layers)
    "safetensors_named": (lambda: st_save({"layer.1": STACK[1], "layers.2": STACK[2],
                                           "direction.3": STACK[3], "0": STACK[0]}), [0, 1, 2, 3]),
    "safetensors_2d": (lambda: st_save({"stack": STACK}), [0, 1, 2, 3]),
    "safetensors_one_named": (lambda: st_save({"layer.2": STACK[2]}), [2]),
    "pt_dict": (lambda: pt({1: tensor(STACK[1]), "layer.3": tensor(STACK[3])}), [1, 3]),
    "pt_2d": (lambda: pt(tensor(STACK)), [0, 1, 2, 3]),
    "pt_list": (lambda: pt([tensor(STACK[0]), None, tensor(STACK[2]), None]), [0, 2]),
    "npy_2d": (lambda: npy(STACK), [0, 1, 2, 3]),
    "json_lists": (lambda: json.dumps([r.tolist() for r in STACK]).encode(), [0, 1, 2, 3]),
    "json_lists_null": (lambda: json.dumps([None, STACK[1].tolist(), None, None]).encode(), [1]),
    "json_layers": (lambda: json.dumps({"layers": {"3": STACK[3].tolist(),
                                                   "1": STACK[1].tolist()}}).encode(), [1, 3]),
    "gguf": (lambda: encode_gguf_control_vector({1: STACK[1], 2: STACK[2], 3: STACK[3]}),
             [1, 2, 3]),
}


def _fmt_of(case: str) -> str:
    return {"safetensors": "safetensors", "pt": "pt", "npy": "npy", "json": "json",
            "gguf": "gguf"}[case.split("_")[0]]


@pytest.mark.parametrize("case", sorted(SINGLE_CASES))
def test_single_round_trip(case, reg):
    data = SINGLE_CASES[case]()
    tol = 1e-3 if "f16" in case else 0
    for fmt in (None, _fmt_of(case)):
        out = decode(data, fmt)
        assert out.kind == "single" and out.per_layer is None
        assert out.source_format == _fmt_of(case)
        assert out.single.dtype == np.float32 and out.single.shape == (HIDDEN,)
        np.testing.assert_allclose(out.single, VEC, rtol=tol, atol=tol)
        assert not out.single.flags.writeable
    info = reg.put(case, data)
    assert info["kind"] == "single" and info["layers"] is None
    assert info["hidden_size"] == HIDDEN and info["source_format"] == _fmt_of(case)
    got = reg.get(case)
    np.testing.assert_array_equal(got.single, decode(data).single)
    np.testing.assert_array_equal(reg.lookup(case), got.single)


@pytest.mark.parametrize("case", sorted(PER_LAYER_CASES))
def test_per_layer_round_trip(case, reg):
    build, layers = PER_LAYER_CASES[case]
    data = build()
    for fmt in (None, _fmt_of(case)):
        out = decode(data, fmt)
        assert out.kind == "per_layer" and out.single is None
        assert list(out.per_layer) == layers
        for layer in layers:
            np.testing.assert_array_equal(out.per_layer[layer], STACK[layer])
            assert out.per_layer[layer].dtype == np.float32
    info = reg.put(case, data)
    assert info["kind"] == "per_layer" and info["layers"] == layers
    assert set(info["norms"]) == set(layers)
    assert info["norms"][layers[0]] == pytest.approx(float(np.linalg.norm(STACK[layers[0]])))
    found = reg.lookup(case)
    assert sorted(found) == layers
    for layer in layers:
        np.testing.assert_array_equal(found[layer], STACK[layer])


def test_exact_values_survive_registry(reg):
    """Bit-exact: odd float32 values (denormals, -0.0, large) come back unchanged."""
    vec = np.array([1e-45, -0.0, 1e29, -1e29, 1 / 3, np.pi, 1e-30, 7], dtype=np.float32)
    reg.put("exact", npy(vec))
    assert reg.get("exact").single.tobytes() == vec.tobytes()


@pytest.mark.parametrize(("data", "fmt"), [
    (b"GGUF\x03\0\0\0", "gguf"), (npy(VEC), "npy"), (pt(tensor(VEC)), "pt"),
    (pickle.dumps([1.0], protocol=2), "pt"), (st_save({"vector": VEC}), "safetensors"),
    (b"  [1, 2]", "json"), (b'\n{"vector": []}', "json"), (b"\xef\xbb\xbf[1]", "json"),
    (b"hello world", None), (b"", None),
])
def test_sniff(data, fmt):
    assert sniff_format(data) == fmt


def test_safetensors_with_header_length_starting_like_json():
    """An unpadded header of length 0x7b makes byte 0 '{': still read as safetensors."""
    header = json.dumps({"vector": {"dtype": "F32", "shape": [HIDDEN],
                                    "data_offsets": [0, 4 * HIDDEN]}})
    header = header.ljust(0x7B)
    data = struct.pack("<Q", len(header)) + header.encode() + VEC.tobytes()
    assert data[:1] == b"{"
    assert sniff_format(data) == "safetensors"
    np.testing.assert_array_equal(decode(data).single, VEC)


# --- GGUF ----------------------------------------------------------------------------

def test_gguf_encoder_layer_mapping_and_metadata():
    data = encode_gguf_control_vector({3: STACK[3], 1: STACK[1]}, arch="qwen2")
    meta, tensors = read_gguf(data)
    assert meta == {"general.architecture": "controlvector",
                    "controlvector.model_hint": "qwen2", "controlvector.layer_count": 2}
    assert list(tensors) == ["direction.1", "direction.3"]
    out = decode(data)
    assert list(out.per_layer) == [1, 3]  # direction.N -> resid_post layer N
    np.testing.assert_array_equal(out.per_layer[1], STACK[1])
    np.testing.assert_array_equal(out.per_layer[3], STACK[3])


def test_gguf_encoder_bytes_match_spec_layout():
    """Hand-check against ggml docs/gguf.md: header, KVs, tensor infos, 32-byte alignment."""
    vec = np.arange(HIDDEN, dtype=np.float32)
    data = encode_gguf_control_vector({2: vec}, arch="llama")
    expected = gguf_file(
        [kv("general.architecture", 8, gstr("controlvector")),
         kv("controlvector.model_hint", 8, gstr("llama")),
         kv("controlvector.layer_count", 4, struct.pack("<I", 1))],
        [("direction.2", vec, 0)])
    assert data == expected
    assert data[:4] == b"GGUF" and struct.unpack_from("<IQQ", data, 4) == (3, 1, 3)
    assert len(data) % 32 == 0
    data_start = len(data) - 32  # 8 floats = 32 bytes, already aligned
    assert data_start % 32 == 0
    assert np.frombuffer(data, "<f4", HIDDEN, data_start).tolist() == vec.tolist()
    # multiple tensors: each offset is a multiple of 32 even when the width is not
    odd = encode_gguf_control_vector({1: np.ones(5), 2: np.full(5, 2.0)}, allow_layer_zero=False)
    _, tensors = read_gguf(odd)
    assert tensors["direction.2"].tolist() == [2.0] * 5


def test_gguf_encoder_refuses_layer_zero_unless_asked():
    with pytest.raises(ValueError, match=r"direction\.0"):
        encode_gguf_control_vector({0: VEC, 1: VEC})
    data = encode_gguf_control_vector({0: VEC}, allow_layer_zero=True)
    assert list(decode(data).per_layer) == [0]
    with pytest.raises(ValueError):
        encode_gguf_control_vector({1: VEC, 2: VEC[:4]})
    with pytest.raises(ValueError):
        encode_gguf_control_vector({1: np.full(HIDDEN, np.nan)})


def test_gguf_extra_kv_types_v2_f16_and_alignment():
    kvs = [
        kv("general.architecture", 8, gstr("controlvector")),
        kv("general.alignment", 4, struct.pack("<I", 64)),
        kv("x.u8", 0, struct.pack("<B", 7)), kv("x.i8", 1, struct.pack("<b", -7)),
        kv("x.u16", 2, struct.pack("<H", 7)), kv("x.i16", 3, struct.pack("<h", -7)),
        kv("x.i32", 5, struct.pack("<i", -7)), kv("x.f32", 6, struct.pack("<f", 0.5)),
        kv("x.bool", 7, b"\x01"), kv("x.u64", 10, struct.pack("<Q", 2**40)),
        kv("x.i64", 11, struct.pack("<q", -(2**40))), kv("x.f64", 12, struct.pack("<d", 0.25)),
        kv("x.tags", 9, struct.pack("<IQ", 8, 2) + gstr("a") + gstr("bcd")),
        kv("x.ints", 9, struct.pack("<IQ", 4, 3) + struct.pack("<3I", 1, 2, 3)),
        kv("x.nested", 9, struct.pack("<IQ", 9, 2)
           + struct.pack("<IQ", 12, 1) + struct.pack("<d", 1.0)
           + struct.pack("<IQ", 8, 1) + gstr("z")),
        kv("x.empty", 9, struct.pack("<IQ", 10, 0)),
    ]
    data = gguf_file(kvs, [("direction.2", STACK[2], 1), ("direction.1", STACK[1], 0)],
                     version=2, alignment=64)
    meta, _ = read_gguf(data)
    assert meta["general.alignment"] == 64 and meta["x.bool"] == 1
    assert meta["x.u64"] == 2**40 and meta["x.i8"] == -7 and meta["x.f64"] == 0.25
    assert "x.tags" not in meta  # arrays are skipped
    out = decode(data)
    assert list(out.per_layer) == [1, 2]
    np.testing.assert_array_equal(out.per_layer[1], STACK[1])
    np.testing.assert_allclose(out.per_layer[2], STACK[2].astype(np.float16), rtol=0, atol=0)


def test_gguf_repeated_layer_index_is_summed_like_llama_cpp():
    data = gguf_file([], [("direction.1", STACK[1], 0), ("direction.01", STACK[2], 0)])
    np.testing.assert_allclose(decode(data).per_layer[1], STACK[1] + STACK[2], rtol=1e-6)


@pytest.mark.parametrize(("data", "match"), [
    (gguf_file([], [("direction.4", VEC, 0)]), "out of range"),
    (gguf_file([], [("direction.1", VEC[:4], 0)]), "width 8"),
    (gguf_file([], [("direction.1", np.full(HIDDEN, np.inf), 0)]), "finite"),
    (gguf_file([], [("blk.1.attn", VEC, 0)]), "direction.N"),
    (gguf_file([], [("direction.1", STACK[:2], 0)]), "1-D"),
    (gguf_file([], []), "no direction tensors"),
    (gguf_file([], [("direction.1", VEC, 0)], version=1), "version 1"),
    (b"GGUF" + struct.pack(">I", 3) + b"\0" * 16, "big-endian"),
    (gguf_file([kv("general.alignment", 4, struct.pack("<I", 24))], [("direction.1", VEC, 0)]),
     "power of two"),
    (gguf_file([kv("k", 99, b"")], []), "unknown metadata value type"),
])
def test_gguf_errors(data, match):
    with pytest.raises(VectorFormatError, match=match):
        decode(data)


def test_gguf_quantized_tensor_rejected():
    good = gguf_file([], [("direction.1", VEC, 0)])
    type_at = good.index(b"direction.1") + len("direction.1") + 4 + 8
    bad = good[:type_at] + struct.pack("<I", 2) + good[type_at + 4:]  # Q4_0
    with pytest.raises(VectorFormatError, match="ggml type 2"):
        decode(bad)


def test_gguf_every_truncation_is_a_clean_error():
    data = encode_gguf_control_vector({1: STACK[1], 2: STACK[2]})
    for cut in range(len(data)):
        with pytest.raises(VectorFormatError):
            decode(data[:cut], "gguf")


def test_gguf_huge_counts_do_not_allocate():
    data = b"GGUF" + struct.pack("<IQQ", 3, 2**62, 2**62)
    with pytest.raises(VectorFormatError, match="corrupt"):
        decode(data)
    arr = kv("x", 9, struct.pack("<IQ", 8, 2**60))
    with pytest.raises(VectorFormatError):
        decode(gguf_file([arr], []))


# --- validation errors -----------------------------------------------------------------

WIDE = np.ones(HIDDEN + 1, dtype=np.float32)


@pytest.mark.parametrize("data", [
    st_save({"vector": WIDE}), npy(WIDE), json.dumps(WIDE.tolist()).encode(),
    pt(tensor(WIDE)), st_save({"layer.1": WIDE}), json.dumps({"layers": {"1": [1.0]}}).encode(),
], ids=["safetensors", "npy", "json", "pt", "safetensors_layer", "json_layer"])
def test_wrong_width(data):
    with pytest.raises(VectorFormatError, match=f"width {HIDDEN}"):
        decode(data)


@pytest.mark.parametrize("data", [
    npy(np.where(np.arange(HIDDEN) == 3, np.nan, 1.0)),
    npy(np.where(np.arange(HIDDEN) == 3, -np.inf, 1.0)),
    npy(np.full(HIDDEN, 1e39)),  # finite in float64, inf in float32
    b"[" + b", ".join([b"1"] * (HIDDEN - 1) + [b"NaN"]) + b"]",
    b"[" + b", ".join([b"1"] * (HIDDEN - 1) + [b"1e400"]) + b"]",
    st_save({"layer.1": np.full(HIDDEN, np.nan, dtype=np.float32)}),
    pt(tensor(np.full(HIDDEN, np.inf, dtype=np.float32))),
], ids=["nan", "inf", "f32_overflow", "json_nan", "json_overflow", "safetensors", "pt"])
def test_non_finite(data):
    with pytest.raises(VectorFormatError, match="finite"):
        decode(data)


@pytest.mark.parametrize(("data", "match"), [
    (json.dumps({"layers": {"4": VEC.tolist()}}).encode(), "out of range"),
    (json.dumps({"layers": {"-1": VEC.tolist()}}).encode(), "not a layer number"),
    (json.dumps({"layers": {"x": VEC.tolist()}}).encode(), "not a layer number"),
    (st_save({"layer.9": VEC}), "out of range"),
    (pt({"layer.4": tensor(VEC)}), "out of range"),
    (npy(np.full(HIDDEN, 3e38, dtype=np.float32)), "beyond 1e\\+30"),
    (npy(STACK[:3]), "one row per layer"),
    (json.dumps([r.tolist() for r in STACK[:3]]).encode(), "exactly 4 entries"),
    (npy(np.ones((LAYERS, HIDDEN, 1))), "expected shape"),
    (st_save({"a": VEC, "b": VEC}), "named by layer"),
    (st_save({"layer.1": VEC, "layers.01": VEC}), "more than once"),
    (json.dumps([True] * HIDDEN).encode(), "list of numbers"),
    (json.dumps(["1"] * HIDDEN).encode(), "list of numbers"),
    (json.dumps({"vector": VEC.tolist(), "extra": 1}).encode(), "found keys"),
    (json.dumps([None] * LAYERS).encode(), "no layer vectors"),
    (json.dumps("x").encode(), None),
    (b"[1, 2", "not valid JSON"),
    (npy(np.array(["a"] * HIDDEN)), "expected numbers"),
    (b"\x00\x01garbage bytes that are nothing", "unrecognised"),
    (b"", "empty"),
    (st_save({"vector": VEC})[:-3], "safetensors"),
    (npy(VEC)[:-3], ".npy"),
    (pt(tensor(VEC))[:-20], ".pt"),
    (pt({"nested": {"x": tensor(VEC)}}), "expected a tensor"),
    (pt([1, 2]), "exactly 4 entries"),
])
def test_bad_payloads(data, match):
    with pytest.raises(VectorFormatError, match=match):
        decode(data)


def test_bad_format_name_and_forced_format():
    with pytest.raises(VectorFormatError, match="unknown vector format"):
        decode(npy(VEC), "pickle")
    with pytest.raises(VectorFormatError):
        decode(npy(VEC), "json")
    np.testing.assert_array_equal(decode(pt(tensor(VEC)), ".pth").single, VEC)


_SIDE_EFFECTS: list[str] = []


def _side_effect(*args: object) -> None:
    _SIDE_EFFECTS.append("ran")


class _Evil:
    def __reduce__(self):
        return (_side_effect, ("pwned",))


@pytest.mark.parametrize("payload", [
    lambda: pt({"layer.1": _Evil()}),
    lambda: pt(_Evil(), legacy=True),
    lambda: pickle.dumps(_Evil(), protocol=2),
    lambda: pickle.dumps({"layer.1": _Evil()}, protocol=5),
], ids=["zip", "legacy", "raw_pickle2", "raw_pickle5"])
@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_pickle_payload_never_runs(payload, reg):
    data = payload()
    _SIDE_EFFECTS.clear()
    with pytest.raises(VectorFormatError, match="never unpickled"):
        decode(data)
    with pytest.raises(VectorFormatError):
        reg.put("evil", data)
    assert _SIDE_EFFECTS == []
    assert reg.count() == 0


def test_npy_object_array_refused():
    buf = io.BytesIO()
    np.save(buf, np.array([_Evil()], dtype=object), allow_pickle=True)
    _SIDE_EFFECTS.clear()
    with pytest.raises(VectorFormatError, match=r"\.npy: could not load"):
        decode(buf.getvalue())
    assert _SIDE_EFFECTS == []


def test_too_large(monkeypatch, reg):
    monkeypatch.setattr(formats, "MAX_VECTOR_BYTES", 64)
    with pytest.raises(VectorTooLargeError, match="limit is 64"):
        decode(npy(VEC))
    with pytest.raises(VectorTooLargeError):
        reg.put("big", npy(VEC))


# --- registry ------------------------------------------------------------------------

HOSTILE = ["", ".", "..", "../x", "x/../../y", "/etc/passwd", "a/b", "a\\b", "a\0b", "x" * 65,
           ".hidden", "-x", "_x", "x.tmp", "name\n", " x", "ｘ", "x:y", "x y", "~root", 3, None]


@pytest.mark.parametrize("name", HOSTILE, ids=[repr(n) for n in HOSTILE])
def test_hostile_names(name, reg, tmp_path):
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(VectorNameError):
        reg.put(name, npy(VEC))
    for op in (reg.get, reg.info, reg.delete, reg.path):
        with pytest.raises(VectorNameError):
            op(name)
    with pytest.raises(KeyError):
        reg.lookup(name)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert os.listdir(reg.root) == []


def test_valid_names(reg):
    for name in ("a", "A.b-c_d", "0", "x" * 64, "v1.2.safetensors", "a..b"):
        reg.put(name, npy(VEC))
        assert reg.path(name).parent == reg.root
    assert reg.count() == 6


def test_list_count_delete(reg):
    assert reg.list() == [] and reg.count() == 0
    reg.put("zeta", npy(VEC))
    reg.put("alpha", npy(STACK))
    reg.put("mid", json.dumps({"layers": {"2": VEC.tolist()}}).encode())
    (reg.root / "notes.txt").write_text("ignored")
    (reg.root / ".half.abc.tmp").write_bytes(b"partial")
    assert [e["name"] for e in reg.list()] == ["alpha", "mid", "zeta"]
    assert reg.count() == 3
    info = reg.info("zeta")
    assert set(info) >= {"name", "kind", "layers", "hidden_size", "source_format", "created",
                         "bytes", "norm", "norms", "sha256", "error"}
    assert info["norm"] == pytest.approx(float(np.linalg.norm(VEC)), rel=1e-6)
    assert info["norms"] is None and info["error"] is None
    assert info["bytes"] == os.path.getsize(reg.path("zeta"))
    assert abs(info["created"] - time.time()) < 60
    assert reg.delete("mid") is True
    assert reg.delete("mid") is False
    assert reg.count() == 2
    with pytest.raises(VectorNotFoundError):
        reg.get("mid")
    with pytest.raises(KeyError, match="unknown vector name 'mid'"):
        reg.lookup("mid")


def test_put_replaces_and_every_process_sees_it(tmp_path):
    """Two registries on one directory stand in for two server processes."""
    a = VectorRegistry(tmp_path, hidden_size=HIDDEN, num_layers=LAYERS)
    b = VectorRegistry(tmp_path, hidden_size=HIDDEN, num_layers=LAYERS)
    a.put("v", npy(VEC))
    np.testing.assert_array_equal(b.lookup("v"), VEC)
    for i in range(5):  # rapid same-size replacements: the cache must never go stale
        a.put("v", npy(VEC + i))
        np.testing.assert_array_equal(b.lookup("v"), VEC + i)
    a.put("v", npy(STACK))
    assert sorted(b.lookup("v")) == [0, 1, 2, 3]
    assert a.delete("v")
    with pytest.raises(KeyError):
        b.lookup("v")


def test_cache_reuses_unchanged_file(reg):
    reg.put("v", npy(VEC))
    assert reg.get("v") is reg.get("v")


def test_other_width_is_an_error_not_silently_used(tmp_path):
    small = VectorRegistry(tmp_path, hidden_size=HIDDEN, num_layers=LAYERS)
    big = VectorRegistry(tmp_path, hidden_size=HIDDEN * 2, num_layers=LAYERS * 2)
    small.put("honesty", npy(VEC))
    big.put("deep", json.dumps({"layers": {"6": [0.5] * (HIDDEN * 2)}}).encode())
    with pytest.raises(VectorRegistryError, match=r"width 8, but no hook .* 16 \(the hidden"):
        big.get("honesty")
    with pytest.raises(SteeringSpecError, match="width 8"):
        big.lookup("honesty")
    with pytest.raises(SteeringSpecError,  # a 400, not a 500
                       match=r"'deep' has width 16, but no hook this model steers"):
        parse_steering_spec({"vectors": [{"layer": 0, "vector": {"name": "deep"}}]},
                            num_layers=LAYERS, hidden_size=HIDDEN, lookup=small.lookup)
    assert issubclass(VectorRegistryError, VectorFormatError)
    listed = {e["name"]: e for e in big.list()}
    assert listed["honesty"]["error"] and listed["honesty"]["hidden_size"] == HIDDEN
    assert listed["deep"]["error"] is None
    # same width, more layers than this model has
    wide = VectorRegistry(tmp_path, hidden_size=HIDDEN, num_layers=LAYERS * 2)
    wide.put("late", json.dumps({"layers": {"6": VEC.tolist()}}).encode())
    with pytest.raises(VectorRegistryError, match="has 4 layers"):
        small.get("late")


def test_damaged_or_foreign_file_reported(reg):
    reg.root.joinpath("junk.safetensors").write_bytes(b"\x05\0\0\0\0\0\0\0{oops")
    reg.root.joinpath("foreign.safetensors").write_bytes(st_save({"weight": VEC}))
    with pytest.raises(VectorRegistryError, match="unreadable"):
        reg.get("junk")
    with pytest.raises(SteeringSpecError, match="unexpected tensor"):
        reg.lookup("foreign")
    assert all(e["error"] for e in reg.list())


def test_atomic_write_leaves_no_temp_files(reg, monkeypatch):
    reg.put("v", npy(VEC))
    assert sorted(os.listdir(reg.root)) == [".content", "v.safetensors"]
    kept = os.listdir(reg.root / ".content")  # the entry's content, by its sha256
    assert len(kept) == 1

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        reg.put("v", npy(STACK))
    with pytest.raises(OSError, match="disk full"):
        reg.put("w", npy(VEC))
    assert sorted(os.listdir(reg.root)) == [".content", "v.safetensors"]
    assert os.listdir(reg.root / ".content") == kept
    np.testing.assert_array_equal(reg.lookup("v"), VEC)


def test_stale_temp_files_are_cleaned(tmp_path):
    old, young = tmp_path / ".v.1.tmp", tmp_path / ".w.2.tmp"
    old.write_bytes(b"x")
    young.write_bytes(b"x")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    VectorRegistry(tmp_path, hidden_size=HIDDEN, num_layers=LAYERS)
    assert not old.exists() and young.exists()


def test_returned_vectors_are_read_only(reg):
    reg.put("v", npy(STACK))
    found = reg.lookup("v")
    with pytest.raises((TypeError, ValueError)):
        found[0][0] = 1.0
    with pytest.raises(TypeError):
        found[9] = VEC  # type: ignore[index]


# --- with the steering spec ------------------------------------------------------------

def test_lookup_single_vector_with_layer(reg):
    reg.put("honesty", npy(VEC))
    spec = parse_steering_spec(
        {"vectors": [{"layers": "1-2", "vector": {"name": "honesty"}, "scale": 2.0}]},
        num_layers=LAYERS, hidden_size=HIDDEN, lookup=reg.lookup)
    assert [op.layer for op in spec.ops] == [1, 2]
    for op in spec.ops:
        assert op.hook == "resid_post" and op.scale == 2.0
        np.testing.assert_array_equal(op.vector, VEC)
    with pytest.raises(SteeringSpecError, match="layer"):  # a single vector needs layer(s)
        parse_steering_spec({"vectors": [{"vector": {"name": "honesty"}}]},
                            num_layers=LAYERS, hidden_size=HIDDEN, lookup=reg.lookup)


def test_lookup_per_layer_vector_without_layers(reg):
    reg.put("cv", encode_gguf_control_vector({1: STACK[1], 3: STACK[3]}))
    spec = parse_steering_spec({"vectors": [{"vector": {"name": "cv"}, "scale": -1.5}]},
                               num_layers=LAYERS, hidden_size=HIDDEN, lookup=reg.lookup)
    assert [op.layer for op in spec.ops] == [1, 3]
    for op in spec.ops:
        assert op.hook == "resid_post" and op.scale == -1.5
        np.testing.assert_array_equal(op.vector, STACK[op.layer])
    # explicit layers pick a subset; a layer the entry lacks is a field error
    spec = parse_steering_spec({"vectors": [{"layer": 3, "vector": {"name": "cv"}}]},
                               num_layers=LAYERS, hidden_size=HIDDEN, lookup=reg.lookup)
    assert [op.layer for op in spec.ops] == [3]
    np.testing.assert_array_equal(spec.ops[0].vector, STACK[3])
    with pytest.raises(SteeringSpecError, match="no entry for layer"):
        parse_steering_spec({"vectors": [{"layer": 2, "vector": {"name": "cv"}}]},
                            num_layers=LAYERS, hidden_size=HIDDEN, lookup=reg.lookup)


def test_lookup_unknown_and_hostile_names_are_field_errors(reg):
    for name in ("missing", "../etc/passwd"):
        with pytest.raises(SteeringSpecError, match="unknown vector name") as err:
            parse_steering_spec({"vectors": [{"layer": 0, "vector": {"name": name}}]},
                                num_layers=LAYERS, hidden_size=HIDDEN, lookup=reg.lookup)
        assert err.value.field == "steering.vectors[0].vector.name"


@pytest.mark.parametrize(("chunks", "declared", "want"), [
    ([b"ab", b"cd"], None, b"abcd"),
    ([b"ab", b"cd"], 4, b"abcd"),
    ([b"abc", b"de"], None, None),  # streamed (no length): stops past the limit
    ([b"a"], 99, None),  # the declared length alone refuses it, unread
])
def test_vector_uploads_are_read_up_to_the_limit(chunks, declared, want):
    """An upload over the limit is refused without holding it whole (server/routes.py)."""
    import asyncio

    from starlette.requests import Request

    from capsteer.server.routes import _body_up_to

    sent: list[bytes] = []

    async def receive() -> dict:
        chunk = chunks[len(sent)]
        sent.append(chunk)
        return {"type": "http.request", "body": chunk, "more_body": len(sent) < len(chunks)}

    headers = [] if declared is None else [(b"content-length", str(declared).encode())]
    request = Request({"type": "http", "method": "PUT", "headers": headers}, receive)
    assert asyncio.run(_body_up_to(request, 4)) == want
    if declared == 99:
        assert sent == []
