"""Hook-point vocabulary shared by capture specs, steering specs and the engine.

Names follow TransformerLens (`blocks.L.hook_resid_post`); aliases match the
reference fork. See docs/ and ../shared/design/api.md §2.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping

import numpy as np

from capsteer.config import errors

HOOKS: tuple[str, ...] = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out",
                          "mlp_in", "mlp_post", "attn_z", "router_logits")
ALIASES: dict[str, str] = {
    "pre_attn": "resid_pre",
    "post_attn": "resid_mid",
    "post_block": "resid_post",
    "ln2.hook_normalized": "mlp_in",  # TransformerLens's names under blocks.L
    "mlp.hook_post": "mlp_post",
    "attn.hook_z": "attn_z",
}
# TransformerLens's name under `blocks.L.` where it is not `hook_{hook}`.
_TL_NAMES: dict[str, str] = {"mlp_in": "ln2.hook_normalized", "mlp_post": "mlp.hook_post",
                             "attn_z": "attn.hook_z"}
# Hooks whose width is not the hidden size (the model's d_mlp, heads * d_head, experts).
WIDE_HOOKS: tuple[str, ...] = ("mlp_post", "attn_z")
# The part of a hook a steering item may select, by hook: "neurons" on mlp_post, "heads"
# (slices of d_head) on attn_z.
SELECTIONS: dict[str, str] = {"mlp_post": "neurons", "attn_z": "heads"}
# Hooks that are read, never steered: a steering item naming one is a 400.
CAPTURE_ONLY: tuple[str, ...] = ("router_logits",)
# The key under which hook widths give attn_z's head count ([heads, d_head] per token).
HEADS_KEY = "attn_z.heads"
# Uses of a hook that can be refused on their own (beside the hook as a whole): a key
# `hook_use(hook, use)` in a model's unavailable hooks refuses that use only, with its reason.
PROJECTION, READOUT = "projection", "readout"
_TL_RE = re.compile(r"blocks\.(\d+)\.(.+)")
# Version of what each hook name means; written into every manifest.
HOOK_SEMANTICS_VERSION = "1"


def hook_use(hook: str, use: str) -> str:
    """The key refusing one use of a hook (PROJECTION: ablate/clamp along a vector and
    `when` gates; READOUT) in a model's unavailable hooks, where the hook itself is offered
    (tensor parallelism splits mlp_post's and attn_z's columns across the ranks)."""
    return f"{hook}:{use}"


class HookNameError(errors.InvalidInput, ValueError):
    """An unknown hook name; the message lists the accepted ones."""


def canonical_hook(name: object) -> str:
    """Map a hook name or alias to its canonical name, or raise HookNameError."""
    if isinstance(name, str):
        key = name.strip()
        if key.startswith("hook_"):
            key = key[len("hook_"):]
        if key in HOOKS:
            return key
        if key in ALIASES:
            return ALIASES[key]
    accepted = ", ".join((*HOOKS, *ALIASES))
    raise HookNameError(f"unknown hook {name!r}; accepted: {accepted}")


def read_only_refusal(hook: str) -> str | None:
    """Why a steering item may not name `hook` (None: it may): capture-only hooks are
    read, never steered."""
    if hook in CAPTURE_ONLY:
        return f"{hook} is read only (capture and readout): steering it is not offered"
    return None


def parse_item_hook(item: Mapping, field: str, unavailable: Mapping[str, str] | None,
                    error_cls: Callable[[str, str], Exception],
                    refusal: Callable[[str], str | None] = read_only_refusal) -> str:
    """A steering item's canonical `hook` (default resid_post), or `error_cls(field +
    ".hook", reason)` raised: one parse for every op kind, so the name, the model's
    unavailable hooks and the op's own refusal (`refusal`) are checked in one order."""
    try:
        hook = canonical_hook(item.get("hook", "resid_post"))
    except HookNameError as exc:
        raise error_cls(field + ".hook", str(exc)) from None
    if unavailable and hook in unavailable:
        raise error_cls(field + ".hook", unavailable[hook])
    reason = refusal(hook)
    if reason is not None:
        raise error_cls(field + ".hook", reason)
    return hook


def tl_hook_name(hook: str, layer: int | str) -> str:
    """TransformerLens's name for a hook at a layer: `blocks.{layer}.hook_{hook}`, or the
    name TL gives it (`blocks.{layer}.ln2.hook_normalized` for mlp_in)."""
    canonical = canonical_hook(hook)
    return f"blocks.{layer}.{_TL_NAMES.get(canonical, 'hook_' + canonical)}"


def parse_tl_hook_name(name: object) -> tuple[str, int] | None:
    """(hook, layer) of a TransformerLens name (tl_hook_name's), or None if it is not one."""
    m = _TL_RE.fullmatch(name) if isinstance(name, str) else None
    if m is None:
        return None
    try:
        return canonical_hook(m.group(2)), int(m.group(1))
    except HookNameError:
        return None


def resolve_layer(index: int, num_layers: int) -> int:
    """Resolve a possibly negative layer index; raise ValueError when out of range."""
    resolved = index + num_layers if index < 0 else index
    if not 0 <= resolved < num_layers:
        raise ValueError(f"layer {index} out of range for a model with {num_layers} layers")
    return resolved


_INT_RE = re.compile(r"\s*-?\d+\s*")
_RANGE_RE = re.compile(r"\s*(-?\d+)\s*-\s*(-?\d+)\s*")
_SLICE_RE = re.compile(r"\s*(-?\d+)?\s*:\s*(-?\d+)?\s*")


def parse_layers(value: object, num_layers: int) -> tuple[int, ...]:
    """Resolve a layer selection to sorted unique indices.

    Accepts "all", an int, "a-b" (inclusive), "a:b" (a Python slice, either end
    optional) and lists mixing ints and such strings; negatives count from the end.
    Raises ValueError saying what is wrong.
    """
    if num_layers <= 0:
        raise ValueError(f"model has no layers (num_layers={num_layers})")

    def one(index: int) -> int:
        return resolve_layer(index, num_layers)

    def parse_str(text: str) -> list[int]:
        s = text.strip().lower()
        if s == "all":
            return list(range(num_layers))
        if _INT_RE.fullmatch(s):
            return [one(int(s))]
        m = _RANGE_RE.fullmatch(s)
        if m:
            a, b = one(int(m.group(1))), one(int(m.group(2)))
            if a > b:
                raise ValueError(f"empty range {text!r} (resolves to {a}-{b})")
            return list(range(a, b + 1))
        m = _SLICE_RE.fullmatch(s)
        if m:
            start = int(m.group(1)) if m.group(1) is not None else None
            stop = int(m.group(2)) if m.group(2) is not None else None
            for bound in (start, stop):
                if bound is not None and not -num_layers <= bound <= num_layers:
                    raise ValueError(
                        f"layer {bound} out of range for a model with {num_layers} layers")
            picked = list(range(num_layers))[slice(start, stop)]
            if not picked:
                raise ValueError(f"empty slice {text!r}")
            return picked
        raise ValueError(f"cannot parse layers {text!r}; use \"all\", [ints], \"a-b\" or \"a:b\"")

    def as_int(item: object) -> int:
        if isinstance(item, bool) or not isinstance(item, (int, np.integer)):
            raise ValueError(f"expected an integer, got {item!r}")
        return int(item)

    if isinstance(value, str):
        layers = parse_str(value)
    elif isinstance(value, (list, tuple)):
        if not value:
            raise ValueError("empty list")
        layers = []
        for item in value:
            layers.extend(parse_str(item) if isinstance(item, str) else [one(as_int(item))])
    elif isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        layers = [one(int(value))]
    else:
        raise ValueError(f"expected \"all\", a list, \"a-b\" or \"a:b\", got {value!r}")
    return tuple(sorted(set(layers)))


def width_table(hidden_size: int, hook_widths: Mapping[str, int] | None = None,
                unavailable: Mapping[str, str] | Collection[str] | None = None, *,
                steerable: bool = False) -> dict[str, int]:
    """Each hook the model has (`steerable`: each one a steering item may name), with its
    width: `hook_widths` (a ModelShape's: mlp_post's d_mlp...), else the hidden size. A
    hook of `hook_widths` absent from it (router_logits of a dense model) counts only
    where that mapping names it."""
    widths = dict(hook_widths or {})
    missing = set(unavailable or ())
    return {h: int(widths.get(h, hidden_size)) for h in HOOKS
            if h not in missing and not (steerable and h in CAPTURE_ONLY)
            and (h != "router_logits" or h in widths)}


def describe_widths(table: Mapping[str, int], hidden_size: int | None = None) -> str:
    """`128 (the hidden size: resid_pre, resid_post, ...), 256 (mlp_post)`: the widths a
    model's hooks have, for messages that refuse a width none of them has."""
    by_width: dict[int, list[str]] = {}
    for hook, width in table.items():
        by_width.setdefault(int(width), []).append(hook)
    return ", ".join(f"{w} ({'the hidden size: ' if w == hidden_size else ''}"
                     f"{', '.join(hooks)})" for w, hooks in sorted(by_width.items()))


def hook_width_text(hook: str, width: int, hidden_size: int | None = None) -> str:
    """`mlp_post is 256 wide at this model` (with `its hidden size` where it is)."""
    return f"{hook} is {width} wide at this model" + (
        " (its hidden size)" if width == hidden_size else "")
