"""A worker's state: its engine (once loaded), drain, in-flight requests, metrics."""
from __future__ import annotations

import asyncio
import base64
import dataclasses
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loraplex.engine.client import EngineClient
from loraplex.engine.errors import EngineDeadError, EngineOverloadedError
from loraplex.engine.request import AdapterRef

from loraplex.platform.errors import ShuttingDownError
from loraplex.platform.observability.tracing import Tracing, TracingConfig
from loraplex.platform.routing.view import WorkerStats
from loraplex.platform.metrics import Metrics
from loraplex.platform.tenancy.throttle import FailureThrottle
from loraplex.platform.worker.config import WorkerConfig

if TYPE_CHECKING:
    from loraplex.adapters.sources import BlobAdapterSource
    from loraplex.platform.worker.stream import Relay
    from loraplex.platform.fleet.wire import GenerateRequest

# Files a gateway needs to rebuild the tokenizer and chat template (`Tokenizer(folder)`).
TOKENIZER_GLOBS = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "chat_template*", "vocab.json",
                   "merges.txt", "config.json", "generation_config.json")


class WorkerState:
    """Everything the routes share. The engine arrives once loaded (`attach`); until then
    the worker is alive (/health) but not ready, and refuses work with 503."""

    def __init__(self, config: WorkerConfig, model_name: str, tracing: Tracing | None = None) -> None:
        self.config = config
        self.tracing = tracing or Tracing(TracingConfig())  # off: one shared no-op span per request
        self.token = config.token  # the shared secret, read once
        self.auth_throttle = FailureThrottle()  # wrong tokens, per caller address
        self.model_name = model_name
        self.engine: EngineClient | None = None
        self.source: BlobAdapterSource | None = None
        self.metrics: Metrics | None = None
        self.model_info: dict[str, Any] = {}
        self.draining = False
        self.in_flight = 0
        self.relays: dict[str, Relay] = {}
        self._prefix_keys: OrderedDict[str, None] = OrderedDict()
        self._idle = asyncio.Event()
        self._idle.set()

    def attach(self, engine: EngineClient, source: BlobAdapterSource | None) -> None:
        info = engine.model_info()
        self.metrics = Metrics(self.model_name, engine.stats, info.max_loras, residency=engine.adapter_residency)
        self.model_info = {"model": self.model_name, "max_model_len": info.max_model_len,
                           "vocab_size": info.vocab_size, "eos_token_ids": list(info.eos_token_ids),
                           "tokenizer_files": tokenizer_files(info.model_dir)}
        self.source = source
        self.engine = engine  # last: the routes take a set engine to mean "ready"

    # -- admission -------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.engine is not None and self.engine.is_running and not self.draining

    def running_engine(self) -> EngineClient:
        if self.engine is None:
            raise EngineOverloadedError("the worker is still loading its model")
        if not self.engine.is_running:
            raise EngineDeadError("the engine is not running")
        return self.engine

    def check_admitting(self) -> EngineClient:
        if self.draining:
            raise ShuttingDownError("the worker is draining; send the request to another worker")
        return self.running_engine()

    def begin(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def end(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def drained(self) -> None:
        """Returns once no request is in flight (the caller stopped admitting)."""
        await self._idle.wait()

    # -- adapters --------------------------------------------------------------------
    async def ensure_adapter(self, ref: AdapterRef | None) -> None:
        """Bring the request's adapter version into the CPU tier (fetched from the store on
        first use, off the engine thread); refusals happen here, before any output."""
        if ref is None:
            return
        await self.running_engine().prefetch_adapter(ref)
        if self.metrics is not None:
            self.metrics.adapter_named(ref.name, ref.digest)

    def unload(self, digest: str) -> None:
        """Drop a version's CPU-tier copy and local cache, unless a request still holds it."""
        if self.running_engine().drop_adapter(digest) and self.source is not None:
            self.source.evict(digest)

    # -- stats -----------------------------------------------------------------------
    def served_prefix(self, req: GenerateRequest) -> None:
        """Remember the request's prefix key for routers: the key they computed for it."""
        key = req.prefix_key
        if key is None:
            return
        self._prefix_keys[key] = None
        self._prefix_keys.move_to_end(key)
        while len(self._prefix_keys) > self.config.prefix_keys:
            self._prefix_keys.popitem(last=False)

    def stats(self) -> WorkerStats:
        if self.engine is None:
            return WorkerStats(ready=False, draining=self.draining)
        # Residency read now: a load finishes on the loader thread, between snapshots.
        stats = dataclasses.replace(self.engine.stats(), adapters=self.engine.adapter_residency())
        return WorkerStats.from_engine(stats, ready=self.ready, draining=self.draining,
                                       prefix_keys=tuple(self._prefix_keys))


def tokenizer_files(model_dir: Path) -> dict[str, str]:
    """{file name: base64 of its bytes} for the tokenizer files in `model_dir`."""
    files = sorted({p for g in TOKENIZER_GLOBS for p in Path(model_dir).glob(g) if p.is_file()})
    return {p.name: base64.b64encode(p.read_bytes()).decode() for p in files}
