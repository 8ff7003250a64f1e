"""Server settings: one typed record, its defaults, where values come from, and how it
travels to the API process.

`capsteer serve` resolves the settings once (`load_settings`: flag > CAPSTEER_* env >
YAML file > defaults); vLLM then builds its own app in the same process (or in several
API processes), and the capsteer middleware reads the resolved settings back from one
environment variable (`from_env`), so every API process sees the same values and none
of them re-reads the env or the file.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple

import yaml
from pydantic import Field, ValidationError, ValidationInfo, field_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)
from pydantic_settings.exceptions import SettingsError

from capsteer.capture.digests import DEFAULT_DIGEST, DIGESTS
from capsteer.capture.publish import IO_MODES
from capsteer.capture.spec import DEFAULT_SPEC, LAYOUTS
from capsteer.capture.writer.budget import (
    DEFAULT_BUDGET_BYTES,
    DEFAULT_RING_BYTES,
    check_processes,
    check_ring_bytes,
)
from capsteer.config import errors
from capsteer.config.sizes import parse_size

ENV_VAR = "CAPSTEER_SERVER_SETTINGS"  # the resolved settings, JSON, launcher -> API process
ENV_PREFIX = "CAPSTEER_"
CONFIG_ENV_VAR = "CAPSTEER_CONFIG"  # names the YAML file when no --config is given
FILE_SECTION = "server"  # a YAML file may hold the keys under `server:`
OVERLOAD_POLICIES = ("block", "drop", "reject")
CAPTURE_WRITERS = ("process", "threads")

Source = Literal["default", "file", "env", "flag"]

class ConfigError(errors.InvalidInput, ValueError):
    """A setting that cannot be used, named with the source it came from."""


@dataclass(frozen=True)
class _Resolution:
    """How the next `ServerSettings(...)` in this context picks its sources."""

    config_file: Path | None = None  # YAML file to read (None: no file)
    shared_file: bool = False  # the file is `vllm serve --config`'s: other keys are vLLM's
    init_only: bool = False  # from_env: the JSON blob is already the effective config
    file_values: Mapping[str, Any] | None = None  # the file's settings, read already


_RESOLUTION: ContextVar[_Resolution | None] = ContextVar("capsteer_settings_resolution",
                                                        default=None)


@contextmanager
def _resolving(resolution: _Resolution) -> Iterator[None]:
    token = _RESOLUTION.set(resolution)
    try:
        yield
    finally:
        _RESOLUTION.reset(token)


def config_file_path(config_file: str | Path | None = None) -> Path | None:
    """The YAML file to read: the one given, else $CAPSTEER_CONFIG, else none."""
    chosen = config_file if config_file is not None else os.environ.get(CONFIG_ENV_VAR) or None
    return Path(chosen).expanduser() if chosen is not None else None


class ServerSettings(BaseSettings):
    """Everything the capsteer layer of the API server needs (defaults live here only).

    Constructing it directly resolves init kwargs > CAPSTEER_* env > YAML file
    ($CAPSTEER_CONFIG) > defaults; `load_settings` does the same with `ConfigError`s.
    """

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, case_sensitive=False,
                                      env_ignore_empty=True, frozen=True, extra="forbid")

    capture_dir: str = Field("captures", description="capture root")
    capture_layout: str = Field("packed", description="how capture files are laid out: "
                                                      + ", ".join(LAYOUTS))
    capture_overload: str = Field("block", description="when the in-flight budget is full: "
                                  "block (spill), drop, reject (429)")
    capture_digest: str = Field(DEFAULT_DIGEST, description="checksum recorded per file in "
                                "manifests: sha256 (api.md) or blake3 (faster; named in the entry)")
    capture_writer: str = Field("process", description="where durable captures are published: "
                                "process (writer processes beside each capture-writing "
                                "engine worker, TP rank 0 of each stage, so "
                                "publishing never holds the engine's GIL) or threads (in the "
                                "worker process)")
    capture_io: str = Field("buffered", description="how durable capture files reach the "
                            "disk: buffered (the page cache, writeback started as written) "
                            "or direct (O_DIRECT from an aligned staging block: no page-cache "
                            "copy; buffered where the filesystem refuses it)")
    capture_writer_processes: int | None = Field(
        None, description="writer processes per capture-writing engine worker "
        "(capture_writer process); "
        "the budget is split among them, so more than one needs the block policy; none: "
        "2 under block on a host of 8 or more CPUs, else 1")
    capture_budget: int = Field(DEFAULT_BUDGET_BYTES, description="bytes of capture rows in flight "
                                "(engine memory), e.g. 8GiB")
    capture_ring: int = Field(DEFAULT_RING_BYTES, description="each capture writer process's "
                              "shared-memory ring (on a GPU one more of the same size, "
                              "page-locked): how large a burst of captured rows leaves the "
                              "engine before its step waits for the writer, e.g. 256MiB")
    capture_staging_rows: int | None = Field(
        None, description="GPU rows for one engine step's captured activations (a row: one "
        "token at one hook and layer; its GPU memory, rows x hidden x dtype bytes, is taken "
        "before vLLM sizes its KV cache, and twice that of page-locked host memory, on every "
        "GPU worker; CPU engines stage no rows). A step whose captures need more fails its "
        "largest captures with an error receipt naming the rows it needed; none: 4 x "
        "--max-num-batched-tokens")
    plain_graphs: bool = Field(True, description="on a GPU, record each CUDA graph twice: "
                               "with capsteer's tap kernels and without, so engine steps "
                               "whose requests carry no capture or steering replay graphs "
                               "without the taps (off: one set; start-up records half "
                               "as many graphs, plain steps run the taps' empty kernels)")
    stack_room: bool = Field(True, description="run each engine process's step loop with "
                             "128 KiB of fresh Python frame stack under it, so the model's "
                             "per-layer calls never map and unmap CPython's stack chunks "
                             "(off: the loop runs as vLLM starts it)")
    capture_wait_timeout: float = Field(60.0, description="seconds a capture_wait response "
                                        "may be held (then status pending)")
    steering_dir: str = Field("steering-vectors", description="named steering vectors")
    readers_dir: str = Field("readers", description="named readers (linear probes, SAEs): "
                             "uploads, and SAELens directories (cfg.json + "
                             "sae_weights.safetensors) placed in it by name")
    admin_key: str | None = Field(None, description="required (X-Admin-Key header) to "
                                  "change the vector and reader registries; none: they "
                                  "are open")
    capture_default: dict[str, Any] = Field(default_factory=lambda: copy.deepcopy(DEFAULT_SPEC),
                                            description="capture spec fields a request "
                                            "leaves out (env: JSON)")
    global_capture: str | None = Field(None, description="capture shorthand applied to every "
                                       "request without a `capture` field")

    @field_validator("capture_layout", "capture_overload", "capture_digest", "capture_writer",
                     "capture_io")
    @classmethod
    def _check_choice(cls, value: str, info: ValidationInfo) -> str:
        choices = {"capture_layout": LAYOUTS, "capture_overload": OVERLOAD_POLICIES,
                   "capture_digest": DIGESTS, "capture_writer": CAPTURE_WRITERS,
                   "capture_io": IO_MODES}[info.field_name]
        if value not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}; got {value!r}")
        return value

    @field_validator("capture_writer_processes")
    @classmethod
    def _check_processes(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is None:
            return value
        check_processes(value, info.data.get("capture_overload", "block"))
        writer = info.data.get("capture_writer", "process")
        if value > 1 and writer != "process":
            raise ValueError(f"{value} processes need capture_writer process (got {writer!r})")
        return value

    @field_validator("capture_budget", "capture_ring", mode="before")
    @classmethod
    def _parse_size(cls, value: Any) -> Any:
        return parse_size(value) if isinstance(value, (str, int, float)) else value

    @field_validator("capture_budget")
    @classmethod
    def _check_budget(cls, value: int) -> int:
        if value <= 0:
            raise ValueError(f"must be a positive size (e.g. 512MiB, 2GiB); got {value}")
        return value

    @field_validator("capture_ring")
    @classmethod
    def _check_ring(cls, value: int, info: ValidationInfo) -> int:
        check_ring_bytes(value)
        writer = info.data.get("capture_writer", "process")
        if value != DEFAULT_RING_BYTES and writer != "process":
            raise ValueError(f"rings belong to writer processes; capture_writer {writer!r} "
                             "has none")
        return value

    @field_validator("capture_staging_rows", mode="before")
    @classmethod
    def _check_staging_rows(cls, value: Any) -> Any:
        if isinstance(value, bool):  # `capture_staging_rows: yes` would be 1 row
            raise ValueError(f"must be a number of rows; got {value!r}")
        return value

    @field_validator("capture_staging_rows")
    @classmethod
    def _check_staging_rows_positive(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError(f"must be at least 1 row; got {value}")
        return value

    @field_validator("capture_wait_timeout")
    @classmethod
    def _check_timeout(cls, value: float) -> float:
        # JSON (to_env) cannot carry inf/nan, and a wait must end
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"must be a positive, finite number of seconds; got {value}")
        return value

    @field_validator("capture_dir", "steering_dir", "readers_dir", "admin_key",
                     "global_capture")
    @classmethod
    def _check_non_empty(cls, value: str | None) -> str | None:
        # an empty admin key would silently open the registry: leave it out instead
        if value is not None and not value.strip():
            raise ValueError("must not be empty (leave it out to use the default)")
        return value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Precedence: init kwargs (flags) > CAPSTEER_* env > YAML file > field defaults."""
        resolution = _RESOLUTION.get() or _Resolution(config_file=config_file_path())
        if resolution.init_only:
            return (init_settings,)
        if resolution.config_file is None:
            return init_settings, env_settings
        return init_settings, env_settings, YamlFileSource(settings_cls, resolution.config_file,
                                                           shared=resolution.shared_file,
                                                           values=resolution.file_values)

    def to_env(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_env(cls) -> ServerSettings:
        """The settings the launcher resolved (no env/file re-read: the blob is final).

        Without the blob (middleware mounted by a plain `vllm serve`), resolve
        env > file > defaults here.
        """
        raw = os.environ.get(ENV_VAR)
        if not raw:
            return load_settings()
        data = json.loads(raw)
        known = {k: v for k, v in data.items() if k in cls.model_fields}  # newer launcher
        with _resolving(_Resolution(init_only=True)):
            return cls(**known)

    @property
    def readout_dir(self) -> str:
        """Where workers leave readout results for the server (beside the captures: a
        dot-directory no capture path can name)."""
        return os.path.join(os.path.abspath(self.capture_dir), ".readouts")

    def worker_config(self) -> dict[str, Any]:
        """The part the engine workers need (passed through vLLM's additional_config)."""
        config: dict[str, Any] = {"capture_dir": os.path.abspath(self.capture_dir),
                                  "steering_dir": os.path.abspath(self.steering_dir),
                                  "capture_budget": self.capture_budget,
                                  "capture_overload": self.capture_overload,
                                  "readers_dir": os.path.abspath(self.readers_dir),
                                  "readout_dir": self.readout_dir}
        if self.capture_digest != DEFAULT_DIGEST:
            config["capture_digest"] = self.capture_digest
        if self.capture_writer != "process":
            config["capture_writer"] = self.capture_writer
        if self.capture_writer_processes is not None:
            config["capture_writer_processes"] = self.capture_writer_processes
        if self.capture_io != "buffered":
            config["capture_io"] = self.capture_io
        if self.capture_ring != DEFAULT_RING_BYTES:
            config["capture_ring_bytes"] = self.capture_ring
        if self.capture_staging_rows is not None:
            config["staging_rows"] = self.capture_staging_rows
        if not self.plain_graphs:
            config["plain_graphs"] = False
        if not self.stack_room:
            config["stack_room"] = False
        return config


def read_config_file(path: str | Path, shared: bool = False) -> dict[str, Any]:
    """The settings in a YAML file (flat, or under `server:`), unknown keys refused; in a
    `shared` file (`capsteer serve --config`, which is also vLLM's) they are vLLM's."""
    if shared:
        return split_config_file(path)[0]
    path = Path(path)
    return _file_settings(_load_yaml(path), path)


def _load_yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"config file {path}: cannot read it: {exc}") from None


