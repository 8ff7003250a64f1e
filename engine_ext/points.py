"""Where a hook acts: the (kind, site) of a hook at a layer, and how many leading layers
a set of hooks needs (the tap op's vocabulary, shared by the plan and extraction)."""

from __future__ import annotations

from collections.abc import Iterable

from capsteer.engine_ext.families import INNER_HOOKS, STREAM, SUB, inner_site, site_layers


def hook_point(hook: str, layer: int, num_layers: int) -> tuple[int, int]:
    """(kind, site) where a hook's value is read; the same place steering acts. Stream
    sites: input_layernorm[L] = 2L, post_attention_layernorm[L] = 2L+1, final norm = 2N;
    an inner hook's (mlp_in) come after them (families.inner_site)."""
    if hook in INNER_HOOKS:
        return SUB, inner_site(hook, layer, num_layers)
    if hook == "resid_pre":
        return STREAM, 2 * layer
    if hook == "resid_mid":
        return STREAM, 2 * layer + 1
    if hook == "resid_post":
        return STREAM, 2 * layer + 2
    if hook == "attn_out":
        return SUB, 2 * layer + 1
    if hook == "mlp_out":
        return SUB, 2 * layer + 2
    raise ValueError(f"unknown hook {hook!r}")


def layers_needed(keys: Iterable[tuple[str, int]], num_layers: int) -> int | None:
    """The fewest leading layers whose forward yields every (hook, layer) of `keys` (a
    forward stopped after layer E-1 reads site 2E at the final norm), or None when
    every layer is needed. Site 2L needs layers < L, sites 2L+1 and 2L+2 layer L too, as
    does an inner hook of layer L."""
    sites = [hook_point(hook, layer, num_layers)[1] for hook, layer in keys]
    if not sites:
        return None
    # At least one layer: the final norm wants a residual.
    stop = max(1, max(site_layers(site, num_layers) for site in sites))
    return stop if stop < num_layers else None


__all__ = ["hook_point", "layers_needed"]
