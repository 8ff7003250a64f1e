"""Steering that reads (api.md §7): SAE-feature vectors and `when` gates.

- `"vector": {"reader": "name", "feature": i}` is that SAE's decoder row `W_dec[i]`.
- `"when": {"reader": {"name": ...}, "index": i, "above": x}` (or `"below": x`) applies
  a steering item only at tokens where the reader's score `i`, read at the item's hook
  and layer from the value before any steering there, passes the test.

Every gate the engine runs is one linear test per token, `src . g + b > 0`, where
`src` is the value at the hook (the stream, or the sublayer output for attn_out and
mlp_out). The reader's own rule becomes that test here, on the host, once per request:
- probe, activation none: z = src . W[i] + B[i]; `above x` is z > x, `below x` z < x;
- probe, sigmoid: sigmoid(z) > x <=> z > logit(x) for 0 < x < 1 (x <= 0 or x >= 1 make
  the test always or never true: a zero `g` with `b` = +1 or -1);
- probe, softmax: with two outputs, softmax(z)[i] = sigmoid(z_i - z_j), a sigmoid test
  on W[i] - W[j]; with one output the score is always 1; over more outputs the score
  depends on all of them and is refused;
- SAE (standard ReLU, JumpReLU with threshold theta), pre-activation
  pre = (src - b_dec if apply_b_dec_to_input) . W_enc[:, i] + b_enc[i]: the feature
  f = relu(pre) (JumpReLU: 0 unless pre > theta). `above x`: x < 0 always, else
  pre > max(x, theta); `below x`: x <= 0 never, else pre < max(x, theta) (theta is
  -inf for ReLU). TopK SAEs (a feature depends on every other feature) and SAEs that
  normalize their input at run time (not linear) are refused.
A gate reads src in float32, like the steering projection; a score exactly on the
threshold may land either side (rounding), as in any float comparison.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from capsteer.config import errors

WHEN_FIELDS = ("reader", "index", "above", "below")
FEATURE_FIELDS = ("reader", "feature")

# name -> the reader's tensors (steering.readers.kinds.LinearProbe / SparseAutoencoder);
# KeyError for an unknown name, InvalidInput for a reader this model cannot use.
ReaderGetter = Callable[[str], Any]


class ConditionError(errors.InvalidInput, ValueError):
    """Bad `when` or reader vector input; `field` is the path's tail under the item."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


def _array(t: Any) -> np.ndarray:
    """A reader tensor (torch, CPU) or array as float64 numpy."""
    if hasattr(t, "detach"):
        t = t.detach().to("cpu").double().numpy()
    return np.asarray(t, dtype=np.float64)


def _reader(readers: ReaderGetter | None, name: object, field: str, hidden: int,
            where: str | None = None) -> Any:
    if not isinstance(name, str) or not name:
        raise ConditionError(field, "must be a non-empty string (a registered reader's name)")
    if readers is None:
        raise ConditionError(field, "no reader registry is configured")
    try:
        reader = readers(name)
    except KeyError:
        raise ConditionError(field, f"unknown reader {name!r}") from None
    except errors.InvalidInput as exc:
        raise ConditionError(field, str(exc)) from None
    if reader.d_in != hidden:
        raise ConditionError(field, f"reader {name!r} reads width {reader.d_in}; "
                             + (where or f"this hook's width is {hidden}"))
    return reader


