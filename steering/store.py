"""One registry directory's file rules (vectors and readers alike): a file is published
under its final name only complete and durable, and temp files of a dead writer go."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

STALE_TMP_SECONDS = 3600.0  # younger temp files may belong to a writer still at work


def publish_atomic(root: Path, path: Path, write: Callable[[str], None]) -> None:
    """`write(temp_path)` fills a temp file in `root`; it is fsynced, renamed to `path`
    and the directory fsynced. A failure leaves nothing behind."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".tmp", dir=root)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(root)


def fsync_dir(root: Path) -> None:
    fd = os.open(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError:  # some filesystems cannot fsync a directory; the rename stands
        pass
    finally:
        os.close(fd)


def remove_stale_temps(root: Path, remove_dir: Callable[[Path], None] | None = None) -> None:
    """Temp files (and, with `remove_dir`, scratch directories) older than
    STALE_TMP_SECONDS: left by a writer that died."""
    cutoff = time.time() - STALE_TMP_SECONDS
    with os.scandir(root) as entries:
        for entry in entries:
            if not (entry.name.startswith(".") and entry.name.endswith(".tmp")):
                continue
            try:
                if entry.stat(follow_symlinks=False).st_mtime >= cutoff:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    if remove_dir is not None:
                        remove_dir(Path(entry.path))
                else:
                    os.unlink(entry.path)
            except OSError:
                pass
