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
