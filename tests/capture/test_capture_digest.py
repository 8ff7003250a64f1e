"""File digests (issue 12): the algorithm is named per file in the manifest, sha256
entries keep their original form, and both verify; hashing overlaps the writes.

Old manifests are rebuilt here by hand from the files with hashlib, in the only form
capsteer wrote before the choice existed (`{"name", "bytes", "sha256"}`), so they do
not depend on the writer under test."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import blake3
import numpy as np
import pytest
import torch
from capture_helpers import feed, make_request, make_spec

from capsteer.capture import CaptureWriter, CorruptCapture, read
from capsteer.capture.cli import main as cli_main
from capsteer.capture.digests import DIGESTS, DigestError, digest_fields, entry_digest
from capsteer.capture.publish import AtomicFile
from capsteer.capture.published import file_digest, verify_files
from capsteer.capture.sharded import INDEX_FILE, read_sharded
from capsteer.capture.writer.sharded import ShardedWriter

KEYS = [("resid_post", 0), ("resid_mid", 2)]
H = 8
OLD_ENTRY_KEYS = {"name", "bytes", "sha256"}


def _independent(path: Path, digest: str) -> str:
    """The file's digest computed without capsteer's code."""
    data = path.read_bytes()
    return hashlib.sha256(data).hexdigest() if digest == "sha256" else blake3.blake3(data).hexdigest()


def _captures(root: Path, digest: str) -> list[Path]:
    """One packed and one per_file capture written with `digest`."""
    w = CaptureWriter(root, digest=digest)
    dirs = []
    for i, layout in enumerate(["packed", "per_file"]):
        spec = make_spec(layers=[0, 1], layout=layout, tag=digest)
        cid = f"{digest}-{layout}"
        end, _ = feed(w, make_request(cid, spec, 6 + i, hidden=H), 3)
        w.close(end)
        receipt = w.future(cid).result(10)
        assert receipt.status == "ok", receipt.error
        dirs.append(root / receipt.dir)
    w.shutdown()
    return dirs


def _job(d: Path, digest: str, n: int = 8, **kw: object) -> ShardedWriter:
    w = ShardedWriter(d, keys=KEYS, hidden_size=H, dtype=torch.bfloat16, shard_bytes=200,
                      digest=digest, **kw)
    for i in range(n):
        k = 3 + i % 4
        g = torch.Generator().manual_seed(i)
        tensors = {key: torch.randn(k, H, generator=g).to(torch.bfloat16) for key in KEYS}
        w.add(f"r{i}", np.arange(k), np.arange(100 + i, 100 + i + k), tensors, prompt_tokens=k)
    return w


def _manifest(d: Path) -> dict:
    return json.loads((d / "manifest.json").read_text())


def _rewrite_as_old(d: Path) -> None:
    """Rewrite a manifest the way capsteer wrote it before digests were named."""
    m = _manifest(d)
    old = [{"name": e["name"], "bytes": e["bytes"], "sha256": _independent(d / e["name"], "sha256")}
           for e in m["files"]]
    m["files"] = old
    if "shards" in m:
        extra = {s["name"]: {"rows": s["rows"], "requests": s["requests"]} for s in m["shards"]}
        m["shards"] = [{**e, **extra[e["name"]]} for e in old]
    (d / "manifest.json").write_text(json.dumps(m))


def _flip(path: Path, offset: int = -5) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


# ------------------------------------------------------------------ the format
def test_sha256_default_keeps_the_old_entry_form(root):
    for d in _captures(root, "sha256"):
        files = _manifest(d)["files"]
        assert files and all(set(e) == OLD_ENTRY_KEYS for e in files)
        for e in files:
            assert e["sha256"] == _independent(d / e["name"], "sha256")
    job = root / "job"
    _job(job, "sha256").close()
    m = _manifest(job)
    assert all(set(e) == OLD_ENTRY_KEYS for e in m["files"])
    assert all(set(s) == OLD_ENTRY_KEYS | {"rows", "requests"} for s in m["shards"])


def test_blake3_entries_name_their_algorithm(root):
    for d in _captures(root, "blake3"):
        files = _manifest(d)["files"]
        assert files
        for e in files:
            assert set(e) == {"name", "bytes", "digest", "blake3"} and e["digest"] == "blake3"
            assert e["blake3"] == _independent(d / e["name"], "blake3")
        cap = read(d)  # verifies
        assert cap.keys() == [("resid_post", 0), ("resid_post", 1)]
    _job(root / "job", "blake3").close()
    m = _manifest(root / "job")
    assert len(m["shards"]) >= 3
    for s, e in zip(m["shards"], m["files"], strict=True):
        assert e == {"name": s["name"], "bytes": s["bytes"], "digest": "blake3", "blake3": s["blake3"]}
        assert e["blake3"] == _independent(root / "job" / e["name"], "blake3")
    assert read_sharded(root / "job").ids() == [f"r{i}" for i in range(8)]


def test_digest_fields_and_entry_digest_round_trip():
    assert digest_fields("sha256", "ab") == {"sha256": "ab"}
    assert digest_fields("blake3", "cd") == {"digest": "blake3", "blake3": "cd"}
    assert entry_digest({"name": "f", "sha256": "ab"}) == ("sha256", "ab")
    assert entry_digest({"name": "f", "digest": "blake3", "blake3": "cd"}) == ("blake3", "cd")
    with pytest.raises(DigestError, match="unknown digest 'md5'"):
        digest_fields("md5", "00")


# --------------------------------------------------------- old manifests verify
def test_old_sha256_manifests_verify_packed_per_file_and_sharded(root):
    dirs = _captures(root, "blake3")  # written fast, then described the old way
    _job(root / "job", "blake3").close()
    for d in [*dirs, root / "job"]:
        _rewrite_as_old(d)
        assert all(set(e) == OLD_ENTRY_KEYS for e in _manifest(d)["files"])
        assert verify_files(d, _manifest(d)) == []
    assert read(dirs[0]).tensor("resid_post", 1).shape == (8, H)  # 6 prompt + 3 - 1 fed
    assert read(dirs[1]).tensor("resid_post", 0).shape == (9, H)
    assert read(root / "job").ids() == [f"r{i}" for i in range(8)]
    assert cli_main(["verify", str(root)]) == 0


# ------------------------------------------------------------ corruption, CLI
@pytest.mark.parametrize("digest", DIGESTS)
def test_a_flipped_byte_is_detected(root, digest, capsys):
    packed, per_file = _captures(root, digest)
    _job(root / "job", digest).close()
    assert cli_main(["verify", str(root)]) == 0
    assert f"3 manifest(s), 0 corrupt; {digest} verified" in capsys.readouterr().out
    victims = [packed / "activations.safetensors", per_file / "resid_post.1.safetensors",
               root / "job" / "shard-00001.safetensors"]
    for victim in victims:
        _flip(victim)  # same size: only the digest can tell
    for d in (packed, per_file):
        with pytest.raises(CorruptCapture, match=f"{digest} .* does not match manifest"):
            read(d)
    with pytest.raises(CorruptCapture, match=f"shard-00001.safetensors: {digest} "):
        read(root / "job")
    assert cli_main(["verify", str(root)]) == 1
    out = capsys.readouterr().out
    assert "3 manifest(s), 3 corrupt" in out
    assert out.count(f"CORRUPT {victims[0].name}: {digest}") == 1


def test_cli_verifies_a_tree_mixing_old_and_new_manifests(root, capsys):
    old = _captures(root, "sha256")
    new = _captures(root, "blake3")
    _rewrite_as_old(old[0])
    assert cli_main(["verify", str(root)]) == 0
    out = capsys.readouterr().out
    assert "4 manifest(s), 0 corrupt; blake3/sha256 verified" in out
    _flip(new[1] / "resid_post.0.safetensors", 100)
    assert cli_main(["verify", str(root)]) == 1
    assert "CORRUPT resid_post.0.safetensors: blake3" in capsys.readouterr().out


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"digest": "md5", "md5": "00"}, "cannot verify: unknown digest 'md5'"),
        ({"digest": "blake3"}, "manifest records no blake3 value"),
        ({"digest": ["blake3"]}, "cannot verify: unknown digest"),
    ],
)
def test_an_unknown_or_missing_digest_is_an_error_never_a_pass(root, edit, message, capsys):
    packed, _ = _captures(root, "sha256")
    m = _manifest(packed)
    m["files"][0].update(edit)
    (packed / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(CorruptCapture, match=message.replace("'", ".")):
        read(packed)
    assert cli_main(["verify", str(packed)]) == 1
    assert message in capsys.readouterr().out


def test_old_entry_without_its_sha256_is_an_error(root):
    packed, _ = _captures(root, "sha256")
    m = _manifest(packed)
    del m["files"][0]["sha256"]
    (packed / "manifest.json").write_text(json.dumps(m))
    assert verify_files(packed, m) == ["activations.safetensors: manifest records no sha256 value"]


# ------------------------------------------------------------ sharded recovery
@pytest.mark.parametrize("first, second", [("blake3", "blake3"), ("sha256", "blake3"), ("blake3", "sha256")])
def test_recovery_rebuilds_the_manifest_with_the_configured_digest(tmp_path, first, second):
    d = tmp_path / "job"
    w = _job(d, first, n=8)
    w.flush()
    m = _manifest(d)
    n_shards = len(m["shards"])
    assert n_shards >= 3
    # A crash between the index append and the manifest rewrite (the last shard is
    # indexed but unlisted), a torn index line and a temp file of a dead writer.
    lagging = {**m, "shards": m["shards"][:-1], "files": m["files"][:-1]}
    (d / "manifest.json").write_text(json.dumps(lagging))
    with open(d / INDEX_FILE, "a") as fh:
        fh.write('{"id": "r99", "sh')
    (d / ".shard-00009.safetensors.999999999.deadbeef.capsteer-tmp").write_bytes(b"torn")
    w2 = ShardedWriter(d, keys=KEYS, hidden_size=H, dtype=torch.bfloat16, shard_bytes=200,
                       digest=second)
    rebuilt = _manifest(d)
    assert [s["name"] for s in rebuilt["shards"]] == [s["name"] for s in m["shards"]]
    assert rebuilt["shards"][:-1] == m["shards"][:-1]  # listed entries keep their digest
    last = rebuilt["shards"][-1]
    assert entry_digest(last)[0] == second
    assert entry_digest(last)[1] == _independent(d / last["name"], second)
    assert last["rows"] == m["shards"][-1]["rows"]
    for i in range(8, 12):  # the resumed job goes on with its own digest
        k = 3
        w2.add(f"r{i}", np.arange(k), np.arange(k), {key: torch.ones(k, H, dtype=torch.bfloat16)
                                                     for key in KEYS}, k)
    w2.close()
    final = _manifest(d)
    assert {entry_digest(s)[0] for s in final["shards"][n_shards:]} == {second}
    assert {entry_digest(s)[0] for s in final["shards"][: n_shards - 1]} == {first}
    job = read_sharded(d)  # verifies every shard with the digest its entry names
    assert job.ids() == [f"r{i}" for i in range(12)]
    assert not [p for p in os.listdir(d) if p.startswith(".")]
    assert cli_main(["verify", str(d)]) == 0


# ----------------------------------------------------- AtomicFile and overlap
@pytest.mark.parametrize("digest", DIGESTS)
def test_overlapped_hash_is_the_hash_of_the_bytes_written(tmp_path, digest):
    """Small (buffered), mid (hashed on the digest thread) and large (written through)
    pieces; the caller reuses its buffer as soon as write returns."""
    rng = np.random.default_rng(0)
    sizes = [7, 300 << 10, 3, (1 << 20) + 5, 64 << 10, 2 << 20, 1, 900 << 10, 900 << 10]
    f = AtomicFile(tmp_path, "data.bin", digest=digest)
    buf = bytearray(max(sizes))
    expected = bytearray()
    for n in sizes:
        piece = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        buf[:n] = piece
        f.write(memoryview(buf)[:n])
        buf[:n] = b"\xff" * n  # reused at once: the digest must not see this
        expected += piece
    f.commit()
    on_disk = (tmp_path / "data.bin").read_bytes()
    assert on_disk == bytes(expected) and f.size == len(expected)
    assert f.hexdigest == _independent(tmp_path / "data.bin", digest)
    assert f.entry() == {"name": "data.bin", "bytes": len(expected), **digest_fields(digest, f.hexdigest)}
    assert file_digest(tmp_path / "data.bin", digest) == f.hexdigest


def test_a_slow_hash_still_sees_the_callers_bytes(tmp_path, monkeypatch):
    """The hash of a large piece runs on a digest thread; write() returns only once it
    is done with the caller's buffer (a slow hasher makes a missing wait show)."""
    import time

    from capsteer.capture import publish

    class Slow:
        def __init__(self) -> None:
            self.h = hashlib.sha256()

        def update(self, data: memoryview) -> None:
            time.sleep(0.05)
            self.h.update(data)

        def hexdigest(self) -> str:
            return self.h.hexdigest()

    monkeypatch.setattr(publish, "new_hasher", lambda name: Slow())
    f = AtomicFile(tmp_path, "slow.bin", digest="sha256")
    buf = bytearray(b"\x01" * (2 << 20))
    f.write(buf)
    buf[:] = b"\x02" * len(buf)
    f.write(b"tail" * (100 << 10))  # buffered, hashed during the commit's fsync
    f.commit()
    assert f.sha256 == _independent(tmp_path / "slow.bin", "sha256")


