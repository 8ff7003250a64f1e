"""Early writeback (issue 12, P5): AtomicFile asks the kernel to start writing each
piece as soon as it is written, so the final fsync waits for the tail only. The
ranges must tile the file exactly, and the call must really reach the kernel."""

from __future__ import annotations

import errno
import os
import sys

import numpy as np
import pytest

from capsteer.capture import publish
from capsteer.capture.publish import AtomicFile, FileSystem


class Recording(FileSystem):
    def __init__(self) -> None:
        self.events: list[tuple[str, int, int]] = []
        self.written = 0

    def write(self, fd: int, data: memoryview) -> int:
        n = super().write(fd, data[: max(1, len(data) // 2)])  # short writes, as a kernel may
        self.events.append(("write", self.written, n))
        self.written += n
        return n

    def start_writeback(self, fd: int, offset: int, nbytes: int) -> int:
        self.events.append(("writeback", offset, nbytes))
        return super().start_writeback(fd, offset, nbytes)


def test_writeback_ranges_tile_the_file_after_their_bytes_are_written(tmp_path):
    rng = np.random.default_rng(1)
    sizes = [5, (1 << 20) + 3, 700 << 10, 600 << 10, 2 << 20, 17]
    fs = Recording()
    f = AtomicFile(tmp_path, "d.bin", fs, digest="sha256")
    data = bytearray()
    for n in sizes:
        piece = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        f.write(piece)
        data += piece
    f.commit()
    assert (tmp_path / "d.bin").read_bytes() == bytes(data)
    ranges = [(o, n) for kind, o, n in fs.events if kind == "writeback"]
    assert ranges, "no writeback was started"
    end = 0
    for offset, nbytes in ranges:  # contiguous, in order, covering every byte once
        assert offset == end and nbytes > 0
        end += nbytes
    assert end == len(data)
    written_by = 0
    for kind, o, n in fs.events:  # each range only once its bytes were handed over
        if kind == "write":
            written_by = o + n
        else:
            assert o + n <= written_by


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux's")
def test_sync_file_range_reaches_the_kernel(tmp_path):
    """A wrong ctypes signature would fail quietly; the kernel's answers show it is right:
    0 on a written file, EBADF on a closed descriptor, EINVAL on a negative length."""
    assert publish._SYNC_FILE_RANGE is not None
    fs = FileSystem()
    fd = os.open(tmp_path / "x.bin", os.O_WRONLY | os.O_CREAT)
    try:
        os.write(fd, b"\x01" * (1 << 20))
        assert fs.start_writeback(fd, 0, 1 << 20) == 0
        assert fs.start_writeback(fd, 0, -1) == errno.EINVAL
    finally:
        os.close(fd)
    assert fs.start_writeback(fd, 0, 1 << 20) == errno.EBADF


class Writev(Recording):
    """Records writev calls; `short`: each takes at most two buffers and half of the
    second, as a kernel may return short."""

    def __init__(self, short: bool) -> None:
        super().__init__()
        self.short = short
        self.calls = 0

    def writev(self, fd: int, buffers: list[memoryview]) -> int:
        self.calls += 1
        take = list(buffers[:2]) if self.short else list(buffers)
        if self.short and len(take[-1]) > 1:
            take[-1] = take[-1][: len(take[-1]) // 2]
        n = super().writev(fd, take)
        self.events.append(("write", self.written, n))
        self.written += n
        return n


@pytest.mark.parametrize("short", [False, True])
@pytest.mark.parametrize("digest", ["sha256", "blake3"])
def test_write_pieces_batches_large_pieces_and_keeps_order_digest_and_writeback(tmp_path, digest, short):
    """Small and large pieces mixed (and writev results cut short): the file is the
    pieces in order, its digest is theirs, the writeback ranges tile it, each range
    starts only after its bytes were handed over, and large pieces share writev calls."""
    if digest == "blake3":
        pytest.importorskip("blake3")
    rng = np.random.default_rng(2)
    sizes = [7, 1 << 20, 1 << 20, (1 << 20) + 5, 100, 3 << 20] + [1 << 20] * 20 + [9]
    pieces = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
    fs = Writev(short)
    f = AtomicFile(tmp_path, "p.bin", fs, digest=digest)
    f.write_pieces(iter(pieces))
    f.commit()
    data = b"".join(pieces)
    assert (tmp_path / "p.bin").read_bytes() == data
    assert f.size == len(data)
    expected = publish.new_hasher(digest)
    expected.update(memoryview(data))
    assert f.hexdigest == expected.hexdigest()
    end = written_by = 0
    for kind, offset, nbytes in fs.events:
        if kind == "write":
            written_by = offset + nbytes
            continue
        assert offset == end and nbytes > 0 and offset + nbytes <= written_by
        end += nbytes
    assert end == len(data)
    if not short:  # 24 large pieces: a batch of two, then batches of up to 16 MiB
        assert 0 < fs.calls <= 4
