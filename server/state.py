"""The capsteer part of one API process: settings, model shape, registries, trackers."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from capsteer.capture.spec import SpecError, parse_capture_shorthand, parse_capture_spec
from capsteer.config.server import ENV_VAR, ServerSettings
from capsteer.engine_ext.vllm.serve import api_keys, app_engine_client, served_tokenizer
from capsteer.engine_ext.vllm.topology import ServedModel, Topology, served_model, served_topology
from capsteer.server.engine_link import EngineLink
from capsteer.server.fields import ModelShape
from capsteer.server.patch_sources import CaptureSources
from capsteer.server.peers import PeerBoard
from capsteer.server.prompt_tokens import PromptCounter
from capsteer.server.tracker import CaptureTracker
from capsteer.steering.readers.registry import ReaderRegistry
from capsteer.steering.readers.results import ResultsHub
from capsteer.steering.registry import VectorRegistry
from capsteer.steering.spec import VectorLookup

log = logging.getLogger("vllm.capsteer.server")


@dataclass
class CapsteerState:
    settings: ServerSettings
    model: ServedModel
    shape: ModelShape
    registry: VectorRegistry
    tracker: CaptureTracker
    link: EngineLink
    api_keys: list[str]
    global_capture: dict | None = None  # the capture object every request without one gets
    topology: Topology | None = None
    prompt_counter: PromptCounter | None = None  # the reject policy's exact prompt lengths
    readers: ReaderRegistry | None = None  # probes and SAEs under --readers-dir
    # Under `capsteer serve` the workers read --steering-dir too (its worker_config), so a
    # request names its registry vectors instead of carrying their floats to every worker.
    by_reference: bool = False
    patch_sources: CaptureSources | None = None  # the captures `op: patch` items read
    _readout_hub: ResultsHub | None = field(default=None, repr=False)

    def readout_hub(self) -> ResultsHub:
        """This process's reader of the workers' readout results (made at the first
        readout, inside the server's event loop)."""
        if self._readout_hub is None:
            self._readout_hub = ResultsHub(self.settings.readout_dir)
        return self._readout_hub

    @property
    def vector_lookup(self) -> VectorLookup:
        return self.registry.lookup_named if self.by_reference else self.registry.lookup

    @classmethod
    def create(cls, app: object, settings: ServerSettings) -> CapsteerState:
        engine = app_engine_client(app)
        topology = served_topology(engine)  # refuses DP layouts capsteer cannot serve
        model = served_model(engine)
        itemsize = torch.empty((), dtype=model.dtype).element_size()
        shape = ModelShape(model.num_layers, model.hidden_size, model.max_model_len, itemsize,
                           dict(model.unavailable), dict(model.hook_widths))
        Path(settings.capture_dir).mkdir(parents=True, exist_ok=True)
        # Named vectors and readers are as wide as any hook the model has (mlp_post: d_mlp).
        registry = VectorRegistry(settings.steering_dir, hidden_size=model.hidden_size,
                                  num_layers=model.num_layers, hook_widths=shape.hook_widths,
                                  unavailable=shape.unavailable)
        readers = ReaderRegistry(settings.readers_dir, hidden_size=model.hidden_size,
                                 hook_widths=shape.hook_widths, unavailable=shape.unavailable)
        global_capture = None
        if getattr(settings, "global_capture", None):
            global_capture = parse_capture_shorthand(settings.global_capture)
            try:  # refuse to start on a spec every request would fail
                parse_capture_spec(global_capture, num_layers=model.num_layers,
                                   unavailable=model.unavailable)
            except SpecError as exc:
                raise ValueError(f"capsteer: --global-capture {settings.global_capture!r}: "
                                 f"{exc}") from None
        peers = PeerBoard.from_env() if topology.api_servers > 1 else None
        if topology.api_servers > 1 and peers is None:
            log.warning("capsteer: %d API server processes but no shared runtime directory "
                        "(start with `capsteer serve`); a receipt lookup reaching another "
                        "process answers 404 until the capture is durable",
                        topology.api_servers)
        tracker = CaptureTracker(settings.capture_dir, admission_budget(settings, topology),
                                 peers=peers, model=model.name)
        link = EngineLink(engine, tracker.settle_unreached, tracker.untrack,
                          on_end=tracker.note_end)
        tracker.ask_unwritten = link.unwritten_receipts
        counter = None
        if settings.capture_overload == "reject":
            counter = prompt_counter(served_tokenizer(app, engine))
        return cls(settings, model, shape, registry, tracker, link,
                   api_keys(app), global_capture, topology, counter, readers,
                   by_reference=bool(os.environ.get(ENV_VAR)),
                   patch_sources=CaptureSources(settings.capture_dir, tracker, model.name))


def prompt_counter(source: object) -> PromptCounter | None:
    """The served tokenizer, for reservations as large as the prompt really is; None (the
    byte bound) where it cannot be loaded."""
    if source is None:
        return None
    try:
        return PromptCounter(source)
    except Exception as exc:
        log.warning("capsteer: cannot load the tokenizer to count prompts (%r); the reject "
                    "policy reserves a byte-count bound instead", exc)
        return None


def admission_budget(settings: ServerSettings, topology: Topology) -> int:
    """This API server's share of what the reject policy admits in flight.

    `--capture-budget` is what each engine's capture writer may hold, so the deployment
    holds `budget x DP size`; the API servers admit that total in equal shares (one
    budget each with vLLM's default of one API server per DP engine)."""
    total = settings.capture_budget * topology.data_parallel_size
    return max(total // topology.api_servers, 1)
