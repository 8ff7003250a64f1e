"""Direct I/O (`capture_io: direct`, AtomicFile(direct=True)): data files reach the disk
through O_DIRECT from an aligned staging block, the tail padded and the file cut back to
its size. The bytes, sizes and digests must be exactly the buffered path's; a filesystem
that refuses O_DIRECT gets the buffered path; a failed write publishes nothing."""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from capture_helpers import feed, make_request, make_spec, temp_files

from capsteer.capture import CaptureWriter, read
from capsteer.capture import publish as publish_mod
from capsteer.capture.cli import main as cli_main
from capsteer.capture.publish import AtomicFile, FileSystem
from capsteer.capture.writer.process import ProcessCaptureWriter

STAGE = publish_mod._DIRECT_STAGE
ALIGN = publish_mod._DIRECT_ALIGN


def _direct_ok(directory: Path) -> bool:
    probe = directory / ".probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    except (OSError, AttributeError):
        return False
    os.close(fd)
    probe.unlink()
    return True


@pytest.fixture
def direct_dir(tmp_path: Path) -> Path:
    if not _direct_ok(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT")
    return tmp_path


class Recording(FileSystem):
    def __init__(self, fail_on: int | None = None) -> None:
        self.writes: list[int] = []
        self.fail_on = fail_on

    def write(self, fd: int, data: memoryview) -> int:
        if self.fail_on is not None and len(self.writes) == self.fail_on:
            raise OSError(errno.EIO, "injected")
        n = super().write(fd, data)
        self.writes.append(n)
        return n


@pytest.mark.parametrize("size", [0, 1, ALIGN - 1, ALIGN, ALIGN + 1, STAGE - 1, STAGE,
                                  STAGE + 5, 2 * STAGE + 3 * ALIGN + 77])
def test_bytes_size_and_digest_are_the_buffered_paths(direct_dir, size):
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    a, b = min(100, size), max(min(100, size), size // 2)
    fs = Recording()
    f = AtomicFile(direct_dir, "d.bin", fs, digest="sha256", direct=True)
    assert f.direct
    f.write(data[:a])  # small: through the write buffer
    f.write_pieces([memoryview(data)[a:b], memoryview(data)[b:]])  # large: batched
    f.commit()
    assert (direct_dir / "d.bin").read_bytes() == data
    assert f.size == os.path.getsize(direct_dir / "d.bin") == size
    assert f.hexdigest == hashlib.sha256(data).hexdigest()
    assert all(n % ALIGN == 0 for n in fs.writes)  # every write aligned, the tail padded
    assert sum(fs.writes) == -(-size // ALIGN) * ALIGN
    assert temp_files(direct_dir) == []


def test_a_filesystem_refusing_o_direct_gets_the_buffered_path(tmp_path, monkeypatch, caplog):
    """Such filesystems answer F_SETFL with O_DIRECT by EINVAL (tmpfs before Linux 6.6);
    fcntl is made to answer so, as this host's filesystems accept O_DIRECT."""
    real_fcntl = publish_mod.fcntl.fcntl

    def refusing(fd, cmd, arg=0):
        if cmd == publish_mod.fcntl.F_SETFL and arg & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_fcntl(fd, cmd, arg)

    monkeypatch.setattr(publish_mod.fcntl, "fcntl", refusing)
    monkeypatch.setattr(publish_mod, "_DIRECT_REFUSED_LOGGED", False)
    with caplog.at_level("WARNING", logger="capsteer.capture.publish"):
        f = AtomicFile(tmp_path, "x.bin", digest="sha256", direct=True)
        AtomicFile(tmp_path, "w.bin", digest="sha256", direct=True).discard()
    assert not f.direct
    warned = [r for r in caplog.records if "refuses O_DIRECT" in r.getMessage()]
    assert len(warned) == 1  # once a process, not once a file
    f.write_pieces([b"abc" * 1000, os.urandom(3 << 20)])
    f.commit()
    data = (tmp_path / "x.bin").read_bytes()
    assert data[:3000] == b"abc" * 1000 and len(data) == 3000 + (3 << 20)
    assert f.hexdigest == hashlib.sha256(data).hexdigest()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.bin"]


def test_direct_is_really_on_the_descriptor(direct_dir):
    f = AtomicFile(direct_dir, "y.bin", direct=True)
    try:
        assert f._fd is not None and f.direct
        assert publish_mod.fcntl.fcntl(f._fd, publish_mod.fcntl.F_GETFL) & os.O_DIRECT
    finally:
        f.discard()
    plain = AtomicFile(direct_dir, "z.bin")
    try:
        assert not plain.direct and plain._fd is not None
        assert not publish_mod.fcntl.fcntl(plain._fd, publish_mod.fcntl.F_GETFL) & os.O_DIRECT
    finally:
        plain.discard()


def test_a_failed_direct_write_publishes_nothing(direct_dir):
    f = AtomicFile(direct_dir, "x.bin", Recording(fail_on=1), direct=True)
    with pytest.raises(OSError, match="injected"):
        f.write_pieces([os.urandom(STAGE), os.urandom(STAGE)])  # the second block fails
        f.commit()
    f.discard()
    assert not (direct_dir / "x.bin").exists()
    assert list(direct_dir.iterdir()) == []


@pytest.mark.parametrize("layout", ["packed", "per_file"])
def test_a_direct_capture_is_the_buffered_capture_byte_for_byte(direct_dir, layout, capsys):
    """The same rows through CaptureWriter(direct_io=True) and the buffered writer: the
    data files are identical, the capture reads back (digest verified) and `capsteer
    verify` passes; and likewise through a writer process (the engine's path)."""
    spec = make_spec(hooks={"resid_post": "all", "resid_mid": [0, -1]}, layout=layout)
    cid = f"direct-{layout}"
    req = make_request(cid, spec, 40, hidden=96, dtype=torch.bfloat16)
    roots = {name: direct_dir / name for name in ("buffered", "direct", "process")}
    refs = None
    for name in ("buffered", "direct"):
        with CaptureWriter(roots[name], workers=2, direct_io=name == "direct") as w:
            end, refs = feed(w, req, 5, prefill_chunk=16)
            w.close(end)
            receipt = w.future(cid).result(30)
            assert receipt.status == "ok", receipt.error
    pw = ProcessCaptureWriter(roots["process"], budget_bytes=64 << 20, workers=2,
                              ring_bytes=1 << 20, direct_io=True)
    try:
        assert pw.ready.wait(60), "the writer process never said it was ready"
        end, _ = feed(pw, req, 5, prefill_chunk=16)
        pw.close(end)
        assert pw.flush(60)
    finally:
        pw.shutdown(timeout=30)
    caps = {name: read(next(root.rglob("manifest.json")).parent) for name, root in roots.items()}
    files = {name: sorted(p.relative_to(root) for p in root.rglob("*.safetensors"))
             for name, root in roots.items()}
    assert files["buffered"] == files["direct"] == files["process"] != []
    for rel in files["buffered"]:
        base = (roots["buffered"] / rel).read_bytes()
        assert (roots["direct"] / rel).read_bytes() == base
        assert (roots["process"] / rel).read_bytes() == base
    for cap in caps.values():
        for key in spec.keys():
            assert refs is not None and torch.equal(cap.tensor(*key), refs[key][:44])
    for root in roots.values():
        assert cli_main(["verify", str(root)]) == 0
        assert temp_files(root) == []


def test_the_server_setting_reaches_the_engine_workers_writer(tmp_path):
    """`--capture-io direct` travels in the workers' config (capture_io) to their writer."""
    from capsteer.capture.writer.factory import durable_writer as _durable_writer
    from capsteer.config.server import load_settings

    for io, direct in (("buffered", False), ("direct", True)):
        config = load_settings({"capture_dir": str(tmp_path / io), "capture_io": io,
                                "capture_writer": "threads"}).worker_config()
        writer = _durable_writer(config)
        try:
            assert isinstance(writer, CaptureWriter) and writer.direct_io is direct
        finally:
            writer.shutdown()


def test_an_unknown_capture_io_in_the_workers_config_is_refused(tmp_path):
    """A hand-written additional_config (plain `vllm serve`) must not silently fall back."""
    from capsteer.capture.writer.factory import durable_writer as _durable_writer

    with pytest.raises(ValueError, match="capture_io"):
        _durable_writer({"capture_dir": str(tmp_path), "capture_io": "odirect",
                         "capture_writer": "threads"})
