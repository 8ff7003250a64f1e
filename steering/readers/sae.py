"""SAELens's saved SAE directories: read `cfg.json` + `sae_weights.safetensors`.

An SAE arrives as a tar (optionally gzip'd) or zip of the directory SAELens's
`SAE.save_model` writes, or sits as such a directory under the readers root.
Archives are never extracted by member name: the one `cfg.json` and the
`sae_weights.safetensors` beside it are copied, with byte limits, into files this
module names, and links, devices, absolute names and `..` are refused.

The config is read as SAELens 6.x's `SAE.load_from_disk` reads it
(`sae_lens/loading/pretrained_sae_loaders.py`): configs older than 6.0 are
renamed and defaulted as `handle_pre_6_0_config` does (`hook_point` -> `hook_name`,
boolean `normalize_activations`, TopK from `activation_fn_kwargs.k`), JumpReLU's
`log_threshold` becomes `threshold` (`JumpReLUSAE.process_state_dict_for_loading`),
and an all-ones `scaling_factor` is dropped (`read_sae_components_from_disk`).
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import tarfile
import zipfile
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

import torch

from capsteer.hooks import describe_widths
from capsteer.steering.readers.formats import ReaderFormatError, ReaderTooLargeError
from capsteer.steering.readers.kinds import SparseAutoencoder

CFG_FILE = "cfg.json"
WEIGHTS_FILE = "sae_weights.safetensors"
MAX_SAE_BYTES = 4 << 30  # one archive, and its weights file once extracted
MAX_CFG_BYTES = 1 << 20
MAX_MEMBERS = 4096
MAX_D_SAE = 1 << 24
_NORMALIZE = {"none": "none", "constant_norm_rescale": "constant_norm_rescale",
              "layer_norm": "layer_norm",
              # identity in SAELens's inference SAE.encode (meant to be folded in)
              "expected_average_only_in": "none", "covariance_whitening": "none"}
_COPY_CHUNK = 1 << 20


@dataclass(frozen=True, eq=False)
class DecodedSAE:
    """A checked SAE (float32 tensors on the CPU) and what describes it."""

    sae: SparseAutoencoder
    config: dict[str, Any]  # architecture, d_in, d_sae, k, normalize_activations, ...


def extract_archive(source: bytes | Path, dest: Path, fmt: str) -> None:
    """Copy the SAE's `cfg.json` and `sae_weights.safetensors` out of a tar or zip
    into `dest` (an empty directory this process owns), within the byte limits."""
    size = len(source) if isinstance(source, bytes) else source.stat().st_size
    if size > MAX_SAE_BYTES:
        raise ReaderTooLargeError(f"archive is {size} bytes; the limit is {MAX_SAE_BYTES}",
                                  "body")
    if fmt == "tar":
        _extract_tar(source, dest)
    elif fmt == "zip":
        _extract_zip(source, dest)
    else:
        raise ReaderFormatError(f"{fmt} is not an SAE archive format (tar or zip)", "format")


def _member_path(name: str) -> PurePosixPath:
    """A member name as a relative path; anything that could escape is refused."""
    path = PurePosixPath(name.replace("\\", "/"))
    if path.is_absolute() or ".." in path.parts or re.match(r"^[A-Za-z]:", name):
        raise ReaderFormatError(f"archive member {name!r} has an unsafe path", "body")
    return path


def _pick_members(entries: dict[PurePosixPath, int]) -> tuple[PurePosixPath, PurePosixPath]:
    """The one cfg.json and the weights file in the same folder."""
    cfgs = [p for p in entries if p.name == CFG_FILE]
    if len(cfgs) != 1:
        raise ReaderFormatError(
            f"archive holds {len(cfgs)} {CFG_FILE} files; expected one SAELens directory "
            f"({CFG_FILE} + {WEIGHTS_FILE})", "body")
    weights = cfgs[0].parent / WEIGHTS_FILE
    if weights not in entries:
        raise ReaderFormatError(f"archive has no {WEIGHTS_FILE} beside {cfgs[0]}", "body")
    if entries[cfgs[0]] > MAX_CFG_BYTES:
        raise ReaderTooLargeError(f"{CFG_FILE} is over {MAX_CFG_BYTES} bytes", "body")
    if entries[weights] > MAX_SAE_BYTES:
        raise ReaderTooLargeError(f"{WEIGHTS_FILE} is over {MAX_SAE_BYTES} bytes", "body")
    return cfgs[0], weights


def _copy_bounded(src: BinaryIO, dest: Path, limit: int) -> None:
    """Copy at most `limit` bytes (a member whose header lies about its size fails)."""
    written = 0
    with open(dest, "xb") as out:
        while chunk := src.read(_COPY_CHUNK):
            written += len(chunk)
            if written > limit:
                raise ReaderTooLargeError(f"{dest.name} is over {limit} bytes", "body")
            out.write(chunk)


def _extract_tar(source: bytes | Path, dest: Path) -> None:
    try:
        tf = (tarfile.open(fileobj=io.BytesIO(source), mode="r:*") if isinstance(source, bytes)
              else tarfile.open(source, mode="r:*"))
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise ReaderFormatError(f"not a readable tar archive: {exc}", "body") from None
    with tf:
        entries: dict[PurePosixPath, int] = {}
        members: dict[PurePosixPath, tarfile.TarInfo] = {}
        try:
            for count, member in enumerate(tf):
                if count >= MAX_MEMBERS:
                    raise ReaderFormatError(f"archive has over {MAX_MEMBERS} members", "body")
                path = _member_path(member.name)
                if member.issym() or member.islnk() or member.isdev() or member.isfifo():
                    raise ReaderFormatError(
                        f"archive member {member.name!r} is a link or device; only regular "
                        "files are accepted", "body")
                if member.isfile():
                    entries[path], members[path] = member.size, member
            cfg, weights = _pick_members(entries)
            for path, name in ((cfg, CFG_FILE), (weights, WEIGHTS_FILE)):
                src = tf.extractfile(members[path])
                assert src is not None  # a regular file always has data
                _copy_bounded(src, dest / name, MAX_CFG_BYTES if name == CFG_FILE
                              else MAX_SAE_BYTES)
        except (tarfile.TarError, EOFError, zlib.error) as exc:
            raise ReaderFormatError(f"damaged tar archive: {exc}", "body") from None


def _extract_zip(source: bytes | Path, dest: Path) -> None:
    try:
        zf = zipfile.ZipFile(io.BytesIO(source) if isinstance(source, bytes) else source)
    except (zipfile.BadZipFile, OSError) as exc:
        raise ReaderFormatError(f"not a readable zip archive: {exc}", "body") from None
    with zf:
        infos = zf.infolist()
        if len(infos) > MAX_MEMBERS:
            raise ReaderFormatError(f"archive has over {MAX_MEMBERS} members", "body")
        entries: dict[PurePosixPath, int] = {}
        by_path: dict[PurePosixPath, zipfile.ZipInfo] = {}
        for info in infos:
            path = _member_path(info.filename)
            mode = (info.external_attr >> 16) & 0o170000
            if mode and mode not in (0o100000, 0o040000):  # symlinks and the like
                raise ReaderFormatError(
                    f"archive member {info.filename!r} is not a regular file", "body")
            if not info.is_dir():
                entries[path], by_path[path] = info.file_size, info
        cfg, weights = _pick_members(entries)
        try:
            for path, name in ((cfg, CFG_FILE), (weights, WEIGHTS_FILE)):
                with zf.open(by_path[path]) as src:
                    _copy_bounded(src, dest / name, MAX_CFG_BYTES if name == CFG_FILE
                                  else MAX_SAE_BYTES)
        except (zipfile.BadZipFile, OSError, EOFError, zlib.error) as exc:
            raise ReaderFormatError(f"damaged zip archive: {exc}", "body") from None


def read_config(directory: Path) -> dict[str, Any]:
    """`cfg.json` with SAELens's pre-6.0 renames and defaults applied."""
    path = directory / CFG_FILE
    try:
        if path.stat().st_size > MAX_CFG_BYTES:
            raise ReaderTooLargeError(f"{CFG_FILE} is over {MAX_CFG_BYTES} bytes", "body")
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ReaderFormatError(f"no {CFG_FILE} in the SAE directory", "body") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ReaderFormatError(f"{CFG_FILE} is not valid JSON: {exc}", "body") from None
    if not isinstance(cfg, dict):
        raise ReaderFormatError(f"{CFG_FILE} must hold a JSON object", "body")
    metadata = cfg.get("metadata") if isinstance(cfg.get("metadata"), dict) else {}
    version = cfg.get("sae_lens_version") or metadata.get("sae_lens_version")
    if _major(version) < 6:
        cfg = _pre_6_0(cfg)
    return cfg


