"""The `capsteer::tap` op every tapped module calls, and the key tensors that name sites.

The op forwards to the worker's HookRuntime (engine_ext.runtime), which holds the plan;
it is registered straight with the dispatcher when this module is imported (the taps
that call it, engine_ext.vllm.sites.install_tap, import it first).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from capsteer.engine_ext.runtime import HookRuntime

RUNTIME: HookRuntime | None = None  # the worker's (one model per process)

# Which site each tap's key tensor names, by the key's address. The site is not an int
# argument of the op because a constant differs in every layer: torch.compile then
# builds one compiled piece per layer (28 on Qwen3-0.6B) where vanilla vLLM runs one
# piece 28 times, and a step too large for CUDA graphs paid for the distinct pieces in
# host time. A key is a graph input like the layer's weights, so the pieces stay equal.
_SITE_BY_KEY: dict[int, int] = {}


def install_runtime(runtime: HookRuntime | None) -> None:
    global RUNTIME
    RUNTIME = runtime


def new_site_key(site: int, device: torch.device | str) -> torch.Tensor:
    """A key tensor that names `site` for the op (kept alive by its module, as a buffer)."""
    key = torch.full((1,), site, dtype=torch.int32, device=device)
    _SITE_BY_KEY[key.data_ptr()] = site  # a newer key at a reused address replaces the old
    return key


def site_of(key: torch.Tensor) -> int:
    site = _SITE_BY_KEY.get(key.data_ptr())
    if site is None:  # never guess: a wrong site would capture or steer the wrong layer
        raise RuntimeError("capsteer: the tap op got a key no site registered (the model's "
                           "buffers moved after the hooks were installed?)")
    return site


def tap(x: torch.Tensor, residual: torch.Tensor | None, key: torch.Tensor, kinds: int) -> None:
    """Steer `x` in place and copy captured rows at one site (see module docstring)."""
    if RUNTIME is not None:
        RUNTIME.tap(x, residual, site_of(key), kinds)


def _tap_fake(x: torch.Tensor, residual: torch.Tensor | None, key: torch.Tensor,
              kinds: int) -> None:
    return None


# Registered straight with the dispatcher, as vLLM registers its own ops: every step
# that runs outside a CUDA graph calls the op once per site, and `torch.library.custom_op`'s
# Python wrappers cost ~9-13 us a call against ~1.6 us here (CPU).
# `x` is mutated, nothing is returned; `key` is only read (for its address).
TAP_SCHEMA = "tap(Tensor(a!) x, Tensor? residual, Tensor key, int kinds) -> ()"
_LIBRARY = torch.library.Library("capsteer", "FRAGMENT")
_LIBRARY.define(TAP_SCHEMA)
_LIBRARY.impl("tap", tap, "CompositeExplicitAutograd")
torch.library.register_fake("capsteer::tap", _tap_fake, lib=_LIBRARY)
