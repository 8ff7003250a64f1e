"""Named steering vectors: one safetensors file per name under a directory.

The directory is the only state, so every server process (API workers, engine
processes, another replica on the same volume) sees the same vectors: a put is
visible to all of them once it returns, and nothing is cached that a file change
would not invalidate. Files are published atomically (temp file, fsync, rename,
fsync dir), so a reader never sees half a vector.

On disk: `<root>/<name>.safetensors` holding tensor `vector` (one vector) or
`layer.N` tensors (0-based layers), float32, with metadata `source_format`, `created`,
`sha256` (of the upload), `hidden_size` and `num_layers` (the model's at upload) and
`width` (the vectors').

Content the server checked a request against is also kept by its content sha256,
`<root>/.content/<sha256>.safetensors`, and the workers read that file, never the name:
every tensor-parallel rank of a request then reads the same bytes, whatever is put under
the name meanwhile, so the ranks steer alike or refuse alike (a rank that refused alone
would leave the others in a collective by themselves). A content file stays at least
CONTENT_KEEP_SECONDS / 2 after the last request checked against it.

A vector is as wide as the hook it steers: the hidden size for the stream hooks, d_mlp
for mlp_post, heads x d_head for attn_z. An upload is kept at its own width when some
hook of the model has that width, and each request checks it against the hook it names
(steering/spec.py), so one registry holds stream and mlp_post vectors side by side.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import numpy as np

from capsteer.config import errors
from capsteer.hooks import describe_widths, width_table
from capsteer.steering import formats
from capsteer.steering.formats import (
    DecodedVectors,
    VectorFormatError,
    VectorTooLargeError,
    decode_vectors,
)
from capsteer.steering.spec import NamedVectors, SteeringSpecError
from capsteer.steering.store import fsync_dir, publish_atomic, remove_stale_temps

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
SUFFIX = ".safetensors"
CONTENT_DIR = ".content"  # content files by sha256 (a dot name: never listed as a vector)
# A content file untouched this long is removed at the next put or delete; each request
# checked against it touches it when it is older than a quarter of this.
CONTENT_KEEP_SECONDS = 3600.0
CONTENT_RETRY_SECONDS = 1.0  # after a failed content write, requests are refused this long
_SHA_RE = re.compile(r"[0-9a-f]{64}")
logger = logging.getLogger("vllm.capsteer")  # under vLLM's configured logger
FILE_KIND = "capsteer-steering-vector/1"
_LAYER_TENSOR_RE = re.compile(r"layer\.(\d{1,6})")


class VectorNameError(errors.InvalidInput, ValueError):
    """A name that is not `[A-Za-z0-9][A-Za-z0-9._-]{0,63}` (or ends with `.tmp`)."""


class VectorNotFoundError(errors.NotFound, KeyError):
    """No vector of that name (a KeyError, as `VectorLookup` requires)."""

    def __str__(self) -> str:
        return f"unknown vector name {self.args[0]!r}"


class VectorRegistryError(VectorFormatError):
    """A stored vector that this model cannot use (other width/layers, damaged file)."""


class VectorContentError(errors.StorageError, OSError):
    """The server could not keep a named vector's content where the workers read it (its
    disk refused the write): the request is refused (503) rather than run unsteered."""

    status = 503
    param = "steering"


class VectorChangedError(errors.NotFound, LookupError):
    """A worker cannot read the vector a request named: it is gone, or another vector was
    stored under its name after the request was checked (its content sha256 differs)."""


def validate_name(name: object) -> str:
    """Return `name` if it is a safe registry name, else raise VectorNameError."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name) or name.endswith(".tmp"):
        raise VectorNameError(
            f"invalid vector name {name!r}: use 1-64 characters from A-Z a-z 0-9 . _ -, "
            "starting with a letter or digit, not ending in '.tmp'")
    return name


@dataclass(frozen=True, eq=False)
class _Stored:
    """One file as read from disk, before this model's geometry is applied."""

    decoded: DecodedVectors | None
    info: dict
    error: str | None
    named: NamedVectors | None = None  # the value with its digests (computed once a file)