def _major(version: object) -> int:
    m = re.match(r"\s*(\d+)", str(version)) if version else None
    return int(m.group(1)) if m else 0


def _pre_6_0(cfg: dict[str, Any]) -> dict[str, Any]:
    """As SAELens's `handle_pre_6_0_config`, for the keys an encoder needs."""
    renames = {"hook_point": "hook_name", "activation_fn_str": "activation_fn"}
    new = {renames.get(k, k): v for k, v in cfg.items()}
    new.setdefault("apply_b_dec_to_input", True)
    new.setdefault("architecture", "standard")
    kwargs = new.get("activation_fn_kwargs") or {}
    if new.get("activation_fn") == "topk" and isinstance(kwargs, dict) \
            and kwargs.get("k") is not None:
        new["architecture"], new["k"] = "topk", kwargs["k"]
    if isinstance(new.get("normalize_activations"), bool):
        new["normalize_activations"] = ("expected_average_only_in"
                                        if new["normalize_activations"] else "none")
    if new.get("normalize_activations") is None:
        new["normalize_activations"] = "none"
    return new


def _int_field(cfg: dict[str, Any], key: str, low: int, high: int) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ReaderFormatError(f"{CFG_FILE}: {key} must be an integer in {low}..{high}, "
                                f"found {value!r}", key)
    return value


