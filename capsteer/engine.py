"""In-process engine: prompts + capture/steering specs in, outputs + captures out.

A thin layer over `vllm.LLM` with capsteer's worker. The server and the
extraction job turn their inputs into the same `extra_args` payload this builds.
Readouts (probe / SAE scores per token) come back in `Result.readout_results`, the
structure the server's non-streaming responses carry.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from capsteer.capture.paths import relative_dir
from capsteer.capture.receipts import Receipt, receipt_at
from capsteer.capture.sink import CapturedActivations
from capsteer.capture.spec import CaptureSpec, SpecError, parse_capture_spec
from capsteer.engine_ext import families
from capsteer.engine_ext.lifeline import mark_launcher
from capsteer.engine_ext.payload import (
    EXTRA_ARGS_KEY,
    RPC_END_CAPTURES,
    RPC_STATS,
    RPC_TAKE_CAPTURES,
    RPC_WRITER_STATS,
    WORKER_CLS,
    build_payload,
    needs_end_report,
    new_readout_id,
)
from capsteer.engine_ext.vllm.version import hooks_code_hash
from capsteer.steering.conditions import ReaderGetter
from capsteer.steering.patches import PatchGetter
from capsteer.steering.readers.collect import Finished, ReadoutCollector
from capsteer.steering.readers.readout import (
    ReadoutItem,
    check_readout_request,
    parse_readout,
)
from capsteer.steering.readers.registry import ReaderRegistry
from capsteer.steering.spec import SteeringSpec, VectorLookup, parse_steering_spec


@dataclass
class Request:
    """One generation: a text prompt or token ids, sampling options, optional hooks."""

    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    capture: object = None
    steering: object = None
    durable: bool = False  # publish the capture to the capture root instead of returning it
    readout: object = None  # the HTTP `readout` field's list (api.md §7)


@dataclass
class Result:
    token_ids: list[int]
    text: str
    prompt_token_ids: list[int]
    capture_id: str | None = None
    captures: CapturedActivations | None = None
    # Per generated token: {token_id: logprob} when the request asked for logprobs.
    logprobs: list[dict[int, float]] | None = None
    # Per prompt token (None for the first): {token_id: logprob}, with `prompt_logprobs`;
    # the fed token is always among them (teacher-forced comparisons read it).
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_cached_tokens: int = 0
    receipt: Receipt | None = None  # durable captures: status, directory, files
    # With `readout`: one entry per item, as the server's `readout_results` (api.md §7).
    readout_results: list[dict[str, Any]] | None = None


def _logprob_steps(steps) -> list[dict[int, float] | None] | None:
    if steps is None:
        return None
    return [None if step is None else {t: lp.logprob for t, lp in step.items()} for step in steps]


def _final_positions(
    caps: CapturedActivations, spec: CaptureSpec, prompt_len: int, num_output: int
) -> CapturedActivations:
    """Apply the position rules with the output length the front end returned: only the
    prompt and the output tokens but the last were fed, whatever the engine ran after a
    stop string or under async scheduling."""
    if caps.error is not None:
        return caps
    fed = prompt_len + max(num_output - 1, 0)
    return caps.select(spec.positions.finalize(caps.positions, prompt_len, fed))


def merge_stages(parts: list[CapturedActivations]) -> CapturedActivations:
    """One capture from the pipeline stages' parts (each holds its own layers' keys; a
    stage holding none of the captured keys sends an empty part)."""
    holding = [p for p in parts if p.tensors] or parts[:1]
    first = holding[0]
    errors = [p.error for p in parts if p.error is not None]
    if not errors and any(not np.array_equal(p.positions, first.positions) for p in holding):
        errors.append("pipeline stages captured different positions")
    if errors:
        return CapturedActivations(first.capture_id, first.positions[:0], first.token_ids[:0],
                                   {}, "; ".join(errors))
    tensors = {k: t for p in holding for k, t in p.tensors.items()}
    return CapturedActivations(first.capture_id, first.positions, first.token_ids, tensors)


class _ReceiptPoller:
    """The manifest on disk is the source of truth: a thread polls each durable capture's
    own directory (the engine dated it) until its manifest is visible, from the batch's
    start, so captures published mid-batch cost nothing after its last output."""

    def __init__(self, root: str | None, rel_dirs: dict[str, str],
                 interval_s: float = 0.02) -> None:
        self.root, self.rel_dirs, self.interval_s = root, rel_dirs, interval_s
        self.found: dict[str, Receipt] = {}
        self._finishing = threading.Event()  # the batch is done: poll at the tail's pace
        self._stopped = False
        self._thread: threading.Thread | None = None
        if rel_dirs:
            self._thread = threading.Thread(target=self._run, name="capsteer-receipts",
                                            daemon=True)
            self._thread.start()

    def _run(self) -> None:
        pending = dict(self.rel_dirs)
        while pending and not self._stopped:
            for capture_id, rel in list(pending.items()):
                receipt = receipt_at(self.root, rel)
                if receipt is not None:
                    self.found[capture_id] = receipt
                    del pending[capture_id]
            if pending:
                self._finishing.wait(self.interval_s)
                if self._finishing.is_set():
                    time.sleep(0.005)

    def stop(self) -> None:
        self._stopped = True
        self._finishing.set()
        if self._thread is not None:
            self._thread.join(1.0)  # at most one pass over the pending manifests

    def wait(self, timeout: float) -> dict[str, Receipt]:
        """Every receipt, once its manifest is visible; TimeoutError naming the missing."""
        if self._thread is None:
            return {}
        self._finishing.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            self.stop()
            missing = sorted(set(self.rel_dirs) - set(self.found))
            raise TimeoutError(f"captures {missing[:4]} not durable after {timeout:g} s")
        return dict(self.found)


class Engine:
    """vLLM's offline engine with capsteer hooks in every worker."""

    def __init__(
        self,
        model: str,
        *,
        capsteer_config: Mapping[str, Any] | None = None,
        vector_lookup: VectorLookup | None = None,
        reader_lookup: ReaderGetter | None = None,
        patch_sources: PatchGetter | None = None,
        **llm_kwargs: Any,
    ) -> None:
        # Start-up cost: vLLM loads when an Engine is made, not at `import capsteer.engine`.
        from vllm import LLM

        from capsteer.engine_ext.vllm.refusals import (
            hooks_unavailable,
            refuse_at_vllm_config_step,
            shards_gathered,
        )

        extra = dict(llm_kwargs.pop("additional_config", None) or {})
        extra["capsteer"] = {"hooks_code": hooks_code_hash(), **dict(capsteer_config or {})}
        # Readout results reach this process through files the workers append to (as they
        # reach the server): a private directory unless one is configured, removed on
        # close; named readers come from `readers_dir` (a private, empty one otherwise,
        # that `self.readers.put` fills).
        self._private: str | None = None
        for key in ("readout_dir", "readers_dir"):
            if not extra["capsteer"].get(key):
                if self._private is None:
                    self._private = tempfile.mkdtemp(prefix="capsteer-engine-")
                    self._cleanup = weakref.finalize(self, shutil.rmtree, self._private, True)
                extra["capsteer"][key] = f"{self._private}/{key.removesuffix('_dir')}"
        self.readout_dir: str = extra["capsteer"]["readout_dir"]
        self.readers_dir: str = extra["capsteer"]["readers_dir"]
        mark_launcher()  # its engine processes exit if this process is killed
        refuse_at_vllm_config_step(WORKER_CLS)  # before the engine starts, not after
        self.llm = LLM(model=model, worker_cls=WORKER_CLS, additional_config=extra, **llm_kwargs)
        hf = self.llm.llm_engine.model_config.hf_config
        self.num_layers = int(hf.num_hidden_layers)
        self.hidden_size = int(hf.hidden_size)
        # Hooks this model does not have (a parallel block's resid_mid): refused by name.
        vllm_config = self.llm.llm_engine.vllm_config
        self.unavailable = hooks_unavailable(
            self.llm.llm_engine.model_config,
            int(vllm_config.parallel_config.tensor_parallel_size), shards_gathered(vllm_config))
        # Widths of the hooks not hidden_size wide (mlp_post: d_mlp).
        self.hook_widths = families.hook_widths(self.llm.llm_engine.model_config.hf_text_config)
        self.dtype = self.llm.llm_engine.model_config.dtype  # what the model runs in
        self.num_stages = int(self.llm.llm_engine.vllm_config.parallel_config
                              .pipeline_parallel_size)
        self.vector_lookup = vector_lookup
        # name -> reader tensors (ReaderRegistry.tensors): `when` gates, SAE-feature vectors
        self.reader_lookup = reader_lookup
        # capture id -> PatchSource (steering/patches.py): what `op: patch` items read
        self.patch_sources = patch_sources
        self.tokenizer = self.llm.get_tokenizer()
        self.capture_dir = extra["capsteer"].get("capture_dir")
        # The server's reader registry, on this engine's readers_dir: readouts name its readers.
        self.readers = ReaderRegistry(self.readers_dir, hidden_size=self.hidden_size,
                                      hook_widths=self.hook_widths, unavailable=self.unavailable)
        if self.reader_lookup is None:  # `when` gates and SAE-feature vectors name them too
            self.reader_lookup = self.readers.tensors
        self._collector: ReadoutCollector | None = None  # made at the first readout

    def stats(self) -> list[dict]:
        """Each worker's diagnostics (mode, plan builds and reuses, sync-checked steps)."""
        return list(self.llm.collective_rpc(RPC_STATS))

    def writer_stats(self) -> list[dict | None]:
        """Each worker's durable-writer stats (budget and ring waits, bytes in flight; None
        where it has no capture_dir or writes no captures, as TP ranks but 0): where a
        capture-heavy batch's time went past the GPU."""
        return list(self.llm.collective_rpc(RPC_WRITER_STATS))

    def close(self) -> None:
        """Stop the engine-core process now rather than at interpreter exit, and remove the
        private readout directory if this engine made one."""
        core = getattr(self.llm.llm_engine, "engine_core", None)
        if core is not None:
            core.shutdown()
        if self._collector is not None:
            self._collector.close()
            self._collector = None
        if self._private is not None:
            self._cleanup()

    def parse(self, req: Request) -> tuple[CaptureSpec | None, SteeringSpec | None]:
        capture = None
        if req.capture not in (None, False):
            capture = parse_capture_spec(req.capture, num_layers=self.num_layers,
                                         unavailable=self.unavailable)
            if int(req.sampling.get("n", 1) or 1) > 1:
                raise SpecError("capture", "one capture per request: use n=1 (send n requests)")
        steering = parse_steering_spec(
            req.steering, num_layers=self.num_layers, hidden_size=self.hidden_size,
            lookup=self.vector_lookup, unavailable=self.unavailable, readers=self.reader_lookup,
            widths=self.hook_widths, patches=self.patch_sources)
        return capture, steering

    def parse_readout(self, req: Request,
                      items: list[ReadoutItem] | None = None) -> list[ReadoutItem] | None:
        """A request's readout items (`items`: already parsed from its `readout`), checked
        as the server checks the HTTP field."""
        if req.readout is None:
            return None
        if items is None:
            items = parse_readout(req.readout, num_layers=self.num_layers,
                                  hidden_size=self.hidden_size, lookup=self.readers.lookup,
                                  widths=self.hook_widths)
        check_readout_request(items, self.unavailable, captures=req.capture not in (None, False),
                              one_sequence=int(req.sampling.get("n", 1) or 1) == 1)
        return items

    def _readouts(self) -> ReadoutCollector:
        if self._collector is None:
            self._collector = ReadoutCollector(self.readout_dir)
        return self._collector

    def generate(self, requests: Sequence[Request], *, timeout: float = 120.0) -> list[Result]:
        """Every request's output, with its captures and readout results once complete
        (TimeoutError after `timeout` seconds of waiting for them past the generation)."""
        # vLLM loads with the engine, not at `import capsteer.engine`.
        from vllm import SamplingParams

        prompts, params, capture_ids, durable, specs = [], [], [], [], []
        payload_dir_time: dict[str, float] = {}  # dates each capture's directory
        parsed: dict[tuple[int, int], tuple] = {}  # a batch often shares one spec object
        awaited: dict[int, str] = {}  # prompt index -> capture id whose end the workers await
        readouts: dict[int, tuple[str, list[ReadoutItem]]] = {}  # prompt index -> id, items
        read_items: dict[int, list[ReadoutItem] | None] = {}  # a batch often shares one list
        for req in requests:
            memo = (id(req.capture), id(req.steering))
            if memo not in parsed or int(req.sampling.get("n", 1) or 1) > 1:
                parsed[memo] = self.parse(req)
            capture, steering = parsed[memo]
            items = read_items[id(req.readout)] = self.parse_readout(
                req, read_items.get(id(req.readout)))
            readout_id = new_readout_id() if items else None
            specs.append(capture)
            if req.durable and not self.capture_dir:
                raise ValueError("durable captures need capsteer_config['capture_dir']")
            # A prompt-only capture needs no end report: its batch runs vLLM's own loop.
            prompt_len = None if req.prompt_token_ids is None else len(req.prompt_token_ids)
            reports = req.durable and capture is not None and \
                needs_end_report(capture, prompt_len)
            payload = build_payload(capture, steering, durable=req.durable, await_end=reports,
                                    readout=items, readout_id=readout_id)
            prompt: dict[str, Any] = (
                {"prompt_token_ids": list(req.prompt_token_ids)}
                if req.prompt_token_ids is not None else {"prompt": req.prompt})
            sampling = dict(req.sampling)
            if payload is not None:
                sampling["extra_args"] = {**sampling.get("extra_args", {}), **payload.extra_args}
                if payload.cache_salt:
                    prompt["cache_salt"] = payload.cache_salt
            prompts.append(prompt)
            params.append(SamplingParams(**sampling))
            capture_ids.append(payload.capture_id if payload else None)
            if payload is not None and payload.capture_id is not None:
                payload_dir_time[payload.capture_id] = \
                    payload.extra_args[EXTRA_ARGS_KEY]["dir_time"]
            durable.append(req.durable)
            if reports:
                awaited[len(prompts) - 1] = payload.capture_id
            if readout_id is not None:
                readouts[len(prompts) - 1] = (readout_id, items)
        # Manifests are read while the batch runs: a capture closed mid-batch is found
        # then, not in a serial pass over every manifest after the last output.
        poller = _ReceiptPoller(self.capture_dir, {
            cid: relative_dir(cid, spec.tag, payload_dir_time[cid])
            for cid, d, spec in zip(capture_ids, durable, specs, strict=True) if cid and d})
        collector = self._readouts() if readouts else None
        try:
            for readout_id, items in readouts.values():  # records are kept from here on
                collector.open(readout_id, items)
            if awaited:
                outputs = self._run_reporting_ends(prompts, params, awaited)
            else:
                outputs = self.llm.generate(prompts, params, use_tqdm=False)
            deadline = time.monotonic() + timeout  # one wait for every kind of result

            def left() -> float:
                return max(deadline - time.monotonic(), 0.0)
            captures = self._collect(
                [c for c, d in zip(capture_ids, durable, strict=True) if c and not d], left())
            read = {} if collector is None else dict(zip(readouts, collector.collect(
                [Finished(rid, items, list(outputs[i].prompt_token_ids or []),
                          list(outputs[i].outputs[0].token_ids))
                 for i, (rid, items) in readouts.items()], left()), strict=True))
        except BaseException:
            poller.stop()
            if collector is not None:
                collector.discard([rid for rid, _ in readouts.values()])
            raise
        receipts = poller.wait(left())
        results = []
        for i, (out, cid, spec) in enumerate(zip(outputs, capture_ids, specs, strict=True)):
            completion = out.outputs[0]
            if cid in captures and spec is not None:
                captures[cid] = _final_positions(
                    captures[cid], spec, len(out.prompt_token_ids or []),
                    len(completion.token_ids))
            results.append(Result(
                token_ids=list(completion.token_ids), text=completion.text,
                prompt_token_ids=list(out.prompt_token_ids or []), capture_id=cid,
                captures=captures.get(cid) if cid else None,
                logprobs=_logprob_steps(completion.logprobs),
                prompt_logprobs=_logprob_steps(out.prompt_logprobs),
                num_cached_tokens=int(out.num_cached_tokens or 0),
                receipt=receipts.get(cid) if cid else None,
                readout_results=read.get(i)))
        return results

    def _run_reporting_ends(self, prompts: list[dict[str, Any]], params: list[Any],
                            awaited: dict[int, str]) -> list[Any]:
        """`LLM.generate`'s loop, except that a durable capture's end (its output length)
        reaches the workers in the step its request finishes, so each capture publishes
        while the rest of the batch runs (reported after `generate` returned, every
        capture of a batch waited for the batch's last request, then published at once)."""
        from vllm.sampling_params import RequestOutputKind

        engine = self.llm.llm_engine
        tag = uuid.uuid4().hex[:12]
        index: dict[str, int] = {}
        outputs: list[Any] = [None] * len(prompts)
        left = len(prompts)
        try:
            for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
                sp.output_kind = RequestOutputKind.FINAL_ONLY  # as LLM.generate sets it
                request_id = f"capsteer-{tag}-{i}"
                engine.add_request(request_id, prompt, sp)
                index[request_id] = i
            while left and engine.has_unfinished_requests():
                ends = []
                for out in engine.step():
                    i = index.get(out.request_id)
                    if i is None or not out.finished:
                        continue
                    outputs[i] = out
                    left -= 1
                    if i in awaited:
                        ends.append((awaited[i], len(out.outputs[0].token_ids)))
                if ends:
                    self.llm.collective_rpc(RPC_END_CAPTURES, args=(ends,))
        except BaseException:
            unfinished = [rid for rid, i in index.items() if outputs[i] is None]
            if unfinished:
                engine.abort_request(unfinished)
            raise
        if left:
            raise RuntimeError(f"capsteer: {left} requests ended without an output")
        return outputs

    def _collect(self, capture_ids: list[str], timeout: float) -> dict[str, CapturedActivations]:
        """Captures close one engine step after their request finishes: poll until all are in.

        Under pipeline parallelism every stage returns its own layers' part of a capture;
        a capture is complete with one part per stage."""
        parts: dict[str, list[CapturedActivations]] = {}
        found: dict[str, CapturedActivations] = {}
        deadline = time.monotonic() + timeout
        while len(found) < len(capture_ids):
            missing = [c for c in capture_ids if c not in found]
            for per_worker in self.llm.collective_rpc(RPC_TAKE_CAPTURES, args=(missing,)):
                for cid, blob in per_worker.items():
                    parts.setdefault(cid, []).append(CapturedActivations.from_wire(blob))
            for cid in missing:
                if len(parts.get(cid, ())) >= self.num_stages:
                    found[cid] = merge_stages(parts.pop(cid))
            if len(found) < len(capture_ids):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"captures not finished: {sorted(set(missing) - set(found))}")
                time.sleep(0.01)
        return found
