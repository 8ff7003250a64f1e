"""Upload bodies in the file formats users bring (numpy .npz / .npy, torch .pt), for the
registry tests of the unit and server tiers."""

from __future__ import annotations

import io

import numpy as np
import torch


def npz_bytes(**arrays: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def pt_bytes(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def npy_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()
