"""The Starlette application factory."""
from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Mount, Route

from loraplex.engine.client import EngineClient

from loraplex.platform.admin.routes import AdminState, admin_routes, openapi
from loraplex.platform.admin.vllm_lora import vllm_lora_routes
from loraplex.platform.serving.auth import Authenticator
from loraplex.platform.db.database import Database
from loraplex.platform.assembly.engine_factory import build_engine
from loraplex.platform.assembly.usage_hooks import UsageHooks
from loraplex.platform.errors import ERRORS, api_error, error_response
from loraplex.platform.http import json_response
from loraplex.platform.serving.gateway import Gateway
from loraplex.platform.serving.hooks import Hooks
from loraplex.platform.metrics import CONTENT_TYPE, Metrics
from loraplex.platform.serving.openai_routes import openai_routes
from loraplex.platform.serving.openapi import openai_openapi
from loraplex.platform.serving.refusals import RefusalHold
from loraplex.platform.serving.parse_pool import ParsePool
from loraplex.platform.serving.tokenize_routes import tokenize_routes
from loraplex.platform.settings import Settings
from loraplex.platform.tenancy.throttle import ThrottleConfig
from loraplex.platform.observability.request_id import RequestIdMiddleware
from loraplex.platform.observability.tracing import TraceContextMiddleware, Tracing, TracingConfig

log = logging.getLogger(__name__)


async def health(request: Request) -> Response:
    """Liveness: the process and its engine loop are alive."""
    gw: Gateway = request.app.state.gateway
    ok = gw.engine.is_running
    return json_response({"status": "ok" if ok else "engine stopped"}, 200 if ok else 503)


async def ready(request: Request) -> Response:
    """Readiness: serving (not draining), engine alive, database reachable."""
    gw: Gateway = request.app.state.gateway
    problems = []
    if gw.draining:
        problems.append("shutting down")
    if not gw.engine.is_running:
        problems.append("engine stopped")
    try:
        await asyncio.wait_for(gw.auth.ping(), timeout=2.0)  # its own thread: never queued behind others
    except Exception as exc:  # noqa: BLE001 - any failure means not ready
        problems.append(f"database unreachable: {type(exc).__name__}")
    if problems:
        return json_response({"status": "not ready", "problems": problems}, 503)
    return json_response({"status": "ready", "model": gw.model_name})


async def metrics(request: Request) -> Response:
    return Response(request.app.state.gateway.metrics.render(), media_type=CONTENT_TYPE)


async def openai_document(request: Request) -> Response:
    return json_response(request.app.state.openai_openapi)


async def _domain_error(request: Request, exc: Exception) -> Response:
    """Renders a domain error as OpenAI's error body; Starlette picks this handler by the
    exception's class hierarchy. An OpenAI endpoint's answer is counted in the metrics."""
    resp = error_response(api_error(exc))
    endpoint = getattr(request.state, "api_endpoint", None)
    if endpoint is not None:
        request.app.state.gateway.metrics.api_request(endpoint, resp.status_code)
    return resp


def _routes(settings: Settings) -> list:
    return [
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        # With a metrics port of its own (listener.py), /metrics is not on the tenants' port.
        *([Route("/metrics", metrics, methods=["GET"])] if settings.metrics_port is None else []),
        Route("/v1/openapi.json", openai_document, methods=["GET"]),
        *vllm_lora_routes(),  # vLLM's /v1/load_lora_adapter, /v1/unload_lora_adapter (admin token)
        Mount("/v1", routes=openai_routes()),
        Mount("/adapters/{adapter}/v1", routes=openai_routes()),
        *tokenize_routes(),  # vLLM's /tokenize and /detokenize
        Mount("/adapters/{adapter}", routes=tokenize_routes()),
        *admin_routes(),  # /admin/api/... (JSON) and /admin/ (the UI)
    ]


def _middleware(settings: Settings) -> list[Middleware]:
    # Every request gets an id (the client's x-request-id when sane): in the response
    # headers, error bodies, log lines, traces and its usage event. With tracing on, a
    # client's traceparent makes its trace the parent of the request's spans. A 429 is held
    # a while before it is sent (serving/refusals.py).
    middleware = [Middleware(RequestIdMiddleware), Middleware(RefusalHold, hold=settings.limits.refusal_hold)]
    if settings.otlp_endpoint:
        middleware.append(Middleware(TraceContextMiddleware))
    return middleware


def create_app(settings: Settings, engine: EngineClient | None = None, *, hooks: Hooks | None = None) -> Starlette:
    """The gateway app. With `engine=None` the lifespan builds the engine from settings
    (and shuts it down at exit); an engine passed in stays owned by the caller."""

    @asynccontextmanager
    async def lifespan(app: Starlette):
        eng = engine if engine is not None else await asyncio.to_thread(build_engine, settings)
        await eng.start()  # a remote client's connections and health poller live in this loop
        db = Database(settings.db_url)
        a = settings.auth
        auth = Authenticator(db, a.cache_ttl, a.negative_ttl, a.last_used_flush_seconds,
                             ThrottleConfig(a.failure_burst, a.failure_rate))
        m = Metrics(settings.model_name, eng.stats, settings.engine.lora.max_loras, residency=eng.adapter_residency)
        # No hooks passed in: quotas and metering (assembly/usage_hooks.py).
        usage = app.state.usage = UsageHooks(settings) if hooks is None else hooks
        await usage.start()
        usage.register_metrics(m.registry)
        tracing = Tracing(TracingConfig(otlp_endpoint=settings.otlp_endpoint, service_name=settings.service_name))
        gw = app.state.gateway = Gateway(settings, eng, auth, m, usage, tracing)
        app.state.parse_pool = ParsePool()  # tokenizing and chat templates, off the event loop
        app.state.admin = AdminState.create(settings, db, gw)
        app.state.admin.start()  # periodic collection of unreferenced adapter blobs
        auth.start()
        try:
            yield
        finally:
            gw.draining = True
            await app.state.admin.close()  # the audit rows of failed sign-ins still being counted
            try:
                await usage.close()  # finishes what is still open, flushes the usage writer
            except Exception:  # noqa: BLE001 - must not block shutdown
                log.exception("closing quotas/metering failed")
            try:
                await auth.close()
            except Exception:  # noqa: BLE001 - a DB hiccup at exit must not block shutdown
                log.exception("final last_used flush failed")
            app.state.parse_pool.close()
            gw.close()
            if engine is None:
                await asyncio.to_thread(eng.shutdown)
            await eng.aclose()
            db.dispose()
            await asyncio.to_thread(tracing.shutdown)  # exports the spans still buffered

    app = Starlette(routes=_routes(settings), lifespan=lifespan, exception_handlers=dict.fromkeys(ERRORS, _domain_error),
                    middleware=_middleware(settings))
    app.state.admin_openapi = openapi()
    app.state.openai_openapi = openai_openapi(settings.limits)
    return app
