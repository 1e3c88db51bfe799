"""The worker's HTTP routes (platform/fleet/WIRE.md): /internal/v1/* and /metrics behind the shared
secret, probes open."""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
from collections.abc import Awaitable, Callable

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from loraplex.engine.errors import InvalidRequestError

from loraplex.platform.errors import AuthenticationError, RateLimitedError
from loraplex.platform.http import ClientDisconnected, json_body, json_response, unless_disconnected, wait_disconnect
from loraplex.platform.serving.gaie import FAIRNESS_HEADER, OBJECTIVE_HEADER, fairness_key, lower_lane, objective_lane
from loraplex.platform.metrics import CONTENT_TYPE
from loraplex.platform.tenancy.throttle import client_address
from loraplex.platform.fleet.wire import STATS_HEADER, GenerateRequest, adapter_from_json
from loraplex.platform.worker.state import WorkerState
from loraplex.platform.worker.stream import NdjsonResponse, Relay

Handler = Callable[[Request], Awaitable[Response]]


def _state(request: Request) -> WorkerState:
    return request.app.state.worker


def _authorize(request: Request) -> None:
    """Only callers holding the shared secret (constant-time compare); none set: loopback.
    A wrong token spends its address's allowance: past the burst it is answered 429 with
    Retry-After, not 401. The right token is never refused, whatever its address sent."""
    state = _state(request)
    if state.token is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), state.token.encode()):
        return
    client = client_address(request)
    if client is not None:
        wait = state.auth_throttle.retry_after(client)
        state.auth_throttle.failed(client)
        if wait > 0:
            raise RateLimitedError("too many wrong internal tokens from this address", wait)
    raise AuthenticationError("missing or wrong internal token")


def internal(handler: Handler) -> Handler:
    """`handler` behind the shared secret (`_authorize`)."""

    @functools.wraps(handler)
    async def checked(request: Request) -> Response:
        _authorize(request)
        return await handler(request)

    return checked


@internal
async def generate(request: Request) -> Response:
    state = _state(request)
    req = _with_gaie_headers(GenerateRequest.from_json(await json_body(request)), request)
    engine = state.check_admitting()
    if req.request_id in state.relays:
        raise InvalidRequestError(f"request id {req.request_id!r} is already in use")
    relay = Relay(state, req)
    watcher = asyncio.ensure_future(wait_disconnect(request.receive))

    async def admit() -> list:
        state.relays[req.request_id] = relay  # abortable (and its id taken) from here on
        await state.ensure_adapter(req.adapter)  # may fetch it from the store (first use)
        relay.start(engine)
        first = await relay.take()
        if relay.done and relay.error is not None and not first:
            raise relay.error  # refused before any output: a plain HTTP error, retryable elsewhere
        return first

    state.begin()
    try:
        first = await unless_disconnected(admit(), watcher)
    except BaseException as exc:
        watcher.cancel()
        relay.cancel()
        if state.relays.get(req.request_id) is relay:
            del state.relays[req.request_id]
        state.end()
        if isinstance(exc, ClientDisconnected):
            return Response(status_code=499)  # nobody reads it
        raise
    state.served_prefix(req)
    headers = {STATS_HEADER: orjson.dumps(state.stats().to_json()).decode()}
    return NdjsonResponse(state, relay, first, watcher, headers)


def _with_gaie_headers(req: GenerateRequest, request: Request) -> GenerateRequest:
    """A request that names no tenant (a worker reached directly) is scheduled fairly by
    its GAIE fairness id; a GAIE objective may lower its lane, never raise it."""
    tenant = req.tenant or fairness_key(request.headers.get(FAIRNESS_HEADER)) or ""
    lane = lower_lane(req.lane, objective_lane(request.headers.get(OBJECTIVE_HEADER), {}))
    return dataclasses.replace(req, tenant=tenant, lane=lane) if (tenant, lane) != (req.tenant, req.lane) else req


@internal
async def abort(request: Request) -> Response:
    state = _state(request)
    doc = await json_body(request)
    rid = doc.get("request_id") if isinstance(doc, dict) else None
    if not isinstance(rid, str):
        raise InvalidRequestError("the body must be {\"request_id\": str}")
    relay = state.relays.get(rid)
    if relay is not None:
        relay.abort()
    elif state.engine is not None:
        state.engine.abort(rid)
    return Response(status_code=204)


@internal
async def stats(request: Request) -> Response:
    return json_response(_state(request).stats().to_json())


@internal
async def model(request: Request) -> Response:
    state = _state(request)
    state.running_engine()
    return json_response(state.model_info)


@internal
async def load_adapter(request: Request) -> Response:
    state = _state(request)
    ref = adapter_from_json(await json_body(request))
    if ref is None:
        raise InvalidRequestError("the body must be {\"name\": str, \"digest\": \"sha256:...\"}")
    await state.ensure_adapter(ref)
    return json_response({"name": ref.name, "digest": ref.digest, "resident": "cpu"})


@internal
async def unload_adapter(request: Request) -> Response:
    _state(request).unload(request.path_params["digest"])
    return Response(status_code=204)


async def health(request: Request) -> Response:
    """Liveness: the process lives (also while the model loads) and its engine loop runs."""
    engine = _state(request).engine
    if engine is not None and not engine.is_running:
        return json_response({"status": "engine stopped"}, 503)
    return json_response({"status": "ok"})


async def ready(request: Request) -> Response:
    state = _state(request)
    if state.ready:
        return json_response({"status": "ready", "model": state.model_name})
    why = "draining" if state.draining else "loading" if state.engine is None else "engine stopped"
    return json_response({"status": "not ready", "problems": [why]}, 503)


@internal  # the series name adapters: Prometheus sends the token (the chart's ServiceMonitor does)
async def metrics(request: Request) -> Response:
    m = _state(request).metrics
    return Response(m.render() if m is not None else b"", media_type=CONTENT_TYPE)


def metrics_routes() -> list[Route]:
    """`/metrics` alone: a listener of its own (`WorkerConfig.metrics_port`) serves it."""
    return [Route("/metrics", metrics, methods=["GET"])]


def worker_routes(*, with_metrics: bool = True) -> list[Route]:
    """Every route; `with_metrics=False` leaves `/metrics` to a listener of its own."""
    return [
        Route("/internal/v1/generate", generate, methods=["POST"]),
        Route("/internal/v1/abort", abort, methods=["POST"]),
        Route("/internal/v1/stats", stats, methods=["GET"]),
        Route("/internal/v1/model", model, methods=["GET"]),
        Route("/internal/v1/adapters/load", load_adapter, methods=["POST"]),
        Route("/internal/v1/adapters/{digest}", unload_adapter, methods=["DELETE"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        *(metrics_routes() if with_metrics else []),
    ]
