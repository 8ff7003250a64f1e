"""What a reader is once loaded, and the math the engine runs on it.

Two kinds: a linear probe (`LinearProbe`) and a sparse autoencoder in SAELens's
inference semantics (`SparseAutoencoder`). Each is a frozen record of tensors the
engine moves to its device once (`.to(device, dtype)`) and then reads inside the
forward. The encode functions take rows `x [n, d]` and return fixed shapes that
depend only on `n` and the reader, never on values: no host sync, no
data-dependent shapes, so they can run inside a captured graph.

The SAE math follows SAELens 6.x's inference classes (`StandardSAE`, `JumpReLUSAE`,
`TopKSAE` in `sae_lens/saes/`) operation for operation, so the feature activations
equal `SAE.encode` on the same inputs (tests/unit/test_readers_sae.py checks it).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from capsteer.config import errors

ACTIVATIONS = ("none", "sigmoid", "softmax")
ARCHITECTURES = ("standard", "jumprelu", "topk")
# Input normalizations SAE.encode applies at run time. SAELens's other values
# ("expected_average_only_in", "covariance_whitening") are identity in its inference
# classes (they are meant to be folded into the weights), so they load as "none".
RUNTIME_NORMALIZATIONS = ("none", "constant_norm_rescale", "layer_norm")
_LAYER_NORM_EPS = 1e-5  # SAELens's run_time_activation_ln_in default
_TINY = 1e-30  # keeps an all-zero row (padding) finite under constant_norm_rescale


class ReaderInputError(errors.InvalidInput, ValueError):
    """A reader argument that cannot work (feature index, top_k); `param` names it."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _moved(obj: object, device: torch.device | str | None,
           dtype: torch.dtype | None) -> dict[str, object]:
    """Tensor fields of a reader record moved to `device` / cast to `dtype`."""
    out: dict[str, object] = {}
    for f in fields(obj):  # type: ignore[arg-type]
        value = getattr(obj, f.name)
        if isinstance(value, torch.Tensor):
            out[f.name] = value.to(device=device, dtype=dtype if value.is_floating_point()
                                   else None)
    return out


@dataclass(frozen=True, eq=False)
class LinearProbe:
    """scores = activation(x @ weight.T + bias); `weight [k, d]`, `bias [k]`."""

    weight: torch.Tensor
    bias: torch.Tensor
    activation: str = "none"
    names: tuple[str, ...] | None = None

    kind = "probe"

    def __post_init__(self) -> None:
        if self.weight.ndim != 2 or self.bias.shape != (self.weight.shape[0],):
            raise ValueError(f"probe needs weight [k, d] and bias [k]; got "
                             f"{list(self.weight.shape)} and {list(self.bias.shape)}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {self.activation!r}")
        if self.names is not None and len(self.names) != self.outputs:
            raise ValueError(f"{len(self.names)} names for {self.outputs} outputs")

    @property
    def d_in(self) -> int:
        return int(self.weight.shape[1])

    @property
    def outputs(self) -> int:
        return int(self.weight.shape[0])

    def to(self, device: torch.device | str | None = None,
           dtype: torch.dtype | None = None) -> LinearProbe:
        """A copy on `device` with float tensors in `dtype` (for the engine)."""
        return replace(self, **_moved(self, device, dtype))  # type: ignore[arg-type]

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        return probe_scores(x, self.weight, self.bias, self.activation)


@dataclass(frozen=True, eq=False)
class SparseAutoencoder:
    """An SAE as SAELens's inference classes run it (see `sae_encode`).

    `W_enc [d_in, d_sae]`, `b_enc [d_sae]`, `W_dec [d_sae, d_in]`, `b_dec [d_in]`;
    `threshold [d_sae]` for JumpReLU, `k` for TopK. `normalize` is the run-time input
    normalization; `dec_norm [d_sae]` (= ||W_dec[i]||) is kept for TopK SAEs trained
    with `rescale_acts_by_decoder_norm`. `hook_name` is SAELens's metadata, if any.
    """

    arch: str
    W_enc: torch.Tensor
    b_enc: torch.Tensor
    W_dec: torch.Tensor
    b_dec: torch.Tensor
    threshold: torch.Tensor | None = None
    k: int | None = None
    normalize: str = "none"
    apply_b_dec_to_input: bool = True
    dec_norm: torch.Tensor | None = None
    hook_name: str | None = None

    kind = "sae"

    def __post_init__(self) -> None:
        d, s = self.d_in, self.d_sae
        shapes = {"W_enc": (d, s), "b_enc": (s,), "W_dec": (s, d), "b_dec": (d,)}
        if self.threshold is not None:
            shapes["threshold"] = (s,)
        if self.dec_norm is not None:
            shapes["dec_norm"] = (s,)
        for name, want in shapes.items():
            if tuple(getattr(self, name).shape) != want:
                raise ValueError(f"{name} has shape {list(getattr(self, name).shape)}, "
                                 f"expected {list(want)}")
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"unknown SAE architecture {self.arch!r}")
        if (self.arch == "jumprelu") != (self.threshold is not None):
            raise ValueError("a threshold belongs to (and only to) a jumprelu SAE")
        if (self.arch == "topk") != (self.k is not None):
            raise ValueError("k belongs to (and only to) a topk SAE")
        if self.k is not None and not 1 <= self.k <= s:
            raise ValueError(f"k={self.k} is outside 1..d_sae={s}")
        if self.dec_norm is not None and self.arch != "topk":
            raise ValueError("dec_norm (rescale_acts_by_decoder_norm) is for topk SAEs")
        if self.normalize not in RUNTIME_NORMALIZATIONS:
            raise ValueError(f"unknown run-time normalization {self.normalize!r}")

    @property
    def d_in(self) -> int:
        return int(self.W_enc.shape[0])

    @property
    def d_sae(self) -> int:
        return int(self.W_enc.shape[1])

    def to(self, device: torch.device | str | None = None,
           dtype: torch.dtype | None = None) -> SparseAutoencoder:
        """A copy on `device` with float tensors in `dtype` (for the engine)."""
        return replace(self, **_moved(self, device, dtype))  # type: ignore[arg-type]

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return sae_encode(x, self)


