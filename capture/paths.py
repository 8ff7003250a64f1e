"""Where a capture lives: `<root>/<YYYY-MM-DD>/<tag or "default">/<capture_id>/`.

capture ids and tags come from clients, so both are checked to be a single safe
path component before they touch the filesystem; nothing can escape the root.
"""

from __future__ import annotations

import datetime as _dt
import re
from pathlib import Path

from capsteer.capture.spec import SpecError, validate_slug

DEFAULT_TAG = "default"
# Like a tag, a bit longer (vLLM request ids can be long), never starting with "."
# (temp names do) so a capture directory can never look like a temp file.
CAPTURE_ID_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")
_DATE_RE = re.compile(r"\d{4}-\d{2}-\d{2}")


def validate_capture_id(capture_id: object) -> str:
    """Return `capture_id` if it is a safe directory name, else raise SpecError."""
    if not isinstance(capture_id, str) or not CAPTURE_ID_RE.fullmatch(capture_id):
        raise SpecError("capture_id", f"{capture_id!r} must match [A-Za-z0-9_-][A-Za-z0-9._-]{{0,127}}")
    return capture_id


def utc_date(ts: float) -> str:
    return _dt.datetime.fromtimestamp(ts, tz=_dt.timezone.utc).strftime("%Y-%m-%d")


def relative_dir(capture_id: str, tag: str | None, ts: float) -> str:
    """The capture directory relative to the root (what receipts report as `dir`)."""
    validate_capture_id(capture_id)
    tag_part = DEFAULT_TAG if tag is None else validate_slug(tag, "capture.tag")
    return f"{utc_date(ts)}/{tag_part}/{capture_id}"


def resolve_inside(root: Path, rel: str) -> Path:
    """root/rel, refusing anything that resolves outside root."""
    root_r = root.resolve()
    path = (root_r / rel).resolve()
    if path != root_r and root_r not in path.parents:
        raise SpecError("capture", f"path {rel!r} escapes the capture root")
    return path


def find_capture_dirs(root: Path, capture_id: str) -> list[Path]:
    """Every `<root>/<date>/<tag>/<capture_id>` directory, newest date first."""
    validate_capture_id(capture_id)
    found = [
        p
        for p in root.glob(f"*/*/{capture_id}")
        if p.is_dir() and _DATE_RE.fullmatch(p.parent.parent.name)
    ]
    return sorted(found, key=lambda p: p.parent.parent.name, reverse=True)