def load_sae_dir(directory: Path, *, hidden_size: int,
                 widths: Mapping[str, int] | None = None) -> DecodedSAE:
    """Read and check one SAELens directory for a model of this hidden width; `widths`
    (hooks.width_table): each hook it may read with its width, its d_in one of them
    (default: the hidden size)."""
    cfg = read_config(directory)
    arch = cfg.get("architecture", "standard")
    if arch not in ("standard", "jumprelu", "topk"):
        raise ReaderFormatError(f"SAE architecture {arch!r} is not supported; accepted: "
                                "standard (ReLU), jumprelu, topk", "architecture")
    d_in = _int_field(cfg, "d_in", 1, 1 << 20)
    if not widths and d_in != hidden_size:
        raise ReaderFormatError(f"the SAE's d_in is {d_in}, but this model's hidden size is "
                                f"{hidden_size}", "d_in")
    if widths and d_in not in widths.values():
        raise ReaderFormatError(f"the SAE's d_in is {d_in}, but no hook of this model has "
                                f"that width (it has {describe_widths(widths, hidden_size)})",
                                "d_in")
    d_sae = _int_field(cfg, "d_sae", 1, MAX_D_SAE)
    normalize = cfg.get("normalize_activations", "none")
    if normalize not in _NORMALIZE:
        raise ReaderFormatError(f"normalize_activations {normalize!r} is not one SAELens "
                                f"knows ({', '.join(_NORMALIZE)})", "normalize_activations")
    apply_b_dec = cfg.get("apply_b_dec_to_input", True)
    if not isinstance(apply_b_dec, bool):
        raise ReaderFormatError("apply_b_dec_to_input must be true or false",
                                "apply_b_dec_to_input")
    k = _int_field(cfg, "k", 1, d_sae) if arch == "topk" else None
    rescale = bool(cfg.get("rescale_acts_by_decoder_norm", False)) if arch == "topk" else False
    tensors = _read_weights(directory / WEIGHTS_FILE)
    shapes = {"W_enc": (d_in, d_sae), "b_enc": (d_sae,), "W_dec": (d_sae, d_in),
              "b_dec": (d_in,)}
    if arch == "jumprelu":
        if "threshold" not in tensors and "log_threshold" in tensors:
            tensors["threshold"] = torch.exp(tensors.pop("log_threshold"))
        shapes["threshold"] = (d_sae,)
    for name, want in shapes.items():
        if name not in tensors:
            raise ReaderFormatError(f"{WEIGHTS_FILE} has no tensor {name!r}", name)
        got = tuple(tensors[name].shape)
        if got != want:
            param = "d_in" if name == "W_enc" and got[1:] == (d_sae,) else name
            raise ReaderFormatError(f"{name} has shape {list(got)}, expected {list(want)} "
                                    f"(d_in={d_in}, d_sae={d_sae})", param)
        if not bool(torch.isfinite(tensors[name]).all()):
            raise ReaderFormatError(f"{name} holds NaN or infinite values", name)
    scaling = tensors.get("scaling_factor")
    if scaling is not None and not bool((scaling == 1).all()):
        raise ReaderFormatError("a finetuning scaling_factor other than ones is not supported",
                                "scaling_factor")
    metadata = cfg.get("metadata") if isinstance(cfg.get("metadata"), dict) else {}
    hook_name = metadata.get("hook_name", cfg.get("hook_name"))
    sae = SparseAutoencoder(
        arch, tensors["W_enc"], tensors["b_enc"], tensors["W_dec"], tensors["b_dec"],
        threshold=tensors.get("threshold") if arch == "jumprelu" else None, k=k,
        normalize=_NORMALIZE[normalize], apply_b_dec_to_input=apply_b_dec,
        dec_norm=tensors["W_dec"].norm(dim=-1) if rescale else None,
        hook_name=hook_name if isinstance(hook_name, str) else None)
    config = {"architecture": arch, "d_in": d_in, "d_sae": d_sae, "k": k,
              "normalize_activations": normalize, "apply_b_dec_to_input": apply_b_dec,
              "rescale_acts_by_decoder_norm": rescale,
              "reshape_activations": _str_or_none(cfg.get("reshape_activations")) or "none",
              "hook_name": sae.hook_name, "model_name": _str_or_none(
                  metadata.get("model_name", cfg.get("model_name"))),
              "sae_lens_version": _str_or_none(
                  cfg.get("sae_lens_version") or metadata.get("sae_lens_version"))}
    return DecodedSAE(sae, config)


def _str_or_none(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the weights file as float32 (bf16/f16 widen exactly)."""
    from safetensors import safe_open  # only SAE loads need the lazy reader

    try:
        out = {}
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():
                tensor = f.get_tensor(key)
                if not tensor.is_floating_point():
                    raise ReaderFormatError(f"{key} is {tensor.dtype}, expected floats", key)
                out[key] = tensor.to(torch.float32).contiguous()
        return out
    except FileNotFoundError:
        raise ReaderFormatError(f"no {WEIGHTS_FILE} in the SAE directory", "body") from None
    except ReaderFormatError:
        raise
    except Exception as exc:
        raise ReaderFormatError(f"{WEIGHTS_FILE} is not a readable safetensors file: "
                                f"{str(exc).splitlines()[0] if str(exc) else exc!r}",
                                "body") from None


def weights_bytes(directory: Path) -> int:
    """Size of the weights file (0 when missing), for descriptions."""
    try:
        return os.stat(directory / WEIGHTS_FILE).st_size
    except OSError:
        return 0


def remove_tree(path: Path) -> None:
    """Best-effort removal of a scratch directory."""
    shutil.rmtree(path, ignore_errors=True)

