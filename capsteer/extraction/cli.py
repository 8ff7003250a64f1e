"""`capsteer extract`: capsteer's job flags plus vLLM's own engine flags, then a run.

A refusal (bad input, a resumed job that asks for other rows, Ray missing, an
unsupported model) is one line and exit status 2, never a stack.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from capsteer.capture.digests import DIGESTS
from capsteer.capture.spec import DTYPES
from capsteer.config.sizes import parse_size
from capsteer.extraction.job import InputError

DESCRIPTION = (
    "Run the engine in-process over a JSONL/Parquet file of prompts and write safetensors "
    "shards + index.jsonl; re-running resumes. Every vLLM engine flag is accepted with "
    "vLLM's meaning, as `vllm serve` takes it: --dtype is the MODEL's dtype (vLLM's 'auto' "
    "runs a float32 checkpoint in bfloat16 on many devices); --capture-dtype is the dtype "
    "the activations are stored in (default: the model's dtype).")


def add_command(subparsers: Any) -> None:
    """Register `capsteer extract` for `capsteer --help`; its own parser (with every vLLM
    engine flag, which costs a vLLM import) is built by `main` when it runs."""
    p = subparsers.add_parser("extract", add_help=False, help="extract activations for many "
                              "prompts into a sharded dataset (capsteer extract --help)")
    p.set_defaults(func=lambda args: main(["--help"]))


def build_parser() -> Any:
    """capsteer's job flags plus vLLM's own engine flags (EngineArgs.add_cli_args)."""
    # Start-up cost: vLLM takes seconds to import; `capsteer --help` does without it.
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    p = FlexibleArgumentParser(prog="capsteer extract", description=DESCRIPTION)
    p.add_argument("model_tag", nargs="?", help="model directory or name (or --model)")
    job = p.add_argument_group("ExtractionJob", "capsteer: the extraction job (see also --help=ModelConfig for --dtype)")
    job.add_argument("--input", required=True, help="JSONL or Parquet: id, prompt | messages")
    job.add_argument("--output", required=True, help="job directory (created; resumable)")
    job.add_argument("--hooks", default="resid_post", help="comma-separated hook names")
    job.add_argument("--layers", default="all",
                     help='"all", "a-b", "a:b" or ints joined by commas')
    job.add_argument("--positions", default="prompt",
                     help="all | prompt | generated | last_prompt | last | ints joined by commas")
    job.add_argument("--capture-dtype", default="auto", choices=DTYPES,
                     help="dtype the activations are stored in; auto = the model's --dtype. "
                          "Narrower than the model's is allowed and logged.")
    job.add_argument("--shard-size", default="1GiB", help="bytes per shard, e.g. 512MiB")
    job.add_argument("--digest", default="sha256", choices=DIGESTS,
                     help="shard digest recorded in the manifest (blake3: ~3x faster to hash; "
                          "see docs/capture-format.md)")
    job.add_argument("--max-tokens", type=int, default=1,
                     help="tokens generated per request (1: the prompt only is fed)")
    job.add_argument("--full-forward", action="store_true",
                     help="run every layer; by default the forward stops after the deepest "
                          "captured layer (as TransformerLens's stop_at_layer), which changes "
                          "no captured value and saves the later layers' time")
    job.add_argument("--no-progress", action="store_true")
    ray = p.add_argument_group("Ray", "capsteer: run the job on engine replicas through Ray "
                               "Data (needs capsteer[ray]; docs/scale-out.md)")
    ray.add_argument("--ray", action="store_true",
                     help="one engine per replica, each writing its own shards into --output")
    ray.add_argument("--num-replicas", type=int, default=None,
                     help="engine replicas, --tensor-parallel-size GPUs each (1 when not given)")
    ray.add_argument("--ray-address", default=None,
                     help="an existing Ray cluster (e.g. auto, ray://head:10001); default: "
                          "start a local one. Every node and this process must see --output")
    ray.add_argument("--ray-batch-size", type=int, default=None,
                     help="prompts per Ray Data batch (64 when not given; 8 batches are queued per "
                          "replica)")
    EngineArgs.add_cli_args(p)
    return p


def engine_args(args: Any, parser: Any) -> dict[str, Any]:
    """The vLLM engine arguments the command line set (the others keep vLLM's defaults)."""
    from vllm.engine.arg_utils import EngineArgs  # start-up cost, as in build_parser

    names = {f.name for f in dataclasses.fields(EngineArgs)} - {"model"}
    return {n: getattr(args, n) for n in sorted(names)
            if hasattr(args, n) and getattr(args, n) != parser.get_default(n)}


def _split(text: str) -> object:
    """A comma list flag: one value as given, several as ints where they are digits."""
    parts = [t.strip() for t in text.split(",") if t.strip()]
    if len(parts) == 1:
        return parts[0]
    return [int(t) if t.lstrip("-").isdigit() else t for t in parts]


def main(argv: list[str]) -> int:
    """`capsteer extract ARGV`."""
    # Start-up cost: `capsteer --help` imports this module; torch and vLLM load only here.
    from capsteer.engine_ext.vllm.version import UnsupportedError
    from capsteer.extraction.local import extract
    from capsteer.extraction.ray import RayMissing

    parser = build_parser()
    args = parser.parse_args(argv)
    model = args.model_tag or (args.model if args.model != parser.get_default("model") else None)
    if not model:
        parser.error("give the model: capsteer extract MODEL --input ... --output ...")
    kwargs = engine_args(args, parser)
    if not Path(args.input).is_file():
        parser.error(f"--input {args.input}: no such file")
    if "worker_cls" in kwargs:  # capsteer.engine sets its own; vLLM would run only one
        parser.error("--worker-cls: capsteer extract runs capsteer's worker, which installs "
                     "the hooks; a worker of your own cannot run beside it")
    positions = _split(args.positions)
    try:
        result = extract(
            model, args.input, args.output, hooks=args.hooks.split(","),
            layers=_split(args.layers), positions=positions if isinstance(positions, list)
            or not positions.lstrip("-").isdigit() else [int(positions)],
            capture_dtype=args.capture_dtype, shard_size=parse_size(args.shard_size),
            digest=args.digest,
            max_tokens=args.max_tokens, full_forward=args.full_forward,
            progress=not args.no_progress, ray=args.ray,
            num_replicas=args.num_replicas, ray_address=args.ray_address,
            ray_batch_size=args.ray_batch_size, **kwargs)
    except KeyboardInterrupt:
        print(f"\ninterrupted: finished requests are in {args.output}; run the same command "
              "again to resume", flush=True)
        return 130
    except (InputError, ValueError, RayMissing, UnsupportedError) as exc:
        print(f"capsteer extract: {exc}", flush=True)  # one line, not a stack
        return 2
    print(f"{result.requests} requests extracted ({result.skipped} already done), "
          f"{result.tokens} tokens in {result.seconds:.1f} s ({result.tokens_per_s:,.0f} tok/s), "
          f"{result.bytes_written / 2**20:,.1f} MiB in {len(result.shards)} shards under {result.output}"
          + (f"; the forward ran {result.forward_layers} of {result.model_layers} layers"
             if result.forward_layers is not None else ""), flush=True)
    return 0