def test_sha256_property_refuses_another_digest(tmp_path):
    f = AtomicFile(tmp_path, "x.bin", digest="blake3")
    f.write(b"abc")
    f.commit()
    assert f.hexdigest == blake3.blake3(b"abc").hexdigest()
    with pytest.raises(DigestError, match="blake3, not sha256"):
        _ = f.sha256


def test_discard_after_a_failed_write_leaves_nothing(tmp_path):
    from capsteer.capture.publish import FileSystem

    class Full(FileSystem):
        def write(self, fd: int, data: memoryview) -> int:
            raise OSError(28, "injected: no space")

    f = AtomicFile(tmp_path, "x.bin", Full(), digest="sha256")
    with pytest.raises(OSError, match="no space"):
        f.write(bytes(2 << 20))
    f.discard()
    assert os.listdir(tmp_path) == []


def test_writers_refuse_an_unknown_digest(tmp_path):
    with pytest.raises(DigestError, match="unknown digest 'md5'"):
        CaptureWriter(tmp_path / "caps", digest="md5")
    with pytest.raises(DigestError, match="unknown digest 'crc'"):
        ShardedWriter(tmp_path / "job", keys=KEYS, hidden_size=H, dtype=torch.bfloat16, digest="crc")
    assert not (tmp_path / "job").exists()


# ------------------------------------------------------------------- extract
def test_extract_flag_job_config_and_the_recorded_digest_check(tmp_path):
    from capsteer.extract import _check_digest, build_parser, job_config

    parser = build_parser()
    args = parser.parse_args(["m", "--input", "i", "--output", "o", "--digest", "blake3"])
    assert args.digest == "blake3"
    assert parser.parse_args(["m", "--input", "i", "--output", "o"]).digest == "sha256"
    with pytest.raises(SystemExit):
        parser.parse_args(["m", "--input", "i", "--output", "o", "--digest", "md5"])
    spec = make_spec(layers=[0])
    assert job_config(tmp_path, spec, 1 << 20, {}, digest="blake3")["sharded"]["digest"] == "blake3"
    d = tmp_path / "job"
    _job(d, "sha256", n=4).close()
    before = {p.name for p in d.glob("shard-*")}
    _check_digest(d, "sha256", set())  # what was asked
    _check_digest(d, "blake3", before)  # nothing new this run
    with pytest.raises(RuntimeError, match=r"digest blake3 was asked for.*shard-00000\.safetensors: sha256"):
        _check_digest(d, "blake3", set())
