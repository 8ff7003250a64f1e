"""`capsteer serve MODEL [vllm serve flags] [capsteer flags]`: vLLM's own OpenAI server
with capsteer's worker in every engine process and capsteer's middleware on its app.

capsteer flags are parsed here; every other flag goes to `vllm serve` unchanged.
The settings reach the API process(es) through one environment variable and the
workers through vLLM's `--additional-config`; a private runtime directory (pending
captures shared by several API server processes) through another.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
from collections.abc import Collection, Iterator, Sequence
from typing import NamedTuple

from capsteer.config.cli import SERVER_FLAGS, add_server_flags, overrides_from_args
from capsteer.config.server import ENV_VAR, ConfigError, resolve_settings
from capsteer.engine_ext.lifeline import mark_launcher
from capsteer.engine_ext.vllm.version import hooks_code_hash
from capsteer.server.leftovers import sweep_and_log
from capsteer.server.peers import RUNTIME_ENV, make_runtime_dir

WORKER_CLS = "capsteer.engine_ext.worker.CapsteerWorker"
MIDDLEWARE = "capsteer.server.middleware.CapsteerMiddleware"
CPU_DEFAULTS = ["--gpu-memory-utilization", "0.3", "--max-model-len", "2048"]


def vllm_argv(model: str, passthrough: list[str], worker_config: dict | None = None,
              file_tokens: list[str] | None = None) -> list[str]:
    """Arguments of `vllm serve` with the capsteer worker, middleware and config folded in.
    `--additional-config`, in every spelling vLLM reads (`=`, `_`, dotted keys, a config
    file's: `file_tokens`, which come first), becomes the one value vLLM would have read,
    with capsteer's section added."""
    argv, extra = take_additional_config([*(file_tokens or []), *passthrough])
    worker = _flag_value(argv, ("--worker-cls",))
    if worker is not None and worker != WORKER_CLS:
        raise SystemExit(f"capsteer serve: --worker-cls {worker} is not supported: capsteer's "
                         f"worker ({WORKER_CLS}) installs the hooks, and vLLM runs one worker "
                         "class")
    section = extra.setdefault("capsteer", {})
    if not isinstance(section, dict):
        raise SystemExit("capsteer serve: --additional-config's \"capsteer\" key is capsteer's "
                         "worker section; it must be an object")
    section.update(worker_config or {})
    section["hooks_code"] = hooks_code_hash()
    section["frontend"] = "server"  # lets the workers tell served DP from the in-process engine
    if worker is None:
        argv += ["--worker-cls", WORKER_CLS]
    return [model, *argv, "--middleware", MIDDLEWARE, "--additional-config", json.dumps(extra)]


def _normalized(arg: str) -> tuple[str, str, str]:
    """(flag name as vLLM reads it, "=" or "", inline value): `_` in the name's first part
    reads as `-` (dotted keys after it are kept as given)."""
    name, eq, value = arg.partition("=")
    if name.startswith("--"):
        head, dot, tail = name[2:].partition(".")
        name = "--" + head.replace("_", "-") + dot + tail
    return name, eq, value


class FlagUse(NamedTuple):
    """One occurrence of a flag in an argv."""

    index: int  # where the flag's token is
    name: str  # the flag as vLLM reads it (`_normalized`)
    value: str | None  # `--x=v`'s v or the next token; None: the flag ends the argv
    width: int  # tokens the flag and its value take: 2 for `--x v`, else 1


def _flag_uses(argv: Sequence[str], names: Collection[str], *, dotted: bool = False,
               skip_values: bool = False) -> Iterator[FlagUse]:
    """Every occurrence of the flags `names` (`--x=v`, `--x v`, `_` spellings), in order; one
    walker so that every reader of vLLM's flags agrees on what a flag's value is.
    `dotted`: `NAME.key` counts as NAME's too (vLLM's dict flags). Readers look at every
    token, a watched flag's value included (a refused flag is never hidden behind another
    flag); `skip_values` steps over a found flag's value, as the takers that remove a flag
    and its value need."""
    i = 0
    while i < len(argv):
        name, eq, given = _normalized(argv[i])
        head, dot, _ = name.partition(".")
        if name in names or (dotted and dot and head in names):
            if eq:
                use = FlagUse(i, name, given, 1)
            elif i + 1 < len(argv):
                use = FlagUse(i, name, argv[i + 1], 2)
            else:
                use = FlagUse(i, name, None, 1)
            yield use
            if skip_values:
                i += use.width
                continue
        i += 1


def _without(argv: Sequence[str], uses: Collection[FlagUse]) -> list[str]:
    """`argv` less the tokens of `uses` (each flag and its value)."""
    taken = {i for use in uses for i in range(use.index, use.index + use.width)}
    return [arg for i, arg in enumerate(argv) if i not in taken]


def take_additional_config(argv: list[str]) -> tuple[list[str], dict]:
    """(argv without any `--additional-config`, the value vLLM would read from them): the
    last whole value, unless dotted keys are given, whose dict then replaces it (vLLM adds
    them as one more value after all others), with vLLM's value reading ("1k" = 1000)."""
    uses = list(_flag_uses(argv, ("--additional-config",), dotted=True, skip_values=True))
    whole: dict = {}
    dotted: dict = {}
    for use in uses:
        if use.value is None:
            raise SystemExit(f"capsteer serve: {argv[use.index]} needs a value")
        if use.name == "--additional-config":
            whole = _json_object(use.value, "--additional-config")
        else:
            _set_dotted(dotted, use.name.removeprefix("--additional-config."), use.value)
    has_dotted = any(use.name != "--additional-config" for use in uses)
    return _without(argv, uses), dotted if has_dotted else whole


def _json_object(value: object, what: str) -> dict:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise SystemExit(f"capsteer serve: {what}: not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise SystemExit(f"capsteer serve: {what} must be a JSON object")
    return value


def _set_dotted(merged: dict, key: str, value: str) -> None:
    *parents, leaf = key.split(".")
    node = merged
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise SystemExit(f"capsteer serve: additional-config.{key}: {part} is not an object")
    try:
        node[leaf] = json.loads(value)
    except ValueError:
        try:
            from vllm.utils.argparse_utils import human_readable_int

            node[leaf] = human_readable_int(value)
        except Exception:  # vLLM keeps such a value as text too
            node[leaf] = value


def file_additional_config(keys: dict) -> list[str]:
    """Pop a config file's additional-config (a mapping, JSON text, or dotted
    `additional-config.x` keys) from `keys` (vLLM's share of the file), as the command-line
    tokens vLLM makes of them: they come before the command line's own."""
    tokens: list[str] = []
    for key in list(keys):
        head, dot, tail = str(key).partition(".")
        if head.replace("_", "-") != "additional-config":
            continue
        value = keys.pop(key)
        text = value if isinstance(value, str) else json.dumps(value)
        tokens += [f"--additional-config{dot}{tail}", text]
    return tokens


def model_first(argv: list[str]) -> list[str]:
    """`serve` arguments with the model first, as capsteer's parser reads them. vLLM also
    takes `--model M`; capsteer's own flags may come before the model; a vLLM flag before
    it is refused (which vLLM flags take a value is vLLM's to know, so "--port 8000 M"
    cannot be told from "--enforce-eager M")."""
    valued = {f.flag for f in SERVER_FLAGS}
    i = 0
    while i < len(argv):
        name, eq, _ = _normalized(argv[i])
        if not argv[i].startswith("-"):
            return [argv[i], *argv[:i], *argv[i + 1:]]
        if name in ("--cpu-defaults", "--vanilla"):
            i += 1
        elif name in valued:
            i += 1 if eq else 2
        else:
            break
    for use in _flag_uses(argv, ("--model",)):
        if use.value is not None:
            return [use.value, *_without(argv, [use])]
    raise SystemExit("capsteer serve: give the model first, as with vllm serve: "
                     "`capsteer serve MODEL [flags]` (or `--model MODEL`)")


# vLLM DP launch modes capsteer refuses (engine_ext/vllm/refusals.data_parallel_problem says why
# for the resolved config; this catches the flags before minutes of engine start-up).
UNSUPPORTED_DP_FLAGS = {
    ("--data-parallel-external-lb", "-dpe"): "external data-parallel load balancing",
    ("--data-parallel-rank", "-dpn"): "external data-parallel load balancing",
    ("--data-parallel-multi-port-external-lb", "-dpm"): "external data-parallel load balancing",
    ("--data-parallel-hybrid-lb", "-dph"): "hybrid data-parallel load balancing",
    ("--data-parallel-start-rank", "-dpr"): "hybrid / multi-node data parallelism",
    ("--headless",): "engines without an API server (multi-node data parallelism)",
}
DP_BACKEND_FLAGS = ("--data-parallel-backend", "-dpb")  # only its default, mp, is served


def refuse_unsupported_dp(passthrough: list[str]) -> None:
    """SystemExit naming the first vLLM data-parallel flag capsteer cannot serve."""
    refused = {name: (flags, what) for flags, what in UNSUPPORTED_DP_FLAGS.items()
               for name in flags}
    # every occurrence is judged (vLLM reads the last backend given; none may be another)
    for use in _flag_uses(passthrough, (*refused, *DP_BACKEND_FLAGS)):
        if use.name in refused:
            flags, what = refused[use.name]
            raise SystemExit(
                f"capsteer serve: {flags[0]} is not supported ({what}); capsteer serves "
                "vLLM's internal load balancing with every engine on this node: "
                "`capsteer serve MODEL --data-parallel-size N` (docs/server.md, Data "
                "parallelism)")
        value = use.value or ""
        if value != "mp":
            raise SystemExit(f"capsteer serve: --data-parallel-backend {value} is not "
                             "supported; only the default mp backend is")
    local = _flag_value(passthrough, ("--data-parallel-size-local", "-dpl"))
    size = _flag_value(passthrough, ("--data-parallel-size", "-dp")) or "1"
    if local is not None and local.isdigit() and size.isdigit() and int(local) < int(size):
        raise SystemExit(
            f"capsteer serve: --data-parallel-size-local {local} below --data-parallel-size "
            f"{size} is not supported (engines on several nodes); capsteer serves every "
            "engine on this node: `capsteer serve MODEL --data-parallel-size N` "
            "(docs/server.md, Data parallelism)")


def _flag_value(argv: list[str], names: tuple[str, ...]) -> str | None:
    """The last value given to a flag (`--flag V` or `--flag=V`), as vLLM's parser reads it."""
    uses = list(_flag_uses(argv, names))
    return uses[-1].value if uses else None


def add_command(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="OpenAI-compatible server with capsteer hooks",
                              add_help=False)
    p.add_argument("model")
    _add_serve_flags(p)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace, passthrough: list[str] | None = None) -> int:
    # Start-up cost: these import vLLM, which `capsteer serve --help` never needs.
    from capsteer.engine_ext.vllm.refusals import refuse_at_vllm_config_step
    from capsteer.engine_ext.vllm.serve import run_vllm_serve
    from capsteer.engine_ext.vllm.version import UnsupportedError

    # `--config` is vllm serve's config file; capsteer takes its own keys from it.
    # `--vllm-config` is an older spelling of the same.
    extra, older = _take_flag(list(passthrough or []), "--vllm-config")
    if older is not None:
        if args.config is not None:
            raise SystemExit("capsteer serve: give one config file: --config FILE holds "
                             "vLLM's flags and capsteer's settings alike")
        args.config = older
    config = args.config
    if args.cpu_defaults:
        extra = CPU_DEFAULTS + extra
    try:
        # flag > CAPSTEER_* env > --config file > default (cli.load_from_args), and the
        # file's other keys, vLLM's, from the same single read of it
        resolved = resolve_settings(overrides_from_args(args), config, shared=True)
    except ConfigError as exc:
        raise SystemExit(f"capsteer serve: {exc}") from None
    settings, vllm_keys = resolved.settings, dict(resolved.vllm_keys)
    file_tokens: list[str] = []
    if not args.vanilla:  # capsteer merges it with its own section (vllm_argv)
        file_tokens = file_additional_config(vllm_keys)
        if any(str(k).replace("_", "-") == "worker-cls" for k in vllm_keys):
            raise SystemExit(f"capsteer serve: {config}: worker-cls is not supported: "
                             f"capsteer's worker ({WORKER_CLS}) installs the hooks")
    config_file = _vllm_config_file(vllm_keys)
    if config_file is not None:
        extra = ["--config", config_file, *extra]
    if args.vanilla:
        run_vllm_serve([args.model, *extra])
        return 0
    refuse_unsupported_dp(extra)
    argv = vllm_argv(args.model, extra, settings.worker_config(), file_tokens)
    os.environ[ENV_VAR] = settings.to_env()
    # the API processes sign their payloads with it and the workers check it (plan.py)
    from capsteer.engine_ext.payload import PAYLOAD_KEY_ENV

    os.environ.setdefault(PAYLOAD_KEY_ENV, secrets.token_hex(16))
    mark_launcher()  # the engine processes vLLM starts exit if this process is killed
    if RUNTIME_ENV not in os.environ:  # shared by the API server processes vLLM starts
        sweep_and_log()  # what a predecessor killed by SIGKILL left (server/leftovers.py)
        os.environ[RUNTIME_ENV] = make_runtime_dir()
    host = _flag_value(extra, ("--host",)) or "127.0.0.1"
    port = _flag_value(extra, ("--port",)) or "8000"
    served = _flag_value(extra, ("--served-model-name",)) or args.model
    # in vLLM's config step, before any engine; the hint only once the config passed
    refuse_at_vllm_config_step(
        WORKER_CLS, on_accept=lambda: print(ready_hint(served, host, port), flush=True))
    try:
        run_vllm_serve(argv)
    except UnsupportedError as exc:
        raise SystemExit(f"capsteer serve: {exc}") from None
    return 0


def _take_flag(argv: list[str], flag: str) -> tuple[list[str], str | None]:
    """(argv without `flag` and its value, the last value given)."""
    uses = list(_flag_uses(argv, (flag,), skip_values=True))
    if any(use.value is None for use in uses):
        raise SystemExit(f"capsteer serve: {flag} needs a value")
    return _without(argv, uses), uses[-1].value if uses else None


def serve_help() -> str:
    """`capsteer serve --help`: capsteer's own flags; vLLM's are `vllm serve --help`'s."""
    parser = argparse.ArgumentParser(
        prog="capsteer serve", usage="capsteer serve MODEL [vllm serve flags] [capsteer flags]",
        description="vLLM's OpenAI-compatible server with capsteer's capture and steering. "
                    "Every flag not listed here is `vllm serve`'s, with vLLM's meaning "
                    "(`vllm serve --help`; `--help=GROUP` shows vLLM's groups).")
    _add_serve_flags(parser)
    return parser.format_help()


def _add_serve_flags(p: argparse.ArgumentParser | argparse._ActionsContainer) -> None:
    p.add_argument("--cpu-defaults", action="store_true",
                   help="flags that fit a 2-core CPU machine")
    p.add_argument("--vanilla", action="store_true",
                   help="run stock `vllm serve` with the same flags and no capsteer "
                        "(side-by-side comparisons)")
    add_server_flags(p)


def _vllm_config_file(keys: dict) -> str | None:
    """vLLM's share of a `--config` file, as a YAML file of its own (vLLM reads it), or None
    when the file held capsteer settings only."""
    if not keys:
        return None
    import atexit
    import shutil
    import tempfile

    import yaml

    folder = tempfile.mkdtemp(prefix="capsteer-vllm-config-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    path = os.path.join(folder, "vllm.yaml")
    with open(path, "w", encoding="utf-8") as fh:
        yaml.safe_dump(keys, fh, sort_keys=False)
    return path


def ready_hint(model: str, host: str, port: str) -> str:
    """A curl line to paste once the server is up: a completion that captures and waits."""
    body = json.dumps({"model": model, "prompt": "hello world", "max_tokens": 8,
                       "capture": {"hooks": ["resid_post"], "layers": "all",
                                   "positions": "prompt"}, "capture_wait": True})
    return (f"capsteer: once ready, try:\n  curl -s http://{host}:{port}/v1/completions "
            f"-H 'Content-Type: application/json' -d '{body}'")
