"""The request payload both sides share: what the front ends (the server, the in-process
engine, extraction) put in a request's sampling `extra_args`, how it is signed, how the
workers decode it, and the worker methods the front ends call through `collective_rpc`.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from capsteer.capture.spec import CaptureSpec
from capsteer.steering.readers.readout import ReadoutItem
from capsteer.steering.spec import SteeringSpec

EXTRA_ARGS_KEY = "capsteer"
# A server's workers act only on payloads carrying this key (its value lives in the
# environment of the server's processes; clients never see it), so a payload that
# reached vLLM by a path capsteer's checks do not cover runs without hooks.
PAYLOAD_KEY_ENV = "CAPSTEER_PAYLOAD_KEY"

# The worker class that carries the hooks, and the methods of it the front ends call by name.
WORKER_CLS = "capsteer.engine_ext.worker.CapsteerWorker"
RPC_TAKE_CAPTURES = "capsteer_take_captures"  # finished in-memory captures
RPC_END_CAPTURES = "capsteer_end_captures"  # output lengths (None: aborted)
RPC_METRICS = "capsteer_metrics"  # the worker's capture metrics
RPC_WRITER_STATS = "capsteer_writer_stats"
RPC_FLUSH_SHARDED = "capsteer_flush_sharded"  # publish an extraction job's partial shard
RPC_STATS = "capsteer_stats"  # diagnostics
RPC_UNWRITTEN = "capsteer_unwritten_receipts"  # outcomes whose manifest a full disk refused
RPC_PLAIN_GRAPHS = "capsteer_plain_graphs"  # hold every step on the hooked CUDA graphs
RPC_METHODS = (RPC_TAKE_CAPTURES, RPC_END_CAPTURES, RPC_METRICS, RPC_WRITER_STATS,
               RPC_FLUSH_SHARDED, RPC_STATS, RPC_PLAIN_GRAPHS, RPC_UNWRITTEN)


def sign_payload(payload: dict) -> dict:
    """`payload` with this process's payload key (see PAYLOAD_KEY_ENV), when it has one:
    its engine's workers, started from this environment, expect it."""
    key = os.environ.get(PAYLOAD_KEY_ENV)
    if key:
        payload["key"] = key
    return payload


def payload_is_trusted(payload: Mapping, key: str | None) -> bool:
    """Whether a worker expecting `key` (None: no key, the in-process engine) may act on
    `payload`."""
    return key is None or payload.get("key") == key


def decode_payload(extra_args: Mapping | None) -> Mapping | None:
    """capsteer's payload in a request's extra_args (`vllm_xargs` carries flat values, so
    it comes as JSON text), or None."""
    payload = (extra_args or {}).get(EXTRA_ARGS_KEY)
    if isinstance(payload, str):
        payload = json.loads(payload)
    return payload or None


@dataclass(frozen=True)
class HookPayload:
    """What a request carries to the workers, and the prefix-cache salt it implies."""

    extra_args: dict
    cache_salt: str | None
    capture_id: str | None


def new_capture_id() -> str:
    return "cap-" + uuid.uuid4().hex


def new_readout_id() -> str:
    return "ro-" + uuid.uuid4().hex


def readout_wire(readout_id: str, items: list[ReadoutItem]) -> str:
    """A request's readout as the JSON text its payload carries."""
    return json.dumps({"id": readout_id, "items": [item.to_dict() for item in items]},
                      separators=(",", ":"))


def parse_readout_payload(wire: str | Mapping) -> tuple[str, list[ReadoutItem]]:
    """The readout id and items of a payload's `readout` (readout_wire's text)."""
    data = json.loads(wire) if isinstance(wire, str) else wire
    return str(data["id"]), [ReadoutItem.from_dict(d) for d in data["items"]]


def needs_end_report(capture: CaptureSpec, prompt_len: int | None) -> bool:
    """Whether a durable capture's kept positions depend on the output length, so the
    caller must report it (`capsteer_end_captures`). Prompt-only captures close in the
    worker once their prompt is fed; `prompt_len` None (not tokenized here) counts
    explicit positions as possibly generated (the worker's rule, `needs_output_length`)."""
    return capture.positions.reaches_past_prompt(prompt_len)


def build_payload(
    capture: CaptureSpec | None, steering: SteeringSpec | None, capture_id: str | None = None,
    durable: bool = False, dir_time: float | None = None, await_end: bool | None = None,
    record_id: str | None = None, readout: list[ReadoutItem] | None = None,
    readout_id: str | None = None,
) -> HookPayload | None:
    """extra_args + cache_salt. Captured prompts never reuse cached blocks (unique
    salt); steered prompts share blocks only with identical steering. `await_end`
    (default: `durable`) promises the worker an end report for a durable capture.
    `record_id` is the id the capture records (manifest `request_id`, sharded index
    `id`); without it, the engine's own request id. A `readout` (results under
    `readout_id`) never reuses cached blocks either: a cached token is never fed, so it
    would have no scores."""
    if capture is None and not readout and (steering is None or steering.is_noop):
        return None
    payload: dict[str, Any] = {}
    salt = None
    if steering is not None and not steering.is_noop:
        # JSON text and its key: cheap for vLLM to copy per request (SteeringSpec.wire_text)
        payload["steering"] = steering.wire_text
        payload["steering_key"] = steering.sharing_key
        salt = steering.cache_salt()
    if capture is not None:
        capture_id = capture_id or new_capture_id()
        payload["capture"] = capture.to_json()  # text, like the steering spec
        payload["capture_id"] = capture_id
        # Every pipeline stage dates its directory alike, and the caller knows where it is.
        payload["dir_time"] = time.time() if dir_time is None else dir_time
        payload["durable"] = durable
        # the caller reports the output length (end_captures)
        payload["await_end"] = durable if await_end is None else await_end
        if record_id is not None:
            payload["record_id"] = record_id
        salt = f"capsteer-capture-{capture_id}"
    if readout:
        readout_id = readout_id or new_readout_id()
        payload["readout"] = readout_wire(readout_id, readout)
        if capture is None:
            salt = f"capsteer-readout-{readout_id}"
    return HookPayload({EXTRA_ARGS_KEY: sign_payload(payload)}, salt, capture_id)
