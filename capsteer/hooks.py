"""Hook-point vocabulary shared by capture specs, steering specs and the engine.

Names follow TransformerLens (`blocks.L.hook_resid_post`); aliases match the
reference fork. See docs/ and ../shared/design/api.md §2.
"""

from __future__ import annotations

HOOKS: tuple[str, ...] = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out")
ALIASES: dict[str, str] = {
    "pre_attn": "resid_pre",
    "post_attn": "resid_mid",
    "post_block": "resid_post",
}
# Version of what each hook name means; written into every manifest.
HOOK_SEMANTICS_VERSION = "1"


class HookNameError(ValueError):
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


def resolve_layer(index: int, num_layers: int) -> int:
    """Resolve a possibly negative layer index; raise ValueError when out of range."""
    resolved = index + num_layers if index < 0 else index
    if not 0 <= resolved < num_layers:
        raise ValueError(f"layer {index} out of range for a model with {num_layers} layers")
    return resolved


def parse_layers(raw: object, num_layers: int) -> list[int]:
    """Resolve a layer selection: "all", [ints], "a-b" (inclusive) or "a:b" (b exclusive).

    Negative numbers count from the end. Raises ValueError saying what is wrong.
    """
    if raw == "all":
        return list(range(num_layers))
    if isinstance(raw, int) and not isinstance(raw, bool):
        return [resolve_layer(raw, num_layers)]
    if isinstance(raw, list) and raw and all(
        isinstance(v, int) and not isinstance(v, bool) for v in raw
    ):
        return sorted({resolve_layer(v, num_layers) for v in raw})
    if isinstance(raw, str):
        text = raw.strip()
        sep = ":" if ":" in text else ("-" if "-" in text[1:] else None)
        if sep is not None:
            cut = text.index(sep, 1 if sep == "-" else 0)
            lo_s, hi_s = text[:cut], text[cut + 1:]
            try:
                lo_i, hi_i = int(lo_s), int(hi_s)
            except ValueError:
                raise ValueError(f"bad layer range {raw!r}") from None
            lo = resolve_layer(lo_i, num_layers)
            if sep == "-":
                hi = resolve_layer(hi_i, num_layers) + 1
            else:
                hi = hi_i + num_layers if hi_i < 0 else min(hi_i, num_layers)
            if lo >= hi:
                raise ValueError(f"empty layer range {raw!r}")
            return list(range(lo, hi))
    raise ValueError("must be 'all', an integer, a non-empty list of integers, 'a-b' or 'a:b'")
