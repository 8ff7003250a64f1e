"""Checks of the numbers a steering request carries (scales, values, vectors inline or as
base64), and the error every steering check raises, naming the request field."""

from __future__ import annotations

import base64
import math
from collections.abc import Mapping

import numpy as np

from capsteer.config import errors

MAX_ABS = 1e30  # far inside float32; anything larger overflows the stream anyway
B64_DTYPES = {"float32": np.float32, "float16": np.float16, "float64": np.float64, "bfloat16": None}


class SteeringSpecError(errors.InvalidInput, ValueError):
    """Invalid steering input; `field` names the offending request field."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = self.param = field
        self.reason = reason


def finite_number(value: object, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SteeringSpecError(field, "must be a number")
    try:
        number = float(value)
    except OverflowError:
        raise SteeringSpecError(field, "is too large") from None
    if not math.isfinite(number) or abs(number) > MAX_ABS:
        raise SteeringSpecError(field, f"must be finite and at most {MAX_ABS:g} in magnitude")
    return number


def check_vector(vec: np.ndarray, field: str, width: int, where: str | None = None,
                 what: str = "vector") -> np.ndarray:
    """`vec` as float32 if it is `width` wide and finite; `where` says whose width that is
    (hooks.hook_width_text: `mlp_post is 256 wide at this model`), `what` names the vector
    (`vector 'honesty'`)."""
    if vec.ndim != 1 or vec.shape[0] != width:
        raise SteeringSpecError(field, f"{what} has width {vec.shape[-1] if vec.ndim else 0}; "
                                       + (where or f"the model's hidden size is {width}"))
    if not np.isfinite(vec).all() or (vec.size and float(np.abs(vec).max()) > MAX_ABS):
        raise SteeringSpecError(field, f"vector holds non-finite numbers or values beyond "
                                       f"{MAX_ABS:g} (float32 would overflow)")
    return vec.astype(np.float32)


def decode_b64(raw: Mapping, field: str) -> np.ndarray:
    dtype = raw.get("dtype", "float32")
    if not isinstance(dtype, str) or dtype not in B64_DTYPES:
        raise SteeringSpecError(field + ".dtype", f"must be one of {', '.join(B64_DTYPES)}")
    try:
        data = base64.b64decode(raw["b64"], validate=True)
    except (ValueError, TypeError):
        raise SteeringSpecError(field + ".b64", "is not valid base64") from None
    if dtype == "bfloat16":
        if len(data) % 2:
            raise SteeringSpecError(field + ".b64", "byte length is not a multiple of 2")
        bits = np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16
        return bits.view(np.float32)
    np_dtype = np.dtype(B64_DTYPES[dtype]).newbyteorder("<")
    if len(data) % np_dtype.itemsize:
        raise SteeringSpecError(field + ".b64", f"byte length is not a multiple of {np_dtype.itemsize}")
    return np.frombuffer(data, dtype=np_dtype).astype(np.float32)


def all_numbers(values: list) -> bool:
    """Numbers, not bools (a bool is an int); exact types first, as JSON gives them."""
    if set(map(type, values)) <= {int, float}:
        return True
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