def split_config_file(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(capsteer's settings, every other key) of a YAML file that `capsteer serve --config`
    shares with `vllm serve --config`: capsteer's are its setting names (flat, `-` or `_`)
    and the `server:` section; the rest is vLLM's, as `vllm serve --config` reads it."""
    path = Path(path).expanduser()
    data = _load_yaml(path)
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: expected a mapping of settings, "
                          f"got {type(data).__name__}")
    valid = set(ServerSettings.model_fields)
    ours = {k: v for k, v in data.items()
            if k == FILE_SECTION or str(k).replace("-", "_") in valid}
    if FILE_SECTION in ours and len(ours) > 1:
        raise ConfigError(f"config file {path}: capsteer settings both under '{FILE_SECTION}:' "
                          f"and at the top level ({', '.join(str(k) for k in ours)}); give "
                          "them in one place")
    rest = {k: v for k, v in data.items() if k not in ours}
    return _file_settings(ours, path), rest


def _file_settings(data: Any, path: Path) -> dict[str, Any]:
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: expected a mapping of settings, "
                          f"got {type(data).__name__}")
    if FILE_SECTION in data:
        if set(data) != {FILE_SECTION}:
            extra = sorted(str(k) for k in data if k != FILE_SECTION)
            raise ConfigError(f"config file {path}: unknown top-level key(s) {extra} next to "
                              f"'{FILE_SECTION}:'")
        return _file_settings(data[FILE_SECTION] or {}, path)
    valid = list(ServerSettings.model_fields)
    settings = {str(k).replace("-", "_"): v for k, v in data.items()}
    unknown = [str(k) for k, norm in zip(data, settings, strict=True) if norm not in valid]
    if unknown:
        raise ConfigError(f"config file {path}: unknown key(s) {', '.join(unknown)}; "
                          f"valid keys: {', '.join(valid)}")
    return settings


