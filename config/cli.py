"""`capsteer config show`, and the capsteer server flags in one list so `capsteer serve`
and `config show` parse the same flags into the same settings.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import yaml

from capsteer.capture.digests import DIGESTS
from capsteer.capture.publish import IO_MODES
from capsteer.capture.spec import LAYOUTS
from capsteer.config.server import (
    CAPTURE_WRITERS,
    CONFIG_ENV_VAR,
    ENV_PREFIX,
    OVERLOAD_POLICIES,
    ConfigError,
    Resolved,
    ServerSettings,
    load_settings,
    resolve_settings,
)

MASK = "***"


@dataclass(frozen=True)
class ServerFlag:
    """One capsteer server flag; `field` is the ServerSettings field it sets (None: --config)."""

    flag: str
    field: str | None
    help: str
    choices: tuple[str, ...] | None = None
    type: Callable[[str], Any] = str
    metavar: str | None = None

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")


def _field_flag(field: str, **kwargs: Any) -> ServerFlag:
    """A flag whose help comes from the field's description, so defaults live in one place."""
    info = ServerSettings.model_fields[field]
    default = info.get_default(call_default_factory=True)
    shown = "none" if default is None else default
    help_text = f"{info.description} (env {ENV_PREFIX}{field.upper()}; default: {shown})"
    return ServerFlag(f"--{field.replace('_', '-')}", field, help_text.replace("%", "%%"),
                      **kwargs)


SERVER_FLAGS: list[ServerFlag] = [
    ServerFlag("--config", None, "YAML file, as `vllm serve --config` reads it; capsteer takes "
               "its own settings from it (these flags' names, or a `server:` section) and "
               f"leaves every other key to vLLM (a file of capsteer settings only: {CONFIG_ENV_VAR})",
               metavar="FILE"),
    _field_flag("capture_dir", metavar="DIR"),
    _field_flag("capture_layout", choices=tuple(LAYOUTS)),
    _field_flag("capture_overload", choices=OVERLOAD_POLICIES),
    _field_flag("capture_digest", choices=DIGESTS),
    _field_flag("capture_writer", choices=CAPTURE_WRITERS),
    _field_flag("capture_writer_processes", type=int, metavar="N"),
    _field_flag("capture_io", choices=IO_MODES),
    _field_flag("capture_budget", metavar="SIZE"),
    _field_flag("capture_ring", metavar="SIZE"),
    _field_flag("capture_staging_rows", type=int, metavar="N"),
    _field_flag("capture_wait_timeout", type=float, metavar="SECONDS"),
    _field_flag("plain_graphs", choices=("on", "off")),
    _field_flag("stack_room", choices=("on", "off")),
    _field_flag("steering_dir", metavar="DIR"),
    _field_flag("readers_dir", metavar="DIR"),
    _field_flag("admin_key", metavar="KEY"),
    _field_flag("global_capture", metavar="SPEC"),
]


def add_server_flags(parser: argparse._ActionsContainer) -> None:
    """Register SERVER_FLAGS; all default to None so 'not given' falls through to env/file."""
    for f in SERVER_FLAGS:
        parser.add_argument(f.flag, dest=f.dest, default=None, type=f.type, choices=f.choices,
                            metavar=f.metavar, help=f.help)


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Settings fields given on the command line (flags left out are absent)."""
    return {f.field: getattr(args, f.dest) for f in SERVER_FLAGS
            if f.field is not None and getattr(args, f.dest, None) is not None}


def load_from_args(args: argparse.Namespace) -> ServerSettings:
    """Effective settings for parsed SERVER_FLAGS (flag > env > file > default)."""
    return load_settings(overrides_from_args(args), getattr(args, "config", None), shared=True)


def add_command(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("config", help="capsteer server configuration")
    sub = p.add_subparsers(dest="config_command", required=True)
    show = sub.add_parser("show", help="print the effective server settings and their sources")
    show.add_argument("--format", choices=("yaml", "json"), default="yaml")
    add_server_flags(show)
    show.set_defaults(func=_show)


def _show(args: argparse.Namespace) -> int:
    try:
        resolved = resolve_settings(overrides_from_args(args), args.config, shared=True)
    except ConfigError as exc:
        print(f"capsteer config: {exc}", file=sys.stderr)
        return 2
    print(render(resolved, args.format))
    if resolved.vllm_keys and args.format == "yaml":
        print(f"# left to vllm serve: {', '.join(str(k) for k in resolved.vllm_keys)}")
    return 0


def render(resolved: Resolved, fmt: str = "yaml") -> str:
    """Effective settings (admin key masked) with each value's source."""
    values = resolved.settings.model_dump()
    if values["admin_key"] is not None:
        values["admin_key"] = MASK
    config_file = str(resolved.config_file) if resolved.config_file else None
    if fmt == "json":
        return json.dumps({"config_file": config_file, "settings": values,
                           "sources": resolved.sources}, indent=2)
    # YAML that loads back as a config file; the source rides along as a comment
    lines = [f"# capsteer server settings (config file: {config_file or 'none'})"]
    dumped = yaml.safe_dump(values, default_flow_style=None, sort_keys=False, width=1 << 16)
    for line in dumped.rstrip("\n").split("\n"):
        key = line.split(":", 1)[0]
        lines.append(f"{line}  # {resolved.sources[key]}" if key in resolved.sources else line)
    return "\n".join(lines)
