"""The request fields capsteer adds to chat and completions: found, validated, rewritten.

A request body arrives as JSON. `parse_hook_fields` finds `capture`,
`capture_wait` and `steering` (top level, or inside a literal `"extra_body"` object
that curl users copy from SDK code), validates them against the model, and
`rewrite_body` turns them into what stock vLLM understands: `vllm_xargs` (which
becomes `SamplingParams.extra_args` in every worker) and `cache_salt`.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from capsteer.capture.spec import CaptureSpec, SpecError, parse_capture_spec
from capsteer.capture.writer.budget import estimate_bytes
from capsteer.engine_ext.payload import EXTRA_ARGS_KEY, build_payload
from capsteer.steering.conditions import ReaderGetter
from capsteer.steering.patches import PatchGetter
from capsteer.steering.readers.readout import (
    ReaderLookup,
    ReadoutItem,
    ReadoutSpecError,
    check_readout_request,
    parse_readout,
)
from capsteer.steering.spec import (
    SteeringSpec,
    SteeringSpecError,
    VectorLookup,
    parse_steering_spec,
)

HOOK_FIELDS = ("capture", "capture_wait", "steering", "readout")
_SPEC_MEMO_SIZE = 256


# Bad input: HTTP 400 with an OpenAI-shaped error naming `field`. The capture spec's own
# error already carries (field, reason); the request-level checks raise the same type.
FieldError = SpecError


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    max_model_len: int
    dtype_itemsize: int
    # Hooks the model does not have (a parallel block's resid_mid) -> the 400's reason.
    unavailable: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # Widths of the hooks not hidden_size wide (mlp_post: d_mlp).
    hook_widths: Mapping[str, int] = dataclasses.field(default_factory=dict)


@dataclass
class HookFields:
    """A request's validated capsteer fields."""

    capture: CaptureSpec | None
    capture_wait: bool
    steering: SteeringSpec | None
    stream: bool
    client_wants_usage: bool
    readout: list[ReadoutItem] | None = None
    client_wants_token_ids: bool = False

    @property
    def active(self) -> bool:
        return self.capture is not None or bool(self.readout) or (
            self.steering is not None and not self.steering.is_noop)


def lift_extra_body(body: dict[str, Any]) -> dict[str, Any]:
    """Merge a literal `extra_body` object into the top level, as the OpenAI SDK would."""
    extra = body.get("extra_body")
    if extra is None:
        return body
    if not isinstance(extra, Mapping):
        raise FieldError("extra_body", "must be an object")
    merged = {k: v for k, v in body.items() if k != "extra_body"}
    for key, value in extra.items():
        if key in merged:
            raise FieldError(f"extra_body.{key}", "also given at the top level; give it once")
        merged[key] = value
    return merged


def refuse_reserved_args(body: Mapping[str, Any]) -> None:
    """Only capsteer writes its worker payload. A client's own `vllm_xargs.capsteer` (on
    any endpoint that takes `vllm_xargs`) or `sampling_params.extra_args.capsteer` (the
    token-in endpoint) would reach every worker without the checks, the admission and the
    tracking that the fields above get: refused, with or without capsteer fields."""
    params = body.get("sampling_params")
    for field, args in (("vllm_xargs", body.get("vllm_xargs")),
                        ("sampling_params.extra_args",
                         params.get("extra_args") if isinstance(params, Mapping) else None)):
        if isinstance(args, str):  # form-data endpoints send vllm_xargs as JSON text
            try:
                args = json.loads(args)
            except ValueError:
                continue  # not JSON: vLLM refuses it itself
        if isinstance(args, Mapping) and EXTRA_ARGS_KEY in args:
            raise FieldError(f"{field}.{EXTRA_ARGS_KEY}", "is reserved for capsteer's own fields")


def _check_positions_fit(capture: CaptureSpec, max_model_len: int) -> None:
    """An explicit position no request can reach (past the context, or counting back
    further than any prompt) would leave its capture silently short: refused."""
    outside = [p for p in capture.positions.explicit if not -max_model_len <= p < max_model_len]
    if outside:
        raise FieldError("capture.positions", f"position {outside[0]} lies outside the model's "
                         f"context (max_model_len {max_model_len})")