class YamlFileSource(YamlConfigSettingsSource):
    """pydantic-settings' YAML source, strict: missing file, stray keys are errors.
    `values`: the file's settings as `resolve_settings` read them, so that the sources it
    reports and the settings come from one read (one version of the file)."""

    def __init__(self, settings_cls: type[BaseSettings], path: Path, shared: bool = False,
                 values: Mapping[str, Any] | None = None) -> None:
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        self.shared = shared
        self.values = values
        super().__init__(settings_cls, yaml_file=path)

    def _read_file(self, file_path: Any) -> dict[str, Any]:
        if self.values is not None:
            return dict(self.values)
        return read_config_file(file_path, shared=self.shared)


class Resolved(NamedTuple):
    """Effective settings and where each value came from (for `capsteer config show`)."""

    settings: ServerSettings
    sources: dict[str, Source]
    config_file: Path | None
    # a shared file's other keys (`vllm serve --config`'s), from the same read: `capsteer
    # serve` hands them to vLLM without reading the file again
    vllm_keys: dict[str, Any]


def resolve_settings(overrides: Mapping[str, Any] | None = None,
                     config_file: str | Path | None = None, shared: bool = False) -> Resolved:
    """`load_settings`, plus the source of every field."""
    flags = {k: v for k, v in (overrides or {}).items() if v is not None}
    valid = list(ServerSettings.model_fields)
    unknown = [k for k in flags if k not in valid]
    if unknown:
        raise ConfigError(f"unknown setting(s) {', '.join(unknown)}; valid: {', '.join(valid)}")
    path = config_file_path(config_file)
    # $CAPSTEER_CONFIG is capsteer's alone; a file given as `--config` is vLLM's too
    shared = shared and config_file is not None
    file_values: dict[str, Any] = {}
    vllm_keys: dict[str, Any] = {}
    if path is not None and shared:
        file_values, vllm_keys = split_config_file(path)
    elif path is not None:
        file_values = read_config_file(path)
    try:
        env_values = _env_values()
    except SettingsError as exc:
        match = re.search(r'field "(\w+)"', str(exc))
        field = match.group(1) if match else "?"
        raise ConfigError(f"invalid {field} (from env {ENV_PREFIX}{field.upper()}): "
                          f"not valid JSON") from None
    sources: dict[str, Source] = {
        name: "flag" if name in flags else "env" if name in env_values
        else "file" if name in file_values else "default"
        for name in valid}
    try:
        with _resolving(_Resolution(config_file=path, shared_file=shared,
                                    file_values=file_values)):
            settings = ServerSettings(**flags)
    except ValidationError as exc:
        raise ConfigError(_explain(exc, sources, path)) from None
    return Resolved(settings, sources, path, vllm_keys)


