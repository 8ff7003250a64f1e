"""An extraction job as SAELens's pre-computed activations, with no code of the user's.

SAELens (6.x) trains from a Hugging Face `datasets` directory written by
`save_to_disk`: one column named after the SAE's `hook_name`, each row an
`Array2D(shape=(context_size, d_in))` of consecutive tokens' activations, and an optional
`token_ids` column (`Sequence(int32, length=context_size)`). Its training runner loads it
with `datasets.load_from_disk(cached_activations_path)` when
`use_cached_activations=True`.

capsteer rows are per request and of any length; SAELens rows are fixed-length windows.
The export concatenates the job's rows in index order and cuts them into windows of
`context_size` tokens (SAELens's own cache also packs documents into windows); the tail
that does not fill a window is left out and counted. Memory stays bounded: rows are read
from memory-mapped shards and written in Arrow files of `rows_per_file` windows. The
dataset is assembled under a hidden temporary name and renamed into place only when
complete, so a partial export is never visible under the name SAELens is given.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open

from capsteer.capture.layouts import key_name
from capsteer.capture.published import CaptureReadError
from capsteer.capture.sharded import ShardedCapture, read_sharded
from capsteer.hooks import canonical_hook, tl_hook_name

EXPORT_INFO = "capsteer_export.json"
DTYPES = {"float32": np.float32, "float16": np.float16}


@dataclass(frozen=True)
class SaeLensExport:
    """What an export wrote, and the SAELens settings that read it."""

    path: Path
    columns: dict[str, tuple[str, int]]   # column (SAELens hook_name) -> (hook, layer)
    context_size: int
    d_in: int  # the first column's width
    sequences: int
    dropped_rows: int
    files: int
    # column -> its width where columns differ (mlp_post's d_mlp beside mlp_in's hidden)
    d_ins: dict[str, int] | None = None

    def sae_lens_config(self, column: str | None = None) -> dict[str, Any]:
        """The LanguageModelSAERunnerConfig fields that point SAELens at this export."""
        column = column or next(iter(self.columns))
        d_in = (self.d_ins or {}).get(column, self.d_in)
        return {"hook_name": column, "d_in": d_in, "context_size": self.context_size,
                "use_cached_activations": True, "cached_activations_path": str(self.path)}


def _select_keys(job: ShardedCapture, keys: list[tuple[str, int]] | None
                 ) -> list[tuple[str, int]]:
    held = job.keys()
    if not keys:
        return held
    chosen = [(canonical_hook(h), int(layer)) for h, layer in keys]
    missing = [k for k in chosen if k not in held]
    if missing:
        raise KeyError(f"{missing} not in this job; it holds {held}")
    return chosen


def _row_chunks(job: ShardedCapture, names: list[str]
                ) -> Iterator[tuple[list[np.ndarray], np.ndarray]]:
    """(per-key rows, token ids) of each indexed request, in index order, read through
    memory-mapped slices of the shard that holds it."""
    handle, open_name = None, None
    try:
        for entry in job.index:
            if entry["shard"] != open_name:
                if handle is not None:
                    handle.__exit__(None, None, None)
                handle = safe_open(job.path / entry["shard"], framework="pt")
                handle.__enter__()
                open_name = entry["shard"]
            lo = int(entry["row_start"])
            hi = lo + int(entry["row_count"])
            rows = [handle.get_slice(n)[lo:hi].float().numpy() for n in names]
            yield rows, handle.get_slice("token_ids")[lo:hi].numpy()
    finally:
        if handle is not None:
            handle.__exit__(None, None, None)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def export_sae_lens(job_dir: str | Path, out_dir: str | Path, *,
                    keys: list[tuple[str, int]] | None = None, context_size: int = 128,
                    hook_names: dict[tuple[str, int], str] | None = None,
                    dtype: str = "float32", rows_per_file: int = 1024,
                    progress: bool = True, verify: bool = True) -> SaeLensExport:
    """Write `out_dir` as a `datasets` directory SAELens trains from.

    `keys` picks (hook, layer) pairs (default: every key in the job), each one column
    named by TransformerLens (`blocks.{layer}.hook_{hook}`, mlp_in's
    `blocks.{layer}.ln2.hook_normalized`) unless `hook_names` maps it to another name (for
    SAELens's `AutoModelForCausalLM` models, whose hook names are HF module names)."""
    try:  # optional dependency (the sae extra)
        import datasets
        from datasets.arrow_writer import ArrowWriter
    except ImportError as e:
        raise ImportError("the SAELens export needs `datasets`: pip install 'capsteer[sae]'") from e

    if context_size < 1 or rows_per_file < 1:
        raise ValueError("context_size and rows_per_file must be positive")
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: one of {sorted(DTYPES)} (Arrow has no bfloat16)")
    out = Path(out_dir)
    if out.exists():
        raise FileExistsError(f"{out} exists; an export never overwrites")
    job = read_sharded(job_dir, verify=verify)
    chosen = _select_keys(job, keys)
    names = {k: (hook_names or {}).get(k) or tl_hook_name(*k) for k in chosen}
    if len(set(names.values())) != len(names):
        raise ValueError(f"column names collide: {names}")
    hook_widths = job.manifest.get("hook_widths") or {}
    widths = {k: int(hook_widths.get(k[0], job.manifest["hidden_size"])) for k in chosen}
    d_in = widths[chosen[0]]
    total_rows = sum(int(e["row_count"]) for e in job.index)
    sequences = total_rows // context_size
    if sequences == 0:
        raise ValueError(f"the job holds {total_rows} rows, fewer than one window of "
                         f"context_size={context_size}")
    n_files = -(-sequences // rows_per_file)
    features = datasets.Features({
        **{names[k]: datasets.Array2D(shape=(context_size, widths[k]), dtype=dtype)
           for k in chosen},
        "token_ids": datasets.Sequence(datasets.Value("int32"), length=context_size)})
    np_dtype = DTYPES[dtype]

    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    files: list[str] = []
    bar = _progress(sequences, progress)
    try:
        window = context_size * rows_per_file
        acts = [np.empty((window, widths[k]), np_dtype) for k in chosen]
        tokens = np.empty(window, np.int32)
        filled = 0
        written = 0

        def flush(n_rows: int) -> None:
            nonlocal written
            n_seq = n_rows // context_size
            name = f"data-{len(files):05d}-of-{n_files:05d}.arrow"
            with ArrowWriter(features=features, path=str(tmp / name)) as writer:
                batch: dict[str, Any] = {
                    names[k]: list(a[: n_seq * context_size].reshape(n_seq, context_size,
                                                                      widths[k]))
                    for k, a in zip(chosen, acts, strict=True)}
                batch["token_ids"] = list(tokens[: n_seq * context_size]
                                          .reshape(n_seq, context_size))
                writer.write_batch(batch)
                writer.finalize()
            with open(tmp / name, "rb+") as fh:
                os.fsync(fh.fileno())
            files.append(name)
            written += n_seq
            bar.update(n_seq)

        tensor_names = [key_name(*k) for k in chosen]
        for rows, ids in _row_chunks(job, tensor_names):
            start = 0
            while start < len(ids) and written + filled // context_size < sequences:
                take = min(len(ids) - start, window - filled)
                for buf, r in zip(acts, rows, strict=True):
                    buf[filled:filled + take] = r[start:start + take]
                tokens[filled:filled + take] = ids[start:start + take]
                filled += take
                start += take
                if filled == window:
                    flush(filled)
                    filled = 0
        if filled >= context_size:
            flush(filled)
        assert written == sequences, (written, sequences)

        _write_dataset_metadata(tmp, features, files, job, names, context_size, dtype)
        info = {"format": "sae-lens-cached-activations", "job": str(job.path),
                "job_manifest_sha256": _manifest_digest(job),
                "columns": {v: list(k) for k, v in names.items()}, "d_in": d_in,
                "d_ins": {names[k]: w for k, w in widths.items()},
                "context_size": context_size, "dtype": dtype, "sequences": sequences,
                "dropped_rows": total_rows - sequences * context_size,
                "requests": len(job.index)}
        (tmp / EXPORT_INFO).write_text(json.dumps(info, indent=2) + "\n")
        _fsync_dir(tmp)
        os.rename(tmp, out)
        _fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        bar.close()
    return SaeLensExport(path=out, columns={v: k for k, v in names.items()},
                         context_size=context_size, d_in=d_in, sequences=sequences,
                         d_ins={names[k]: w for k, w in widths.items()},
                         dropped_rows=total_rows - sequences * context_size, files=len(files))


def _manifest_digest(job: ShardedCapture) -> str:
    return hashlib.sha256(json.dumps(job.manifest, sort_keys=True).encode()).hexdigest()


def _write_dataset_metadata(directory: Path, features: Any, files: list[str],
                            job: ShardedCapture, names: dict[tuple[str, int], str],
                            context_size: int, dtype: str) -> None:
    """`dataset_info.json` and `state.json`, as `Dataset.save_to_disk` leaves them, so
    `datasets.load_from_disk` opens the directory."""
    import datasets  # optional dependency (the sae extra), present once export began

    info = datasets.DatasetInfo(
        description=f"capsteer extraction job {job.path.name} as SAELens cached activations",
        features=features)
    info.write_to_directory(str(directory))
    fingerprint = hashlib.sha256(json.dumps(
        [_manifest_digest(job), sorted(names.values()), context_size, dtype]).encode()
    ).hexdigest()[:16]
    state = {"_data_files": [{"filename": f} for f in files], "_fingerprint": fingerprint,
             "_format_columns": None, "_format_kwargs": {}, "_format_type": None,
             "_output_all_columns": False, "_split": None}
    (directory / "state.json").write_text(json.dumps(state, indent=2) + "\n")


def _progress(total: int, enabled: bool) -> Any:
    """A tqdm bar over windows written (a do-nothing bar when disabled)."""
    from tqdm import tqdm  # start-up cost: loaded only when an export runs

    return tqdm(total=total, unit="window", desc="export", disable=not enabled)



def _parse_keys(hooks: str | None, layers: str | None) -> list[tuple[str, int]] | None:
    if hooks is None and layers is None:
        return None
    if hooks is None or layers is None:
        raise SystemExit("capsteer export: give --hooks and --layers together")
    return [(h.strip(), layer) for h in hooks.split(",") if h.strip()
            for layer in _parse_layer_list(layers)]


def _parse_layer_list(layers: str) -> list[int]:
    """Comma-separated layers, each a number or an inclusive range "a-b" (as `capsteer
    extract --layers` takes them)."""
    out: list[int] = []
    for item in (part.strip() for part in layers.split(",")):
        if not item:
            continue
        lo, dash, hi = item.partition("-")
        if lo.strip().isdigit() and (not dash or hi.strip().isdigit()):
            out.extend(range(int(lo), int(hi if dash else lo) + 1))
        else:
            raise SystemExit(f"capsteer export: --layers {layers!r}: give layer numbers or "
                             "ranges, comma-separated (e.g. 0,16 or 4-8)")
    return out


def add_command(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "export", help="convert an extraction job for a training library (SAELens)",
        description="Write an extraction job as SAELens's pre-computed activations (a "
                    "`datasets` directory: one column per (hook, layer) named after "
                    "TransformerLens, rows of --context-size tokens, plus token_ids). "
                    "Streams shard by shard; the result appears under OUT only when complete.")
    p.add_argument("job", help="extraction job directory (capsteer extract --output)")
    p.add_argument("--to", required=True, choices=["sae-lens"], help="target format")
    p.add_argument("out", help="directory to create (must not exist)")
    p.add_argument("--hooks", help="comma-separated hooks (default: every key in the job)")
    p.add_argument("--layers", help="comma-separated layers (with --hooks)")
    p.add_argument("--context-size", type=int, default=128,
                   help="tokens per row; SAELens's context_size must equal it (default 128)")
    p.add_argument("--hook-name", help="column name for a single exported key (default "
                   "blocks.{layer}.hook_{hook}, mlp_in's blocks.{layer}.ln2.hook_normalized; "
                   "SAELens's AutoModelForCausalLM models use HF "
                   "module names such as model.layers.16)")
    p.add_argument("--capture-dtype", default="float32", choices=sorted(DTYPES),
                   help="stored dtype of the exported activations (Arrow has no bfloat16); "
                        "named as in capsteer extract, where --dtype is the model's")
    p.add_argument("--rows-per-file", type=int, default=1024, help="rows per Arrow file")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_main)


def _main(args: Any) -> int:
    keys = _parse_keys(args.hooks, args.layers)
    hook_names = None
    if args.hook_name:
        if keys is None or len(keys) != 1:
            raise SystemExit("capsteer export: --hook-name names one key: give one --hooks "
                             "and one --layers")
        hook_names = {(canonical_hook(keys[0][0]), keys[0][1]): args.hook_name}
    try:
        result = export_sae_lens(args.job, args.out, keys=keys, context_size=args.context_size,
                                 hook_names=hook_names, dtype=args.capture_dtype,
                                 rows_per_file=args.rows_per_file,
                                 progress=not args.no_progress)
    except (OSError, KeyError, ValueError, ImportError, CaptureReadError) as e:
        raise SystemExit(f"capsteer export: {e}") from None
    print(f"{result.sequences} rows of {result.context_size} tokens in {result.files} files "
          f"under {result.path} ({result.dropped_rows} tail rows left out)")
    for column in result.columns:
        print("SAELens:", json.dumps(result.sae_lens_config(column)))
    return 0