class VectorRegistry:
    """Files under `root`, validated against one model's geometry on every read."""

    def __init__(self, root: str | Path, *, hidden_size: int, num_layers: int,
                 hook_widths: Mapping[str, int] | None = None,
                 unavailable: Mapping[str, str] | None = None,
                 cache_entries: int = 128, read_only: bool = False) -> None:
        """`hook_widths`, `unavailable`: the model's hooks not hidden_size wide and those it
        lacks (a ModelShape's); a vector must be as wide as one hook it has that steering
        may name. `read_only`: a reader beside the server's registry (a worker): the
        directory is neither created nor cleaned."""
        self.root = Path(root)
        self.hidden_size = int(hidden_size)
        self.num_layers = int(num_layers)
        self.widths = width_table(hidden_size, hook_widths, unavailable, steerable=True)
        self._cache: OrderedDict[str, tuple[tuple, _Stored]] = OrderedDict()
        self._cache_entries = cache_entries
        self._lock = threading.Lock()
        self.read_only = read_only
        self._touched: dict[str, float] = {}  # content sha256 -> when this process kept it
        # content sha256 -> (when its write failed, the refusal's reason)
        self._content_failed: dict[str, tuple[float, str]] = {}
        if not read_only:
            self.root.mkdir(parents=True, exist_ok=True)
            remove_stale_temps(self.root)

    # --- public API ---------------------------------------------------------------

    def path(self, name: str) -> Path:
        """The file for `name`; never outside root (the name has no separators or dots first)."""
        path = self.root / (validate_name(name) + SUFFIX)
        if os.path.dirname(os.path.abspath(path)) != os.path.abspath(self.root):
            raise VectorNameError(f"invalid vector name {name!r}")
        return path

    def put(self, name: str, data: bytes, fmt: str | None = None) -> dict:
        """Decode, validate and store an upload under `name` (replacing any old one)."""
        path = self.path(name)
        if len(data) > formats.MAX_VECTOR_BYTES:
            raise VectorTooLargeError(
                f"upload is {len(data)} bytes; the limit is {formats.MAX_VECTOR_BYTES} bytes")
        decoded = decode_vectors(data, hidden_size=self.hidden_size,
                                 num_layers=self.num_layers, fmt=fmt, widths=self.widths)
        if decoded.single is not None:
            tensors = {"vector": decoded.single}
        else:
            assert decoded.per_layer is not None
            tensors = {f"layer.{k}": v for k, v in decoded.per_layer.items()}
        metadata = {
            "format": FILE_KIND,
            "source_format": decoded.source_format,
            "created": repr(time.time()),
            "sha256": hashlib.sha256(data).hexdigest(),
            "hidden_size": str(self.hidden_size),
            "num_layers": str(self.num_layers),
            "width": str(decoded.width),
        }
        blob = _save(tensors, metadata)
        # Its content file first: a request checked against the new entry finds it there.
        self._keep_content(NamedVectors.of(name, decoded.value()), strict=True)
        publish_atomic(self.root, path, lambda tmp: Path(tmp).write_bytes(blob))
        self._drop_old_content()
        return self.info(name)

    def content_path(self, sha256: str) -> Path:
        """The file keeping the entry content whose NamedVectors.sha256 is `sha256`."""
        if not isinstance(sha256, str) or not _SHA_RE.fullmatch(sha256):
            raise VectorNameError(f"invalid content sha256 {sha256!r}")
        return self.root / CONTENT_DIR / (sha256 + SUFFIX)

    def get_content(self, sha256: str) -> NamedVectors:
        """The entry content kept under `sha256` (what a request was checked against),
        checked against this model and against the sha256 itself; VectorNotFoundError
        when no such content is kept, SteeringSpecError when it is unusable here."""
        path = self.content_path(sha256)
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            raise VectorNotFoundError(f"content {sha256[:16]}...") from None
        stored = self._decode_file(f"content {sha256[:16]}...", blob)
        if stored.error is not None or stored.named is None:
            raise SteeringSpecError("steering.vectors[].vector.name",
                                    stored.error or "stored content is unusable")
        if stored.named.sha256 != sha256:  # damaged, or written by something else
            raise SteeringSpecError("steering.vectors[].vector.name",
                                    f"content file {path.name} holds other content "
                                    f"({stored.named.sha256[:16]}...)")
        return stored.named

    def get(self, name: str) -> DecodedVectors:
        """The stored vectors; VectorRegistryError if this model cannot use them."""
        stored = self._load(name)
        if stored.error is not None:
            raise VectorRegistryError(stored.error)
        assert stored.decoded is not None
        return stored.decoded

    def info(self, name: str) -> dict:
        """Summary of one entry (no vector data); `error` says why it is unusable, if it is."""
        info = dict(self._load(name).info)
        for key in ("layers", "norms"):  # copies: callers must not edit the cached entry
            if info[key] is not None:
                info[key] = type(info[key])(info[key])
        return info

    def names(self) -> list[str]:
        """Registered names, sorted (files with invalid names are ignored)."""
        out = []
        with os.scandir(self.root) as entries:
            for entry in entries:
                stem = entry.name[:-len(SUFFIX)] if entry.name.endswith(SUFFIX) else None
                if stem and NAME_RE.fullmatch(stem) and not stem.endswith(".tmp") \
                        and entry.is_file():
                    out.append(stem)
        return sorted(out)

    def list(self) -> list[dict]:
        """`info` of every entry, sorted by name."""
        out = []
        for name in self.names():
            try:
                out.append(self.info(name))
            except VectorNotFoundError:  # deleted by another process meanwhile
                continue
        return out

    def count(self) -> int:
        return len(self.names())

    def delete(self, name: str) -> bool:
        """Remove `name`; False when it did not exist."""
        path = self.path(name)
        try:
            os.unlink(path)
        except FileNotFoundError:
            return False
        finally:
            with self._lock:
                self._cache.pop(name, None)
        fsync_dir(self.root)
        self._drop_old_content()
        return True

    def lookup(self, name: str) -> np.ndarray | Mapping[int, np.ndarray]:
        """`VectorLookup` for `parse_steering_spec`: a vector or {layer: vector}.

        Unknown and invalid names raise KeyError (the spec reports "unknown vector
        name"); a stored vector this model cannot use raises SteeringSpecError, so the
        request gets a 400 naming the problem rather than a 500 (the spec only turns
        KeyError into a field error itself).
        """
        try:
            validate_name(name)
        except VectorNameError:
            raise VectorNotFoundError(name) from None
        try:
            return self.get(name).value()
        except VectorRegistryError as exc:
            raise SteeringSpecError("steering.vectors[].vector.name", str(exc)) from None

    def lookup_named(self, name: str) -> NamedVectors:
        """`lookup` with each vector's digest and the entry's content sha256, so a request's
        wire form can name the entry instead of carrying its floats (the server's workers
        read the same directory). Digests are computed once per stored file."""
        try:
            validate_name(name)
        except VectorNameError:
            raise VectorNotFoundError(name) from None
        stored = self._load(name)
        if stored.error is not None or stored.named is None:  # as `lookup` refuses it
            raise SteeringSpecError("steering.vectors[].vector.name",
                                    stored.error or f"vector {name!r} is unusable")
        if not self.read_only:  # the server: the workers will read exactly this content
            self._keep_content(stored.named)
        return stored.named

    # --- internals ----------------------------------------------------------------

    def _keep_content(self, named: NamedVectors, strict: bool = False) -> None:
        """Make `named`'s content readable by its sha256 for at least CONTENT_KEEP_SECONDS
        / 2 more (written if missing, touched when older than a quarter of that). A
        failure raises OSError when `strict` (an upload), else VectorContentError (a
        request's check: refused, never run unsteered), at once again for
        CONTENT_RETRY_SECONDS after a failed write (no disk work per refused request)."""
        now = time.time()
        if now - self._touched.get(named.sha256, 0.0) < CONTENT_KEEP_SECONDS / 4:
            return
        path = self.content_path(named.sha256)
        failed = self._content_failed.get(named.sha256)
        if failed is not None and now - failed[0] < CONTENT_RETRY_SECONDS and not strict:
            raise VectorContentError(failed[1])
        try:
            try:
                os.utime(path)
            except FileNotFoundError:  # put by older code, or unused for a long while
                path.parent.mkdir(exist_ok=True)
                value = named.value
                tensors = ({"vector": np.asarray(value)} if not isinstance(value, Mapping)
                           else {f"layer.{k}": np.asarray(v) for k, v in value.items()})
                blob = _save(tensors, {"format": FILE_KIND, "name": named.name})
                publish_atomic(path.parent, path, lambda tmp: Path(tmp).write_bytes(blob))
        except OSError as exc:
            if strict:
                raise
            reason = (f"the server cannot keep vector {named.name!r}'s content for its "
                      f"workers ({exc.strerror or exc}); retry later")
            logger.error("capsteer: %s (at %s)", reason, path)
            with self._lock:
                self._content_failed[named.sha256] = (now, reason)
            raise VectorContentError(reason) from exc
        with self._lock:  # checks run on the event loop and in threads (patch reads)
            self._content_failed.pop(named.sha256, None)
            self._touched[named.sha256] = now
            if len(self._touched) > 4 * self._cache_entries:  # forget the oldest half
                for sha, _ in sorted(self._touched.items(), key=lambda kv: kv[1])[
                        :len(self._touched) // 2]:
                    del self._touched[sha]

    def _drop_old_content(self) -> None:
        """Content files no request was checked against for CONTENT_KEEP_SECONDS."""
        folder = self.root / CONTENT_DIR
        cutoff = time.time() - CONTENT_KEEP_SECONDS
        try:
            entries = list(os.scandir(folder))
        except FileNotFoundError:
            return
        for entry in entries:
            try:
                if entry.name.endswith(SUFFIX) and \
                        entry.stat(follow_symlinks=False).st_mtime < cutoff:
                    os.unlink(entry.path)
            except OSError:  # removed by another process meanwhile
                pass
        remove_stale_temps(folder)

    def _load(self, name: str) -> _Stored:
        """Read `name`, reusing the cached decode while the file is unchanged.

        The cache key is the file's inode, size, mtime and its whole safetensors
        header (which holds the upload's sha256 and creation time), all read from
        the same open file, so a replaced file is never served from the cache.
        """
        path = self.path(name)
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            raise VectorNotFoundError(name) from None
        with f:
            st = os.fstat(f.fileno())
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            header = f.read(n) if 0 <= n <= min(st.st_size, 100_000_000) else b""
            key = (st.st_ino, st.st_size, st.st_mtime_ns, head, header)
            with self._lock:
                hit = self._cache.get(name)
                if hit is not None and hit[0] == key:
                    self._cache.move_to_end(name)
                    return hit[1]
            f.seek(0)
            blob = f.read()
        stored = self._decode_file(name, blob)
        with self._lock:
            self._cache[name] = (key, stored)
            self._cache.move_to_end(name)
            while len(self._cache) > self._cache_entries:
                self._cache.popitem(last=False)
        return stored

    def _decode_file(self, name: str, blob: bytes) -> _Stored:
        info: dict = {"name": name, "kind": None, "layers": None, "hidden_size": None,
                      "width": None, "hooks": None,
                      "source_format": None, "created": None, "sha256": None,
                      "bytes": len(blob), "norm": None, "norms": None, "error": None}
        try:
            meta, tensors = _read_safetensors(blob)
        except ValueError as exc:
            info["error"] = f"vector {name!r}: stored file is unreadable ({exc})"
            return _Stored(None, info, info["error"])
        info["source_format"] = meta.get("source_format")
        info["sha256"] = meta.get("sha256")
        try:
            info["created"] = float(meta["created"])
        except (KeyError, ValueError):
            pass
        single, per_layer = None, None
        if set(tensors) == {"vector"}:
            single = tensors["vector"]
        else:
            per_layer = {}
            for tname, arr in tensors.items():
                m = _LAYER_TENSOR_RE.fullmatch(tname)
                if m is None:
                    info["error"] = (f"vector {name!r}: stored file has unexpected tensor "
                                     f"{tname!r} (not written by capsteer?)")
                    return _Stored(None, info, info["error"])
                per_layer[int(m.group(1))] = arr
        arrays = [single] if single is not None else list(per_layer.values())  # type: ignore[union-attr]
        if not arrays or any(a.ndim != 1 for a in arrays) or len({a.shape for a in arrays}) != 1:
            info["error"] = f"vector {name!r}: stored file holds no usable 1-D vectors"
            return _Stored(None, info, info["error"])
        width = int(arrays[0].shape[0])
        # `hidden_size` is the width under its first name (vectors were all stream-wide)
        info["hidden_size"] = info["width"] = width
        info["hooks"] = [h for h, w in self.widths.items() if w == width]
        if single is not None:
            info["kind"], info["norm"] = "single", _norm(single)
            decoded = DecodedVectors(single, None, info["source_format"] or "safetensors")
        else:
            assert per_layer is not None
            per_layer = dict(sorted(per_layer.items()))
            info["kind"], info["layers"] = "per_layer", list(per_layer)
            info["norms"] = {k: _norm(v) for k, v in per_layer.items()}
            decoded = DecodedVectors(None, MappingProxyType(per_layer),
                                     info["source_format"] or "safetensors")
        info["error"] = self._incompatibility(name, width, per_layer, arrays)
        named = NamedVectors.of(name, decoded.value()) if info["error"] is None else None
        return _Stored(decoded, info, info["error"], named)

    def _incompatibility(self, name: str, width: int, per_layer: dict | None,
                         arrays: list[np.ndarray]) -> str | None:
        if width not in self.widths.values():
            return (f"vector {name!r} has width {width}, but no hook this model steers has "
                    f"that width (it has {describe_widths(self.widths, self.hidden_size)}): "
                    "it was uploaded for another model; upload it again")
        if per_layer is not None:
            beyond = [k for k in per_layer if k >= self.num_layers]
            if beyond:
                return (f"vector {name!r} has layers {beyond}, but this model has "
                        f"{self.num_layers} layers (0..{self.num_layers - 1})")
        if not all(np.isfinite(a).all() for a in arrays):
            return f"vector {name!r}: stored values are not all finite (damaged file?)"
        return None



class VectorReader:
    """A worker's reader of the named vectors requests refer to (steering/spec.py's wire
    form): the content the server checked, read by its sha256 from the server's registry
    directory (`.content/`), never by name, and kept by that sha256 (the last `keep`
    entries). Every rank of a request reads the same bytes, so all of them steer with
    that content or all refuse it, whatever is put under the name meanwhile."""

    def __init__(self, root: str | Path, *, hidden_size: int, num_layers: int,
                 hook_widths: Mapping[str, int] | None = None, keep: int = 32) -> None:
        self.registry = VectorRegistry(root, hidden_size=hidden_size, num_layers=num_layers,
                                       hook_widths=hook_widths, read_only=True)
        self._kept: OrderedDict[str, np.ndarray | Mapping[int, np.ndarray]] = OrderedDict()
        self._keep = keep

    def __call__(self, name: str, sha256: str) -> np.ndarray | Mapping[int, np.ndarray]:
        """`VectorResolve`: the content `sha256` that `name` held when the request was
        checked, else VectorChangedError."""
        kept = self._kept.get(sha256)
        if kept is not None:
            self._kept.move_to_end(sha256)
            return kept
        try:
            named = self.registry.get_content(sha256)
        except (KeyError, SteeringSpecError, VectorNameError) as exc:
            raise VectorChangedError(
                f"steering vector {name!r}: the content the request was checked against "
                f"(sha256 {str(sha256)[:16]}...) is not readable in "
                f"{self.registry.root / CONTENT_DIR} ({exc})") from None
        self._kept[sha256] = named.value
        while len(self._kept) > self._keep:
            self._kept.popitem(last=False)
        return named.value


def _save(tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> bytes:
    """A safetensors file of float32 `tensors`."""
    from safetensors.numpy import save  # safetensors loads only where vectors are written

    return save({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()},
                metadata=dict(metadata))


def _norm(vec: np.ndarray) -> float:
    return float(np.linalg.norm(vec.astype(np.float64)))


def _read_safetensors(blob: bytes) -> tuple[dict[str, str], dict[str, np.ndarray]]:
    """Metadata and float32 tensors of a registry file (ValueError if it is not one)."""
    import safetensors

    if len(blob) < 8:
        raise ValueError("too short")
    (n,) = struct.unpack_from("<Q", blob, 0)
    try:
        header = json.loads(bytes(blob[8:8 + n]))
        items = safetensors.deserialize(bytes(blob))
    except Exception as exc:
        raise ValueError(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None
    meta = (header.get("__metadata__") or {}) if isinstance(header, dict) else {}
    tensors = {}
    for tname, t in items:
        if t["dtype"] != "F32":
            raise ValueError(f"tensor {tname!r} is {t['dtype']}, expected F32")
        arr = np.frombuffer(bytes(t["data"]), dtype="<f4").reshape(t["shape"]).astype(np.float32)
        arr.setflags(write=False)
        tensors[tname] = arr
    return {str(k): str(v) for k, v in meta.items()}, tensors
