"""`capsteer` command line: one entry point, each concern registers its own commands."""

from __future__ import annotations

import argparse
import sys

from capsteer import demo_model


def build_parser() -> argparse.ArgumentParser:
    """Every command's parser, registered by the module that owns the command."""
    # Start-up cost: these modules import torch (through capsteer.capture); `capsteer serve
    # --help` and `capsteer extract` load only what they need, in `main`.
    from capsteer.capture import cli as capture_cli
    from capsteer.capture import export
    from capsteer.config import cli as config_cli
    from capsteer.extraction import cli as extraction_cli
    from capsteer.server import launch

    parser = argparse.ArgumentParser(prog="capsteer")
    sub = parser.add_subparsers(dest="command", required=True)
    demo_model.add_command(sub)
    launch.add_command(sub)
    extraction_cli.add_command(sub)
    config_cli.add_command(sub)
    export.add_command(sub)
    capture_cli.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["extract"]:  # its own parser: capsteer's job flags + vLLM's engine flags
        from capsteer.extraction import cli as extraction_cli  # start-up cost, as above

        return extraction_cli.main(argv[1:])
    if argv[:1] == ["serve"]:  # every unknown flag belongs to `vllm serve`
        from capsteer.server import launch  # start-up cost, as above

        if not argv[1:]:
            print(launch.serve_help(), file=sys.stderr)
            return 2
        if {"-h", "--help"} & set(argv[1:]):  # --help=GROUP is vLLM's
            print(launch.serve_help())
            return 0
        argv = ["serve", *launch.model_first(argv[1:])]
        args, passthrough = build_parser().parse_known_args(argv)
        return int(args.func(args, passthrough) or 0)
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
