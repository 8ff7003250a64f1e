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

from capsteer.config.cli import add_server_flags, load_from_args
from capsteer.config.server import ENV_VAR, ConfigError
from capsteer.engine_ext.lifeline import mark_launcher
from capsteer.engine_ext.version import hooks_code_hash
from capsteer.server.peers import RUNTIME_ENV, make_runtime_dir

WORKER_CLS = "capsteer.engine_ext.worker.CapsteerWorker"
MIDDLEWARE = "capsteer.server.middleware.CapsteerMiddleware"
CPU_DEFAULTS = ["--gpu-memory-utilization", "0.3", "--max-model-len", "2048"]


def vllm_argv(model: str, passthrough: list[str], worker_config: dict | None = None) -> list[str]:
    """Arguments of `vllm serve` with the capsteer worker, middleware and config folded in."""
    argv = [model, *passthrough]
    if "--worker-cls" not in passthrough:
        argv += ["--worker-cls", WORKER_CLS]
    extra: dict = {}
    if "--additional-config" in passthrough:
        i = passthrough.index("--additional-config")
        extra = json.loads(passthrough[i + 1])
        del argv[1 + i: 1 + i + 2]
    section = extra.setdefault("capsteer", {})
    section.update(worker_config or {})
    section["hooks_code"] = hooks_code_hash()
    section["frontend"] = "server"  # lets the workers tell served DP from the in-process engine
    return [*argv, "--middleware", MIDDLEWARE, "--additional-config", json.dumps(extra)]


# vLLM DP launch modes capsteer refuses (engine_ext/adapter.data_parallel_problem says why
# for the resolved config; this catches the flags before minutes of engine start-up).
UNSUPPORTED_DP_FLAGS = {
    ("--data-parallel-external-lb", "-dpe"): "external data-parallel load balancing",
    ("--data-parallel-rank", "-dpn"): "external data-parallel load balancing",
    ("--data-parallel-multi-port-external-lb", "-dpm"): "external data-parallel load balancing",
    ("--data-parallel-hybrid-lb", "-dph"): "hybrid data-parallel load balancing",
    ("--data-parallel-start-rank", "-dpr"): "hybrid / multi-node data parallelism",
    ("--headless",): "engines without an API server (multi-node data parallelism)",
}


def refuse_unsupported_dp(passthrough: list[str]) -> None:
    """SystemExit naming the first vLLM data-parallel flag capsteer cannot serve."""
    for i, arg in enumerate(passthrough):
        name = arg.split("=", 1)[0]
        for flags, what in UNSUPPORTED_DP_FLAGS.items():
            if name in flags:
                raise SystemExit(
                    f"capsteer serve: {flags[0]} is not supported ({what}); capsteer serves "
                    "vLLM's internal load balancing with every engine on this node: "
                    "`capsteer serve MODEL --data-parallel-size N` (docs/server.md, Data "
                    "parallelism)")
        if name in ("--data-parallel-backend", "-dpb"):
            value = arg.split("=", 1)[1] if "=" in arg else (
                passthrough[i + 1] if i + 1 < len(passthrough) else "")
            if value != "mp":
                raise SystemExit(f"capsteer serve: --data-parallel-backend {value} is not "
                                 "supported; only the default mp backend is")


def add_command(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="OpenAI-compatible server with capsteer hooks",
                              add_help=False)
    p.add_argument("model")
    p.add_argument("--cpu-defaults", action="store_true",
                   help="flags that fit a 2-core CPU machine")
    p.add_argument("--vanilla", action="store_true",
                   help="run stock `vllm serve` with the same flags and no capsteer "
                        "(side-by-side comparisons)")
    add_server_flags(p)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace, passthrough: list[str] | None = None) -> int:
    from capsteer.engine_ext.adapter import run_vllm_serve

    # `--config` is capsteer's settings file; vLLM's own `--config` is `--vllm-config`.
    extra = ["--config" if a == "--vllm-config" else a for a in (passthrough or [])]
    if args.cpu_defaults:
        extra = CPU_DEFAULTS + extra
    try:
        settings = load_from_args(args)  # flag > CAPSTEER_* env > --config file > default
    except ConfigError as exc:
        raise SystemExit(f"capsteer serve: {exc}") from None
    if args.vanilla:
        run_vllm_serve([args.model, *extra])
        return 0
    refuse_unsupported_dp(extra)
    os.environ[ENV_VAR] = settings.to_env()
    mark_launcher()  # the engine processes vLLM starts exit if this process is killed
    if RUNTIME_ENV not in os.environ:  # shared by the API server processes vLLM starts
        os.environ[RUNTIME_ENV] = make_runtime_dir()
    host = extra[extra.index("--host") + 1] if "--host" in extra else "127.0.0.1"
    port = extra[extra.index("--port") + 1] if "--port" in extra else "8000"
    served = extra[extra.index("--served-model-name") + 1] if "--served-model-name" in extra \
        else args.model
    print(ready_hint(served, host, port), flush=True)
    run_vllm_serve(vllm_argv(args.model, extra, settings.worker_config()))
    return 0


def ready_hint(model: str, host: str, port: str) -> str:
    """A curl line to paste once the server is up: a completion that captures and waits."""
    body = json.dumps({"model": model, "prompt": "hello world", "max_tokens": 8,
                       "capture": {"hooks": ["resid_post"], "layers": "all",
                                   "positions": "prompt"}, "capture_wait": True})
    return (f"capsteer: once ready, try:\n  curl -s http://{host}:{port}/v1/completions "
            f"-H 'Content-Type: application/json' -d '{body}'")
