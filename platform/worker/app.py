"""The worker's Starlette app: routes, the one error mapping, the engine's lifetime."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response

from loraplex.adapters.errors import AdapterError
from loraplex.adapters.sources import BlobAdapterSource
from loraplex.engine.client import EngineClient
from loraplex.engine.errors import EngineError

from loraplex.platform.errors import PlatformError, RateLimitedError, api_error
from loraplex.platform.observability.request_id import RequestIdMiddleware
from loraplex.platform.observability.tracing import TraceContextMiddleware
from loraplex.platform.fleet.errors import error_status
from loraplex.platform.http import json_response
from loraplex.platform.worker.routes import metrics_routes, worker_routes
from loraplex.platform.worker.state import WorkerState
from loraplex.engine.threads import use_serial_default_executor
from loraplex.platform.heap import freeze_startup_heap

log = logging.getLogger(__name__)

Loader = Callable[[], tuple[EngineClient, "BlobAdapterSource | None"]]


async def _error(request: Request, exc: Exception) -> Response:
    """Every error leaves as platform/fleet/WIRE.md's body; an unexpected one (which Starlette then logs
    with its traceback) says nothing of internals."""
    status, body = error_status(exc)
    response = json_response(body, status)
    if isinstance(exc, RateLimitedError):
        response.headers.update(api_error(exc).headers)  # Retry-After
    return response


_HANDLERS = {EngineError: _error, AdapterError: _error, PlatformError: _error, HTTPException: _error,
             Exception: _error}


def create_worker_app(state: WorkerState, *, loader: Loader | None = None,
                      on_load_failure: Callable[[BaseException], None] | None = None,
                      with_metrics: bool = True) -> Starlette:
    """The worker app over `state`. With `loader`, the engine loads in a thread after the
    server starts (/health answers meanwhile, /ready says 503) and shuts down at exit
    (with the tracer); without one, `state` already holds an engine, which stays the
    caller's (and so does its tracer). `with_metrics=False`: no `/metrics` here, a
    `create_metrics_app` listener serves it."""

    @asynccontextmanager
    async def lifespan(app: Starlette):
        task = asyncio.ensure_future(_load(state, loader, on_load_failure)) if loader is not None else None
        try:
            yield
        finally:
            state.draining = True
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                if state.engine is not None:
                    await asyncio.to_thread(state.engine.shutdown)
                await asyncio.to_thread(state.tracing.shutdown)  # exports the spans still buffered

    middleware = [Middleware(RequestIdMiddleware)]  # the gateway's x-request-id
    if state.tracing.enabled:
        middleware.append(Middleware(TraceContextMiddleware))  # its traceparent: the spans' parent
    app = Starlette(routes=worker_routes(with_metrics=with_metrics), lifespan=lifespan,
                    exception_handlers=_HANDLERS, middleware=middleware)
    app.state.worker = state
    return app


def create_metrics_app(state: WorkerState) -> Starlette:
    """`/metrics` of `state` alone, for a listener of its own: behind the internal token
    and answering errors exactly as on the main port."""
    app = Starlette(routes=metrics_routes(), exception_handlers=_HANDLERS)
    app.state.worker = state
    return app


async def _load(state: WorkerState, loader: Loader, on_failure: Callable[[BaseException], None] | None) -> None:
    use_serial_default_executor()
    try:
        engine, source = await asyncio.to_thread(loader)
    except Exception as exc:  # noqa: BLE001 - reported, and the process exits
        log.error("loading the model failed: %s", exc)
        if on_failure is not None:
            on_failure(exc)
        return
    state.attach(engine, source)
    await asyncio.to_thread(freeze_startup_heap)
    log.info("worker ready: %s", state.model_name)
