"""`capsteer serve MODEL [vllm serve flags]`: vLLM's own OpenAI server, with capsteer's
worker in every engine process.

Request fields (capture, capture_wait, steering), receipts and the extra endpoints
are added by the server module on top of this launcher.
"""

from __future__ import annotations

import argparse
import json

from capsteer.engine_ext.version import hooks_code_hash

WORKER_CLS = "capsteer.engine_ext.worker.CapsteerWorker"
CPU_DEFAULTS = ["--gpu-memory-utilization", "0.3", "--max-model-len", "2048"]


def vllm_argv(model: str, passthrough: list[str]) -> list[str]:
    """Arguments of `vllm serve` with the capsteer worker and its config folded in."""
    argv = [model, *passthrough]
    if "--worker-cls" not in passthrough:
        argv += ["--worker-cls", WORKER_CLS]
    extra: dict = {}
    if "--additional-config" in passthrough:
        i = passthrough.index("--additional-config")
        extra = json.loads(passthrough[i + 1])
        del argv[1 + i: 1 + i + 2]
    extra.setdefault("capsteer", {})["hooks_code"] = hooks_code_hash()
    return [*argv, "--additional-config", json.dumps(extra)]


def add_command(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="OpenAI-compatible server with capsteer hooks",
                              add_help=False)
    p.add_argument("model")
    p.add_argument("--cpu-defaults", action="store_true",
                   help="flags that fit a 2-core CPU machine")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace, passthrough: list[str] | None = None) -> int:
    from capsteer.engine_ext.adapter import run_vllm_serve

    extra = list(passthrough or [])
    if args.cpu_defaults:
        extra = CPU_DEFAULTS + extra
    host = extra[extra.index("--host") + 1] if "--host" in extra else "127.0.0.1"
    port = extra[extra.index("--port") + 1] if "--port" in extra else "8000"
    print(f"capsteer: once ready, try:\n  curl http://{host}:{port}/v1/completions "
          f"-H 'Content-Type: application/json' -d "
          f"'{{\"model\": \"{args.model}\", \"prompt\": \"hello world\", \"max_tokens\": 16}}'",
          flush=True)
    run_vllm_serve(vllm_argv(args.model, extra))
    return 0
