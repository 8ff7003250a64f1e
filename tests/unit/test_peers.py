"""The pending board that lets any API server process answer 'pending' for another's
capture: a marker counts only while its owner process runs (a zombie does not)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from capsteer.server.peers import PeerBoard


def _marker(board: PeerBoard, capture_id: str, pid: int) -> None:
    (board.dir / capture_id).write_text(str(pid))


def test_own_marker_is_held_until_removed(tmp_path):
    board = PeerBoard(tmp_path)
    board.dir.mkdir(parents=True, exist_ok=True)
    board.add("cap-a")
    assert board.holds("cap-a")
    assert not board.holds("cap-unknown")
    board.remove("cap-a")
    assert not board.holds("cap-a")


def test_markers_of_dead_or_zombie_owners_do_not_count(tmp_path):
    board = PeerBoard(tmp_path)
    board.dir.mkdir(parents=True, exist_ok=True)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        _marker(board, "cap-live", live.pid)
        _marker(board, "cap-zombie", zombie.pid)
        deadline = time.monotonic() + 30
        while board.holds("cap-zombie") and time.monotonic() < deadline:
            time.sleep(0.05)  # exited but not reaped: /proc says Z
        assert os.path.exists(f"/proc/{zombie.pid}")  # still unreaped, so a zombie
        assert not board.holds("cap-zombie")
        assert board.holds("cap-live")
        zombie.wait()
        assert not board.holds("cap-zombie")  # reaped: no such process
        _marker(board, "cap-junk", 0)
        assert not board.holds("cap-junk")
    finally:
        live.kill()
        live.wait()
