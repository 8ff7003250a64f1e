"""Named readers (linear probes, SAEs): one file per name under one directory.

Same rules as the vector registry (`steering/registry.py`): the directory is the
only state, every process sees a put once it returns, files are published
atomically (temp file, fsync, rename, fsync dir), names are validated alike.

On disk: `<root>/<name>.safetensors`, float32 tensors `weight`, `bias` (probe) or
`W_enc`, `b_enc`, `W_dec`, `b_dec` and `threshold` (JumpReLU) (SAE), with metadata
`format`, `kind`, `source_format`, `created`, `sha256` (of the upload), `d_in`,
`outputs` and `config` (JSON: the probe's activation and names, or the SAE's
architecture, k, normalization, hook name). An operator may also place a SAELens
directory (`cfg.json` + `sae_weights.safetensors`) at `<root>/<name>/`; it is read
by path, checked like an upload. A file and a directory of one name: the file wins.

A reader is as wide as the hook it reads (its `d_in`): the hidden size for the stream
hooks, d_mlp for mlp_post, heads x d_head for attn_z, the experts for router_logits. An
upload is kept at its own width when some hook of the model has that width; a readout,
gate or SAE-feature vector checks it against the hook it names (readout.py,
conditions.py).

Descriptions come from the file header alone (cheap, cached per file version), so
the API process checks a request's readers without loading their weights; `get`
loads the tensors for whoever runs them.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from capsteer.config import errors
from capsteer.hooks import describe_widths, width_table
from capsteer.steering.readers import formats
from capsteer.steering.readers.formats import (
    ReaderFormatError,
    ReaderTooLargeError,
    decode_probe,
    normalize_format,
    sniff_format,
    zip_member_names,
)
from capsteer.steering.readers.kinds import LinearProbe, Reader, SparseAutoencoder
from capsteer.steering.readers.sae import (
    CFG_FILE,
    MAX_SAE_BYTES,
    WEIGHTS_FILE,
    extract_archive,
    load_sae_dir,
    remove_tree,
)
from capsteer.steering.registry import NAME_RE
from capsteer.steering.store import fsync_dir, publish_atomic, remove_stale_temps

SUFFIX = ".safetensors"
FILE_KIND = "capsteer-reader/1"
_HEADER_LIMIT = 100_000_000
TENSOR_CACHE_BYTES = 2 << 30  # reader tensors `tensors` keeps for the server's parse


class ReaderNameError(errors.InvalidInput, ValueError):
    """A name that is not `[A-Za-z0-9][A-Za-z0-9._-]{0,63}` (or ends with `.tmp`)."""

    param = "name"


class ReaderNotFoundError(errors.NotFound, KeyError):
    """No reader of that name (a KeyError, as `parse_readout`'s lookup requires)."""

    param = "name"

    def __str__(self) -> str:
        return f"unknown reader {self.args[0]!r}"


class ReaderRegistryError(ReaderFormatError):
    """A stored reader this model cannot use (other width, damaged or changed file)."""


def validate_name(name: object) -> str:
    """Return `name` if it is a safe registry name, else raise ReaderNameError."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name) or name.endswith(".tmp"):
        raise ReaderNameError(
            f"invalid reader name {name!r}: use 1-64 characters from A-Z a-z 0-9 . _ -, "
            "starting with a letter or digit, not ending in '.tmp'")
    return name


@dataclass(frozen=True)
class ReaderShape:
    """What a request needs to know of a reader, without its weights."""

    name: str | None
    kind: str  # "probe" | "sae"
    d_in: int
    outputs: int  # probe outputs k, or the SAE's d_sae
    sha256: str | None  # of the stored upload; None for inline probes
    hook_name: str | None = None  # SAELens's record of where an SAE was trained


class ReaderRegistry:
    """Reader files under `root`, checked against the widths of one model's hooks."""

    def __init__(self, root: str | Path, *, hidden_size: int,
                 hook_widths: Mapping[str, int] | None = None,
                 unavailable: Mapping[str, str] | None = None,
                 cache_entries: int = 256) -> None:
        """`hook_widths`, `unavailable`: the model's hooks not hidden_size wide and those it
        lacks (a ModelShape's); a reader's d_in must be the width of a hook it has."""
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.hidden_size = int(hidden_size)
        self.widths = width_table(hidden_size, hook_widths, unavailable)
        self._cache: OrderedDict[str, tuple[tuple, dict[str, Any]]] = OrderedDict()
        self._cache_entries = cache_entries
        # (name, sha256) -> tensors, most recent last, within TENSOR_CACHE_BYTES (`tensors`)
        self._tensors: OrderedDict[tuple[str, str | None], Reader] = OrderedDict()
        self._lock = threading.Lock()
        remove_stale_temps(self.root, remove_tree)

    # --- public API ---------------------------------------------------------------

    def path(self, name: str) -> Path:
        """The file for `name`; never outside root (the name has no separators)."""
        path = self.root / (validate_name(name) + SUFFIX)
        if os.path.dirname(os.path.abspath(path)) != os.path.abspath(self.root):
            raise ReaderNameError(f"invalid reader name {name!r}")
        return path

    def put(self, name: str, source: bytes | Path, fmt: str | None = None, *,
            activation: str | None = None) -> dict[str, Any]:
        """Decode, check and store an upload (bytes, or a file holding it) under `name`.

        Probes: safetensors, .npz, .npy, .pt, JSON; SAEs: a tar or zip of SAELens's
        saved directory. `fmt` is sniffed when not given; `activation` (probes) wins
        over one the file names."""
        path = self.path(name)
        size = len(source) if isinstance(source, bytes) else source.stat().st_size
        if size > MAX_SAE_BYTES:
            raise ReaderTooLargeError(f"upload is {size} bytes; the limit is {MAX_SAE_BYTES}",
                                      "body")
        if size == 0:
            raise ReaderFormatError("upload is empty", "body")
        head = source[:4096] if isinstance(source, bytes) else _head(source)
        chosen = normalize_format(fmt)
        if chosen is None:
            names = zip_member_names(source) if head.startswith(b"PK") else None
            chosen = sniff_format(head, names)
        if chosen is None:
            raise ReaderFormatError(
                "unrecognised reader file: expected safetensors, .npz, .npy, .pt or JSON (a "
                f"probe) or a tar/zip of a SAELens directory (first bytes {head[:8]!r}); pass "
                "?format= if it is one", "body")
        digest = _sha256(source)
        if chosen in ("tar", "zip"):
            if activation is not None:
                raise ReaderFormatError("activation applies to probes, not SAEs", "activation")
            scratch = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=self.root))
            try:
                extract_archive(source, scratch, chosen)
                decoded = load_sae_dir(scratch, hidden_size=self.hidden_size,
                                       widths=self.widths)
            finally:
                remove_tree(scratch)
            sae = decoded.sae
            tensors = {"W_enc": sae.W_enc, "b_enc": sae.b_enc, "W_dec": sae.W_dec,
                       "b_dec": sae.b_dec}
            if sae.threshold is not None:
                tensors["threshold"] = sae.threshold
            kind, outputs, config, d_in = "sae", sae.d_sae, decoded.config, sae.d_in
        else:
            if size > formats.MAX_PROBE_BYTES:
                raise ReaderTooLargeError(
                    f"probe upload is {size} bytes; the limit is {formats.MAX_PROBE_BYTES}",
                    "body")
            data = source if isinstance(source, bytes) else source.read_bytes()
            probe = decode_probe(data, hidden_size=self.hidden_size, fmt=chosen,
                                 activation=activation, widths=self.widths)
            tensors = {"weight": torch.from_numpy(probe.weight.copy()),
                       "bias": torch.from_numpy(probe.bias.copy())}
            kind, (outputs, d_in) = "probe", map(int, probe.weight.shape)
            config = {"architecture": "linear", "activation": probe.activation,
                      "names": list(probe.names) if probe.names is not None else None}
        metadata = {"format": FILE_KIND, "kind": kind, "source_format": chosen,
                    "created": repr(time.time()), "sha256": digest,
                    "d_in": str(d_in), "outputs": str(outputs),
                    "config": json.dumps(config)}
        from safetensors.torch import save_file  # torch's writer; only puts need it

        contiguous = {k: v.contiguous() for k, v in tensors.items()}
        publish_atomic(self.root, path, lambda tmp: save_file(contiguous, tmp, metadata=metadata))
        return self.info(name)

    def info(self, name: str) -> dict[str, Any]:
        """Description of one reader (no weights); `error` says why it is unusable."""
        return json.loads(json.dumps(self._describe(name)))  # a copy callers may edit

    def shape(self, name: str) -> ReaderShape:
        """`ReaderShape` of a usable reader; ReaderRegistryError when unusable."""
        info = self._describe(name)
        if info["error"] is not None:
            raise ReaderRegistryError(info["error"], "name")
        outputs = info["d_sae"] if info["kind"] == "sae" else info["outputs"]
        config = info["config"] or {}
        return ReaderShape(name, info["kind"], info["d_in"], outputs, info["sha256"],
                           config.get("hook_name"))

    def lookup(self, name: str) -> ReaderShape:
        """The lookup `parse_readout` takes: unknown or invalid names raise KeyError
        (ReaderNotFoundError); a reader this model cannot use raises ReaderRegistryError."""
        try:
            validate_name(name)
        except ReaderNameError:
            raise ReaderNotFoundError(name) from None
        return self.shape(name)

    def get(self, name: str, *, sha256: str | None = None) -> Reader:
        """The reader's tensors (CPU, float32). `sha256` (from a `ReaderShape`) makes a
        reader replaced since the request was checked an error rather than a surprise."""
        info = self._describe(name)
        if info["error"] is not None:
            raise ReaderRegistryError(info["error"], "name")
        if sha256 is not None and info["sha256"] != sha256:
            raise ReaderRegistryError(f"reader {name!r} was replaced since the request was "
                                      "checked; send the request again", "name")
        if info["storage"] == "directory":
            return load_sae_dir(self.root / name, hidden_size=self.hidden_size,
                                widths=self.widths).sae
        return _reader_from_file(self.path(name), info)

    def tensors(self, name: str) -> Reader:
        """`get`, reusing the tensors of the last readers read while their content is the
        same: the server resolves `when` gates and SAE-feature vectors with it on every
        request, and a large SAE takes seconds to load."""
        sha = self.shape(name).sha256
        with self._lock:
            hit = self._tensors.get((name, sha))
            if hit is not None:
                self._tensors.move_to_end((name, sha))
                return hit
        reader = self.get(name, sha256=sha)
        if _nbytes(reader) <= TENSOR_CACHE_BYTES:
            with self._lock:
                self._tensors[(name, sha)] = reader
                while sum(_nbytes(r) for r in self._tensors.values()) > TENSOR_CACHE_BYTES:
                    self._tensors.popitem(last=False)
        return reader

    def names(self) -> list[str]:
        """Registered names, sorted (entries with invalid names are ignored)."""
        out = set()
        with os.scandir(self.root) as entries:
            for entry in entries:
                stem = entry.name[:-len(SUFFIX)] if entry.name.endswith(SUFFIX) else entry.name
                if not NAME_RE.fullmatch(stem) or stem.endswith(".tmp"):
                    continue
                if entry.name.endswith(SUFFIX) and entry.is_file():
                    out.add(stem)
                elif entry.is_dir() and os.path.isfile(os.path.join(entry.path, CFG_FILE)):
                    out.add(stem)
        return sorted(out)

    def list(self) -> list[dict[str, Any]]:
        """`info` of every entry, sorted by name."""
        out = []
        for name in self.names():
            try:
                out.append(self.info(name))
            except ReaderNotFoundError:  # deleted by another process meanwhile
                continue
        return out

    def delete(self, name: str) -> bool:
        """Remove `name` (its file and any operator-placed directory); False if absent."""
        path = self.path(name)
        found = False
        try:
            os.unlink(path)
            found = True
        except FileNotFoundError:
            pass
        directory = self.root / name
        if directory.is_dir() and not directory.is_symlink():
            remove_tree(directory)
            found = True
        with self._lock:
            self._cache.pop(name, None)
        if found:
            fsync_dir(self.root)
        return found

    # --- internals ----------------------------------------------------------------

    def _describe(self, name: str) -> dict[str, Any]:
        """The cached description, refreshed whenever the file (or directory) changed."""
        path = self.path(name)
        directory = self.root / name
        try:
            st = os.stat(path)
            key: tuple = ("file", st.st_ino, st.st_size, st.st_mtime_ns)
        except FileNotFoundError:
            try:
                key = ("directory", *(_stat_key(directory / f) for f in (CFG_FILE, WEIGHTS_FILE)))
            except FileNotFoundError:
                raise ReaderNotFoundError(name) from None
        with self._lock:
            hit = self._cache.get(name)
            if hit is not None and hit[0] == key:
                self._cache.move_to_end(name)
                return hit[1]
        info = (self._describe_file(name, path) if key[0] == "file"
                else self._describe_dir(name, directory))
        with self._lock:
            self._cache[name] = (key, info)
            self._cache.move_to_end(name)
            while len(self._cache) > self._cache_entries:
                self._cache.popitem(last=False)
        return info

    def _base_info(self, name: str, storage: str) -> dict[str, Any]:
        return {"name": name, "kind": None, "storage": storage, "architecture": None,
                "d_in": None, "hooks": None, "outputs": None, "d_sae": None, "activation": None,
                "names": None, "config": None, "source_format": None, "created": None,
                "sha256": None, "bytes": None, "error": None}

    def _describe_file(self, name: str, path: Path) -> dict[str, Any]:
        info = self._base_info(name, "file")
        try:
            meta, size = _read_header(path)
            config = json.loads(meta["config"])
            kind, d_in, outputs = meta["kind"], int(meta["d_in"]), int(meta["outputs"])
        except FileNotFoundError:
            raise ReaderNotFoundError(name) from None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            info["error"] = f"reader {name!r}: stored file is unreadable ({exc})"
            return info
        info.update(kind=kind, d_in=d_in, config=config, bytes=size,
                    architecture=config.get("architecture"),
                    source_format=meta.get("source_format"), sha256=meta.get("sha256"))
        try:
            info["created"] = float(meta["created"])
        except (KeyError, ValueError):
            pass
        if kind == "sae":
            info["d_sae"] = outputs
        else:
            info.update(outputs=outputs, activation=config.get("activation"),
                        names=config.get("names"))
        info["error"] = self._unfit(name, d_in)
        info["hooks"] = self._hooks_of(d_in)
        return info

    def _hooks_of(self, width: int) -> list[str]:
        """The hooks of this model a reader of `width` reads (`hooks` in its description)."""
        return [h for h, w in self.widths.items() if w == width]

    def _unfit(self, name: str, d_in: int) -> str | None:
        if d_in in self.widths.values():
            return None
        return (f"reader {name!r} reads width {d_in}, but no hook of this model has that "
                f"width (it has {describe_widths(self.widths, self.hidden_size)}): it was "
                "uploaded for another model")

    def _describe_dir(self, name: str, directory: Path) -> dict[str, Any]:
        info = self._base_info(name, "directory")
        info.update(kind="sae", source_format="directory")
        try:
            decoded = load_sae_dir(directory, hidden_size=self.hidden_size, widths=self.widths)
        except ReaderFormatError as exc:
            info["error"] = f"reader {name!r}: {exc}"
            return info
        weights = directory / WEIGHTS_FILE
        info.update(architecture=decoded.config["architecture"], d_in=decoded.sae.d_in,
                    d_sae=decoded.sae.d_sae, config=decoded.config,
                    hooks=self._hooks_of(decoded.sae.d_in),
                    bytes=weights.stat().st_size, created=weights.stat().st_mtime,
                    sha256=_dir_identity(directory))
        return info



