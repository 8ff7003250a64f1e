"""The captures `op: patch` steering items read on the server (steering/patches.py): a
capture id becomes a PatchSource once its manifest says ok, it was taken from the served
model and its files match their checksums; one still in flight is pending (a 400 naming
the field: wait for it with `capture_wait` first)."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np

from capsteer.capture.published import CaptureReadError
from capsteer.capture.reader import Capture, read
from capsteer.capture.receipts import find_receipt
from capsteer.capture.spec import SpecError
from capsteer.server.tracker import CaptureTracker
from capsteer.steering.patches import PatchSource, PatchSourceError

_KEPT = 64  # verified captures kept (a patch study sends many requests against one)


class CaptureSources:
    """capture id -> PatchSource over the server's capture root (a PatchGetter)."""

    def __init__(self, root: str | Path, tracker: CaptureTracker | None, model: str) -> None:
        self.root = Path(root)
        self.tracker = tracker
        self.model = model
        self._verified: OrderedDict[str, Capture] = OrderedDict()

    def __call__(self, capture_id: str) -> PatchSource:
        try:
            receipt = find_receipt(self.root, capture_id)
        except SpecError:  # not a capture id at all
            raise KeyError(capture_id) from None
        if receipt is None:
            if self.tracker is not None and self.tracker.is_tracked(capture_id):
                raise PatchSourceError(f"capture {capture_id} is still pending (not durable "
                                       "yet): send its request with capture_wait: true, or "
                                       "poll GET /v1/captures/{id} until status ok")
            raise KeyError(capture_id)
        if receipt.status != "ok":
            raise PatchSourceError(f"capture {capture_id} has status {receipt.status}: "
                                   f"{receipt.error}")
        capture = self._verified.get(capture_id)
        if capture is None or capture.path != self.root / str(receipt.dir):
            try:  # checksums once, then the rows straight from the files
                capture = read(self.root / str(receipt.dir))
            except CaptureReadError as exc:
                raise PatchSourceError(f"capture {capture_id} cannot be read: {exc}") from None
            self._verified[capture_id] = capture
            while len(self._verified) > _KEPT:
                self._verified.popitem(last=False)
        else:
            self._verified.move_to_end(capture_id)
        model = str(capture.manifest.get("model", ""))
        if model != self.model:
            raise PatchSourceError(f"capture {capture_id} was taken from model {model!r}; "
                                   f"this server serves {self.model!r}")
        def rows(hook: str, layer: int, capture: Capture = capture) -> np.ndarray:
            try:
                return capture.numpy(hook, layer)
            except (OSError, ValueError, RuntimeError) as exc:  # unreadable since verified
                raise PatchSourceError(f"capture {capture_id}: {hook}.{layer} cannot be "
                                       f"read: {exc}") from None
        return PatchSource(capture_id, model, frozenset(capture.keys()), capture.positions,
                           rows)