def load_settings(overrides: Mapping[str, Any] | None = None,
                  config_file: str | Path | None = None, shared: bool = False) -> ServerSettings:
    """Effective settings: flag (overrides; None = not given) > CAPSTEER_* env > YAML file
    (`config_file`, else $CAPSTEER_CONFIG) > defaults. Raises `ConfigError`.

    Dict values (capture_default) given both in env and file are merged key by key.
    """
    return resolve_settings(overrides, config_file, shared).settings


def _env_values() -> dict[str, Any]:
    """The fields CAPSTEER_* env sets (the same source `ServerSettings` reads)."""
    from pydantic_settings import EnvSettingsSource

    return EnvSettingsSource(ServerSettings)()


def _where(field: str, source: Source, path: Path | None) -> str:
    return {"flag": f"flag --{field.replace('_', '-')}",
            "env": f"env {ENV_PREFIX}{field.upper()}",
            "file": f"file {path}",
            "default": "default"}[source]


def _explain(exc: ValidationError, sources: Mapping[str, Source], path: Path | None) -> str:
    """One line per bad field: name, source, reason (secrets never echoed)."""
    lines = []
    for err in exc.errors():
        field = str(err["loc"][0]) if err["loc"] else "?"
        reason = str(err["ctx"]["error"]) if err["type"] == "value_error" else err["msg"]
        if err["type"] != "value_error" and field != "admin_key":
            reason += f"; got {err['input']!r}"
        where = _where(field, sources[field], path) if field in sources else "input"
        lines.append(f"invalid {field} (from {where}): {reason}")
    return "; ".join(lines)