def _lax_true(value: object) -> bool:
    """True as vLLM's request models read a boolean (pydantic's lax mode: 1, "true", "yes"...)."""
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "t", "yes", "y", "on")
    return value is True or (isinstance(value, int) and value == 1)


def _prompt_count(prompt: object) -> int:
    """Prompts in a completions `prompt`: a string or a token list is one; a list of
    strings or of token lists is one each."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return len(prompt)
    return 1


def parse_hook_fields(
    body: dict[str, Any], shape: ModelShape, *, lookup: VectorLookup | None,
    default_layout: str, capture_default: Mapping[str, Any] | None,
    readers: ReaderLookup | None = None, reader_tensors: ReaderGetter | None = None,
    patches: PatchGetter | None = None,
) -> HookFields:
    """Validate the capsteer fields of an (extra_body-lifted) request body. `readers`:
    the reader registry's shapes (readout); `reader_tensors`: its tensors by name
    (steering `when` gates, SAE-feature vectors); `patches`: the captures `op: patch`
    items read."""
    refuse_reserved_args(body)  # also when the fields ask for nothing (capture: false)
    capture = None
    raw_capture = body.get("capture")
    if raw_capture is not None and raw_capture is not False:
        capture = parse_capture_spec(raw_capture, num_layers=shape.num_layers,
                                     default_layout=default_layout, default=capture_default,
                                     unavailable=shape.unavailable)
        _check_positions_fit(capture, shape.max_model_len)
        n = body.get("n", 1)
        if n is not None and str(n).strip() != "1":  # vLLM reads "1" as 1
            raise FieldError("n", "capture needs n=1 (one capture per request; send n requests)")
        if body.get("best_of") not in (None, 1):
            raise FieldError("best_of", "capture needs best_of=1")
        if _prompt_count(body.get("prompt")) > 1:
            raise FieldError("prompt", "capture needs one prompt per request (each prompt is "
                             "its own capture; send one request per prompt)")
    wait = body.get("capture_wait", False)
    if wait is None:
        wait = False
    if not isinstance(wait, bool):
        raise FieldError("capture_wait", f"must be true or false, got {wait!r}")
    if wait and capture is None:
        raise FieldError("capture_wait", "needs a capture field in the same request")
    steering = None
    raw_steering = body.get("steering")
    if raw_steering is not None:
        try:
            if lookup is not None and _names_only(raw_steering):
                steering = _SPEC_MEMO.parse(raw_steering, shape, lookup, reader_tensors, readers)
            else:
                steering = parse_steering_spec(raw_steering, num_layers=shape.num_layers,
                                               hidden_size=shape.hidden_size, lookup=lookup,
                                               unavailable=shape.unavailable,
                                               readers=reader_tensors, patches=patches,
                                               widths=shape.hook_widths)
        except SteeringSpecError as exc:
            raise FieldError(exc.field, exc.reason) from None
    if _lax_true(body.get("use_beam_search")) and (
            capture is not None or (steering is not None and not steering.is_noop)):
        # vLLM's beam search runs its own sampling params, without capsteer's payload
        raise FieldError("use_beam_search", "capture and steering do not run under beam search")
    readout = None
    if body.get("readout") is not None:
        try:
            readout = parse_readout(body["readout"], num_layers=shape.num_layers,
                                    hidden_size=shape.hidden_size, lookup=readers,
                                    widths=shape.hook_widths)
            n = body.get("n", 1)
            check_readout_request(readout, shape.unavailable, captures=capture is not None,
                                  one_sequence=n is None or str(n).strip() == "1")
        except ReadoutSpecError as exc:
            raise FieldError(exc.field, exc.reason) from None
        _check_readout_request(body)
    stream = body.get("stream") is True
    options = body.get("stream_options")
    if options is not None and not isinstance(options, Mapping):
        raise FieldError("stream_options", f"must be an object, got {type(options).__name__}")
    wants_usage = isinstance(options, Mapping) and options.get("include_usage") is True
    return HookFields(capture, wait, steering, stream, wants_usage, readout,
                      body.get("return_token_ids") is True)


def _check_readout_request(body: Mapping[str, Any]) -> None:
    """What a readout needs of the HTTP request's own fields beyond check_readout_request
    (400 naming the field otherwise)."""
    if body.get("best_of") not in (None, 1):
        raise FieldError("best_of", "readout needs best_of=1")
    if _prompt_count(body.get("prompt")) > 1:
        raise FieldError("prompt", "readout needs one prompt per request")
    if _lax_true(body.get("use_beam_search")):
        raise FieldError("use_beam_search", "readout does not run under beam search")


def _names_only(raw: object) -> bool:
    """Whether a steering field names all its vectors (no floats: every item's `vector` is
    `{"name": ...}`, so no inline vector, SAE feature or patch source): such fields repeat
    verbatim across requests and their parse can be reused."""
    if not isinstance(raw, Mapping) or set(raw) != {"vectors"} or not isinstance(
            raw["vectors"], list) or not raw["vectors"]:
        return False
    for item in raw["vectors"]:
        vector = item.get("vector") if isinstance(item, Mapping) else None
        if not (isinstance(vector, Mapping) and set(vector) == {"name"}
                and isinstance(vector["name"], str)):
            return False
    return True


class _SpecMemo:
    """Parsed names-only steering fields, reused while every entry they name is unchanged:
    a vector is the same object in the registry's cache, a `when` gate's reader has the
    same content sha256 (a replaced or removed entry differs, or raises). A request
    steering every layer with a named vector, gated or not, then costs one registry check
    per name instead of a parse, a check of every vector, the gates' arithmetic and a new
    wire form. Reader tensors are never kept here (an SAE can be GBs); the middleware also
    parses off the event loop (patches), hence the lock."""

    def __init__(self, size: int) -> None:
        self._specs: OrderedDict[tuple, tuple[SteeringSpec | None, tuple]] = OrderedDict()
        self._size = size
        self._lock = threading.Lock()

    def parse(self, raw: Mapping, shape: ModelShape, lookup: VectorLookup,
              readers: ReaderGetter | None = None,
              reader_shapes: ReaderLookup | None = None) -> SteeringSpec | None:
        """`readers`: the reader tensors `when` gates read; `reader_shapes`: the same
        registry's shapes, whose sha256 tells a reader unchanged (without them, a field
        whose gates name readers is parsed every time)."""
        key = (json.dumps(raw, sort_keys=True), shape.num_layers, shape.hidden_size,
               tuple(sorted(shape.unavailable.items())), tuple(sorted(shape.hook_widths.items())),
               *_identity(lookup), *_identity(reader_shapes))
        with self._lock:
            hit = self._specs.get(key)
        if hit is not None:
            try:
                same = all(lookup(name) is found if which == 0
                           else reader_shapes is not None and reader_shapes(name).sha256 == found
                           for which, name, found in hit[1])
            except Exception:  # gone or unusable now: the parse below reports it
                same = False
            if same:
                with self._lock:
                    if key in self._specs:
                        self._specs.move_to_end(key)
                return hit[0]
        seen: list[tuple[int, str, object]] = []

        def vector(name: str) -> object:
            found = lookup(name)
            seen.append((0, name, found))
            return found

        def reader(name: str) -> object:
            found = readers(name)
            # its sha256 as the registry reports it now (None: cannot be told, not reused)
            seen.append((1, name, None if reader_shapes is None else reader_shapes(name).sha256))
            return found
        spec = parse_steering_spec(raw, num_layers=shape.num_layers,
                                   hidden_size=shape.hidden_size, lookup=vector,
                                   unavailable=shape.unavailable, widths=shape.hook_widths,
                                   readers=None if readers is None else reader)
        if all(found is not None for which, _, found in seen if which == 1):
            with self._lock:
                self._specs[key] = (spec, tuple(seen))
                while len(self._specs) > self._size:
                    self._specs.popitem(last=False)
        return spec


def _identity(get: Callable | None) -> tuple[object, object]:
    """A lookup's identity for a memo key: a bound method's object and function (a fresh
    bound method object per attribute access is the same lookup)."""
    owner = getattr(get, "__self__", None)
    return (owner if owner is not None else get), getattr(get, "__func__", None)


_SPEC_MEMO = _SpecMemo(_SPEC_MEMO_SIZE)


def response_id(body: dict[str, Any], path: str, header_id: str | None) -> str:
    """The `id` vLLM gives the response ("chatcmpl-…" / "cmpl-…" + the X-Request-Id
    header, else the body's `request_id`), so a capture's manifest can name it. A body
    with neither gets a fresh `request_id` here (vLLM would draw one itself)."""
    base = header_id
    if base is None:
        if "request_id" not in body:
            body["request_id"] = uuid.uuid4().hex
        base = str(body["request_id"])  # (not a string: vLLM refuses the request itself)
    return ("chatcmpl-" if path.rstrip("/").endswith("/chat/completions") else "cmpl-") + base


def rewrite_body(body: dict[str, Any], hooks: HookFields, capture_id: str | None,
                 dir_time: float | None = None, record_id: str | None = None,
                 readout_id: str | None = None) -> dict[str, Any]:
    """The body stock vLLM accepts: capsteer fields out, `vllm_xargs` and `cache_salt` in.
    `dir_time` dates the capture's directory (default: now); `record_id` is the id the
    capture records (the response's id). `body` passed `parse_hook_fields`, which refused
    a client's own payload key; the one written here replaces any that is left."""
    out = {k: v for k, v in body.items() if k not in HOOK_FIELDS}
    payload = build_payload(hooks.capture, hooks.steering, capture_id=capture_id,
                            durable=hooks.capture is not None, dir_time=dir_time,
                            record_id=record_id, readout=hooks.readout, readout_id=readout_id)
    if payload is None:
        return out
    if hooks.readout:
        # Token ids place each score (dropped again unless the client asked for them).
        out["return_token_ids"] = True
    xargs = out.get("vllm_xargs")
    if xargs is None:
        xargs = {}
    if not isinstance(xargs, Mapping):
        raise FieldError("vllm_xargs", "must be an object")
    out["vllm_xargs"] = {**xargs, EXTRA_ARGS_KEY: json.dumps(payload.extra_args[EXTRA_ARGS_KEY])}
    if payload.cache_salt:
        user_salt = out.get("cache_salt")
        out["cache_salt"] = payload.cache_salt if not user_salt else f"{user_salt}|{payload.cache_salt}"
    if hooks.capture is not None and hooks.stream:
        # The output length ends the capture: ask vLLM for the usage chunk (dropped again
        # before the client sees it unless the client asked for it).
        options = dict(out.get("stream_options") or {})
        options["include_usage"] = True
        out["stream_options"] = options
    return out


def estimate_capture_bytes(body: Mapping[str, Any], capture: CaptureSpec, shape: ModelShape,
                           prompt_tokens: int | None = None) -> int:
    """Upper bound of a capture's row bytes: `prompt_tokens` as counted by the served
    tokenizer (server/prompt_tokens.py), else from the text: byte-level BPE gives at most
    one token per UTF-8 byte, plus a margin for the chat template."""
    if prompt_tokens is None:
        text_bytes = len(json.dumps(body.get("messages", body.get("prompt", "")),
                                    ensure_ascii=False).encode())
        prompt_tokens = text_bytes + 64
    prompt_tokens = min(prompt_tokens, shape.max_model_len)
    max_new = body.get("max_completion_tokens") or body.get("max_tokens")
    if not isinstance(max_new, int) or max_new <= 0:
        max_new = shape.max_model_len
    max_new = min(max_new, max(shape.max_model_len - 1, 1))
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}.get(capture.dtype, shape.dtype_itemsize)
    return estimate_bytes(capture, shape.hidden_size, itemsize, prompt_tokens, max_new,
                          shape.hook_widths)