def _nbytes(reader: Reader) -> int:
    return sum(t.nbytes for t in vars(reader).values() if isinstance(t, torch.Tensor))


def _head(path: Path, n: int = 4096) -> bytes:
    with open(path, "rb") as f:
        return f.read(n)


def _sha256(source: bytes | Path) -> str:
    if isinstance(source, bytes):
        return hashlib.sha256(source).hexdigest()
    h = hashlib.sha256()
    with open(source, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _stat_key(path: Path) -> tuple[int, int, int]:
    st = os.stat(path)
    return st.st_ino, st.st_size, st.st_mtime_ns


def _dir_identity(directory: Path) -> str:
    """A version id for an operator-placed directory (its files' inode, size, mtime)."""
    parts = [_stat_key(directory / f) for f in (CFG_FILE, WEIGHTS_FILE)]
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def _read_header(path: Path) -> tuple[dict[str, str], int]:
    """A safetensors file's metadata (header only) and the file's size."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) != 8:
            raise ValueError("too short")
        (n,) = struct.unpack("<Q", head)
        if not 0 < n <= min(size - 8, _HEADER_LIMIT):
            raise ValueError("bad header length")
        header = json.loads(f.read(n))
    meta = header.get("__metadata__") or {}
    if meta.get("format") != FILE_KIND:
        raise ValueError(f"not a capsteer reader file (format {meta.get('format')!r})")
    return meta, size


_BUILDERS: dict[str, Callable[[dict[str, torch.Tensor], dict[str, Any]], Reader]] = {
    "probe": lambda t, c: LinearProbe(
        t["weight"], t["bias"], c.get("activation") or "none",
        tuple(c["names"]) if c.get("names") is not None else None),
    "sae": lambda t, c: SparseAutoencoder(
        c["architecture"], t["W_enc"], t["b_enc"], t["W_dec"], t["b_dec"],
        threshold=t.get("threshold"), k=c.get("k"),
        normalize=_runtime_normalize(c.get("normalize_activations", "none")),
        apply_b_dec_to_input=bool(c.get("apply_b_dec_to_input", True)),
        dec_norm=t["W_dec"].norm(dim=-1) if c.get("rescale_acts_by_decoder_norm") else None,
        hook_name=c.get("hook_name")),
}


def _runtime_normalize(value: str) -> str:
    return value if value in ("constant_norm_rescale", "layer_norm") else "none"


def _reader_from_file(path: Path, info: dict[str, Any]) -> Reader:
    from safetensors.torch import load_file  # torch's reader; only engine-side loads need it

    try:
        tensors = load_file(str(path), device="cpu")
        return _BUILDERS[info["kind"]](tensors, info["config"])
    except FileNotFoundError:
        raise ReaderNotFoundError(info["name"]) from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ReaderRegistryError(f"reader {info['name']!r}: stored file is unusable ({exc})",
                                  "name") from None