def _index(value: object, n: int, field: str, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConditionError(field, f"must be an integer, got {value!r}")
    if not 0 <= value < n:
        raise ConditionError(field, f"{value} is not {what} of this reader (0..{n - 1})")
    return value


def feature_vector(raw: Mapping, field: str, hidden: int,
                   readers: ReaderGetter | None, where: str | None = None) -> np.ndarray:
    """`{"reader": name, "feature": i}` -> the SAE's decoder row W_dec[i], float32; `hidden`
    is the width of the item's hook, which `where` names (hooks.hook_width_text)."""
    unknown = sorted(set(raw) - set(FEATURE_FIELDS))
    if unknown:
        raise ConditionError(f"{field}.{unknown[0]}",
                             'unknown field; an SAE feature is {"reader": name, "feature": i}')
    reader = _reader(readers, raw.get("reader"), field + ".reader", hidden, where)
    if reader.kind != "sae":
        raise ConditionError(field + ".reader", f"reader {raw['reader']!r} is a {reader.kind}, "
                                                "not an SAE: only an SAE has decoder rows")
    if "feature" not in raw:
        raise ConditionError(field + ".feature", "is required (the SAE feature's index)")
    feature = _index(raw["feature"], reader.d_sae, field + ".feature", "a feature")
    return _array(reader.W_dec[feature]).astype(np.float32)


def _threshold(value: object, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConditionError(field, f"must be a number, got {value!r}")
    try:
        number = float(value)
    except OverflowError:
        raise ConditionError(field, "is too large") from None
    if not math.isfinite(number):
        raise ConditionError(field, "must be finite")
    return number


def parse_when(raw: object, field: str, hidden: int, readers: ReaderGetter | None,
               where: str | None = None) -> tuple[np.ndarray, float]:
    """A steering item's `when` as the linear gate (g float32 [hidden], b): the item
    applies at a token where src . g + b > 0."""
    if not isinstance(raw, Mapping):
        raise ConditionError(field, 'must be an object {"reader": {"name": ...}, "index": i, '
                                    '"above": x} (or "below")')
    unknown = sorted(set(raw) - set(WHEN_FIELDS))
    if unknown:
        raise ConditionError(f"{field}.{unknown[0]}",
                             f"unknown field; accepted: {', '.join(WHEN_FIELDS)}")
    ref = raw.get("reader")
    if not (isinstance(ref, Mapping) and set(ref) == {"name"}):
        raise ConditionError(field + ".reader", 'must be {"name": ...} (a registered reader)')
    reader = _reader(readers, ref["name"], field + ".reader.name", hidden, where)
    n = reader.outputs if reader.kind == "probe" else reader.d_sae
    if "index" not in raw and not (reader.kind == "probe" and n == 1):
        raise ConditionError(field + ".index", f"is required: reader {ref['name']!r} has {n} "
                                               "outputs")
    index = _index(raw.get("index", 0), n, field + ".index",
                   "an output" if reader.kind == "probe" else "a feature")
    if ("above" in raw) == ("below" in raw):
        raise ConditionError(field, 'give exactly one of "above" and "below"')
    above = "above" in raw
    x = _threshold(raw["above" if above else "below"], field + (".above" if above else ".below"))
    at = field + ".reader.name"
    if reader.kind == "probe":
        return _probe_gate(reader, index, above, x, at)
    return _sae_gate(reader, index, above, x, at)


def _constant(passes: bool, hidden: int) -> tuple[np.ndarray, float]:
    """A test whose answer does not depend on the token."""
    return np.zeros(hidden, np.float32), 1.0 if passes else -1.0


def _linear(p: np.ndarray, c: float, t: float, above: bool) -> tuple[np.ndarray, float]:
    """src . p + c > t (above) or < t (below), as src . g + b > 0."""
    if above:
        return p.astype(np.float32), float(c - t)
    return (-p).astype(np.float32), float(t - c)


def _probe_gate(probe: Any, i: int, above: bool, x: float,
                field: str) -> tuple[np.ndarray, float]:
    weight, bias = _array(probe.weight), _array(probe.bias)
    k, hidden = weight.shape
    p, c, activation = weight[i], float(bias[i]), probe.activation
    if activation == "softmax":
        if k == 1:  # softmax of one output is 1 at every token
            return _constant(1.0 > x if above else 1.0 < x, hidden)
        if k > 2:
            raise ConditionError(field, f"a softmax probe's score over {k} outputs depends on "
                                        "all of them, not one linear test; a `when` takes a "
                                        "softmax probe of at most 2 outputs (or use "
                                        "activation none/sigmoid)")
        j = 1 - i  # softmax(z)[i] = sigmoid(z_i - z_j) for two outputs
        p, c, activation = weight[i] - weight[j], float(bias[i] - bias[j]), "sigmoid"
    if activation == "sigmoid":
        if x <= 0.0 or x >= 1.0:  # sigmoid lies in (0, 1)
            return _constant(above == (x <= 0.0), hidden)
        return _linear(p, c, math.log(x) - math.log1p(-x), above)
    return _linear(p, c, x, above)


def _sae_gate(sae: Any, i: int, above: bool, x: float,
              field: str) -> tuple[np.ndarray, float]:
    if sae.arch == "topk":
        raise ConditionError(field, "a TopK SAE's feature depends on every other feature "
                                    "(whether it is among the k largest), so it is not one "
                                    "linear test per token; use a ReLU or JumpReLU SAE, or "
                                    "a probe")
    if sae.normalize != "none":
        raise ConditionError(field, f"this SAE normalizes its input at run time "
                                    f"({sae.normalize}), so a feature is not one linear test "
                                    "per token")
    p = _array(sae.W_enc[:, i])  # one column: an SAE can be GBs
    c = float(_array(sae.b_enc[i]))
    if sae.apply_b_dec_to_input:
        c -= float(_array(sae.b_dec) @ p)
    hidden = p.shape[0]
    if above and x < 0.0:  # a feature is never negative
        return _constant(True, hidden)
    if not above and x <= 0.0:
        return _constant(False, hidden)
    floor = float(_array(sae.threshold[i])) if sae.arch == "jumprelu" else -math.inf
    return _linear(p, c, max(x, floor), above)