Reader = LinearProbe | SparseAutoencoder


def probe_scores(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                 activation: str = "none") -> torch.Tensor:
    """[n, d] rows -> [n, k] scores: activation(x @ weight.T + bias), in weight's dtype."""
    scores = x.to(weight.dtype) @ weight.T + bias
    if activation == "sigmoid":
        return torch.sigmoid(scores)
    if activation == "softmax":
        return torch.softmax(scores, dim=-1)
    if activation != "none":
        raise ValueError(f"unknown activation {activation!r}")
    return scores


def sae_encode(x: torch.Tensor, sae: SparseAutoencoder) -> torch.Tensor:
    """[n, d_in] rows -> [n, d_sae] feature activations, as SAELens's `SAE.encode`.

    Same steps in the same order as `SAE.process_sae_in` and each class's `encode`:
    cast, run-time normalization, subtract `b_dec` when `apply_b_dec_to_input`, then
    `x @ W_enc + b_enc` and the architecture's activation.
    """
    sae_in = x.to(sae.W_enc.dtype)
    if sae.normalize == "constant_norm_rescale":
        norm = sae_in.norm(dim=-1, keepdim=True).clamp_min(_TINY)
        sae_in = sae_in * ((sae.d_in ** 0.5) / norm)
    elif sae.normalize == "layer_norm":
        mu = sae_in.mean(dim=-1, keepdim=True)
        sae_in = sae_in - mu
        std = sae_in.std(dim=-1, keepdim=True)
        sae_in = sae_in / (std + _LAYER_NORM_EPS)
    if sae.apply_b_dec_to_input:
        sae_in = sae_in - sae.b_dec
    hidden_pre = sae_in @ sae.W_enc + sae.b_enc
    if sae.arch == "jumprelu":
        assert sae.threshold is not None
        return torch.relu(hidden_pre) * (hidden_pre > sae.threshold).to(hidden_pre.dtype)
    if sae.arch == "topk":
        assert sae.k is not None
        if sae.dec_norm is not None:
            hidden_pre = hidden_pre * sae.dec_norm
        values, indices = torch.topk(hidden_pre, k=sae.k, dim=-1, sorted=False)
        return torch.zeros_like(hidden_pre).scatter_(-1, indices, values.relu())
    return torch.relu(hidden_pre)


def sae_top_k(acts: torch.Tensor, k: int,
              threshold: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The `k` largest activations per row: (ids [n, k] int64, values [n, k]).

    Shapes are fixed; entries not above `threshold` (an inactive feature is 0, so the
    default keeps only active ones) have id -1 and value 0, for the host to drop.
    Within a row, kept entries come first, largest value first.
    """
    if not 1 <= k <= acts.shape[-1]:
        raise ReaderInputError(f"top_k={k} is outside 1..{acts.shape[-1]} (d_sae)", "top_k")
    values, ids = torch.topk(acts, k=k, dim=-1, sorted=True)
    keep = values > threshold
    return (torch.where(keep, ids, torch.full_like(ids, -1)),
            torch.where(keep, values, torch.zeros_like(values)))


def decoder_row(sae: SparseAutoencoder, feature: int, *,
                param: str = "feature") -> torch.Tensor:
    """Feature `feature`'s decoder direction `W_dec[feature]` ([d_in]), for steering."""
    if isinstance(feature, bool) or not isinstance(feature, int) \
            or not 0 <= feature < sae.d_sae:
        raise ReaderInputError(
            f"feature {feature!r} is not a feature index of this SAE (0..{sae.d_sae - 1})",
            param)
    return sae.W_dec[feature]
