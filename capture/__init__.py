"""capsteer.capture: capture specs, the durable writer pool, layouts, receipts, reader.

Data path: engine rows -> `CaptureWriter` (a `CaptureSink`) -> worker threads ->
safetensors under temp names -> fsync, rename, fsync dir -> manifest.json last ->
`Receipt`. See docs/capture-format.md for the on-disk format.
"""

from capsteer.capture.dataset import JobRows, open_job
from capsteer.capture.published import CaptureReadError, CorruptCapture
from capsteer.capture.reader import Capture, read
from capsteer.capture.receipts import Receipt, find_receipt, wait_for_receipt
from capsteer.capture.sink import (
    CapturedActivations,
    CaptureEnd,
    CaptureRequest,
    CaptureSink,
    MemorySink,
)
from capsteer.capture.spec import CaptureSpec, PositionSpec, SpecError, parse_capture_spec
from capsteer.capture.writer.budget import POLICIES, Overloaded, estimate_bytes
from capsteer.capture.writer.local import CaptureWriter

__all__ = [
    "POLICIES",
    "Capture",
    "CaptureEnd",
    "CaptureReadError",
    "CaptureRequest",
    "CaptureSink",
    "CaptureSpec",
    "CaptureWriter",
    "CapturedActivations",
    "CorruptCapture",
    "JobRows",
    "MemorySink",
    "Overloaded",
    "PositionSpec",
    "Receipt",
    "SpecError",
    "estimate_bytes",
    "find_receipt",
    "open_job",
    "parse_capture_spec",
    "read",
    "wait_for_receipt",
]
