"""Running a worker: build the engine, serve, drain on SIGTERM, exit 0."""
from __future__ import annotations

import asyncio
import logging
import signal

import uvicorn

from loraplex.adapters.sources import BlobAdapterSource, open_source
from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.engine import LLMEngine
from loraplex.engine.checkpoint import resolve_model_dir
from loraplex.engine.lora import LoRAManager

from loraplex.platform.observability.tracing import Tracing, TracingConfig
from loraplex.platform.settings import Settings
from loraplex.platform.side_server import serve_beside, side_config
from loraplex.platform.worker.app import create_metrics_app, create_worker_app
from loraplex.platform.worker.config import WorkerConfig
from loraplex.platform.worker.state import WorkerState

log = logging.getLogger("loraplex.worker")


def build_worker_engine(settings: Settings, config: WorkerConfig) -> tuple[AsyncEngine, BlobAdapterSource]:
    """The engine over the shared adapter store (fetched by digest, cached in config.cache_dir)."""
    def build() -> LLMEngine:  # on the engine thread, the one thread that runs the model (async_engine.py)
        model_dir = resolve_model_dir(settings.engine.model.model)  # converting a checkpoint runs tensors
        source = open_source(config.adapter_store, model_dir, config.cache_dir, settings.engine.lora.max_lora_rank,
                             config.s3_endpoint_url, cache_max_bytes=config.cache_max_bytes)
        engine = LLMEngine(settings.engine, lora_manager=LoRAManager(source, settings.engine.lora))
        engine.report_prefill = True  # the gateway bills the prompt tokens of a request aborted mid-prefill
        log.info("engine warmed up for every batch width in %.1f s", engine.warm_up())
        return engine

    engine = AsyncEngine(build)
    return engine, engine.engine.lora.store


class DrainingServer(uvicorn.Server):
    """uvicorn, except that the first SIGTERM drains: the worker reports not ready and
    refuses new requests (503) while it still answers, finishes what runs, then exits."""

    def __init__(self, config: uvicorn.Config, state: WorkerState, drain_timeout_s: float,
                 metrics: uvicorn.Config | None = None) -> None:
        super().__init__(config)
        self.state = state
        self.drain_timeout_s = drain_timeout_s
        self.metrics = metrics  # /metrics on a listener of its own, up while this one is
        self.failed = False
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        await serve_beside(super().serve(sockets), self.metrics)

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if sig == signal.SIGTERM and not self.state.draining and self._loop is not None:
            self.state.draining = True  # /ready and new generates answer 503 from now on
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))
            return
        super().handle_exit(sig, frame)

    async def _drain(self) -> None:
        log.info("draining: %d requests in flight", self.state.in_flight)
        try:
            await asyncio.wait_for(self.state.drained(), self.drain_timeout_s)
        except asyncio.TimeoutError:
            log.warning("drain timed out with %d requests in flight", self.state.in_flight)
        self.should_exit = True

    def load_failed(self, exc: BaseException) -> None:
        self.failed = True
        self.should_exit = True


def run_worker(settings: Settings, config: WorkerConfig, *, access_log: bool = False) -> int:
    config.check()
    tracing = Tracing(TracingConfig(otlp_endpoint=settings.otlp_endpoint, service_name="loraplex-worker"))
    state = WorkerState(config, settings.model_name, tracing)
    server: DrainingServer | None = None

    def failed(exc: BaseException) -> None:
        assert server is not None
        server.load_failed(exc)

    side = config.metrics_port is not None
    app = create_worker_app(state, loader=lambda: build_worker_engine(settings, config), on_load_failure=failed,
                            with_metrics=not side)
    # log_config=None: uvicorn's loggers propagate to the one root handler the CLI set
    # (text or JSON lines, each with the request id).
    uv = uvicorn.Config(app, host=config.host, port=config.port, access_log=access_log, log_level="info",
                        timeout_graceful_shutdown=30, log_config=None)
    metrics = side_config(create_metrics_app(state), config.metrics_host, config.metrics_port) if side else None
    server = DrainingServer(uv, state, config.drain_timeout_s, metrics)
    log.info("loraplex worker: internal API at http://%s:%d (model %s)", config.host, config.port,
             settings.engine.model.model)
    if side:
        log.info("loraplex worker: /metrics at http://%s:%d", config.metrics_host, config.metrics_port)
    server.run()
    return 1 if server.failed else 0
