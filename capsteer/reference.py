"""HF transformers reference for every hook point and steering op.

The ground truth capsteer is checked against: the same weights run by
transformers, with forward hooks reading (or changing) the same points.
resid_pre[L] = hidden_states[L]; resid_post[L] = stream leaving layer L (before
the final norm for the last layer); resid_mid[L] = input of
post_attention_layernorm; attn_out / mlp_out = the sublayer outputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager

import torch

from capsteer.steering.spec import SteeringSpec


def load_hf(model_dir: str, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    model.eval()
    return model


def _apply(op, target: torch.Tensor, stream: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """target is what the op edits; stream is what ablate/clamp project (may be target)."""
    vec = torch.as_tensor(op.vector, dtype=torch.float32, device=target.device)
    tf = target.float()
    if op.op == "add":
        delta = op.scale * vec
    else:
        proj = (stream.float() * vec).sum(-1, keepdim=True)
        delta = -proj * vec + (op.value * vec if op.op == "clamp" else 0.0)
    out = torch.where(mask.unsqueeze(-1), tf + delta, tf)
    return out.to(target.dtype)


SUB_HOOKS = ("attn_out", "mlp_out")


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
    so ops there apply in request order, as capsteer composes them.
    """
    handles = []
    layers = model.model.layers
    last = len(layers) - 1
    layer_inputs: dict[int, torch.Tensor] = {}
    keep_inputs: set[int] = set()
    for op in (spec.ops if spec else ()):
        if (op.hook in SUB_HOOKS) != sublayer:
            continue
        hook, index = op.hook, op.layer
        if hook == "resid_post" and index < last:
            hook, index = "resid_pre", index + 1
        layer = layers[index]
        if hook == "resid_pre":
            def pre(mod, args, kwargs, op=op):
                h = args[0] if args else kwargs["hidden_states"]
                h = _apply(op, h, h, _position_mask(h, op.positions, prompt_len))
                return ((h, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": h})
            handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
        elif hook == "resid_post":  # last layer: the stream entering the final norm
            def post(mod, args, kwargs, output, op=op):
                h = output[0] if isinstance(output, tuple) else output
                h = _apply(op, h, h, _position_mask(h, op.positions, prompt_len))
                return (h, *output[1:]) if isinstance(output, tuple) else h
            handles.append(layer.register_forward_hook(post, with_kwargs=True))
        elif hook == "mlp_out":
            def mlp(mod, args, output, op=op):
                return _apply(op, output, output, _position_mask(output, op.positions, prompt_len))
            handles.append(layer.mlp.register_forward_hook(mlp))
        else:  # attn_out edits the attention output; resid_mid projects the stream after it
            keep_inputs.add(index)

            def attn(mod, args, output, op=op):
                o = output[0]
                stream = layer_inputs[op.layer] + o if op.hook == "resid_mid" else o
                return (_apply(op, o, stream, _position_mask(o, op.positions, prompt_len)),
                        *output[1:])
            handles.append(layer.self_attn.register_forward_hook(attn))
    for index in sorted(keep_inputs):  # after every pre-hook: the steered layer input
        def keep_input(mod, args, kwargs, idx=index):
            layer_inputs[idx] = args[0] if args else kwargs["hidden_states"]
        handles.append(layers[index].register_forward_pre_hook(keep_input, with_kwargs=True))
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


@torch.no_grad()
def hf_activations(
    model, token_ids: Sequence[int], steering: SteeringSpec | None = None, prompt_len: int = 0
) -> dict[tuple[str, int], torch.Tensor]:
    """Every hook at every layer and position for one sequence: {(hook, layer): [T, hidden]}.

    Registration order mirrors capsteer: at one point, sublayer steering, then the
    sublayer reading, then stream steering, then the stream reading.
    """
    out: dict[tuple[str, int], torch.Tensor] = {}

    def keep(key, tensor):
        out[key] = tensor[0].detach().clone()

    handles = _steering_handles(model, steering, prompt_len, sublayer=True)
    for i, layer in enumerate(model.model.layers):
        handles.append(layer.self_attn.register_forward_hook(
            lambda m, a, o, i=i: keep(("attn_out", i), o[0])))
        handles.append(layer.mlp.register_forward_hook(
            lambda m, a, o, i=i: keep(("mlp_out", i), o)))
    handles += _steering_handles(model, steering, prompt_len, sublayer=False)
    for i, layer in enumerate(model.model.layers):
        handles.append(layer.register_forward_pre_hook(
            lambda m, a, k, i=i: keep(("resid_pre", i), a[0] if a else k["hidden_states"]),
            with_kwargs=True))
        handles.append(layer.post_attention_layernorm.register_forward_pre_hook(
            lambda m, a, i=i: keep(("resid_mid", i), a[0])))
        if i + 1 < len(model.model.layers):  # the same point as resid_pre(i+1)
            handles.append(model.model.layers[i + 1].register_forward_pre_hook(
                lambda m, a, k, i=i: keep(("resid_post", i), a[0] if a else k["hidden_states"]),
                with_kwargs=True))
        else:
            handles.append(layer.register_forward_hook(
                lambda m, a, k, o, i=i: keep(("resid_post", i),
                                             o[0] if isinstance(o, tuple) else o),
                with_kwargs=True))
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
