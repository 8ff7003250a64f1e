"""HF transformers reference for every hook point and steering op.

The ground truth capsteer is checked against: the same weights run by
transformers, with forward hooks reading (or changing) the same points.
resid_pre[L] = hidden_states[L]; resid_post[L] = stream leaving layer L (before
the final norm for the last layer); resid_mid[L], attn_out[L], mlp_out[L] = the
input / outputs of the family's modules (engine_ext/families.py); mlp_in[L] = the
input of the family's MLP module (the pre-MLP norm's output), steered by a pre-hook that
hands the MLP a new tensor (the stream, and in Cohere's shared-norm parallel block
attention's input, stay as they were); mlp_post[L] = the input of the MLP's output
projection (down_proj, GPT-2's c_proj, GPT-NeoX's dense_4h_to_h), steered the same way
(a neuron selection zeroes, sets or adds at the selected neurons only). A parallel
block (GPT-NeoX, Cohere) has no resid_mid: it is neither read nor steerable here.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager

import torch

from capsteer.engine_ext.families import (
    TRANSFORMERS_STREAM,
    Family,
    family_for,
    unavailable_hooks,
)
from capsteer.steering.spec import SteeringSpec


def load_hf(model_dir: str, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """The HF model in eval mode with HF's eager attention: its sdpa path silently drops
    what sdpa cannot express (Gemma 2's attention logit soft-capping), so it is not the
    architecture's ground truth."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation="eager").to(device)
    model.eval()
    return model


def _apply(op, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The op on `target` (ablate/clamp project target itself) at the masked positions,
    where its `when` gate passes on `target` (exact for one gated op per point: capsteer
    reads a point's gate once, before every op there)."""
    vec = torch.as_tensor(op.vector, dtype=torch.float32, device=target.device)
    tf = target.float()
    if getattr(op, "gate", None) is not None:
        gate = torch.as_tensor(op.gate, dtype=torch.float32, device=target.device)
        mask = mask & ((tf * gate).sum(-1) + op.gate_bias > 0)
    select = getattr(op, "select", None)  # a selection's mask (steering/selections.py)
    sel = None if select is None else torch.as_tensor(select, dtype=torch.float32,
                                                      device=target.device)
    if sel is not None and op.op != "add":  # zero the selected slices (clamp: set them)
        delta = -tf * sel + (op.value * sel if op.op == "clamp" else 0.0)
    elif op.op == "add":
        delta = op.scale * (vec if sel is None else vec * sel)
    else:
        proj = (tf * vec).sum(-1, keepdim=True)
        delta = -proj * vec + (op.value * vec if op.op == "clamp" else 0.0)
    out = torch.where(mask.unsqueeze(-1), tf + delta, tf)
    return out.to(target.dtype)


SUB_HOOKS = ("attn_out", "mlp_out", "mlp_in", "mlp_post", "attn_z")
_INPUT_OF = {"mlp_in": "mlp_in", "mlp_post": "mlp_post", "attn_z": "attn_z"}  # Family fields


def hf_family(model) -> Family:
    """The family row (engine_ext/families.py) naming this HF model's hook modules; the
    stream-only layout for an architecture without one."""
    names = list(getattr(model.config, "architectures", None) or ()) or [type(model).__name__]
    return family_for(names[0]) or TRANSFORMERS_STREAM  # as vLLM's Transformers backend


def _missing(model, family: Family) -> dict[str, str]:
    """The hooks this model lacks (the stream-only layout's reasons name the architecture,
    so they read the top-level config)."""
    return unavailable_hooks(family, model.config)


def decoder_layers(model, family: Family):
    """The HF model's decoder layers (`model.layers`, GPT-2's `transformer.h`)."""
    return getattr(model.base_model, family.layers)


def _sub(layer, path: str):
    for part in path.split("."):
        layer = getattr(layer, part)
    return layer


def _first(output):
    return output[0] if isinstance(output, tuple) else output


def _with_first(output, value):
    return (value, *output[1:]) if isinstance(output, tuple) else value


def _layer_input(args, kwargs):
    return args[0] if args else kwargs["hidden_states"]


def _position_mask(hidden: torch.Tensor, positions: str, prompt_len: int) -> torch.Tensor:
    pos = torch.arange(hidden.shape[1], device=hidden.device)
    if positions == "prompt":
        m = pos < prompt_len
    elif positions == "generated":
        m = pos >= prompt_len
    else:
        m = torch.ones_like(pos, dtype=torch.bool)
    return m.unsqueeze(0).expand(hidden.shape[0], -1)


def _steering_handles(model, spec: SteeringSpec | None, prompt_len: int, sublayer: bool) -> list:
    """HF hooks applying the ops of one kind (sublayer outputs or stream points).

    resid_post(L) and resid_pre(L+1) are one point: both become pre-hooks of layer L+1,
    so ops there apply in request order, as capsteer composes them. resid_mid edits the
    stream in place at the input of the family's resid_mid module: the layer's residual
    is that same tensor, so the add and the MLP both see it, as in capsteer.
    """
    if not (spec and spec.ops):
        return []
    family = hf_family(model)
    missing = _missing(model, family)
    handles = []
    layers = decoder_layers(model, family)
    last = len(layers) - 1
    for op in spec.ops:
        if op.hook in missing:
            raise ValueError(missing[op.hook])
        if (op.hook in SUB_HOOKS) != sublayer:
            continue
        hook, index = op.hook, op.layer
        if hook == "resid_post" and index < last:
            hook, index = "resid_pre", index + 1
        layer = layers[index]
        if hook == "resid_pre" or hook in _INPUT_OF:  # the module gets a new input
            # tensor (mlp_in's is attention's input too in Cohere's parallel block:
            # attention keeps it; mlp_post's and attn_z's are an output projection's)
            def pre(mod, args, kwargs, op=op):
                h = _layer_input(args, kwargs)
                h = _apply(op, h, _position_mask(h, op.positions, prompt_len))
                return ((h, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": h})
            module = layer if hook == "resid_pre" else _sub(
                layer, getattr(family, _INPUT_OF[hook]))
            handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        elif hook == "resid_post":  # last layer: the stream entering the final norm
            def post(mod, args, kwargs, output, op=op):
                h = _first(output)
                return _with_first(output, _apply(op, h, _position_mask(
                    h, op.positions, prompt_len)))
            handles.append(layer.register_forward_hook(post, with_kwargs=True))
        elif hook == "resid_mid":
            def mid(mod, args, kwargs, op=op):
                h = _layer_input(args, kwargs)
                h.copy_(_apply(op, h, _position_mask(h, op.positions, prompt_len)))
            handles.append(_sub(layer, family.resid_mid).register_forward_pre_hook(
                mid, with_kwargs=True))
        else:  # attn_out / mlp_out edit the sublayer output the stream adds
            def out(mod, args, output, op=op):
                o = _first(output)
                return _with_first(output, _apply(op, o, _position_mask(
                    o, op.positions, prompt_len)))
            module = family.attn_out if hook == "attn_out" else family.mlp_out
            handles.append(_sub(layer, module).register_forward_hook(out))
    return handles


@contextmanager
def steering_hooks(model, spec: SteeringSpec | None, prompt_len: int):
    """Apply `spec` with HF hooks (positions by absolute index) for the duration."""
    handles = _steering_handles(model, spec, prompt_len, sublayer=True)
    handles += _steering_handles(model, spec, prompt_len, sublayer=False)
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextmanager
def hf_patched(model, patches: list[tuple[str, int, list[int], torch.Tensor]]):
    """HF hooks doing what `op: patch` does (steering/patches.py): the value at (hook,
    layer) at absolute `positions` set to `values` ([P, hidden]); resid_post as the stream
    entering the next layer (not the last layer), mlp_out as the MLP's output. Positions
    past the sequence are skipped, as a request that never feeds them."""
    family = hf_family(model)
    layers = decoder_layers(model, family)
    handles = []

    def replace(h: torch.Tensor, positions: list[int], values: torch.Tensor) -> torch.Tensor:
        h = h.clone()
        inside = [i for i, p in enumerate(positions) if p < h.shape[1]]
        h[0, [positions[i] for i in inside]] = values[inside].to(h.dtype)
        return h

    for hook, layer, positions, values in patches:
        if hook == "resid_post":
            def pre(mod, args, kwargs, positions=positions, values=values):
                if args:
                    return (replace(args[0], positions, values), *args[1:]), kwargs
                return args, {**kwargs, "hidden_states": replace(kwargs["hidden_states"],
                                                                 positions, values)}
            handles.append(layers[layer + 1].register_forward_pre_hook(pre, with_kwargs=True))
        else:
            assert hook == "mlp_out"
            module = layers[layer]
            for part in family.mlp_out.split("."):
                module = getattr(module, part)

            def out(mod, args, output, positions=positions, values=values):
                if isinstance(output, tuple):
                    return (replace(output[0], positions, values), *output[1:])
                return replace(output, positions, values)
            handles.append(module.register_forward_hook(out))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def hf_activations(
    model, token_ids: Sequence[int], steering: SteeringSpec | None = None, prompt_len: int = 0
) -> dict[tuple[str, int], torch.Tensor]:
    """Every hook at every layer and position for one sequence: {(hook, layer): [T, hidden]}.

    Registration order mirrors capsteer: at one point, sublayer steering, then the
    sublayer reading, then stream steering, then the stream reading. The modules read
    are the family's (engine_ext/families.py): e.g. Gemma 2's attn_out is the output of
    post_attention_layernorm, OLMo 2's resid_mid is the MLP's input.
    """
    family = hf_family(model)
    missing = _missing(model, family)
    out: dict[tuple[str, int], torch.Tensor] = {}

    def keep(key, tensor):
        out[key] = tensor[0].detach().clone()

    layers = decoder_layers(model, family)
    handles = _steering_handles(model, steering, prompt_len, sublayer=True)
    for i, layer in enumerate(layers):
        if "attn_out" not in missing:
            handles.append(_sub(layer, family.attn_out).register_forward_hook(
                lambda m, a, o, i=i: keep(("attn_out", i), _first(o))))
        if "mlp_out" not in missing:
            handles.append(_sub(layer, family.mlp_out).register_forward_hook(
                lambda m, a, o, i=i: keep(("mlp_out", i), _first(o))))
        if "mlp_in" not in missing:
            handles.append(_sub(layer, family.mlp_in).register_forward_pre_hook(
                lambda m, a, k, i=i: keep(("mlp_in", i), _layer_input(a, k)), with_kwargs=True))
        if "router_logits" not in missing:  # an MoE router's output: [tokens, n_experts]
            handles.append(_sub(layer, family.router).register_forward_hook(
                lambda m, a, o, i=i: out.__setitem__(
                    ("router_logits", i), _first(o).reshape(-1, _first(o).shape[-1])
                    .detach().clone())))
        for hook in ("mlp_post", "attn_z"):  # an output projection's input
            if hook not in missing:
                handles.append(_sub(layer, getattr(family, hook)).register_forward_pre_hook(
                    lambda m, a, k, i=i, hook=hook: keep((hook, i), _layer_input(a, k)),
                    with_kwargs=True))
    handles += _steering_handles(model, steering, prompt_len, sublayer=False)
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(
            lambda m, a, k, i=i: keep(("resid_pre", i), _layer_input(a, k)), with_kwargs=True))
        if "resid_mid" not in missing:
            handles.append(_sub(layer, family.resid_mid).register_forward_pre_hook(
                lambda m, a, k, i=i: keep(("resid_mid", i), _layer_input(a, k)),
                with_kwargs=True))
        if i + 1 < len(layers):  # the same point as resid_pre(i+1)
            handles.append(layers[i + 1].register_forward_pre_hook(
                lambda m, a, k, i=i: keep(("resid_post", i), _layer_input(a, k)),
                with_kwargs=True))
        else:
            handles.append(layer.register_forward_hook(
                lambda m, a, k, o, i=i: keep(("resid_post", i), _first(o)), with_kwargs=True))
    try:
        model(torch.tensor([list(token_ids)], device=model.device))
    finally:
        for h in handles:
            h.remove()
    return out


@torch.no_grad()
def hf_greedy(
    model, prompt_ids: Sequence[int], max_tokens: int, steering: SteeringSpec | None = None
) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and the log-softmax at each step, recomputing the full sequence."""
    ids = list(prompt_ids)
    logprobs = []
    with steering_hooks(model, steering, len(prompt_ids)):
        for _ in range(max_tokens):
            logits = model(torch.tensor([ids], device=model.device)).logits[0, -1].float()
            lp = torch.log_softmax(logits, -1)
            logprobs.append(lp)
            ids.append(int(lp.argmax()))
    return ids[len(prompt_ids):], logprobs
